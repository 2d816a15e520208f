"""Per-element activation-sparse decode GEMVs (``fine_gemv``): TEAL / WINA style.

``fine_gemv(x [T, K], w_t [K, N], threshold)``: ``y[t, n] = sum over k with keep[t, k] of
x[t, k] * w_t[k, n]``, ``keep[t, k] = |x[t, k]| * scale[k] >= threshold`` (and, given one,
``group_mask[t, k // group_size]``), fp32 accumulation, for T = 1..4 decode tokens.

Layout. The weight is stored once, transposed (``fine_layout``): row k of ``w_t`` is weight
column k, contiguous over the outputs, so an input element under its threshold is a skipped
contiguous read. Projections that share an input (q|k|v, gate|up) are concatenated along N
and keep one threshold each (``segments`` / ``thresholds``: TEAL's greedy allocation gives
q, k and v different thresholds on the same input).

Decomposition. A program owns a BN-wide slice of one segment's columns and a share of the
rows (split-K over ``program_id(1)``). It walks its rows a [BU, BR, BN] step at a time: loads
the T tokens' inputs, compares them with the segment's threshold in registers (no mask pass,
nothing read back by the host), ORs the T keep bits of each row and loads the weight rows
under that mask. Masked-off lanes issue no memory traffic, so a row no token keeps costs no
DRAM bytes; a token that does not keep a row another token keeps multiplies it by an exact
zero. The next step's inputs and weights are requested before this step's products wait on
theirs (``PF``), so the input -> threshold -> weight dependency never leaves a thread with
nothing in flight. Columns of adjacent slices are read by adjacent programs at the same time,
so a kept row is streamed whole across programs even when one slice is a 128-byte line. Each
thread holds BU rows of its columns, summed in registers into one [BR, BN] accumulator per
token, reduced across threads once at the end. Split-K sums are fp32, reduced one of two ways
(``ATOMIC``, a config key): atomic tiles (TEAL's decomposition: about one step per program,
thousands of short programs) add into a zeroed fp32 buffer with ``atomic_add``, and the last
program of a column slice to draw its ticket stores y and clears the buffer (the order of the
additions, and so the last bits, may vary between runs); ordered tiles (a few long programs)
store partials that the last program sums in split order (the same bits on every run;
``deterministic=True`` keeps to these). TEAL's own kernel adds into the fp16/bf16 output
(1-4 % error against fp32, bench/results/h200/fine_gemv.md); neither reduction here does.
``acc_out`` skips the rounding epilogue for a consumer that rounds the fp32 sums itself (the fine
engine's norms), and ``clear`` zeros a buffer whose consumer has finished in the same launch, so
that re-arming it costs no launch of its own.
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl

from . import pdl
from .env import autotune_enabled, interpret_mode, num_sms
from .routing import row_lists, split_tickets, zeroed_accumulator
from .silu_mul import silu_mul_reference, silu_mul_rounded

__all__ = ["fine_layout", "fine_segments", "fine_gemv", "fine_gemv_reference",
           "keep_mask_reference", "MAX_T", "MAX_SEGMENTS"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_T = 4
MAX_SEGMENTS = 4
# Split-K factor under the interpreter (the interpreter pays per program); the tests set 1
# and 3 as well, to run the unsplit store and a reduction over an odd number of partials.
INTERPRET_SPLIT = 2
# More splits than this buy no bandwidth and lengthen the reducer's tail.
MAX_SPLIT = 64
# Interpreter default: list the kept rows (CH at a time, small so that ragged K ends mid-chunk)
# or 0 to walk them under the mask; the tests run both.
INTERPRET_COMPACT = 16
# fp32 values one program zeros per store of a ``clear`` buffer (four per thread of a warp)
CLEAR_BLOCK = 128


# ---------------------------------------------------------------- kernels
@triton.jit
def _tok(x_ptr, t, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS,
         HAS_SCALE: tl.constexpr, HAS_GM: tl.constexpr, K, GLU_IN: tl.constexpr, XT: tl.constexpr):
    """Token t at rows k: its inputs in fp32, the magnitude compared with the threshold, and
    whether the row may be kept at all (inside the split, its routed group on). ``GLU_IN``: the
    input is silu(gate) * up, rounded to XT as silu_mul rounds it, from fp32 gate and up sums
    (row t: K gate sums, then K up sums)."""
    if GLU_IN:
        g = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0, eviction_policy="evict_last")
        u = tl.load(x_ptr + t * stride_xt + K + k, mask=k_ok, other=0.0, eviction_policy="evict_last")
        xv = silu_mul_rounded(g, u, XT).to(tl.float32)
    else:
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
    mag = tl.abs(xv)
    if HAS_SCALE:
        mag = mag * s
    ok = k_ok
    if HAS_GM:
        ok = ok & (tl.load(gm_ptr + t * stride_gt + k // GS, mask=k_ok, other=0) != 0)
    return xv, mag, ok


@triton.jit
def _block(x_ptr, w_base, scale_ptr, gm_ptr, k, k_hi, n_ok3, th, stride_xt, stride_wk, stride_gt, GS,
           T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_GM: tl.constexpr, MASKW: tl.constexpr,
           K, GLU_IN: tl.constexpr, XT: tl.constexpr):
    """One step of BU x BR rows: the weight rows any token keeps (the rest masked off: no
    memory traffic) and each token's kept inputs (zeros where it does not keep the row).
    ``MASKW`` False: every row in range is kept by some token (a list of kept rows), so the
    weight load is masked by the range alone and need not wait for the inputs' keep bits."""
    k_ok = k < k_hi
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr + k, mask=k_ok, other=0.0, eviction_policy="evict_last")
    x0, m0, o0 = _tok(x_ptr, 0, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS, HAS_SCALE, HAS_GM, K, GLU_IN, XT)
    keep0 = (m0 >= th) & o0
    row = keep0
    a0 = tl.where(keep0, x0, 0.0)
    a1 = a0
    a2 = a0
    a3 = a0
    if T > 1:
        x1, m1, o1 = _tok(x_ptr, 1, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS, HAS_SCALE, HAS_GM, K, GLU_IN, XT)
        keep1 = (m1 >= th) & o1
        row = row | keep1
        a1 = tl.where(keep1, x1, 0.0)
    if T > 2:
        x2, m2, o2 = _tok(x_ptr, 2, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS, HAS_SCALE, HAS_GM, K, GLU_IN, XT)
        keep2 = (m2 >= th) & o2
        row = row | keep2
        a2 = tl.where(keep2, x2, 0.0)
    if T > 3:
        x3, m3, o3 = _tok(x_ptr, 3, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS, HAS_SCALE, HAS_GM, K, GLU_IN, XT)
        keep3 = (m3 >= th) & o3
        row = row | keep3
        a3 = tl.where(keep3, x3, 0.0)
    if MASKW:
        wm = row[:, :, None] & n_ok3
    else:
        wm = k_ok[:, :, None] & n_ok3
    w = tl.load(w_base + k[:, :, None].to(tl.int64) * stride_wk, mask=wm, other=0.0, eviction_policy="evict_first")
    return w, a0, a1, a2, a3


