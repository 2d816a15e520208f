"""Trial: decode GEMV design sweep (T=1, 50 % masks, Llama-3.1-8B shapes), H200.

Why: the routed decode GEMVs other than ffn_up read their bytes at 1.6-2.6 TB/s (e2e profile),
cuBLAS at ~3.1 TB/s on the same sizes. This times, inside one CUDA graph of back-to-back calls on
rotating weight copies (so L2 never holds the weights and no graph-launch cost is counted), the
library's tl.dot kernels over a grid of tiles and split-K factors, and CUDA-core candidates
(elementwise FMA + row reduction, no MMA), against cuBLAS. Every variant is first checked against
the fp32 reference.

    PYTHONPATH=src python experiments/decode_gemv_sweep.py --out DIR
    PYTHONPATH=src python experiments/decode_gemv_sweep.py --wide --shapes o,q,down --out DIR
    PYTHONPATH=src python experiments/decode_gemv_sweep.py --probe-only --out DIR
(``--wide``: steps of up to a whole row over 1-4 rows per program, gemm_k loads predicated per
column, so each program has all its bytes in flight at once as the plain-read floor does;
results: experiments/results/decode_gemv_sweep_wide.md. ``--probe-only``: the plain-read floors
(``wide.benchmarks.read_floors``, the reproducible part, which the bounds use), the o/q GEMVs
with L2-hot weights and with programmatic dependent launch; experiments/results/decode_gemv_probe.md.)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "src")
import importlib  # noqa: E402
gk = importlib.import_module("wide.kernels.gemm_k")
gm = importlib.import_module("wide.kernels.gemm_mn")
from wide.benchmarks import read_floors  # noqa: E402
from wide.kernels.routing import split_tickets  # noqa: E402
from wide.base.timing import graph_time_us  # noqa: E402


@triton.jit
def _store_1d(acc, ws_ptr, y_ptr, cnt_ptr, tile, n, n_ok, N, SPLIT: tl.constexpr):
    if SPLIT:
        n_s = tl.num_programs(1)
        tl.store(ws_ptr + tl.program_id(1) * N + n, acc, mask=n_ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == n_s - 1:
            tot = tl.zeros_like(acc)
            for s in range(0, n_s):
                tot += tl.load(ws_ptr + s * N + n, mask=n_ok, other=0.0, volatile=True)
            tl.store(y_ptr + n, tot.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + tile, 0)
    else:
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2 of every address in ptrs (one per 128-byte line); the dummy output
    # keeps the call from being removed.
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cc_mn(x_ptr, w_ptr, y_ptr, mask_ptr, ws_ptr, cnt_ptr, N, K, GS, NG_MASKED, KC,
           BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
           GDC: tl.constexpr = 0):
    pid = tl.program_id(0)
    if GDC == 2:  # weights known before the predecessor ends: prefetch this program's rows
        n0 = pid * BN + tl.arange(0, BN)
        g0 = (pid * BN) // GS
        a0 = tl.load(mask_ptr + g0, mask=g0 < NG_MASKED, other=1)
        kl = tl.arange(0, 64) * 64  # one address per 128 B line, first 4096 columns
        kl = tl.where(a0 != 0, kl, 0)
        _prefetch_l2(w_ptr + n0[:, None].to(tl.int64) * K + kl[None, :])
    if GDC > 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = pid * BN + tl.arange(0, BN)
    n_ok = n < N
    g = (pid * BN) // GS
    act = tl.load(mask_ptr + g, mask=g < NG_MASKED, other=1)
    k_lo = tl.program_id(1) * KC
    k_hi = tl.minimum(K, k_lo + KC)
    k_end = tl.where(act != 0, k_hi, k_lo)
    k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_end, BK, num_stages=STAGES):
        xk = tl.load(x_ptr + k0 + k).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + (k0 + k)[None, :], mask=n_ok[:, None],
                    other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    _store_1d(tl.sum(acc, axis=1), ws_ptr, y_ptr, cnt_ptr, pid, n, n_ok, N, SPLIT)


@triton.jit
def _cc_k(x_ptr, w_ptr, y_ptr, mask_ptr, ws_ptr, cnt_ptr, N, K, NG, GS,
          BN: tl.constexpr, BK: tl.constexpr, NG_PAD: tl.constexpr, SPLIT: tl.constexpr,
          FLAT: tl.constexpr, STAGES: tl.constexpr, GDC: tl.constexpr = 0):
    # FLAT: 0 loop over the active groups only, 1 every step predicated on its group, 2 every
    # step predicated per column
    pid = tl.program_id(0)
    if GDC > 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = pid * BN + tl.arange(0, BN)
    n_ok = n < N
    k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    s = tl.program_id(1)
    n_s = tl.num_programs(1)
    if FLAT:
        # every step of K, loads predicated on the step's group being active (FLAT == 2: on
        # each column's group, so a step may span several groups, e.g. a whole row in one step:
        # all of a program's bytes in flight at once, as in the plain read)
        n_steps = K // BK
        j_lo = (s * n_steps) // n_s
        j_hi = ((s + 1) * n_steps) // n_s
        for j in tl.range(j_lo, j_hi, num_stages=STAGES):
            k0 = j * BK
            if FLAT == 2:
                a = tl.load(mask_ptr + (k0 + k) // GS) != 0
            else:
                a = tl.load(mask_ptr + k0 // GS + k * 0) != 0
            xk = tl.load(x_ptr + k0 + k, mask=a, other=0.0).to(tl.float32)
            w = tl.load(w_rows + (k0 + k)[None, :], mask=n_ok[:, None] & a[None, :], other=0.0)
            acc += w.to(tl.float32) * xk[None, :]
    else:
        gp = tl.arange(0, NG_PAD)
        used = (tl.load(mask_ptr + gp, mask=gp < NG, other=0) != 0).to(tl.int32)
        pos = tl.cumsum(used, axis=0) - 1
        n_used = tl.sum(used, axis=0)
        ent = tl.where(used != 0, gp, -1)
        spg = GS // BK
        n_steps = n_used * spg
        j_lo = (s * n_steps) // n_s
        j_hi = ((s + 1) * n_steps) // n_s
        for j in tl.range(j_lo, j_hi, num_stages=STAGES):
            gi = j // spg
            gid = tl.max(tl.where(pos == gi, ent, -1), axis=0)
            k0 = gid * GS + (j - gi * spg) * BK
            xk = tl.load(x_ptr + k0 + k).to(tl.float32)
            w = tl.load(w_rows + (k0 + k)[None, :], mask=n_ok[:, None], other=0.0)
            acc += w.to(tl.float32) * xk[None, :]
    _store_1d(tl.sum(acc, axis=1), ws_ptr, y_ptr, cnt_ptr, pid, n, n_ok, N, SPLIT)


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def measure(record, shape, impl, cfg, call, out, ref, copies, nbytes, max_err=None):
    """Check ``call(0)`` (which writes ``out``) against ``ref``, then time ``call(i)`` for the
    ``copies`` input sets back to back and record it; a failure or an error over ``max_err``
    is printed and skipped."""
    try:
        call(0)
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        if max_err is not None and err > max_err:
            print("BAD", shape, cfg, err)
            return
        record(shape, impl, cfg, graph_time_us([lambda i=i: call(i) for i in range(copies)]), err,
               nbytes)
    except Exception as e:  # noqa: BLE001
        print("FAIL", shape, impl, cfg, type(e).__name__, str(e)[:300], flush=True)


def half_mask(ng, gen, dev):
    m = torch.zeros(ng, dtype=torch.bool)
    m[torch.randperm(ng, generator=gen)[: ng // 2]] = True
    return m.view(1, ng).to(dev)


def probe(rows, record, dev, gen):
    """Floors: a plain read of the same bytes; the o GEMV with its weights hot in L2; PDL."""
    C = 8
    read_floors.measure(record, dev)
    # q / o shapes: cold (rotating copies), hot (same copy), PDL, PDL + L2 prefetch
    N, K, GS, ngm = 4096, 4096, 512, 8
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(C)]
    xs = [torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(C)]
    ms = [half_mask(ngm, gen, dev) for _ in range(C)]
    ys = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in range(C)]
    nbytes = N * K
    refs = [gm.gemm_mn_reference(x, w, m, GS) for x, w, m in zip(xs, ws, ms)]
    refk = [gk.gemm_k_reference(x, w, m, GS) for x, w, m in zip(xs, ws, ms)]
    wsp = torch.empty((1, N), device=dev, dtype=torch.float32)
    tick = split_tickets(dev, N)
    for bn, bk, nw in ((4, 1024, 8), (4, 512, 4), (8, 512, 8)):
        for gdc in (0, 1, 2):
            for hot in (False, True):
                def mn(i, gdc=gdc, bn=bn, bk=bk, nw=nw, hot=hot):
                    j = 0 if hot else i
                    _cc_mn[(N // bn, 1)](xs[j], ws[j], ys[j], ms[j].view(torch.uint8), wsp, tick,
                                         N, K, GS, ngm, K, BN=bn, BK=bk, SPLIT=False, STAGES=1,
                                         GDC=gdc, num_warps=nw, launch_pdl=gdc > 0)
                cfg = f"BN={bn} BK={bk} w={nw} gdc={gdc} hot={hot}"
                measure(record, "q", "cc_probe", cfg, mn, ys[0], refs[0], C, nbytes)
                if gdc == 2:
                    continue

                def kk(i, gdc=gdc, bn=bn, bk=bk, nw=nw, hot=hot):
                    j = 0 if hot else i
                    _cc_k[(N // bn, 1)](xs[j], ws[j], ys[j], ms[j].view(torch.uint8), wsp, tick,
                                        N, K, ngm, GS, BN=bn, BK=bk, NG_PAD=16, SPLIT=False,
                                        FLAT=False, STAGES=1, GDC=gdc, num_warps=nw,
                                        launch_pdl=gdc > 0)
                measure(record, "o", "cc_probe", cfg, kk, ys[0], refk[0], C, nbytes)
    # library kernels hot vs cold
    for hot in (False, True):
        calls = [lambda i=i, hot=hot: gk.gemm_k(xs[0 if hot else i], ws[0 if hot else i],
                                                 ms[0 if hot else i], GS, out=ys[i]) for i in range(C)]
        record("o", "lib_probe", f"hot={hot}", graph_time_us(calls), 0.0, nbytes)
        calls = [lambda i=i, hot=hot: torch.matmul(xs[0 if hot else i], ws[0 if hot else i].t(),
                                                    out=ys[i]) for i in range(C)]
        record("o", "cublas_probe", f"hot={hot}", graph_time_us(calls), 0.0, N * K * 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/decode_gemv_sweep")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probe-only", action="store_true")
    ap.add_argument("--wide", action="store_true",
                    help="wide-step CUDA-core variants only (BK up to a whole row, 1-4 rows)")
    ap.add_argument("--shapes", default="qkv,q,o,down")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.time()
    record = read_floors.recorder(rows, widths=(8, 14, 40))

    # shape: (kind, N, K, GS, n routed groups, dense tail cols)
    shapes = {
        "qkv": ("mn", 6144, 4096, 512, 8, 2048),
        "q": ("mn", 4096, 4096, 512, 8, 0),
        "o": ("k", 4096, 4096, 512, 8, 0),
        "down": ("k", 4096, 14336, 128, 112, 0),
    }
    shapes = {k: v for k, v in shapes.items() if k in a.shapes.split(",")}
    for name, (kind, N, K, GS, ngm, tail) in ({} if a.probe_only else shapes).items():
        C = a.copies
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(C)]
        xs = [torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(C)]
        ms = [half_mask(ngm, gen, dev) for _ in range(C)]
        ys = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in range(C)]
        if kind == "mn":
            refs = [gm.gemm_mn_reference(x, w, m, GS, dense_tail=tail) for x, w, m in zip(xs, ws, ms)]
            nbytes = (N - tail) // 2 * K * 2 + tail * K * 2
        else:
            refs = [gk.gemm_k_reference(x, w, m, GS) for x, w, m in zip(xs, ws, ms)]
            nbytes = N * K  # half of the N*K*2 bytes
        # cuBLAS dense (same bytes as the full weight)
        us = graph_time_us([lambda i=i: torch.matmul(xs[i], ws[i].t(), out=ys[i]) for i in range(C)])
        record(name, "cublas_dense", "-", us, 0.0, N * K * 2)
        # library, as the engine calls it (autotuned)
        if kind == "mn":
            lib = [lambda i=i: gm.gemm_mn(xs[i], ws[i], ms[i], GS, out=ys[i], dense_tail=tail)
                   for i in range(C)]
        else:
            lib = [lambda i=i: gk.gemm_k(xs[i], ws[i], ms[i], GS, out=ys[i]) for i in range(C)]
        lib[0]()
        err = rel_err(ys[0], refs[0])
        record(name, "lib_autotuned", "-", graph_time_us(lib), err, nbytes)

        # CUDA-core candidates
        if a.wide:
            # Wide steps: up to a whole row per step (per-column predication for gemm_k), so
            # a program has all of its bytes in flight at once; few rows per program; software
            # pipelining of the remaining steps.
            bks, splits = [1024, 2048, 4096], ([1, 2] if K > 4096 else [1])
            bns, warps, stages = [1, 2, 4], [4, 8, 16], [1, 3]
        else:
            if kind == "mn":
                bks, splits = [512, 1024], [1, 2, 4]
            else:
                bks, splits = ([128] if GS == 128 else [256, 512]), [1, 2, 4, 8]
            bns, warps, stages = [4, 8, 16], [4, 8], [1]
        if a.quick:
            bns, warps, stages = bns[1:3], [4], [1]
        for bn, bk, sp, nw, st in itertools.product(bns, bks, splits, warps, stages):
            if bn * bk > 16384 or (not a.wide and bk > GS * (1 if kind == "k" else 8)):
                continue
            if a.wide and (bk > K or K % bk or (st > 1 and bk * sp >= K) or bn * bk < 32 * nw * 8):
                continue  # one step needs no pipelining; fewer than 8 elements per thread
            kc = triton.cdiv(triton.cdiv(K, sp), bk) * bk
            nsp = triton.cdiv(K, kc) if kind == "mn" else sp
            wsp = torch.empty((nsp, N), device=dev, dtype=torch.float32)
            tick = split_tickets(dev, triton.cdiv(N, bn))
            flat_opts = ([2] if a.wide else [0, 1]) if kind == "k" else [0]
            for flat in flat_opts:
                cfg = f"BN={bn} BK={bk} S={nsp} w={nw} st={st}" + (["", " flat", " flatcol"][flat])

                def call(i, bn=bn, bk=bk, kc=kc, nsp=nsp, nw=nw, st=st, flat=flat, wsp=wsp,
                         tick=tick):
                    m8 = ms[i].view(torch.uint8)
                    if kind == "mn":
                        _cc_mn[(triton.cdiv(N, bn), nsp)](
                            xs[i], ws[i], ys[i], m8, wsp, tick, N, K, GS, ngm, kc,
                            BN=bn, BK=bk, SPLIT=nsp > 1, STAGES=st, num_warps=nw)
                    else:
                        _cc_k[(triton.cdiv(N, bn), nsp)](
                            xs[i], ws[i], ys[i], m8, wsp, tick, N, K, ngm, GS,
                            BN=bn, BK=bk, NG_PAD=max(16, triton.next_power_of_2(ngm)),
                            SPLIT=nsp > 1, FLAT=flat, STAGES=st, num_warps=nw)
                measure(record, name, "cuda_core", cfg, call, ys[0], refs[0], C, nbytes,
                        max_err=1e-2)
        del ws
        torch.cuda.empty_cache()
        print(f"[{time.time() - t_start:.0f} s]", flush=True)

    if not a.wide:
        probe(rows, record, dev, gen)
    import os
    os.makedirs(a.out, exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python experiments/decode_gemv_sweep.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(a.out, "decode_gemv_sweep.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    best = {}
    for r in rows:
        key = (r["shape"], r["impl"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    with open(os.path.join(a.out, "decode_gemv_sweep.md"), "w") as f:
        f.write(f"# Decode GEMV sweep (T=1, 50 %)\n\n{env}\n\n| shape | impl | best cfg | us | TB/s |\n"
                "|---|---|---|---|---|\n")
        for (s, i), r in sorted(best.items()):
            f.write(f"| {s} | {i} | {r['cfg']} | {r['us']} | {r['tbps']} |\n")
    print(open(os.path.join(a.out, "decode_gemv_sweep.md")).read())


if __name__ == "__main__":
    main()
