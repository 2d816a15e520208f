"""Is the learned thresholds' free-text distance from dense (gen KL 0.123 at 25 % on the frontier,
against TEAL greedy's 0.028, with a perplexity below dense's) the per-channel scales' fit to the
calibration text, or a worse approximation? The shipped sets as saved, then the same sets with
their per-channel scales set to 1 and one shift of every log threshold (wide.method.fine.shift_to_target,
as compare lands learned thresholds) putting them back on the target linear sparsity of the
calibration text: the learned per-layer allocation kept, the channel fit removed (not a
retraining without scales). Held-out perplexity on every held-out window and the frontier's
free-text measure (128 prompts, seed 0) for each, dense beside them.

    PYTHONPATH=src python experiments/learned_scales_drift_cpu.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import wide
from wide import cli
from wide.method import fine
from wide.commands import runs
from wide.evaluation.evaluate import generation_quality, perplexity


def measure(model, dense, ids, prompts) -> dict:
    p = perplexity(model, ids, progress=False)
    g = generation_quality(model, dense, ids, prompts=prompts, progress=False)
    return {"ppl": round(p["ppl"], 2), "linear_sparsity": round(p.get("linear_sparsity") or 0.0, 4),
            **{k: round(g[k], 4) for k in ("gen_kl", "gen_match", "gen_prefix", "gen_distinct2")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--calibration-sequences", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/learned_scales_drift_cpu/results.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    args = cli.build_parser().parse_args(["compare", "--device", "cpu", "--methods", "dense"])
    tok, _ = runs.load_tokenizer(args)
    ids, _ = runs.heldout(args, tok)
    cal, _ = runs.calibration(args, tok, args.max_train_tokens)
    batches = cal[:a.calibration_sequences].split(8)
    dense, tok, _ = runs.load_model(args, tok)
    dense.eval()
    out = {"heldout_windows": int(ids.shape[0]), "calibration_sequences": a.calibration_sequences,
           "dense": measure(dense, dense, ids, a.prompts), "rows": []}
    print(json.dumps(out["dense"]), flush=True)
    for name in ("smollm2-135m-fine-25", "smollm2-135m-fine-50"):
        model = wide.from_pretrained(name, runs.load_model(args, tok)[0]).eval()
        target = wide.pretrained.provenance(name)["target_sparsity"]
        row = {"checkpoint": name, "as_saved": measure(model, dense, ids, a.prompts)}
        f = fine.get_fine(model)
        with torch.no_grad():
            for p in f.log_scale.values():
                p.zero_()
        row["shift"] = round(fine.shift_to_target(model, batches, target), 4)
        row["scales_off"] = measure(model, dense, ids, a.prompts)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
