"""Table and plot of a token-budget scaling run (bench/quality_scaling.sh): held-out perplexity
and the seven-task zero-shot average of WIDE stage 1 against the calibration tokens it saw, one
line per loss (ce, kd, mix), the dense model as a reference line.

Reads every ``*.json`` results file of ``wide eval`` in the folders given (their ``records``
with ``op == "quality"``; every routed record must carry ``loss``, ``tokens`` and ``seed``),
writes DIR/quality_scaling.json (the records and a kd-vs-ce summary per budget),
DIR/quality_scaling.md and DIR/quality_scaling.png into the first folder (or --out).

    python3 bench/scaling_plot.py OUT [MORE_DIRS ...] [--out DIR] [--series "LABEL=FILE,FILE,..." ...]

--series adds the records of those results files as one more line, named LABEL (another recipe,
another target, or stage 2, whose tokens count both stages); the grid's kd-vs-ce summary leaves
them out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")
STEM = "quality_scaling"


def read_records(f: Path, series: str = None) -> list:
    """The quality records of one results file (none if it is not one); a routed record without
    loss, tokens or seed is refused, naming the file."""
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return []
    out = []
    for r in doc.get("records", []) if isinstance(doc, dict) else []:
        if r.get("op") != "quality" or (series and r.get("method") == "dense"):
            continue
        if r.get("method") != "dense":
            missing = [k for k in ("loss", "tokens", "seed") if r.get(k) is None]
            if missing:
                raise ValueError(f"{f}: a {r.get('method')} record lacks {', '.join(missing)} "
                                 "(made by a wide older than --loss? evaluate the routers again)")
        out.append({**r, "file": f.name, **({"series": series} if series else {})})
    return out


def collect(folders, series=()) -> list:
    """Quality records of every results file in ``folders`` (this script's own output skipped),
    then those of each ``series`` ("LABEL=FILE,FILE,...": its files named one by one, which must
    exist), marked with their label."""
    out = []
    for folder in folders:
        for f in sorted(Path(folder).glob("*.json")):
            if f.stem != STEM:
                out += read_records(f)
    for spec in series:
        label, sep, files = spec.partition("=")
        if not sep or not label or not files:
            raise ValueError(f"--series {spec!r}: expected LABEL=FILE[,FILE...]")
        for name in files.split(","):
            if not Path(name).is_file():
                raise ValueError(f"--series {label}: no results file {name}")
            out += read_records(Path(name), label)
    return out


def line_of(r):
    """The plot line and table label a record belongs to: its series, else its loss (None for
    the dense model)."""
    return r.get("series") or r.get("loss")


def routed(records) -> list:
    return sorted((r for r in records if r.get("method") != "dense"),
                  key=lambda r: ("series" in r, line_of(r), r["tokens"], r["seed"], r.get("stage", 1)))


def summary(records) -> list:
    """Per budget (and seed) where both ran: kd against ce (perplexity ratio, average difference)."""
    by = {(r["loss"], r["tokens"], r["seed"]): r for r in routed(records) if "series" not in r}
    rows = []
    for (loss, tokens, seed), kd in sorted(by.items(), key=lambda kv: kv[0][1]):
        ce = by.get(("ce", tokens, seed))
        if loss == "ce" or ce is None:
            continue
        row = {"loss": loss, "tokens": tokens, "seed": seed, "ppl_ratio_vs_ce": kd["ppl"] / ce["ppl"]}
        if kd.get("avg") is not None and ce.get("avg") is not None:
            row["avg_minus_ce"] = kd["avg"] - ce["avg"]
        rows.append(row)
    return rows


def _f(v, p=3):
    return "-" if v is None else f"{v:.{p}f}"


def kept_cell(kept: dict, r) -> str:
    """"43% ± 9": the kept share and its standard error from the documents scored, in points."""
    k, se = kept.get(id(r), (None, None))
    return "-" if k is None else f"{k:.0%}" + ("" if se is None else f" ± {100 * se:.0f}")


def kept_with_error(records) -> dict:
    """id(record) -> (share of dense's above-chance accuracy over the six tasks, BoolQ left out;
    its standard error from the documents scored, or None)."""
    from wide.evaluation.evaluate import above_chance, above_chance_se, chance_levels

    dense = next((r for r in records if r.get("method") == "dense"), None)
    if dense is None:
        return {}
    try:
        levels = chance_levels(records)
    except Exception as e:  # no task data here: the column is left out, not guessed
        print(f"chance levels unknown ({e}): no above-chance column", file=sys.stderr)
        return {}
    return {id(r): (above_chance(r, dense, chance=levels),
                    None if r is dense else above_chance_se(r, dense, chance=levels)) for r in records}


def table(records) -> str:
    head = ["loss", "tokens", "seed", "FLOP sparsity", "ppl", "ppl / dense", "bpb", *TASKS, "avg",
            "above chance kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = [r for r in records if r.get("method") == "dense"]
    kept = kept_with_error(records)
    for r in dense[:1] + routed(records):
        tokens = "-" if r.get("method") == "dense" else f"{r['tokens'] / 1e6:.3g}M"
        seed = "-" if r.get("seed") is None else str(r["seed"])
        ratio = r["ppl"] / dense[0]["ppl"] if dense and r.get("ppl") else None
        cells = [line_of(r) or "dense", tokens, seed, _f(r.get("sparsity")), _f(r.get("ppl"), 2), _f(ratio, 2),
                 _f(r.get("bpb"))] + [_f(r.get(t)) for t in TASKS] + [_f(r.get("avg")), kept_cell(kept, r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = routed(records)
    for line in dict.fromkeys(line_of(r) for r in rows):
        pts = sorted((r for r in rows if line_of(r) == line), key=lambda r: r["tokens"])
        xs = [r["tokens"] / 1e6 for r in pts]
        style = {"marker": "o", "label": line, "ls": "--" if "series" in pts[0] else "-"}
        ax1.plot(xs, [r["ppl"] for r in pts], **style)
        if all(r.get("avg") is not None for r in pts):
            ax2.plot(xs, [r["avg"] for r in pts], **style)
    dense = next((r for r in records if r.get("method") == "dense"), None)
    if dense is not None:
        ax1.axhline(dense["ppl"], color="k", lw=0.8, ls=":", label="dense")
        if dense.get("avg") is not None:
            ax2.axhline(dense["avg"], color="k", lw=0.8, ls=":", label="dense")
    ticks = sorted({r["tokens"] / 1e6 for r in rows})
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("calibration tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax1.yaxis.set_major_formatter(ScalarFormatter())
    ax1.yaxis.set_minor_formatter(NullFormatter())
    ax1.set_ylabel("held-out perplexity")
    ax2.set_ylabel("seven-task average accuracy")
    sp = [r.get("sparsity") for r in rows if r.get("sparsity") is not None and "series" not in r]
    target = f"{sum(sp) / len(sp):.0%} realised FLOP sparsity" if sp else ""
    model = records[0].get("model", "") if records else ""
    more = "; dashed: the series their labels name" if any("series" in r for r in rows) else ""
    fig.suptitle(f"{model}: WIDE against the calibration budget (grid: stage 1, {target}{more})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="folders holding wide eval results (*.json)")
    ap.add_argument("--out", default=None, help="where the outputs go (default: the first folder)")
    ap.add_argument("--series", action="append", default=[], metavar="LABEL=FILE,FILE,...",
                    help="one more line from these results files (tokens: both stages for stage 2)")
    a = ap.parse_args(argv)
    records = collect(a.folders, a.series)
    if not routed(records):
        print(f"no routed quality records in {', '.join(a.folders)}", file=sys.stderr)
        return 1
    out = Path(a.out or a.folders[0])
    out.mkdir(parents=True, exist_ok=True)
    summ = summary(records)
    (out / f"{STEM}.json").write_text(json.dumps({"records": records, "kd_vs_ce": summ}, indent=2))
    cmd = "python3 bench/scaling_plot.py " + " ".join(f'"{x}"' if " " in x else x for x in (argv or sys.argv[1:]))
    lines = [f"# {STEM}", "", f"Made by `{cmd}`.", "", table(records), ""]
    for s in summ:
        d = f", average {s['avg_minus_ce']:+.3f}" if "avg_minus_ce" in s else ""
        lines.append(f"- {s['tokens'] / 1e6:.3g}M tokens, seed {s['seed']}: {s['loss']} perplexity "
                     f"{s['ppl_ratio_vs_ce']:.3f}x of ce{d}")
    limits = sorted({r.get("limit") for r in records if r.get("limit")})
    if limits:
        lines.append(f"\nZero-shot scores use the first {', '.join(map(str, limits))} validation documents of each task. "
                     "\"Above chance kept\": (mean accuracy - mean chance) / (dense's mean accuracy - mean chance) over "
                     "the six tasks other than BoolQ, where dense SmolLM2 scores below the majority rate; ± its standard "
                     "error from the documents scored (wide.evaluation.evaluate.above_chance_se: paired with dense's where both "
                     "records carry per-document scores, else an upper estimate; seeds add their own spread).")
    (out / f"{STEM}.md").write_text("\n".join(lines) + "\n")
    plot(records, out / f"{STEM}.png")
    print(table(records))
    print(f"wrote {out / STEM}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
