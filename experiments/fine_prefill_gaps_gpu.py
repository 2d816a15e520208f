"""Where does the fine engine's 4 % TTFT loss go? (issue 47; GPU only)

On the 2026-12-07 H100 the fine engine's 4k prefill took 104.8 ms (CUDA events) against the
dense engine's 101.1 ms, while its kernels summed to 94.5 ms against 100.4 ms (the transposed
layout's NN GEMMs are faster: bench/results/h100/fine_gemv_prefill.md). So ~10 ms of the fine
prefill is GPU idle time. This times each engine's prefill (events), the host's enqueue time,
and under the profiler (CPU and CUDA) the GPU busy time, the idle gaps between kernels (the
largest, with the kernels around them) and the CUDA runtime calls that can stall the GPU
(malloc, free, synchronisations, copies). The dense engine is timed before and after the
fine engine exists, to separate the engine from what building it leaves behind.

    PYTHONPATH=src python experiments/fine_prefill_gaps_gpu.py --out /tmp/gaps.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

RUNTIME = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
           "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamWaitEvent", "cudaHostAlloc", "cuMemAddressReserve",
           "cuMemMap", "cuMemCreate", "cudaGetDeviceProperties", "cudaFuncGetAttributes")


@torch.no_grad()
def measure(name, engine, ids, reps=5):
    from torch.profiler import ProfilerActivity, profile

    T = ids.shape[1]
    engine.setup_cache(1, -(-T // 128) * 128 + 128)
    for _ in range(2):
        engine.prefill(ids)
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        engine.prefill(ids)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    host, wall = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill(ids)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.prefill(ids)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    gaps = []
    for p, n in zip(kernels[:-1], kernels[1:]):
        g = n.time_range.start - p.time_range.end
        if g > 20:
            gaps.append({"gap_us": g, "before": p.name[:70], "after": n.name[:70]})
    gaps.sort(key=lambda r: -r["gap_us"])
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3 if kernels else 0.0
    calls = {}
    for e in prof.key_averages():
        if any(e.key.startswith(r) for r in RUNTIME):
            calls[e.key] = {"count": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 3)}
    cpu_top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    engine.free_cache()
    rec = {"engine": name, "event_ms": statistics.median(ms), "event_ms_all": [round(v, 3) for v in ms],
           "host_enqueue_ms": statistics.median(host), "host_wall_ms": statistics.median(wall),
           "profiled_kernel_ms": round(busy, 3), "profiled_span_ms": round(span, 3),
           "gaps_over_20us": len(gaps), "gap_ms": round(sum(g["gap_us"] for g in gaps) / 1e3, 3),
           "largest_gaps": gaps[:12], "runtime_calls": calls,
           "cpu_top": [{"op": e.key[:80], "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3), "count": e.count}
                       for e in cpu_top]}
    print(f"{name:14s} events {rec['event_ms']:.2f} ms, host enqueue {rec['host_enqueue_ms']:.2f} ms, "
          f"kernels {busy:.2f} ms over a span of {span:.2f} ms, {len(gaps)} gaps > 20 us = {rec['gap_ms']:.2f} ms; "
          f"runtime calls {calls}", flush=True)
    for g in gaps[:6]:
        print(f"    gap {g['gap_us']:.0f} us: {g['before']} -> {g['after']}", flush=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", type=int, default=4096)
    a = p.parse_args(argv)
    import wide
    from wide.benchmarks.e2e import build_model, fine_thresholds
    from wide.engine.inference import AcceleratedModel

    dev = torch.device("cuda")
    model = build_model("llama-3.1-8b", False, dev, torch.bfloat16)
    model = wide.wrap(model, wide.WideConfig(ffn_group_size=128, router_init="random"))
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand_ids(b, t):
        return torch.randint(0, vocab, (b, t), generator=gen).to(dev)

    th = fine_thresholds(model, [rand_ids(1, 512) for _ in range(2)], [0.5])
    model.wide_fine.log_threshold.data.copy_(th[0.5])
    ids = rand_ids(1, a.prompt)
    recs = []
    dense = AcceleratedModel(model, mode="dense")
    recs.append(measure("dense (alone)", dense, ids))
    fine = AcceleratedModel(model, mode="fine")
    recs.append(measure("fine", fine, ids))
    recs.append(measure("dense (after)", dense, ids))
    recs.append(measure("fine (again)", fine, ids))
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompt": a.prompt,
                   "command": "python experiments/fine_prefill_gaps_gpu.py " + " ".join(sys.argv[1:]),
                   "records": recs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