@triton.jit
def _fma(acc, w, a):
    # [BU, BR, BN] products summed over BU: the BU rows of a column sit in one thread, so the
    # sum stays in registers and the accumulator is one [BR, BN] tile per token.
    return acc + tl.sum(w.to(tl.float32) * a[:, :, None], axis=0)


@triton.jit
def _fma_tokens(acc0, acc1, acc2, acc3, w, a0, a1, a2, a3, T: tl.constexpr):
    acc0 = _fma(acc0, w, a0)
    if T > 1:
        acc1 = _fma(acc1, w, a1)
    if T > 2:
        acc2 = _fma(acc2, w, a2)
    if T > 3:
        acc3 = _fma(acc3, w, a3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _partial_sum(ws_ptr, row, cols, n_ok, n_s, T: tl.constexpr, NW, RS: tl.constexpr):
    """Sum over the n_s splits of partial row ``row`` (a token) at ``cols``, in split order,
    RS splits per load so that the reducer has many loads in flight."""
    rs = tl.arange(0, RS)
    tot = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, n_s, RS):
        s = s0 + rs
        p = tl.load(ws_ptr + (s[:, None] * T + row) * NW + cols[None, :],
                    mask=(s < n_s)[:, None] & n_ok[None, :], other=0.0, volatile=True)
        tot += tl.sum(p, axis=0)
    return tot


@triton.jit
def _total(src_ptr, t, cols, ok, n_s, T: tl.constexpr, N, RS: tl.constexpr, ATOMIC: tl.constexpr):
    """Token t's fp32 sum at ``cols``: read (and cleared for the next launch) from the atomic
    sums, or the partials summed in split order."""
    if ATOMIC:
        tot = tl.load(src_ptr + t * N + cols, mask=ok, other=0.0, volatile=True)
        tl.store(src_ptr + t * N + cols, tl.zeros_like(tot), mask=ok)
        return tot
    return _partial_sum(src_ptr, t, cols, ok, n_s, T, N, RS)


@triton.jit
def _finish(src_ptr, y_ptr, cols, n_ok, tk, b1, N, n_s, stride_yt, T: tl.constexpr, BN: tl.constexpr,
            RS: tl.constexpr, ATOMIC: tl.constexpr, GLU: tl.constexpr):
    """The last program of a column slice (of a gate/up pair with GLU) stores y from the sums."""
    out_ty = y_ptr.dtype.element_ty
    if GLU:
        gc = tk * BN + tl.arange(0, BN)
        g_ok = gc < b1
        for t in tl.static_range(T):
            g = _total(src_ptr, t, gc, g_ok, n_s, T, N, RS, ATOMIC)
            u = _total(src_ptr, t, b1 + gc, g_ok, n_s, T, N, RS, ATOMIC)
            tl.store(y_ptr + t * stride_yt + gc, silu_mul_rounded(g, u, out_ty), mask=g_ok)
    else:
        for t in tl.static_range(T):
            tot = _total(src_ptr, t, cols, n_ok, n_s, T, N, RS, ATOMIC)
            tl.store(y_ptr + t * stride_yt + cols, tot.to(out_ty), mask=n_ok)


@triton.jit
def _add_sums(ap, N, y0, y1, y2, y3, n_ok, T: tl.constexpr):
    # token t's fp32 sums at ap + t * N
    tl.atomic_add(ap, y0, mask=n_ok, sem="relaxed")
    if T > 1:
        tl.atomic_add(ap + N, y1, mask=n_ok, sem="relaxed")
    if T > 2:
        tl.atomic_add(ap + 2 * N, y2, mask=n_ok, sem="relaxed")
    if T > 3:
        tl.atomic_add(ap + 3 * N, y3, mask=n_ok, sem="relaxed")


@triton.jit
def _clear_slice(clr_ptr, clr_n, CLR_BLOCK: tl.constexpr):
    """Zeros this program's share of the fp32 buffer ``clr_ptr[:clr_n]`` (programs flattened
    over the grid, each a contiguous slice): a consumer-finished sum buffer cleared for its next
    producer in a launch that runs anyway, instead of a memset launch of its own."""
    npg = tl.num_programs(0) * tl.num_programs(1)
    flat = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    per = tl.cdiv(clr_n, npg)
    lo = flat.to(tl.int64) * per
    hi = tl.minimum(lo + per, clr_n)
    offs = tl.arange(0, CLR_BLOCK)
    for c0 in range(0, per, CLR_BLOCK):
        o = lo + c0 + offs
        tl.store(clr_ptr + o, tl.zeros([CLR_BLOCK], dtype=tl.float32), mask=o < hi)


@triton.jit
def _segment(pid, b1, b2, b3, b4, th0, th1, th2, th3, th_ptr,
             NSEG: tl.constexpr, TH_PTR: tl.constexpr, BN: tl.constexpr):
    """Program -> (first column, end of its segment, the segment's threshold). Each segment
    is tiled on its own, so a slice never straddles two thresholds."""
    if TH_PTR:
        th0 = tl.load(th_ptr)
    lo = pid * 0
    hi = lo + b1
    th = th0
    first = lo
    if NSEG > 1:
        e1 = tl.cdiv(b1, BN)
        if TH_PTR:
            th1 = tl.load(th_ptr + 1)
        c1 = pid >= e1
        lo = tl.where(c1, b1, lo)
        hi = tl.where(c1, b2, hi)
        th = tl.where(c1, th1, th)
        first = tl.where(c1, e1, first)
    if NSEG > 2:
        e2 = e1 + tl.cdiv(b2 - b1, BN)
        if TH_PTR:
            th2 = tl.load(th_ptr + 2)
        c2 = pid >= e2
        lo = tl.where(c2, b2, lo)
        hi = tl.where(c2, b3, hi)
        th = tl.where(c2, th2, th)
        first = tl.where(c2, e2, first)
    if NSEG > 3:
        e3 = e2 + tl.cdiv(b3 - b2, BN)
        if TH_PTR:
            th3 = tl.load(th_ptr + 3)
        c3 = pid >= e3
        lo = tl.where(c3, b3, lo)
        hi = tl.where(c3, b4, hi)
        th = tl.where(c3, th3, th)
        first = tl.where(c3, e3, first)
    return lo + (pid - first) * BN, hi, th


