"""How far can the 50 % TTFT / TPOT ratios go in this benchmark? Bounds computed from measured
profiles, not from a model of the GPU.

Inputs (all committed results of one device session each; re-run the benchmarks to refresh):
- ``e2e.json``: the e2e benchmark with ``--profile`` (GPU time per kernel of one eager B=1
  decode step and of one 4096-token prefill, dense and routed engine) and its TTFT/TPOT records;
- ``read_floors.json``: the time of a plain read of 16.8 / 33.5 / 58.7 MB in a CUDA graph (the
  floor for a kernel that must read those bytes, ramp-up and drain included), written by
  ``python -m wide.benchmarks.read_floors --out DIR`` (older files: the probe rows of the
  decode GEMV sweep in experiments/, same schema);
- ``kernels.json``: the routed ffn_up GEMV at T=1 (already at its read floor).

TTFT bound (4k prompt): the dense engine's prefill profile, with every part that routing can
shrink halved for free (gate/up GEMM and SiLU*up, the q share of the q/k/v GEMM, attention) and
the rest as measured dense: K/V projections, norms, RoPE, LM head, and O and down, which cannot
skip work with i.i.d. masks (bench/results/kernels_notes.md: no (token tile, group) block of
a reduction-routed GEMM is empty). Router cost counted as zero. GEMM time is split between
q/k/v, O, gate/up and down by FLOP share (cuBLAS runs them all at ~680 TFLOP/s at T=4096).

TPOT floor (batch 1): the routed engine's eager decode step with each routed GEMV replaced by a
plain read of the bytes it must read (its measured floor), everything else as measured, plus the
CUDA-graph replay overhead seen in the same run (graph TPOT - eager GPU time).

Fine-mode TPOT floor (batch 1, ``--modes e2e_modes.json --fine fine_gemv.json``): per-element
decode reads the weight rows its inputs keep, so each projection's floor is a plain read of
half its bytes (fine_gemv.json's ``floor_us`` per shape; gate|up is one launch over both
matrices: twice up's). The rest of the step is the dense engine's TPOT at the same context
(e2e_modes.json) less the dense GEMVs (fine_gemv.json's cuBLAS times): attention, norms, LM
head, graph replay. Two files of one card, possibly of different sessions (both named).

    python -m wide.benchmarks.bounds --results bench/results
    python -m wide.benchmarks.bounds --results bench/results/h100 --modes bench/results/h100/e2e_modes.json \
        --fine bench/results/h100/fine_gemv.json --out bench/results/h100/bounds_fine
(``bash bench/gpu_all.sh`` measures the read floors and runs this after the e2e benchmark, on the
same machine.)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from wide.base.arch import PRESETS

# The e2e benchmark's model (Llama-3.1-8B shapes), per layer: (N, K) of each GEMM
HID, INTER, HQ, HKV, HD, LAYERS = (PRESETS["llama-3.1-8b"][k] for k in (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_hidden_layers"))
QKV_FLOP = (HQ + 2 * HKV) * HD * HID
Q_FLOP = HQ * HD * HID
O_FLOP = HID * HQ * HD
GU_FLOP = 2 * INTER * HID
DOWN_FLOP = HID * INTER
MB = 1e6
BYTES = 2  # bf16


def _profile(e2e: dict, name: str) -> dict:
    prof = e2e.get("profile") or {}
    if name not in prof or not isinstance(prof[name], dict):
        raise SystemExit(f"e2e.json has no '{name}' profile: run the e2e benchmark with --profile")
    return prof[name]


def _sum(top: list, pred) -> float:
    return sum(t["us_per_step"] for t in top if pred(t))


def _record(e2e: dict, op: str, engine: str, sparsity, source: str = "e2e.json", **kw) -> float:
    for r in e2e["records"]:
        if r.get("op") == op and r.get("engine") == engine and \
                (sparsity is None or abs((r.get("sparsity") or 0) - sparsity) < 1e-6) and \
                all(r.get(k) == v for k, v in kw.items()):
            return r["ms"]
    raise SystemExit(f"no {op} record for engine={engine} sparsity={sparsity} {kw} in {source}")


def ttft_bound(e2e: dict, s: float = 0.5) -> dict:
    p = _profile(e2e, "dense prefill 4096")
    top = p["top"]
    gemm = _sum(top, lambda t: t["kernel"].startswith("nvjet") and t["launches_per_step"] > 1)
    head = _sum(top, lambda t: t["kernel"].startswith("nvjet") and t["launches_per_step"] == 1)
    attn = _sum(top, lambda t: "sdpa" in t["kernel"] or "flash" in t["kernel"])
    silu = _sum(top, lambda t: "_silu_mul" in t["kernel"])
    total = p["total_us_per_step"]
    per_flop = gemm / (QKV_FLOP + O_FLOP + GU_FLOP + DOWN_FLOP)
    gu, q = GU_FLOP * per_flop, Q_FLOP * per_flop
    o_us, down_us = O_FLOP * per_flop, DOWN_FLOP * per_flop
    o_down = o_us + down_us
    shrinkable = gu + silu + q + attn
    routed_min = total - s * shrinkable
    # O has 8 groups: tokens sorted by their 8-bit pattern make tiles that could skip (at best
    # halving O too); down's 112 groups give every token its own pattern, so no tile order helps.
    routed_min_o = routed_min - s * o_us
    dense_ms = _record(e2e, "e2e_ttft", "dense", None, prompt_len=4096, B=1)
    routed_ms = _record(e2e, "e2e_ttft", "routed", s, prompt_len=4096, B=1)
    return dict(dense_gpu_us=total, gemm_us=gemm, gate_up_us=gu, q_us=q, o_down_us=o_down,
                attention_us=attn, silu_us=silu, lm_head_us=head, shrinkable_us=shrinkable,
                routed_min_us=routed_min, bound=total / routed_min, o_us=o_us, down_us=down_us,
                bound_o_skips=total / routed_min_o, bound_all_skip=total / (routed_min - s * o_down),
                down_share=down_us / total,
                measured=dense_ms / routed_ms, dense_ms=dense_ms, routed_ms=routed_ms,
                o_down_share=o_down / total)


def tpot_floor(e2e: dict, probe: dict, kernels: dict, s: float = 0.5) -> dict:
    p = _profile(e2e, "routed")
    top = p["top"]
    gemv_names = ("_gemv_mn_kernel", "_gemm_k_kernel", "_gemv_k_kernel")
    gemv = _sum(top, lambda t: t["kernel"] in gemv_names)
    if gemv == 0:
        raise SystemExit("the routed decode profile has none of the routed GEMV kernels")
    other = p["total_us_per_step"] - gemv
    floors = {}
    for mb in (16.8, 33.5, 58.7):
        rows = [r["us"] for r in probe["rows"] if r.get("impl") == "read_floor"
                and r.get("shape") == f"read{mb}"]
        if not rows:
            raise SystemExit(f"the read-floor file has no read_floor rows for {mb} MB")
        floors[mb] = min(rows)
    ffn = [r for r in kernels["records"] if r.get("op") == "ffn_up" and r.get("T") == 1
           and abs(r.get("sparsity", 0) - s) < 1e-6]
    if not ffn:
        raise SystemExit("kernels.json has no ffn_up T=1 record")
    ffn_us = ffn[0]["routed_us"]
    # bytes at 50 %: q half + k/v whole (33.5 MB), o half (16.8), gate+up half (117 MB), down half (58.7)
    layer = floors[33.5] + floors[16.8] + ffn_us + floors[58.7]
    dense_ms = _record(e2e, "e2e_tpot", "dense", None, B=1)
    routed_ms = _record(e2e, "e2e_tpot", "routed", s, B=1)
    graph_over = routed_ms * 1e3 - p["total_us_per_step"]
    floor_us = other + LAYERS * layer + graph_over
    gemv_now = gemv / LAYERS
    return dict(routed_gpu_us=p["total_us_per_step"], gemv_us=gemv, other_us=other,
                read_floor_us=floors, ffn_up_t1_us=ffn_us, layer_floor_us=layer,
                layer_gemv_now_us=gemv_now, graph_overhead_us=graph_over,
                floor_step_us=floor_us, bound=dense_ms * 1e3 / floor_us,
                measured=dense_ms / routed_ms, dense_ms=dense_ms, routed_ms=routed_ms,
                step_for_1p7_us=dense_ms * 1e3 / 1.7)


def fine_tpot_floor(modes: dict, fine: dict, prompt_len: int = 4096) -> dict:
    """The fine mode's batch-1 TPOT bound at 50 % (module docstring), with its parts."""
    shapes = {}
    for r in fine["records"]:
        if r.get("op") == "fine_gemv" and r.get("T") == 1 and abs(r.get("kept", 0) - 0.5) < 1e-6:
            shapes[r["shape"]] = r
    missing = [k for k in ("qkv", "o", "up", "down") if k not in shapes]
    if missing:
        raise SystemExit(f"the fine_gemv file has no T=1, 50 % record for {missing}")

    def per_layer(field: str) -> dict:  # gate|up: one launch over both matrices, up's shape twice
        return {k: (2 if k == "up" else 1) * shapes[k][field] for k in ("qkv", "o", "up", "down")}

    times, floors, dense_gemv = per_layer("fine_us"), per_layer("floor_us"), per_layer("dense_us")
    at = dict(source="the modes file", B=1, prompt_len=prompt_len)
    dense_ms = _record(modes, "e2e_tpot", "dense", None, mode="dense", **at)
    fine_ms = _record(modes, "e2e_tpot", "fine", 0.5, mode="fine", **at)
    other = dense_ms * 1e3 - LAYERS * sum(dense_gemv.values())
    floor_us = other + LAYERS * sum(floors.values())
    return dict(dense_ms=dense_ms, fine_ms=fine_ms, measured=dense_ms / fine_ms, other_us=other,
                layer_floor_us=sum(floors.values()), layer_fine_us=sum(times.values()),
                layer_dense_us=sum(dense_gemv.values()), floor_us=floors, fine_us=times,
                floor_step_us=floor_us, bound=dense_ms * 1e3 / floor_us,
                # the step the kernels' own timings predict, beside the one measured
                predicted_step_us=other + LAYERS * sum(times.values()),
                step_for_1p85_us=dense_ms * 1e3 / 1.85, prompt_len=prompt_len,
                modes_date=modes.get("date"), fine_date=fine.get("date"))


