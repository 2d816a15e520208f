"""Why the hybrid (routers + learned thresholds, trained together) loses to learned thresholds
alone on the GPU frontier (bench/results/frontier.md): each hybrid checkpoint evaluated as
saved, with its routers forced to keep every group (thresholds only), and with its thresholds
off (routers only), beside the learned-thresholds checkpoint of the same target.

    PYTHONPATH=src python experiments/hybrid_ablation_cpu.py RUNS_DIR [--sequences 32]

RUNS_DIR holds seed0/{hybrid,learned}-{25,40,50}/stage1/final as bench/frontier.sh left them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from wide import cli
from wide.method import fine
from wide.commands import runs
from wide.evaluation.evaluate import perplexity
from wide.training.recovery import load_recovered


@contextlib.contextmanager
def routers_keep_all(model):
    saved = []
    for r in model.wide_routers:
        for kind in ("attn", "ffn"):
            router = r.router(kind)
            if router is None:
                continue
            saved.append((router.offset, router.offset.detach().clone()))
            router.offset.data.fill_(1e4)
    try:
        yield
    finally:
        for p, v in saved:
            p.data.copy_(v)


@contextlib.contextmanager
def thresholds_off(model):
    f = fine.get_fine(model)
    enabled, f.enabled = f.enabled, False
    try:
        yield
    finally:
        f.enabled = enabled


def measure(model, ids) -> dict:
    r = perplexity(model, ids, progress=False)
    return {"ppl": round(r["ppl"], 2), "linear_sparsity": round(r.get("linear_sparsity") or 0.0, 4),
            "flop_sparsity": round(r.get("flop_sparsity") or 0.0, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/hybrid_ablation_cpu/results.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    args = cli.build_parser().parse_args(["eval", "--max-eval-sequences", str(a.sequences), "--device", "cpu"])
    tok, _ = runs.load_tokenizer(args)
    ids, _ = runs.heldout(args, tok)
    base, tok, _ = runs.load_model(args, tok)
    out = {"sequences": a.sequences, "tokens": int(ids.numel()), "dense": measure(base, ids), "rows": []}
    print(out["dense"], flush=True)
    for t in (25, 40, 50):
        for family in ("hybrid", "learned"):
            d = a.runs / "seed0" / f"{family}-{t}" / "stage1" / "final"
            if not d.is_dir():
                continue
            model, _, _ = runs.load_model(args, tok)
            model = load_recovered(model, d).eval()
            row = {"checkpoint": f"{family}-{t}", "as_saved": measure(model, ids)}
            if family == "hybrid":
                with routers_keep_all(model):
                    row["routers_keep_all"] = measure(model, ids)
                with thresholds_off(model):
                    row["thresholds_off"] = measure(model, ids)
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
