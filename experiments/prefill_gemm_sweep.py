"""Trial: prefill routed gemm_mn / ffn_up sweep: weight tiles by TMA descriptor vs pointer loads (H200).

Why: at T=4096 and 50 % the fused gate/up (`ffn_up`) runs at ~490 TFLOP/s on its active work,
cuBLAS at ~684 on dense work (bench/results/kernels.md: 1.64x where the target is 1.85x), and
it is a third of the routed prefill. The X rows of a group are gathered through its token list
(Hopper has no TMA gather), but every weight tile is a contiguous [BN, BK] block of W: this
times a variant that loads the weight tiles through host TMA descriptors, and the library's own
pointer-load kernel over a wider tile grid than its autotuner tries, both against the library
call (autotuned) and cuBLAS. Every variant is first checked against the fp32 reference; every
timed call includes the mask reordering (RouteIndex), as the library call does.

    PYTHONPATH=src python experiments/prefill_gemm_sweep.py --out experiments/results/prefill_gemm_sweep
    TRITON_INTERPRET=1 PYTHONPATH=src python experiments/prefill_gemm_sweep.py --check-only   # CPU
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from wide.kernels.routing import RouteIndex

gm = importlib.import_module("wide.kernels.gemm_mn")  # the module (the package exports the op)
_tile_of = gm._tile_of  # the library kernel's program -> tile decomposition

try:  # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the install
    TensorDescriptor = None


@triton.jit
def _mn_tma_kernel(x_ptr, wg_desc, wu_desc, y_ptr, idx_ptr, counts_ptr, T, K, GS,
                   stride_xt, stride_yt,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FUSED: tl.constexpr):
    # The library's prefill decomposition (gemm_mn.py): program = (group g, BN-wide slice of its
    # columns, BM rows of g's token list), row tile fastest; tiles past the group's count run
    # no K step and store zeros. Only the weight tiles differ: TMA loads of [BN, BK] blocks.
    m_tile, g, sub, r, row_in = _tile_of(tl.program_id(0), T, GS, BM, BN)
    cnt = tl.load(counts_ptr + g)
    tok = tl.load(idx_ptr + g * T + r, mask=row_in, other=0).to(tl.int64)
    act = r < cnt
    n0 = g * GS + sub * BN
    k_end = tl.where(cnt > m_tile * BM, K, 0)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        a = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + k)[None, :], mask=act[:, None], other=0.0)
        acc = tl.dot(a, wg_desc.load([n0, k0]).T, acc)
        if FUSED:
            acc2 = tl.dot(a, wu_desc.load([n0, k0]).T, acc2)
    if FUSED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    n = n0 + tl.arange(0, BN)
    tl.store(y_ptr + tok[:, None] * stride_yt + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_in[:, None])


def _rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def _variants(fused: bool, check_only: bool):
    """(impl, tile dict) candidates; a small set under the interpreter."""
    if check_only:
        return [("tma", dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1)),
                ("pointer", dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1))]
    out = []
    bns = [64, 128] if fused else [128, 256]
    for impl, bm, bn, bk, w, st in itertools.product(("tma", "pointer"), (64, 128), bns, (64, 128),
                                                     (4, 8), (3, 4, 5)):
        regs = bm * bn * (2 if fused else 1) // (32 * w)  # fp32 accumulator words per thread
        smem = st * (bm * bk + bn * bk * (2 if fused else 1)) * 2
        if regs > 192 or smem > 220 * 1024:
            continue
        out.append((impl, dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st)))
    return out


def _launcher(impl, cfg, x, ws, y, mask, G, fused):
    """A call of one variant on (x, ws, mask), reordering included."""
    T, K = x.shape
    N = ws[0].shape[0]
    ng = N // G
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    grid = (triton.cdiv(T, bm) * ng * (G // bn),)
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if impl == "tma":
        descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
        wu = descs[1] if fused else descs[0]

        def call():
            route = RouteIndex(mask)
            _mn_tma_kernel[grid](x, descs[0], wu, y, route.idx, route.counts, T, K, G,
                                 x.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, FUSED=fused, **opts)
        return call
    w2 = ws[1] if fused else ws[0]

    def call():  # the library kernel itself, with this tile
        route = RouteIndex(mask)
        m = route.mask.view(torch.uint8)
        gm._plain_kernel[grid](x, ws[0], w2, y, m, route.idx, route.counts, T, N, K, G, x.stride(0),
                               ws[0].stride(0), w2.stride(0), y.stride(0), m.stride(0),
                               triton.next_power_of_2(T), y, K, ng, m,
                               DIRECT=False, FUSED=fused, SPLIT=False, BM=bm, BN=bn, BK=bk, **opts)
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/prefill_gemm_sweep")
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096])
    ap.add_argument("--check-only", action="store_true",
                    help="tiny shapes, correctness only (CPU under TRITON_INTERPRET=1)")
    a = ap.parse_args(argv)
    check_only = a.check_only
    dev = torch.device("cpu" if check_only and not torch.cuda.is_available() else "cuda")
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    if TensorDescriptor is None:
        print("triton.tools.tensor_descriptor is missing (triton < 3.4): TMA variants skipped")
    gen = torch.Generator().manual_seed(0)
    # name: (fused, N, K, G); Llama-3.1-8B gate/up and q
    shapes = {"gate_up": (True, 14336, 4096, 128), "q": (False, 4096, 4096, 512)}
    if check_only:
        shapes = {"gate_up": (True, 256, 64, 64), "q": (False, 128, 64, 64)}
        a.tokens = [70]
    rows = []
    t0 = time.time()
    if not check_only:
        from wide.base.timing import graph_time_us
    for (name, (fused, N, K, G)), T in itertools.product(shapes.items(), a.tokens):
        x = torch.randn(T, K, generator=gen).to(dev, dt)
        ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(dev, dt) for _ in range(2 if fused else 1)]
        mask = (torch.rand(T, N // G, generator=gen) < 0.5).to(dev)
        ref = (gm.ffn_up_reference(x, ws[0], ws[1], mask, G) if fused
               else gm.gemm_mn_reference(x, ws[0], mask, G))
        y = torch.empty(T, N, device=dev, dtype=dt)
        flop = 2 * T * K * N * (2 if fused else 1) * float(mask.float().mean())
        cands = []
        if not check_only:
            dense_w = torch.cat(ws) if fused else ws[0]
            cands.append(("cublas_dense", "-", lambda: F.linear(x, dense_w), None))
        lib = (lambda: gm.ffn_up(x, ws[0], ws[1], mask, G, out=y)) if fused else \
            (lambda: gm.gemm_mn(x, ws[0], mask, G, out=y))
        cands.append(("lib_autotuned", "-", lib, ref))
        for impl, cfg in _variants(fused, check_only):
            if impl == "tma" and TensorDescriptor is None:
                continue
            label = " ".join(f"{k}={v}" for k, v in cfg.items())
            cands.append((impl, label, _launcher(impl, cfg, x, ws, y, mask, G, fused), ref))
        for impl, label, fn, want in cands:
            row = dict(shape=name, T=T, impl=impl, cfg=label)
            try:
                if want is not None:
                    y.fill_(float("nan"))
                    fn()
                    row["rel_err"] = _rel_err(y, want)
                    if not row["rel_err"] < 1e-2:
                        row["error"] = "wrong result"
                if not check_only and "error" not in row:
                    us = graph_time_us([fn])
                    row.update(us=round(us, 1), tflops=round(flop / us / 1e6, 1))
            except Exception as e:  # a tile the compiler or the device refuses: record, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    bad = [r for r in rows if r.get("error") == "wrong result"]
    if check_only:
        print("check-only:", "FAILED" if bad else "all variants match the fp32 reference")
        return 1 if bad else 0
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command="PYTHONPATH=src python experiments/prefill_gemm_sweep.py --out " + a.out)
    with open(a.out + ".json", "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Prefill gemm_mn / ffn_up sweep ({env['gpu']})\n\n{env['torch']=} {env['triton']=} "
                f"{env['date']}. Command: `{env['command']}`\n\nBest of each impl per shape "
                f"(all rows in the JSON); times include the mask reordering.\n\n"
                "| shape | T | impl | cfg | us | TFLOP/s (active) | rel err |\n|---|---|---|---|---|---|---|\n")
        for key, grp in itertools.groupby(sorted((r for r in rows if "us" in r),
                                                 key=lambda r: (r["shape"], r["T"], r["impl"], r["us"])),
                                          key=lambda r: (r["shape"], r["T"], r["impl"])):
            r = next(grp)
            f.write(f"| {r['shape']} | {r['T']} | {r['impl']} | {r['cfg']} | {r['us']} | {r['tflops']} | "
                    f"{r.get('rel_err', 0):.1e} |\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
