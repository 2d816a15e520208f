"""``wide.accelerate(model)``: run a routed model on the routed kernels, with a static KV cache.

The HF model stays as it is (its hooks give the masked PyTorch path, which is what training,
evaluation and ``model.generate()`` use). ``accelerate`` builds an :class:`AcceleratedModel`
beside it that shares its weights and has its own forward, in the gpt-fast style:

* a preallocated KV cache ``[B, max_len, Hkv, D]`` per layer, written in place, so the decode
  step has fixed shapes and is captured once per (batch, cache length) in a CUDA graph;
* batched prompts are right-padded and carry per-sequence lengths (``q_lens``/``k_lens`` in
  prefill, ``seq_lens`` in decode, one RoPE position per sequence), so each sequence sees
  exactly the keys and positions it would see alone;
* per layer and module the router runs once per step on the same input as in the HF path
  (residual or normed, per the config) and gives one bool mask ``[tokens, groups]``; one
  :class:`~wide.kernels.RouteIndex` of it serves Q (``gemm_mn``) and O (``gemm_k``), another
  gate/up (``ffn_up``) and down (``gemm_k``). K/V projections run dense on every token (every
  token's keys are needed by later tokens) and go to the cache; attention runs on
  ``prefill_attention`` / ``decode_attention``, which skip inactive head groups.

Decode is launch-bound at small batch: a layer of plain PyTorch ops is ~50 tiny kernels.
Small Triton kernels here cut that down, for the routed and the dense engine alike: one
fuses the residual add, RMSNorm and the router (a group runs iff its margin >= 0), each row
split over 256-column programs with the last one to finish reducing the router's partial
sums (at batch 1 the norm stops at the partial sums and the q / gate-up GEMV finishes the
router per group and writes the mask, which saves the norm its cross-program round trips);
one applies RoPE to q and k and writes k and v into the cache. Prefill has the same
two (one program per row for the norm; token blocks for RoPE), a router kernel that reads the
bf16 rows directly (no fp32 copy), and the dense engine a one-pass SiLU*up. They round to the
model dtype where the HF ops round; their fp32 internals (summation order, Triton's sqrt and
exp) differ by ulps, so a normed value can differ by one bf16 step (decode check: 1.1e-4
relative). Router offsets are calibrated mid-gap between neighbouring margins, so such
differences flip a decision only for tokens within half a gap of the threshold.

Backends: ``"triton"`` (the kernels; CUDA with compute capability >= 8.0, or the CPU under
``TRITON_INTERPRET=1`` for tests) and ``"torch"`` (the same computation with dense matmuls
and masks, for CPUs and other GPUs). ``mode="dense"`` runs the same engine with no routing
(fused QKV and gate/up matmuls, SDPA prefill, flash decoding), which is the baseline the
end-to-end benchmark divides by.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modeling import Geometry, get_state

__all__ = ["AcceleratedModel", "accelerate", "generate", "GenerationResult", "sample_logits",
           "ACCELERATED_MODEL_TYPES"]

# Which implementation (routed kernel or cuBLAS) runs each routed projection, per (op, weight
# shape, group, T bucket, dtype), measured on first use. Filled only on CUDA with autotuning
# on; see _measured.
K_CHOICES: dict = {}

# Prompts up to this many tokens (batch x length, rounded up to 128 per sequence) prefill by
# CUDA-graph replay; longer ones are GPU-bound and run eagerly (see AcceleratedModel.prefill).
PREFILL_GRAPH_MAX_TOKENS = 2048


def prefill_graphs_enabled() -> bool:
    """Short prefills replay CUDA graphs unless ``WIDE_PREFILL_GRAPHS=0``."""
    return os.environ.get("WIDE_PREFILL_GRAPHS", "1") != "0"


def choose_fastest(key, candidates: dict, choices: dict, timer: Callable, default: str) -> str:
    """The name of the fastest of ``candidates`` (name -> zero-argument callable) by ``timer``,
    cached in ``choices[key]``. While a CUDA graph is being captured nothing may be timed, so an
    unmeasured key gets ``default`` (uncached)."""
    if key in choices:
        return choices[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return default
    times = {name: timer(fn) for name, fn in candidates.items()}
    choices[key] = min(times, key=times.get)
    return choices[key]


# q/k/v bias (qwen2) and q/k norms (qwen3) are not wired into the fused decode kernels.
ACCELERATED_MODEL_TYPES = ("llama", "mistral")
BACKENDS = ("auto", "triton", "torch")
MODES = ("routed", "dense")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------ fused decode helpers

if HAS_TRITON:

    @triton.jit
    def _norm_route_kernel(x_ptr, d_ptr, res_ptr, y_ptr, nw_ptr, eps,
                           rdw_ptr, rdb_ptr, ruw_ptr, rub_ptr, off_ptr, m_ptr, hp_ptr, cnt_ptr,
                           H, G, NCHUNK, stride_x, stride_d, stride_res, stride_y, stride_m,
                           HAS_DELTA: tl.constexpr, ROUTE: tl.constexpr, NORMED_IN: tl.constexpr,
                           R: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                           NC_PAD: tl.constexpr, G_PAD: tl.constexpr, FINAL: tl.constexpr):
        # Program (token, chunk): residual add, RMSNorm (HF rounding) and the router's first
        # linear on its CHUNK columns; the last chunk program of a token to finish adds the
        # partial router sums in chunk order and writes the mask (margin >= 0). One program per
        # token was latency-bound: a single SM walking 16 x H fp32 router weights in a loop took
        # ~40 us per call on an H200 (bench/results/e2e.md profile), 2.5 ms of a 6 ms decode step.
        # FINAL=False (batch 1): stop at the partial sums; the next GEMV finishes the router
        # (gemm_mn's RouterPartials), which saves this kernel the ticket round trips.
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        # Every chunk program needs the whole row's sum of squares; the row is a few KB (L2).
        ss = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, H, BLOCK):
            cols = c0 + offs
            ok = cols < H
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
            if HAS_DELTA:
                d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            xf = x.to(tl.float32)
            ss += xf * xf
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * stride_res + cols, x, mask=ok)
        nw = tl.load(nw_ptr + cols, mask=ok, other=0.0)
        n = (x.to(tl.float32) * rstd).to(x.dtype)
        y = (n.to(tl.float32) * nw.to(tl.float32)).to(x.dtype)
        tl.store(y_ptr + row * stride_y + cols, y, mask=ok)
        if ROUTE:
            offs_r = tl.arange(0, R)
            if NORMED_IN:
                src = y.to(tl.float32)
            else:
                src = x.to(tl.float32)
            w = tl.load(rdw_ptr + offs_r[:, None] * H + cols[None, :], mask=ok[None, :], other=0.0)
            part = tl.sum(w * src[None, :], axis=1)
            tl.store(hp_ptr + (row * NCHUNK + c) * R + offs_r, part)
        if ROUTE and FINAL:
            offs_r = tl.arange(0, R)
            # The router's second linear (rows 2g execute, 2g+1 skip) is loaded by every
            # program before the ticket, so the reducing program does not wait on it after.
            gs = tl.arange(0, G_PAD)
            g_ok = gs < G
            u0 = tl.load(ruw_ptr + (2 * gs)[:, None] * R + offs_r[None, :], mask=g_ok[:, None], other=0.0)
            u1 = tl.load(ruw_ptr + (2 * gs + 1)[:, None] * R + offs_r[None, :], mask=g_ok[:, None], other=0.0)
            b0 = tl.load(rub_ptr + 2 * gs, mask=g_ok, other=0.0)
            b1 = tl.load(rub_ptr + 2 * gs + 1, mask=g_ok, other=0.0)
            hb = tl.load(rdb_ptr + offs_r)
            off = tl.load(off_ptr)
            # Every thread's partial store lands before the (release) ticket; the program that
            # draws the last ticket (acquire) reads all partials, bypassing L1, then re-arms
            # the counter for the next call (and the next CUDA-graph replay).
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
            if ticket == NCHUNK - 1:
                cs = tl.arange(0, NC_PAD)
                parts = tl.load(hp_ptr + (row * NCHUNK + cs[:, None]) * R + offs_r[None, :],
                                mask=(cs < NCHUNK)[:, None], other=0.0, volatile=True)
                h = tl.sum(parts, axis=0) + hb
                l0 = tl.sum(u0 * h[None, :], axis=1) + b0
                l1 = tl.sum(u1 * h[None, :], axis=1) + b1
                margin = l0 - l1 + off
                tl.store(m_ptr + row * stride_m + gs, (margin >= 0).to(tl.uint8), mask=g_ok)
                tl.atomic_xchg(cnt_ptr + row, 0)

    @triton.jit
    def _router_mask_kernel(x_ptr, dw_ptr, db_ptr, uw_ptr, ub_ptr, off_ptr, m_ptr,
                            T, H, G, R, stride_x, stride_m,
                            BM: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr,
                            G_PAD: tl.constexpr):
        # Prefill routers, [BM tokens] per program: h = x W_down^T + b straight from the bf16
        # rows (no fp32 copy of x), then both logits of every group and the mask, in one
        # launch. PyTorch ran this as an fp32 copy of x plus a narrow sgemm: ~10 of 109 ms of
        # a 4k-token prefill on an H200. The dots are "tf32x3" (three TF32 tensor-core products
        # with fp32 accumulation, ~fp32 accurate; bf16 x is exact in TF32): "ieee" fp32 FMAs
        # took 180 us per 4k-token call there, slower than PyTorch. The kernel backend runs on
        # sm80+ only (TF32 present); the interpreter computes the dots in fp32 regardless.
        pid = tl.program_id(0)
        rows = (pid * BM + tl.arange(0, BM)).to(tl.int64)
        r_ok = rows < T
        rr = tl.arange(0, R_PAD)
        rr_ok = rr < R
        acc = tl.zeros([BM, R_PAD], dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < H
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(dw_ptr + rr[None, :] * H + k[:, None], mask=rr_ok[None, :] & k_ok[:, None],
                        other=0.0)
            acc = tl.dot(x, w, acc, input_precision="tf32x3")
        h = acc + tl.load(db_ptr + rr, mask=rr_ok, other=0.0)[None, :]
        gs = tl.arange(0, G_PAD)
        g_ok = gs < G
        u_ok = rr_ok[:, None] & g_ok[None, :]
        u0 = tl.load(uw_ptr + (2 * gs)[None, :] * R + rr[:, None], mask=u_ok, other=0.0)
        u1 = tl.load(uw_ptr + (2 * gs + 1)[None, :] * R + rr[:, None], mask=u_ok, other=0.0)
        l0 = tl.dot(h, u0, input_precision="tf32x3") + tl.load(ub_ptr + 2 * gs, mask=g_ok, other=0.0)[None, :]
        l1 = tl.dot(h, u1, input_precision="tf32x3") + tl.load(ub_ptr + 2 * gs + 1, mask=g_ok, other=0.0)[None, :]
        margin = l0 - l1 + tl.load(off_ptr)
        tl.store(m_ptr + rows[:, None] * stride_m + gs[None, :], (margin >= 0).to(tl.uint8),
                 mask=r_ok[:, None] & g_ok[None, :])

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, m_ptr, I, GS, stride_g, stride_u, stride_y, stride_m,
                         BLOCK: tl.constexpr, MASKED: tl.constexpr):
        # silu(gate) * up from cuBLAS gate/up outputs in one pass, rounding where
        # F.silu(g) * u rounds: the dense engine's FFN activation (the routed ffn_up kernel
        # fuses it into its epilogue, so the baseline gets the fused pass too), and, MASKED,
        # the routed engine's when cuBLAS measured faster than ffn_up (exact zeros in the
        # token's inactive groups, as down's input must be).
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < I
        if MASKED:
            ok = ok & (tl.load(m_ptr + row * stride_m + c // GS, mask=ok, other=0) != 0)
        g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0)
        u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(y_ptr + row * stride_y + c, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
                 mask=c < I)

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        # q*cos + rotate_half(q)*sin on the two halves, rounded to the model dtype after each
        # product and after the sum, as HF's bf16 ops round.
        dt = x1.dtype
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _rope_prefill_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, T, Hq,
                             stride_q, stride_k, stride_v, stride_cb, stride_ct, stride_ch,
                             BT: tl.constexpr, HALF: tl.constexpr):
        # Program (token block, sequence b, head h): positions 0..T-1 of right-padded prompts.
        # h < Hq rotates q head h in place; otherwise KV head h - Hq is rotated and written,
        # with v, to the cache. PyTorch's RoPE (cat, muls, adds, cache copies) was ~8 ms of a
        # 4k-token prefill on an H200, for both engines.
        tb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2)
        t = tb * BT + tl.arange(0, BT)
        ok = (t < T)[:, None]
        d = tl.arange(0, HALF)[None, :]
        cs = t[:, None].to(tl.int64) * 2 * HALF + d
        c1 = tl.load(cos_ptr + cs, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
        row = (b * T + t)[:, None]
        if h < Hq:
            base = q_ptr + row * stride_q + h * 2 * HALF
        else:
            base = k_ptr + row * stride_k + (h - Hq) * 2 * HALF
        o1, o2 = _rotate(tl.load(base + d, mask=ok, other=0.0),
                         tl.load(base + HALF + d, mask=ok, other=0.0), c1, c2, s1, s2)
        if h < Hq:
            tl.store(base + d, o1, mask=ok)
            tl.store(base + HALF + d, o2, mask=ok)
        else:
            kh = h - Hq
            dst = b * stride_cb + t[:, None].to(tl.int64) * stride_ct + kh * stride_ch
            tl.store(kc_ptr + dst + d, o1, mask=ok)
            tl.store(kc_ptr + dst + HALF + d, o2, mask=ok)
            vb = v_ptr + row * stride_v + kh * 2 * HALF
            tl.store(vc_ptr + dst + d, tl.load(vb + d, mask=ok, other=0.0), mask=ok)
            tl.store(vc_ptr + dst + HALF + d, tl.load(vb + HALF + d, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr,
                           Hq, stride_q, stride_k, stride_v, stride_cb, stride_ct, stride_ch,
                           HALF: tl.constexpr):
        # Program (b, h): h < Hq rotates q head h in place; otherwise KV head h - Hq is rotated
        # and written, with v, to the cache at the sequence's position. Rounds like HF's
        # q*cos + rotate_half(q)*sin in the model dtype.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        d = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + pos * 2 * HALF + d).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * 2 * HALF + d).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + d).to(tl.float32)
        if h < Hq:
            base = q_ptr + b * stride_q + h * 2 * HALF
        else:
            base = k_ptr + b * stride_k + (h - Hq) * 2 * HALF
        o1, o2 = _rotate(tl.load(base + d), tl.load(base + HALF + d), c1, c2, s1, s2)
        if h < Hq:
            tl.store(base + d, o1)
            tl.store(base + HALF + d, o2)
        else:
            kh = h - Hq
            dst = b * stride_cb + pos * stride_ct + kh * stride_ch
            tl.store(kc_ptr + dst + d, o1)
            tl.store(kc_ptr + dst + HALF + d, o2)
            vb = v_ptr + b * stride_v + kh * 2 * HALF
            tl.store(vc_ptr + dst + d, tl.load(vb + d))
            tl.store(vc_ptr + dst + HALF + d, tl.load(vb + HALF + d))


def _silu_mul(g: torch.Tensor, u: torch.Tensor, mask: Optional[torch.Tensor] = None,
              group_size: int = 1) -> torch.Tensor:
    """silu(g) * u [T, I] in one Triton pass (rows of g and u with unit column stride), with
    exact zeros in the groups where ``mask [T, I // group_size]`` is False when given."""
    T, I = g.shape
    y = torch.empty((T, I), dtype=g.dtype, device=g.device)
    if T:
        m = mask.contiguous().view(torch.uint8) if mask is not None else y
        _silu_mul_kernel[(T, triton.cdiv(I, 1024))](
            g, u, y, m, I, group_size, g.stride(0), u.stride(0), y.stride(0),
            m.stride(0) if mask is not None else 0, BLOCK=1024, MASKED=mask is not None,
            num_warps=4)
    return y


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin):
    """HF's q*cos + rotate_half(q)*sin; x [..., T, H, D], cos/sin broadcastable [..., T, 1, D]."""
    return (x * cos) + (_rotate_half(x) * sin)


