"""Summary of a bench/ab.sh run: each timed figure of the base checkout against the same figure
of this tree, from the rounds' results folders (OUT/<bench>-<side>-<round>/<bench>.json).

Per figure: the median over rounds of each side, new / base, and the run-to-run spread of
each side ((max - min) / median over its rounds). A change is "within spread" when the
medians differ by no more than the larger spread of the two sides (with one round: no more
than 3 %, about the spread seen between back-to-back runs on the H200). Writes OUT/ab.json
and OUT/ab.md; exit 0.

    python3 bench/ab_summary.py OUT
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ONE_ROUND_TOLERANCE = 0.03


def figures(doc: dict, bench: str) -> dict:
    """(name -> time) of one results file: kernel dense/routed us, e2e dense/routed ms."""
    out = {}
    for r in doc.get("records", []):
        if bench == "kernels":
            key = f"{r['op']} {r['shape']} T={r['T']} s={r['sparsity']}"
            out[key + " dense_us"] = r["dense_us"]
            out[key + " routed_us"] = r["routed_us"]
        elif r.get("op", "").startswith("e2e_") and "ms" in r:
            what = r["op"][4:]
            size = f"B={r['B']}" + (f" prompt={r['prompt_len']}" if what == "ttft" else "")
            model = f"{r['model']} " if r.get("model") and r["model"] != "llama-3.1-8b" else ""
            sp = "" if r["engine"] == "dense" else f" s={r['sparsity']}"
            out[f"{model}{what} {size} {r['engine']}{sp} ms"] = r["ms"]
    return out


def collect(root: Path) -> dict:
    """bench -> side -> name -> [time per round]."""
    found: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for d in sorted(root.iterdir()):
        parts = d.name.split("-")
        if not d.is_dir() or len(parts) != 3 or parts[1] not in ("base", "new"):
            continue
        bench, side, _ = parts
        f = d / f"{bench}.json"
        if f.is_file():
            for name, t in figures(json.loads(f.read_text()), bench).items():
                found[bench][side][name].append(t)
    return found


def spread(xs: list) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def summarise(found: dict) -> list:
    rows = []
    for bench, sides in found.items():
        for name in sorted(set(sides["base"]) & set(sides["new"])):
            b, n = sides["base"][name], sides["new"][name]
            mb, mn = statistics.median(b), statistics.median(n)
            tol = max(spread(b), spread(n)) if min(len(b), len(n)) > 1 else ONE_ROUND_TOLERANCE
            rows.append({"bench": bench, "figure": name, "base": mb, "new": mn, "new_over_base": mn / mb,
                         "rounds": [len(b), len(n)], "spread_base": spread(b), "spread_new": spread(n),
                         "within_spread": abs(mn / mb - 1) <= tol, "base_runs": b, "new_runs": n})
    return rows


def markdown(rows: list, gpu: str) -> str:
    lines = [f"# A/B: base checkout vs this tree ({gpu})", "",
             "Median over rounds; spread = (max - min) / median of one side over its rounds.", "",
             "| bench | figure | base | new | new / base | spread base | spread new | within spread |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bench']} | {r['figure']} | {r['base']:.2f} | {r['new']:.2f} | "
                     f"{r['new_over_base']:.3f} | {r['spread_base']:.1%} | {r['spread_new']:.1%} | "
                     f"{'yes' if r['within_spread'] else '**no**'} |")
    n = sum(r["within_spread"] for r in rows)
    lines += ["", f"{n} of {len(rows)} figures within spread."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    root = Path((argv or sys.argv[1:])[0])
    rows = summarise(collect(root))
    gpu = (root / "gpu.txt").read_text().strip() if (root / "gpu.txt").is_file() else "unknown GPU"
    (root / "ab.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    md = markdown(rows, gpu)
    (root / "ab.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
