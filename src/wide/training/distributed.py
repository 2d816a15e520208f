"""Calibration and recovery on several processes with PyTorch FSDP2 (``fully_shard``).

The one training loop of ``wide.training.train`` runs unchanged in every process; a ``DistContext``
passed to it (``train(..., dist=ctx)``) hands it a :class:`TrainingSession`, which changes
four things:

* data: ``TrainArgs.batch_size`` is the GLOBAL micro-batch; each rank takes its contiguous
  slice of the indices ``batch_indices`` gives, so no sequence is seen twice and the global
  batch does not depend on the number of processes;
* Gumbel noise: drawn per global sample from a generator seeded by (seed, step, micro-batch,
  position in the global batch, layer, module), so a sample gets the same noise whichever
  rank holds it; a run on N processes is the run on one, up to float rounding;
* the sparsity loss: the per-(layer, module) skipped/total sums are all-reduced before the
  rates are formed, so the penalty is that of the global batch, not a mean of per-rank ones;
* checkpoints: ``torch.distributed.checkpoint`` (DCP) for the trainable state and the
  optimizer, keyed by parameter name, so a run saved on N processes resumes on M.

The frozen backbone is sharded with ``fully_shard`` (each decoder layer, then the root). The
trainable parameters (routers, LoRA adapters) are passed as ``ignored_params``: they stay
whole, in float32, on every rank, and their gradients are averaged here with one all-reduce
per optimizer step. They are small (routers of an 8B model: ~4.5M parameters), which keeps
bf16 mixed precision off them without a second FSDP policy, and keeps router/adapter saving,
gradient clipping and the optimizer exactly those of the single-process path.
"""

from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as tdist

from ..base.arch import KINDS, decoder_layers
from ..method.group_rules import group_rule
from ..method.sparsity import _summarise
from ..method.state import get_state

DCP_DIR = "dcp"


def _fsdp():
    """``fully_shard`` moved from ``torch.distributed._composable.fsdp`` to
    ``torch.distributed.fsdp`` in torch 2.6."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


_M64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """Deterministic 63-bit seed from integers (splitmix64 finaliser per value); Python's
    ``hash`` of tuples is not stable across processes for every type, this is."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & _M64)) * 0xBF58476D1CE4E5B9) & _M64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _M64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


@dataclass
class DistContext:
    """Where this process sits. ``DistContext()`` is a one-process run with the distributed
    semantics (global batch slicing, keyed noise, DCP checkpoints) and no process group."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Optional[object] = None  # None = the default process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def collective(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.collective:
            tdist.barrier(group=self.group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.collective:
            tdist.all_reduce(t, group=self.group)
        return t

    def mean(self, value: torch.Tensor) -> float:
        """Mean over ranks of a scalar (equal-sized shards, so the global-batch mean)."""
        t = value.detach().float().reshape(1).to(self.device)
        return float(self.all_reduce_(t)) / self.world_size

    def local_slice(self, global_count: int) -> slice:
        if global_count % self.world_size:
            raise ValueError(f"the global micro-batch ({global_count} sequences, --batch-size) must be divisible "
                             f"by the number of processes ({self.world_size})")
        per = global_count // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def session(self, model, seed: int) -> "TrainingSession":
        """What ``wide.training.train.train(..., dist=self)`` runs its loop with."""
        return TrainingSession(self, model, seed)

    def shard(self, model, **kwargs):
        """:func:`shard_model` over this context's ranks."""
        return shard_model(model, self, **kwargs)


