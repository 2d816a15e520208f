"""The quality-sparsity frontier: every method's `wide compare` records on one axis, the share of
all linear-layer MACs skipped (``linear_sparsity``: q, k, v, o, gate, up, down; LM head left
out), pooled over seeds, as a table and a plot of perplexity against linear sparsity.

    python3 bench/frontier.py RESULTS/seed0.json RESULTS/seed1.json RESULTS/seed2.json \
        [--extra bench/results/quality_smollm2.json] [--e2e bench/results/e2e.json] --out bench/results/frontier

Inputs are `wide compare` results files (bench/frontier.sh makes them), each of one seed; they
may cover different targets and methods (the first seed has every method at every target, the
others the trained methods at 25 % and 50 %) but must agree on every other setting. ``--extra``
adds the records of an earlier comparison (on the FLOP axis, before ``linear_sparsity``
existed): for methods without per-element sparsity its linear sparsity follows exactly from the
realised FLOP-weighted rate (skipped MACs are the same MACs; only the denominator grows by the
K/V projections), and the row says so. ``--e2e`` fills the speed columns from end-to-end
records that carry ``mode`` (wide bench e2e: coarse, fine, hybrid). Records' generation fields
(``gen_kl``, ``gen_match``, ...) are shown where they exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from seeds_summary import SAME, _cell, aggregate_records, with_above_chance  # noqa: E402

GEN_FIELDS = ("gen_kl", "gen_match", "gen_prefix", "gen_distinct2")
STATS = ("ppl", "avg", "linear_sparsity", "attn_core_sparsity", "above_chance_kept", *GEN_FIELDS)
# Methods whose records count routed groups only: their linear sparsity follows from the FLOP rate.
GROUP_ONLY = ("wide", "dynamic_depth", "module_skip", "static_width")
SPEED_MODES = ("coarse", "fine", "hybrid")
# The engine mode that runs a method's sparsity: per-element thresholds decode in `fine`, routers
# in `coarse`, routers with thresholds inside their groups in `hybrid` (stage 2 decodes as stage 1).
MODE_OF = {"teal": "fine", "teal_greedy": "fine", "wina": "fine", "learned": "fine", "wide": "coarse",
           "hybrid": "hybrid", "heads": "hybrid"}
SPEED_AT = ((1, 4096), (32, 4096))  # (batch, prompt) of the per-row speed columns


def load(paths: list) -> tuple:
    """(documents, shared settings): one seed per file, every setting but the targets equal."""
    docs = [(p, json.loads(Path(p).read_text())) for p in paths]
    seeds = [d["settings"]["seed"] for _, d in docs]
    first = docs[0][1]["settings"]
    same = [k for k in SAME if k != "targets"] + ["axis"]
    for p, d in docs[1:]:
        diff = [k for k in same if d["settings"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"{p} differs from {docs[0][0]} in {', '.join(diff)}: not one comparison")
    by_seed: dict = {}
    for (p, d), s in zip(docs, seeds):
        by_seed.setdefault(s, []).append((p, d))
    return docs, first, by_seed


def merge_generation(docs: list, path) -> list:
    """The generation fields of ``path`` (a `wide compare --generation N` run: the same settings,
    seed and checkpoints as the first input, only the generation settings added to its evaluation
    key) onto the first input's rows of the same method, stage and target. Its perplexity must be
    the row's (they evaluate the same model on the same text): a mismatch means another model or
    other settings, and is refused. Returns the (name, stage, target) keys of the rows it joined."""
    gen = json.loads(Path(path).read_text())
    first = docs[0][1]
    if gen["settings"].get("seed") != first["settings"].get("seed"):
        raise ValueError(f"{path} is seed {gen['settings'].get('seed')}, the first input seed "
                         f"{first['settings'].get('seed')}: not the same models")
    rows = {(r.get("name"), r.get("stage"), r.get("target")): r for r in first["records"]}
    merged = []
    for g in gen["records"]:
        if g.get("gen_kl") is None:
            continue
        key = (g.get("name"), g.get("stage"), g.get("target"))
        row = rows.get(key)
        if row is None:
            raise ValueError(f"{path}: no row {key} in {docs[0][0]} to put its generation fields on")
        if abs(g["ppl"] / row["ppl"] - 1) > 5e-3:
            raise ValueError(f"{path}: {key} has perplexity {g['ppl']:.4f} there and {row['ppl']:.4f} in "
                             f"{docs[0][0]}: not the same model")
        row.update({k: g[k] for k in g if k.startswith("gen_")})
        merged.append(key)
    return merged


def linear_from_flops(record: dict) -> float:
    """The linear sparsity of a routed-groups-only record from its realised FLOP-weighted rate:
    skipped MACs / all linear MACs = rate x routable MACs / linear MACs, per layer and token."""
    from wide.base.arch import PRESETS
    from wide.method.geometry import ModelDims, projection_shapes

    cfg = PRESETS["smollm2-135m"]
    if "smollm2" not in str(record.get("model", "")).lower():
        raise ValueError(f"no shape known for model {record.get('model')!r}")
    heads = cfg["num_attention_heads"]
    hd = cfg["hidden_size"] // heads
    dims = ModelDims("llama", cfg["num_hidden_layers"], cfg["hidden_size"], heads, cfg["num_key_value_heads"], hd,
                     cfg["intermediate_size"], cfg["vocab_size"])
    shapes = projection_shapes(dims)
    routable = sum(o * i for p, (o, i) in shapes.items() if p not in ("k", "v"))
    return record["sparsity"] * routable / sum(o * i for o, i in shapes.values())


def records_of(docs: list, extra: list) -> list:
    """Every record with its seed and above-chance share against its own file's dense row; the
    extra files' group-only records get linear_sparsity from their FLOP rate."""
    out = []
    for _, d in docs:
        with_above_chance(d["records"])
        out += [{**r, "source": "frontier"} for r in d["records"]]
    for p, d in extra:
        with_above_chance(d["records"])
        for r in d["records"]:
            if r.get("name") == "dense" or r.get("method") not in GROUP_ONLY:
                continue
            r = {**r, "source": str(p)}
            if r.get("linear_sparsity") is None:
                r["linear_sparsity"] = linear_from_flops(r)
                r["linear_sparsity_from"] = "flop rate"
            r["name"] = f"{r['name']}@flops"
            r["label"] = f"{r.get('label', r['name'])} (FLOP-axis target)"
            out.append(r)
    return out


