"""K-major weights for the reduction-width GEMMs (O, down), H200.

Why: at batch 1 the row-major down GEMV reads, per weight row, 56 separate 256-byte pieces (one
per active 128-wide group) and reaches ~2.6 TB/s, while the gate/up GEMV, whose groups are whole
contiguous rows, reads at the copy ceiling (~3.9 TB/s). Stored K-major (``k_major(w)``), a
group's weights are one contiguous block. This times, as back-to-back calls inside one CUDA
graph on rotating weight copies (the decode GEMV sweep's timer), at 50 % i.i.d. masks:

* T=1: the library's row-major gemm_k, its K-major batch-1 GEMV (autotuned, and a grid of tiles
  and split factors), cuBLAS on either layout;
* T=2..4096: cuBLAS and the library's gemm_k on either layout (what batched decode and prefill
  would pay for the K-major storage, since the engine falls back to cuBLAS there).

Every variant is first checked against the fp32 reference (bf16: rel err < 1e-2).

    python bench/decode_kmajor_sweep.py --out bench/results/decode_kmajor_sweep
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/decode_kmajor_sweep.py --check-only   # CPU
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, "src")
import importlib  # noqa: E402
gk = importlib.import_module("wide.kernels.gemm_k")
from wide.benchmarks.kernels import _graph_time_us as graph_time_us  # noqa: E402
from wide.kernels.gemm_mn import gemv_launch_state  # noqa: E402


def masks(T, ng, gen, dev):
    """[T, ng] masks with exactly half of each row's groups active."""
    m = torch.zeros(T, ng, dtype=torch.bool)
    for t in range(T):
        m[t, torch.randperm(ng, generator=gen)[: ng // 2]] = True
    return m.to(dev)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/decode_kmajor_sweep")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    ap.add_argument("--tokens", default="1,2,8,32,4096", help="token counts (comma list)")
    ap.add_argument("--check-only", action="store_true",
                    help="tiny fp32 shapes, every variant checked, nothing timed (CPU interpreter)")
    a = ap.parse_args(argv)
    check_only = a.check_only
    dev = torch.device("cpu" if check_only and not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if check_only else torch.bfloat16
    max_err = 1e-5 if check_only else 1e-2
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    bad = []
    t0 = time.time()

    def record(shape, impl, cfg, us, err, nbytes, T=1):
        r = dict(shape=shape, T=T, impl=impl, cfg=cfg, us=round(us, 2), rel_err=err,
                 tbps=round(nbytes / max(us, 1e-9) / 1e6, 3))
        rows.append(r)
        print(f"{shape:5s} T={T:<5d} {impl:16s} {cfg:34s} {us:9.2f} us {r['tbps']:5.2f} TB/s "
              f"err {err:.1e}", flush=True)

    def measure(shape, T, impl, cfg, call, out, ref, copies, nbytes, check=True):
        """Check call(0) (it writes ``out``) against ``ref``, then time call(i) for the copies
        back to back in one CUDA graph (the decode GEMV sweep's timer)."""
        try:
            call(0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()
            if check and not err < max_err:
                print("BAD", shape, T, impl, cfg, err, flush=True)
                bad.append((shape, T, impl, cfg, err))
                return
            us = 0.0 if check_only else graph_time_us([lambda i=i: call(i) for i in range(copies)])
            record(shape, impl, cfg, us, err, nbytes, T)
        except Exception as e:  # noqa: BLE001
            print("FAIL", shape, T, impl, cfg, type(e).__name__, str(e)[:300], flush=True)
            bad.append((shape, T, impl, cfg, type(e).__name__))

    shapes = {"down": (4096, 14336, 128), "o": (4096, 4096, 512)}
    tokens = tuple(int(t) for t in a.tokens.split(","))
    C = a.copies
    if check_only:
        shapes = {"down": (40, 256, 16), "o": (40, 1024, 256)}
        tokens, C = (1, 3), 1
    for name, (N, K, GS) in shapes.items():
        ng = K // GS
        ws = [(torch.randn(N, K, device=dev) * 0.02).to(dtype) for _ in range(C)]
        wks = [gk.k_major(w) for w in ws]
        for T in tokens:
            Cx = C if T <= 32 else 2
            xs = [torch.randn(T, K, device=dev).to(dtype) for _ in range(Cx)]
            ms = [masks(T, ng, gen, dev) for _ in range(Cx)]
            ys = [torch.empty(T, N, device=dev, dtype=dtype) for _ in range(Cx)]
            refs = [gk.gemm_k_reference(x, w, m, GS) for x, w, m in zip(xs, ws, ms)]
            used = sum(float(m.any(0).float().mean()) for m in ms) / Cx
            routed_bytes = used * N * K * ws[0].element_size()
            dense_ref = F.linear(xs[0].float(), ws[0].float())
            for lay, wl in (("row", ws), ("k_major", wks)):
                measure(name, T, f"cublas_{lay}", "-",
                        lambda i, wl=wl: torch.matmul(xs[i], wl[i].t(), out=ys[i]),
                        ys[0], dense_ref, Cx, N * K * ws[0].element_size())
                measure(name, T, f"lib_{lay}", "-",
                        lambda i, wl=wl: gk.gemm_k(xs[i], wl[i], ms[i], GS, out=ys[i]),
                        ys[0], refs[0], Cx, routed_bytes)
            if T == 1:  # the K-major batch-1 GEMV over a grid of tiles
                m8 = [m.view(torch.uint8) for m in ms]
                grid = itertools.product([64, 128, 256, 512], [32, 64, 128], [16, 32], [4], [1, 0])
                if a.quick or check_only:
                    grid = [(256, 32, 32, 8, 1), (128, 16, 16, 4, 0)]
                for bn, bk, sp, nw, db in grid:
                    if check_only:
                        bn, bk, sp = 32, min(bk, GS), 2
                    elif not 2048 <= bn * bk <= 16384 or GS % bk or sp > gk.KT_MAX_SPLIT:
                        continue
                    wsp, tick, _ = gemv_launch_state(dev, N, gk.KT_MAX_SPLIT)

                    def call(i, bn=bn, bk=bk, sp=sp, nw=nw, db=db, wsp=wsp, tick=tick):
                        gk._gemv_kt_kernel[(triton.cdiv(N, bn), sp)](
                            xs[i], wks[i], ys[i], m8[i], wsp, tick, N, K, ng, GS, wks[i].stride(1),
                            BN=bn, BK=bk, S=sp, NG_PAD=max(16, triton.next_power_of_2(ng)), DB=db,
                            num_warps=nw)
                    measure(name, T, "kt_gemv", f"BN={bn} BK={bk} S={sp} w={nw} DB={db}", call,
                            ys[0], refs[0], C, routed_bytes)
                # the row-major batch-1 GEMV's own configs, with and without the double buffer
                for c in (gk._GEMV_CFGS if GS >= gk.GEMV_MIN_GROUP else []):
                    kw = dict(c.kwargs)
                    if check_only:
                        kw.update(BN=8, BK=min(kw["BK"], GS), S=2)
                    elif GS % kw["BK"]:
                        continue
                    wsp, tick, grid_fn = gemv_launch_state(dev, N)

                    def rcall(i, kw=kw, nw=c.num_warps, wsp=wsp, tick=tick):
                        gk._gemv_k_kernel[(triton.cdiv(N, kw["BN"]), kw["S"])](
                            xs[i], ws[i], ys[i], m8[i], wsp, tick, N, K, ng, GS, ws[i].stride(0),
                            NG_PAD=max(16, triton.next_power_of_2(ng)), num_warps=nw, **kw)
                    measure(name, T, "row_gemv", " ".join(f"{k}={v}" for k, v in kw.items())
                            + f" w={c.num_warps}", rcall, ys[0], refs[0], C, routed_bytes)
            del xs, ys, refs
            print(f"[{time.time() - t0:.0f} s]", flush=True)
        del ws, wks
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if check_only:
        print(f"{len(rows)} variants checked, {len(bad)} bad")
        return 1 if bad or not rows else 0

    os.makedirs(a.out, exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command="python bench/decode_kmajor_sweep.py " + " ".join(sys.argv[1:]))
    with open(os.path.join(a.out, "decode_kmajor_sweep.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    best = {}
    for r in rows:
        key = (r["shape"], r["T"], r["impl"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    with open(os.path.join(a.out, "decode_kmajor_sweep.md"), "w") as f:
        f.write("# K-major O / down weights: batch-1 GEMV and the layouts' cost elsewhere\n\n"
                f"{env}\n\nBest of each implementation (all rows in the JSON); TB/s on the bytes "
                "read (the used groups' weights for the routed rows, all of them for cuBLAS).\n\n"
                "| shape | T | impl | best cfg | us | TB/s | rel err |\n|---|---|---|---|---|---|---|\n")
        for (s, T, i), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1]["us"])):
            f.write(f"| {s} | {T} | {i} | {r['cfg']} | {r['us']} | {r['tbps']} | {r['rel_err']:.1e} |\n")
    print(open(os.path.join(a.out, "decode_kmajor_sweep.md")).read())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
