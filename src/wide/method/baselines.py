"""The paper's baselines, built from the same machinery as WIDE (docs/method.md, "Baselines
from the same machinery").

* **Token-level dynamic depth pruning**: one router per layer; a skipped token passes the
  residual stream through the layer (attention and FFN outputs dropped) while its K/V are
  still computed. ``WideConfig`` with one group per module and ``tie_modules=True``.
* **Module skipping**: separate token routers for attention and FFN, one group each.
* **Static width pruning**: the same heads and FFN channels removed for every token, chosen
  from calibration activations in the FLAP / Wanda-sp style. Channel c of a reduction
  projection (``o_proj``, ``down_proj``) scores ``||W[:, c]||_2 * mean_t |x_t,c|`` on
  calibration tokens of the dense model; a group scores the sum over its channels. Groups
  are the same as WIDE's (GQA packs, ``ffn_group_size`` channels), so the methods differ
  only in *when* a group is skipped.

All use FLOP-weighted rates, so "50%" means half of the routable MACs (q+o, gate+up+down)
for every method. Static pruning meets the budget by construction: it removes the
lowest-scoring groups until the removed MACs are as close to the target as the group sizes
allow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..base import arch
from .config import WideConfig
from ..base.arch import KINDS
from .geometry import Geometry, ModelDims, resolve_geometry
from .modeling import wrap
from .sparsity import _summarise
from .state import get_state

METHODS = ("wide", "dynamic_depth", "module_skip", "static_width")
STATIC_FILE = "static_masks.json"
NORMALIZE = ("layer", "module", "none")


def method_config(method: str, model_config, target: float, **overrides) -> WideConfig:
    """The ``WideConfig`` of ``method`` at FLOP-weighted ``target`` for a HF model config.

    ``overrides`` (router rank, temperatures, loss mode, ...) apply to every method, so a
    comparison changes only what distinguishes the methods.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    dims = ModelDims.from_hf_config(model_config)
    kw = dict(target_sparsity=target, **overrides)
    if method in ("dynamic_depth", "module_skip"):
        kw.update(attn_group_size=dims.num_heads, ffn_group_size=dims.intermediate_size)
        kw["tie_modules"] = method == "dynamic_depth"
    elif method == "static_width":
        kw.setdefault("extra", {})["static"] = True
    return WideConfig(**kw)


def dynamic_depth_config(model_config, target: float = 0.5, **kw) -> WideConfig:
    return method_config("dynamic_depth", model_config, target, **kw)


def module_skip_config(model_config, target: float = 0.5, **kw) -> WideConfig:
    return method_config("module_skip", model_config, target, **kw)


# ---------------------------------------------------------------- static width pruning


@torch.no_grad()
def channel_importance(model, batches: Iterable[torch.Tensor]) -> dict:
    """(layer, kind) -> [columns] importance of each input channel of o_proj / down_proj,
    ``||W[:, c]||_2 * mean|x_c|`` over the calibration tokens of the dense model.

    A wrapped model is measured with routing switched off, so the scores never depend on a
    previous mask.
    """
    spec = arch.spec_for(model)
    sums: dict = {}
    count = [0]
    handles = []
    for i, layer in enumerate(arch.decoder_layers(model)):
        for kind in KINDS:
            proj = arch.reduction_projection(layer, spec, kind)

            def hook(mod, args, key=(i, kind)):
                x = args[0].detach().float().abs()
                sums[key] = sums.get(key, 0) + x.reshape(-1, x.shape[-1]).sum(0)
            handles.append(proj.register_forward_pre_hook(hook))
    state = getattr(model, "wide_state", None)
    previous = state.mask_fn if state is not None else None
    if state is not None:
        state.mask_fn = lambda layer, kind, x: None
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for ids in batches:
            model(input_ids=ids.to(device))
            count[0] += ids.numel()
    finally:
        for h in handles:
            h.remove()
        if state is not None:
            state.mask_fn = previous
        model.train(was_training)
    if not count[0]:
        raise ValueError("static pruning needs at least one calibration batch")
    out = {}
    for i, layer in enumerate(arch.decoder_layers(model)):
        for kind in KINDS:
            proj = arch.reduction_projection(layer, spec, kind)
            w = getattr(proj, "get_base_layer", lambda p=proj: p)().weight.float()
            out[(i, kind)] = (w.norm(dim=0) * (sums[(i, kind)] / count[0])).cpu()
    return out


def group_scores(importance: dict, geo: Geometry) -> dict:
    """(layer, kind) -> [groups]: the sum of the group's channel importances."""
    return {(layer, kind): imp.view(geo.groups(kind), geo.columns(kind)).sum(-1)
            for (layer, kind), imp in importance.items()}