def aggregate(records: list) -> list:
    rows = aggregate_records(records, STATS, keep=("source", "linear_sparsity_from", "gen_distinct2_dense", "gen_settings"))
    dense = next((r for r in rows if r.get("name") == "dense"), None)
    for r in rows:
        if dense is not None and r.get("ppl"):
            r["ppl_vs_dense"] = r["ppl"] / dense["ppl"]
    rows.sort(key=lambda r: (r.get("name") != "dense", r.get("name") or "", r.get("stage") or 0, r.get("target") or 0))
    return rows


LEVELS = (0.25, 0.4, 0.5, 0.6)
PPL_RANGE = 8.0  # the plot's perplexity axis ends at this multiple of dense
NEAR = 0.005  # a measured point this close to a level stands for it


def at_levels(rows: list, levels=LEVELS) -> dict:
    """(name, stage) -> {level: ppl} at exactly those linear sparsities, log-perplexity
    interpolated between the two measured points around each level, or the point measured within
    ``NEAR`` of it (none outside them): methods
    land near, not on, their targets (TEAL's quantiles skip more of the held-out text than of the
    calibration text), and the targets compare methods at equal sparsity."""
    import math

    out: dict = {}
    for key in dict.fromkeys((r["name"], r.get("stage")) for r in rows if r.get("name") != "dense"):
        pts = sorted((r["linear_sparsity"], r["ppl"]) for r in rows
                     if (r["name"], r.get("stage")) == key and r.get("ppl") and r.get("linear_sparsity") is not None)
        got = {}
        for lv in levels:
            near = [y for x, y in pts if abs(x - lv) <= NEAR]
            if near:  # measured there (a shifted hybrid lands on its target)
                got[lv] = near[0]
                continue
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                if x0 <= lv <= x1 and x1 > x0:
                    f = (lv - x0) / (x1 - x0)
                    got[lv] = math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
                    break
        if got:
            out[key] = got
    return out


