"""Output-width routed GEMM (``gemm_mn``) and the fused FFN up-projection (``ffn_up``).

``gemm_mn(x [T, K], w [N, K], mask [T, N//G])``: ``y[t, cols(g)] = x[t] @ w[cols(g)].T`` where
``mask[t, g]``, exact zeros elsewhere. ``ffn_up`` computes ``silu(x w_gate^T) * (x w_up^T)`` on
the active groups in one kernel, so the intermediate is written once.

Decomposition. One program owns (group g, a BN-wide slice of g's columns, a tile of BM rows
of ``idx[g]``, the group's token list with active tokens first). Programs are ordered with
the row tile fastest, so consecutive programs reuse the same weight slice from L2.
* Tiles wholly among the active tokens run a plain pipelined tl.dot loop on gathered rows.
* The one tile straddling ``counts[g]`` masks the loads of its inactive rows (they are
  loaded as zero, so their output rows come out as exact zeros).
* Tiles wholly past ``counts[g]`` store zeros and do nothing else, which replaces a memset.
The grid is sized for the worst case (every token in every group), so nothing waits on the
host. For T <= 16 (decode) rows are the tokens themselves with a per-row mask (no reordering
launch), and each program skips the whole K loop, i.e. the group's weight bytes, when none
of its tokens uses the group. At T = 1 both ops run a CUDA-core GEMV instead (no MMA tile to
pad), which can also finish a half-evaluated router and write the mask (``RouterPartials``).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import routing as _routing
from .env import autotune_enabled, interpret_mode
from .fp32_dot import dot
from .routing import (DIRECT_MAX_T, RouteIndex, RouterPartials, check_group_size, check_mask, group_runs,
                      largest_pow2_divisor, next_pow2, split_tickets)

__all__ = ["gemm_mn", "ffn_up", "gemm_mn_reference", "ffn_up_reference"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _splitk_store(acc, ws_ptr, y_ptr, cnt_ptr, tile, rows, cols, st_mask, T, N, stride_yt):
    """Split-K epilogue: store this program's fp32 partial of the output tile; the program
    that draws the tile's last ticket adds all partials in split order (deterministic, the
    same sum as a separate reduce launch, without the launch) and re-arms the ticket.
    Every thread's partial store lands before the (release) ticket; the reducer (acquire)
    reads the partials bypassing L1."""
    n_s = tl.num_programs(1)
    ws_off = rows[:, None] * N + cols[None, :]
    tl.store(ws_ptr + tl.program_id(1) * T * N + ws_off, acc, mask=st_mask)
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if ticket == n_s - 1:
        tot = tl.zeros_like(acc)
        for s in range(0, n_s):
            tot += tl.load(ws_ptr + s * T * N + ws_off, mask=st_mask, other=0.0, volatile=True)
        tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], tot.to(y_ptr.dtype.element_ty),
                 mask=st_mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _tile_of(pid, T, GS, BM: tl.constexpr, BN: tl.constexpr):
    """Program -> (row tile, group g, BN-wide slice of g's columns, its BM rows, which of them
    are < T). The row tile runs fastest, so consecutive programs share a weight slice in L2."""
    num_m = tl.cdiv(T, BM)
    nsub = tl.cdiv(GS, BN)
    m_tile = pid % num_m
    gn = pid // num_m
    r = m_tile * BM + tl.arange(0, BM)
    return m_tile, gn // nsub, gn % nsub, r, r < T


@triton.jit
def _gemm_mn_kernel(x_ptr, w_ptr, w2_ptr, y_ptr, mask_ptr, idx_ptr, counts_ptr,
                    T, N, K, GS, stride_xt, stride_wn, stride_w2n, stride_yt, stride_mt,
                    T_BUCKET, ws_ptr, KC, NG_MASKED, cnt_ptr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, DIRECT: tl.constexpr, FUSED: tl.constexpr,
                    SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    # Split-K (decode only): program_id(1) owns columns [k_lo, k_lo + KC) of the reduction and
    # writes an fp32 partial; the last split program of the tile sums them (_splitk_store).
    k_lo = tl.program_id(1) * KC
    m_tile, g, sub, r, row_in = _tile_of(pid, T, GS, BM, BN)
    cols = sub * BN + tl.arange(0, BN)
    col_ok = cols < GS
    n = g * GS + cols
    if DIRECT:
        tok = r
        # Groups from NG_MASKED on (a dense tail, e.g. K/V fused after routed Q) have no
        # mask column and run for every token.
        in_mask = row_in & ((r * 0 + g) < NG_MASKED)
        act = tl.load(mask_ptr + tok * stride_mt + g, mask=in_mask, other=1) != 0
        act = act & row_in
        n_act = tl.sum(act.to(tl.int32), axis=0)
    else:
        cnt = tl.load(counts_ptr + g)
        tok = tl.load(idx_ptr + g * T + r, mask=row_in, other=0)
        act = r < cnt
        n_act = cnt - m_tile * BM
    tok = tok.to(tl.int64)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + n[None, :]
    st_mask = row_in[:, None] & col_ok[None, :]

    # Tiles past the group's active tokens run the K loop zero times and store the zero
    # accumulator. (A data-dependent `if` around the loop would keep it from being pipelined.)
    k_hi = tl.minimum(K, k_lo + KC)
    k_end = tl.where(n_act > 0, k_hi, k_lo)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + (k_lo + k)[None, :]
    w_ptrs = w_ptr + n[None, :].to(tl.int64) * stride_wn + (k_lo + k)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if FUSED:
        w2_ptrs = w2_ptr + n[None, :].to(tl.int64) * stride_w2n + (k_lo + k)[:, None]
        acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_end, BK):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=act[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + k) < K
            a = tl.load(x_ptrs, mask=act[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = dot(a, b, acc)
        if FUSED:
            if EVEN_K:
                b2 = tl.load(w2_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                b2 = tl.load(w2_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc2 = dot(a, b2, acc2)
            w2_ptrs += BK
        x_ptrs += BK
        w_ptrs += BK
    if FUSED:
        # silu in fp32; inactive rows have acc == acc2 == 0 and stay exactly zero.
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if SPLIT:
        _splitk_store(acc, ws_ptr, y_ptr, cnt_ptr, pid, tok, n, st_mask, T, N, stride_yt)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def _gemv_store(acc, ws_ptr, y_ptr, cnt_ptr, pid, n, n_ok, N, S: tl.constexpr):
    """Epilogue of the batch-1 GEMVs: reduce the [BN, BK] products to BN outputs and store
    them (or, split along K, the fp32 partial for _splitk_store)."""
    out = tl.expand_dims(tl.sum(acc, axis=1), 0)
    row = tl.arange(0, 1)
    st_mask = n_ok[None, :]
    if S > 1:
        _splitk_store(out, ws_ptr, y_ptr, cnt_ptr, pid, row, n, st_mask, 1, N, 0)
    else:
        tl.store(y_ptr + row[:, None] + n[None, :], out.to(y_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def _router_decision(g, hp_ptr, hb_ptr, uw_ptr, ub_ptr, off_ptr, NCHUNK,
                     R: tl.constexpr, NC_PAD: tl.constexpr):
    """Group g's routing decision of one token from the router's per-chunk partial sums
    (written by the decode norm kernel): h = sum of partials + bias, the execute and skip
    logits u[2g] . h + b[2g] and u[2g+1] . h + b[2g+1], then the shared rule (group_runs)."""
    cs = tl.arange(0, NC_PAD)
    rr = tl.arange(0, R)
    parts = tl.load(hp_ptr + cs[:, None] * R + rr[None, :], mask=(cs < NCHUNK)[:, None], other=0.0)
    h = tl.sum(parts, axis=0) + tl.load(hb_ptr + rr)
    l0 = tl.sum(tl.load(uw_ptr + (2 * g) * R + rr) * h, axis=0) + tl.load(ub_ptr + 2 * g)
    l1 = tl.sum(tl.load(uw_ptr + (2 * g + 1) * R + rr) * h, axis=0) + tl.load(ub_ptr + 2 * g + 1)
    return group_runs(l0, l1, tl.load(off_ptr))


@triton.jit
def _gemv_mn_kernel(x_ptr, w_ptr, w2_ptr, y_ptr, mask_ptr, ws_ptr, cnt_ptr, N, K, GS, NG_MASKED,
                    stride_wn, stride_w2n, hp_ptr, hb_ptr, uw_ptr, ub_ptr, off_ptr, NCHUNK,
                    BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, FUSED: tl.constexpr,
                    ROUTER: tl.constexpr, R: tl.constexpr, NC_PAD: tl.constexpr):
    # One token (batch-1 decode): BN weight rows x a 1/S share of K per program, CUDA-core FMAs
    # on whole contiguous rows and one row reduction at the end. Measured on an H200 against the
    # tl.dot path (whose 16-row MMA tile is 15/16 padding here): q 8.9 vs 11.5 us, q+k+v 12.8
    # vs 13.8 us (experiments/results/decode_gemv_sweep.md). A program of an inactive group loads no
    # weights and, unsplit, stores its zeros. FUSED (ffn_up, never split): the same BN rows of
    # the gate and up weights, silu(gate) * up in the epilogue. ROUTER: the mask is an output;
    # each program derives its group's decision from the router partials (no launch and no
    # cross-program ticket in the norm kernel), the first program of the group stores it for
    # the operators after this one.
    tl.static_assert((not FUSED) or (S == 1), "the fused SiLU*up epilogue needs whole sums")
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    n_ok = n < N
    g = (pid * BN) // GS  # BN divides GS: a program never straddles two groups
    if ROUTER:
        routed = g < NG_MASKED
        on = _router_decision(tl.minimum(g, NG_MASKED - 1), hp_ptr, hb_ptr, uw_ptr, ub_ptr,
                              off_ptr, NCHUNK, R, NC_PAD)
        act = (on | (g >= NG_MASKED)).to(tl.int32)
        tl.store(mask_ptr + g, on.to(tl.uint8),
                 mask=routed & ((pid * BN) % GS == 0) & (tl.program_id(1) == 0))
    else:
        act = tl.load(mask_ptr + g, mask=g < NG_MASKED, other=1)
    kc = tl.cdiv(tl.cdiv(K, S), BK) * BK
    k_lo = tl.program_id(1) * kc
    k_hi = tl.minimum(K, k_lo + kc)
    k_end = tl.where(act != 0, k_hi, k_lo)
    k = tl.arange(0, BK)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    w2_rows = w2_ptr + n[:, None].to(tl.int64) * stride_w2n
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    acc2 = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(k_lo, k_end, BK):
        k_ok = (k0 + k) < k_hi
        xk = tl.load(x_ptr + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + (k0 + k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
        if FUSED:
            w2 = tl.load(w2_rows + (k0 + k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += w2.to(tl.float32) * xk[None, :]
    if FUSED:
        # silu in fp32 as in the tl.dot epilogue; inactive groups give exact zeros.
        gate = tl.sum(acc, axis=1)
        out = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc2, axis=1)
        tl.store(y_ptr + n, out.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        _gemv_store(acc, ws_ptr, y_ptr, cnt_ptr, pid, n, n_ok, N, S)


def _gcfg(bn, bk, w, s):
    return triton.Config({"BN": bn, "BK": bk, "S": s}, num_warps=w, num_stages=1)


# Batch-1 GEMV tiles: the fastest few of the sweeps, per shape they differ by ~1 us. The
# 2048-wide steps (few rows, half a row per step, so a program has more bytes in flight) took
# q from 9.24 to 6.90 us, q+k/v to 10.92 us (experiments/results/decode_gemv_sweep_wide.md).
_GEMV_CFGS = [_gcfg(4, 1024, 8, 1), _gcfg(4, 512, 8, 1), _gcfg(4, 512, 4, 1), _gcfg(4, 1024, 4, 1),
              _gcfg(16, 1024, 8, 1), _gcfg(8, 512, 8, 2), _gcfg(4, 2048, 4, 1),
              _gcfg(1, 2048, 4, 1), _gcfg(1, 1024, 4, 1)]
GEMV_MAX_SPLIT = 2
# Fused gate/up: two weight streams per program, and the SiLU needs whole sums (no split).
_GEMV_FUSED_CFGS = [_gcfg(2, 1024, 4, 1), _gcfg(2, 512, 4, 1), _gcfg(4, 1024, 8, 1),
                    _gcfg(4, 512, 4, 1), _gcfg(4, 512, 8, 1), _gcfg(8, 512, 8, 1)]


def _gemv_heuristic(K: int, gs: int, fused: bool) -> dict:
    if interpret_mode():  # few, wide programs: the interpreter pays per program
        split = _routing.INTERPRET_GEMV_SPLIT if K > 32 and not fused else 1
        return dict(BN=largest_pow2_divisor(gs, 64), BK=32, S=split, num_warps=4)
    return dict(BN=4, BK=512, S=1, num_warps=4)  # BN divides every group size (16 k)


def _cfg(bm, bn, bk, w, s):
    return triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)


# Decode (T <= 16) configs are memory-bound GEMVs: small BN gives enough programs to pull
# from every SM; prefill configs are the usual Hopper tl.dot tiles. (Tuning the split-K
# factor with the tile as well was measured: no gain at T=1, bench/results/kernels_notes.md.)
_DECODE_CFGS = [_cfg(16, 16, 256, 4, 4), _cfg(16, 32, 256, 4, 4), _cfg(16, 32, 128, 4, 5),
                _cfg(16, 64, 128, 4, 4)]
_PREFILL_CFGS = [_cfg(128, 128, 64, 8, 4), _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 64, 4, 4),
                 _cfg(128, 128, 64, 4, 4), _cfg(64, 256, 64, 8, 4), _cfg(32, 128, 128, 4, 4)]
_FUSED_PREFILL_CFGS = [_cfg(128, 128, 64, 8, 3), _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4),
                       _cfg(128, 128, 64, 8, 4), _cfg(32, 128, 128, 4, 4)]


def _prune(configs, named_args, **kwargs):
    tb, gs = named_args["T_BUCKET"], named_args["GS"]
    bn_cap = max(16, min(256, 1 << (gs.bit_length() - 1)))  # largest pow2 <= group size
    x = named_args.get("x_ptr")
    fp32 = hasattr(x, "element_size") and x.element_size() == 4
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BM"], c.kwargs["BN"]
        if (tb <= DIRECT_MAX_T) != (bm == 16):
            continue
        # fp32 tiles of the bf16 configs can outgrow shared memory (227 KB per block on an
        # H200): X and up to two weight tiles (gate and up) per stage.
        if fp32 and c.num_stages * c.kwargs["BK"] * (bm + 2 * bn) * 4 > 220 * 1024:
            continue
        if bn > bn_cap or (bm > 32 and bm > 2 * tb):
            continue
        keep.append(c)
    if not keep and fp32:  # a tile that fits: 32 x 64 x 64 over 3 stages
        return [_cfg(32 if tb > DIRECT_MAX_T else 16, min(64, bn_cap), 64, 4, 3)]
    return keep or [configs[0]]


def _heuristic(T: int, gs: int, fused: bool, fp32: bool = False) -> triton.Config:
    bn_cap = max(16, min(256, 1 << (gs.bit_length() - 1)))
    if interpret_mode():
        return _cfg(16 if T <= DIRECT_MAX_T else 32, min(32, bn_cap), 32, 4, 1)
    # fp32's tf32x3 dots stage both operands twice: the bf16 tiles' K depth, halved, fits
    # (tests/test_kernels_smem_sm90.py compiles them for sm_90)
    d = 2 if fp32 else 1
    if T <= DIRECT_MAX_T:
        return _cfg(16, min(32, bn_cap), 256 // d, 4, 4)
    if T <= 128:
        return _cfg(64, min(128, bn_cap), 64 // d, 4, 4)
    return _cfg(128, min(128, bn_cap), 64 // d, 8, 3 if fused else 4)


_heur = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})
_plain_kernel = _heur(_gemm_mn_kernel)
# Short tuning runs: each key (shape, bucketed T) is tuned once per process and cached.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _BENCH = {}
    if "warmup" in inspect.signature(triton.autotune).parameters:
        _BENCH = {"warmup": 5, "rep": 25}
_KEY = ["T_BUCKET", "N", "K", "GS"]
_tuned = triton.autotune(configs=_DECODE_CFGS + _PREFILL_CFGS, key=_KEY,
                         prune_configs_by={"early_config_prune": _prune}, **_BENCH)(_plain_kernel)
_tuned_gemv = triton.autotune(configs=_GEMV_CFGS, key=["N", "K", "GS", "NG_MASKED"],
                              **_BENCH)(_gemv_mn_kernel)
_tuned_gemv_fused = triton.autotune(configs=_GEMV_FUSED_CFGS, key=["N", "K", "GS", "NG_MASKED"],
                                    **_BENCH)(_gemv_mn_kernel)
_tuned_fused = triton.autotune(configs=_DECODE_CFGS + _FUSED_PREFILL_CFGS, key=_KEY,
                               prune_configs_by={"early_config_prune": _prune}, **_BENCH)(_plain_kernel)


def _check_inputs(x, ws, mask, group_size, out, dense_tail=0):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [T, K]")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; use bfloat16, float16 or float32")
    T, K = x.shape
    N = ws[0].shape[0] if ws[0].dim() == 2 else -1
    for w in ws:
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != K or w.shape[0] != N:
            raise ValueError(f"weights must be [N, K] with K={K} matching x and one N, got "
                             f"{[list(v.shape) for v in ws]}")
        if w.dtype != x.dtype:
            raise ValueError(f"weight dtype {w.dtype} differs from x dtype {x.dtype}")
        if w.device != x.device:
            raise ValueError("x and weights must be on the same device")
    ng = check_group_size(N, group_size, "N")
    if dense_tail:
        if dense_tail < 0 or dense_tail % group_size or dense_tail > N:
            raise ValueError(f"dense_tail={dense_tail} must be a multiple of group_size="
                             f"{group_size} in [0, N={N}]")
    check_mask(mask, T, ng - dense_tail // group_size, x.device)
    if out is not None:
        if tuple(out.shape) != (T, N) or out.dtype != x.dtype or out.device != x.device \
                or out.stride(1) != 1:
            raise ValueError(f"out must be a [{T}, {N}] {x.dtype} tensor with unit column stride")
    return T, N, K, ng


def _launch(x, ws, mask, group_size, route, out, fused, dense_tail=0, router=None):
    T, N, K, ng = _check_inputs(x, ws, mask, group_size, out, dense_tail)
    ng_routed = ng - dense_tail // group_size  # groups with a mask column
    if router is not None:
        if T != 1 or K == 0 or not mask.is_contiguous() or ng_routed == 0:
            raise ValueError("router partials need one token (T == 1), K > 0, routed groups and "
                             "a contiguous mask to write")
        router.check(ng_routed, x.device)
    y = out if out is not None else torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    ws = [w if w.stride(1) == 1 else w.contiguous() for w in ws]
    direct = T <= DIRECT_MAX_T
    if route is not None and (route.num_tokens != T or route.num_groups != ng_routed):
        raise ValueError(f"route was built for a [{route.num_tokens}, {route.num_groups}] mask, "
                         f"expected [{T}, {ng_routed}]")
    if T == 1:
        _launch_gemv(x, ws, y, mask, group_size, ng_routed, fused, router)
        return y
    if dense_tail and not direct:
        # Prefill: the tail is an ordinary GEMM, as fast as cuBLAS makes it.
        nr = N - dense_tail
        if nr:
            _launch(x, [w[:nr] for w in ws], mask, group_size, route, y[:, :nr], fused)
        y[:, nr:] = F.linear(x, ws[0][nr:])
        return y
    if direct:
        m = mask.contiguous().view(torch.uint8)
        idx = counts = m  # unused placeholders
    else:
        if route is None:  # (a given one was checked above; no dense tail on this path)
            route = RouteIndex(mask)
        m = route.mask.view(torch.uint8)
        idx, counts = route.idx, route.counts
    w2 = ws[1] if fused else ws[0]

    n_split = 1 if (fused or not direct) else decode_splits(N // 32, K)
    kc = K if n_split == 1 else triton.cdiv(triton.cdiv(K, n_split), _KC_ALIGN) * _KC_ALIGN
    n_split = triton.cdiv(K, kc)
    # fp32 partials and per-tile tickets for split-K decode (see _splitk_store)
    wsp = y if n_split == 1 else torch.empty((n_split, T, N), dtype=torch.float32, device=x.device)
    tickets = split_tickets(x.device, triton.cdiv(T, 16) * ng * triton.cdiv(group_size, 16)) \
        if n_split > 1 else m

    def grid(meta):
        return (triton.cdiv(T, meta["BM"]) * ng * triton.cdiv(group_size, meta["BN"]), n_split)

    args = (x, ws[0], w2, y, m, idx, counts, T, N, K, group_size, x.stride(0), ws[0].stride(0),
            w2.stride(0), y.stride(0), m.stride(0), next_pow2(T), wsp, kc, ng_routed,
            tickets)
    flags = dict(DIRECT=direct, FUSED=fused, SPLIT=n_split > 1)
    if autotune_enabled():
        (_tuned_fused if fused else _tuned)[grid](*args, **flags)
    else:
        c = _heuristic(T, group_size, fused, x.element_size() == 4)
        _plain_kernel[grid](*args, **flags, num_warps=c.num_warps, num_stages=c.num_stages,
                            **c.kwargs)
    return y


def gemv_launch_state(device: torch.device, N: int):
    """What every batch-1 GEMV launch needs besides its tensors: the fp32 split-K partials
    and tickets read by ``_gemv_store`` (enough for any S a config or the interpreter uses,
    and any BN >= 4), and the grid over (BN-row tiles, S splits)."""
    wsp = torch.empty((max(GEMV_MAX_SPLIT, _routing.INTERPRET_GEMV_SPLIT), 1, N), dtype=torch.float32,
                      device=device)

    def grid(meta):
        return (triton.cdiv(N, meta["BN"]), meta["S"])

    return wsp, split_tickets(device, triton.cdiv(N, 4)), grid


def router_launch_args(router: Optional[RouterPartials], m: torch.Tensor):
    """(pointer args, constexpr flags) of a kernel that may finish a batch-1 router
    (``_router_decision``): the router's tensors, or ``m`` as placeholders without one."""
    if router is None:
        return (m, m, m, m, m, 0), dict(ROUTER=False, R=16, NC_PAD=2)
    hp = router.partials
    return ((hp, router.down_bias, router.up_weight, router.up_bias, router.offset, hp.shape[0]),
            dict(ROUTER=True, R=hp.shape[1], NC_PAD=max(2, next_pow2(hp.shape[0]))))