def select_groups(scores: dict, geo: Geometry, target: float, normalize: str = "layer") -> dict:
    """Keep masks (layer, kind) -> bool [groups] that remove the least important groups until
    the removed share of routable MACs is as close to ``target`` as the group sizes allow.

    Attention and FFN scores live on different scales, so they are standardised before one
    global ranking: ``"layer"`` (default) z-scores every (layer, module) on its own, as FLAP
    does; ``"module"`` z-scores each module type over all layers; ``"none"`` ranks raw scores.
    Activation magnitudes grow with depth, so the last two strip the first layers bare: on
    SmolLM2-135M at 25% they remove whole early FFNs and reach perplexity 3.6e5 against 268
    for ``"layer"`` (dense 28; 8 held-out windows of 256 tokens).
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target must lie in [0, 1], got {target}")

    def z(v: torch.Tensor) -> torch.Tensor:
        return (v - v.mean()) / v.std().clamp_min(1e-12) if v.numel() > 1 else v - v.mean()

    norm = {}
    if normalize == "layer":
        norm = {k: z(v.float()) for k, v in scores.items()}
    elif normalize == "module":
        for kind in KINDS:
            keys = sorted(k for k in scores if k[1] == kind)
            if keys:
                flat = z(torch.cat([scores[k].float() for k in keys]))
                for k, part in zip(keys, flat.split([scores[k].numel() for k in keys])):
                    norm[k] = part
    else:
        norm = {k: v.float() for k, v in scores.items()}

    items = sorted(((float(s), layer, kind, g) for (layer, kind), v in norm.items() for g, s in enumerate(v.tolist())))
    total = sum(geo.group_macs(kind) for _, _, kind, _ in items)
    goal = target * total
    removed = 0.0
    keep = {k: torch.ones(v.numel(), dtype=torch.bool) for k, v in scores.items()}
    # Walk the ranking once; a group is removed when that brings the removed MACs closer to the
    # goal, so a cheaper lower-ranked group can still fill a gap a costly one would overshoot.
    for _, layer, kind, g in items:
        cost = geo.group_macs(kind)
        if abs(removed + cost - goal) < abs(removed - goal):
            keep[(layer, kind)][g] = False
            removed += cost
    return keep


class StaticPruning:
    """Fixed keep masks; ``apply(model)`` routes every token through them."""

    def __init__(self, keep: dict, target: float, normalize: str = "layer"):
        self.keep = keep
        self.target = target
        self.normalize = normalize

    def rates(self, geo: Geometry) -> dict:
        sums = {k: (torch.tensor(float((~v).sum())), torch.tensor(float(v.numel()))) for k, v in self.keep.items()}
        sp = _summarise(geo, sums)
        return {"flop_rate": float(sp.flop_rate), "group_rate": float(sp.group_rate),
                "attn_rate": None if sp.attn_rate is None else float(sp.attn_rate),
                "ffn_rate": None if sp.ffn_rate is None else float(sp.ffn_rate)}

    def apply(self, model):
        state = get_state(model)
        cache: dict = {}

        def fn(layer, kind, x):
            key = (layer, kind, x.device)
            if key not in cache:
                cache[key] = self.keep[(layer, kind)].to(device=x.device, dtype=torch.float32)
            keep = cache[key]
            return keep.expand(*x.shape[:-1], keep.numel())

        state.mask_fn = fn
        return model

    def to_dict(self) -> dict:
        return {"target": self.target, "normalize": self.normalize,
                "keep": {f"{layer}.{kind}": v.int().tolist() for (layer, kind), v in self.keep.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "StaticPruning":
        keep = {}
        for key, v in d["keep"].items():
            layer, kind = key.split(".")
            keep[(int(layer), kind)] = torch.tensor(v, dtype=torch.bool)
        return cls(keep, d["target"], d.get("normalize", "layer"))

    def save(self, directory) -> None:
        (Path(directory) / STATIC_FILE).write_text(json.dumps(self.to_dict()))


def static_width(model, batches: Iterable[torch.Tensor], target: float = 0.5, *, normalize: str = "layer",
                 config: Optional[WideConfig] = None) -> StaticPruning:
    """Prune ``model`` statically at FLOP-weighted ``target``: wraps it (WIDE's geometry
    unless ``config`` says otherwise) if needed, scores groups on ``batches`` (input_ids
    tensors), installs the fixed masks and returns them."""
    if not hasattr(model, "wide_state"):
        wrap(model, config or method_config("static_width", model.config, target))
    state = get_state(model)
    if state.config.tie_modules:
        raise ValueError("static width pruning needs per-module groups, not tie_modules")
    scores = group_scores(channel_importance(model, batches), state.geometry)
    pruning = StaticPruning(select_groups(scores, state.geometry, target, normalize), target, normalize)
    pruning.apply(model)
    return pruning


def apply_static_file(model, directory) -> Optional[StaticPruning]:
    """Install the static masks saved in ``directory``, if it holds any."""
    path = Path(directory) / STATIC_FILE
    if not path.is_file():
        return None
    pruning = StaticPruning.from_dict(json.loads(path.read_text()))
    geo = get_state(model).geometry
    for (layer, kind), v in pruning.keep.items():
        if layer >= geo.dims.num_layers or v.numel() != geo.groups(kind):
            raise ValueError(f"static masks in {directory} do not fit this model ({layer}.{kind})")
    pruning.apply(model)
    return pruning


def resolve(model_config, config: WideConfig) -> Geometry:
    return resolve_geometry(ModelDims.from_hf_config(model_config), config)


__all__ = ["METHODS", "method_config", "dynamic_depth_config", "module_skip_config", "channel_importance",
           "group_scores", "select_groups", "StaticPruning", "static_width", "apply_static_file", "resolve"]
