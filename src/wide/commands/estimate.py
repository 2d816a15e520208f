"""``wide calibrate --dry-run``: memory per rank and step time of a planned run under
``wide.training.distributed.shard_model``, from the model's config alone (no weights are loaded).
docs/distributed.md says what each row counts and how close it came to measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from ..base.arch import KINDS
from ..method.geometry import PROJECTIONS, ModelDims, projection_shapes, resolve_geometry

# Dense bf16 tensor-core peaks (FLOP/s), for the time estimate only.
GPU_PEAK = {"h200": 989e12, "h100": 989e12, "a100": 312e12, "l40s": 362e12}


@dataclass
class DryRunArgs:
    """The options only ``--dry-run`` reads (wide.base.cliargs metadata)."""

    world_size: Optional[int] = field(default=None, metadata={
        "help": "ranks for --dry-run (default: WORLD_SIZE or 1)", "min": 1})
    mfu: float = field(default=0.4, metadata={"help": "model FLOP utilisation assumed by --dry-run", "gt": 0, "max": 1})
    gpu: str = field(default="h200", metadata={
        "choices": tuple(GPU_PEAK), "help": "GPU whose bf16 peak --dry-run assumes"})


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


# Bytes per token and vocabulary entry at the LM head. ce: the bf16 logits, their fp32 copy, the
# log-softmax and its gradient. kd (and mix, which runs the same ops): the teacher's bf16 logits
# and their log-softmax beside the student's bf16 logits, the cross-entropy's log-softmax (the
# loop computes it under every loss), the student's softened log-softmax, exp(teacher) and the
# KL's difference and product, all alive at the KL (28.0 measured on the CPU, where ce's is 12.0).
LOGIT_BYTES = {"ce": 14, "kd": 28, "mix": 28}
# Bytes per element of a projection input that the per-element thresholds' backward holds at
# once (wide.method.fine._SparseInput recomputes its masks there: x, score, mask, log margin,
# sigmoid, slope, the output gradient and its product in fp32, the bf16 gradients in and out): 45.0
# measured on the CPU for down_proj's input.
FINE_BACKWARD_BYTES = 45


def threshold_params(dims: ModelDims, fine) -> tuple:
    """(trained, held) parameter counts of per-element thresholds under ``fine`` (a
    ``wide.method.fine.FineConfig``, None: none): a log threshold per layer and projection (trained
    when learned), and per-channel log scales of every projection input where the criterion or
    ``per_channel`` has them (trained with ``per_channel``)."""
    if fine is None:
        return 0, 0
    L = dims.num_layers
    thresholds = L * len(PROJECTIONS)
    scales = L * sum(i for _, i in projection_shapes(dims).values()) if fine.criterion == "wina" or fine.per_channel \
        else 0
    trained = (thresholds if fine.allocation == "learned" else 0) + (scales if fine.per_channel else 0)
    return trained, thresholds + scales - trained


def estimate(config, wide_config, *, world_size: int = 1, seq_len: int = 4096, batch_size: int = 1,
             grad_accum: int = 1, steps: int = 10_000, activation_checkpointing: bool = False,
             param_bytes: int = 2, lora_r: int = 0, lora_targets: int = 7, mfu: float = DryRunArgs.mfu,
             gpu: str = DryRunArgs.gpu, loss: str = "ce", fine=None, fine_trained: bool = True) -> Estimate:
    """Per-rank memory and step time of stage 1 (or stage 2 with ``lora_r``) under
    ``shard_model``. ``batch_size`` is the global micro-batch, as in TrainArgs.

    Activations count what autograd saves when only the routers (and adapters) train: the
    frozen linears save nothing but their weights, so what remains is the fp32 RMSNorm and
    router inputs, attention's q/k/v/output, the masked o_proj/down_proj inputs and the
    SwiGLU operands; the LM head's logits (``LOGIT_BYTES`` of ``loss``) are counted separately,
    being large for 128k vocabularies. Layers of ``attn_dense_layers`` have no attention router.

    ``fine``: per-element thresholds (a ``wide.method.fine.FineConfig``, as ``wide calibrate
    --hybrid`` attaches them), trained beside the routers, or held fixed with ``fine_trained=False``
    (head routers on frozen thresholds). Their op saves the normed inputs of q/k/v and gate/up
    (o's and down's are counted already) and recomputes its masks in backward
    (``FINE_BACKWARD_BYTES``).
    """
    if loss not in LOGIT_BYTES:
        raise ValueError(f"loss {loss!r}: the estimate knows {sorted(LOGIT_BYTES)}")
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
    routed_layers = {}  # kind -> layers with a router of that kind
    for kind in KINDS:
        routed = wide_config.routes_attention if kind == "attn" else wide_config.routes_ffn
        if wide_config.tie_modules:
            g = 1 if kind == "attn" else 0
        else:
            g = geo.groups(kind) if routed else 0
        dense = len(wide_config.attn_dense_layers) if kind == "attn" and not wide_config.tie_modules else 0
        routed_layers[kind] = L - dense if g else 0
        if g:
            router_params += routed_layers[kind] * (H * r + r + r * 2 * g + 2 * g)
    fine_params, fine_held = threshold_params(dims, fine)
    if not fine_trained:
        fine_params, fine_held = 0, fine_params + fine_held
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
    trained = router_params + lora_params + fine_params
    # fp32 weight, grad, Adam m and v; thresholds held fixed keep their fp32 weight only
    trainable = trained * 16 + fine_held * 4
    act = 2  # bytes of a bf16 activation
    per_layer_token = (2 * 4 * H  # two RMSNorms save their fp32 input
                       + act * (2 * q + 2 * kv)  # attention: q, k, v, output
                       + act * q  # masked o_proj input
                       + 4 * act * I)  # silu(gate) input and output, up, masked down_proj input
    if fine is not None:
        per_layer_token += 2 * act * H  # the thresholds' op saves the normed q/k/v and gate/up inputs
    if lora_r:
        per_layer_token += act * (3 * H + q + 2 * I) + 4 * lora_r * lora_targets
    router_inputs = 4 * H * sum(routed_layers.values())  # each router saves its fp32 input
    if activation_checkpointing:
        # layer inputs + one layer recomputed (one with the most routers)
        saved = (L * act * H + per_layer_token + 4 * H * sum(1 for n in routed_layers.values() if n)) * tokens
    else:
        saved = (L * per_layer_token + router_inputs) * tokens
    logits = LOGIT_BYTES[loss] * V * tokens
    workspace = 3 * act * max(H, I) * tokens + 2 * act * q * tokens  # backward temporaries of one layer
    if fine is not None:
        workspace = max(workspace, FINE_BACKWARD_BYTES * max(H, q, I) * tokens)
    params_note = f"{trained / 1e6:.2f}M params x 16 B (fp32 w, grad, AdamW m, v)"
    if fine_params:
        params_note += f", {fine_params / 1e6:.2f}M of them thresholds"
    if fine_held:
        params_note += f"; {fine_held / 1e6:.2f}M fixed threshold params x 4 B"
    rows = [
        ("backbone parameters (sharded)", sharded / GiB, f"{total_params / 1e9:.2f}B x {param_bytes} B / {ws}"),
        ("gathered parameters", gathered / GiB, "root + 2 layers unsharded (bf16)" if ws > 1 else "world size 1: none"),
        ("trainable state (replicated)", trainable / GiB, params_note),
        ("activations" + (" (checkpointed)" if activation_checkpointing else ""), saved / GiB,
         f"{tokens} tokens/rank/micro-batch"),
        ("logits and loss", logits / GiB, f"vocab {V}: {LOGIT_BYTES[loss]} B per token ({loss})"),
        ("backward workspace", workspace / GiB,
         "one layer's transient gradients" + (" (the thresholds' backward)" if fine is not None else "")),
    ]
    peak = sum(r[1] for r in rows)
    # FLOPs: the frozen backbone needs input gradients only (one forward's worth in backward),
    # activation checkpointing adds one forward, kd (and mix) the teacher's forward.
    attn_flops = 2 * 2 * dims.num_heads * dims.head_dim * seq_len / 2  # causal QK^T and PV per token
    fwd_token = 2 * (total_params - (0 if tied else V * H)) + L * attn_flops
    passes = 2 + (1 if activation_checkpointing else 0) + (0.1 if lora_r else 0) + (1 if loss != "ce" else 0)
    tokens_step = batch_size * grad_accum * seq_len
    flops_step = fwd_token * passes * tokens_step
    peak_flops = GPU_PEAK.get(gpu.lower(), GPU_PEAK[DryRunArgs.gpu])
    step_s = flops_step / (ws * peak_flops * mfu)
    detail = dict(world_size=ws, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, steps=steps,
                  activation_checkpointing=activation_checkpointing, total_params=total_params,
                  router_params=router_params, lora_params=lora_params, threshold_params=fine_params,
                  fixed_threshold_params=fine_held, trainable_params=trained, loss=loss, tokens_per_rank=tokens,
                  flops_per_step=flops_step, mfu=mfu, gpu=gpu,
                  bytes={name: gib * GiB for name, gib, _ in rows})
    return Estimate(rows, peak, step_s, step_s * steps / 3600, tokens_step / ws / step_s, detail)


def dry_run(args) -> dict:
    """``wide calibrate --dry-run``: print the estimate of the run ``args`` describe."""
    from ..base.arch import hf_config
    from ..base.cliargs import from_args
    from ..method.config import WideConfig
    from ..method.fine import FineConfig
    from .runs import DEFAULT

    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    model = args.model if args.model != DEFAULT else "smollm2-135m"
    hybrid = getattr(args, "hybrid", False)
    # the configs cmd_calibrate builds (calibrate_config's linear budget changes no byte here)
    fine = from_args(FineConfig, args, allocation="learned") if hybrid else None
    est = estimate(hf_config(model), from_args(WideConfig, args), world_size=world, seq_len=args.seq_len,
                   batch_size=args.batch_size, grad_accum=args.grad_accum, steps=args.steps,
                   activation_checkpointing=args.activation_checkpointing,
                   param_bytes=2 if args.dtype != "float32" else 4, mfu=args.mfu, gpu=args.gpu,
                   loss=args.loss, fine=fine)
    print(f"wide calibrate --dry-run: {model}, {world} rank(s), global micro-batch {args.batch_size} x "
          f"{args.seq_len} tokens, grad-accum {args.grad_accum}, activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}, backbone {args.dtype}, loss {args.loss}"
          + (", learned thresholds (--hybrid)" if hybrid else ""))
    print(est.table())
    return {"peak_gib": est.peak_gib, "step_s": est.step_s, **est.detail}


__all__ = ["GPU_PEAK", "LOGIT_BYTES", "FINE_BACKWARD_BYTES", "DryRunArgs", "Estimate", "estimate",
           "threshold_params", "dry_run"]
