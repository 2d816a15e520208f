"""Fused residual add + RMSNorm + token router (``norm_route``), the engine's norm at every
decoder layer in prefill and decode, for the routed and the dense engine alike.

One launch replaces PyTorch's ~7 elementwise/reduction kernels of an RMSNorm (~10 ms of a
4k-token prefill on an H200) and, with a router, the router's two small linears. The values
round where HF's ``LlamaRMSNorm`` (and its relatives) round: the residual sum, ``x * rstd`` and
the weight product each in the model dtype; the router runs in fp32 on the residual or the
normed row (``normed_input``).

Programs are (token, column chunk). Each reads its whole row for the sum of squares (a few KB,
from L2), normalises its own chunk and, with a router, writes the chunk's partial sums of the
router's first linear; the last program of a token to finish (an atomic ticket) adds the
partials in chunk order and writes the mask. ``defer`` (one token) stops at the partial sums:
the next GEMV finishes the router for its own group (:class:`~wide.kernels.RouterPartials`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .reference import rms_norm_reference
from .routing import RouterPartials, group_runs

__all__ = ["norm_route", "norm_route_reference"]


@triton.jit
def _norm_route_kernel(x_ptr, d_ptr, res_ptr, y_ptr, nw_ptr, eps,
                       rdw_ptr, rdb_ptr, ruw_ptr, rub_ptr, off_ptr, m_ptr, hp_ptr, cnt_ptr,
                       H, G, NCHUNK, stride_x, stride_d, stride_res, stride_y, stride_m,
                       HAS_DELTA: tl.constexpr, ROUTE: tl.constexpr, NORMED_IN: tl.constexpr,
                       R: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       NC_PAD: tl.constexpr, G_PAD: tl.constexpr, FINAL: tl.constexpr,
                       MARGIN: tl.constexpr, acc_ptr, done_ptr, st_ptr, stride_acc, ACC: tl.constexpr,
                       PDL: tl.constexpr = False):
    # Program (token, chunk): residual add, RMSNorm (HF rounding) and the router's first
    # linear on its CHUNK columns; the last chunk program of a token to finish adds the
    # partial router sums in chunk order and writes the mask. One program per token was
    # latency-bound: a single SM walking 16 x H fp32 router weights in a loop took ~40 us per
    # call on an H200 (bench/results/e2e.md profile), 2.5 ms of a 6 ms decode step.
    # FINAL=False (batch 1): stop at the partial sums; the next GEMV finishes the router
    # (gemm_mn's RouterPartials), which saves this kernel the ticket round trips.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    pdl.wait(PDL)
    # Every chunk program needs the whole row's sum of squares; the row is a few KB (L2).
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, H, BLOCK):
        cols = c0 + offs
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        ss += xf * xf
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
    pdl.release(PDL)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        # an fp32 delta (a GEMV's unrounded sums) is rounded to x's dtype first, as the GEMV's
        # own epilogue would have rounded it: the same bits as a rounded delta
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=ok)
    nw = tl.load(nw_ptr + cols, mask=ok, other=0.0)
    n = (x.to(tl.float32) * rstd).to(x.dtype)
    y = (n.to(tl.float32) * nw.to(tl.float32)).to(x.dtype)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)
    # What the router reads (its chunk, fp32): the normed row or the residual.
    if NORMED_IN:
        src = y.to(tl.float32)
    else:
        src = x.to(tl.float32)
    if ACC:
        # The previous-tile rule's running sum of router inputs (fp32), in this launch: done gets
        # the sum so far (the finished tile's, on a row whose tile starts here), and the sum
        # restarts from this row where a tile starts, else grows by it.
        a = tl.load(acc_ptr + row * stride_acc + cols, mask=ok, other=0.0)
        tl.store(done_ptr + row * stride_acc + cols, a, mask=ok)
        st = tl.load(st_ptr + row)
        tl.store(acc_ptr + row * stride_acc + cols, tl.where(st != 0, src, a + src), mask=ok)
    if ROUTE:
        offs_r = tl.arange(0, R)
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
            if MARGIN:  # the decision's own margin (group_runs is margin >= 0), for a batch-wide choice
                tl.store(m_ptr + row * stride_m + gs, l0 - l1 + off, mask=g_ok)
            else:
                tl.store(m_ptr + row * stride_m + gs, group_runs(l0, l1, off).to(tl.uint8), mask=g_ok)
            tl.atomic_xchg(cnt_ptr + row, 0)


def norm_route(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
               router=None, *, normed_input: bool = False, chunk: int = 256, defer: bool = False,
               scratch: Optional[dict] = None, margins: bool = False, tile_sums=None):
    """``(x + delta, RMSNorm(x + delta) * weight, mask or None, RouterPartials or None)`` for
    rows ``x [B, H]`` (``delta`` None: no residual add, the residual is ``x`` itself).

    ``router`` (a :class:`~wide.method.routers.TokenRouter`): also its bool mask ``[B, groups]``.
    ``chunk`` columns per program; many rows (prefill) take one program per row (``chunk``
    >= H), since every program reads its whole row. ``defer`` (one token): only the router's
    partial sums are computed; the returned mask is an empty buffer for the GEMV given the
    returned RouterPartials to fill. ``scratch``: the caller's dict of the router's partial
    sums and per-token tickets, allocated once per shape (outside any graph capture: call once
    eagerly first) and kept by the caller; the kernel leaves the tickets at zero, so a captured
    launch can be replayed as is. The partials are overwritten by the next launch with the
    same shape: consume a deferred router's (in stream order) before that. ``margins``: the
    third result is the router's fp32 margins ``[B, groups]`` instead of its mask (a group runs
    iff its margin is >= 0), for a decision over the whole batch (batch-shared decode).
    ``tile_sums`` ``(acc, done, start)``: fp32 ``[B, H]`` running sums of the router input (the
    residual, or the normed row with ``normed_input``) and a bool ``[B]`` or ``[B, 1]``; in the same
    launch ``done`` gets ``acc`` and ``acc`` becomes the row where ``start``, else ``acc`` + the row
    (the previous-tile rule's decode, :class:`wide.engine.routing_rules.PreviousTileRule`).

    ``delta`` is ``[B, H]`` in x's dtype or, for a half-precision ``x``, fp32 (a GEMV's unrounded
    sums, ``fine_gemv(acc_out=...)``): it is rounded to x's dtype before the add, so the result
    is the same as for the GEMV's rounded output. The kernel only reads it."""
    B, H = x.shape
    _check_delta(delta, x)
    if defer and B != 1:
        raise ValueError(f"a deferred router needs one token, got {B}")
    if defer and margins:
        raise ValueError("a deferred router writes its mask in the GEMV: it has no margins to return")
    resid = x if delta is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    chunk = min(chunk, triton.next_power_of_2(H))
    nchunk = triton.cdiv(H, chunk)
    R = router.down.out_features if router is not None else 16
    G = router.num_groups if router is not None else 1
    mask = (torch.empty((B, G), dtype=torch.float32 if margins else torch.bool, device=x.device)
            if router is not None else None)
    if router is not None:
        scratch = scratch if scratch is not None else {}
        key = (B, nchunk, R)
        if key not in scratch:
            scratch[key] = (torch.empty((B, nchunk, R), dtype=torch.float32, device=x.device),
                            torch.zeros((B,), dtype=torch.int32, device=x.device))
        hp, cnt = scratch[key]
    else:
        hp = cnt = normed  # unused without a router
    w = weight
    d = delta if delta is not None else x
    out = None if mask is None else mask if margins else mask.view(torch.uint8)  # fp32 margins or 0/1 bytes
    block = min(4096, triton.next_power_of_2(H))
    _norm_route_kernel[(B, nchunk)](
        x, d, resid, normed, w, eps,
        router.down.weight if router is not None else w,
        router.down.bias if router is not None else w,
        router.up.weight if router is not None else w,
        router.up.bias if router is not None else w,
        router.offset if router is not None else w,
        out if mask is not None else normed, hp, cnt,
        H, G, nchunk, x.stride(0), d.stride(0), resid.stride(0), normed.stride(0),
        mask.stride(0) if mask is not None else 0,
        HAS_DELTA=delta is not None, ROUTE=router is not None, NORMED_IN=normed_input,
        R=R, BLOCK=block, CHUNK=chunk, NC_PAD=max(2, triton.next_power_of_2(nchunk)),
        G_PAD=max(16, triton.next_power_of_2(G)), FINAL=not defer, MARGIN=margins,
        num_warps=8 if block >= 4096 else 4, **_sums_args(tile_sums, x), **pdl.launch_kwargs(x.device))
    if defer and router is not None:
        rp = RouterPartials(hp[0], router.down.bias, router.up.weight, router.up.bias, router.offset)
        return resid, normed, mask, rp
    return resid, normed, mask, None