def levels_table(rows: list, levels=LEVELS) -> str:
    interp = at_levels(rows, levels)
    dense = next((r["ppl"] for r in rows if r.get("name") == "dense"), None)
    labels = {(r["name"], r.get("stage")): r.get("label") or r["name"] for r in rows}
    head = ["method", "stage", *[f"ppl at {lv:.0%}" for lv in levels]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, got in interp.items():
        cells = [labels[key], str(key[1])]
        for lv in levels:
            v = got.get(lv)
            cells.append("-" if v is None else f"{v:.2f}" + (f" ({v / dense:.2f}x)" if dense else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_columns(path) -> dict:
    """mode -> {(B, prompt_len): speedup} of end-to-end TPOT records at 50 %, with the card."""
    if not path:
        return {}
    doc = json.loads(Path(path).read_text())
    out: dict = {}
    for r in doc.get("records", []):
        if r.get("op") == "e2e_tpot" and r.get("mode") in SPEED_MODES and r.get("speedup"):
            out.setdefault(r["mode"], {})[(r.get("B"), r.get("prompt_len"))] = r["speedup"]
    return {"device": doc.get("device"), "modes": out} if out else {}


def row_speed(r: dict, speed: dict, at) -> str:
    """The TPOT speedup of the row's engine mode at (B, prompt), for rows at the records' 50 %."""
    mode = MODE_OF.get(r.get("method"))
    if not speed or mode is None or r.get("target") is None or abs(r["target"] - 0.5) > 1e-6:
        return "-"
    v = speed["modes"].get(mode, {}).get(at)
    return "-" if v is None else f"{v:.2f}x ({mode})"


def table(rows: list, speed: dict = None) -> str:
    gen = any(r.get("gen_kl") is not None for r in rows)
    head = ["method", "stage", "target", "seeds", "linear sparsity", "attn-core sparsity", "ppl", "x dense",
            "7-task avg", "above chance kept", "tokens"] + (["gen KL", "gen match", "gen prefix", "distinct-2"]
                                                          if gen else [])
    if speed:
        head += [f"TPOT B={b} x {p // 1024}k" for b, p in SPEED_AT]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.get("label") or r.get("name") or "?", str(r.get("stage")),
                 "-" if r.get("target") is None else f"{r['target']:.0%}",
                 "-" if not r.get("seeds") else ",".join(map(str, r["seeds"])),
                 _cell(r, "linear_sparsity", lambda v: f"{v:.3f}"),
                 _cell(r, "attn_core_sparsity", lambda v: f"{v:.3f}"),
                 _cell(r, "ppl", lambda v: f"{v:.2f}"),
                 "-" if r.get("ppl_vs_dense") is None else f"{r['ppl_vs_dense']:.2f}x",
                 _cell(r, "avg", lambda v: f"{v:.3f}"), _cell(r, "above_chance_kept", lambda v: f"{v:.0%}"),
                 "-" if r.get("tokens") is None else (f"{r['tokens'] / 1e6:.2f}M" if r["tokens"] else "0")]
        if gen:
            cells += [_cell(r, "gen_kl", lambda v: f"{v:.3f}"), _cell(r, "gen_match", lambda v: f"{v:.0%}"),
                      _cell(r, "gen_prefix", lambda v: f"{v:.1f}"), _cell(r, "gen_distinct2", lambda v: f"{v:.2f}")]
        if speed:
            cells += [row_speed(r, speed, at) for at in SPEED_AT]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))
    dense = next((r for r in rows if r.get("name") == "dense"), None)
    # a dozen methods: tab10 would give two of them one colour, so colour and marker both vary
    colours, markers = plt.get_cmap("tab20").colors, "osD^vPX*<>hp"
    for i, name in enumerate(dict.fromkeys(r["name"] for r in rows if r.get("name") != "dense")):
        pts = sorted((r for r in rows if r["name"] == name and r.get("linear_sparsity") is not None),
                     key=lambda r: r["linear_sparsity"])
        if not pts:
            continue
        xs = [r["linear_sparsity"] for r in pts]
        style = "-" if pts[0].get("stage") == 1 else "--"
        label = f"{pts[0].get('label') or name}"
        for ax, k in ((ax1, "ppl"), (ax2, "above_chance_kept")):
            if all(r.get(k) is not None for r in pts):
                err = [[r[k] - r[f"{k}_min"] for r in pts], [r[f"{k}_max"] - r[k] for r in pts]]
                ax.errorbar(xs, [r[k] for r in pts], yerr=err, marker=markers[i % len(markers)], ms=5, capsize=3,
                            ls=style, color=colours[(2 * i) % 20 + (i // 10) % 2], label=label)
    if dense is not None and dense.get("ppl"):
        ax1.axhline(dense["ppl"], color="k", lw=0.8, ls=":", label="dense")
        # the methods that matter sit within a few x dense; the collapsed ones would squash them
        top = dense["ppl"] * PPL_RANGE
        ax1.set_ylim(dense["ppl"] * 0.85, top)
        off = sorted({r.get("label") or r["name"] for r in rows if r.get("name") != "dense" and (r.get("ppl") or 0) > top})
        if off:
            import textwrap

            ax1.text(0.01, 0.99, textwrap.fill(f"above {top:.0f} (off the chart, in the table): " + "; ".join(off), 80),
                     fontsize=6, transform=ax1.transAxes, va="top")
    ax1.set_ylabel("held-out perplexity (geometric mean over seeds)")
    ax1.set_yscale("log")
    ax2.set_ylabel("above-chance accuracy kept (six tasks)")
    ax2.axhline(1.0, color="k", lw=0.8, ls=":")
    for ax in (ax1, ax2):
        ax.set_xlabel("linear sparsity: share of q/k/v/o/gate/up/down MACs skipped on held-out text")
        ax.grid(alpha=0.3)
    model = next((r.get("model") for r in rows if r.get("model")), "")
    fig.suptitle(f"{model}: quality against linear sparsity (solid: stage 1, dashed: stage 2; bars: min-max over seeds)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.legend(*ax1.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(0.8, 0.5), fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="wide compare results (.json) on the linear axis, one seed each")
    ap.add_argument("--extra", nargs="*", default=[], help="earlier comparisons whose group-only methods join the plot")
    ap.add_argument("--e2e", default=None, help="end-to-end results with mode records, for the speed columns")
    ap.add_argument("--generation", default=None,
                    help="a `wide compare --generation N` run of the first input's seed: its free-text fields join "
                         "the first input's rows")
    ap.add_argument("--out", required=True, help="output stem: OUT.json, OUT.md, OUT.png")
    a = ap.parse_args(argv)
    docs, settings, _ = load(a.inputs)
    merged = merge_generation(docs, a.generation) if a.generation else []
    extra = [(p, json.loads(Path(p).read_text())) for p in a.extra]
    records = records_of(docs, extra)
    rows = aggregate(records)
    speed = speed_columns(a.e2e)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {k: sorted({str(d[k]) for _, d in docs if d.get(k)}) for k in ("device", "torch", "date")}
    cmd = " ".join(["python3 bench/frontier.py", *a.inputs] + (["--extra", *a.extra] if a.extra else [])
                   + (["--e2e", a.e2e] if a.e2e else []) + (["--generation", a.generation] if a.generation else [])
                   + ["--out", a.out])
    doc = {"device": head["device"][0] if len(head["device"]) == 1 else head["device"],
           "torch": head["torch"][0] if len(head["torch"]) == 1 else head["torch"],
           "date": head["date"][-1] if head["date"] else None, "command": cmd,
           "inputs": [{"file": str(p), "command": d.get("command"), "seed": d["settings"]["seed"],
                       "device": d.get("device"), "date": d.get("date")} for p, d in docs],
           "extra": [{"file": str(p), "command": d.get("command"), "device": d.get("device")} for p, d in extra],
           "settings": {k: v for k, v in settings.items() if k != "seed"},
           "generation": {"file": str(a.generation), "rows": [list(k) for k in merged],
                          "settings": next((r.get("gen_settings") for _, d in docs[:1] for r in d["records"]
                                            if r.get("gen_settings")), None)} if a.generation else None,
           "speed": {"device": speed.get("device"),
                     "tpot_speedup": {m: {f"B{b}_{p}": v for (b, p), v in s.items()}
                                      for m, s in speed.get("modes", {}).items()}} if speed else None,
           "records": records, "aggregated": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    md = [f"# {out.stem}", "",
          f"Every method on one axis: `linear sparsity` is the share of all q, k, v, o, gate, up and down MACs a "
          f"method skips per token on the held-out text, counted exactly (a routed group skips its rows / columns, a "
          f"zeroed input element its weight column; the LM head is left out). Attention-core sparsity is the share of "
          f"the QK^T / PV MACs skipped (query heads routed away). Perplexity: geometric mean over seeds, (min-max) "
          f"where they differ. Above chance kept: (accuracy - chance) / (dense's - chance) over ARC-E, ARC-C, "
          f"WinoGrande, PIQA, OBQA and HellaSwag, against the same seed's dense row.", "",
          f"Command: `{cmd}`. Device: {doc['device']}; torch {doc['torch']}; last run {doc['date']}.", "",
          f"First input's command: `{doc['inputs'][0]['command']}`.", ""]
    if a.generation:
        g = doc["generation"]["settings"] or {}
        md += [f"Free text (`{a.generation}`, seed {docs[0][1]['settings']['seed']} only): {g.get('prompts')} held-out "
               f"prompts of {g.get('prompt_len')} tokens continued greedily for {g.get('new_tokens')} tokens by dense "
               f"and by the method. gen KL: KL(dense || method) per token on dense's continuation (nats); gen match: "
               f"share of greedy tokens equal to dense's; gen prefix: mean tokens before the texts part; distinct-2 of "
               f"the method's text (dense's: {next((r.get('gen_distinct2_dense') for r in rows if r.get('gen_distinct2_dense')), float('nan')):.2f}).", ""]
    md += [table(rows, speed), ""]
    if len(at_levels(rows)):
        md += ["At equal linear sparsity: each method's perplexity at exactly 25/40/50/60 %, log-perplexity "
               "interpolated between its two measured points around the level ('-': outside its measured range).", "",
               levels_table(rows), ""]
        doc["at_levels"] = {f"{name}|{stage}": {str(k): v for k, v in got.items()}
                            for (name, stage), got in at_levels(rows).items()}
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    if any(r.get("linear_sparsity_from") for r in rows):
        md.append("Rows marked '(FLOP-axis target)' come from an earlier comparison whose targets were FLOP-weighted "
                  "routable shares; their linear sparsity is their realised FLOP rate x routable / linear MACs, which "
                  "is exact for routed groups.")
    if speed:
        md += ["", f"End-to-end decode (TPOT) speedup against the dense engine, 50 %, {speed['device']}, "
               "Llama-3.1-8B shapes with random weights and thresholds set to the rate (the TPOT columns "
               "above: each 50 % row's engine mode; fine = TEAL, WINA and learned thresholds, coarse = "
               "routers, hybrid = routers + thresholds):", ""]
        for m, s in speed["modes"].items():
            md.append(f"- {m}: " + ", ".join(f"B={b} x {p}: {v:.2f}x" for (b, p), v in sorted(s.items())))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(f"wrote {out.with_suffix('.json')}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
