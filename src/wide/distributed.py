"""Calibration and recovery on several processes with PyTorch FSDP2 (``fully_shard``).

The one training loop of ``wide.train`` runs unchanged in every process; a ``DistContext``
passed to it (or installed by :func:`init`) changes four things:

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

from .arch import decoder_layers
from .modeling import KINDS, ModelDims, _summarise, get_state, resolve_geometry

DCP_DIR = "dcp"
_CURRENT: Optional["DistContext"] = None


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


def init(backend: Optional[str] = None, **pg_kwargs) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
    pin this process to its GPU, and make the context the default of ``wide.train.train``."""
    global _CURRENT
    if not tdist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tdist.init_process_group(backend, **pg_kwargs)
    if tdist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    _CURRENT = DistContext(tdist.get_rank(), tdist.get_world_size(), device)
    return _CURRENT


def current() -> Optional[DistContext]:
    return _CURRENT


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def shutdown() -> None:
    global _CURRENT
    _CURRENT = None
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
        raise RuntimeError("shard_model needs a process group: call wide.distributed.init() (under torchrun)")
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
    ``wide.routers.gumbel_straight_through``. Outside training it is the inference rule."""

    def __init__(self, model, seed: int):
        self.model = model
        self.seed = seed
        self.key: Optional[tuple] = None  # (step, micro, global offset of this rank's first sample)

    def __call__(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        router = self.model.wide_routers[layer].router(kind)
        tau = self.model.wide_state.tau
        if tau is None or not router.training or self.key is None:
            return router.decide(x, None)
        logits = router(x)
        noise = self.noise(logits.shape, layer, kind, logits.device)
        y = ((logits + noise) / tau).softmax(-1)
        hard = torch.zeros_like(y).scatter_(-1, y.argmax(-1, keepdim=True), 1.0)
        return (hard - y.detach() + y)[..., 0]

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
    """What ``wide.train.train`` needs from the distributed side during one call."""

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
    barrier rank 0 adds the router files and trainer state and renames the whole into
    ``path``, so ``path`` always holds one complete checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .serialization import save_routers
    from .train import TRAINER_STATE

    path = Path(path)
    staging = path.parent / f".{path.name}.dcp-staging"
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


# ---------------------------------------------------------------- stage 2


def recover(model, train_ids, args, out_dir, ctx: DistContext, *, lora=None, freeze_routers: bool = False,
            eval_ids=None, resume: bool = True, progress: bool = True, stop_at=None, extra=None,
            write_more=None, mixed_precision: Optional[bool] = None, activation_checkpointing: bool = False,
            shard: bool = True) -> dict:
    """``wide.recovery.recover`` on several processes: adapters are added before sharding
    (so they stay replicated float32), and only rank 0 writes the final directory."""
    from dataclasses import asdict

    from .recovery import FINAL_DIR, LoraArgs, add_lora, read_adapters, save_recovered, write_adapters
    from .train import train

    lora = (lora or LoraArgs()).resolved(model)
    params = add_lora(model, lora, freeze_routers=freeze_routers)
    if shard:
        shard_model(model, ctx, mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing)
    result = train(model, train_ids, args, out_dir, eval_ids=eval_ids, parameters=params, resume=resume,
                   progress=progress and ctx.is_main, save_extra=lambda d: write_adapters(model, d),
                   load_extra=lambda d: read_adapters(model, d), stop_at=stop_at, dist=ctx)
    if result.get("stopped_at") is not None:
        return result
    meta = {"stage": 2, "lora": {**asdict(lora), "targets": list(lora.targets)},
            "freeze_routers": freeze_routers, **(extra or {})}
    if ctx.is_main:
        save_recovered(model, Path(out_dir) / FINAL_DIR, extra=meta, write_more=write_more)
    ctx.barrier()
    result["recovered_dir"] = str(Path(out_dir) / FINAL_DIR)
    return result


# ---------------------------------------------------------------- memory and time estimate


# Dense bf16 tensor-core peaks (FLOP/s), for the time estimate only.
GPU_PEAK = {"h200": 989e12, "h100": 989e12, "a100": 312e12, "l40s": 362e12}


@dataclass
class Estimate:
    rows: list  # (component, GiB per rank, note)
    peak_gib: float
    step_s: float
    total_h: float
    tokens_per_s_per_rank: float
    detail: dict

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'component':<{w}}  {'GiB/rank':>9}  note", "-" * (w + 40)]
        for name, gib, note in self.rows:
            lines.append(f"{name:<{w}}  {gib:>9.2f}  {note}")
        lines.append("-" * (w + 40))
        lines.append(f"{'estimated peak':<{w}}  {self.peak_gib:>9.2f}  torch.cuda.max_memory_allocated")
        d = self.detail
        lines.append(f"time: {d['flops_per_step'] / 1e15:.2f} PFLOP per step at {d['mfu']:.0%} MFU of "
                     f"{d['world_size']} x {d['gpu']} -> {self.step_s:.2f} s/step, "
                     f"{self.tokens_per_s_per_rank:.0f} tokens/s per GPU, {self.total_h:.2f} h for {d['steps']} steps")
        return "\n".join(lines)


def estimate(config, wide_config, *, world_size: int = 1, seq_len: int = 4096, batch_size: int = 1,
             grad_accum: int = 1, steps: int = 10_000, activation_checkpointing: bool = False,
             param_bytes: int = 2, lora_r: int = 0, lora_targets: int = 7, mfu: float = 0.4,
             gpu: str = "h200") -> Estimate:
    """Per-rank memory and step time of stage 1 (or stage 2 with ``lora_r``) under
    ``shard_model``. ``batch_size`` is the global micro-batch, as in TrainArgs.

    Activations count what autograd saves when only the routers (and adapters) train: the
    frozen linears save nothing but their weights, so what remains is the fp32 RMSNorm and
    router inputs, attention's q/k/v/output, the masked o_proj/down_proj inputs and the
    SwiGLU operands; the LM head's logits (bf16, their fp32 copy, log-softmax and its
    gradient) are counted separately, being large for 128k vocabularies.
    """
    dims = ModelDims.from_hf_config(config)
    geo = resolve_geometry(dims, wide_config)
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} is not divisible by world size {world_size}")
    H, L, I, V = dims.hidden_size, dims.num_layers, dims.intermediate_size, dims.vocab_size
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    layer_params = H * (2 * q + 2 * kv) + 3 * H * I + 2 * H
    tied = getattr(config, "tie_word_embeddings", False)
    root_params = V * H * (1 if tied else 2) + H
    total_params = L * layer_params + root_params
    r = wide_config.router_rank
    router_params = 0
    for kind in KINDS:
        routed = wide_config.routes_attention if kind == "attn" else wide_config.routes_ffn
        if wide_config.tie_modules:
            g = 1 if kind == "attn" else 0
        else:
            g = geo.groups(kind) if routed else 0
        if g:
            router_params += L * (H * r + r + r * 2 * g + 2 * g)
    lora_params = 0
    if lora_r:
        shapes = [(H, q), (H, kv), (H, kv), (q, H), (H, I), (H, I), (I, H)][:lora_targets]
        lora_params = L * sum(lora_r * (a + b) for a, b in shapes)
    GiB = 2 ** 30
    ws = world_size
    tokens = batch_size // ws * seq_len  # per rank per micro-batch

    sharded = total_params * param_bytes / ws
    # Root parameters (embeddings, LM head, final norm) stay gathered through the step; the
    # layers are gathered one at a time, with the next one prefetched.
    gathered = (root_params * 2 + 2 * layer_params * 2) if ws > 1 else 0
    trainable = (router_params + lora_params) * 16  # fp32 weight, grad, Adam m and v
    act = 2  # bytes of a bf16 activation
    per_layer_token = (2 * 4 * H  # two RMSNorms save their fp32 input
                       + 2 * 4 * H  # two routers save their fp32 input
                       + act * (2 * q + 2 * kv)  # attention: q, k, v, output
                       + act * q  # masked o_proj input
                       + 4 * act * I)  # silu(gate) input and output, up, masked down_proj input
    if lora_r:
        per_layer_token += act * (3 * H + q + 2 * I) + 4 * lora_r * lora_targets
    if activation_checkpointing:
        saved = L * act * H * tokens + per_layer_token * tokens  # layer inputs + one layer recomputed
    else:
        saved = L * per_layer_token * tokens
    logits = (2 + 4 + 4 + 4) * V * tokens  # bf16 logits, fp32 copy, log-softmax, its gradient
    workspace = 3 * act * max(H, I) * tokens + 2 * act * q * tokens  # backward temporaries of one layer
    rows = [
        ("backbone parameters (sharded)", sharded / GiB, f"{total_params / 1e9:.2f}B x {param_bytes} B / {ws}"),
        ("gathered parameters", gathered / GiB, "root + 2 layers unsharded (bf16)" if ws > 1 else "world size 1: none"),
        ("trainable state (replicated)", trainable / GiB,
         f"{(router_params + lora_params) / 1e6:.1f}M params x 16 B (fp32 w, grad, AdamW m, v)"),
        ("activations" + (" (checkpointed)" if activation_checkpointing else ""), saved / GiB,
         f"{tokens} tokens/rank/micro-batch"),
        ("logits and loss", logits / GiB, f"vocab {V}: 14 B per token"),
        ("backward workspace", workspace / GiB, "one layer's transient gradients"),
    ]
    peak = sum(r[1] for r in rows)
    # FLOPs: the frozen backbone needs input gradients only (one forward's worth in backward),
    # activation checkpointing adds one forward.
    attn_flops = 2 * 2 * dims.num_heads * dims.head_dim * seq_len / 2  # causal QK^T and PV per token
    fwd_token = 2 * (total_params - (0 if tied else V * H)) + L * attn_flops
    passes = 2 + (1 if activation_checkpointing else 0) + (0.1 if lora_r else 0)
    tokens_step = batch_size * grad_accum * seq_len
    flops_step = fwd_token * passes * tokens_step
    peak_flops = GPU_PEAK.get(gpu.lower(), GPU_PEAK["h200"])
    step_s = flops_step / (ws * peak_flops * mfu)
    detail = dict(world_size=ws, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, steps=steps,
                  activation_checkpointing=activation_checkpointing, total_params=total_params,
                  router_params=router_params, lora_params=lora_params, tokens_per_rank=tokens,
                  flops_per_step=flops_step, mfu=mfu, gpu=gpu,
                  bytes={name: gib * GiB for name, gib, _ in rows})
    return Estimate(rows, peak, step_s, step_s * steps / 3600, tokens_step / ws / step_s, detail)


__all__ = ["DistContext", "init", "current", "shutdown", "under_torchrun", "shard_model", "trainable_parameters",
           "KeyedGumbel", "TrainingSession", "save_checkpoint", "load_checkpoint", "is_dcp_checkpoint",
           "recover", "estimate", "Estimate", "mix_seed"]
