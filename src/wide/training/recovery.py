"""Stage 2: LoRA recovery on top of stage-1 routers (the paper's two-stage training; docs/baselines.md).

Adapters are injected in place with PEFT (``inject_adapter_in_model``) rather than through a
``PeftModel`` wrapper, so the wrapped HF model stays the object that owns ``wide_routers``
and ``wide_state`` and every other part of ``wide`` keeps working on it. PEFT swaps
``o_proj`` / ``down_proj`` for ``lora.Linear``; the routing hooks are then moved onto the
new modules (``install_hooks``) so the mask also gates the LoRA branch, not only the base
layer's input.

A recovery directory is a router checkpoint (``routers.safetensors`` + ``wide_config.json``)
plus PEFT's own adapter files (``adapter_model.safetensors`` with PEFT's key layout and
``adapter_config.json``), so ``PeftModel.from_pretrained`` can read the adapters too. The
same files go inside the training checkpoint through ``save_extra``, which keeps one atomic
write per checkpoint.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..base import arch
from ..base.cliargs import check_fields
from ..method.modeling import install_hooks, router_parameters
from ..method.state import get_state
from ..io.serialization import CheckpointError, load, resolve_base_model, save_routers
from .train import TrainArgs, train

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FINAL_DIR = "recovered"
# PeftModel.save_pretrained writes keys relative to the PeftModel, one level above the HF model.
_PEFT_PREFIX = "base_model.model."
# The paper's stage-2 learning rate; stage 1 trains fresh routers at TrainArgs' default.
RECOVERY_LR = 2e-4
# Where stage 2's TrainArgs differ from stage 1's defaults: the paper's rate, and the full target
# from the first step (stage 1's warm-up exists for routers that start dense; these are trained).
RECOVERY_DEFAULTS = {"lr": RECOVERY_LR, "sparsity_warmup": 0.0}


@dataclass
class LoraArgs:
    # The metadata is each field's command-line option (wide.base.cliargs).
    r: int = field(default=16, metadata={"flag": "--lora-r", "help": "LoRA rank", "min": 1})
    alpha: int = field(default=32, metadata={"flag": "--lora-alpha", "help": "LoRA scale numerator (scale = alpha / r)", "gt": 0})
    dropout: float = field(default=0.1, metadata={"flag": "--lora-dropout", "help": "dropout on the LoRA branch", "min": 0, "lt": 1})
    # PEFT target module names; None = every linear projection the model's ArchSpec names.
    targets: Optional[Sequence[str]] = None

    def __post_init__(self):
        check_fields(self)

    def resolved(self, model) -> "LoraArgs":
        """These arguments with ``targets`` filled in from the model's architecture."""
        if self.targets is not None:
            return self
        return replace(self, targets=arch.spec_for(model).lora_targets)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none")


def has_lora(model) -> bool:
    return any("lora_" in n for n, _ in model.named_parameters())


def add_lora(model, lora: Optional[LoraArgs] = None, *, freeze_routers: bool = False,
             freeze_thresholds: bool = False) -> list:
    """Inject LoRA adapters into a wrapped model, in place; returns the parameters to train
    (adapters, plus the routers unless ``freeze_routers``, with learned per-element thresholds
    unless ``freeze_thresholds``: head routers trained beside a set's frozen thresholds keep them).

    PEFT freezes everything that is not an adapter, routers included, so router gradients are
    switched back on here.
    """
    from peft import inject_adapter_in_model

    get_state(model)
    if has_lora(model):
        raise ValueError("model already has LoRA adapters")
    lora = (lora or LoraArgs()).resolved(model)
    cfg = lora.peft_config()
    cfg.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    inject_adapter_in_model(cfg, model)
    install_hooks(model)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    # PEFT gives adapters the base layer's dtype; bf16 adapters would lose most 2e-4 updates.
    for p in adapters:
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    routers = router_parameters(model)  # with learned per-element thresholds (wide.fine), those too
    if freeze_thresholds and model._modules.get("wide_fine") is not None:
        frozen = {id(p) for p in model.wide_fine.learnable()}
        routers = [p for p in routers if id(p) not in frozen]  # PEFT has switched them off already
    for p in routers:
        p.requires_grad_(not freeze_routers)
    return adapters + ([] if freeze_routers else routers)


def adapter_state_dict(model) -> dict:
    from peft import get_peft_model_state_dict

    return {_PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}


def write_adapters(model, directory: Union[str, Path]) -> None:
    """PEFT's adapter files into ``directory`` (which must exist)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    save_file(adapter_state_dict(model), str(directory / ADAPTER_FILE), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(directory))


def read_adapters(model, directory: Union[str, Path]) -> None:
    """Load adapter tensors from ``directory`` into a model that already has adapters of the
    same shape; every adapter tensor must be present."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_FILE
    try:
        sd = load_file(str(path))
    except Exception as e:  # safetensors' error type moved between releases
        raise CheckpointError(f"{path} is missing, corrupt or unreadable: {e}") from e
    sd = {k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k: v for k, v in sd.items()}
    device = next(model.parameters()).device
    res = set_peft_model_state_dict(model, {k: v.to(device) for k, v in sd.items()})
    missing = [k for k in res.missing_keys if "lora_" in k]
    if res.unexpected_keys or missing:
        raise CheckpointError(f"adapters in {directory} do not match the model: "
                              f"unexpected {res.unexpected_keys[:4]}, missing {missing[:4]}")