def _hf_rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # module.forward, not module(...): the norms carry wide's routing hooks, which would
    # evaluate the routers a second time and record masks for the HF path.
    return norm.forward(x)


@dataclass
class _Layer:
    attn_norm: nn.Module
    ffn_norm: nn.Module
    wq: torch.Tensor
    wkv: torch.Tensor  # [2*Hkv*D, H], k rows then v rows
    wo: torch.Tensor
    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor
    wqkv: Optional[torch.Tensor] = None  # [wq; wk; wv]: dense engine, and routed decode
    wgu: Optional[torch.Tensor] = None  # dense engine only
    routers: dict = field(default_factory=dict)  # kind -> TokenRouter (or None)


@dataclass
class GenerationResult:
    """``tokens[i]``: the new token ids of prompt i (up to and including EOS);
    ``texts`` when a tokenizer was given; prefill and per-token decode times in seconds."""

    tokens: list
    texts: Optional[list] = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0


def _linear_plain(mod: nn.Module, name: str, layer: int) -> torch.Tensor:
    if not isinstance(mod, nn.Linear) or hasattr(mod, "lora_A") or hasattr(mod, "base_layer"):
        raise ValueError(f"layer {layer} {name} is a {type(mod).__name__}, not a plain nn.Linear: "
                         "merge LoRA adapters (wide.recovery) before wide.accelerate")
    if mod.bias is not None:
        raise ValueError(f"layer {layer} {name} has a bias; wide.accelerate supports bias-free "
                         "Llama/Mistral projections only")
    return mod.weight