def _launch_gemv(x, ws, y, mask, group_size, ng_masked, fused, router=None):
    T, K = x.shape
    w, w2 = ws[0], ws[-1]
    N = w.shape[0]
    m = mask.contiguous().view(torch.uint8)  # the router path's mask is checked contiguous
    wsp, tickets, grid = gemv_launch_state(x.device, N)
    rargs, rflags = router_launch_args(router, m)
    args = (x, w, w2, y, m, wsp, tickets, N, K, group_size, ng_masked, w.stride(0), w2.stride(0)) + rargs
    if autotune_enabled():  # (tuning reruns are harmless: every run writes the same y and mask)
        (_tuned_gemv_fused if fused else _tuned_gemv)[grid](*args, FUSED=fused, **rflags)
    else:
        _gemv_mn_kernel[grid](*args, **_gemv_heuristic(K, group_size, fused), FUSED=fused, **rflags)


# Split-K chunks are multiples of the largest BK, so every chunk is whole BK steps.
_KC_ALIGN = 256


def decode_splits(n_programs: int, K: int) -> int:
    """Split-K factor for decode GEMVs: enough programs (~1024) to keep every SM's loads in
    flight; each split still reads >= 512 columns."""
    if interpret_mode():
        return 2 if K >= 2 * _KC_ALIGN else 1
    return max(1, min(8, 1024 // max(1, n_programs), K // 512))


def gemm_mn(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, group_size: int,
            route: Optional[RouteIndex] = None, out: Optional[torch.Tensor] = None,
            dense_tail: int = 0, router: Optional[RouterPartials] = None) -> torch.Tensor:
    """Output-width routed ``x [T, K] @ w[N, K].T`` -> ``[T, N]``; group g = columns
    ``g*group_size:(g+1)*group_size`` computed where ``mask[t, g]``, exact zeros elsewhere.

    ``route`` (a :class:`RouteIndex` of the same mask) lets several ops share one reordering.
    ``dense_tail`` trailing columns (a multiple of ``group_size``; ``mask`` has no columns for
    them) are computed for every token: decode runs routed Q and dense K/V in one launch.
    ``router`` (one token only): ``mask`` is then an output, each group's decision computed in
    the kernel from the router's partial sums (:class:`RouterPartials`).
    """
    return _launch(x, [w], mask, group_size, route, out, fused=False, dense_tail=dense_tail,
                   router=router)


def ffn_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, mask: torch.Tensor,
           group_size: int, route: Optional[RouteIndex] = None,
           out: Optional[torch.Tensor] = None,
           router: Optional[RouterPartials] = None) -> torch.Tensor:
    """Fused ``silu(x w_gate^T) * (x w_up^T)`` on the active groups (zeros elsewhere).
    ``router``: as in :func:`gemm_mn` (``mask`` written by the kernel)."""
    return _launch(x, [w_gate, w_up], mask, group_size, route, out, fused=True, router=router)


def _col_mask(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    return mask.repeat_interleave(group_size, dim=1).to(torch.float32)


def gemm_mn_reference(x, w, mask, group_size, dense_tail=0):
    """float32 reference of :func:`gemm_mn`."""
    if dense_tail:
        tail = torch.ones(mask.shape[0], dense_tail // group_size, dtype=torch.bool, device=mask.device)
        mask = torch.cat([mask.bool(), tail], dim=1)
    return (x.float() @ w.float().t()) * _col_mask(mask, group_size)


def ffn_up_reference(x, w_gate, w_up, mask, group_size):
    """float32 reference of :func:`ffn_up`."""
    xf = x.float()
    return F.silu(xf @ w_gate.float().t()) * (xf @ w_up.float().t()) * _col_mask(mask, group_size)
