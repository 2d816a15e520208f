"""Is ``fine_gemv`` right on every tile, at every launch? (issue 47; GPU only)

The 2026-12-07 H100 run of ``wide.benchmarks.fine_gemv`` (bench/results/h100/fine_gemv.md) flagged
up (14336x4096) in bf16 at 25 % and 75 % kept (rel err 6.2e-2 / 8.7e-2 against fp32) on the
autotuner's pick, ``BN512-BR1-BU8-P8-pf-w2-s1-atomic-compact128``; the same tile was right in
fp16 and on down. This launches every config of the autotuner's list on its own (``config=``), many
times, with fresh inputs and thresholds, and counts the launches whose output is off the fp32
reference (rel err >= 1e-2), the column slices that are off, and whether one input gives the same
output launch after launch (a race varies, a miscompiled tile repeats its error).

    PYTHONPATH=src python experiments/fine_gemv_race_gpu.py --out /tmp/race.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from wide.benchmarks.fine_gemv import MODELS, TINY, _cfg_name, _thresholds
from wide.kernels import fine_gemv as fg

LIMIT = 1e-2
# silu(gate) * up from bf16-rounded gate and up: a one-ulp difference in either (fp32 sums in
# another order) moves the product by up to ~1 %, which a tiny CPU shape does not average out
GLU_BF16_LIMIT = 3e-2


def _case(K, widths, dtype, gen, device):
    N = sum(widths)
    w_t = (torch.randn(K, N, generator=gen) / math.sqrt(K)).to(device=device, dtype=dtype)
    segs = [0]
    for n in widths:
        segs.append(segs[-1] + n)
    return w_t, segs


def _rel(y, ref) -> float:
    return ((y - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def _check(x, w_t, segs, kept, c, glu):
    ths = _thresholds(x, kept, len(segs) - 1)
    y = fg.fine_gemv(x, w_t, segments=segs, thresholds=ths, config=c, glu=glu).float()
    ref = fg.fine_gemv_reference(x, w_t, segments=segs, thresholds=ths, glu=glu)
    return y, ref, _rel(y, ref)


def _bad_slices(y, ref, bn, limit):
    """Column slices (of BN) whose own rel err is over the limit: (slice, err)."""
    out = []
    for s in range(0, y.shape[1], bn):
        e = _rel(y[:, s:s + bn], ref[:, s:s + bn])
        if not e < limit:
            out.append((s // bn, round(e, 4)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--launches", type=int, default=12, help="fresh inputs per config and case")
    p.add_argument("--repeats", type=int, default=12, help="launches on one fixed input per config and case")
    p.add_argument("--match", nargs="*", default=None, help="only configs whose name holds one of these")
    p.add_argument("--cpu", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (a check of this script)")
    a = p.parse_args(argv)
    dev = torch.device("cpu" if a.cpu else "cuda")
    shapes = dict(MODELS["llama-3.1-8b"])
    if a.cpu:
        t = TINY["tiny"]
        shapes = {"up": t["down"], "down": t["down"], "o": t["down"], "qkv": t["qkv"], "gate_up": t["gate_up"]}
    cases = [("up", torch.bfloat16, 1, False), ("up", torch.float16, 1, False), ("down", torch.bfloat16, 1, False),
             ("down", torch.float16, 1, False), ("o", torch.bfloat16, 1, False), ("qkv", torch.bfloat16, 1, False),
             ("gate_up", torch.bfloat16, 1, True), ("up", torch.bfloat16, 2, False), ("up", torch.bfloat16, 4, False)]
    configs = fg._CONFIGS
    if a.match:
        configs = [c for c in configs if any(m in _cfg_name(c) for m in a.match)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, t0 = [], time.time()
    for shape, dt, T, glu in cases:
        K, widths = shapes[shape]
        w_t, segs = _case(K, widths, dt, gen, dev)
        for c in configs:
            if T > 1 and not fg._compact(c):
                continue
            name = _cfg_name(c)
            limit = GLU_BF16_LIMIT if glu and dt == torch.bfloat16 else LIMIT
            errs, slices = [], {}
            try:
                for i in range(a.launches):
                    kept = (0.25, 0.5, 0.75)[i % 3]
                    x = torch.randn(T, K, generator=gen).to(device=dev, dtype=dt)
                    y, ref, err = _check(x, w_t, segs, kept, c, glu)
                    errs.append(err)
                    if not err < limit:
                        for s, e in _bad_slices(y, ref, c.kwargs["BN"], limit):
                            slices[s] = max(slices.get(s, 0.0), e)
                x = torch.randn(T, K, generator=gen).to(device=dev, dtype=dt)
                outs, rep_errs = [], []
                for _ in range(a.repeats):
                    y, ref, err = _check(x, w_t, segs, 0.5, c, glu)
                    outs.append(y)
                    rep_errs.append(err)
                distinct = len({o.cpu().numpy().tobytes() for o in outs})
            except Exception as e:  # a config that does not compile here is named and skipped
                print(f"{shape} {dt} T={T} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            bad = sum(not e < limit for e in errs)
            rbad = sum(not e < limit for e in rep_errs)
            row = {"shape": shape, "dtype": str(dt).split(".")[-1], "T": T, "glu": glu, "config": name,
                   "launches": len(errs), "bad": bad, "max_err": max(errs), "repeats": len(rep_errs),
                   "repeat_bad": rbad, "repeat_max_err": max(rep_errs), "repeat_distinct_outputs": distinct,
                   "bad_slices": sorted(slices.items())[:16], "n_bad_slices": len(slices)}
            rows.append(row)
            print(f"{shape:7s} {row['dtype']:8s} T={T} {name:48s} bad {bad}/{len(errs)} max {max(errs):.1e} | "
                  f"fixed input: bad {rbad}/{len(rep_errs)} max {max(rep_errs):.1e} distinct {distinct} | "
                  f"slices {row['n_bad_slices']} {row['bad_slices'][:6]} [{time.time() - t0:.0f}s]", flush=True)
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                           "command": "python experiments/fine_gemv_race_gpu.py " + " ".join(sys.argv[1:]),
                           "rows": rows}, f, indent=1)
    total = sum(r["bad"] + r["repeat_bad"] for r in rows)
    print(f"configs x cases: {len(rows)}, bad launches: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
