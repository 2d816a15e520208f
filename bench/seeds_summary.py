"""Mean and range over seeds of `wide compare` results: the headline comparison's format.

    for s in 0 1 2; do wide compare --seed $s --runs runs/compare-s$s --out results/compare_s$s ...; done
    python3 bench/seeds_summary.py results/compare_s0.json results/compare_s1.json results/compare_s2.json \
        --out bench/results/quality_smollm2

Records of the same method, stage and target are pooled; each input must come from a different
seed and the same settings otherwise (refused, naming the setting, if not). Writes OUT.json (the
per-seed records, then one aggregated record per method with ``seeds``, the mean of ``avg``,
``sparsity`` and ``above_chance_kept``, the geometric mean of ``ppl``, and their ``*_min`` /
``*_max``), OUT.md and OUT.png (means with min-max bars).

Perplexity is averaged as the mean of its logarithm (the held-out cross-entropy), because one
diverged seed (dynamic depth gave 59 and 4712 on two seeds of one recipe) would otherwise be the
whole arithmetic mean.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STATS = ("ppl", "avg", "sparsity", "above_chance_kept")
SAME = ("steps", "recovery_steps", "batch_size", "grad_accum", "seq_len", "lr", "recovery_lr", "limit", "targets",
        "loss", "amp", "data", "decontaminate", "dtype", "sparsity_warmup", "router_init", "ffn_group_size",
        "router_rank", "router_input", "tau_start", "tau_end", "sparsity_coef", "budget", "lora_r", "offsets")


def load(paths) -> tuple:
    docs = [(p, json.loads(Path(p).read_text())) for p in paths]
    seeds = [d["settings"]["seed"] for _, d in docs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"two inputs share a seed ({seeds}): each file must be another seed")
    first = docs[0][1]["settings"]
    for p, d in docs[1:]:
        diff = [k for k in SAME if d["settings"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"{p} differs from {docs[0][0]} in {', '.join(diff)}: not seeds of one comparison")
    return docs, first


def with_above_chance(records: list) -> None:
    """above_chance_kept on every record of one seed, against that seed's dense record."""
    from wide.evaluation.evaluate import above_chance, chance_levels

    dense = next((r for r in records if r.get("name") == "dense"), None)
    if dense is None:
        return
    levels = chance_levels([dense])
    for r in records:
        r["above_chance_kept"] = above_chance(r, dense, chance=levels)


def aggregate(docs) -> list:
    return aggregate_records([r for _, d in docs for r in d["records"]])