def init(backend: Optional[str] = None, **pg_kwargs) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*) and
    pin this process to its GPU. Outside torchrun (``wide calibrate --fsdp`` on one process)
    the group is this process alone."""
    if not tdist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not pg_kwargs and not under_torchrun():
            # env:// would need MASTER_ADDR and friends; a one-process group needs no rendezvous.
            pg_kwargs = dict(store=tdist.HashStore(), rank=0, world_size=1)
        tdist.init_process_group(backend, **pg_kwargs)
    if tdist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return DistContext(tdist.get_rank(), tdist.get_world_size(), device)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


# ---------------------------------------------------------------- sharding


def trainable_parameters(model) -> list:
    """Routers (all of them, trained or not) and every other parameter that requires grad."""
    seen, out = set(), []
    for p in list(model.wide_routers.parameters()) + [p for p in model.parameters() if p.requires_grad]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def shard_model(model, ctx: DistContext, *, mixed_precision: Optional[bool] = None,
                activation_checkpointing: bool = False, reshard_after_forward: bool = True):
    """``fully_shard`` each decoder layer and the root over all ranks, in place.

    Call after the trainable set is final (``freeze_backbone`` / ``add_lora``): whatever
    requires grad then, and the routers, stay replicated. ``mixed_precision`` (default: on
    CUDA) gathers the backbone in bf16 and reduces in fp32; the replicated parameters keep
    their float32.
    """
    fully_shard, MixedPrecisionPolicy = _fsdp()
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise RuntimeError(f"wide's FSDP2 path needs fully_shard(ignored_params=...), added in torch 2.7; "
                           f"this is torch {torch.__version__}")
    if not tdist.is_initialized():
        raise RuntimeError("shard_model needs a process group: call wide.training.distributed.init() (under torchrun)")
    from torch.distributed.device_mesh import init_device_mesh

    keep = trainable_parameters(model)
    # fully_shard leaves ignored parameters where they are; the routers' offset buffers too.
    for p in keep:
        p.data = p.data.to(ctx.device)
    for b in model.wide_routers.buffers():
        b.data = b.data.to(ctx.device)
    if activation_checkpointing:
        # Non-reentrant: the frozen embeddings give the layers inputs without grad. The
        # recomputed forward re-runs the routing hooks; keyed noise makes it reproduce the masks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if mixed_precision is None:
        mixed_precision = ctx.device.type == "cuda"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision else MixedPrecisionPolicy())
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    ignored = set(keep)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    return model


# ---------------------------------------------------------------- routing noise and loss


class KeyedGumbel:
    """``WideState.mask_fn`` for training: the router's own logits with Gumbel noise keyed
    by the sample's place in the global batch, hard straight-through like
    ``wide.method.routers.gumbel_straight_through``. Outside training it is the inference rule."""

    def __init__(self, model, seed: int):
        self.model = model
        self.seed = seed
        self.key: Optional[tuple] = None  # (step, micro, global offset of this rank's first sample)

    def __call__(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        state = self.model.wide_state
        router = self.model.wide_routers[layer].router(kind)
        rule = group_rule(state.config, kind)
        tau = state.tau
        if tau is None or not router.training or self.key is None:
            return rule.runs(router.margin(x)).float()
        noise = self.noise(rule.noise_shape(tuple(x.shape[:-1]), router.num_groups), layer, kind, x.device)
        return rule.sample(router, x, tau, gumbels=noise)

    def noise(self, shape, layer: int, kind: str, device) -> torch.Tensor:
        step, micro, offset = self.key
        out = []
        for i in range(shape[0]):
            g = torch.Generator(device=device)
            g.manual_seed(mix_seed(self.seed, step, micro, offset + i, layer, KINDS.index(kind)))
            e = torch.empty(shape[1:], device=device, dtype=torch.float32).exponential_(generator=g)
            out.append(-e.log())
        return torch.stack(out)


class TrainingSession:
    """What ``wide.training.train.train`` needs from the distributed side during one call: data and noise
    per rank, the global sparsity loss, gradient averaging and DCP checkpoints."""

    def __init__(self, ctx: DistContext, model, seed: int):
        self.ctx = ctx
        self.model = model
        self.state = get_state(model)
        self.noise = KeyedGumbel(model, seed)
        self._previous_mask_fn = self.state.mask_fn
        # A static mask (baselines) is deterministic: it needs no noise and keeps precedence.
        if self.state.mask_fn is None:
            self.state.mask_fn = self.noise

    def close(self) -> None:
        if self.state.mask_fn is self.noise:
            self.state.mask_fn = self._previous_mask_fn

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def barrier(self) -> None:
        self.ctx.barrier()

    def mean(self, value: torch.Tensor) -> float:
        return self.ctx.mean(value)

    def is_checkpoint(self, path) -> bool:
        return is_dcp_checkpoint(path)

    def save_checkpoint(self, opt, path, *, step: int, trainer_state: dict,
                        write_more: Optional[Callable[[Path], None]] = None) -> None:
        save_checkpoint(self.ctx, self.model, opt, path, step=step, trainer_state=trainer_state,
                        write_more=write_more)

    def load_checkpoint(self, opt, path) -> dict:
        return load_checkpoint(self.ctx, self.model, opt, path)

    def local_indices(self, indices: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        sl = self.ctx.local_slice(len(indices))
        self.noise.key = (step, micro, sl.start)
        return indices[sl]

    def seed_step(self, seed: int, step: int) -> None:
        # Dropout (stage 2) and anything else drawing from the global RNG: a function of the
        # step and rank, so a resumed run on the same world size draws what the full run drew.
        torch.manual_seed(mix_seed(seed, step, self.ctx.rank, 0x5EED))

    def sparsity(self):
        """Differentiable global-batch sparsity of the last forward. Each rank's gradient
        flows through its own sums only; ``penalty_scale`` makes the averaged gradients the
        gradient of the global penalty."""
        sums: dict = {}
        for rec in self.state.records:
            s, t = sums.get((rec.layer, rec.kind), (0.0, 0.0))
            sums[(rec.layer, rec.kind)] = (rec.skipped + s, rec.total + t)
        if self.ctx.collective and sums:
            keys = sorted(sums)
            local = torch.stack([torch.stack([torch.as_tensor(sums[k][0]).float().reshape(()),
                                              torch.as_tensor(sums[k][1]).float().reshape(())]) for k in keys])
            local = local.detach().to(self.ctx.device)
            glob = self.ctx.all_reduce_(local.clone())
            for i, k in enumerate(keys):
                s, _ = sums[k]
                delta = (glob[i, 0] - local[i, 0]).to(s.device)
                sums[k] = (s + delta, glob[i, 1].to(s.device))
        return _summarise(self.state.geometry, sums)

    @property
    def penalty_scale(self) -> float:
        return float(self.ctx.world_size)

    def reduce_gradients(self, params) -> None:
        """Average the replicated parameters' gradients over ranks (one flat all-reduce)."""
        if not self.ctx.collective:
            return
        for p in params:
            if p.grad is None:  # every rank must contribute the same layout
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).float() for p in params]).to(self.ctx.device)
        self.ctx.all_reduce_(flat).div_(self.ctx.world_size)
        i = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[i:i + n].view_as(p.grad).to(p.grad.device, p.grad.dtype))
            i += n