def fine_lines(f: dict, modes_path, fine_path) -> list:
    ms = f["floor_us"]
    return [
        "", "## TPOT batch 1, fine mode (per-element decode)", "",
        f"Modes run of {f['modes_date']} ({Path(modes_path).name}), fine GEMVs of {f['fine_date']} "
        f"({Path(fine_path).name}); prompt {f['prompt_len']}.", "",
        f"Dense engine {f['dense_ms']:.2f} ms, fine {f['fine_ms']:.2f} ms: **{f['measured']:.2f}x**. "
        f"The dense step less its GEMVs (cuBLAS, {f['layer_dense_us']:.1f} us per layer) leaves "
        f"{f['other_us'] / 1e3:.2f} ms of attention, norms, LM head and graph replay.",
        f"Plain reads of the kept half of each weight: q|k|v {ms['qkv']:.1f} us, o {ms['o']:.1f} us, gate|up "
        f"{ms['up']:.1f} us, down {ms['down']:.1f} us: {f['layer_floor_us']:.1f} us per layer, where the "
        f"fine GEMVs take {f['layer_fine_us']:.1f} us ({f['layer_fine_us'] / f['layer_floor_us']:.2f}x the floor; "
        f"predicted step {f['predicted_step_us'] / 1e3:.2f} ms against {f['fine_ms']:.2f} ms measured).",
        f"With every fine GEMV at its floor the step would take {f['floor_step_us'] / 1e3:.2f} ms: "
        f"**{f['bound']:.2f}x**; 1.85x needs {f['step_for_1p85_us'] / 1e3:.2f} ms"
        + (", below the floor: out of reach with one kernel per projection even at plain-read speed."
           if f["floor_step_us"] > f["step_for_1p85_us"] else ": within reach only at plain-read speed."),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--probe", default=None, help="read floors (default RESULTS/read_floors.json)")
    ap.add_argument("--out", default=None, help="markdown + json path stem (default RESULTS/bounds)")
    ap.add_argument("--modes", default=None, help="e2e modes results (wide.benchmarks.e2e --modes) for the "
                    "fine-mode TPOT bound, with --fine")
    ap.add_argument("--fine", default=None, help="fine_gemv results (wide.benchmarks.fine_gemv) for it")
    args = ap.parse_args(argv)
    if bool(args.modes) != bool(args.fine):
        raise SystemExit("--modes and --fine go together (the fine-mode bound needs both)")
    res = Path(args.results)
    for name in ("e2e.json", "kernels.json"):
        if not (res / name).exists():
            raise SystemExit(f"{res / name} is missing: run the kernels and e2e benchmarks first")
    probe_path = Path(args.probe) if args.probe else res / "read_floors.json"
    if not probe_path.exists():
        raise SystemExit(f"{probe_path} is missing: python -m wide.benchmarks.read_floors --out DIR, "
                         "then pass --probe DIR/read_floors.json")
    e2e = json.loads((res / "e2e.json").read_text())
    probe = json.loads(probe_path.read_text())
    kernels = json.loads((res / "kernels.json").read_text())
    t, d = ttft_bound(e2e), tpot_floor(e2e, probe, kernels)
    f = None
    if args.modes:
        modes, fine = (json.loads(Path(x).read_text()) for x in (args.modes, args.fine))
        for doc, path in ((modes, args.modes), (fine, args.fine)):
            if doc.get("device") != e2e.get("device"):
                raise SystemExit(f"{path} was measured on {doc.get('device')}, e2e.json on {e2e.get('device')}: "
                                 "bounds come from one card")
        f = fine_tpot_floor(modes, fine)
    out = Path(args.out) if args.out else res / "bounds"
    extra = f" --modes {args.modes} --fine {args.fine}" if args.modes else ""
    meta = dict(device=e2e.get("device"), torch=e2e.get("torch"), triton=e2e.get("triton"),
                e2e_date=e2e.get("date"), probe=probe.get("env", {}).get("command"),
                command=f"python -m wide.benchmarks.bounds --results {args.results}{extra}")
    out.with_suffix(".json").write_text(json.dumps(dict(meta, ttft=t, tpot=d, **({"tpot_fine": f} if f else {})),
                                                   indent=1))
    ms = lambda us, nd=1: f"{us / 1e3:.{nd}f} ms"  # noqa: E731
    lines = [
        "# How far the 50 % ratios can go in this benchmark (bounds from measured profiles)", "",
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; profiles and records of "
        f"the e2e run of {meta['e2e_date']} (e2e.json), read floors of {probe_path.name}, the "
        "T=1 ffn_up of kernels.json. Method: wide/benchmarks/bounds.py's docstring.", "",
        f"Command: `{meta['command']}`", "",
        "| 50 % | dense engine | routed | ratio | bound (measured parts, ideal routing) | target |",
        "|---|---|---|---|---|---|",
        f"| TTFT 4k | {t['dense_ms']:.1f} ms | {t['routed_ms']:.1f} ms | {t['measured']:.2f}x | "
        f"**{t['bound']:.2f}x** (GPU time {ms(t['routed_min_us'])} vs {ms(t['dense_gpu_us'])}) | 1.75x |",
        f"| TPOT B=1 | {d['dense_ms']:.2f} ms | {d['routed_ms']:.2f} ms | "
        f"{d['measured']:.2f}x | **{d['bound']:.2f}x** (step >= {d['floor_step_us'] / 1e3:.2f} ms) | 1.7x |",
        "", "## TTFT 4k", "",
        f"Dense prefill GPU time {ms(t['dense_gpu_us'])}: GEMMs {ms(t['gemm_us'])} (by FLOP share: "
        f"gate/up {ms(t['gate_up_us'])}, q {ms(t['q_us'])}, O + down {ms(t['o_down_us'])}), attention "
        f"{ms(t['attention_us'])}, SiLU*up {ms(t['silu_us'])}, LM head {ms(t['lm_head_us'])}.",
        f"Halving everything routing can shrink ({ms(t['shrinkable_us'])}) for free leaves "
        f"{ms(t['routed_min_us'])}: **{t['bound']:.2f}x**. O and down alone are "
        f"{t['o_down_share']:.0%} of the dense prefill and stay dense with i.i.d. masks, which is "
        "why 1.75x is out of reach here (it needs them to skip too: masks whose tokens agree "
        "within a tile, i.e. trained for it, or coarser groups).",
        f"Even with O halved as well (its 8 groups allow pattern-sorted token tiles) the bound is "
        f"**{t['bound_o_skips']:.2f}x**: down ({t['down_share']:.0%} of the dense prefill, 112 groups, "
        "so every token has its own pattern and no tile of tokens shares an unused group) stays "
        f"dense. Only if down skipped perfectly too would it reach {t['bound_all_skip']:.2f}x.",
        "", "## TPOT batch 1", "",
        f"Routed eager step {ms(d['routed_gpu_us'], 2)} of GPU time: routed GEMVs {ms(d['gemv_us'], 2)} "
        f"({d['layer_gemv_now_us']:.1f} us per layer), everything else {ms(d['other_us'], 2)} "
        f"(attention, norms, LM head, ...); CUDA-graph replay adds {d['graph_overhead_us']:.0f} us.",
        "Plain reads of the bytes each routed GEMV needs: q+k/v 33.5 MB "
        f"{d['read_floor_us'][33.5]:.1f} us, o 16.8 MB {d['read_floor_us'][16.8]:.1f} us, down 58.7 MB "
        f"{d['read_floor_us'][58.7]:.1f} us, gate/up 117 MB {d['ffn_up_t1_us']:.1f} us (the routed "
        f"ffn_up itself): {d['layer_floor_us']:.1f} us per layer.",
        f"With every routed GEMV at that floor the step would take {d['floor_step_us'] / 1e3:.2f} ms: "
        f"**{d['bound']:.2f}x**; 1.7x needs {d['step_for_1p7_us'] / 1e3:.2f} ms. " + (
            "Below the floor: with one kernel per operator (each paying its own ramp-up and "
            "drain) the target is out of reach even at plain-read speed; kernels that stream "
            "several operators' weights back to back (a persistent per-layer decode kernel) "
            "are what could get under it." if d["floor_step_us"] > d["step_for_1p7_us"] else
            "Within reach only with every routed GEMV at plain-read speed, the routing "
            "overhead included."),
        "The read floors move between device sessions by ~1 us per size, which moves this "
        "bound by a few hundredths.",
    ]
    if f:
        lines += fine_lines(f, args.modes, args.fine)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