def aggregate_records(records: list, stats=STATS, keep=()) -> list:
    """One row per (name, stage, target): the mean of each of ``stats`` over the records (of
    ``ppl``, the geometric mean), its min and max, the seeds; ``keep`` more fields of the first."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r.get("name"), r.get("stage"), r.get("target")), []).append(r)
    out = []
    for (name, stage, target), rs in groups.items():
        agg = {k: rs[0].get(k) for k in ("name", "label", "method", "stage", "target", "model", "loss", "tokens",
                                         "routing", *keep)}
        agg["seeds"] = sorted({r.get("seed") for r in rs if r.get("seed") is not None}) or None
        agg["n"] = len(rs)
        for k in stats:
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                mean = statistics.mean(vals)
                if k == "ppl" and min(vals) != max(vals):  # equal values stay exact (exp(log(x)) may not be)
                    mean = math.exp(statistics.mean(map(math.log, vals)))
                agg[k], agg[f"{k}_min"], agg[f"{k}_max"] = mean, min(vals), max(vals)
        out.append(agg)
    return out


def _cell(r, k, fmt) -> str:
    if r.get(k) is None:
        return "-"
    if r.get("n", 1) > 1 and r[f"{k}_min"] != r[f"{k}_max"]:
        return f"{fmt(r[k])} ({fmt(r[f'{k}_min'])}-{fmt(r[f'{k}_max'])})"
    return fmt(r[k])


def table(rows: list) -> str:
    head = ["method", "stage", "target", "seeds", "FLOP sparsity", "ppl", "avg", "above chance kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.get("label") or r.get("method") or "?", str(r.get("stage")),
            "-" if r.get("target") is None else f"{r['target']:.0%}",
            "-" if not r.get("seeds") else ",".join(map(str, r["seeds"])),
            _cell(r, "sparsity", lambda v: f"{v:.3f}"), _cell(r, "ppl", lambda v: f"{v:.1f}"),
            _cell(r, "avg", lambda v: f"{v:.3f}"), _cell(r, "above_chance_kept", lambda v: f"{v:.0%}")]) + " |")
    return "\n".join(lines)


def plot(rows: list, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    dense = next((r for r in rows if r.get("name") == "dense"), None)
    for name in dict.fromkeys(r["name"] for r in rows if r.get("name") != "dense"):
        pts = sorted((r for r in rows if r["name"] == name), key=lambda r: r["target"])
        xs = [r["sparsity"] for r in pts]
        for ax, k in ((ax1, "avg"), (ax2, "ppl")):
            if all(r.get(k) is not None for r in pts):
                err = [[r[k] - r[f"{k}_min"] for r in pts], [r[f"{k}_max"] - r[k] for r in pts]]
                ax.errorbar(xs, [r[k] for r in pts], yerr=err, marker="o", capsize=3,
                            ls="-" if pts[0].get("stage") == 1 else "--", label=pts[0].get("label") or name)
    if dense is not None:
        for ax, k in ((ax1, "avg"), (ax2, "ppl")):
            if dense.get(k) is not None:
                ax.axhline(dense[k], color="k", lw=0.8, ls=":", label="Dense")
    ax1.set_ylabel("average zero-shot accuracy")
    ax1.set_title("mean, bars: min-max over seeds", fontsize=9)
    ax2.set_ylabel("held-out perplexity")
    ax2.set_title("geometric mean, bars: min-max over seeds", fontsize=9)
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xlabel("realised FLOP-weighted sparsity")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="wide compare results (.json), one per seed")
    ap.add_argument("--out", required=True, help="output stem: OUT.json, OUT.md, OUT.png")
    a = ap.parse_args(argv)
    docs, settings = load(a.inputs)
    for _, d in docs:
        with_above_chance(d["records"])
    rows = aggregate(docs)
    per_seed = [r for _, d in docs for r in d["records"]]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the results-file header (ANCHORS.md): one value where every input agrees, else the list
    head = {k: sorted({str(d[k]) for _, d in docs if d.get(k)}) for k in ("device", "torch", "date")}
    doc = {**{k: (v[0] if len(v) == 1 else v) if v else None for k, v in head.items() if k != "date"},
           "date": head["date"][-1] if head["date"] else None,
           "command": " ".join(["python3 bench/seeds_summary.py", *a.inputs, "--out", a.out]),
           "inputs": [{"file": str(p), "command": d.get("command"), "seed": d["settings"]["seed"],
                       "device": d.get("device"), "date": d.get("date")} for p, d in docs],
           "settings": {k: v for k, v in settings.items() if k != "seed"}, "records": per_seed, "aggregated": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    shared = ", ".join(f"{k} {v}" for k, v in doc["settings"].items() if v is not None)
    md = [f"# {out.stem}", "", f"Mean over seeds (perplexity: geometric mean), (min-max) where they differ; `{doc['command']}`.", "",
          f"Device: {doc['device']}; torch {doc['torch']}; last run {doc['date']}. Settings of every seed's "
          f"`wide compare`: {shared}. The first seed's command (the others differ in --seed, --runs, --out): "
          f"`{doc['inputs'][0]['command']}`.", "",
          table(rows), "",
          "Above chance kept: (mean accuracy - mean chance) / (dense's - mean chance) over the six tasks other than "
          "BoolQ, per seed against that seed's dense row."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(f"wrote {out.with_suffix('.json')}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
