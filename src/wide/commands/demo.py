"""The demo of the recommended path (`bash scripts/demo.sh`, ``python -m wide.commands.demo``): learned
per-element thresholds calibrated briefly on the CPU with `wide calibrate`, beside their
training-free start (TEAL's uniform quantiles), the sets shipped with wide and dense: held-out
perplexity on a quick subset, greedy continuations from the engine (``wide.accelerate``), and
what the short run does and does not reach. Run again, it reuses every result whose inputs are
unchanged: the calibration (its directory is named by its settings), each evaluation and each
continuation (``OUT/results.json``, keyed by the set's content and the evaluation's settings).
`wide demo` runs the same (:func:`add_arguments`, :func:`run`).

Routers are not calibrated here: 30 CPU steps of them reached a held-out perplexity of 211, 8x
dense (issue 49), so the shipped routers stand in for them beside the thresholds."""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..io import pretrained

PROMPTS = (
    "The capital of France is",
    "To make a cup of tea, first",
    "The three primary colours are",
)

# The recommended path's sets beside the demo's own, in the order of its table.
SHIPPED_FINE = ("smollm2-135m-fine-50", "smollm2-135m-fine-25")
SHIPPED_ROUTERS = ("smollm2-135m-50",)
RESULTS_FILE = "results.json"
WALL_FILE = "demo_wall.json"  # beside a calibration's run.json: the wall time of the whole command
DEMO_FILE = "demo.md"


