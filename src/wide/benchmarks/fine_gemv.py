"""Activation-sparse decode GEMVs (``wide.kernels.fine_gemv``) vs dense cuBLAS and the plain-read floor.

    PYTHONPATH=src python -m wide.benchmarks.fine_gemv --out bench/results/fine_gemv
    TRITON_INTERPRET=1 PYTHONPATH=src python -m wide.benchmarks.fine_gemv --device cpu --out /tmp/fg  # smoke run

Each case: one projection of Llama-3.1-8B or Qwen2.5-7B at decode (T tokens), random bf16
weights and inputs, per-segment thresholds at the |x| quantile that keeps the asked share of
each token's inputs (i.i.d. random, so for T > 1 the union of kept rows is larger: recorded
as ``union``). The output is checked against the fp32 reference (rel err < 1e-2) first; then
three timings in the same process: cuBLAS (``F.linear`` on the dense ``[N, K]`` weight),
``fine_gemv`` (thresholds compared in the kernel), and
the floor: a plain read (``wide.kernels.plain_read``) of as many bytes as the kept rows
hold. Timing as in the kernel benchmark (``wide.base.timing.graph_time_us``): a CUDA graph of
calls rotating over enough input sets that L2 never holds the next call's weights.
``--sweep`` times every tile config of a list per case instead (tuning). On the CPU
(``--device cpu``) the kernels run under the Triton interpreter on one tiny shape, timed
with the wall clock: only that the records are built counts there.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from wide.base.timing import graph_time_us, wall_time_us

# model: shape -> (K, output widths of the weights fused along N)
MODELS = {
    "llama-3.1-8b": {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
                     "gate_up": (4096, (14336, 14336)), "up": (4096, (14336,)),
                     "down": (14336, (4096,))},
    "qwen2.5-7b": {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)),
                   "gate_up": (3584, (18944, 18944)), "down": (18944, (3584,))},
}
TINY = {"tiny": {"qkv": (80, (64, 16, 16)), "down": (136, (48,)), "gate_up": (64, (40, 40))}}
L2_BYTES = 60e6
MAX_SETS = 16  # (weight + transposed copy per set: 16 q|k|v sets at 25 % hold 1.6 GB)
# plain-read floor settings (wide.benchmarks.read_floors: the fastest at these sizes)
FLOOR_CFGS = ((16384, 8), (32768, 8))
FLOOR_BLOCK = 2048
TARGETS = {("llama-3.1-8b", "down"): 1.85, ("llama-3.1-8b", "up"): 1.85}


def _thresholds(x, kept, nseg):
    """One threshold per segment: the |x| quantile that keeps ``kept`` of each token's inputs
    (the same share for every segment, so T = 1 reads ``kept`` of the rows)."""
    th = torch.quantile(x.float().abs().flatten().cpu(), 1.0 - kept).item()
    return [th] * nseg


def _sweep_configs():
    """Tile configs a ``--sweep`` times: (BN, BR, BU, warps) tiles, each at a few split targets,
    with the ordered reduction and, at about one step per program, the atomic one."""
    from wide.kernels.fine_gemv import _cfg
    cfgs = []
    for bn, br, bu, w, ppss, pfs in (
            (64, 16, 4, 4, (4, 8, 16), (True, False)), (64, 16, 8, 4, (4, 8, 16), (True, False)),
            (64, 16, 16, 4, (4, 8, 16), (True, False)), (32, 32, 4, 4, (8, 16), (True,)),
            (32, 32, 8, 4, (8, 16), (True,)), (128, 8, 8, 4, (4, 8), (True,)), (128, 8, 16, 4, (4, 8), (True,)),
            (64, 32, 4, 8, (4, 8), (True,)), (64, 32, 8, 8, (4, 8), (True,)), (256, 1, 16, 1, (8, 16), (True,)),
            (256, 1, 32, 1, (8, 16), (True,)), (256, 4, 8, 4, (4, 8), (True,)), (512, 2, 8, 4, (8,), (True,))):
        for pps in ppss:
            for pf in pfs:
                cfgs.append(_cfg(bn, br, bu, w, pps, pf))
    cfgs.append(_cfg(64, 16, 8, 4, 8, False, stages=3))
    for bn, br, bu, w in ((64, 16, 4, 2), (64, 32, 2, 4), (64, 8, 8, 2), (128, 16, 4, 4), (128, 8, 8, 4),
                          (128, 4, 8, 2), (128, 4, 16, 2), (128, 16, 2, 4), (256, 8, 4, 4), (256, 4, 8, 4),
                          (256, 2, 16, 2), (256, 1, 16, 1), (512, 4, 4, 8), (512, 2, 8, 4)):
        for pps, pf in ((64, False), (32, True), (16, True)):
            cfgs.append(_cfg(bn, br, bu, w, pps, pf, atomic=True))
    # compacting tiles: the kept rows listed CH at a time, then walked BU rows a step
    for bn, bu, w in ((256, 16, 1), (256, 8, 1), (256, 32, 1), (512, 8, 1), (512, 16, 1), (128, 16, 1)):
        for ch in (64, 128, 256):
            for pps in (4, 8, 16):
                cfgs.append(_cfg(bn, 1, bu, w, pps, True, atomic=True, compact=ch))
    for ch, pps in ((64, 8), (128, 8), (256, 4)):
        cfgs.append(_cfg(256, 1, 16, 1, pps, True, compact=ch))
    # the tiles the autotuner keeps (bench/results/h100/fine_gemv.md) with the weight loads waiting
    # on the list alone (-nomask), and walked without register prefetch under the compiler's
    # software pipeline (-nopf-s2..s4)
    for bn, bu, ch, pps in ((256, 8, 64, 16), (512, 8, 128, 8), (256, 16, 64, 16), (512, 16, 128, 8)):
        cfgs.append(_cfg(bn, 1, bu, 1, pps, True, atomic=True, compact=ch, maskw=False))
        for st in (2, 3, 4):
            for mw in (True, False):
                cfgs.append(_cfg(bn, 1, bu, 1, pps, False, stages=st, atomic=True, compact=ch, maskw=mw))
    return cfgs


def _cfg_name(c):
    k = c.kwargs
    return (f"BN{k['BN']}-BR{k['BR']}-BU{k['BU']}-P{k['PPS']}-{'pf' if k['PF'] else 'nopf'}"
            f"-w{c.num_warps}-s{c.num_stages}" + ("-atomic" if k.get("ATOMIC") else "")
            + (f"-compact{k['CH']}" if k.get("COMPACT") else "") + ("" if k.get("MASKW", True) else "-nomask"))


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_case(model, shape, K, widths, T, kept, device, timer, seed, sweep=None, dtype="bf16", teal=False,
             acc_out=False):
    """One record (or, with ``sweep``, one per config): check, then time dense, fine, floor
    (and, with ``teal``, TEAL's kernel on the same weight and threshold; with ``acc_out``, the
    atomic tiles adding into caller-held fp32 sums, ``acc_us``: no ticket, no rounding pass)."""
    from wide.kernels.fine_gemv import fine_gemv, fine_gemv_reference, fine_layout, keep_mask_reference
    from wide.kernels.plain_read import plain_read

    cuda = device.type == "cuda"
    dt = DTYPES[dtype] if cuda else torch.float32
    N = sum(widths)
    nseg = len(widths)
    # Enough sets that the bytes the sparse kernels read over one rotation (kept rows of each
    # set's weight: at least `kept` of it) are 3x the L2: sized by the whole weight instead, up
    # at 25 % read its 29 MB kept rows from L2 on every replay (an H100 run of 2026-12-07:
    # bench/results/h100/README.md), its floor too.
    read_bytes = kept * N * K * (2 if cuda else 4)
    n_rot = int(max(1, min(MAX_SETS, math.ceil(3 * L2_BYTES / read_bytes)))) if cuda else 2
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(n_rot):
        ws = [(torch.randn(n, K, generator=gen) / math.sqrt(K)).to(device=device, dtype=dt) for n in widths]
        w_dense = torch.cat(ws, 0)
        w_t = fine_layout(*ws)
        del ws
        x = torch.randn(T, K, generator=gen).to(device=device, dtype=dt)
        sets.append((x, w_dense, w_t))
    segments = [0]
    for n in widths:
        segments.append(segments[-1] + n)
    x0, _, w_t0 = sets[0]
    ths = _thresholds(x0, kept, nseg)
    # rows read: the union over the tokens of each segment's kept rows
    keep = keep_mask_reference(x0, ths[0])
    union_rows = int(keep.any(0).sum().item())
    kept_elems = union_rows * N

    def fine(s, config=None, deterministic=None):
        return fine_gemv(s[0], s[2], segments=segments, thresholds=ths, config=config, deterministic=deterministic)

    accs = [torch.zeros(T, N, device=device) for _ in sets] if acc_out else None

    def fine_acc(i, config=None):
        # the sums grow over the timed launches; only the first, on zeros, is checked
        return fine_gemv(sets[i][0], sets[i][2], segments=segments, thresholds=ths, config=config, acc_out=accs[i])

    def acc_fields(config=None):
        if not acc_out or (config is not None and not config.kwargs.get("ATOMIC")):
            return {}
        accs[0].zero_()
        a = fine_acc(0, config)
        rel = ((a - ref).norm() / ref.norm().clamp_min(1e-20)).item()
        us = timer([lambda i=i: fine_acc(i, config) for i in range(len(sets))])
        out = {"acc_us": round(us, 3), "acc_rel_err": rel}
        if config is None:
            out["acc_config"] = _chosen_config("_tuned_acc")
        return out

    def dense(s):
        return F.linear(s[0], s[1])
    ref = fine_gemv_reference(x0, w_t0, segments=segments, thresholds=ths)
    out_elems = T * N

    def check(config=None):
        y = fine(sets[0], config).float()
        if torch.isnan(y).any():
            return float("nan")
        return ((y - ref).norm() / ref.norm().clamp_min(1e-20)).item()

    elt = 2 if cuda else 4
    nbytes = kept_elems * elt + T * K * elt + out_elems * elt
    base = {"op": "fine_gemv", "model": model, "shape": shape, "N": N, "K": K, "T": T, "kept": kept,
            "sparsity": round(1 - kept, 4), "dtype": dtype if cuda else "fp32",
            "union": round(union_rows / K, 4), "segments": segments}
    dense_us = timer([lambda s=s: dense(s) for s in sets])
    # cuBLAS on the kernels' transposed copy: what batches and prefill would run on it if the
    # engine kept that copy alone
    base["dense_t_us"] = round(timer([lambda s=s: s[0] @ s[2] for s in sets]), 3)
    if teal and T == 1 and cuda:
        from wide.kernels.teal_gemv import teal_gemv
        y_teal = teal_gemv(x0, w_t0, ths[0], 1 - kept)
        base["teal_rel_err"] = ((y_teal.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()
        outs = [torch.empty(1, N, device=device, dtype=dt) for _ in sets]
        teal_us = timer([lambda s=s, o=o: teal_gemv(s[0], s[2], ths[0], 1 - kept, out=o) for s, o in zip(sets, outs)])
        base["teal_us"] = round(teal_us, 3)
        base["teal_speedup"] = round(dense_us / teal_us, 4)
    floor_us = _floor_us(kept_elems, n_rot, device, dt, timer, plain_read)

    def record(fine_us, rel, extra):
        return {**base, "dense_us": round(dense_us, 3), "fine_us": round(fine_us, 3),
                "floor_us": round(floor_us, 3), "speedup": round(dense_us / fine_us, 4),
                "vs_floor": round(fine_us / floor_us, 4), "gbps": round(nbytes / fine_us / 1e3, 1),
                "rel_err": rel, **extra}

    if sweep:
        out = []
        for c in sweep:
            try:
                rel = check(c)
                us = timer([lambda s=s, c=c: fine(s, c) for s in sets])
            except Exception as e:  # a config that does not compile or fit is skipped, named
                print(f"  {_cfg_name(c)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            out.append(record(us, rel, {"config": _cfg_name(c), **acc_fields(c)}))
        del sets
        return out
    rel = check()
    fine_us = timer([lambda s=s: fine(s) for s in sets])
    chosen = _chosen_config()
    ordered_us = timer([lambda s=s: fine(s, deterministic=True) for s in sets]) if cuda else None
    extra = {} if ordered_us is None else {"ordered_us": round(ordered_us, 3)}
    if chosen:
        extra["config"] = chosen
    extra.update(acc_fields())
    return [record(fine_us, rel, extra)]


def _chosen_config(tuner="_tuned_gemv"):
    """The tile the autotuner kept for the last launch, by name (None without autotuning)."""
    from wide.kernels import fine_gemv as fg
    best = getattr(getattr(fg, tuner, None), "best_config", None)
    return _cfg_name(best) if best is not None and fg.autotune_enabled() else None


def prefill_records(models, shapes, tokens, dtype, device, timer):
    """cuBLAS at prefill sizes on the original ``[N, K]`` weight (``F.linear``) and on the fine
    layout's transposed copy (``x @ w_t``), which a fine engine keeps alone: what its TTFT pays
    for the single copy, per projection."""
    dt = DTYPES[dtype]
    out = []
    for model, shp in models.items():
        for shape, (K, widths) in shp.items():
            if shapes and shape not in shapes:
                continue
            N = sum(widths)
            gen = torch.Generator(device="cpu").manual_seed(0)
            w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(device=device, dtype=dt)
            w_t = w.t().contiguous()
            for M in tokens:
                x = torch.randn(M, K, generator=gen).to(device=device, dtype=dt)
                nt_us = timer([lambda: F.linear(x, w)])
                nn_us = timer([lambda: x @ w_t])
                out.append({"op": "prefill_gemm", "model": model, "shape": shape, "N": N, "K": K, "M": M,
                            "dtype": dtype, "dense_us": round(nt_us, 2), "dense_t_us": round(nn_us, 2),
                            "t_over_dense": round(nn_us / nt_us, 4),
                            "tflops": round(2 * M * N * K / nt_us / 1e6, 1)})
                print(f"prefill {model} {shape} M={M}: F.linear {nt_us:.1f} us, on w_t {nn_us:.1f} us "
                      f"({nn_us / nt_us:.3f}x)", flush=True)
                del x
            del w, w_t
    return out


def _floor_us(kept_elems, n_rot, device, dt, timer, plain_read):
    """Fastest plain read of ``kept_elems`` elements (whole chunks), over ``n_rot`` copies."""
    best = float("inf")
    for chunk, warps in FLOOR_CFGS if device.type == "cuda" else ((1024, 4),):
        block = min(FLOOR_BLOCK, chunk)
        n = kept_elems // chunk * chunk
        if n == 0:
            continue
        bufs = [torch.randn(n, device=device, dtype=dt) for _ in range(n_rot)]
        out = torch.empty(n // chunk, device=device, dtype=torch.float32)
        us = timer([lambda b=b, c=chunk, w=warps: plain_read(b, out, c, block, w) for b in bufs])
        # a floor over fewer bytes than kept (whole chunks only) is scaled up to them
        best = min(best, us * kept_elems / n)
        del bufs
    return best


def write_results(records, meta, out):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "records": records}, indent=1))
    cfg = any("config" in r for r in records)
    acc = any("acc_us" in r for r in records)
    lines = [f"# Activation-sparse decode GEMVs vs dense cuBLAS ({meta['device']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Command: `{meta['command']}`", "",
             "kept: share of each token's inputs over the threshold (i.i.d. random); union: share of the "
             "weight rows read (any token keeps them). floor: a plain read of the union's bytes. fine: the "
             "autotuned kernel (atomic or ordered fp32 split-K sums, whichever is faster); ordered: "
             "deterministic=True. TEAL: its kernel rebuilt (wide.kernels.teal_gemv; fp16/bf16 atomic "
             "sums), T = 1. dense^T: cuBLAS on the kernels' transposed copy.", "",
             "| shape | dtype | N | K | T | kept | union | dense us | dense^T us | fine us | ordered us | floor us | "
             "speedup | TEAL us | TEAL speedup | fine / floor | GB/s | rel err | TEAL rel err |"
             + (" fp32-out us | fp32-out / floor |" if acc else "") + (" config |" if cfg else ""),
             "|" + "---|" * (19 + 2 * acc + cfg)]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    for r in records:
        tgt = TARGETS.get((r["model"], r["shape"])) if abs(r["kept"] - 0.5) < 1e-9 and r["T"] == 1 else None
        sp = f"{r['speedup']:.2f}x" + ("" if tgt is None else (" (>= %.2f %s)" % (tgt, "met" if r["speedup"] >= tgt
                                                                                 else "MISSED")))
        lines.append(f"| {r['model']} {r['shape']} | {r.get('dtype', 'bf16')} | {r['N']} | {r['K']} | {r['T']} | "
                     f"{r['kept']} | {r['union']:.3f} | {r['dense_us']:.2f} | {f(r.get('dense_t_us'), '.2f')} | "
                     f"{r['fine_us']:.2f} | {f(r.get('ordered_us'), '.2f')} | {r['floor_us']:.2f} | {sp} | "
                     f"{f(r.get('teal_us'), '.2f')} | {f(r.get('teal_speedup'), '.2f')} | {r['vs_floor']:.3f} | "
                     f"{r['gbps']:.0f} | {r['rel_err']:.2e} | {f(r.get('teal_rel_err'), '.2e')} |"
                     + (f" {f(r.get('acc_us'), '.2f')} | {f(r.get('acc_us') and r['acc_us'] / r['floor_us'], '.3f')} |"
                        if acc else "")
                     + (f" {r['config']} |" if "config" in r else ""))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def add_arguments(p) -> None:
    p.add_argument("--out", default="bench/results/fine_gemv", help="results path: OUT.json and OUT.md")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Triton interpreter, one tiny shape, wall-clock times (a smoke run)")
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--shapes", nargs="*", default=None, help="subset of qkv o gate_up up down")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--kept", type=float, nargs="*", default=[0.5])
    p.add_argument("--sweep", action="store_true", help="time every config of the sweep list per case")
    p.add_argument("--sweep-match", nargs="*", default=None,
                   help="with --sweep: only the configs whose name holds one of these strings "
                        "(e.g. BN256-BR1-BU16-P8-pf)")
    p.add_argument("--dtypes", nargs="*", default=["bf16"], choices=list(DTYPES), help="weight/input dtypes (GPU)")
    p.add_argument("--teal", action="store_true", help="time TEAL's kernel beside ours (T = 1)")
    p.add_argument("--acc-out", action="store_true",
                   help="also time the atomic tiles adding into caller-held fp32 sums (fine_gemv(acc_out=)): "
                        "the kernel without its ticket and rounding pass")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[],
                   help="also time cuBLAS at these prefill sizes on the original weight and on the "
                        "fine layout's transposed copy (OUT_prefill.json/md; GPU)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> list:
    if args.device == "cpu":
        # (Triton reads the switch when a kernel is defined, and importing wide defines them)
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("--device cpu runs the kernels under Triton's interpreter: "
                               "start Python with TRITON_INTERPRET=1")
        device, timer, models = torch.device("cpu"), wall_time_us, TINY
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("needs a CUDA device (or --device cpu)")
        device, timer = torch.device("cuda"), graph_time_us
        models = {m: MODELS[m] for m in args.models}
    import triton

    for p in args.kept:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"kept shares lie in (0, 1], got {p}")
    for t in args.tokens:
        if not 1 <= t <= 4:
            raise ValueError(f"fine GEMVs take 1..4 tokens, got {t}")
    sweep = _sweep_configs() if args.sweep else None
    if sweep and args.sweep_match:
        sweep = [c for c in sweep if any(m in _cfg_name(c) for m in args.sweep_match)]
        if not sweep:
            raise ValueError(f"no sweep config matches {args.sweep_match}")
    argv = getattr(args, "argv", None)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python -m wide.benchmarks.fine_gemv " + " ".join(sys.argv[1:] if argv is None else argv),
            "timing": "cudagraph" if device.type == "cuda" else "wall (interpreter)",
            "autotune": os.environ.get("WIDE_AUTOTUNE", "1") != "0"}
    records, bad = [], 0
    t0 = time.time()
    for model, shapes in models.items():
        for shape, (K, widths) in shapes.items():
            if args.shapes and shape not in args.shapes:
                continue
            for dtype, T, kept in itertools.product(args.dtypes if device.type == "cuda" else ["fp32"],
                                                args.tokens, args.kept):
                try:
                    rs = run_case(model, shape, K, widths, T, kept, device, timer,
                                  args.seed + 7 * T, sweep=sweep, dtype=dtype, teal=args.teal,
                                  acc_out=getattr(args, "acc_out", False))
                except Exception as e:  # record and go on: one bad case must not lose the run
                    print(f"FAILED {model} {shape} {dtype} T={T} kept={kept}: {type(e).__name__}: {e}",
                          flush=True)
                    bad += 1
                    continue
                for r in rs:
                    ok = r["rel_err"] < 1e-2 and r.get("acc_rel_err", 0.0) < 1e-2
                    bad += not ok
                    records.append(r)
                    print(f"{model:12s} {shape:7s} {dtype} T={T} kept={kept:.2f} union={r['union']:.3f} "
                          f"dense={r['dense_us']:8.2f} fine={r['fine_us']:8.2f} floor={r['floor_us']:8.2f} "
                          f"x{r['speedup']:.2f} /floor {r['vs_floor']:.3f} {r['gbps']:.0f}GB/s "
                          f"err={r['rel_err']:.1e} {r.get('config', '')} "
                          + (f"fp32-out={r['acc_us']:.2f} " if "acc_us" in r else "") + f"{'ok' if ok else 'BAD'} "
                          f"[{time.time() - t0:.0f}s]", flush=True)
                write_results(records, meta, args.out)
    write_results(records, meta, args.out)
    if args.prefill_tokens and device.type == "cuda":
        pre = prefill_records(models, args.shapes, args.prefill_tokens, args.dtypes[0], device, timer)
        write_prefill(pre, meta, Path(str(args.out) + "_prefill"))
    args.failed = bad
    return records


def write_prefill(records, meta, out):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "records": records}, indent=1))
    lines = [f"# Prefill GEMMs: cuBLAS on the original weight vs on the fine layout's transposed copy "
             f"({meta['device']})", "", f"torch {meta['torch']}, {meta['date']}. Command: `{meta['command']}`", "",
             "| shape | N | K | M | dtype | F.linear(x, w) us | x @ w_t us | w_t / w | TFLOP/s (w) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['model']} {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['dtype']} | "
                     f"{r['dense_us']:.1f} | {r['dense_t_us']:.1f} | {r['t_over_dense']:.3f} | {r['tflops']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    a.argv = argv
    try:
        run(a)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    return 1 if a.failed else 0


if __name__ == "__main__":
    sys.exit(main())
