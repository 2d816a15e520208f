"""One table of the router-choice runs of bench/quality_routing.sh (issue 19, item 4): every
`wide eval` record named ``wide<pct>-<loss>-<tokens>-s<seed>[-<variant>]`` in a folder, beside the
settings its calibration used (read back from ``runs/<name>.run.json``, not from the name), its
perplexity against dense and the share of dense's above-chance accuracy it keeps; rows sorted by
perplexity within each target and token budget (stage 2 rows: `loraX` variants, their tokens
stage 1's plus their own, their settings stage 2's: lr, warm-up).

    python3 bench/variants_table.py bench/results/routing_quality   # writes variants.{md,json} there
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from scaling_plot import _f, kept_cell, kept_with_error  # noqa: E402

NAME = re.compile(r"^wide(?P<pct>\d+)-(?P<loss>ce|kd|mix)-(?P<tokens>\d+)-s(?P<seed>\d+)(?:-(?P<variant>.+))?$")
STEM = "variants"
STAGE2 = re.compile(r"[-+]lora[^+]*$")  # a stage-2 run's name is its stage-1 run's plus this
# column: (where in run.json, key)
SETTINGS = (("data", "data", "data"), ("batch", "train_args", "batch_size"), ("lr", "train_args", "lr"),
            ("start", "wide_config", "router_init"), ("warm-up", "train_args", "sparsity_warmup"),
            ("budget", "wide_config", "budget"),
            ("input", "wide_config", "router_input"), ("rank", "wide_config", "router_rank"),
            ("tau", "wide_config", "tau_start"), ("tau end", "wide_config", "tau_end"),
            ("tile", "wide_config", "route_tile"), ("tile source", "wide_config", "tile_source"),
            ("ffn group", "wide_config", "ffn_group_size"),
            ("attn group", "wide_config", "attn_group_size"))


def settings(run: dict) -> dict:
    """The table's settings of one run.json; fields a run predates read as what wide did then."""
    from wide.method.config import with_predating
    from wide.training.train import with_defaults

    data = dict(run.get("data", {}))
    if data.get("data"):  # a path (sampled shards) by its folder's name: samples-s0
        data["data"] = Path(data["data"]).name
    parts = {"train_args": with_defaults(run.get("train_args", {})),
             "wide_config": with_predating(run.get("wide_config", {})), "data": data}
    out = {col: parts[where].get(key) for col, where, key in SETTINGS}
    if out["attn group"] is None:  # the default: one GQA pack per group
        out["attn group"] = "pack"
    return out


def collect(folder: Path) -> list:
    """Quality records of the named runs (and dense), each with its name, variant and settings."""
    out = []
    for f in sorted(folder.glob("*.json")):
        m = NAME.match(f.stem)
        if f.stem != "dense" and m is None:
            continue
        recs = [r for r in json.loads(f.read_text()).get("records", []) if r.get("op") == "quality"]
        if not recs:
            continue
        rec = {**recs[0], "name": f.stem}
        if m is not None:
            run = folder / "runs" / f"{f.stem}.run.json"
            if not run.is_file():
                raise FileNotFoundError(f"{run} is missing: the table reads each run's settings from it")
            data = json.loads(run.read_text())
            if "wide_config" not in data:  # stage 2's run.json: the routers' settings are stage 1's
                stage1 = folder / "runs" / f"{STAGE2.sub('', f.stem)}.run.json"
                if stage1.is_file():
                    data["wide_config"] = json.loads(stage1.read_text()).get("wide_config", {})
            # tokens: the record's own count (stage 2 adds its tokens to stage 1's), else the name's
            rec.update(variant=m["variant"] or "-", tokens=int(rec.get("tokens") or m["tokens"]), seed=int(m["seed"]),
                       loss=m["loss"], stage=rec.get("stage") or 1, target=int(m["pct"]) / 100,
                       settings=settings(data))
        out.append(rec)
    return out


def _g(v):
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def table(records: list) -> str:
    dense = next((r for r in records if r["name"] == "dense"), None)
    kept = kept_with_error(records)
    routed = sorted((r for r in records if r["name"] != "dense"),
                    key=lambda r: (-r["target"], r["tokens"], r["ppl"]))
    head = ["variant", "target", "stage", "tokens", "seed", "loss", *(c for c, _, _ in SETTINGS), "ppl", "ppl / dense",
            "avg", "above chance kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ([dense] if dense else []) + routed:
        s = r.get("settings", {})
        ratio = r["ppl"] / dense["ppl"] if dense else None
        cells = [r.get("variant", "(dense model)"), "-" if r is dense else f"{r['target']:.0%}", _g(r.get("stage")),
                 "-" if r is dense else f"{r['tokens'] / 1e6:.3g}M",
                 _g(r.get("seed")), r.get("loss") or "-", *(_g(s.get(c)) for c, _, _ in SETTINGS),
                 _f(r["ppl"], 2), _f(ratio, 2), _f(r.get("avg")), kept_cell(kept, r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    records = collect(args.folder)
    if not any(r["name"] != "dense" for r in records):
        print(f"no wide<pct>-<loss>-<tokens>-s<seed>[-<variant>].json records in {args.folder}", file=sys.stderr)
        return 1
    md = (f"# Router choices (bench/quality_routing.sh)\n\nMade by `python3 bench/variants_table.py "
          f"{args.folder}` from the records beside it and their runs/*.run.json.\n\n{table(records)}\n\n"
          "Above chance kept: the share of dense's above-chance accuracy over the six tasks other than BoolQ, "
          "± its standard error from the documents scored (wide.evaluation.evaluate.above_chance_se: document by document "
          "against dense where both records carry per-document scores, else an upper estimate; seeds add their "
          "own spread).\n")
    (args.folder / f"{STEM}.md").write_text(md)
    keep = ("name", "variant", "target", "stage", "tokens", "seed", "loss", "settings", "ppl", "avg", "sparsity")
    (args.folder / f"{STEM}.json").write_text(json.dumps([{k: r.get(k) for k in keep} for r in records], indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
