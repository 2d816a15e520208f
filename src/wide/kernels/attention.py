"""Routed attention kernels: prefill and decode that skip inactive head groups.

A *head group* is ``Hq // G`` contiguous query heads; ``mask[..., g]`` True means the group
runs for that token. Default ``G = Hkv`` (one GQA pack per group), so in decode an inactive
group means its KV head is never read.

Prefill (:func:`prefill_attention`)
    q [B, T, Hq, D], k/v [B, Tk, Hkv, D], mask [B, T, G] bool. Query row ``t`` sits at key
    position ``t + Tk - T`` (chunked prefill / prefix reuse). Variable-length batches use
    *per-sequence lengths with padding* (``q_lens``/``k_lens``, int32 [B]) on either side:
    ``padding_side="right"`` (valid rows ``0..q_len-1``, keys ``0..k_len-1``) or
    ``"left"`` (valid rows ``T-q_len..T-1``, keys ``Tk-k_len..Tk-1``). Padding rows and inactive
    (token, group) pairs produce exact zeros. cu_seqlens (packed) layouts are not supported.

    A routing kernel turns the mask into, per (sequence, group), a permutation of the rows with
    the active rows first in increasing order (like an MoE per-expert token list) and a count.
    The attention kernel's tiles then hold only active rows; tiles past the count only write
    zeros; a tile's causal key loop stops at the largest position it actually holds, and keys
    below its smallest position run without masking. (``wide.kernels.routing`` did not exist
    when this was written, so the compaction is a local kernel: ``_route_rows_kernel``.)

Decode (:func:`decode_attention`)
    q [B, Hq, D], mask [B, G], per-sequence ``seq_lens`` (keys 0..len-1, new token included),
    contiguous k/v [B, Tk_max, Hkv, D] or paged k/v [num_blocks, block_size, Hkv, D] with
    ``block_table`` [B, max_blocks]. Split-KV flash decoding: one program per (split, sequence,
    KV head) handles all query heads of that KV head, returns before any K/V load when none of
    them is active, and writes fp32 partials; a combine kernel merges the splits in fp32 and
    writes zeros for inactive heads. The combine walks the splits in fixed blocks (online
    rescaling over their log2-sum-exps), so its registers are bounded for any split count, and
    at small batch it also splits the head dim across programs. The split count is autotuned
    per shape on CUDA (heuristic x {1/4, 1/2, 1, 2}, timed once per shape key outside graph
    capture, then cached; see :func:`decode_split_plan`). (A fused "last split combines"
    variant with atomic arrival counters was measured slower on the H200 - its serial merge
    loop sat on the critical path, e.g. B=1 Tk=4k 17.0 us vs 10.6 us - and was dropped; see
    bench/results/attention_notes.md.)

Both are graph-capturable: grids depend on shapes only, counts stay on the device.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from .env import autotune_enabled, interpret_mode, num_sms

try:  # Triton is optional on CPU-only installs; the fp32 references work without it.
    import triton
    import triton.language as tl

    from . import pdl
    from .fp32_dot import dot as _dot

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    _dot = None
    HAS_TRITON = False

__all__ = [
    "prefill_attention",
    "prefill_attention_reference",
    "decode_attention",
    "decode_attention_reference",
    "route_rows",
    "decode_splits",
    "decode_split_plan",
    "decode_split_candidates",
]

_LOG2E = 1.4426950408889634
_SUPPORTED_HEAD_DIMS = (64, 128)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# fp32 references
# --------------------------------------------------------------------------------------------


def _row_key_ranges(B, T, Tk, q_lens, k_lens, padding_side, device):
    """Per (b, t): valid flag, first key, last causal key (inclusive) in padded coordinates."""
    t = torch.arange(T, device=device)
    if q_lens is None:
        q_lens_ = torch.full((B,), T, device=device, dtype=torch.long)
    else:
        q_lens_ = q_lens.to(device=device, dtype=torch.long)
    if k_lens is None:
        k_lens_ = torch.full((B,), Tk, device=device, dtype=torch.long)
    else:
        k_lens_ = k_lens.to(device=device, dtype=torch.long)
    if padding_side == "right":
        valid = t[None, :] < q_lens_[:, None]
        kstart = torch.zeros(B, device=device, dtype=torch.long)
        kend = k_lens_
        delta = k_lens_ - q_lens_
    else:
        valid = t[None, :] >= (T - q_lens_)[:, None]
        kstart = Tk - k_lens_
        kend = torch.full((B,), Tk, device=device, dtype=torch.long)
        delta = torch.full((B,), Tk - T, device=device, dtype=torch.long)
    return valid, kstart, kend, delta


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    q_lens: Optional[torch.Tensor] = None,
    k_lens: Optional[torch.Tensor] = None,
    padding_side: str = "right",
    chunk: int = 1024,
) -> torch.Tensor:
    """fp32 PyTorch reference of :func:`prefill_attention` (same arguments), chunked over rows."""
    B, T, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = mask.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    qf, kf, vf = q.float(), k.float(), v.float()
    rep = Hq // Hkv
    kf = kf.repeat_interleave(rep, dim=2).permute(0, 2, 3, 1)  # [B, Hq, D, Tk]
    vf = vf.repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)  # [B, Hq, Tk, D]
    valid, kstart, kend, delta = _row_key_ranges(B, T, Tk, q_lens, k_lens, padding_side, dev)
    head_mask = mask.bool().repeat_interleave(Hq // G, dim=2) & valid[:, :, None]  # [B,T,Hq]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float32, device=dev)
    j = torch.arange(Tk, device=dev)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s = torch.matmul(qf[:, t0:t1].permute(0, 2, 1, 3), kf) * scale  # [B, Hq, c, Tk]
        allowed = (j[None, None, :] >= kstart[:, None, None]) & (j[None, None, :] < kend[:, None, None])
        if causal:
            tt = torch.arange(t0, t1, device=dev)
            allowed = allowed & (j[None, None, :] <= (tt[None, :, None] + delta[:, None, None]))
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key give 0, not NaN
        o = torch.matmul(p, vf).permute(0, 2, 1, 3)  # [B, c, Hq, D]
        out[:, t0:t1] = torch.where(head_mask[:, t0:t1, :, None], o, torch.zeros_like(o))
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """fp32 PyTorch reference of :func:`decode_attention` (same arguments)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = mask.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    head_mask = mask.bool().repeat_interleave(Hq // G, dim=1)
    lens = seq_lens.tolist()
    for b in range(B):
        n = int(lens[b])
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            bs = k_cache.shape[1]
            nblk = (n + bs - 1) // bs
            ids = block_table[b, :nblk].long()
            kb = k_cache[ids].reshape(-1, Hkv, D)[:n]
            vb = v_cache[ids].reshape(-1, Hkv, D)[:n]
        kb = kb.float().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        vb = vb.float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("hn,nhd->hd", p, vb)
        out[b] = torch.where(head_mask[b, :, None], o, torch.zeros_like(o))
    return out


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check_float(name, x, dtype=None):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {dtype} (same as q)")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dimension")