class AcceleratedModel:
    """Static-cache inference engine over a wrapped (or, for ``mode="dense"``, any)
    Llama/Mistral HF model. Shares the HF model's weights; see the module docstring."""

    def __init__(self, model, backend: str = "auto", mode: str = "routed",
                 cuda_graphs: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        cfg = model.config
        mtype = getattr(cfg, "model_type", None)
        if mtype not in ACCELERATED_MODEL_TYPES:
            raise ValueError(f"wide.accelerate supports {ACCELERATED_MODEL_TYPES} models; this one is "
                             f"{mtype!r} (use the masked PyTorch path: the wrapped model itself)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"wide.accelerate needs a SiLU-gated MLP, got hidden_act={cfg.hidden_act!r}")
        self.model = model
        self.mode = mode
        self.state = get_state(model) if mode == "routed" else getattr(model, "wide_state", None)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {self.dtype}: use float32, float16 or bfloat16")
        self.num_heads = cfg.num_attention_heads
        self.num_kv = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden = cfg.hidden_size
        self.inter = cfg.intermediate_size
        self.backend = self._pick_backend(backend)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        if self.state is not None and mode == "routed":
            geo: Geometry = self.state.geometry
            self.attn_gs = geo.attn_group_size
            self.ffn_gs = geo.ffn_group_size
            self.attn_groups, self.ffn_groups = geo.attn_groups, geo.ffn_groups
            self.cfg = self.state.config
        else:
            self.attn_gs = self.num_heads // self.num_kv
            self.attn_groups = self.num_kv
            self.ffn_gs, self.ffn_groups, self.cfg = self.inter, 1, None
        if self.backend == "triton":
            self._check_kernel_shapes()
        inner = model.model
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            wq = _linear_plain(a.q_proj, "q_proj", i)
            wk = _linear_plain(a.k_proj, "k_proj", i)
            wv = _linear_plain(a.v_proj, "v_proj", i)
            wo = _linear_plain(a.o_proj, "o_proj", i)
            wg = _linear_plain(m.gate_proj, "gate_proj", i)
            wu = _linear_plain(m.up_proj, "up_proj", i)
            wd = _linear_plain(m.down_proj, "down_proj", i)
            wqkv = None
            if mode == "dense" or self._fuse_qkv():
                # One weight tensor for q/k/v, with wq and wkv as row views of it: the dense
                # engine runs one GEMM for them (as gpt-fast does), routed decode one gemm_mn
                # launch of routed Q with K/V as always-on groups (dense_tail).
                wqkv = torch.cat([wq, wk, wv]).detach()
                wq, wkv = wqkv[:wq.shape[0]], wqkv[wq.shape[0]:]
            else:
                wkv = torch.cat([wk, wv]).detach()
            L = _Layer(layer.input_layernorm, layer.post_attention_layernorm, wq, wkv, wo, wg, wu, wd,
                       wqkv=wqkv)
            if mode == "dense":
                L.wgu = torch.cat([wg, wu]).detach()
            elif self.state is not None:
                lr = model.wide_routers[i]
                L.routers = {"attn": lr.router("attn"), "ffn": lr.router("ffn")}
            self.layers.append(L)
        self._cache_key = None
        self._graphs = {}
        self._prefill_pool = None  # one memory pool for every prefill graph
        self._capture_stream = None  # every capture on one stream, so the pool's blocks are reused
        self._rope_len = 0

    # -------------------------------------------------------------- set-up and checks

    def _fuse_qkv(self) -> bool:
        """Whether routed decode can append K/V to Q as whole always-on groups."""
        if self.mode != "routed" or self.backend != "triton" or self.state is None:
            return False
        gcols = self.attn_gs * self.head_dim
        return (2 * self.num_kv * self.head_dim) % gcols == 0

    def _pick_backend(self, backend: str) -> str:
        dev = self.device
        kernels_ok = HAS_TRITON and (
            (dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 8)
            or (dev.type == "cpu" and _interpret()))
        if backend == "auto":
            return "triton" if kernels_ok and self.head_dim in (64, 128) and self._groups_ok() else "torch"
        if backend == "triton":
            if not HAS_TRITON:
                raise ValueError("backend='triton' needs Triton installed")
            if dev.type == "cpu" and not _interpret():
                raise ValueError("backend='triton' on the CPU runs only under TRITON_INTERPRET=1 "
                                 "(tests); use backend='torch' or a CUDA GPU")
            if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 8:
                raise ValueError(f"backend='triton' needs compute capability >= 8.0, this GPU has "
                                 f"{torch.cuda.get_device_capability(dev)}; use backend='torch'")
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"backend='triton' does not run on {dev.type}")
            if dev.type == "cpu" and self.dtype == torch.bfloat16:
                raise ValueError("bfloat16 matmuls are wrong in the Triton interpreter: test in "
                                 "float32 or float16")
        return backend

    def _groups_ok(self) -> bool:
        st = self.state
        return st is None or st.geometry.ffn_group_size % 16 == 0

    def _check_kernel_shapes(self) -> None:
        if self.head_dim not in (64, 128):
            raise ValueError(f"the attention kernels need head_dim 64 or 128, this model has "
                             f"{self.head_dim}; use backend='torch'")
        if self.mode == "routed" and self.ffn_gs % 16:
            raise ValueError(f"the routed GEMM kernels need ffn_group_size to be a multiple of 16, "
                             f"got {self.ffn_gs}; re-wrap with e.g. "
                             f"{[d for d in range(16, self.inter + 1, 16) if self.inter % d == 0][:6]}"
                             " or use backend='torch'")

    def _ensure_rope(self, n: int) -> None:
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        pos = torch.arange(n, device=self.device)[None]
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [n, D]
        self._rope_len = n

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate the static KV cache (a no-op if one of this size exists)."""
        key = (batch, max_len)
        if self._cache_key == key:
            return
        self._graphs.clear()
        self._prefill_pool = None
        self.k_cache = self.v_cache = None
        shape = (batch, max_len, self.num_kv, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self._cache_key = key
        self._ensure_rope(max_len)
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=self.device)

    def free_cache(self) -> None:
        self._graphs.clear()
        self._prefill_pool = None
        self.k_cache = self.v_cache = None
        self._cache_key = None

    # -------------------------------------------------------------- routing

    def _routed(self, kind: str) -> bool:
        if self.mode != "routed":
            return False
        cfg = self.cfg
        return cfg.routes_attention if kind == "attn" else cfg.routes_ffn

    def _mask_torch(self, i: int, kind: str, resid: torch.Tensor, normed: torch.Tensor,
                    attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Bool mask [..., groups] of module ``kind`` in layer ``i`` (None: runs dense)."""
        cfg, st = self.cfg, self.state
        if not self._routed(kind):
            return None
        x = normed if cfg.router_input == "normed" else resid
        if cfg.tie_modules and kind == "ffn":
            return attn_mask[..., :1].expand(*attn_mask.shape[:-1], self.ffn_groups)
        if st.mask_fn is not None:
            x3 = x if x.dim() == 3 else x[:, None]
            m = st.mask_fn(i, kind, x3)
            m = None if m is None else (m.reshape(x3.shape[0], x3.shape[1], -1) != 0)
            if m is None:
                return None
            m = m if x.dim() == 3 else m[:, 0]
        else:
            m = self._router_mask(self.layers[i].routers[kind], x)
        if cfg.tie_modules:
            m = m[..., :1].expand(*m.shape[:-1], self.attn_groups)
        return m

    def _router_mask(self, router, x: torch.Tensor) -> torch.Tensor:
        """Bool mask [..., groups] of ``router`` on ``x`` [..., H]: one Triton launch on the
        kernel backend, the router module itself otherwise (same fp32 math, other order)."""
        if self.backend != "triton":
            return router.margin(x) >= 0
        H = x.shape[-1]
        x2 = x.reshape(-1, H)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        T, G, R = x2.shape[0], router.num_groups, router.down.out_features
        mask = torch.empty((T, G), dtype=torch.bool, device=x.device)
        if T:
            bm = 32 if T >= 2048 or _interpret() else 16  # enough programs for every SM
            _router_mask_kernel[(triton.cdiv(T, bm),)](
                x2, router.down.weight, router.down.bias, router.up.weight, router.up.bias,
                router.offset, mask.view(torch.uint8), T, H, G, R, x2.stride(0), mask.stride(0),
                BM=bm, BK=64, R_PAD=max(16, triton.next_power_of_2(R)),
                G_PAD=max(16, triton.next_power_of_2(G)), num_warps=4)
        return mask.view(*x.shape[:-1], G)

    def _norm_route(self, i, kind, x, delta, defer: bool = False):
        """Decode: (new residual, normed, mask [B, G] bool or None, RouterPartials or None).
        ``defer`` (batch 1, kernel backend): the mask is an empty buffer that the next GEMV
        fills from the returned RouterPartials."""
        L = self.layers[i]
        norm = L.attn_norm if kind == "attn" else L.ffn_norm
        # Tied (dynamic-depth) decisions and custom mask_fns are evaluated in PyTorch.
        fused_route = (self._routed(kind) and self.state.mask_fn is None
                       and not self.cfg.tie_modules)
        if self.backend != "triton":
            resid = x if delta is None else x + delta
            normed = _hf_rms(norm, resid)
            mask = self._mask_torch(i, kind, resid, normed, getattr(self, "_amask", None))
            return resid, normed, mask, None
        router = L.routers.get(kind) if fused_route else None
        resid, normed, mask, rp = self._launch_norm_route(x, delta, norm, router,
                                                          defer=defer and x.shape[0] == 1)
        if router is None and self._routed(kind):
            mask = self._mask_torch(i, kind, resid, normed, getattr(self, "_amask", None))
        return resid, normed, mask, rp

    # -------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lens: Optional[torch.Tensor] = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run right-padded prompts ``ids [B, T]`` with lengths ``lens [B]`` through the model,
        writing their keys/values to cache positions 0..len-1. Returns logits at each
        sequence's last prompt token [B, V] (or [B, T, V] with ``all_logits``).

        Short prompts (B x T <= PREFILL_GRAPH_MAX_TOKENS) replay a CUDA graph from the second
        prefill of a (B, T rounded up to 128) bucket on (the first runs eagerly, so a one-off
        prompt pays no capture): there the ~20 launches per layer cost more host time than the
        GPU needs, as in decode (a 1k-token routed prefill on an H200: 29-54 ms of wall time
        eagerly, 21.9 ms replayed). The returned logits are then a graph buffer, overwritten by
        the next prefill of any length (clone them to keep them); positions T..bucket-1 of the
        cache get padding keys, which no sequence reads (they lie past its length).
        ``WIDE_PREFILL_GRAPHS=0`` turns it off."""
        B, T = ids.shape
        if self._cache_key is None or self._cache_key[0] != B or self._cache_key[1] < T:
            raise ValueError(f"call setup_cache(batch={B}, max_len>={T}) first")
        Tb = -(-T // 128) * 128
        key = ("prefill", B, Tb)
        if (self.cuda_graphs and not all_logits and B * Tb <= PREFILL_GRAPH_MAX_TOKENS
                and Tb <= self._cache_key[1] and getattr(self.state, "mask_fn", None) is None
                and prefill_graphs_enabled()):
            if key in self._graphs:
                return self._prefill_graphed(ids, lens, key)
            self._graphs[key] = None  # seen once: capture on the next prefill of this bucket
        return self._prefill_eager(ids, lens, all_logits)

    def _prefill_graphed(self, ids: torch.Tensor, lens: Optional[torch.Tensor], key: tuple):
        _, B, Tb = key
        T = ids.shape[1]
        g = self._graphs[key]
        if g is None:  # static inputs, filled below before the capture's warm-up reads them
            ids_buf = torch.empty(B, Tb, dtype=torch.long, device=self.device)
            lens_buf = torch.empty(B, dtype=torch.long, device=self.device)
        else:
            graph, out, ids_buf, lens_buf = g
        ids_buf[:, :T].copy_(ids)
        ids_buf[:, T:].zero_()
        if lens is None:
            lens_buf.fill_(T)
        else:
            lens_buf.copy_(lens)
        if g is None:
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph, out = self._capture(lambda: self._prefill_eager(ids_buf, lens_buf),
                                       pool=self._prefill_pool)
            self._graphs[key] = (graph, out, ids_buf, lens_buf)
        graph.replay()
        return out

    @torch.no_grad()
    def _prefill_eager(self, ids: torch.Tensor, lens: Optional[torch.Tensor] = None,
                       all_logits: bool = False) -> torch.Tensor:
        B, T = ids.shape
        if lens is None:
            lens = torch.full((B,), T, dtype=torch.long, device=self.device)
        lens = lens.to(self.device)
        lens32 = lens.to(torch.int32)
        valid = torch.arange(T, device=self.device)[None, :] < lens[:, None]
        kern = self.backend == "triton"
        Hq, Hkv, D = self.num_heads, self.num_kv, self.head_dim
        x = self.embed(ids)
        delta = None  # the previous layer's FFN output, added to x inside the next norm
        for i, L in enumerate(self.layers):
            x, hn = self._prefill_norm(x, delta, L.attn_norm)
            ma = self._mask_torch(i, "attn", x, hn, None)
            self._amask = ma
            if ma is not None:
                ma = ma & valid[..., None]
            h2 = hn.reshape(B * T, -1)
            if self.mode == "dense":
                qkv = F.linear(h2, L.wqkv)
                q, kv = qkv[:, :Hq * D], qkv[:, Hq * D:]
            else:
                kv = F.linear(h2, L.wkv)
                if ma is not None and kern:
                    ma2 = ma.reshape(B * T, -1)
                    from .kernels import build_route
                    route_a = build_route(ma2)
                    q = self._q_proj(L, h2, ma2, route_a)
                else:
                    q = F.linear(h2, L.wq)
            if kern:
                kc, vc = self.k_cache[i], self.v_cache[i]
                _rope_prefill_kernel[(triton.cdiv(T, 32), B, Hq + Hkv)](
                    q, kv, kv[:, Hkv * D:], self.cos, self.sin, kc, vc, T, Hq, q.stride(0),
                    kv.stride(0), kv.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
                    BT=32, HALF=D // 2)
                q = q.view(B, T, Hq, D)
                k, v = kc[:, :T], vc[:, :T]
            else:
                cos = self.cos[:T][None, :, None, :]
                sin = self.sin[:T][None, :, None, :]
                q = _rope(q.reshape(B, T, Hq, D), cos, sin)
                k = _rope(kv[:, :Hkv * D].reshape(B, T, Hkv, D), cos, sin)
                v = kv[:, Hkv * D:].reshape(B, T, Hkv, D)
                self.k_cache[i][:, :T] = k
                self.v_cache[i][:, :T] = v
            if ma is not None and kern:
                from .kernels import prefill_attention
                att = prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), ma,
                                        q_lens=lens32, k_lens=lens32, padding_side="right")
                o = self._reduce_k(att.reshape(B * T, Hq * D), L.wo, ma2, self.attn_gs * D, route_a)
            else:
                att = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                    enable_gqa=Hq != Hkv).transpose(1, 2)
                if ma is not None:
                    att = att * ma.repeat_interleave(Hq // self.attn_groups, dim=-1)[..., None].to(att.dtype)
                o = F.linear(att.reshape(B * T, Hq * D), L.wo)
            x, hn = self._prefill_norm(x, o.view(B, T, -1), L.ffn_norm)
            mf = self._mask_torch(i, "ffn", x, hn, self._amask)
            if mf is not None:
                mf = mf & valid[..., None]
            delta = self._ffn(L, hn.reshape(B * T, -1), None if mf is None else mf.reshape(B * T, -1)).view(B, T, -1)
        if delta is not None:
            x = x + delta
        self._amask = None
        if not all_logits:
            x = x[torch.arange(B, device=self.device), lens - 1]
        return self.lm_head(_hf_rms(self.final_norm, x)).float()

    def _prefill_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], norm: nn.Module):
        """(x + delta, RMSNorm of it) for prefill rows ``[B, T, H]``: one launch on the kernel
        backend (one program per row; PyTorch's version is ~7 elementwise/reduction kernels,
        ~10 ms of a 4k-token prefill on an H200), the HF module otherwise. Same rounding."""
        if self.backend != "triton":
            x = x if delta is None else x + delta
            return x, _hf_rms(norm, x)
        B, T, H = x.shape
        resid, normed, _, _ = self._launch_norm_route(
            x.reshape(B * T, H), None if delta is None else delta.reshape(B * T, H), norm, None,
            chunk=triton.next_power_of_2(H))
        return resid.view(B, T, H), normed.view(B, T, H)

    def _reduce_k(self, x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, group_size: int, route):
        """O and down projections. Their inputs are exact zeros in inactive groups (the attention
        and ffn_up kernels write zeros there), so cuBLAS on the same input computes the same sum;
        gemm_k wins only where skipping saves more than it costs. With i.i.d. masks over many
        groups a prefill tile almost never has an empty group (bench/results/kernels.md: gemm_k
        0.6-0.8x of cuBLAS at T >= 64), while decode reads only the used groups' weights. So the
        faster of the two is measured once per shape and T bucket, on CUDA with autotuning on."""
        from .kernels import gemm_k
        return self._measured("gemm_k", x, w, group_size,
                              lambda: gemm_k(x, w, mask, group_size, route=route),
                              lambda: F.linear(x, w))

    def _measured(self, op: str, x, w, group_size: int, routed: Callable, dense: Callable,
                  routed_only: bool = False):
        """``routed()`` or ``dense()`` (cuBLAS; the same values wherever they are used), whichever
        was measured faster for this op, weight shape, group size and T bucket: once, on CUDA
        with autotuning on (K_CHOICES), else (or ``routed_only``) the routed kernel. Timed as
        CUDA-graph replays: eager timing of a ~20 us decode kernel measures mostly its Python
        launch cost, which made cuBLAS (one launch) win every T bucket."""
        from .kernels.routing import autotune_enabled, next_pow2
        from .timing import time_graph

        if routed_only:
            return routed()
        key = (op, tuple(w.shape), group_size, next_pow2(x.shape[0]), x.dtype)
        if key not in K_CHOICES and (self.device.type != "cuda" or not autotune_enabled()):
            return routed()
        pick = choose_fastest(key, {"routed": routed, "cublas": dense}, K_CHOICES, time_graph,
                              default="routed")
        return routed() if pick == "routed" else dense()

    def _ffn_up(self, L: _Layer, h: torch.Tensor, mf: torch.Tensor, route, router=None):
        """silu(h wg^T) * (h wu^T) on the active groups, zeros elsewhere. With many tokens per
        step (batched decode, short prompts) the union of their groups is ~every group and
        cuBLAS can be faster than skipping: measured (see _measured). A batch-1 deferred
        ``router`` needs the routed GEMV, which writes the mask."""
        from .kernels import ffn_up
        return self._measured("ffn_up", h, L.wg, self.ffn_gs,
                              lambda: ffn_up(h, L.wg, L.wu, mf, self.ffn_gs, route=route, router=router),
                              lambda: _silu_mul(F.linear(h, L.wg), F.linear(h, L.wu), mf, self.ffn_gs),
                              routed_only=router is not None)

    def _q_proj(self, L: _Layer, h: torch.Tensor, ma: torch.Tensor, route, router=None,
                fused_kv: bool = False):
        """Routed q (or q and the dense k/v tail, ``fused_kv``) vs cuBLAS, measured as in
        _ffn_up. cuBLAS's q of inactive heads is not zeroed: attention skips those heads and
        writes zeros for them, so nothing reads it."""
        from .kernels import gemm_mn
        w = L.wqkv if fused_kv else L.wq
        tail = L.wkv.shape[0] if fused_kv else 0
        gs = self.attn_gs * self.head_dim
        return self._measured("qkv" if fused_kv else "q", h, w, gs,
                              lambda: gemm_mn(h, w, ma, gs, route=route, dense_tail=tail, router=router),
                              lambda: F.linear(h, w), routed_only=router is not None)

    def _ffn(self, L: _Layer, h: torch.Tensor, mf: Optional[torch.Tensor]) -> torch.Tensor:
        if self.mode == "dense":
            gu = F.linear(h, L.wgu)
            if self.backend == "triton":
                I = gu.shape[1] // 2
                return F.linear(_silu_mul(gu[:, :I], gu[:, I:]), L.wd)
            g, u = gu.chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, L.wd)
        if mf is None:
            return F.linear(F.silu(F.linear(h, L.wg)) * F.linear(h, L.wu), L.wd)
        if self.backend == "triton":
            from .kernels import build_route
            route = build_route(mf)
            u = self._ffn_up(L, h, mf, route)
            return self._reduce_k(u, L.wd, mf, self.ffn_gs, route)
        u = F.silu(F.linear(h, L.wg)) * F.linear(h, L.wu)
        u = u * mf.repeat_interleave(self.ffn_gs, dim=-1).to(u.dtype)
        return F.linear(u, L.wd)

    # -------------------------------------------------------------- decode

    def _decode_eager(self, tok: torch.Tensor, pos: torch.Tensor, record: Optional[list] = None):
        """One new token per sequence at cache position ``pos`` [B]; returns logits [B, V]."""
        B = tok.shape[0]
        Hq, Hkv, D = self.num_heads, self.num_kv, self.head_dim
        kern = self.backend == "triton"
        x = self.embed(tok)
        delta = None
        seq_lens = (pos + 1).to(torch.int32)
        if kern:
            from .kernels import build_route, decode_attention
        # Batch 1 on the kernels: the q and gate/up GEMVs finish the router and write the masks
        # (WIDE_DEFER_ROUTER=0: the norm kernel does, as for larger batches; read when a step
        # runs eagerly, so a captured graph keeps the setting it was captured with).
        defer = kern and os.environ.get("WIDE_DEFER_ROUTER", "1") != "0"
        for i, L in enumerate(self.layers):
            x, hn, ma, rpa = self._norm_route(i, "attn", x, delta, defer=defer)
            self._amask = ma
            if record is not None:
                record.append((i, "attn", ma))
            if self.mode == "dense":
                qkv = F.linear(hn, L.wqkv)
                q, kv = qkv[:, :Hq * D], qkv[:, Hq * D:]
            elif ma is not None and kern and L.wqkv is not None:
                route_a = build_route(ma)
                qkv = self._q_proj(L, hn, ma, route_a, router=rpa, fused_kv=True)
                q, kv = qkv[:, :Hq * D], qkv[:, Hq * D:]
            else:
                kv = F.linear(hn, L.wkv)
                if ma is not None and kern:
                    route_a = build_route(ma)
                    q = self._q_proj(L, hn, ma, route_a, router=rpa)
                else:
                    q = F.linear(hn, L.wq)
            if kern:
                _rope_cache_kernel[(B, Hq + Hkv)](
                    q, kv, kv[:, Hkv * D:], self.cos, self.sin, pos, self.k_cache[i], self.v_cache[i],
                    Hq, q.stride(0), kv.stride(0), kv.stride(0), self.k_cache[i].stride(0),
                    self.k_cache[i].stride(1), self.k_cache[i].stride(2), HALF=D // 2)
                qh = q.unflatten(-1, (Hq, D))
                att = decode_attention(qh, self.k_cache[i], self.v_cache[i],
                                       ma if ma is not None else self._all_heads(B), seq_lens)
                att = att.reshape(B, Hq * D)
                if ma is not None:
                    o = self._reduce_k(att, L.wo, ma, self.attn_gs * D, route_a)
                else:
                    o = F.linear(att, L.wo)
            else:
                c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
                qh = _rope(q.unflatten(-1, (Hq, D)), c, s)
                k = _rope(kv[:, :Hkv * D].reshape(B, Hkv, D), c, s)
                bi = torch.arange(B, device=self.device)
                self.k_cache[i][bi, pos] = k
                self.v_cache[i][bi, pos] = kv[:, Hkv * D:].reshape(B, Hkv, D)
                keymask = torch.arange(self.k_cache[i].shape[1], device=self.device)[None, :] < seq_lens[:, None]
                att = F.scaled_dot_product_attention(
                    qh[:, :, None], self.k_cache[i].transpose(1, 2), self.v_cache[i].transpose(1, 2),
                    attn_mask=keymask[:, None, None, :], enable_gqa=Hq != Hkv)[:, :, 0]
                if ma is not None:
                    att = att * ma.repeat_interleave(Hq // self.attn_groups, dim=-1)[..., None].to(att.dtype)
                o = F.linear(att.reshape(B, Hq * D), L.wo)
            x, hn, mf, rpf = self._norm_route(i, "ffn", x, o, defer=defer)
            if record is not None:
                record.append((i, "ffn", mf))
            if mf is not None and kern:
                route_f = build_route(mf)
                u = self._ffn_up(L, hn, mf, route_f, router=rpf)
                delta = self._reduce_k(u, L.wd, mf, self.ffn_gs, route_f)
            else:
                delta = self._ffn(L, hn, mf)
        self._amask = None
        if kern:
            x, hn, _ = self._norm_route_final(x, delta)
        else:
            hn = _hf_rms(self.final_norm, x + delta)
        return self.lm_head(hn).float()

    def _all_heads(self, B: int) -> torch.Tensor:
        m = getattr(self, "_ones", None)
        if m is None or m.shape[0] != B:
            m = self._ones = torch.ones(B, self.attn_groups, dtype=torch.bool, device=self.device)
        return m

    def _norm_route_final(self, x, delta):
        resid, normed, _, _ = self._launch_norm_route(x, delta, self.final_norm, None)
        return resid, normed, None

    def _launch_norm_route(self, x, delta, norm, router, chunk: int = 256, defer: bool = False):
        """Residual add + RMSNorm (+ the router's mask when ``router`` is given) in one launch
        over (token, column chunk) programs; returns (residual, normed, mask [B, G] or None,
        RouterPartials or None). Every chunk program reads its whole row for the sum of
        squares, so many rows (prefill) take one program per row (``chunk`` >= H).
        ``defer`` (one token): only the router's partial sums are computed; the mask is left
        for the GEMV given the returned RouterPartials to write."""
        B, H = x.shape
        if defer and B != 1:
            raise ValueError(f"a deferred router needs one token, got {B}")
        resid = x if delta is None else torch.empty_like(x)
        normed = torch.empty_like(x)
        chunk = min(chunk, triton.next_power_of_2(H))
        nchunk = triton.cdiv(H, chunk)
        R = router.down.out_features if router is not None else 16
        G = router.num_groups if router is not None else 1
        mask = torch.empty((B, G), dtype=torch.bool, device=x.device) if router is not None else None
        if router is not None:
            # Scratch for the router's per-chunk partial sums and the per-token tickets.
            # Allocated once per shape (outside graph capture: the eager warm-up step comes
            # first), and the kernel leaves the tickets at zero, so a captured step can be
            # replayed as is.
            scratch = self.__dict__.setdefault("_nr_scratch", {})
            key = (B, nchunk, R)
            if key not in scratch:
                scratch[key] = (torch.empty((B, nchunk, R), dtype=torch.float32, device=x.device),
                                torch.zeros((B,), dtype=torch.int32, device=x.device))
            hp, cnt = scratch[key]
        else:
            hp = cnt = normed  # unused without a router
        w = norm.weight
        d = delta if delta is not None else x
        block = min(4096, triton.next_power_of_2(H))
        _norm_route_kernel[(B, nchunk)](
            x, d, resid, normed, w, norm.variance_epsilon,
            router.down.weight if router is not None else w,
            router.down.bias if router is not None else w,
            router.up.weight if router is not None else w,
            router.up.bias if router is not None else w,
            router.offset if router is not None else w,
            mask.view(torch.uint8) if mask is not None else normed, hp, cnt,
            H, G, nchunk, x.stride(0), d.stride(0), resid.stride(0), normed.stride(0),
            mask.stride(0) if mask is not None else 0,
            HAS_DELTA=delta is not None, ROUTE=router is not None,
            NORMED_IN=self.cfg is not None and self.cfg.router_input == "normed",
            R=R, BLOCK=block, CHUNK=chunk, NC_PAD=max(2, triton.next_power_of_2(nchunk)),
            G_PAD=max(16, triton.next_power_of_2(G)), FINAL=not defer,
            num_warps=8 if block >= 4096 else 4)
        if defer and router is not None:
            from .kernels import RouterPartials
            rp = RouterPartials(hp[0], router.down.bias, router.up.weight, router.up.bias,
                                router.offset)
            return resid, normed, mask, rp
        return resid, normed, mask, None

    @torch.no_grad()
    def decode(self, tok: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, V] for new tokens ``tok [B]`` at positions ``pos`` (default: the
        engine's position buffer, advanced by :meth:`generate`). CUDA-graph replay on GPU."""
        if self._cache_key is None:
            raise ValueError("call setup_cache first")
        if pos is not None:
            self.pos.copy_(pos)
        self.tok.copy_(tok)
        if not self.cuda_graphs or getattr(self.state, "mask_fn", None) is not None:
            return self._decode_eager(self.tok, self.pos)  # (a Python mask_fn is not captured)
        B = tok.shape[0]
        g = self._graphs.get(B)
        if g is None:
            g = self._capture(lambda: self._decode_eager(self.tok, self.pos))
            self._graphs[B] = g
        graph, out = g
        graph.replay()
        return out

    def _capture(self, step: Callable[[], torch.Tensor], pool=None):
        """(CUDA graph of ``step()``, its output buffer). ``step`` reads only static buffers.
        All captures share one stream: the caching allocator reuses a freed block only on the
        stream that allocated it, so graphs sharing a pool must be captured on one stream."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if HAS_TRITON:
            from .kernels.routing import fresh_split_tickets

            fresh_split_tickets(self.device, stream)  # this graph's own split-K counters
        # Warm-up on the capture stream: autotuning, compilation, the measured kernel choices
        # and per-stream scratch buffers must exist before capture. It writes k/v at the
        # current positions, which the replay then overwrites.
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            out = step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, out

    # -------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id=None, seed: Optional[int] = None,
                 pad_to: Optional[int] = None) -> GenerationResult:
        """Generate for a batch of prompts (lists of token ids, any lengths)."""
        import time

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        T = int(lens.max())
        max_len = max(pad_to or 0, T + max_new_tokens)
        max_len = -(-max_len // 128) * 128  # fewer distinct cache sizes, fewer graph captures
        self.setup_cache(B, max_len)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        ids, lens = ids.to(self.device), lens.to(self.device)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = _eos_set(eos_token_id)
        if eos is not None:
            eos = eos.to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.prefill(ids, lens)
        tok = sample_logits(logits, temperature, top_k, top_p, gen)
        sync()
        t1 = time.perf_counter()
        out = [tok]
        self.pos.copy_(lens)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        if eos is not None:
            done |= torch.isin(tok, eos)
        steps = 0
        for _ in range(max_new_tokens - 1):
            if eos is not None and bool(done.all()):
                break
            logits = self.decode(tok)
            self.pos += 1
            tok = sample_logits(logits, temperature, top_k, top_p, gen)
            out.append(tok)
            steps += 1
            if eos is not None:
                done |= torch.isin(tok, eos)
        sync()
        t2 = time.perf_counter()
        seqs = torch.stack(out, dim=1).tolist()
        if eos is not None:
            eset = set(eos.tolist())
            seqs = [s[:next((j + 1 for j, t in enumerate(s) if t in eset), len(s))] for s in seqs]
        return GenerationResult(tokens=seqs, ttft_s=t1 - t0, tpot_s=(t2 - t1) / max(steps, 1))

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [B, T, V] of unpadded prompts (for checks against the HF path)."""
        B, T = ids.shape
        if self._cache_key is None or self._cache_key[0] != B or self._cache_key[1] < T:
            self.setup_cache(B, -(-T // 128) * 128)
        return self.prefill(ids.to(self.device), all_logits=True)


def _eos_set(eos_token_id):
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long) if ids else None


def sample_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: greedy at temperature 0, else temperature, then
    top-k, then nucleus (top-p) filtering and one multinomial draw per row."""
    if temperature is None or temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_l, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_l, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_l)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def accelerate(model, backend: str = "auto", mode: str = "routed",
               cuda_graphs: bool = True) -> AcceleratedModel:
    """Build the static-cache engine for a wrapped model (see the module docstring).

    The HF model is not modified: ``model(...)`` and ``model.generate(...)`` keep running the
    masked PyTorch path. The engine is also kept as ``model.wide_engine`` for
    :func:`generate`.
    """
    engine = AcceleratedModel(model, backend=backend, mode=mode, cuda_graphs=cuda_graphs)
    if mode == "routed":
        model.wide_engine = engine
    return engine


def generate(model, tokenizer_or_ids, prompts=None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id=None, seed: Optional[int] = None) -> GenerationResult:
    """Generate with the accelerated engine.

    ``model``: a wrapped HF model (accelerated on first use) or an :class:`AcceleratedModel`.
    ``tokenizer_or_ids``: a tokenizer (then ``prompts`` is a string or list of strings and the
    result carries ``texts``), or the prompts as token ids: a 1-D/2-D tensor, a list of ints or
    a list of lists of ints (any lengths).
    """
    engine = model if isinstance(model, AcceleratedModel) else (
        getattr(model, "wide_engine", None) or accelerate(model))
    tokenizer = None
    if hasattr(tokenizer_or_ids, "encode") and not isinstance(tokenizer_or_ids, torch.Tensor):
        tokenizer = tokenizer_or_ids
        if prompts is None:
            raise ValueError("give the prompts (a string or list of strings) with the tokenizer")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [tokenizer.encode(t) for t in texts]
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    else:
        ids = _as_id_lists(tokenizer_or_ids)
    res = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, eos_token_id=eos_token_id, seed=seed)
    if tokenizer is not None:
        res.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
    return res


def _as_id_lists(x) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() == 1:
            return [x.tolist()]
        if x.dim() == 2:
            return x.tolist()
        raise ValueError(f"token id tensor must be 1-D or 2-D, got {x.dim()}-D")
    x = list(x)
    if x and all(isinstance(t, int) for t in x):
        return [x]
    if x and all(isinstance(p, (list, tuple, torch.Tensor)) for p in x):
        return [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in x]
    raise ValueError("prompts must be token ids (tensor, list of ints or list of lists) or come "
                     "with a tokenizer")
