"""Trial (measured, not kept in the library): the batch-1 routed FFN in ONE kernel against the
two-kernel path (``ffn_up`` then ``gemm_k``) and cuBLAS dense, Llama-3.1-8B shapes, i.i.d.
50 % masks, CUDA-graph timing over three weight sets (so L2 never holds a layer's weights),
plus a tile sweep of the fused kernel. Every timed variant is checked against the fp32
reference first. Result (experiments/results/ffn_decode_ab.md): the fused kernel is slower.

The fused kernel: each program owns CH intermediate channels of one group, computes their
gate/up sums and SiLU product (rounded to the input dtype, as the two-kernel path stores it),
then at once their contribution to every output from the CH matching columns of w_down, and
writes an fp32 partial row; a small second launch sums the active programs' rows in program
order (deterministic). The hope was to drop the down GEMV's own ramp-up, split-K tail and
mask wait; what it costs is parallelism (one program per CH channels) and 64-128 B pieces of
w_down per row.

    PYTHONPATH=src python experiments/ffn_decode_ab.py --out experiments/results/ffn_decode_ab
    PYTHONPATH=src TRITON_INTERPRET=1 python experiments/ffn_decode_ab.py --tiny   # CPU smoke run
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from wide.kernels import RouterPartials, ffn_up, gemm_k
from wide.kernels.gemm_mn import _router_decision, router_launch_args
from wide.kernels.env import interpret_mode
from wide.kernels.routing import check_group_size, check_mask, next_pow2
from wide.base.timing import graph_time_us

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _ffn_decode_kernel(x_ptr, wg_ptr, wu_ptr, wd_ptr, mask_ptr, part_ptr, K, N, GS,
                       stride_wg, stride_wu, stride_wd,
                       hp_ptr, hb_ptr, uw_ptr, ub_ptr, off_ptr, NCHUNK,
                       CH: tl.constexpr, BK: tl.constexpr, BND: tl.constexpr,
                       ROUTER: tl.constexpr, R: tl.constexpr, NC_PAD: tl.constexpr):
    pid = tl.program_id(0)
    c0 = pid * CH  # CH divides GS: a program never straddles two groups
    g = c0 // GS
    if ROUTER:
        on = _router_decision(g, hp_ptr, hb_ptr, uw_ptr, ub_ptr, off_ptr, NCHUNK, R, NC_PAD)
        tl.store(mask_ptr + g, on.to(tl.uint8), mask=(c0 % GS) == 0)
    else:
        on = tl.load(mask_ptr + g) != 0
    if on:
        ch = c0 + tl.arange(0, CH)
        k = tl.arange(0, BK)
        g_rows = wg_ptr + ch[:, None].to(tl.int64) * stride_wg
        u_rows = wu_ptr + ch[:, None].to(tl.int64) * stride_wu
        acc_g = tl.zeros([CH, BK], dtype=tl.float32)
        acc_u = tl.zeros([CH, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = (k0 + k) < K
            xk = tl.load(x_ptr + k0 + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(g_rows + (k0 + k)[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32) * xk
            acc_u += tl.load(u_rows + (k0 + k)[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32) * xk
        gate = tl.sum(acc_g, axis=1)
        h = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_u, axis=1)
        # The two-kernel path stores the intermediate in the input dtype: same rounding here.
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        nn = tl.arange(0, BND)
        d_cols = wd_ptr + ch[None, :]
        for n0 in range(0, N, BND):
            n_ok = (n0 + nn) < N
            wd = tl.load(d_cols + (n0 + nn)[:, None].to(tl.int64) * stride_wd, mask=n_ok[:, None],
                         other=0.0)
            y = tl.sum(wd.to(tl.float32) * h[None, :], axis=1)
            tl.store(part_ptr + pid.to(tl.int64) * N + n0 + nn, y, mask=n_ok)


@triton.jit
def _ffn_decode_reduce_kernel(part_ptr, mask_ptr, y_ptr, N, NPROG, CPG,
                              BN: tl.constexpr, BP: tl.constexpr):
    # y = sum of the active programs' partial rows, in program order (fixed tree per BP block).
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    pp = tl.arange(0, BP)
    acc = tl.zeros([BN], dtype=tl.float32)
    for p0 in range(0, NPROG, BP):
        p = p0 + pp
        act = tl.load(mask_ptr + p // CPG, mask=p < NPROG, other=0) != 0
        v = tl.load(part_ptr + p[:, None].to(tl.int64) * N + n[None, :],
                    mask=act[:, None] & n_ok[None, :], other=0.0)
        acc += tl.sum(v, axis=0)
    tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def _config(group_size: int, K: int) -> dict:
    if interpret_mode():  # few, wide programs: the interpreter pays per program
        return dict(CH=min(group_size, 32), BK=min(64, next_pow2(K)), BND=32, num_warps=4)
    return dict(CH=min(group_size, 32), BK=128, BND=256, num_warps=4)


def ffn_decode(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               mask: torch.Tensor, group_size: int, router: Optional[RouterPartials] = None,
               out: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """The routed FFN of one token, ``x [1, K]`` -> ``[1, N]``, in one pass over the weights
    of the active groups (plus a small deterministic reduce launch).

    ``mask [1, I // group_size]`` bool selects the intermediate groups; with ``router``
    (:class:`RouterPartials`) it is an output instead, written by the kernel as in
    :func:`~wide.kernels.ffn_up`. ``config`` overrides the tile (``CH``, ``BK``, ``BND``,
    ``num_warps``; for sweeps).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be a [1, K] tensor (one token), got {list(getattr(x, 'shape', []))}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; use bfloat16, float16 or float32")
    K = x.shape[1]
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != K \
                or w.shape != w_gate.shape:
            raise ValueError(f"{name} must be [I, K={K}] like w_gate, got "
                             f"{list(getattr(w, 'shape', []))}")
    I = w_gate.shape[0]
    if not isinstance(w_down, torch.Tensor) or w_down.dim() != 2 or w_down.shape[1] != I:
        raise ValueError(f"w_down must be [N, I={I}], got {list(getattr(w_down, 'shape', []))}")
    for w in (w_gate, w_up, w_down):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError("x and the weights must share dtype and device")
        if w.stride(1) != 1:
            raise ValueError("weights must have unit column stride")
    N = w_down.shape[0]
    ng = check_group_size(I, group_size, "I")
    check_mask(mask, 1, ng, x.device)
    cfg = dict(config or _config(group_size, K))
    ch = cfg["CH"]
    if group_size % ch:
        raise ValueError(f"CH={ch} must divide group_size={group_size}")
    if out is not None and (tuple(out.shape) != (1, N) or out.dtype != x.dtype
                            or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [1, {N}] {x.dtype} tensor")
    y = out if out is not None else torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    if router is not None:
        if not mask.is_contiguous():
            raise ValueError("a router writes the mask: it must be contiguous")
        router.check(ng, x.device)
    m = mask.contiguous().view(torch.uint8)
    rargs, rflags = router_launch_args(router, m)
    if K == 0 or I == 0:
        if router is not None and I:
            raise ValueError("a router needs K > 0")
        return y.zero_()
    x = x.contiguous()
    nprog = I // ch
    part = torch.empty((nprog, N), dtype=torch.float32, device=x.device)
    warps = cfg.pop("num_warps", 4)
    _ffn_decode_kernel[(nprog,)](x, w_gate, w_up, w_down, m, part, K, N, group_size,
                                 w_gate.stride(0), w_up.stride(0), w_down.stride(0), *rargs,
                                 **cfg, **rflags, num_warps=warps)
    bn = 64 if interpret_mode() else 128
    _ffn_decode_reduce_kernel[(triton.cdiv(N, bn),)](part, m, y, N, nprog, group_size // ch,
                                                     BN=bn, BP=32, num_warps=4)
    return y


def ffn_decode_reference(x, w_gate, w_up, w_down, mask, group_size):
    """float32 reference of :func:`ffn_decode` (the intermediate rounded to x's dtype, as the
    kernel and the two-kernel path store it)."""
    xf = x.float()
    h = torch.nn.functional.silu(xf @ w_gate.float().t()) * (xf @ w_up.float().t())
    h = (h * mask.repeat_interleave(group_size, dim=1).float()).to(x.dtype).float()
    return h @ w_down.float().t()




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="experiments/results/ffn_decode_ab")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run of this script (TRITON_INTERPRET=1, tiny shapes, no timing)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    K, I, N, G = 4096, 14336, 4096, 128
    timer = graph_time_us
    if args.tiny:
        dev, dt = "cpu", torch.float32
        K, I, N, G = 64, 256, 64, 32
        timer = lambda fns: float("nan")  # noqa: E731
    ng = I // G
    torch.manual_seed(0)
    sets = []
    for _ in range(3):
        wg = torch.randn(I, K, device=dev, dtype=dt) / K ** 0.5
        wu = torch.randn(I, K, device=dev, dtype=dt) / K ** 0.5
        wd = torch.randn(N, I, device=dev, dtype=dt) / I ** 0.5
        x = torch.randn(1, K, device=dev, dtype=dt)
        m = torch.rand(1, ng, device=dev) >= args.sparsity
        # a router whose decisions are ~50 % (random partials, symmetric margins)
        rp = RouterPartials(torch.randn(16, 16, device=dev), torch.zeros(16, device=dev),
                            torch.randn(2 * ng, 16, device=dev), torch.zeros(2 * ng, device=dev),
                            torch.zeros((), device=dev))
        sets.append(dict(wg=wg, wu=wu, wd=wd, wgu=torch.cat([wg, wu]), x=x, m=m, rp=rp,
                         rm=torch.empty(1, ng, dtype=torch.bool, device=dev)))
    recs = []

    def check(fn, s, mask_key="m"):
        y = fn(s).float()
        r = ffn_decode_reference(s["x"], s["wg"], s["wu"], s["wd"], s[mask_key], G)
        return ((y - r).norm() / r.norm()).item()

    def add(name, fn, mask_key="m", **kw):
        err = check(fn, sets[0], mask_key)
        us = timer([lambda s=s: fn(s) for s in sets])
        rec = dict(variant=name, us=us, rel_err=err, **kw)
        recs.append(rec)
        print(f"{name:60s} {us:8.2f} us  err {err:.1e}", flush=True)
        return rec

    def two(s):
        u = ffn_up(s["x"], s["wg"], s["wu"], s["m"], G)
        return gemm_k(u, s["wd"], s["m"], G)

    def two_router(s):
        u = ffn_up(s["x"], s["wg"], s["wu"], s["rm"], G, router=s["rp"])
        return gemm_k(u, s["wd"], s["rm"], G)

    def dense(s):
        gu = F.linear(s["x"], s["wgu"])
        return F.linear(F.silu(gu[:, :I]) * gu[:, I:], s["wd"])

    d = dense(sets[0]).float()
    full = ffn_decode_reference(sets[0]["x"], sets[0]["wg"], sets[0]["wu"], sets[0]["wd"],
                                torch.ones(1, ng, dtype=torch.bool, device=dev), G)
    recs.append(dict(variant="cublas dense (gate/up, silu*up, down)",
                     us=timer([lambda s=s: dense(s) for s in sets]),
                     rel_err=((d - full).norm() / full.norm()).item()))
    print(recs[-1], flush=True)
    add("two kernels: ffn_up + gemm_k (mask given)", two)
    add("two kernels: ffn_up + gemm_k (router in ffn_up)", two_router, mask_key="rm")
    us = timer([lambda s=s: ffn_up(s["x"], s["wg"], s["wu"], s["m"], G) for s in sets])
    recs.append(dict(variant="ffn_up alone (mask given)", us=us, rel_err=float("nan")))
    print(recs[-1], flush=True)
    add("fused default (mask given)", lambda s: ffn_decode(s["x"], s["wg"], s["wu"], s["wd"], s["m"], G))
    add("fused default (router)", lambda s: ffn_decode(s["x"], s["wg"], s["wu"], s["wd"], s["rm"], G,
                                                      router=s["rp"]), mask_key="rm")
    grid = itertools.product([16, 32, 64], [128, 256, 512], [64, 256], [4, 8])
    if args.quick:
        grid = [(32, 128, 256, 4), (32, 256, 256, 8), (64, 128, 128, 8), (16, 256, 256, 4)]
    t0 = time.time()
    for ch, bk, bnd, w in grid:
        if time.time() - t0 > 200:
            print("sweep time budget spent", flush=True)
            break
        if 2 * ch * bk > 128 * 32 * w or (args.tiny and (ch > G or bk > K)):
            continue  # two [CH, BK] fp32 accumulators over > 128 registers per thread: spills
        cfg = dict(CH=ch, BK=bk, BND=bnd, num_warps=w)
        try:
            add(f"fused CH={ch} BK={bk} BND={bnd} warps={w}",
                lambda s, c=cfg: ffn_decode(s["x"], s["wg"], s["wu"], s["wd"], s["m"], G, config=c),
                **cfg)
        except Exception as e:  # e.g. out of registers / shared memory for a tile
            print(f"CH={ch} BK={bk} BND={bnd} w={w}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)", torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="PYTHONPATH=src python experiments/ffn_decode_ab.py " + " ".join(
                    f"--{k}" if v is True else f"--{k} {v}"
                    for k, v in vars(args).items() if v not in (False, None)),
                shape=dict(K=K, I=I, N=N, G=G, sparsity=args.sparsity))
    out.with_suffix(".json").write_text(json.dumps(dict(meta, records=recs), indent=1))
    best = min((r for r in recs if r["variant"].startswith("fused CH")), key=lambda r: r["us"], default=None)
    lines = [f"# Batch-1 routed FFN: fused kernel vs two kernels ({meta['device']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. K={K}, I={I}, N={N}, "
             f"G={G}, i.i.d. masks at {args.sparsity:.0%}; CUDA-graph time per call over 3 weight sets.",
             "", f"Command: `{meta['command']}`", "", "| variant | us | rel err vs fp32 |", "|---|---|---|"]
    for r in sorted(recs, key=lambda r: r["us"]):
        lines.append(f"| {r['variant']} | {r['us']:.2f} | {r['rel_err']:.1e} |")
    if best:
        lines += ["", f"Fastest fused tile: {best['variant']} ({best['us']:.2f} us)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
