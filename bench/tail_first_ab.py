"""A/B of the batch-1 q+k/v GEMV with a deferred router: dense-tail (K/V) programs launched first
and not waiting for the routing decision (``WIDE_TAIL_FIRST=1``, the default) against the
previous order (``0``). Llama-3.1-8B q+k/v (6144 x 4096, 512-wide q groups, 2048 dense K/V rows),
random router partials (~50 % of q groups), CUDA-graph time over three weight sets, alternating
the two settings five times; both checked against the fp32 reference first.

    PYTHONPATH=src python bench/tail_first_ab.py --out bench/results/tail_first_ab
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton

from wide.benchmarks.kernels import _graph_time_us
from wide.kernels import RouterPartials, gemm_mn, gemm_mn_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/tail_first_ab")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    K, NQ, NKV, G = 4096, 4096, 2048, 512
    ng = NQ // G
    torch.manual_seed(0)
    sets = []
    for _ in range(3):
        sets.append(dict(
            x=torch.randn(1, K, device=dev, dtype=dt),
            w=torch.randn(NQ + NKV, K, device=dev, dtype=dt) / K ** 0.5,
            m=torch.empty(1, ng, dtype=torch.bool, device=dev),
            rp=RouterPartials(torch.randn(16, 16, device=dev), torch.zeros(16, device=dev),
                              torch.randn(2 * ng, 16, device=dev), torch.zeros(2 * ng, device=dev),
                              torch.zeros((), device=dev))))

    def call(s):
        return gemm_mn(s["x"], s["w"], s["m"], G, dense_tail=NKV, router=s["rp"])

    times = {"0": [], "1": []}
    errs = {}
    for r in range(args.rounds):
        for flag in ("0", "1"):
            os.environ["WIDE_TAIL_FIRST"] = flag  # read at launch; each graph keeps its setting
            if r == 0:
                y = call(sets[0]).float()
                ref = gemm_mn_reference(sets[0]["x"], sets[0]["w"], sets[0]["m"], G, dense_tail=NKV)
                errs[flag] = ((y - ref).norm() / ref.norm()).item()
            times[flag].append(_graph_time_us([lambda s=s: call(s) for s in sets]))
    os.environ.pop("WIDE_TAIL_FIRST")
    med = {k: statistics.median(v) for k, v in times.items()}
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command=f"PYTHONPATH=src python bench/tail_first_ab.py --out {args.out} --rounds {args.rounds}",
                active_q_groups=[int(s["m"].sum()) for s in sets])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta, times_us=times, median_us=med,
                                                        rel_err=errs), indent=1))
    lines = [f"# Batch-1 q+k/v GEMV with a deferred router: K/V programs first ({meta['device']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; active q groups per "
             f"weight set: {meta['active_q_groups']} of {ng}.", "", f"Command: `{meta['command']}`", "",
             "| WIDE_TAIL_FIRST | median us | per round (us) | rel err vs fp32 |", "|---|---|---|---|"]
    for k in ("0", "1"):
        lines.append(f"| {k} | {med[k]:.2f} | {', '.join(f'{t:.2f}' for t in times[k])} | {errs[k]:.1e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