def _check_lens(name, x, B, device):
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != B:
        raise ValueError(f"{name} must be a 1-D tensor of length B={B}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")


def _check_groups(G, Hq, Hkv):
    if Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv}")
    if G <= 0 or Hq % G != 0:
        raise ValueError(f"mask has G={G} groups, which must divide the query heads Hq={Hq}")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _seq_window(qlen_ptr, klen_ptr, b, T, Tk,
                    HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, LEFT: tl.constexpr):
        # Derived in-kernel (not with torch ops on the host) to keep the eager launch path short.
        if HAS_QLEN:
            ql = tl.load(qlen_ptr + b).to(tl.int32)
        else:
            ql = T
        if HAS_KLEN:
            kl = tl.load(klen_ptr + b).to(tl.int32)
        else:
            kl = Tk
        if LEFT:
            q0 = T - ql
            q1 = T
            kstart = Tk - kl
            kend = Tk
            delta = Tk - T
        else:
            q0 = 0
            q1 = ql
            kstart = 0
            kend = kl
            delta = kl - ql
        return q0, q1, kstart, kend, delta

    @triton.jit
    def _route_rows_kernel(
        mask_ptr, perm_ptr, count_ptr, qlen_ptr, klen_ptr,
        T, Tk, G,
        stride_mb, stride_mt, stride_mg,
        HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, LEFT: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        # One program per (sequence, group): a running prefix sum over rows gives each active
        # row its slot in the compacted list; inactive rows fill the list from the back, so the
        # whole permutation is written in one pass and tiles past `count` know which rows to
        # zero.
        pid = tl.program_id(0)
        b = pid // G
        g = pid % G
        q0, q1, _ks, _ke, _dl = _seq_window(qlen_ptr, klen_ptr, b, T, Tk, HAS_QLEN, HAS_KLEN, LEFT)
        base_m = mask_ptr + b * stride_mb + g * stride_mg
        base_p = perm_ptr + pid.to(tl.int64) * T
        n_act = 0
        n_off = 0
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            inb = t < T
            m = tl.load(base_m + t * stride_mt, mask=inb, other=0)
            act = (m != 0) & (t >= q0) & (t < q1) & inb
            a_i = act.to(tl.int32)
            o_i = ((~act) & inb).to(tl.int32)
            ca = tl.cumsum(a_i, 0)
            co = tl.cumsum(o_i, 0)
            slot = tl.where(act, n_act + ca - 1, T - (n_off + co))
            tl.store(base_p + slot, t, mask=inb)
            n_act += tl.sum(a_i, 0)
            n_off += tl.sum(o_i, 0)
        tl.store(count_ptr + pid, n_act)

    @triton.jit
    def _prefill_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
        lo, hi, kstart, kend, kmax_row,
        qk_scale, offs_n, offs_d,
        MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            if MASKED:
                kv_ok = (cols >= kstart) & (cols < kend)
                k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None],
                            mask=kv_ok[None, :], other=0.0)
            else:
                k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None])
            qk = _dot(q, k, None)
            if MASKED:
                ok = kv_ok[None, :] & (cols[None, :] <= kmax_row[:, None])
                # A finite fill keeps fully-masked rows NaN-free; their sums are wiped by the
                # alpha = 0 rescale at the first block that holds a real key for the row.
                qk = tl.where(ok, qk * qk_scale, -1.0e30)
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                qk = qk - m_ij[:, None]
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                qk = qk * qk_scale - m_ij[:, None]
            p = tl.math.exp2(qk)
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if MASKED:
                vv = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                             mask=kv_ok[:, None], other=0.0)
            else:
                vv = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])
            acc = _dot(p.to(vv.dtype), vv, acc)
            m_i = m_ij
        return acc, l_i, m_i

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, perm_ptr, count_ptr, qlen_ptr, klen_ptr,
        T, Tk, Hq, G, qk_scale, T_BUCKET,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_ob, stride_ot, stride_oh,
        HEADS_PER_KV: tl.constexpr, HEADS_PER_G: tl.constexpr,
        CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
        HAS_QLEN: tl.constexpr, HAS_KLEN: tl.constexpr, LEFT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # Heads vary fastest so the heaviest (last) tiles of every head start first and the
        # heads sharing a KV head run side by side over the same keys (L2 reuse).
        pid_bh = tl.program_id(0)
        m_blk = tl.num_programs(1) - 1 - tl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        g = h // HEADS_PER_G
        kvh = h // HEADS_PER_KV
        bg = b * G + g
        count = tl.load(count_ptr + bg)

        offs_r = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        in_t = offs_r < T
        rows = tl.load(perm_ptr + bg.to(tl.int64) * T + offs_r, mask=in_t, other=0)
        o_rows = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + rows.to(tl.int64) * stride_ot
        if m_blk * BLOCK_M >= count:
            # Tile of inactive rows only: no loads, just the exact zeros.
            tl.store(o_rows[:, None] + offs_d[None, :],
                     tl.zeros([BLOCK_M, HEAD_DIM], dtype=o_ptr.dtype.element_ty),
                     mask=in_t[:, None])
            return
        active = offs_r < count
        _q0, _q1, kstart, kend, delta = _seq_window(qlen_ptr, klen_ptr, b, T, Tk,
                                                    HAS_QLEN, HAS_KLEN, LEFT)
        if CAUSAL:
            kmax_row = tl.where(active, rows + delta, -1)
            kmax_row = tl.minimum(kmax_row, kend - 1)
            row_hi = tl.max(kmax_row, 0) + 1
            row_lo = tl.min(tl.where(active, kmax_row, 2147483647), 0) + 1
        else:
            kmax_row = tl.where(active, kend - 1, -1)
            row_hi = kend
            row_lo = kend

        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
                    + rows.to(tl.int64)[:, None] * stride_qt + offs_d[None, :],
                    mask=active[:, None], other=0.0)
        k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
        v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Keys in [full_lo, full_hi) are visible to every active row of the tile: no masks.
        # The smallest position held bounds full_hi, the largest bounds the whole loop.
        head_lo = (kstart // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(((kstart + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, row_hi)
        full_hi = tl.maximum((row_lo // BLOCK_N) * BLOCK_N, full_lo)
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       head_lo, full_lo, kstart, kend, kmax_row, qk_scale,
                                       offs_n, offs_d, True, BLOCK_N)
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       full_lo, full_hi, kstart, kend, kmax_row, qk_scale,
                                       offs_n, offs_d, False, BLOCK_N)
        acc, l_i, m_i = _prefill_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       full_hi, row_hi, kstart, kend, kmax_row, qk_scale,
                                       offs_n, offs_d, True, BLOCK_N)
        has_key = active & (kmax_row >= kstart)
        l_safe = tl.where(has_key, l_i, 1.0)
        out = tl.where(has_key[:, None], acc / l_safe[:, None], 0.0)
        tl.store(o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=in_t[:, None])

    _PREFILL_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        # fp32 (tf32x3 dots stage each operand twice): 128 KB at head dim 128, where the tiles
        # above need 256-512 KB of the 227 KB a block may have
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    ]
    _prefill_kernel_tuned = triton.autotune(
        configs=_PREFILL_CONFIGS, key=["HEAD_DIM", "CAUSAL", "HEADS_PER_KV", "T_BUCKET"]
    )(_prefill_kernel)

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, lens_ptr, table_ptr, po_ptr, plse_ptr,
        Hq, Hkv, G, qk_scale, chunk, block_size,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_mb, stride_tb,
        NUM_SPLITS: tl.constexpr,
        HEADS_PER_KV: tl.constexpr, HEADS_PER_G: tl.constexpr,
        PAGED: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
    ):
        split = tl.program_id(0)
        pid = tl.program_id(1)
        pdl.wait(PDL)
        b = pid // Hkv
        kvh = pid % Hkv
        offs_h = tl.arange(0, BLOCK_H)
        heads = kvh * HEADS_PER_KV + offs_h
        h_ok = offs_h < HEADS_PER_KV
        gm = tl.load(mask_ptr + b * stride_mb + heads // HEADS_PER_G, mask=h_ok, other=0)
        row_on = (gm != 0) & h_ok
        n = tl.load(lens_ptr + b)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n)
        # The whole point: an inactive KV head (or an empty split) returns before any K/V load.
        # The combine kernel re-derives both conditions, so nothing needs to be written here.
        if (tl.max(row_on.to(tl.int32), 0) == 0) | (lo >= hi):
            return
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None], other=0.0)
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        if PAGED:
            k_base = k_ptr + kvh * stride_kh
            v_base = v_ptr + kvh * stride_vh
        else:
            k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
            v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            ok = cols < hi
            if PAGED:
                blk = tl.load(table_ptr + b * stride_tb + cols // block_size, mask=ok, other=0)
                k_off = blk.to(tl.int64) * stride_kb + (cols % block_size) * stride_kt
                v_off = blk.to(tl.int64) * stride_vb + (cols % block_size) * stride_vt
            else:
                k_off = cols.to(tl.int64) * stride_kt
                v_off = cols.to(tl.int64) * stride_vt
            k = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=ok[None, :], other=0.0)
            qk = _dot(q, k, None)
            qk = tl.where(ok[None, :], qk * qk_scale, -1.0e30)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None]
            acc = _dot(p.to(vv.dtype), vv, acc)
            m_i = m_ij
        pdl.release(PDL)  # late: the combine's programs would take this launch's SM room
        # Partials are normalised with their log2-sum-exp so the combine is a weighted average.
        out_rows = (b * Hq + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(po_ptr + out_rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
                 mask=h_ok[:, None])
        tl.store(plse_ptr + out_rows, m_i + tl.math.log2(l_i), mask=h_ok)

    # Decode is bandwidth-bound: what matters is the bytes in flight per SM, traded between
    # tile depth (BLOCK_N, stages) and resident CTAs (72 KB smem at 64/3 -> 3 CTAs per SM).
    _DECODE_CONFIGS = [
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
    ]
    _decode_split_kernel_tuned = triton.autotune(
        configs=_DECODE_CONFIGS, key=["HEAD_DIM", "PAGED", "BLOCK_H", "NUM_SPLITS", "chunk"]
    )(_decode_split_kernel)

    @triton.jit
    def _decode_combine_kernel(
        po_ptr, plse_ptr, mask_ptr, lens_ptr, o_ptr,
        Hq, chunk,
        stride_mb, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, HEADS_PER_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl.wait(PDL)
        # One program per (sequence, query head, BLOCK_D slice of the head dim). The splits are
        # merged BLOCK_S at a time with an online rescaling (running max of the log2-sum-exps),
        # so registers stay at BLOCK_S x BLOCK_D fp32 whatever the split count; a block's lse
        # and partial loads are issued together (one dependent round trip per block).
        pid = tl.program_id(0)
        b = pid // Hq
        h = pid % Hq
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        on = tl.load(mask_ptr + b * stride_mb + h // HEADS_PER_G) != 0
        o_base = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
        if on:
            n = tl.load(lens_ptr + b)
            # Splits past the sequence never ran (the split kernel returned before writing).
            n_split = tl.minimum(tl.cdiv(n, chunk), NUM_SPLITS)
            row0 = pid.to(tl.int64) * NUM_SPLITS
            offs_s = tl.arange(0, BLOCK_S)
            # First block peeled: it holds split 0, so m is finite whenever n >= 1.
            s_ok = offs_s < n_split
            lse = tl.load(plse_ptr + row0 + offs_s, mask=s_ok, other=-float("inf"))
            part = tl.load(po_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=s_ok[:, None], other=0.0)
            m = tl.max(lse, 0)
            m_ref = tl.where(m > -float("inf"), m, 0.0)  # n == 0: no -inf - -inf
            w = tl.where(s_ok, tl.math.exp2(lse - m_ref), 0.0)
            acc = tl.sum(part * w[:, None], 0)
            l_sum = tl.sum(w, 0)
            for s0 in range(BLOCK_S, n_split, BLOCK_S):
                offs = s0 + offs_s
                s_ok = offs < n_split
                lse = tl.load(plse_ptr + row0 + offs, mask=s_ok, other=-float("inf"))
                part = tl.load(po_ptr + (row0 + offs)[:, None] * HEAD_DIM + offs_d[None, :],
                               mask=s_ok[:, None], other=0.0)
                m_new = tl.maximum(m, tl.max(lse, 0))
                # m == m_new also covers -inf == -inf (n == 0), where exp2(m - m_new) is NaN.
                alpha = tl.where(m_new == m, 1.0, tl.math.exp2(m - m_new))
                w = tl.where(s_ok, tl.math.exp2(lse - m_new), 0.0)
                acc = acc * alpha + tl.sum(part * w[:, None], 0)
                l_sum = l_sum * alpha + tl.sum(w, 0)
                m = m_new
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)  # an empty sequence gives zeros
            tl.store(o_base + offs_d, out.to(o_ptr.dtype.element_ty))
        else:
            tl.store(o_base + offs_d, tl.zeros([BLOCK_D], dtype=o_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# Python entry points
# --------------------------------------------------------------------------------------------


def route_rows(mask: torch.Tensor, q_lens: Optional[torch.Tensor] = None,
               k_lens: Optional[torch.Tensor] = None, padding_side: str = "right", Tk: Optional[int] = None):
    """Per (sequence, group), rows ordered active-first (increasing), and the active counts.

    mask [B, T, G] bool; padding rows (from ``q_lens``/``padding_side``) count as inactive.
    Returns ``perm`` int32 [B, G, T] (a permutation of 0..T-1 per (b, g): active rows first,
    then the inactive ones) and ``count`` int32 [B, G]; no host sync.
    """
    B, T, G = mask.shape
    perm = torch.empty(B, G, T, dtype=torch.int32, device=mask.device)
    count = torch.empty(B, G, dtype=torch.int32, device=mask.device)
    m8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    block_t = min(4096, triton.next_power_of_2(max(T, 16)))
    _route_rows_kernel[(B * G,)](
        m8, perm, count, q_lens if q_lens is not None else count,
        k_lens if k_lens is not None else count, T, Tk if Tk is not None else T, G,
        m8.stride(0), m8.stride(1), m8.stride(2),
        HAS_QLEN=q_lens is not None, HAS_KLEN=k_lens is not None, LEFT=padding_side == "left",
        BLOCK_T=block_t,
    )
    return perm, count


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    q_lens: Optional[torch.Tensor] = None,
    k_lens: Optional[torch.Tensor] = None,
    padding_side: str = "right",
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
) -> torch.Tensor:
    """Causal GQA prefill attention that runs only the active (token, head-group) pairs.

    q [B, T, Hq, D]; k, v [B, Tk, Hkv, D] (Tk >= T; query row t sits at key position
    t + Tk - T); mask [B, T, G] bool with G dividing Hq (group g = query heads
    g*Hq/G .. (g+1)*Hq/G - 1). D must be 64 or 128. Optional ``q_lens``/``k_lens`` (int [B])
    give per-sequence lengths inside the padded tensors, padded on ``padding_side``
    ("right" or "left"); see the module docstring. Returns [B, T, Hq, D] in q's dtype with
    exact zeros for inactive pairs and padding rows. ``block_m``/``block_n`` pin the tile
    shape (otherwise autotuned on GPU).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D tensor [B, T, Hq, D]")
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError("k and v must be 4-D tensors [B, Tk, Hkv, D]")
    _check_float("q", q)
    _check_float("k", k, q.dtype)
    _check_float("v", v, q.dtype)
    B, T, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if D not in _SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported (only {_SUPPORTED_HEAD_DIMS})")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    if Tk < T:
        raise ValueError(f"keys Tk={Tk} must be at least the queries T={T}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor [B, T, G]")
    if mask.dim() != 3 or mask.shape[0] != B or mask.shape[1] != T:
        raise ValueError(f"mask shape {tuple(mask.shape)} must be [B={B}, T={T}, G]")
    G = mask.shape[2]
    _check_groups(G, Hq, Hkv)
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    for name, x in (("k", k), ("v", v), ("mask", mask)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device}")
    _check_lens("q_lens", q_lens, B, q.device)
    _check_lens("k_lens", k_lens, B, q.device)
    if not HAS_TRITON:
        raise RuntimeError("prefill_attention needs Triton")
    if T == 0 or B == 0:
        return torch.zeros_like(q)

    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    perm, count = route_rows(mask, q_lens, k_lens, padding_side, Tk)
    out = torch.empty_like(q)
    args = (
        q, k, v, out, perm, count, q_lens if q_lens is not None else count,
        k_lens if k_lens is not None else count, T, Tk, Hq, G, scale * _LOG2E,
        # Only an autotuning key (powers of two up to 16k): re-tune per size class, not per T.
        min(triton.next_power_of_2(T), 16384),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
    )
    kw = dict(HEADS_PER_KV=Hq // Hkv, HEADS_PER_G=Hq // G, CAUSAL=bool(causal), HEAD_DIM=D,
              HAS_QLEN=q_lens is not None, HAS_KLEN=k_lens is not None, LEFT=padding_side == "left")
    if block_m is not None or block_n is not None or interpret_mode() or not q.is_cuda:
        bm = block_m or (16 if interpret_mode() else 128)
        bn = block_n or (16 if interpret_mode() else 64)
        grid = (B * Hq, triton.cdiv(T, bm))
        _prefill_kernel[grid](*args, **kw, BLOCK_M=bm, BLOCK_N=bn,
                              num_warps=4 if bm <= 64 else 8, num_stages=3)
    else:
        grid = lambda meta: (B * Hq, triton.cdiv(T, meta["BLOCK_M"]))  # noqa: E731
        _prefill_kernel_tuned[grid](*args, **kw)
    return out


def _split_plan(Tk_max: int, num_splits: int) -> tuple:
    """(splits, chunk) for about ``num_splits`` splits: chunk a multiple of 128 (so that every
    BLOCK_N divides it), no empty trailing split."""
    tk = max(int(Tk_max), 1)
    splits = max(1, int(num_splits))
    chunk = -(-tk // splits)
    chunk = -(-chunk // 128) * 128
    return -(-tk // chunk), chunk


def decode_splits(B: int, Hkv: int, Tk_max: int, device: torch.device, *,
                  min_chunk: int = 128, waves: int = 12) -> tuple:
    """Split count and keys per split, from shapes only (graph-safe).

    Sized so that B*Hkv*splits is about ``waves`` times the SM count when every head is
    active: at 50% sparsity half the programs return at once and the rest still give each SM
    ~6 resident-or-queued programs. Measured on the H200 (run 1): at 4 waves B=8 and B=32
    at Tk=32k read 3.05 and 3.80 TB/s; doubling the splits raised that to 3.52 and 4.17. A split holds at least ``min_chunk`` keys, a multiple of 128 so that
    every BLOCK_N divides it.
    """
    target = waves * num_sms(device)
    splits = max(1, min(-(-target // max(1, B * Hkv)), -(-Tk_max // min_chunk)))
    return _split_plan(Tk_max, splits)


# Split counts tried by the decode autotuner, relative to the heuristic.
_SPLIT_FACTORS = (0.25, 0.5, 1.0, 2.0)


def decode_split_candidates(B: int, Hkv: int, Tk_max: int, device: torch.device) -> list:
    """(splits, chunk) plans the decode autotuner times: the heuristic's split count times
    1/4, 1/2, 1 and 2, normalised by :func:`_split_plan` and deduplicated (heuristic first)."""
    base = decode_splits(B, Hkv, Tk_max, device)
    out = [base]
    for f in _SPLIT_FACTORS:
        plan = _split_plan(Tk_max, max(1, round(base[0] * f)))
        if plan not in out:
            out.append(plan)
    return out


# Per-shape split counts chosen by timing, keyed by shapes only:
# (B, next_pow2(Tk_max), Hq, Hkv, D, paged, dtype) -> split count.
_DECODE_SPLITS_TUNED: dict = {}


def _decode_key(q, k_cache, block_table, tk_max):
    B, Hq, D = q.shape
    return (B, 1 << max(0, int(tk_max) - 1).bit_length(), Hq, k_cache.shape[2], D,
            block_table is not None, q.dtype)


def decode_split_plan(q: torch.Tensor, k_cache: torch.Tensor,
                      block_table: Optional[torch.Tensor] = None,
                      num_splits: Optional[int] = None) -> tuple:
    """(splits, chunk) that :func:`decode_attention` uses for these shapes now, without tuning:
    ``num_splits`` if given, else the autotuned count for this shape key if cached, else the
    :func:`decode_splits` heuristic."""
    tk_max = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    tk_max = max(int(tk_max), 1)
    if num_splits is not None:
        return _split_plan(tk_max, num_splits)
    cached = _DECODE_SPLITS_TUNED.get(_decode_key(q, k_cache, block_table, tk_max))
    if cached is not None:
        return _split_plan(tk_max, cached)
    return decode_splits(q.shape[0], k_cache.shape[2], tk_max, q.device)


def _should_tune(q: torch.Tensor) -> bool:
    return q.is_cuda and autotune_enabled()


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _pick_splits(cands, times) -> int:
    """Fastest plan's split count; the heuristic (cands[0]) keeps its place unless another
    plan is clearly (> 2%) faster, since smaller differences are timing noise."""
    best = min(range(len(cands)), key=times.__getitem__)
    if times[best] > 0.98 * times[0]:
        best = 0
    return cands[best][0]


def _tune_decode_splits(launch, cands) -> int:
    """Time each (splits, chunk) plan on the call's real inputs, as CUDA-graph replays
    (:func:`wide.base.timing.time_graph`); returns the fastest count."""
    from ..base.timing import time_graph

    times = [time_graph(lambda: launch(splits, chunk)) for splits, chunk in cands]
    return _pick_splits(cands, times)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    combine_block: Optional[int] = None,
) -> torch.Tensor:
    """Split-KV flash decoding that skips inactive head groups and their KV reads.

    q [B, Hq, D] (the new token of each sequence); mask [B, G] bool; seq_lens int [B] (keys
    0..len-1 are attended, the new token's key included). Contiguous cache: k_cache, v_cache
    [B, Tk_max, Hkv, D]. Paged cache: k_cache, v_cache [num_blocks, block_size, Hkv, D] and
    block_table int [B, max_blocks]. A sequence with seq_len 0 gives zeros.
    Returns [B, Hq, D] in q's dtype, exact zeros for inactive heads. Graph-capturable.

    ``num_splits`` pins the KV split count; by default it is autotuned per shape on CUDA
    (see :func:`decode_split_plan`). ``block_n``/``num_warps``/``num_stages`` pin the split
    kernel's tile; ``combine_block`` pins how many splits the combine merges per iteration.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D tensor [B, Hq, D]")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor")
    _check_float("q", q)
    _check_float("k_cache", k_cache, q.dtype)
    _check_float("v_cache", v_cache, q.dtype)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if D not in _SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported (only {_SUPPORTED_HEAD_DIMS})")
    if k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor [B, G]")
    if mask.dim() != 2 or mask.shape[0] != B:
        raise ValueError(f"mask shape {tuple(mask.shape)} must be [B={B}, G]")
    G = mask.shape[1]
    _check_groups(G, Hq, Hkv)
    if seq_lens is None:
        raise ValueError("seq_lens is required")
    _check_lens("seq_lens", seq_lens, B, q.device)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("mask", mask)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device}")
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError("block_table must be an int tensor [B, max_blocks]")
        if block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device}, expected {q.device}")
        block_size = k_cache.shape[1]
        tk_max = block_table.shape[1] * block_size
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"contiguous cache batch {k_cache.shape[0]} != B={B}")
        block_size = 1
        tk_max = k_cache.shape[1]
    if combine_block is not None and (combine_block < 1 or combine_block & (combine_block - 1)):
        raise ValueError(f"combine_block must be a power of two, got {combine_block}")
    if not HAS_TRITON:
        raise RuntimeError("decode_attention needs Triton")
    if B == 0:
        return torch.zeros_like(q)

    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    heads_per_kv = Hq // Hkv
    block_h = max(16, triton.next_power_of_2(heads_per_kv))
    lens = seq_lens.to(torch.int32) if seq_lens.dtype != torch.int32 else seq_lens
    m8 = mask.contiguous().view(torch.uint8)
    table = block_table if paged else lens  # any int pointer; never read when not paged
    pinned = block_n is not None or num_warps is not None or num_stages is not None
    # The combine's head-dim slice: at small batch, halves of the head dim double its programs.
    block_d = min(D, 64 if B * Hq >= num_sms(q.device) else 32)

    def launch(splits, chunk):
        po = torch.empty(B * Hq * splits, D, dtype=torch.float32, device=q.device)
        plse = torch.empty(B * Hq * splits, dtype=torch.float32, device=q.device)
        args = (
            q, k_cache, v_cache, m8, lens, table, po, plse,
            Hq, Hkv, G, scale * _LOG2E, chunk, block_size,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            m8.stride(0), block_table.stride(0) if paged else 0,
        )
        kw = dict(NUM_SPLITS=splits, HEADS_PER_KV=heads_per_kv, HEADS_PER_G=Hq // G,
                  PAGED=paged, HEAD_DIM=D, BLOCK_H=block_h, **pdl.launch_kwargs(q.device))
        grid = (splits, B * Hkv)
        if pinned or interpret_mode() or not q.is_cuda:
            bn = block_n or (16 if interpret_mode() else 64)
            _decode_split_kernel[grid](*args, **kw, BLOCK_N=bn, num_warps=num_warps or 4,
                                       num_stages=num_stages or 3)
        else:
            _decode_split_kernel_tuned[grid](*args, **kw)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
        # BLOCK_S x BLOCK_D <= 4096 fp32 (32 registers a thread at 4 warps) for any split count.
        block_s = combine_block or 4096 // block_d
        block_s = min(block_s, triton.next_power_of_2(splits))
        _decode_combine_kernel[(B * Hq, D // block_d)](
            po, plse, m8, lens, out, Hq, chunk,
            m8.stride(0), out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEADS_PER_G=Hq // G, HEAD_DIM=D,
            BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4, **pdl.launch_kwargs(q.device),
        )
        return out

    splits, chunk = decode_split_plan(q, k_cache, block_table, num_splits)
    if num_splits is None and _should_tune(q):
        key = _decode_key(q, k_cache, block_table, tk_max)
        # Tune once per shape key, outside graph capture (timing needs host syncs). Once
        # cached, the split count - hence the grids and the buffer sizes - depends on the
        # shapes only, so a captured graph stays valid for any mask/seq_lens on replay. A
        # capture of a shape never seen eagerly uses the heuristic (not cached).
        if key not in _DECODE_SPLITS_TUNED and not _is_capturing():
            cands = decode_split_candidates(B, Hkv, max(tk_max, 1), q.device)
            try:
                if len(cands) == 1:
                    best = cands[0][0]
                else:
                    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
                        best = _tune_decode_splits(launch, cands)
            except Exception as e:  # never fail the call over tuning: fall back to the heuristic
                import warnings

                warnings.warn(f"decode split autotuning failed ({type(e).__name__}: {e}); "
                              "using the heuristic split count")
                best = cands[0][0]
            _DECODE_SPLITS_TUNED[key] = best
            splits, chunk = _split_plan(max(tk_max, 1), best)
    return launch(splits, chunk)