def _check_delta(delta, x: torch.Tensor) -> None:
    if delta is None:
        return
    if not isinstance(delta, torch.Tensor) or tuple(delta.shape) != tuple(x.shape) or delta.device != x.device:
        raise ValueError(f"delta must be a {list(x.shape)} tensor on {x.device}, got "
                         f"{list(getattr(delta, 'shape', ()))} on {getattr(delta, 'device', None)}")
    if delta.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"delta must be {x.dtype} (x's dtype) or float32 sums, got {delta.dtype}")
    if delta.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError("delta needs unit column stride")


def _sums_args(tile_sums, x: torch.Tensor) -> dict:
    if tile_sums is None:  # unused pointers: any tensor
        return dict(acc_ptr=x, done_ptr=x, st_ptr=x, stride_acc=0, ACC=False)
    B, H = x.shape
    acc, done, start = tile_sums
    for t in (acc, done):
        if t.shape != (B, H) or t.dtype != torch.float32 or t.stride() != (H, 1) or t.device != x.device:
            raise ValueError(f"tile_sums need contiguous fp32 [{B}, {H}] buffers on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} {t.stride()} on {t.device}")
    if start.numel() != B or start.dtype != torch.bool:
        raise ValueError(f"tile_sums' start flags: {B} bools, got {tuple(start.shape)} {start.dtype}")
    return dict(acc_ptr=acc, done_ptr=done, st_ptr=start.reshape(B).view(torch.uint8), stride_acc=acc.stride(0),
                ACC=True)


def norm_route_reference(x, delta, weight, eps, router=None, *, normed_input: bool = False):
    """PyTorch reference of :func:`norm_route` (fp32 statistics, the same rounding points):
    ``(resid, normed, mask or None)``; the mask is the router module's own decision."""
    # an fp32 delta is rounded to x's dtype first, as the kernel does
    resid = x if delta is None else (x.float() + delta.to(x.dtype).float()).to(x.dtype)
    normed = rms_norm_reference(resid, weight, eps)
    mask = None
    if router is not None:
        mask = router.runs((normed if normed_input else resid).float())
    return resid, normed, mask
