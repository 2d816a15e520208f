"""Reduction-width routed GEMM (``gemm_k``).

``gemm_k(x [T, K], w [N, K], mask [T, K//G])``: ``y[t] = sum over active g of
x[t, cols(g)] @ w[:, cols(g)].T``, accumulated in fp32 registers in one pass (no atomics,
deterministic).

Decomposition. An output tile (BM token rows, BN columns) must keep the same rows for the
whole reduction, so skipping happens per (row tile, group): the route orders tokens by mask
pattern (when the number of groups is small enough for that to make tiles homogeneous) and
lists, per row tile, the groups active for at least one of its tokens. Each program loops
over that list only (block-level skipping; the indirect loads pipeline like MoE kernels) and
loads the X rows of tokens inactive in the current group as zeros (intra-block skipping of
their bytes). With i.i.d. random masks over many groups (e.g. FFN down: 112 groups) almost
every (tile, group) pair has an active token, so prefill does close to dense work; see
bench/results/kernels.md for the measured consequence.

Decode (T <= 16): one row tile of the tokens themselves. Each program derives, in registers
from the mask, the ordered list of groups used by at least one token (no extra launch, no
host sync) and loops over that list only, so the weight columns of unused groups cost no loop
iteration at all (masked-off loads would still occupy the pipeline). Split-K divides the used
steps equally between ``program_id(1)`` programs (fp32 partials, reduced in split order by
the last program of each tile).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from . import routing as _routing
from .env import autotune_enabled, interpret_mode, num_sms
from .fp32_dot import dot
from .gemm_mn import _gcfg, _gemv_store, _splitk_store, gemv_launch_state
from .routing import (DIRECT_MAX_T, SORT_MAX_GROUPS, RouteIndex, check_group_size, check_mask,
                      largest_pow2_divisor, next_pow2, split_tickets)

__all__ = ["gemm_k", "gemm_k_reference", "gemm_k_block_m"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _split_share(n_steps):
    # Split-K: program_id(1)'s equal share [lo, hi) of n_steps (balanced on the device).
    s = tl.program_id(1)
    n_s = tl.num_programs(1)
    return (s * n_steps) // n_s, ((s + 1) * n_steps) // n_s


@triton.jit
def _gemm_k_kernel(x_ptr, w_ptr, y_ptr, mask_ptr, perm_ptr, tg_ptr, tc_ptr,
                   T, N, K, NG, GS, stride_xt, stride_wn, stride_yt, stride_mt,
                   T_BUCKET, ws_ptr, cnt_ptr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   HAS_PERM: tl.constexpr, GROUP_M: tl.constexpr,
                   NESTED: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
                   NG_PAD: tl.constexpr, LISTED: tl.constexpr = False, RB: tl.constexpr = 16):
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BM)
    num_n = tl.cdiv(N, BN)
    # Grouped ordering: GROUP_M row tiles share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    m_tile = first_m + (pid % width) % gsize
    n_tile = (pid % width) // gsize

    r = m_tile * BM + tl.arange(0, BM)
    row_in = r < T
    if HAS_PERM:
        tok = tl.load(perm_ptr + r, mask=row_in, other=0)
    else:
        tok = r
    tok = tok.to(tl.int64)
    n = n_tile * BN + tl.arange(0, BN)
    n_ok = n < N
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_rows = w_ptr + n[None, :].to(tl.int64) * stride_wn
    if NESTED:
        # Few wide groups: outer loop over the tile's active groups (one indirection per
        # group), inner direct-addressed loop over the group's columns, which pipelines.
        cnt = tl.load(tc_ptr + m_tile)
        for gi in range(0, cnt):
            gid = tl.load(tg_ptr + m_tile * NG + gi)
            act = tl.load(mask_ptr + tok * stride_mt + gid, mask=row_in, other=0) != 0
            for kk in range(0, GS, BK):
                k0 = gid * GS + kk
                a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + k)[None, :],
                            mask=act[:, None], other=0.0)
                b = tl.load(w_rows + (k0 + k)[:, None], mask=n_ok[None, :], other=0.0)
                acc = dot(a, b, acc)
    elif DECODE:
        # Decode (T <= 16, one row tile): loop over the groups used by some token only, as
        # one flat loop of BK-wide steps through the ordered list of used groups, so no
        # iteration is spent on a group no token uses and every load moves bytes.
        # The list is derived here, in registers, from the [T, NG] mask (a few KB, read from
        # L2 by every program): bits[g] = tokens active in g, pos[g] = rank of g among the
        # used groups (what RouteIndex.used_groups lists), so no extra launch is needed.
        # Each step picks its entry (group id << 16 | token bits) with one tiny reduction:
        # an in-loop load of a list entry would make the X/W loads indirect, and Triton's
        # pipeliner then splits num_stages between the two levels (half the tiles in flight).
        # Split-K: program_id(1) owns an equal share [j_lo, j_hi) of the *used* steps
        # (balanced on the device from the count, no host sync) and writes an fp32 partial;
        # programs with an empty share write zeros, which the ordered reduce adds.
        # X rows of tokens inactive in the step's group load as zeros.
        gp = tl.arange(0, NG_PAD)
        mt = tl.load(mask_ptr + r[:, None] * stride_mt + gp[None, :],
                     mask=row_in[:, None] & (gp < NG)[None, :], other=0).to(tl.int32)
        bits = tl.sum(mt << r[:, None], axis=0)  # distinct bits: the sum is their OR
        used = (bits != 0).to(tl.int32)
        pos = tl.cumsum(used, axis=0) - 1
        n_used = tl.sum(used, axis=0)
        ent = tl.where(used != 0, gp * 65536 + bits, 0)
        spg = GS // BK
        j_lo, j_hi = _split_share(n_used * spg)
        for j in range(j_lo, j_hi):
            gi = j // spg
            e = tl.sum(tl.where(pos == gi, ent, 0), axis=0)
            gid = e >> 16
            act = (((e >> r) & 1) != 0) & row_in
            k0 = gid * GS + (j - gi * spg) * BK
            a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + k)[None, :],
                        mask=act[:, None], other=0.0)
            b = tl.load(w_rows + (k0 + k)[:, None], mask=n_ok[None, :], other=0.0)
            acc = dot(a, b, acc)
    elif LISTED:
        # Rows that come in runs sharing one mask (tile-coherent routing, a batch-shared decode
        # step): the decode path's flat loop over the used groups' steps, for any tile height.
        # The used list is the union over the tile's rows, built in registers RB rows at a
        # time; a row's own mask bit is loaded per step, so rows that do not share the union
        # stay exact (only the skipping depends on the runs). Split-K as in decode.
        gp = tl.arange(0, NG_PAD)
        used = tl.zeros([NG_PAD], dtype=tl.int32)
        for r0 in range(0, BM, RB):
            rr = m_tile * BM + r0 + tl.arange(0, RB)
            mt = tl.load(mask_ptr + rr[:, None] * stride_mt + gp[None, :],
                         mask=(rr < T)[:, None] & (gp < NG)[None, :], other=0).to(tl.int32)
            used = tl.maximum(used, tl.max(mt, axis=0))
        pos = tl.cumsum(used, axis=0) - 1
        ent = tl.where(used != 0, gp, -1)
        spg = GS // BK
        j_lo, j_hi = _split_share(tl.sum(used, axis=0) * spg)
        for j in range(j_lo, j_hi):
            gi = j // spg
            gid = tl.max(tl.where(pos == gi, ent, -1), axis=0)
            act = tl.load(mask_ptr + tok * stride_mt + gid, mask=row_in, other=0) != 0
            k0 = gid * GS + (j - gi * spg) * BK
            a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + k)[None, :],
                        mask=act[:, None], other=0.0)
            b = tl.load(w_rows + (k0 + k)[:, None], mask=n_ok[None, :], other=0.0)
            acc = dot(a, b, acc)
    else:
        # Prefill with many groups: one flat, direct-addressed loop over K (pipelines like a
        # plain GEMM); X rows of tokens inactive in the current group are not loaded.
        for k0 in range(0, K, BK):
            gid = k0 // GS
            act = tl.load(mask_ptr + tok * stride_mt + gid, mask=row_in, other=0) != 0
            a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + k)[None, :],
                        mask=act[:, None], other=0.0)
            b = tl.load(w_rows + (k0 + k)[:, None], mask=n_ok[None, :], other=0.0)
            acc = dot(a, b, acc)
    if SPLIT:
        _splitk_store(acc, ws_ptr, y_ptr, cnt_ptr, pid, tok, n, row_in[:, None] & n_ok[None, :],
                      T, N, stride_yt)
    else:
        tl.store(y_ptr + tok[:, None] * stride_yt + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_in[:, None] & n_ok[None, :])


@triton.jit
def _gemv_k_kernel(x_ptr, w_ptr, y_ptr, mask_ptr, ws_ptr, cnt_ptr, N, K, NG, GS, stride_wn,
                   BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, NG_PAD: tl.constexpr):
    # One token (batch-1 decode) over few wide groups (attention O): BN weight rows per program,
    # a loop over the token's active groups only (their ranks derived in registers from the
    # mask row, as in the decode path above), CUDA-core FMAs on contiguous row segments, one
    # row reduction at the end. Split-K shares the active steps between S programs.
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    n_ok = n < N
    k = tl.arange(0, BK)
    gp = tl.arange(0, NG_PAD)
    used = (tl.load(mask_ptr + gp, mask=gp < NG, other=0) != 0).to(tl.int32)
    pos = tl.cumsum(used, axis=0) - 1
    ent = tl.where(used != 0, gp, -1)
    spg = GS // BK
    n_steps = tl.sum(used, axis=0) * spg
    s = tl.program_id(1)
    j_lo = (s * n_steps) // S
    j_hi = ((s + 1) * n_steps) // S
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for j in range(j_lo, j_hi):
        gi = j // spg
        gid = tl.max(tl.where(pos == gi, ent, -1), axis=0)
        k0 = gid * GS + (j - gi * spg) * BK
        xk = tl.load(x_ptr + k0 + k).to(tl.float32)
        w = tl.load(w_rows + (k0 + k)[None, :], mask=n_ok[:, None], other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    _gemv_store(acc, ws_ptr, y_ptr, cnt_ptr, pid, n, n_ok, N, S)


# Batch-1 tiles: the fastest few of the sweep (experiments/results/decode_gemv_sweep.md); S stays
# within gemm_mn's GEMV_MAX_SPLIT, which sizes the partials.
_GEMV_CFGS = [_gcfg(4, 512, 4, 1), _gcfg(8, 512, 8, 1), _gcfg(16, 512, 4, 1), _gcfg(16, 512, 4, 2),
              _gcfg(4, 256, 4, 1), _gcfg(16, 256, 8, 2)]
# The batch-1 kernel beat the tl.dot decode path for 512-wide groups (O: 9.0 vs 10.4 us) and
# lost for 128-wide ones (down: 23.4 vs 22.1 us), measured on an H200.
GEMV_MIN_GROUP = 256


def _gemv_prune(configs, named_args, **kwargs):
    gs = named_args["GS"]
    keep = [c for c in configs if gs % c.kwargs["BK"] == 0]
    return keep or [_gcfg(4, largest_pow2_divisor(gs, 512), 4, 1)]


def _cfg(bn, bk, w, s):
    return triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)


# BM is fixed before launch (the per-tile group lists depend on it), so only BN/BK/warps/
# stages are tuned. Decode wants many small programs (bandwidth) with deep pipelines (every
# step of the used-group loop moves weight bytes), prefill the usual tiles.
_DECODE_CFGS = [_cfg(16, 128, 4, 4), _cfg(32, 128, 4, 4), _cfg(32, 64, 4, 6), _cfg(64, 128, 4, 4),
                _cfg(16, 128, 4, 6), _cfg(32, 128, 4, 5)]
_PREFILL_CFGS = [_cfg(256, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 64, 4, 4), _cfg(128, 128, 8, 3),
                 _cfg(256, 64, 8, 4)]


# Shared memory a config's pipelined X and W tiles may take (H100/H200 allow 227 KB per block).
_SMEM_BYTES = 220 * 1024


def _prune(configs, named_args, **kwargs):
    gs, bm = named_args["GS"], kwargs.get("BM", 128)
    # A listed batched-decode step (one short row tile, split K) is bandwidth-bound like decode.
    small = bm == 16 or (kwargs.get("LISTED", False) and named_args["T"] <= 64)
    x = named_args.get("x_ptr")
    esize = x.element_size() if hasattr(x, "element_size") else 2
    keep = []
    for c in configs:
        if gs % c.kwargs["BK"] != 0:
            continue
        # fp32 tiles of the bf16 configs can outgrow shared memory (227 KB per block on an
        # H100/H200): e.g. 64 x 128 + 128 x 128 fp32 over 3 stages needs 288 KB.
        if c.num_stages * c.kwargs["BK"] * (bm + c.kwargs["BN"]) * esize > _SMEM_BYTES:
            continue
        if small != any(c is d for d in _DECODE_CFGS):
            continue
        if bm <= 64 and c.kwargs["BN"] == 256 and c.num_warps == 4:
            continue
        keep.append(c)
    if not keep:
        bk = largest_pow2_divisor(gs, 64)
        keep = [_cfg(32 if small else 128, bk, 4, 3)]
    return keep


def gemm_k_block_m(T: int, num_groups: int) -> int:
    """Row-tile height used by :func:`gemm_k` (the route's tile lists are keyed by it)."""
    if T <= DIRECT_MAX_T:
        return 16
    if interpret_mode():
        return 32
    if num_groups <= SORT_MAX_GROUPS and T >= 1024:
        # Pattern-sorted tokens: smaller tiles are homogeneous in more groups.
        return 64
    return 64 if T <= 128 else 128


def _heuristic(T: int, gs: int, bm: int, fp32: bool = False) -> triton.Config:
    if interpret_mode():
        return _cfg(32, largest_pow2_divisor(gs, 32), 4, 1)
    if bm == 16:
        return _cfg(32, largest_pow2_divisor(gs, 128), 4, 4)
    if bm == 64:
        return _cfg(128, largest_pow2_divisor(gs, 64), 4, 4)
    # fp32's tf32x3 dots stage both operands twice: 256 x 64 over 3 stages needs 320 KB there
    # (tests/test_kernels_smem_sm90.py compiles it for sm_90), 256 x 32 160 KB
    return _cfg(256, largest_pow2_divisor(gs, 32 if fp32 else 64), 8, 3)


# Short tuning runs: each key (shape, bucketed T) is tuned once per process and cached.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _BENCH = {}
    if "warmup" in inspect.signature(triton.autotune).parameters:
        _BENCH = {"warmup": 5, "rep": 25}
_KEY = ["T_BUCKET", "N", "K", "GS", "BM"]
_tuned_gemv = triton.autotune(configs=_GEMV_CFGS, key=["N", "K", "GS"],
                              prune_configs_by={"early_config_prune": _gemv_prune},
                              **_BENCH)(_gemv_k_kernel)
_tuned = triton.autotune(configs=_DECODE_CFGS + _PREFILL_CFGS, key=_KEY,
                         prune_configs_by={"early_config_prune": _prune}, **_BENCH)(_gemm_k_kernel)


def gemm_k(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, group_size: int,
           route: Optional[RouteIndex] = None, out: Optional[torch.Tensor] = None,
           row_runs: Optional[int] = None) -> torch.Tensor:
    """Reduction-width routed ``y[t] = sum_{g: mask[t,g]} x[t, cols(g)] @ w[:, cols(g)].T``.

    x [T, K], w [N, K], mask [T, K // group_size] bool -> y [T, N] (x's dtype, fp32 accumulate).
    ``route`` (a :class:`RouteIndex` of the same mask) lets several ops share one reordering.
    ``row_runs``: the rows come in aligned runs of this many that share one mask (tile-coherent
    routing with ``route_tile``; a batch-shared decode step, where every row shares it): row
    tiles of up to that height then loop over the groups some row of the tile uses, so whole
    (tile, group) blocks are skipped also where there are too many groups to sort tokens by
    pattern (FFN down). The result does not depend on it, only the speed.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [T, K]")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; use bfloat16, float16 or float32")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [N, K] with K={x.shape[1]}, got {list(getattr(w, 'shape', []))}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError("x and w must share dtype and device")
    T, K = x.shape
    N = w.shape[0]
    ng = check_group_size(K, group_size, "K")
    check_mask(mask, T, ng, x.device)
    if out is not None:
        if tuple(out.shape) != (T, N) or out.dtype != x.dtype or out.device != x.device \
                or out.stride(1) != 1:
            raise ValueError(f"out must be a [{T}, {N}] {x.dtype} tensor with unit column stride")
    y = out if out is not None else torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    if route is None:
        route = RouteIndex(mask)
    elif route.num_tokens != T or route.num_groups != ng:
        raise ValueError(f"route was built for a [{route.num_tokens}, {route.num_groups}] mask, "
                         f"expected [{T}, {ng}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    if K == 0:
        return y.zero_()
    if T == 1 and group_size >= GEMV_MIN_GROUP:
        _launch_gemv(x, w, y, route.mask, group_size, ng)
        return y
    bm = gemm_k_block_m(T, ng)
    nested = _use_nested(T, ng, group_size)
    listed = bool(row_runs) and T > DIRECT_MAX_T and not nested
    if listed:  # row tiles inside one run: a run's union is its own mask
        bm = max(16, min(128, largest_pow2_divisor(int(row_runs), 128), next_pow2(T)))
    # Decode: one row tile (bm == 16), never nested; list entries pack group id << 16 with
    # a 16-bit token mask, so group ids must stay below 2**15.
    decode = T <= DIRECT_MAX_T and ng < 2 ** 15
    m = route.mask.view(torch.uint8)
    if nested:
        perm, tg, tc = route.token_tiles(bm)
    else:  # flat loops: rows in token order, no lists needed (decode derives its own)
        perm, tg, tc = None, m, m

    # A short listed step (a batched decode) is one row tile: split K as decode does.
    n_split = _decode_splits(N, K, x.device) if decode or (listed and T <= 64) else 1
    wsp = y if n_split == 1 else torch.empty((n_split, T, N), dtype=torch.float32, device=x.device)
    tickets = split_tickets(x.device, triton.cdiv(T, bm) * triton.cdiv(N, 16)) if n_split > 1 else m

    def grid(meta):
        return (triton.cdiv(T, bm) * triton.cdiv(N, meta["BN"]), n_split)

    args = (x, w, y, m, perm if perm is not None else m, tg, tc, T, N, K, ng, group_size,
            x.stride(0), w.stride(0), y.stride(0), m.stride(0), next_pow2(T), wsp, tickets)
    flags = dict(BM=bm, HAS_PERM=perm is not None, GROUP_M=8, NESTED=nested, DECODE=decode,
                 SPLIT=n_split > 1, NG_PAD=max(16, next_pow2(ng)) if decode or listed else 16,
                 LISTED=listed, RB=max(2, min(bm, 8192 // max(16, next_pow2(ng)))))
    if autotune_enabled():
        _tuned[grid](*args, **flags)
    else:
        c = _heuristic(T, group_size, bm, x.element_size() == 4)
        _gemm_k_kernel[grid](*args, **flags, num_warps=c.num_warps, num_stages=c.num_stages,
                             **c.kwargs)
    return y


def _launch_gemv(x, w, y, mask, group_size, ng):
    N, K = w.shape
    wsp, tickets, grid = gemv_launch_state(x.device, N)
    ng_pad = max(16, next_pow2(ng))
    args = (x, w, y, mask.view(torch.uint8), wsp, tickets, N, K, ng, group_size, w.stride(0))
    if autotune_enabled():
        _tuned_gemv[grid](*args, NG_PAD=ng_pad)
    else:
        _gemv_k_kernel[grid](*args, **_gemv_heuristic(group_size), NG_PAD=ng_pad)


def _gemv_heuristic(group_size: int) -> dict:
    bk = largest_pow2_divisor(group_size, 32 if interpret_mode() else 512)
    if interpret_mode():  # few programs; the kernel tests turn the split on
        return dict(BN=64, BK=bk, S=_routing.INTERPRET_GEMV_SPLIT, num_warps=4)
    return dict(BN=4, BK=bk, S=1, num_warps=4)


# Decode split-K: target programs per SM, and the fewest columns a split reads when every
# group is used (about half of that at 50 % density).
_DECODE_PROGRAMS_PER_SM = 4
_DECODE_MIN_SPLIT_COLS = 1024


def _decode_splits(N: int, K: int, device: torch.device) -> int:
    """Split-K factor of the decode path.

    A decode GEMV is bound by HBM bandwidth, which needs many loads in flight on every SM.
    The splits share the *used* steps equally (balanced on the device), so every program is
    active whatever the density: aim at ~4 programs per SM over the cdiv(N, 32) output tiles
    of the nominal BN = 32 (4 programs x num_stages BK x BN tiles in flight per SM), but keep
    each split's run of weights long enough to amortise its pipeline prologue and partial
    write (>= 1024 columns with every group used, ~512 = 2 groups of 256 / 4 of 128 at 50 %).
    E.g. Llama-3.1-8B down (N 4096, K 14336) and o (4096, 4096) on 132 SMs: 128 tiles x 4.
    """
    if interpret_mode():  # exercise the split path (and empty shares) on tiny test shapes
        return 1 if K <= 64 else 3
    tiles = triton.cdiv(N, 32)
    want = max(1, (_DECODE_PROGRAMS_PER_SM * num_sms(device)) // tiles)
    return max(1, min(16, want, K // _DECODE_MIN_SPLIT_COLS))


def _use_nested(T: int, num_groups: int, group_size: int) -> bool:
    # The per-tile group list pays off only when tiles can be homogeneous (few groups, sorted
    # tokens) and each group is wide enough for its inner loop to pipeline.
    return T > DIRECT_MAX_T and num_groups <= SORT_MAX_GROUPS and (
        group_size >= 256 or interpret_mode())


def gemm_k_reference(x, w, mask, group_size):
    """float32 reference of :func:`gemm_k`."""
    xm = x.float() * mask.repeat_interleave(group_size, dim=1).to(torch.float32)
    return xm @ w.float().t()
