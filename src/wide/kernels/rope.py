"""RoPE + KV-cache write (``rope_prefill``, ``rope_decode``): one launch per layer rotates q in
place and writes rotated k and v into the static cache, for the routed and the dense engine.

PyTorch's RoPE (cat, muls, adds, cache copies) was ~8 ms of a 4k-token prefill on an H200. The
launch also applies what some families do to q/k/v between the projection and RoPE, so those
cost no extra pass either:

* ``bias`` ([bq; bk; bv], Qwen2): added to q, k and v, rounded to the model dtype. The
  projection GEMMs run without bias (the routed q GEMM has no bias epilogue), so the sum is
  rounded twice where HF's ``F.linear(x, w, b)`` may round once: at most one ulp apart.
* ``qk_norm`` ([q_norm; k_norm] weights, [2 * D], Qwen3): per-head RMSNorm of q and k before RoPE,
  rounded where HF's ``Qwen3RMSNorm`` rounds (fp32 statistics, ``x * rstd`` in the model dtype,
  then the weight product).

The rotation rounds like HF's ``q*cos + rotate_half(q)*sin`` in the model dtype: after each
product and after the sum.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .reference import apply_rope, rms_norm_reference

__all__ = ["rope_prefill", "rope_decode", "rope_reference"]


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
def _bias_norm(x1, x2, h, is_k, b_ptr, n_ptr, eps, d, HALF: tl.constexpr, AXIS: tl.constexpr,
               HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    # Bias of head h (of [q heads; k heads; v heads]) and the per-head RMSNorm (weights
    # [q_norm; k_norm], row is_k), on the two halves of a head: [rows, HALF] (AXIS 1) or
    # [HALF] (AXIS 0). Both are compiled out when off, leaving x1, x2 as loaded.
    dt = x1.dtype
    if HAS_BIAS:
        x1 = (x1.to(tl.float32) + tl.load(b_ptr + h * 2 * HALF + d).to(tl.float32)).to(dt)
        x2 = (x2.to(tl.float32) + tl.load(b_ptr + h * 2 * HALF + HALF + d).to(tl.float32)).to(dt)
    if NORM:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        ss = tl.sum(x1f * x1f, axis=AXIS, keep_dims=True) + tl.sum(x2f * x2f, axis=AXIS, keep_dims=True)
        rstd = 1.0 / tl.sqrt(ss / (2 * HALF) + eps)
        w = n_ptr + is_k * 2 * HALF
        x1 = ((x1f * rstd).to(dt).to(tl.float32) * tl.load(w + d).to(tl.float32)).to(dt)
        x2 = ((x2f * rstd).to(dt).to(tl.float32) * tl.load(w + HALF + d).to(tl.float32)).to(dt)
    return x1, x2


@triton.jit
def _rope_prefill_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, T, Hq,
                         stride_q, stride_k, stride_v, stride_cb, stride_ct, stride_ch,
                         b_ptr, n_ptr, eps,
                         BT: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
                         QK_NORM: tl.constexpr):
    # Program (token block, sequence b, head h): positions 0..T-1 of right-padded prompts.
    # h < Hq rotates q head h in place; otherwise KV head h - Hq is rotated and written,
    # with v, to the cache.
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
    x1, x2 = _bias_norm(tl.load(base + d, mask=ok, other=0.0), tl.load(base + HALF + d, mask=ok, other=0.0),
                        h, (h >= Hq).to(tl.int32), b_ptr, n_ptr, eps, d, HALF, 1, HAS_BIAS, QK_NORM)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2)
    if h < Hq:
        tl.store(base + d, o1, mask=ok)
        tl.store(base + HALF + d, o2, mask=ok)
    else:
        kh = h - Hq
        dst = b * stride_cb + t[:, None].to(tl.int64) * stride_ct + kh * stride_ch
        tl.store(kc_ptr + dst + d, o1, mask=ok)
        tl.store(kc_ptr + dst + HALF + d, o2, mask=ok)
        vb = v_ptr + row * stride_v + kh * 2 * HALF
        # v's bias follows every k head's: head index h + Hkv of [q; k; v].
        v1, v2 = _bias_norm(tl.load(vb + d, mask=ok, other=0.0), tl.load(vb + HALF + d, mask=ok, other=0.0),
                            h + tl.num_programs(2) - Hq, 1, b_ptr, n_ptr, eps, d, HALF, 1, HAS_BIAS, False)
        tl.store(vc_ptr + dst + d, v1, mask=ok)
        tl.store(vc_ptr + dst + HALF + d, v2, mask=ok)


@triton.jit
def _take(p, HALF: tl.constexpr, dt, CLEAR: tl.constexpr):
    """The two halves of one head at ``p`` in the model dtype ``dt`` (fp32 sums rounded, as the
    GEMV's epilogue would have rounded them); ``CLEAR``: zeroed after every thread's load, for
    the sums' next producer. Each head of the sums is this program's alone."""
    d = tl.arange(0, HALF)
    r1 = tl.load(p + d)
    r2 = tl.load(p + HALF + d)
    if CLEAR:
        # a [HALF] tensor is replicated over the warps: no zero lands before every replica's load
        tl.debug_barrier()
        tl.store(p + d, tl.zeros_like(r1))
        tl.store(p + HALF + d, tl.zeros_like(r2))
    return r1.to(dt), r2.to(dt)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr,
                       Hq, stride_q, stride_k, stride_v, stride_cb, stride_ct, stride_ch,
                       b_ptr, n_ptr, eps, qo_ptr, stride_qo,
                       HALF: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                       CLEAR: tl.constexpr, PDL: tl.constexpr = False):
    # Program (b, h): h < Hq rotates q head h (into qo, q itself unless given another);
    # otherwise KV head h - Hq is rotated and written, with v, to the cache at the sequence's
    # position.
    dt = kc_ptr.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pdl.wait(PDL)
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
    xa, xb = _take(base, HALF, dt, CLEAR)
    pdl.release(PDL)
    x1, x2 = _bias_norm(xa, xb, h, (h >= Hq).to(tl.int32), b_ptr, n_ptr, eps, d, HALF, 0, HAS_BIAS, QK_NORM)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2)
    if h < Hq:
        qo = qo_ptr + b * stride_qo + h * 2 * HALF
        tl.store(qo + d, o1)
        tl.store(qo + HALF + d, o2)
    else:
        kh = h - Hq
        dst = b * stride_cb + pos * stride_ct + kh * stride_ch
        tl.store(kc_ptr + dst + d, o1)
        tl.store(kc_ptr + dst + HALF + d, o2)
        va, vb = _take(v_ptr + b * stride_v + kh * 2 * HALF, HALF, dt, CLEAR)
        v1, v2 = _bias_norm(va, vb, h + tl.num_programs(1) - Hq, 1, b_ptr, n_ptr, eps, d, HALF, 0, HAS_BIAS, False)
        tl.store(vc_ptr + dst + d, v1)
        tl.store(vc_ptr + dst + HALF + d, v2)


def _extras(q, bias, qk_norm, eps):
    """The optional arguments of both kernels: pointers (q as a never-read placeholder), eps
    and the flags that compile their use in or out."""
    return ((bias if bias is not None else q, qk_norm if qk_norm is not None else q, float(eps)),
            dict(HAS_BIAS=bias is not None, QK_NORM=qk_norm is not None))


def rope_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, *,
                 bias: Optional[torch.Tensor] = None, qk_norm: Optional[torch.Tensor] = None,
                 eps: float = 0.0) -> None:
    """Prompt positions 0..T-1 of ``batch`` right-padded sequences: ``q [B*T, Hq*D]`` is rotated
    in place; ``k``, ``v`` ``[B*T, Hkv*D]`` (row views, unit column stride) are rotated / copied
    to ``k_cache``/``v_cache [B, >=T, Hkv, D]``. ``cos``/``sin`` ``[>=T, D]``. ``bias``
    ``[(Hq + 2 Hkv) * D]`` (q, k, v), ``qk_norm`` ``[2 * D]`` (q_norm then k_norm weights) with
    ``eps``: see the module docstring."""
    T = q.shape[0] // batch
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    Hq = q.shape[1] // D
    args, flags = _extras(q, bias, qk_norm, eps)
    _rope_prefill_kernel[(triton.cdiv(T, 32), batch, Hq + Hkv)](
        q, k, v, cos, sin, k_cache, v_cache, T, Hq, q.stride(0), k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *args,
        BT=32, HALF=D // 2, **flags)


def rope_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                *, bias: Optional[torch.Tensor] = None, qk_norm: Optional[torch.Tensor] = None,
                eps: float = 0.0, q_out: Optional[torch.Tensor] = None, clear: bool = False) -> None:
    """One new token per sequence at cache position ``pos [B]``: ``q [B, Hq*D]`` rotated in
    place, ``k``/``v`` ``[B, Hkv*D]`` rotated / copied into the caches; as :func:`rope_prefill`.

    ``q``, ``k`` and ``v`` may be fp32 sums (``fine_gemv(acc_out=...)``) where the cache holds a
    half-precision dtype: each value is rounded to the cache's dtype first, as the GEMV's own
    rounding would have, so the results are the same. ``q_out`` ``[B, Hq*D]`` in the cache's
    dtype: the rotated q goes there instead (needed for fp32 sums). ``clear``: the launch zeros
    ``q``, ``k`` and ``v`` once read (each head is one program's), re-armed for the next sums."""
    B = q.shape[0]
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    Hq = q.shape[1] // D
    _check_decode_io(q, k, v, k_cache, q_out, clear)
    args, flags = _extras(q, bias, qk_norm, eps)
    qo = q if q_out is None else q_out
    _rope_cache_kernel[(B, Hq + Hkv)](
        q, k, v, cos, sin, pos, k_cache, v_cache, Hq, q.stride(0), k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *args, qo, qo.stride(0), HALF=D // 2,
        CLEAR=clear, **flags, **pdl.launch_kwargs(q.device))


def _check_decode_io(q, k, v, k_cache, q_out, clear) -> None:
    dt = k_cache.dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (dt, torch.float32):
            raise ValueError(f"{name} must be {dt} (the cache's dtype) or float32 sums, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit column stride")
    if q_out is None:
        if q.dtype != dt:
            raise ValueError(f"fp32 sums need q_out: q is rotated into a {dt} tensor of its own")
        if clear:
            raise ValueError("clear zeros q once read: give q_out for the rotated q")
        return
    if tuple(q_out.shape) != tuple(q.shape) or q_out.dtype != dt or q_out.device != q.device \
            or q_out.stride(-1) != 1:
        raise ValueError(f"q_out must be a {list(q.shape)} {dt} tensor on {q.device} with unit column stride")


def rope_reference(q, k, v, cos, sin, *, bias=None, qk_norm=None, eps=0.0):
    """fp32 PyTorch reference of both kernels on head tensors ``q [..., Hq, D]``, ``k``/``v``
    ``[..., Hkv, D]`` with ``cos``/``sin`` broadcastable ``[..., 1, D]`` (each token's position):
    ``(q, k, v)`` after bias, per-head norm and rotation, as the cache and q receive them."""
    q, k, v = q.float(), k.float(), v.float()
    Hq, Hkv, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if bias is not None:
        b = bias.float().view(Hq + 2 * Hkv, D)
        q, k, v = q + b[:Hq], k + b[Hq:Hq + Hkv], v + b[Hq + Hkv:]
    if qk_norm is not None:
        q, k = rms_norm_reference(q, qk_norm[:D], eps), rms_norm_reference(k, qk_norm[D:], eps)
    return apply_rope(q, cos.float(), sin.float()), apply_rope(k, cos.float(), sin.float()), v