@triton.jit
def _split_rows(K, BK: tl.constexpr):
    # This program's rows [k_lo, k_hi): whole steps, the chunk the host planned (_plan).
    n_s = tl.num_programs(1)
    kc = tl.cdiv(tl.cdiv(K, n_s), BK) * BK
    k_lo = tl.program_id(1) * kc
    return k_lo, tl.minimum(K, k_lo + kc)


@triton.jit
def _compact_rows(x_ptr, scale_ptr, gm_ptr, slot_ptr, k_lo, k_hi, th, stride_xt, stride_gt, GS,
                  T: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_GM: tl.constexpr, CH: tl.constexpr,
                  K, GLU_IN: tl.constexpr, XT: tl.constexpr):
    """Writes the rows of [k_lo, k_hi) that any token keeps, in order, to ``slot_ptr`` and
    returns how many: the weight loop then reads only kept rows, every lane of every load a
    useful byte, where a masked tile spends half its load slots (and so half the bytes it
    could have in flight) on rows nobody keeps."""
    cnt = k_lo * 0
    for c0 in range(k_lo, k_hi, CH):
        k = c0 + tl.arange(0, CH)
        k_ok = k < k_hi
        s = 1.0
        if HAS_SCALE:
            s = tl.load(scale_ptr + k, mask=k_ok, other=0.0)
        row = k_ok & (k < 0)
        for t in tl.static_range(T):
            _, mag, ok = _tok(x_ptr, t, stride_xt, k, k_ok, s, gm_ptr, stride_gt, GS, HAS_SCALE, HAS_GM, K, GLU_IN, XT)
            row = row | ((mag >= th) & ok)
        ki = row.to(tl.int32)
        tl.store(slot_ptr + cnt + tl.cumsum(ki, axis=0) - 1, k, mask=row)
        cnt += tl.sum(ki, axis=0)
    return cnt


@triton.jit
def _step_rows(slot, j, n, k_lo, K, COMPACT: tl.constexpr):
    """Rows of list positions j: the j-th kept row (K, out of range, past the list's end), or
    row k_lo + j of the split when walking under the mask."""
    if COMPACT:
        return tl.load(slot + j, mask=j < n, other=K)
    return k_lo + j