DESCRIPTION = ("The recommended path on the CPU, on the default model: learned per-element thresholds "
               "calibrated briefly with `wide calibrate`, beside their training-free start (TEAL's uniform "
               "quantiles), the sets shipped with wide and dense; held-out perplexity on a quick subset and "
               "greedy continuations from the engine. Run again, it reuses every finished result.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m wide.commands.demo", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options, for ``python -m wide.commands.demo`` and `wide demo` alike."""
    from ..base.cliargs import bounded

    p.add_argument("--out", default="runs/demo", help="where the runs, the result cache and demo.md go")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the demo's runs and results in OUT first: recompute everything")
    p.add_argument("--target", type=bounded(float, min=0.05, max=0.95), default=0.5,
                   help="share of the linear-layer MACs the thresholds skip")
    p.add_argument("--steps", type=bounded(int, min=1), default=40, help="calibration steps")
    p.add_argument("--batch-size", type=bounded(int, min=1), default=4, help="sequences per calibration step")
    p.add_argument("--seq-len", type=bounded(int, min=16), default=128, help="tokens per calibration sequence")
    p.add_argument("--calib-sequences", type=bounded(int, min=1), default=8,
                   help="sequences whose activation quantiles give the thresholds' start (TEAL)")
    p.add_argument("--eval-sequences", type=bounded(int, min=1), default=16,
                   help="held-out windows of 256 tokens for perplexity")
    p.add_argument("--sample-tokens", type=bounded(int, min=1), default=20, help="new tokens per continuation")
    p.add_argument("--seed", type=int, default=0, help="the calibration's seed")
    p.add_argument("--threads", type=bounded(int, min=1), default=None,
                   help="CPU threads for torch (default: one per core less the load average's whole part, at least "
                        "one: on a busy machine more threads than free cores wait on each other)")


def default_threads() -> int:
    """One thread per core the machine leaves free (the 1-minute load average's whole part taken
    off), at least one. On a 2-core machine already running one busy process, two threads each
    wait on the other: a calibration step took 95 s with two and 20 s with one (4 x 64 tokens,
    load average 8)."""
    import os

    cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, cores - busy)


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def content_id(directory) -> str:
    """A set's identity: the sha256 of its files as its manifest lists them (checked)."""
    from ..io.serialization import read_manifest

    manifest = read_manifest(directory)
    if manifest is None:
        raise ValueError(f"{directory} is incomplete or its files do not match its manifest")
    return _key(sorted((rel, f["sha256"]) for rel, f in manifest["files"].items()))


# The thresholds' learning rate as a multiple of --lr (2e-3): 3e-2. In 40 steps of 4 x 128 tokens
# at 50 % (16 held-out windows, dense 25.89, TEAL's start 38.92), x5 (wide's default) reached 33.99
# and x15 31.9 by step 30; x40 reached 32.79 at step 10, then rose to 34.18 at step 20.
LR_SCALE = 15


def calibrate_options(args) -> list:
    """`wide calibrate`'s options for the demo's learned thresholds: the recommended command
    (README, "The recommended path") at a CPU budget. Without --out, --resume and --threads, which
    do not change the result."""
    return ["--hybrid", "--sparse-target", "none", "--fine-per-channel", "--target", f"{args.target:g}",
            "--sparsity-warmup", "0", "--fine-lr-scale", str(LR_SCALE),
            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--fine-calib-sequences", str(args.calib_sequences),
            "--offset-batches", "1", "--eval-every", "0", "--save-every", str(max(1, args.steps // 4)),
            "--seed", str(args.seed), "--device", "cpu"]


def _finished(run_dir: Path) -> bool:
    from ..io.serialization import read_manifest

    return (run_dir / "run.json").is_file() and read_manifest(run_dir / "routers") is not None


def calibrate(args, out: Path) -> tuple:
    """(routers directory, seconds, whether it ran now) of the demo's learned thresholds: `wide
    calibrate` in its own process, in a directory named by its options, resumed where a kill left
    it and not run at all where it finished."""
    options = calibrate_options(args)
    run_dir = out / f"learned-{round(args.target * 100)}-{_key(options)[:10]}"
    timing = run_dir / WALL_FILE
    if _finished(run_dir):
        wall = json.loads(timing.read_text())["wall_s"] if timing.is_file() else None
        return run_dir / "routers", wall, False
    argv = ["calibrate", "--out", str(run_dir), *options, "--resume"]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    print("$ wide " + shlex.join(argv), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "wide.cli", *argv])
    if rc != 0 or not _finished(run_dir):
        raise SystemExit(f"wide calibrate failed (exit code {rc}); run the demo again to resume it")
    wall = time.perf_counter() - t0  # the whole command: data, TEAL start, steps, shift onto the target
    timing.write_text(json.dumps({"wall_s": wall, "date": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    return run_dir / "routers", wall, True


def teal_start(args, out: Path, model_path, tok) -> Path:
    """TEAL's uniform thresholds at the target from the calibration's first sequences: where the
    learned thresholds start (wide calibrate --hybrid calibrates them the same way), saved once."""
    from transformers import AutoModelForCausalLM

    from ..io.serialization import save_routers
    from ..method import fine, modeling
    from ..method.config import WideConfig
    from ..method.fine import FineConfig
    from . import runs

    settings = {"target": args.target, "calib_sequences": args.calib_sequences, "batch_size": args.batch_size,
                "seq_len": args.seq_len, "model": str(model_path)}
    d = out / f"teal-{round(args.target * 100)}-{_key(settings)[:10]}"
    if _finished_set(d):
        return d
    data = argparse.Namespace(data="wiki", eval_data=None, heldout_fraction=0.1, text_field="text",
                              decontaminate="all", seq_len=args.seq_len)
    ids, _ = runs.calibration(data, tok)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    modeling.wrap(model, WideConfig(sparse_target="none", target_sparsity=args.target, loss_mode="linear"))
    fine.attach(model, FineConfig(criterion="magnitude", allocation="uniform", target=args.target))
    fine.calibrate(model, ids[:args.calib_sequences].split(args.batch_size))
    save_routers(model, d, extra={"method": "teal", "demo": settings})
    return d


def _finished_set(d: Path) -> bool:
    from ..io.serialization import read_manifest

    return read_manifest(d) is not None


def engine_mode(directory) -> str:
    """How the engine runs a set: what ``wide.accelerate(mode="auto")`` would pick once it is
    loaded, read from its files, since the mode is part of the cache key checked before any load."""
    from ..engine.inference import carried_mode
    from ..io.serialization import read_meta
    from . import runs

    return carried_mode(*runs.checkpoint_contents(directory, read_meta(directory)))


class Results:
    """The demo's results, cached in one JSON file by the sha256 of what decides each."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError:
            self.data = {}

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        from ..io.serialization import atomic_write_text

        self.data[key] = value
        atomic_write_text(self.path, json.dumps(self.data, indent=1))


HELDOUT = {"data": "wiki", "heldout_fraction": 0.1, "seq_len": 256}  # the windows the shipped sets were measured on


def wiki_heldout(args, tok) -> torch.Tensor:
    """The first ``--eval-sequences`` held-out Wikipedia windows of 256 tokens."""
    from . import runs

    held = argparse.Namespace(**HELDOUT, eval_data=None, text_field="text", exact_bpb=False,
                              max_eval_sequences=args.eval_sequences)
    return runs.heldout(held, tok)[0]


def measure(sets: list, args, model_path, tok, results: Results, heldout=None) -> list:
    """One row per (label, directory or None for dense): held-out perplexity and the share of
    linear MACs skipped, and greedy continuations from the engine; each from the cache where its
    key (the set's content, the model, the settings) is there. ``heldout()`` gives the held-out
    windows (default: :func:`wiki_heldout`), loaded only when a perplexity is computed."""
    from transformers import AutoModelForCausalLM

    from ..engine.inference import AcceleratedModel, accelerate, generate
    from ..evaluation.evaluate import perplexity
    from ..training.recovery import load_recovered

    heldout = heldout or (lambda: wiki_heldout(args, tok))
    eval_settings = {"model": str(model_path), "dtype": "float32", **HELDOUT, "sequences": args.eval_sequences}
    heldout_ids = None
    rows = []
    for label, d in sets:
        t0 = time.perf_counter()
        ident = "dense" if d is None else content_id(d)
        mode = "dense" if d is None else engine_mode(d)
        k_ppl = _key({"set": ident, "eval": eval_settings})
        k_text = _key({"set": ident, "model": str(model_path), "mode": mode, "prompts": PROMPTS,
                       "tokens": args.sample_tokens})
        ppl, texts = results.get(k_ppl), results.get(k_text)
        if ppl is None or texts is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            if d is not None:
                model = load_recovered(model, d)
            if ppl is None:
                if heldout_ids is None:
                    heldout_ids = heldout()
                r = perplexity(model, heldout_ids, batch_size=4, progress=False)
                ppl = {"ppl": r["ppl"], "linear_sparsity": r.get("linear_sparsity") or 0.0,
                       "flop_sparsity": r.get("flop_sparsity", 0.0), "tokens": r["tokens"]}
                results.put(k_ppl, ppl)
            if texts is None:
                engine = AcceleratedModel(model, mode="dense") if d is None else accelerate(model, mode=mode)
                res = generate(engine, [tok.encode(p) for p in PROMPTS], max_new_tokens=args.sample_tokens,
                               eos_token_id=tok.eos_token_id)
                texts = [tok.decode(t, skip_special_tokens=True).strip().replace("\n", " ") for t in res.tokens]
                results.put(k_text, texts)
            del model
            how = f"{time.perf_counter() - t0:.0f} s"
        else:
            how = "reused"
        print(f"  {label}: perplexity {ppl['ppl']:.2f}, {ppl['linear_sparsity']:.1%} of linear MACs skipped ({how})",
              flush=True)
        rows.append({"label": label, "dir": None if d is None else str(d), "mode": mode, **ppl, "texts": texts})
    return rows


def _shipped_line(name: str) -> str:
    prov = pretrained.provenance(name)
    machine = prov.get("machine") or {}
    machine = (machine.get("gpu") or "a GPU") if isinstance(machine, dict) else machine
    return f"{prov['tokens'] / 1e6:.2f}M tokens on {machine.replace('NVIDIA ', '').replace(' 80GB HBM3', '')}"


def report(rows: list, args, own_wall: float, own_ran: bool) -> str:
    """demo.md: the table, what it shows, the continuations."""
    dense = rows[0]
    by = {r["label"]: r for r in rows}
    own_tokens = args.steps * args.batch_size * args.seq_len
    what = {
        "dense": ("the model as it is", "-"),
        "TEAL start": ("thresholds at the dense model's activation quantiles, the same share everywhere; "
                       "no training", f"quantiles of {args.calib_sequences} x {args.seq_len} tokens"),
        "demo's learned": ("thresholds + per-channel scales learned from the TEAL start (the command below)",
                           f"{own_tokens / 1e3:.0f}k tokens, {args.steps} steps on this CPU"
                           + ("" if own_wall is None else f", {own_wall / 60:.1f} min"
                              + ("" if own_ran else " when it ran"))),
    }
    for n in SHIPPED_FINE:
        what[n] = (f"shipped: the same method at {pretrained.provenance(n)['target_sparsity']:.0%}", _shipped_line(n))
    for n in SHIPPED_ROUTERS:
        what[n] = ("shipped routers: token-level head / channel groups (FLOP-weighted 50 %)", _shipped_line(n))
    lines = ["# The recommended path on the CPU", "",
             f"Held-out perplexity on {args.eval_sequences} Wikipedia windows of 256 tokens "
             f"({dense['tokens']} predicted tokens: a quick subset, so absolute values differ from the full "
             "evaluation's), and the share of all q/k/v/o/gate/up/down MACs each set skips on them.", "",
             "| set | what it is | calibration | linear MACs skipped | held-out ppl | x dense |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        desc, cal = what.get(r["label"], ("", ""))
        name = f"`{r['label']}`" if r["label"] in pretrained.names() else r["label"]
        lines.append(f"| {name} | {desc} | {cal} | {r['linear_sparsity']:.1%} | {r['ppl']:.2f} | "
                     f"{r['ppl'] / dense['ppl']:.2f}x |")
    teal, own = by.get("TEAL start"), by.get("demo's learned")
    ship = by.get(SHIPPED_FINE[0]) if args.target == 0.5 else None
    if own:
        lines += ["", f"The demo's calibration: `wide calibrate --out {Path(own['dir']).parent} "
                      f"{shlex.join(calibrate_options(args))}`."]
    lines += ["", "## What this shows", ""]
    if teal and own:
        gain = 1 - own["ppl"] / teal["ppl"]
        lines.append(f"- {args.steps} CPU steps ({own_tokens / 1e3:.0f}k tokens) of learned thresholds take perplexity "
                     f"from TEAL's {teal['ppl']:.1f} ({teal['ppl'] / dense['ppl']:.2f}x dense) to {own['ppl']:.1f} "
                     f"({own['ppl'] / dense['ppl']:.2f}x) at the same {args.target:.0%} of the linear MACs "
                     f"({gain:.0%} {'lower' if gain >= 0 else 'higher'}).")
    if ship and own:
        ev = pretrained.provenance(SHIPPED_FINE[0])["evaluation"]
        lines.append(f"- The shipped `{SHIPPED_FINE[0]}` is the same method at the GPU budget "
                     f"({_shipped_line(SHIPPED_FINE[0])}): {ship['ppl']:.1f} ({ship['ppl'] / dense['ppl']:.2f}x) "
                     f"here; on the whole held-out text {ev['routers']['ppl']:.2f} against dense's "
                     f"{ev['dense']['ppl']:.2f}, and a seven-task average of {ev['routers']['avg']:.3f} against "
                     f"{ev['dense']['avg']:.3f} (500 documents per task, its provenance.json). More tokens keep "
                     "improving the thresholds: the CPU run shows the start of that, not that set.")
    routers = by.get(SHIPPED_ROUTERS[0])
    if routers and ship:
        better = routers["ppl"] > ship["ppl"]
        lines.append(f"- Routers trained on {_shipped_line(SHIPPED_ROUTERS[0]).split(' on ')[0]} "
                     f"(`{SHIPPED_ROUTERS[0]}`) reach {routers['ppl']:.1f} ({routers['ppl'] / dense['ppl']:.2f}x) "
                     f"while skipping {routers['linear_sparsity']:.0%} of the linear MACs"
                     + (": the thresholds keep more quality for as much skipped. " if better else ". ")
                     + "Routers skip whole groups, which also speeds up prefill and batched decode on a GPU; the "
                     "README's modes table puts quality and speed side by side.")
    lines += ["- The continuations below come from the engine (`wide.accelerate`): dense prefill and per-element "
              "decode for thresholds (`--mode fine`), routed groups for routers (`--mode coarse`). On the CPU it runs "
              "its PyTorch path, so nothing here measures speed.", "", "## Greedy continuations", ""]
    for i, p in enumerate(PROMPTS):
        lines.append(f"**{p}** ...")
        lines += [f"- {r['label']} ({r['mode']}): {r['texts'][i]}" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(parse_args(argv))


def run(args) -> int:
    """The demo with parsed options (:func:`add_arguments`)."""
    from . import runs
    from ..io.serialization import atomic_write_text, remove_directory

    out = Path(args.out)
    if args.overwrite:  # what the demo wrote, nothing else of OUT
        for d in [*out.glob("learned-*"), *out.glob("teal-*")]:
            remove_directory(d)
        for f in (RESULTS_FILE, DEMO_FILE):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is None:
        args.threads = default_threads()
        print(f"{args.threads} CPU thread(s) (--threads sets another number)", flush=True)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    tok, model_path = runs.load_tokenizer(argparse.Namespace(model=runs.DEFAULT, threads=args.threads, device=None))
    print(f"1/3 learned thresholds at {args.target:.0%} of the linear-layer MACs, {args.steps} steps on the CPU",
          flush=True)
    own, own_wall, own_ran = calibrate(args, out)
    if not own_ran:
        print(f"  reused {own.parent} (finished earlier)", flush=True)
    t_cal = time.perf_counter()
    print("2/3 their start, TEAL's uniform thresholds (no training)", flush=True)
    teal = teal_start(args, out, model_path, tok)
    print("3/3 held-out perplexity and greedy continuations, each set", flush=True)
    sets = [("dense", None), ("TEAL start", teal), ("demo's learned", own),
            *((n, pretrained.resolve(n)) for n in (*SHIPPED_FINE, *SHIPPED_ROUTERS))]
    rows = measure(sets, args, model_path, tok, Results(out / RESULTS_FILE))
    text = report(rows, args, own_wall, own_ran)
    atomic_write_text(out / DEMO_FILE, text + "\n")
    print("\n" + text)
    t_end = time.perf_counter()
    print(f"\ncalibration {t_cal - t_start:.0f} s, the rest {t_end - t_cal:.0f} s; "
          f"results in {out / DEMO_FILE} (cache: {out / RESULTS_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