# ---------------------------------------------------------------- checkpoints


def _state_dict_options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # The frozen backbone is the base model's own files; a checkpoint holds what trains.
    # Loading is then non-strict on the model's side (the frozen keys are absent by design);
    # dcp.load itself fails on any trainable key the checkpoint lacks.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save_checkpoint(ctx: DistContext, model, opt, path, *, step: int, trainer_state: dict,
                    write_more: Optional[Callable[[Path], None]] = None) -> None:
    """Every rank writes its part of the DCP checkpoint into a staging directory; after a
    barrier rank 0 adds the router files and trainer state and puts the whole in place with
    ``wide.io.serialization``'s crash-safe protocol (manifest, renames, recovery on resume)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..io.serialization import save_routers
    from .train import TRAINER_STATE

    path = Path(path)
    # Named like atomic_directory's temporaries, so that recovery removes it after a kill.
    staging = path.parent / f".{path.name}.tmp-dcp"
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
    ctx.barrier()
    msd, osd = get_state_dict(model, opt, options=_state_dict_options())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(staging), no_dist=not ctx.collective)
    ctx.barrier()
    if ctx.is_main:
        def write(tmp: Path) -> None:
            os.replace(staging, tmp / DCP_DIR)
            torch.save({**trainer_state, "world_size": ctx.world_size}, tmp / TRAINER_STATE)
            if write_more is not None:
                write_more(tmp)

        save_routers(model, path, extra={"step": step, "world_size": ctx.world_size}, write_more=write)
    ctx.barrier()


def is_dcp_checkpoint(path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def load_checkpoint(ctx: DistContext, model, opt, path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` on any number of processes into the
    model and optimizer; returns the trainer state (step, scheduler, args, history)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .train import TRAINER_STATE

    path = Path(path)
    msd, osd = get_state_dict(model, opt, options=_state_dict_options())
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path / DCP_DIR), no_dist=not ctx.collective)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=_state_dict_options(strict=False))
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)


__all__ = ["DistContext", "init", "shutdown", "under_torchrun", "shard_model", "trainable_parameters",
           "KeyedGumbel", "TrainingSession", "save_checkpoint", "load_checkpoint", "is_dcp_checkpoint", "mix_seed"]