@triton.jit
def _fine_gemv_kernel(x_ptr, w_ptr, y_ptr, scale_ptr, gm_ptr, th_ptr, ws_ptr, acc_ptr, cnt_ptr, idx_ptr,
                      K, N, stride_xt, stride_wk, stride_yt, stride_gt, GS,
                      b1, b2, b3, b4, th0, th1, th2, th3, clr_ptr, clr_n,
                      T: tl.constexpr, NSEG: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_GM: tl.constexpr, TH_PTR: tl.constexpr,
                      BN: tl.constexpr, BR: tl.constexpr, BU: tl.constexpr, PPS: tl.constexpr,
                      PF: tl.constexpr, ATOMIC: tl.constexpr, COMPACT: tl.constexpr, CH: tl.constexpr,
                      GLU: tl.constexpr, RS: tl.constexpr, MASKW: tl.constexpr, ACC_ONLY: tl.constexpr,
                      GLU_IN: tl.constexpr,
                      CLEAR: tl.constexpr, CLR_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    pdl.wait(PDL)  # before CLEAR too: the previous kernel may still read what it zeros
    n_s = tl.num_programs(1)
    XT = w_ptr.dtype.element_ty  # GLU_IN: the dtype silu(gate) * up is rounded to, the weight's
    if CLEAR:
        # first: the stores leave before the loads they would otherwise queue behind
        _clear_slice(clr_ptr, clr_n, CLR_BLOCK)
    c0, hi, th = _segment(pid, b1, b2, b3, b4, th0, th1, th2, th3, th_ptr, NSEG, TH_PTR, BN)
    cols = c0 + tl.arange(0, BN)
    n_ok = cols < hi
    n_ok3 = n_ok[None, None, :]
    w_base = w_ptr + cols[None, None, :]
    kk = tl.arange(0, BU)[:, None] * BR + tl.arange(0, BR)[None, :]
    acc0 = tl.zeros([BR, BN], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if COMPACT:
        k_lo, k_hi = _split_rows(K, CH)
        # this program's own list (no other program writes it), as long as its rows
        slot = idx_ptr + (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + pid) * (tl.cdiv(tl.cdiv(K, n_s), CH) * CH)
        n = _compact_rows(x_ptr, scale_ptr, gm_ptr, slot, k_lo, k_hi, th, stride_xt, stride_gt, GS,
                          T, HAS_SCALE, HAS_GM, CH, K, GLU_IN, XT)
        tl.debug_barrier()  # the list's stores, by every thread, before any thread reads it
        lim = K
    else:
        k_lo, k_hi = _split_rows(K, BR * BU)
        slot = idx_ptr
        n = k_hi - k_lo
        lim = k_hi
    if PF:
        # Register double buffering: the next step's rows, inputs, keep bits and weight loads
        # are issued before this step's products wait on its weights, so a load is always in
        # flight behind the (list ->) input -> threshold -> weight dependency.
        w, a0, a1, a2, a3 = _block(x_ptr, w_base, scale_ptr, gm_ptr, _step_rows(slot, kk, n, k_lo, K, COMPACT),
                                   lim, n_ok3, th, stride_xt, stride_wk, stride_gt, GS, T, HAS_SCALE, HAS_GM, MASKW,
                                   K, GLU_IN, XT)
        for j0 in range(0, n, BR * BU):
            wn, b0, b1_, b2_, b3_ = _block(x_ptr, w_base, scale_ptr, gm_ptr,
                                           _step_rows(slot, j0 + BR * BU + kk, n, k_lo, K, COMPACT), lim,
                                           n_ok3, th, stride_xt, stride_wk, stride_gt, GS, T, HAS_SCALE, HAS_GM,
                                           MASKW, K, GLU_IN, XT)
            acc0, acc1, acc2, acc3 = _fma_tokens(acc0, acc1, acc2, acc3, w, a0, a1, a2, a3, T)
            w = wn
            a0 = b0
            a1 = b1_
            a2 = b2_
            a3 = b3_
    else:
        # (num_stages > 1: the compiler's software pipeline keeps the loads in flight instead)
        for j0 in range(0, n, BR * BU):
            w, a0, a1, a2, a3 = _block(x_ptr, w_base, scale_ptr, gm_ptr, _step_rows(slot, j0 + kk, n, k_lo, K, COMPACT),
                                       lim, n_ok3, th, stride_xt, stride_wk, stride_gt, GS, T, HAS_SCALE, HAS_GM,
                                       MASKW, K, GLU_IN, XT)
            acc0, acc1, acc2, acc3 = _fma_tokens(acc0, acc1, acc2, acc3, w, a0, a1, a2, a3, T)
    pdl.release(PDL)  # (the tail left: the sums, a ticket, a last program's epilogue)
    y0 = tl.sum(acc0, axis=0)
    y1 = tl.sum(acc1, axis=0)
    y2 = tl.sum(acc2, axis=0)
    y3 = tl.sum(acc3, axis=0)
    out_ty = y_ptr.dtype.element_ty
    # GLU: gate's slice j and up's slice j (programs j and j + tiles of gate) share one ticket,
    # and the last of their 2 * n_s programs writes silu(gate) * up for those columns.
    tk = pid
    arrivals = n_s
    if GLU:
        tpg = tl.cdiv(b1, BN)
        tk = tl.where(pid < tpg, pid, pid - tpg)
        arrivals = 2 * n_s
    if ACC_ONLY:
        # The caller's fp32 [T, N] sums (zero before the launch): added into, never rounded
        # or cleared here, so no ticket and no last program; whoever reads them next clears them.
        _add_sums(acc_ptr + cols, N, y0, y1, y2, y3, n_ok, T)
    elif n_s == 1 and not GLU:
        tl.store(y_ptr + cols, y0.to(out_ty), mask=n_ok)
        if T > 1:
            tl.store(y_ptr + stride_yt + cols, y1.to(out_ty), mask=n_ok)
        if T > 2:
            tl.store(y_ptr + 2 * stride_yt + cols, y2.to(out_ty), mask=n_ok)
        if T > 3:
            tl.store(y_ptr + 3 * stride_yt + cols, y3.to(out_ty), mask=n_ok)
    elif ATOMIC:
        # fp32 sums in acc[token, column] (zero at launch); the last program of the slice to
        # draw its ticket reads them, stores y and clears them for the next launch.
        _add_sums(acc_ptr + cols, N, y0, y1, y2, y3, n_ok, T)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tk, 1, sem="acq_rel")
        if ticket == arrivals - 1:
            _finish(acc_ptr, y_ptr, cols, n_ok, tk, b1, N, n_s, stride_yt, T, BN, RS, True, GLU)
            tl.atomic_xchg(cnt_ptr + tk, 0)
    else:
        # fp32 partials ws[split, token, column]; the last program of the slice to draw its
        # ticket (acquire) reads every partial, stored before each program's ticket (release),
        # and sums them in split order: the same bits on every run.
        wsp = ws_ptr + tl.program_id(1) * T * N + cols
        tl.store(wsp, y0, mask=n_ok)
        if T > 1:
            tl.store(wsp + N, y1, mask=n_ok)
        if T > 2:
            tl.store(wsp + 2 * N, y2, mask=n_ok)
        if T > 3:
            tl.store(wsp + 3 * N, y3, mask=n_ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tk, 1, sem="acq_rel")
        if ticket == arrivals - 1:
            _finish(ws_ptr, y_ptr, cols, n_ok, tk, b1, N, n_s, stride_yt, T, BN, RS, False, GLU)
            tl.atomic_xchg(cnt_ptr + tk, 0)  # re-armed for the next launch on this stream


def _cfg(bn, br, bu, warps, pps, pf, stages=1, atomic=False, compact=0, maskw=True):
    """``compact``: 0 walks the split's rows under the keep mask; CH > 0 first lists the kept
    rows CH at a time, then walks the list (splits are then whole CH chunks). ``maskw`` False
    (compacting tiles only): the weight loads of a step wait for its list entries alone, not
    for the inputs' keep bits as well."""
    if not maskw and not compact:
        raise ValueError("only a compacting tile may load weights without the keep mask (maskw=False)")
    if compact and warps != 1:
        # Measured wrong, not understood: on an H100 (triton 3.6) the one two-warp compacting
        # tile lost rows in 2-3 of 12 launches at T = 1 and in every launch at T = 2 and 4, in
        # bf16 and fp16, while every one-warp tile was right in all of them
        # (experiments/results/fine_gemv_race_h100/).
        raise ValueError(f"compacting tiles run one warp (got num_warps={warps})")
    return triton.Config({"BN": bn, "BR": br, "BU": bu, "PPS": pps, "PF": pf, "ATOMIC": atomic,
                          "COMPACT": compact > 0, "CH": max(compact, 1), "MASKW": maskw},
                         num_warps=warps, num_stages=stages)


def _bk(c) -> int:
    """Split granularity of a config (a ``triton.Config`` or its kwargs)."""
    kw = c.kwargs if isinstance(c, triton.Config) else c
    return kw["CH"] if kw.get("COMPACT", False) else kw["BR"] * kw["BU"]


def _atomic(c: triton.Config) -> bool:
    return bool(c.kwargs.get("ATOMIC", False))


def _compact(c: triton.Config) -> bool:
    return bool(c.kwargs.get("COMPACT", False))


# A step is a [BU, BR, BN] tile: BN columns (16-byte vectors along them), BR rows across the
# threads (BR * BN = 8 * 32 * warps puts one vector per thread) and BU rows per thread.
# Narrow slices (BN 32..128, a 64..256-byte piece of each row) give many column slices, so
# few splits and a short reduction. PPS: programs per SM the split factor aims at.
# Provenance: a sweep of the first version of this kernel (a [BK, BN] fp32 accumulator per
# token, no prefetch; H100, Llama-3.1-8B, T = 1, 50 % kept) was fastest with 64-column slices
# on down, o and q|k|v and with 256..1024-column ones on up, at 1.36-1.76x the plain-read
# floor. This list (present kernel) is a guess from that; `python -m wide.benchmarks.fine_gemv
# --sweep` times it and more on a GPU.
_ORDERED = [
    _cfg(64, 16, 8, 4, 8, True),
    # the fastest tile of the 2026-12-06 H100 sweep on up, down and q|k|v (one warp, 8 programs
    # per SM): up 28.7 us against 31.5 us at 16 per SM (experiments/results/fine_gemv_compact_h100);
    # tiles with rows across threads (BR > 1) ran 2-20x slower in the H200 sweep of 2026-12-07
    # (bench/results/h200/fine_gemv_sweep.md), so one is kept, as a fallback
    _cfg(256, 1, 16, 1, 8, True), _cfg(256, 1, 16, 1, 16, True),
]
# Atomic tiles, TEAL's decomposition: about one step per program (a PPS past the row count
# gives every program one [BK, BN] tile), so the GPU keeps thousands of independent
# input -> threshold -> weight chains in flight instead of a few long loops; fp32 sums.
# Provenance: the H200 sweep of 2026-12-07 (bench/results/h200/fine_gemv_sweep.md, T = 1, 50 %):
# one warp on a 256-column slice, 16 rows per thread, one step per program was the fastest tile
# on up (23.9 us) and o (10.8 us), against the best ordered tile's 25.6 / 12.2 and TEAL's kernel's
# 23.0 / 9.6 (bench/results/h200/fine_gemv.md); every tile that spreads rows across threads
# (BR > 1) ran 2-20x slower, so none is listed.
_ATOMIC = [
    _cfg(256, 1, 16, 1, 64, False, atomic=True), _cfg(256, 1, 16, 1, 16, True, atomic=True),
]
# Compacting tiles (one warp on a 256- or 512-column slice, the kept rows listed CH at a time,
# then walked 8-16 rows a step with the next step's loads in flight): every lane of a weight load
# is a kept byte, as in a plain read of the kept rows. CH sets the split: 64-row chunks give
# o_proj (16 slices of 256 columns) 64 splits, 256-row ones give up 16. On the first GPU run
# (H100, 2026-12-07, bench/results/h100/fine_gemv.md) the autotuner kept a compacting tile on
# every shape, dtype and share: 64/128-row chunks on q|k|v and o, 512 columns on up and down
# (then a two-warp tile, since found wrong: _cfg).
_COMPACT = [
    _cfg(256, 1, 16, 1, 8, True, atomic=True, compact=256), _cfg(256, 1, 16, 1, 8, True, atomic=True, compact=128),
    _cfg(256, 1, 16, 1, 16, True, atomic=True, compact=64), _cfg(256, 1, 8, 1, 16, True, atomic=True, compact=64),
    _cfg(512, 1, 8, 1, 8, True, atomic=True, compact=128), _cfg(256, 1, 32, 1, 8, True, atomic=True, compact=256),
]
# Weight loads waiting on the list alone (maskw=False: listed rows are kept by some token, so
# the input -> threshold step leaves the chain before each weight load), with register prefetch
# or under the compiler's software pipeline (PF off, num_stages 2-3). The H100 sweep of
# 2026-12-07 (bench/results/h100/fine_gemv_sweep.md, T = 1, 50 %, bf16) timed the 64-row-chunk
# tile this way at 11.6 us on o (13.3 with the keep mask and prefetch), 14.0 on q|k|v (14.7),
# 25.1-25.2 on up (25.7 for the 512-column tile) and 26.2 on down (26.7); the same changes made
# the 512-column and 16-row-step tiles slower (up to 2-4x without prefetch), so they are not listed.
_COMPACT = _COMPACT + [_cfg(256, 1, 8, 1, 16, True, atomic=True, compact=64, maskw=False),
                       _cfg(256, 1, 8, 1, 16, False, stages=2, atomic=True, compact=64, maskw=False),
                       _cfg(256, 1, 8, 1, 16, False, stages=3, atomic=True, compact=64, maskw=False)]
_COMPACT_ORDERED = [_cfg(256, 1, 16, 1, 8, True, compact=128), _cfg(256, 1, 16, 1, 16, True, compact=64)]
_ORDERED = _ORDERED + _COMPACT_ORDERED
_CONFIGS = _ORDERED + _ATOMIC + _COMPACT


def _default_config(deterministic: bool = False) -> triton.Config:
    if interpret_mode():  # a few small programs: the interpreter pays per program
        return _cfg(64, 8, 4, 1, 1, True, atomic=not deterministic, compact=INTERPRET_COMPACT)
    # the sweep's fastest of each reduction (see _ATOMIC)
    if deterministic:
        return _cfg(256, 1, 16, 1, 8, True)
    return _cfg(256, 1, 16, 1, 64, False, atomic=True)


def _rs(bn: int) -> int:
    # splits summed per load of the reducer: ~4K fp32 values in flight
    return max(1, min(64, 4096 // bn))


def _n_tiles(bounds: Sequence[int], bn: int) -> int:
    return sum(triton.cdiv(b - a, bn) for a, b in zip(bounds[:-1], bounds[1:]))


def _plan(K: int, tiles: int, bk: int, pps: int, sms: int, atomic: bool = False) -> int:
    """Split-K factor: about ``pps`` programs per SM and no empty split (the kernel recomputes
    the same chunk from the number of splits); ordered splits also take at least two BK steps
    each and at most MAX_SPLIT partials, which their reducer reads back."""
    if K == 0:
        return 1
    if interpret_mode():
        s = INTERPRET_SPLIT
    elif atomic:
        s = max(1, min(triton.cdiv(pps * sms, max(1, tiles)), triton.cdiv(K, bk)))
    else:
        s = max(1, min(MAX_SPLIT, triton.cdiv(pps * sms, max(1, tiles)), K // (2 * bk)))
    kc = triton.cdiv(triton.cdiv(K, s), bk) * bk
    return triton.cdiv(K, kc)


_RS = triton.heuristics({"RS": lambda a: _rs(a["BN"])})
_plain_gemv = _RS(_fine_gemv_kernel)
# Short tuning runs, once per key and process (triton versions without warmup/rep take none).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _BENCH = {}
    if "warmup" in inspect.signature(triton.autotune).parameters:
        _BENCH = {"warmup": 5, "rep": 25}
    _KEY = ["K", "N", "b1", "b2", "b3", "T", "NSEG", "GLU", "GLU_IN"]
    _tuned_gemv = triton.autotune(configs=_CONFIGS, key=_KEY, **_BENCH)(_plain_gemv)
    # deterministic=True: the ordered reduction only (the same bits on every run)
    _tuned_ordered = triton.autotune(configs=_ORDERED, key=_KEY, **_BENCH)(_plain_gemv)
    # acc_out: atomic tiles only, each tuning run's additions taken back (restore_value) so
    # the caller's sums hold one launch's worth; triton versions without it tune nothing there
    _ACC_TUNE = "restore_value" in inspect.signature(triton.autotune).parameters
    _tuned_acc = (triton.autotune(configs=_ATOMIC + _COMPACT, key=_KEY, restore_value=["acc_ptr"], **_BENCH)(_plain_gemv)
                  if _ACC_TUNE else None)


def _configs_for_launch(deterministic: bool, acc: bool = False):
    if acc:
        return _ATOMIC + _COMPACT if autotune_enabled() and _ACC_TUNE else [_default_config()]
    if autotune_enabled():
        return _ORDERED if deterministic else _CONFIGS
    return [_default_config(deterministic)]


# ---------------------------------------------------------------- host side
def fine_layout(w: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """The load-time layout of one or several ``[N_i, K]`` weights that share an input (q, k,
    v; gate, up): ``[K, sum N_i]``, row k = input column k of every weight, contiguous. The
    output columns follow the order given; :func:`fine_segments` gives their boundaries."""
    ws = (w,) + more
    for v in ws:
        if not isinstance(v, torch.Tensor) or v.dim() != 2:
            raise ValueError("weights must be 2-D [N, K] tensors")
        if v.shape[1] != ws[0].shape[1] or v.dtype != ws[0].dtype or v.device != ws[0].device:
            raise ValueError(f"weights must share K, dtype and device, got "
                             f"{[(list(v.shape), v.dtype, str(v.device)) for v in ws]}")
    if len(ws) == 1:
        return w.t().contiguous()
    return torch.cat([v.t() for v in ws], dim=1).contiguous()


def fine_segments(w: torch.Tensor, *more: torch.Tensor) -> List[int]:
    """Output-column boundaries of ``fine_layout(w, *more)``: ``[0, N_0, N_0 + N_1, ...]``."""
    b = [0]
    for v in (w,) + more:
        b.append(b[-1] + int(v.shape[0]))
    return b


def _float_threshold(v, what: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number or a float32 tensor, got {type(v).__name__}") from None
    if math.isnan(f):
        raise ValueError(f"{what} is NaN")
    if f < 0:
        raise ValueError(f"{what} must be >= 0 (it bounds a magnitude), got {f}")
    return f


def _resolve_thresholds(threshold, thresholds, nseg: int, device) -> Tuple[Optional[torch.Tensor], List[float]]:
    """(device tensor or None, floats). A tensor (fp32 on x's device, one value per segment)
    is read by the kernel, so it can change between CUDA-graph replays; floats are baked
    into the launch."""
    if thresholds is not None and threshold is not None:
        raise ValueError("pass either threshold or thresholds, not both")
    src = thresholds if thresholds is not None else threshold
    if src is None:
        raise ValueError("a threshold is required (threshold=, or thresholds= per segment)")
    if isinstance(src, torch.Tensor):
        if src.dtype != torch.float32 or src.device != torch.device(device):
            raise ValueError(f"threshold tensors must be float32 on {device}, got {src.dtype} on {src.device}")
        flat = src.reshape(-1)
        if thresholds is None and flat.numel() == 1 and nseg > 1:
            flat = flat.expand(nseg)
        if flat.numel() != nseg:
            raise ValueError(f"expected {nseg} thresholds (one per segment), got {flat.numel()}")
        return flat.contiguous(), [0.0] * nseg
    if thresholds is None:
        return None, [_float_threshold(src, "threshold")] * nseg
    vals = list(src)
    if len(vals) != nseg:
        raise ValueError(f"expected {nseg} thresholds (one per segment), got {len(vals)}")
    return None, [_float_threshold(v, f"thresholds[{i}]") for i, v in enumerate(vals)]


def _check_x(x, w_t, what="w_t"):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [T, K]")
    if not isinstance(w_t, torch.Tensor) or w_t.dim() != 2:
        raise ValueError(f"{what} must be a 2-D tensor [K, N] (see fine_layout)")
    T, K = x.shape
    _check_tokens(T)
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; use bfloat16, float16 or float32")
    if w_t.dtype != x.dtype:
        raise ValueError(f"{what} dtype {w_t.dtype} differs from x dtype {x.dtype}")
    _check_weight(w_t, K, x, what)
    return T, K


def _check_tokens(T):
    if not 1 <= T <= MAX_T:
        raise ValueError(f"fine GEMVs take 1..{MAX_T} decode tokens, got T={T}; prefill uses the dense weight")


def _check_weight(w_t, K, x, what):
    if w_t.shape[0] != K:
        raise ValueError(f"{what} must be [K, N] with K={K} rows matching x, got {list(w_t.shape)} "
                         f"(a [N, K] weight needs fine_layout)")
    if w_t.device != x.device:
        raise ValueError(f"x is on {x.device} but {what} on {w_t.device}")
    if w_t.stride(1) != 1 and w_t.shape[1] > 1:
        raise ValueError(f"{what} must have unit column stride (fine_layout makes it contiguous)")


def _check_glu_input(x, w_t, glu):
    """``glu_input``: x holds fp32 gate and up sums [T, 2K] (a gate|up launch's ``acc_out``)."""
    if glu:
        raise ValueError("glu_input reads silu(gate) * up from sums; glu writes it: not both in one launch")
    if not isinstance(w_t, torch.Tensor) or w_t.dim() != 2:
        raise ValueError("w_t must be a 2-D tensor [K, N] (see fine_layout)")
    K = w_t.shape[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != 2 * K:
        raise ValueError(f"glu_input takes float32 gate and up sums [T, 2K] = [T, {2 * K}] for w_t of {K} rows, got "
                         + (f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    _check_tokens(x.shape[0])
    if w_t.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {w_t.dtype}; use bfloat16, float16 or float32")
    _check_weight(w_t, K, x, "w_t")
    return x.shape[0], K


def _check_scale(scale, K, device):
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != (K,):
        raise ValueError(f"scale must be a float32 tensor of shape [{K}]")
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device}, expected {device}")


def _check_group_mask(gm, group_size, T, dim, device, what):
    if gm is None:
        if group_size is not None:
            raise ValueError("group_size given without group_mask")
        return 1
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_mask needs a positive int group_size, got {group_size!r}")
    if dim % group_size:
        raise ValueError(f"group_size {group_size} does not divide {what}={dim}")
    if not isinstance(gm, torch.Tensor) or gm.dtype != torch.bool:
        raise ValueError("group_mask must be a torch.bool tensor")
    if tuple(gm.shape) != (T, dim // group_size):
        raise ValueError(f"group_mask must have shape [T, {what} // group_size] = [{T}, {dim // group_size}], "
                         f"got {list(gm.shape)}")
    if gm.device != device:
        raise ValueError(f"group_mask is on {gm.device}, expected {device}")
    return group_size


def _check_out(out, T, N, x):
    if out is None:
        return torch.empty((T, N), dtype=x.dtype, device=x.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, N) or out.dtype != x.dtype \
            or out.device != x.device or (out.stride(1) != 1 and N > 1):
        raise ValueError(f"out must be a [{T}, {N}] {x.dtype} tensor on {x.device} with unit column stride")
    return out


def _check_acc_out(acc_out, T, N, x, glu, out, deterministic, config):
    if glu or out is not None:
        raise ValueError("acc_out takes the fp32 sums alone: not with glu or out")
    if deterministic:
        raise ValueError("acc_out adds atomically, in no fixed order: not with deterministic=True")
    if config is not None and not _atomic(config):
        raise ValueError("acc_out needs an ATOMIC config (its programs add into the sums)")
    if not isinstance(acc_out, torch.Tensor) or acc_out.dtype != torch.float32 or tuple(acc_out.shape) != (T, N) \
            or acc_out.device != x.device or not acc_out.is_contiguous():
        raise ValueError(f"acc_out must be a contiguous float32 [{T}, {N}] tensor on {x.device}")


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """[first, last) byte addresses a strided tensor may touch."""
    n = 1 + sum((d - 1) * abs(st) for d, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + n * t.element_size()


def _check_clear(clear, x, others: dict) -> None:
    if clear is None:
        return
    if not isinstance(clear, torch.Tensor) or clear.dtype != torch.float32 or not clear.is_contiguous() \
            or clear.device != x.device:
        raise ValueError(f"clear must be a contiguous float32 tensor on {x.device}")
    lo, hi = _span(clear)
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.numel() and clear.numel():
            a, b = _span(t)
            if a < hi and lo < b:
                # the zeros would race with this launch's own reads or writes of it
                raise ValueError(f"clear shares memory with {name}: it must be a buffer of its own")


def _check_segments(segments, N) -> List[int]:
    if segments is None:
        return [0, N]
    b = [int(v) for v in segments]
    if len(b) < 2 or len(b) - 1 > MAX_SEGMENTS:
        raise ValueError(f"segments must hold 2..{MAX_SEGMENTS + 1} boundaries, got {len(b)}")
    if b[0] != 0 or b[-1] != N:
        raise ValueError(f"segments must start at 0 and end at N={N}, got {b}")
    if any(hi <= lo for lo, hi in zip(b[:-1], b[1:])):
        raise ValueError(f"segments must be strictly increasing, got {b}")
    return b


def _workspace(x, T, width, K, tiles_of, configs, glu=False):
    """fp32 partials for the largest split any ordered candidate uses, the zeroed fp32 sums of
    the atomic ones, one ticket per column slice of the config with the most slices, and the
    kept-row lists of the compacting ones (one per program, as long as its rows)."""
    sms = num_sms(x.device)
    worst_s, worst_tiles, worst_idx = 1, 1, 0
    for c in configs:
        tiles = tiles_of(c.kwargs["BN"])
        worst_tiles = max(worst_tiles, tiles)
        s = _plan(K, tiles, _bk(c), c.kwargs["PPS"], sms, _atomic(c))
        if not _atomic(c):
            worst_s = max(worst_s, s)
        if _compact(c):
            kc = triton.cdiv(triton.cdiv(K, s), _bk(c)) * _bk(c)
            worst_idx = max(worst_idx, tiles * s * kc)
    # (glu reduces through the partials or sums even unsplit: gate and up meet there)
    ws = torch.empty((worst_s, T, width), dtype=torch.float32, device=x.device) if worst_s > 1 or glu else x
    acc = zeroed_accumulator(x.device, T * width) if any(_atomic(c) for c in configs) else x
    tickets = split_tickets(x.device, worst_tiles)
    idx = row_lists(x.device, worst_idx) if worst_idx else x
    return ws, acc, tickets, idx, sms


def fine_gemv(x: torch.Tensor, w_t: torch.Tensor, threshold=None, *, scale: Optional[torch.Tensor] = None,
              group_mask: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
              segments: Optional[Sequence[int]] = None,
              thresholds: Union[Sequence[float], torch.Tensor, None] = None,
              out: Optional[torch.Tensor] = None, config: Optional[triton.Config] = None,
              deterministic: Optional[bool] = None, glu: bool = False,
              acc_out: Optional[torch.Tensor] = None, clear: Optional[torch.Tensor] = None,
              glu_input: bool = False) -> torch.Tensor:
    """Activation-sparse ``x [T, K] @ w_t [K, N]`` -> ``[T, N]`` (T = 1..4, fp32 accumulation).

    Input column k counts for token t iff ``|x[t, k]| * scale[k] >= threshold`` (``scale``:
    optional fp32 [K], e.g. WINA's weight-column norms) and, given ``group_mask [T, K //
    group_size]`` (bool, True = the routed group of input columns runs), its group is on.
    ``segments`` ``[0, N_0, ..., N]`` (up to 4) split the outputs of fused projections, each
    with its own threshold in ``thresholds``; without them ``threshold`` applies to all
    columns. Thresholds are floats (baked into the launch) or a float32 tensor on x's device
    (read by the kernel). A NaN input never passes a threshold, so it is dropped.
    Weight rows no token keeps are not read. ``config`` (a ``triton.Config`` of BN, BR, BU,
    PPS, PF, ATOMIC): launch with it instead of the autotuner's choice (tuning sweeps).

    ``glu``: the two segments are a gate and an up projection of equal width I; the result is
    ``silu(gate) * up`` ``[T, I]``, computed by the last program of each column slice from the
    fp32 sums and rounded exactly as :func:`wide.kernels.silu_mul.silu_mul` on the rounded
    gate and up outputs (one launch and one round trip of ``[T, 2I]`` fewer).

    ``glu_input``: ``x`` is fp32 ``[T, 2K]``, the gate sums then the up sums that a gate|up launch
    added into its ``acc_out``; the input is ``silu(gate) * up`` in w_t's dtype, rounded as
    :func:`wide.kernels.silu_mul.silu_mul` rounds the rounded gate and up outputs, computed where
    each row is loaded (the down projection of a decode step, reading the gate|up sums without
    their ticket and rounding pass). The output is in w_t's dtype (or ``acc_out``). Not with ``glu``.

    Split-K sums are fp32 either way. By default the splits may add into one fp32 sum
    atomically (the order, and so the last bits, can differ between runs); ``deterministic``
    (default: ``torch.are_deterministic_algorithms_enabled()``) keeps to the reduction that
    sums the splits' partials in a fixed order.

    ``acc_out`` (fp32 ``[T, N]``, contiguous, zero or holding sums to add to): the products are
    added into it atomically and nothing else is written (no rounding to x's dtype, no split-K
    ticket, no last program), and it is returned. The kernel's tail is then one atomic add: a
    consumer that reads the fp32 sums (a norm or RoPE after the projection) rounds them and
    writes the zeros back for the next launch. Not with ``glu``, ``out`` or ``deterministic``.

    ``clear`` (a contiguous fp32 tensor of any shape, sharing no memory with the launch's other
    tensors): besides its own work, the launch zeros it, each program a slice. The engine clears
    an ``acc_out`` buffer whose consumer has finished (earlier in stream order) in the next
    launch that runs anyway, so that no launch of its own re-arms it.
    """
    T, K = _check_glu_input(x, w_t, glu) if glu_input else _check_x(x, w_t)
    N = w_t.shape[1]
    bounds = _check_segments(segments, N)
    if segments is None and thresholds is not None:
        raise ValueError("thresholds (one per segment) need segments")
    nseg = len(bounds) - 1
    th_t, ths = _resolve_thresholds(threshold, thresholds, nseg, x.device)
    _check_scale(scale, K, x.device)
    gs = _check_group_mask(group_mask, group_size, T, K, x.device, "K")
    if glu and (nseg != 2 or 2 * bounds[1] != N):
        raise ValueError(f"glu needs two segments of equal width (gate | up), got segments {bounds}")
    acc_only = acc_out is not None
    if acc_only:
        _check_acc_out(acc_out, T, N, x, glu, out, deterministic, config)
        deterministic = False
        y = acc_out
    else:
        y = _check_out(out, T, N // 2 if glu else N, w_t if glu_input else x)
    _check_clear(clear, x, {"x": x, "w_t": w_t, "acc_out" if acc_only else "out": y, "scale": scale,
                            "group_mask": group_mask,
                            "thresholds": thresholds if isinstance(thresholds, torch.Tensor) else threshold})
    if clear is not None and (N == 0 or K == 0):  # no launch to clear it in
        clear.zero_()
    if N == 0 or (K == 0 and acc_only):
        return y
    if K == 0:  # silu(0) * 0 = 0 too
        return y.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if config is not None and deterministic and _atomic(config):
        raise ValueError("an ATOMIC config sums its splits in no fixed order: not with deterministic=True")
    configs = [config] if config is not None else _configs_for_launch(deterministic, acc_only)
    ws, acc, tickets, idx, sms = _workspace(x, T, N, K, lambda bn: _n_tiles(bounds, bn), configs, glu)
    if acc_only:
        acc = acc_out
    gm = group_mask.view(torch.uint8) if group_mask is not None else x
    gm_stride = group_mask.stride(0) if group_mask is not None else 0
    if group_mask is not None and group_mask.stride(1) != 1:
        gm = group_mask.contiguous().view(torch.uint8)
        gm_stride = gm.stride(0)
    b = bounds[1:] + [N] * (MAX_SEGMENTS + 1 - len(bounds))
    th = ths + [0.0] * (MAX_SEGMENTS - len(ths))

    def grid(meta):
        tiles = _n_tiles(bounds, meta["BN"])
        return (tiles, _plan(K, tiles, _bk(meta), meta["PPS"], sms, meta["ATOMIC"]))

    args = (x, w_t, y, scale if scale is not None else x, gm, th_t if th_t is not None else x, ws, acc, tickets, idx,
            K, N, x.stride(0), w_t.stride(0), y.stride(0), gm_stride, gs, *b, *th,
            clear if clear is not None else x, 0 if clear is None else clear.numel())
    flags = dict(T=T, NSEG=nseg, HAS_SCALE=scale is not None, HAS_GM=group_mask is not None, GLU_IN=glu_input,
                 TH_PTR=th_t is not None, GLU=glu, ACC_ONLY=acc_only,
                 CLEAR=clear is not None and clear.numel() > 0, CLR_BLOCK=CLEAR_BLOCK, **pdl.launch_kwargs(x.device))
    if acc_only and config is None and autotune_enabled() and _ACC_TUNE:
        _tuned_acc[grid](*args, **flags)
    elif config is None and autotune_enabled() and not acc_only:
        (_tuned_ordered if deterministic else _tuned_gemv)[grid](*args, **flags)
    else:
        c = configs[0]
        _plain_gemv[grid](*args, **flags, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return y


# ---------------------------------------------------------------- references
def _th32(v, device) -> torch.Tensor:
    # compared in float32, as the kernel compares (a Python float is rounded to fp32 first)
    return torch.as_tensor(v, dtype=torch.float32, device=device) if not isinstance(v, torch.Tensor) \
        else v.to(torch.float32)


def keep_mask_reference(x: torch.Tensor, threshold, scale: Optional[torch.Tensor] = None,
                        group_mask: Optional[torch.Tensor] = None,
                        group_size: Optional[int] = None) -> torch.Tensor:
    """bool ``[T, K]``: ``|x| * scale >= threshold`` (in fp32), and the input column's group on."""
    mag = x.float().abs()
    if scale is not None:
        mag = mag * scale.float()
    keep = mag >= _th32(threshold, x.device)
    if group_mask is not None:
        keep = keep & group_mask.bool().repeat_interleave(group_size, dim=1)
    return keep


def fine_gemv_reference(x, w_t, threshold=None, *, scale=None, group_mask=None, group_size=None,
                        segments=None, thresholds=None, glu: bool = False, glu_input: bool = False) -> torch.Tensor:
    """float32 reference of :func:`fine_gemv` (with ``glu``: HF's ``act(gate) * up`` on the
    gate and up outputs rounded to x's dtype, in x's dtype, returned as float32; with
    ``glu_input``: x's gate and up sums rounded to w_t's dtype, HF's ``act(gate) * up`` on them
    as the input)."""
    if glu_input:
        k = x.shape[1] // 2
        x = silu_mul_reference(x[:, :k].to(w_t.dtype), x[:, k:].to(w_t.dtype)).to(w_t.dtype)
    if glu:
        y = fine_gemv_reference(x, w_t, threshold, scale=scale, group_mask=group_mask, group_size=group_size,
                                segments=segments, thresholds=thresholds).to(x.dtype)
        i = y.shape[1] // 2
        return silu_mul_reference(y[:, :i], y[:, i:]).float()
    N = w_t.shape[1]
    bounds = [0, N] if segments is None else [int(v) for v in segments]
    nseg = len(bounds) - 1
    if thresholds is None:
        ths = [threshold] * nseg
    else:
        ths = list(thresholds.reshape(-1)) if isinstance(thresholds, torch.Tensor) else list(thresholds)
    xf, wf = x.float(), w_t.float()
    parts = []
    for (lo, hi), th in zip(zip(bounds[:-1], bounds[1:]), ths):
        keep = keep_mask_reference(x, th, scale, group_mask, group_size)
        parts.append(torch.where(keep, xf, torch.zeros_like(xf)) @ wf[:, lo:hi])
    return torch.cat(parts, dim=1)