def lora_args_from_dir(directory: Union[str, Path]) -> LoraArgs:
    cfg = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    return LoraArgs(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg["lora_dropout"],
                    targets=tuple(sorted(cfg["target_modules"])))


def merge(model):
    """Fold the adapters into the base weights and put plain ``nn.Linear`` modules back, so
    the model is an ordinary HF model plus routers (and the routed kernels apply). In place;
    returns the model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    get_state(model)
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.get_base_layer())
            replaced += 1
    if not replaced:
        raise ValueError("model has no LoRA adapters to merge")
    # The PEFT bookkeeping would otherwise make later PEFT calls think adapters are present.
    model.__dict__.pop("peft_config", None)
    install_hooks(model)
    return model


def save_recovered(model, path, *, extra: Optional[dict] = None, write_more=None) -> Path:
    """Routers + adapters (+ whatever ``write_more`` adds) in one atomic directory."""
    def write(tmp: Path) -> None:
        if has_lora(model):
            write_adapters(model, tmp)
        if write_more is not None:
            write_more(tmp)

    return save_routers(model, path, extra=extra, write_more=write)


def load_recovered(base, path, *, merge_adapters: bool = True, check_base: bool = True,
                   require_manifest: bool = True, **hf_kwargs):
    """Base model (a model or a local HF directory) + everything a method directory holds, in
    one call: routers, LoRA adapters if any (merged by default), a static pruning mask if any.

    Works on stage-1 router directories too, so it is the one loader for every method, and on
    the names of shipped routers (wide.pretrained). A base model other than the one the
    routers were trained on (same shape) loads with a warning unless ``check_base=False``; a
    directory without its sha256 manifest is refused unless ``require_manifest=False``.
    """
    from ..io import pretrained
    from ..method.baselines import apply_static_file

    base = pretrained.base_model_for(path, base)
    path = Path(pretrained.resolve(path))
    base = resolve_base_model(path, base, **hf_kwargs)
    load(base, path, check_base=check_base, require_manifest=require_manifest)
    if (path / ADAPTER_FILE).is_file():
        add_lora(base, lora_args_from_dir(path))
        read_adapters(base, path)
        if merge_adapters:
            merge(base)
    apply_static_file(base, path)
    return base.eval()


def recover(model, train_ids: torch.Tensor, args: TrainArgs, out_dir, *, lora: Optional[LoraArgs] = None,
            freeze_routers: bool = False, freeze_thresholds: bool = False, eval_ids: Optional[torch.Tensor] = None, resume: bool = True,
            progress: bool = True, stop_at: Optional[int] = None, extra: Optional[dict] = None,
            write_more=None, dist=None, shard: bool = True, activation_checkpointing: bool = False) -> dict:
    """Stage 2 on a model wrapped with stage-1 routers: add LoRA, train adapters (+ routers)
    with ``wide.training.train.train``, save ``out_dir/recovered`` (routers + adapters, unmerged).

    ``args`` should carry stage 2's rate and no target warm-up (``RECOVERY_DEFAULTS``). The model keeps its
    adapters unmerged on return; call ``merge(model)`` for inference.

    ``dist`` (a ``wide.training.distributed.DistContext``) runs it as one rank of a data-parallel run:
    the backbone is sharded after the adapters are added (unless ``shard=False``), so they stay
    replicated in float32, and only the main rank writes ``out_dir/recovered``.
    """
    if args.sparsity_warmup and not freeze_routers:
        warnings.warn(f"stage 2 with sparsity_warmup={args.sparsity_warmup}: the target starts near 0, so the "
                      "trained routers first drift towards dense; stage 2 usually runs the full target from "
                      "the first step (TrainArgs(**RECOVERY_DEFAULTS), as `wide recover` does)", stacklevel=2)
    lora = (lora or LoraArgs()).resolved(model)
    params = add_lora(model, lora, freeze_routers=freeze_routers, freeze_thresholds=freeze_thresholds)
    if dist is not None and shard:
        dist.shard(model, activation_checkpointing=activation_checkpointing)
    result = train(model, train_ids, args, out_dir, eval_ids=eval_ids, parameters=params, resume=resume,
                   progress=progress, save_extra=lambda d: write_adapters(model, d),
                   load_extra=lambda d: read_adapters(model, d), stop_at=stop_at, dist=dist)
    if result.get("stopped_at") is not None:
        return result
    meta = {"stage": 2, "lora": {**asdict(lora), "targets": list(lora.targets)},
            "freeze_routers": freeze_routers, **({"freeze_thresholds": True} if freeze_thresholds else {}),
            **(extra or {})}
    if dist is None or dist.is_main:
        save_recovered(model, Path(out_dir) / FINAL_DIR, extra=meta, write_more=write_more)
    if dist is not None:
        dist.barrier()
    result["recovered_dir"] = str(Path(out_dir) / FINAL_DIR)
    return result


__all__ = ["LoraArgs", "RECOVERY_LR", "RECOVERY_DEFAULTS", "add_lora", "has_lora", "write_adapters", "read_adapters", "merge",
           "save_recovered", "load_recovered", "recover"]
