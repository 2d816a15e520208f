"""Quality against speed of the routing rules (issue 20): one table and plot from committed results.

Quality (SmolLM2-135M, 50 %, stage 1, ce, 6.55M calibration tokens, seed 0; `wide eval` records
of bench/quality_routing.sh, the per-token point from the scaling grid of bench/quality_scaling.sh)
and speed (Llama-3.1-8B shapes, random weights, H200; `wide.benchmarks.e2e --routings` runs, each
ratio against the dense engine of its own run; where several runs time a cell the last one named
wins, and the table marks the cells it took from runs after the first). Batch-shared decode changes decode steps only: its
quality is the decode-mode perplexity of `wide eval --decode-batches 8 32` (second half of each
held-out window decoded one token per step), for the shipped 50 % routers, against the same
routers decoding with their own masks.

    python3 bench/routing_tradeoff.py            # writes bench/results/routing/routing_tradeoff.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RULES = ("token", "tile16", "tile16prev", "tile64", "tile128", "batch_shared")  # rows with no data are left out
SPEED = (("e2e_ttft", 4096, "TTFT 4k"), ("e2e_ttft", 16384, "TTFT 16k"), ("e2e_tpot", 1, "TPOT B=1"),
         ("e2e_tpot", 8, "TPOT B=8"), ("e2e_tpot", 32, "TPOT B=32"))
# The first run timed every cell; the second (tile steps that skip the routers, the rolled
# batch-shared kernel) re-timed token, tile16 and batch_shared at 4k and batches 1, 8, 32; the
# third timed the same cells again once batch-shared at batch 1 ran the per-token path; the fourth
# timed token, tile16 and tile16prev (previous-tile source) once its CUDA-graph decode was fixed;
# the fifth the same at 4k and batch 1 after tile16prev's prefill stopped copying its inputs to fp32.
E2E_RUNS = ("e2e_routing.json", "e2e_reuse.json", "e2e_b1shared.json", "e2e_tileprev.json",
            "e2e_tileprev_profile.json")
TARGETS = {"TTFT 4k": 1.75, "TPOT B=1": 1.7, "TPOT B=8": 1.5, "TPOT B=32": 1.4}


def _records(path: Path) -> list:
    return [r for r in json.loads(path.read_text()).get("records", []) if r.get("op") == "quality"]


def quality(quality_dir: Path, grid: Path, tokens: int, recipe: str = "") -> dict:
    """routing -> the quality record at ``tokens`` (ce, seed 0), plus "dense" and the decode-mode
    records ("decode_dense", "decode_routers"). ``recipe``: the bench/quality_routing.sh variant
    whose per-token run and ``+tileN`` (``+tileN+prev``) runs to read ("": the scaling grid's recipe, lr 2e-3 from a
    random start, with the plain ``tileN`` variants)."""
    out = {"dense": _records(quality_dir / "dense.json")[0]}
    if recipe:
        out["token"] = _records(quality_dir / f"wide50-ce-{tokens}-s0-{recipe}.json")[0]
    else:
        out["token"] = next(r for r in _records(grid) if r.get("loss") == "ce" and r.get("tokens") == tokens
                            and r.get("seed") == 0 and r.get("routing", "token") in (None, "token"))
    for rule in (r for r in RULES if r.startswith("tile")):
        variant = rule.replace("prev", "+prev")  # bench/quality_routing.sh's parts: tile16+prev
        f = quality_dir / f"wide50-ce-{tokens}-s0-{recipe + '+' if recipe else ''}{variant}.json"
        if f.is_file():
            out[rule] = _records(f)[0]
    for key, name in (("decode_dense", "decode-dense.json"), ("decode_routers", "decode-smollm2-135m-50.json")):
        if (quality_dir / name).is_file():
            out[key] = _records(quality_dir / name)[0]
    return out


def speed(runs: list) -> dict:
    """(routing, column label) -> (routed ms, dense ms, speedup, index of the run) at 50 %, from
    e2e runs in order (a later run's cell replaces an earlier one's)."""
    out = {}
    for k, e2e in enumerate(runs):
        for r in json.loads(Path(e2e).read_text())["records"]:
            if r.get("engine") != "routed" or r.get("sparsity") != 0.5 or "speedup" not in r:
                continue
            x = r["prompt_len"] if r["op"] == "e2e_ttft" else r["B"]
            for op, val, label in SPEED:
                if r["op"] == op and x == val:
                    out[(r.get("routing") or "token", label)] = (r["ms"], r["dense_ms"], r["speedup"], k)
    return out


def table(q: dict, s: dict, q_old: Optional[dict] = None) -> tuple:
    """``q_old``: the same rules at an earlier recipe, shown beside as one more column."""
    from wide.evaluation.evaluate import above_chance

    dense, token = q["dense"], q["token"]
    rows = []
    for rule in RULES:
        row = {"routing": rule}
        if q_old and rule in q_old:
            row["old_recipe_ppl_vs_token"] = q_old[rule]["ppl"] / q_old["token"]["ppl"]
        if rule == "batch_shared":
            dec = q.get("decode_routers", {}).get("decode") or {}
            if dec:
                row.update(decode_ppl_own=dec["own"], decode_ppl_shared={b: v for b, v in dec["batch_shared"].items()},
                           decode_ratio={b: v / dec["own"] for b, v in dec["batch_shared"].items()})
        elif rule in q:
            r = q[rule]
            row.update(ppl=r["ppl"], ppl_vs_token=r["ppl"] / token["ppl"], avg=r.get("avg"),
                       above_chance_kept=above_chance(r, dense))
        for _, _, label in SPEED:
            # batch-shared changes decode only: its prefill is the per-token one
            src = "token" if rule == "batch_shared" and label.startswith("TTFT") else rule
            if (src, label) in s:
                row[label] = s[(src, label)][2]
                if s[(src, label)][3]:
                    row.setdefault("later_run", {})[label] = s[(src, label)][3]
        if len(row) > 1:
            rows.append(row)
    old = q_old is not None
    lines = ["| routing | ppl | ppl / per-token | avg | above chance kept | "
             + ("ppl / per-token, old recipe | " if old else "")
             + " | ".join(label for _, _, label in SPEED) + " |",
             "|---|---|---|---|---|" + "---|" * (old + len(SPEED))]
    for row in rows:
        if row["routing"] == "batch_shared":
            q_cells = ("decode: " + ", ".join(f"B={b} {row['decode_ppl_shared'][b]:.1f}" for b in row["decode_ppl_shared"])
                       + f" vs own {row['decode_ppl_own']:.1f}" if "decode_ppl_own" in row else "-",
                       ", ".join(f"{v:.2f}x" for v in row.get("decode_ratio", {}).values()) or "-", "-", "-")
        else:
            q_cells = (f"{row['ppl']:.1f}", f"{row['ppl_vs_token']:.2f}x", f"{row['avg']:.3f}",
                       f"{row['above_chance_kept']:.0%}" if row.get("above_chance_kept") is not None else "-") \
                if "ppl" in row else ("-",) * 4
        sp = [(f"{row[label]:.2f}x" + "*" * row.get("later_run", {}).get(label, 0)
               + (" (= token)" if row["routing"] == "batch_shared" and label.startswith("TTFT") else ""))
              if label in row else "-" for _, _, label in SPEED]
        if old:
            q_cells += (f"{row['old_recipe_ppl_vs_token']:.2f}x" if "old_recipe_ppl_vs_token" in row else "-",)
        lines.append(f"| {row['routing']} | " + " | ".join(q_cells) + " | " + " | ".join(sp) + " |")
    lines.append("| target | - | <= 1.10x | - | - | " + ("<= 1.10x | " if old else "") + " | ".join(
        f">= {TARGETS[label]}x" if label in TARGETS else "-" for _, _, label in SPEED) + " |")
    return rows, "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["routing"] for r in rows if "ppl" in r]
    a.bar(names, [r["ppl_vs_token"] for r in rows if "ppl" in r], color="tab:blue", label="this recipe")
    olds = [r for r in rows if "old_recipe_ppl_vs_token" in r and "ppl" not in r]
    if olds:
        a.bar([f"{r['routing']}\n(old recipe)" for r in olds], [r["old_recipe_ppl_vs_token"] for r in olds],
              color="tab:gray", label="lr 2e-3, random start")
    for rr in rows:
        if "decode_ratio" in rr:
            for bsz, v in rr["decode_ratio"].items():
                a.bar(f"shared B={bsz}\n(decode)", v, color="tab:orange")
    a.axhline(1.1, color="gray", ls="--", lw=0.8, label="target: within 10%")
    a.set_ylabel("perplexity / per-token routing")
    a.set_title("Quality cost (SmolLM2-135M, 50%)")
    a.legend()
    labels = [label for _, _, label in SPEED]
    w = 0.8 / len(rows)
    for i, r in enumerate(rows):
        a_x = [j + i * w for j in range(len(labels))]
        b.bar(a_x, [r.get(label, 0) for label in labels], w, label=r["routing"])
    b.set_xticks([j + 0.4 - w / 2 for j in range(len(labels))], labels)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_ylabel("x dense engine (same run)")
    b.set_title("Speed (Llama-3.1-8B shapes, H200, 50%)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quality", default=str(ROOT / "bench/results/routing_quality"))
    ap.add_argument("--grid", default=str(ROOT / "bench/results/quality_scaling/quality_scaling.json"))
    ap.add_argument("--e2e", nargs="+", default=[str(ROOT / "bench/results/routing" / f) for f in E2E_RUNS],
                    help="e2e results in order; a later run's cell replaces an earlier one's (marked *, ** ...)")
    ap.add_argument("--tokens", type=int, default=6553600)
    # The best per-token recipe of the quality issue (dense start, lr 1.2e-2 at batch 128); the
    # tile rules measured only at the first recipe get a column of their own.
    ap.add_argument("--recipe", default="dense+lr1p2e-2",
                    help="quality_routing.sh variant of the quality rows ('': the scaling grid's recipe)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/routing"))
    a = ap.parse_args(argv)
    q = quality(Path(a.quality), Path(a.grid), a.tokens, a.recipe)
    q_old = quality(Path(a.quality), Path(a.grid), a.tokens) if a.recipe else None
    rows, md = table(q, speed(a.e2e), q_old)
    if a.recipe:
        md = (f"Quality rows: variant `{a.recipe}` of bench/quality_routing.sh (its `+tileN` runs beside it; "
              "`-` where that rule was not trained at this recipe). The old-recipe column: the scaling grid's per-token "
              "run (lr 2e-3, random start) and the plain `tileN` variants.\n\n" + md)
    if len(a.e2e) > 1:
        md += "\n\n" + "\n".join(f"{'*' * k}: from {Path(f).name}" for k, f in enumerate(a.e2e) if k) \
            + f" (unmarked speed cells: {Path(a.e2e[0]).name})"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_tradeoff.json").write_text(json.dumps({"tokens": a.tokens, "recipe": a.recipe, "rows": rows},
                                                          indent=1))
    (out / "routing_tradeoff.md").write_text(
        "# Routing rules: quality cost against speed (50 %)\n\nCommand: `python3 bench/routing_tradeoff.py` "
        "(reads bench/results/routing_quality, quality_scaling/quality_scaling.json and the e2e runs named below it)"
        "\n\n" + md + "\n")
    plot(rows, out / "routing_tradeoff.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
