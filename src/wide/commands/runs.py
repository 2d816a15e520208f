"""What every command runs on: the model, data, evaluation and training-run options (as
dataclasses whose fields carry their command-line help, see ``wide.base.cliargs``), loading the
model and tokenizer, packing the calibration and held-out text, one evaluation record, the
results files and the machine they were measured on. ``wide.cli`` and ``wide.commands.compare`` both
build on this module, so neither needs the other.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..method.config import routing_name as config_routing_name
from ..data import BUILTIN_SOURCES, DECONTAMINATE_MODES, MODEL_NAME, jsonl_text
from ..evaluation.evaluate import TASKS

DEFAULT = "default"  # --model value that stands for the embedded SmolLM2 (wide.data.fetch_default_model)
DEFAULT_SHAPE = "smollm2-135m"  # the default model's entry in wide.base.arch.PRESETS: checked before it is fetched
FFN_TILE = 16  # channels of the routed GPU kernels' FFN tile: FFN group sizes are multiples of it
DTYPES = ("float32", "bfloat16", "float16")
OFFSET_MODES = ("global", "per_module", "none")


@dataclass
class ModelArgs:
    model: str = field(default=DEFAULT, metadata={
        "help": "local Hugging Face model directory (Llama, Mistral, Qwen2 or Qwen3); 'default' fetches "
                f"{MODEL_NAME} from PyPI once and caches it"})
    dtype: str = field(default="float32", metadata={
        "choices": DTYPES, "help": "backbone dtype; routers always run in float32"})
    device: Optional[str] = field(default=None, metadata={
        "help": "torch device, e.g. cpu or cuda:0 (default: cuda if available, else cpu)"})
    threads: Optional[int] = field(default=None, metadata={
        "help": "CPU threads for torch (default: torch's choice)", "min": 1})


@dataclass
class DataArgs:
    data: str = field(default="wiki", metadata={
        "help": "text source: 'wiki' (the embedded Wikipedia pages, split by article), 'sotu' (US State of the "
                "Union addresses from the npm registry, split by address), a .txt or .jsonl file, a directory of "
                ".txt files, a local HF dataset directory, or a directory of token shards from wide sample-data"})
    eval_data: Optional[str] = field(default=None, metadata={
        "help": "source of the held-out text for perplexity (its held-out split; the same kinds as --data) "
                "(default: --data, or 'wiki' when --data holds sampled token shards)"})
    decontaminate: str = field(default="all", metadata={
        "choices": DECONTAMINATE_MODES,
        "help": "drop calibration documents that share a 13-word sequence with the held-out text and the seven "
                "zero-shot tasks (all; fetches the tasks once), with the held-out text only (heldout), or keep "
                "every document (none)"})
    text_field: str = field(default="text", metadata={"help": "field holding the text in JSONL / datasets"})
    # Next-token loss needs two tokens per sequence.
    seq_len: int = field(default=256, metadata={
        "help": "tokens per packed sequence, for training and perplexity", "min": 2})
    heldout_fraction: float = field(default=0.1, metadata={
        "help": "fraction of documents (articles) held out for evaluation", "min": 0.0, "lt": 1.0})


@dataclass
class EvalArgs:
    tasks: list[str] = field(default_factory=lambda: list(TASKS), metadata={
        "nargs": "*", "choices": TASKS,
        "help": "zero-shot tasks; pass --tasks with no names to skip zero-shot (default: all seven)"})
    limit: Optional[int] = field(default=None, metadata={
        "help": "score only the first N documents of each task (the seven, and --harness's)", "min": 1})
    batch_size: int = field(default=8, metadata={"help": "sequences per forward pass", "min": 1})
    max_eval_sequences: Optional[int] = field(default=None, metadata={
        "help": "cap on held-out sequences for perplexity", "min": 1})
    exact_bpb: bool = field(default=False, metadata={
        "help": "tokenise the held-out text once more to count its tokens exactly for bits/byte"})
    decode_batches: list[int] = field(default_factory=list, metadata={
        "nargs": "*",
        "help": "also score the second half of held-out windows in decode mode (one token per step on the KV "
                "cache), with the routers' own masks and batch-shared over batches of each given size of "
                "unrelated windows (its quality cost; docs/routing_structure.md); e.g. 8 32"})
    decode_windows: int = field(default=64, metadata={
        "help": "held-out windows the decode-mode perplexity reads (with --decode-batches)", "min": 1})
    generation: int = field(default=0, metadata={
        "help": "also measure free-text quality on this many held-out prompts: greedy continuations of the dense "
                "and the pruned model, KL(dense || pruned) per step on dense's text, the share of matching tokens, "
                "the matching prefix and distinct bigrams (0: off)", "min": 0})
    generation_tokens: int = field(default=32, metadata={
        "help": "new tokens of each continuation (with --generation)", "min": 2})
    generation_prompt: int = field(default=32, metadata={
        "help": "prompt tokens cut from each held-out window (with --generation)", "min": 1})


HARNESS_MODES = ("hf", "coarse", "fine", "hybrid", "dense")  # wide.harness.MODES, without importing lm-eval


@dataclass
class HarnessArgs:
    """``wide eval --harness``: lm-evaluation-harness tasks on each evaluated model (wide.harness,
    the optional extra wide[harness])."""

    harness: list[str] = field(default_factory=list, metadata={
        "nargs": "+",
        "help": "also run these lm-evaluation-harness tasks, groups or tags (comma- or space-separated, e.g. "
                "arc_easy,hellaswag) on each model; needs pip install 'wide[harness]'. --limit, --batch-size "
                "apply; the datasets come from wherever the tasks say (the Hugging Face hub for lm-eval's own) "
                "(default: none)"})
    harness_include: Optional[str] = field(default=None, metadata={
        "help": "a directory of lm-eval task YAMLs searched besides lm-eval's own tasks (lm-eval's --include_path)"})
    harness_mode: str = field(default="hf", metadata={
        "choices": HARNESS_MODES,
        "help": "what computes the --harness scores: hf, the model with wide's hooks (routers and thresholds on "
                "every token, as the rest of wide eval); or the engine (wide.accelerate) in mode coarse, fine, "
                "hybrid or dense, whose prefill applies no per-element thresholds (fine: loglikelihood tasks "
                "score the dense model); without a CUDA GPU the engine runs its PyTorch path"})
    harness_fewshot: Optional[int] = field(default=None, metadata={
        "help": "few-shot examples per --harness prompt (default: each task's own)", "min": 0})


@dataclass
class RunArgs:
    """What a training command does around ``wide.training.train.train``."""

    max_train_tokens: Optional[int] = field(default=None, metadata={
        "help": "cap on packed training tokens (default: all)", "min": 1})
    stop_at: Optional[int] = field(default=None, metadata={
        "help": "end this invocation after this step with a checkpoint; --resume continues the run", "min": 1})
    offsets: str = field(default="global", metadata={
        "choices": OFFSET_MODES,
        "help": "after training, calibrate router offsets so inference hits the target exactly on calibration "
                "text: one shift for all routers, one per router, or none"})
    offset_batches: int = field(default=8, metadata={"help": "batches used for offset calibration", "min": 1})


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ checks before anything loads
# Each raises ValueError / FileNotFoundError with one line naming the flag; ``wide.cli`` runs
# them right after parsing, so a bad argument costs no model load and no data packing.


def check_model(args) -> None:
    """--model is 'default' or a Hugging Face model directory."""
    if args.model == DEFAULT:
        return
    path = Path(args.model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--model {path} does not exist (give a local Hugging Face model directory, "
                                f"or '{DEFAULT}')")
    if not path.is_dir():
        raise ValueError(f"--model {path} is a file, not a model directory (the folder holding config.json)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {path} has no config.json: not a Hugging Face model directory")


def model_config(args, *, routed: bool = True):
    """The transformers config of --model, read from its config.json alone (the default model:
    its known shape, so nothing is fetched yet), once the checks that need no weights loaded
    have passed: every safetensors file whole and, with ``routed``, an architecture wide routes."""
    from ..base import arch

    check_model(args)
    if args.model == DEFAULT:
        cfg = arch.hf_config(DEFAULT_SHAPE)
    else:
        from transformers import AutoConfig

        path = Path(args.model).expanduser()
        try:
            cfg = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--model {path}: its config.json cannot be read ({e})") from None
        check_safetensors("--model", path)
    if routed:
        try:
            arch.spec_for(cfg)
        except arch.UnsupportedArchitecture as e:
            raise ValueError(f"--model {args.model}: {e}") from None
    return cfg


def check_safetensors(flag: str, directory) -> None:
    """Every ``*.safetensors`` file of ``directory`` (and every shard its index lists) exactly as
    long as its header says: a copy or download cut short fails here, in milliseconds, not after
    the data is packed."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{flag} {directory}: {index} is not a safetensors index (damaged?)") from None
        missing = sorted(s for s in shards if not (directory / s).is_file())
        if missing:
            raise ValueError(f"{flag} {directory}: {index} lists {', '.join(missing)}, which it does not hold")
    for f in sorted(directory.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(n) if 8 + n <= size else None
        if header is None:
            raise ValueError(f"{flag} {directory}: {f} is cut short or not a safetensors file ({size} bytes, fewer "
                             "than its header alone would take): copy or download it again")
        try:
            entries = json.loads(header)
            need = 8 + n + max((v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ValueError(f"{flag} {directory}: {f} is not a safetensors file (its header does not "
                             "parse)") from None
        if size < need:
            raise ValueError(f"{flag} {directory}: {f} is cut short ({size} of the {need} bytes its header "
                             "promises): copy or download it again")
        if size > need:
            raise ValueError(f"{flag} {directory}: {f} holds {size - need} bytes more than its header describes "
                             "(damaged?): copy or download it again")


def check_geometry(hf_config, config) -> None:
    """The group sizes of WideConfig ``config`` against the model's config, naming the flags:
    dividing its query heads and FFN channels, and for the FFN a multiple of 16, which the GPU
    kernels need (ops.kernel_shape_error) and the help promises."""
    from ..base.cliargs import with_flags
    from ..method.config import WideConfig
    from ..method.geometry import ModelDims, resolve_geometry

    dims = ModelDims.from_hf_config(hf_config)
    ffn = config.ffn_group_size
    if ffn is not None and ffn % FFN_TILE:
        sizes = [d for d in range(FFN_TILE, dims.intermediate_size + 1, FFN_TILE) if dims.intermediate_size % d == 0]
        raise ValueError(f"--ffn-group-size {ffn} is not a multiple of {FFN_TILE}, which the GPU kernels need; the "
                         f"multiples of {FFN_TILE} that divide this model's {dims.intermediate_size} FFN channels: "
                         f"{sizes}")
    try:
        resolve_geometry(dims, config)
    except ValueError as e:
        raise ValueError(with_flags(WideConfig, str(e))) from None


def check_data(args) -> None:
    """--data (and --eval-data) exist, are a kind of source the loader reads, and their text
    files decode as UTF-8 (every byte: reading is cheap next to tokenising); a JSONL file's
    first record holds --text-field (every record is checked again when the file is read)."""
    from ..data import is_token_shards

    _check_source("--data", args.data, args.text_field)
    eval_data = getattr(args, "eval_data", None)
    if eval_data is not None:
        _check_source("--eval-data", eval_data, args.text_field)
        if eval_data not in BUILTIN_SOURCES and is_token_shards(eval_data):
            raise ValueError(f"--eval-data {eval_data} holds sampled token shards: held-out text must be a text "
                             "source")


def _check_source(flag: str, source: str, text_field: str) -> None:
    from ..data import TEXT_SUFFIXES, check_utf8, valid_sources

    if source in BUILTIN_SOURCES:
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist (give {valid_sources()})")
    if path.is_file() and path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{flag} {path}: not a text source: give {valid_sources()}")
    # every byte, not the first record only: text that does not decode would otherwise stop the
    # command after the tokenizer and data packing, with a codec message naming no file
    if path.is_file():
        texts = [path] if path.suffix.lower() in (".txt", ".jsonl") else []
    else:  # a directory of .txt files, unless it holds arrow or parquet data (which the loader reads instead)
        arrow = (path / "dataset_dict.json").is_file() or any(path.glob("*.arrow")) or any(path.glob("*.parquet"))
        texts = [] if arrow else sorted(path.glob("*.txt"))
    for f in texts:
        try:
            check_utf8(f)
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None
    if path.is_file() and path.suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lineno, line = next(((i, x) for i, x in enumerate(f, 1) if x.strip()), (0, ""))
        if not line:
            raise ValueError(f"{flag} {path} holds no records")
        try:
            jsonl_text(path, lineno, line, text_field)
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None


def check_out(flag: str, out, *, stem: bool = False) -> None:
    """``out`` can be created: a directory (or, with ``stem``, a path stem whose files go
    beside it) with no file in the way."""
    path = Path(out).expanduser()
    if not stem and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file: give a directory (it holds the run's files)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
            break


def check_routers(flag: str, path, hf_config=None) -> dict:
    """A router directory ``wide`` wrote, its files as its manifest sealed them (hashing a few
    MB costs less than the model load a damaged file would waste) and, given the model's
    ``hf_config``, trained for that shape; returns its metadata."""
    from ..io.serialization import read_meta, shape_differences, verify_manifest

    try:
        meta = read_meta(path)
        verify_manifest(path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    desc = shape_differences(meta, hf_config) if hf_config is not None else ""
    if desc:
        raise ValueError(f"{flag} {path}: routers trained for a different model than --model ({desc})")
    return meta


def check_thresholds(flag: str, path, hf_config=None) -> dict:
    """A set that holds per-element thresholds (:func:`check_routers`'s checks, then its
    thresholds file); returns its metadata."""
    from ..io import pretrained

    meta = check_routers(flag, path, hf_config)
    if not checkpoint_contents(path, meta)[1]:
        raise ValueError(f"{flag} {pretrained.name_of(path) or path} holds no per-element thresholds (routers only): "
                         "give a set with thresholds (wide calibrate --hybrid, or the shipped smollm2-135m-fine-50)")
    return meta


def resolve_thresholds(flag: str, name, hf_config=None) -> str:
    """The directory of a thresholds set given by shipped name or path, checked as
    :func:`check_thresholds` does."""
    from ..io import pretrained

    try:
        path = str(pretrained.resolve(name))
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    check_thresholds(flag, path, hf_config)
    return path


def load_frozen_thresholds(model, path) -> None:
    """Attach the per-element thresholds of the set in ``path`` to a wrapped model, not trained
    (after ``freeze_backbone``, which makes learned ones trainable)."""
    from ..io.serialization import CONFIG_FILE, load_thresholds

    load_thresholds(model, path, json.loads((Path(path) / CONFIG_FILE).read_text())["fine"])
    for p in model.wide_fine.parameters():
        p.requires_grad_(False)


# The engine's modes (wide generate --mode, wide eval --harness-mode) that run the routers, and
# those that decode with per-element thresholds.
ROUTED_MODES = ("coarse", "hybrid")
THRESHOLD_MODES = ("fine", "hybrid")


def checkpoint_contents(path, meta: dict) -> tuple:
    """(routers, thresholds): whether the router directory ``path`` (with its metadata ``meta``)
    holds routers and per-element thresholds, from its files alone. A directory of per-element
    thresholds only (the shipped fine sets, TEAL, WINA) is wrapped with sparse_target none: its
    routers.safetensors is empty."""
    from ..io.serialization import THRESHOLDS_FILE

    routers = (meta.get("wide_config") or {}).get("sparse_target", "all") != "none"
    return routers, "fine" in meta and (Path(path) / THRESHOLDS_FILE).is_file()


def check_mode(flag: str, mode: str, path=None, meta: Optional[dict] = None) -> None:
    """Refuse an engine mode that the checkpoint given with --routers (``path``, None for none)
    cannot run, before the model loads: one without routers would run coarse as the dense model
    under the routed label, and one without thresholds fails fine or hybrid only once loaded."""
    if path is None:
        if mode in THRESHOLD_MODES:
            need = "routers and per-element thresholds" if mode == "hybrid" else "per-element thresholds"
            raise ValueError(f"{flag} {mode} decodes with {need}: give --routers with them (e.g. "
                             f"{'a wide calibrate --hybrid run' if mode == 'hybrid' else 'smollm2-135m-fine-50'})")
        return
    from ..io import pretrained

    name = pretrained.name_of(path) or path
    routers, thresholds = checkpoint_contents(path, meta)
    if mode in ROUTED_MODES and not routers:
        raise ValueError(f"{flag} {mode} runs the routers, and --routers {name} has none (per-element thresholds "
                         f"only): use {flag} fine, which decodes with its thresholds")
    if mode in THRESHOLD_MODES and not thresholds:
        raise ValueError(f"{flag} {mode} decodes with per-element thresholds, and --routers {name} has none "
                         f"(routers only): use {flag} coarse, or a set with thresholds (wide calibrate --hybrid, or "
                         "the shipped smollm2-135m-fine-50)")


# ------------------------------------------------------------------ run directories

SETTINGS_FILE = "settings.json"  # the options that decide a run's result, checked on --resume
# Every invocation's command line, the one that started the run first: run.json quotes that one,
# not the --resume that finished it.
COMMANDS_FILE = "commands.json"
RUN_FILES = ("run.json", "history.json", SETTINGS_FILE, COMMANDS_FILE)
# What makes a directory hold a run: settings alone are written before the first step, so a run
# that failed before its first checkpoint (a loss gone non-finite, a kill) left nothing to resume
# or lose, and the corrected command starts over there without --overwrite.
RESULT_FILES = ("run.json", "history.json")


def _normalised(key: str, value):
    """Paths as absolute paths, so that the same run given from another directory matches."""
    paths = ("model", "data", "eval_data", "routers", "thresholds")
    if key in paths and value not in (DEFAULT, *BUILTIN_SOURCES, None):
        return str(Path(value).expanduser().resolve())
    return list(value) if isinstance(value, tuple) else value


def run_settings(args, dests) -> dict:
    return {d: _normalised(d, getattr(args, d)) for d in dests}


def _run_parts(out: Path, final_dir: str) -> list:
    from ..io.serialization import leftovers
    from ..training.train import CHECKPOINT_DIR

    parts = [out / CHECKPOINT_DIR, out / final_dir, *(out / f for f in RESULT_FILES)]
    return [p for p in parts if p.exists()] + leftovers(out / CHECKPOINT_DIR) + leftovers(out / final_dir)


def prepare_run(args, final_dir: str, settings: dict) -> None:
    """Refuse to replace a run by accident: an ``args.out`` holding a run needs --resume (which
    must keep every setting of ``settings``, by argparse dest, naming the flags that differ) or
    --overwrite. Reads only: under torchrun every rank runs it."""
    from ..base.cliargs import flag_of
    from ..io.serialization import newest_version
    from ..training.train import CHECKPOINT_DIR

    out = Path(args.out).expanduser()
    check_out("--out", out)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of them")
    over = "start over with --overwrite (this deletes it) or give another --out"
    if args.overwrite or not _run_parts(out, final_dir):
        return
    if not args.resume:
        raise ValueError(f"--out {out} already holds a run: continue it with --resume, or {over}")
    if newest_version(out / CHECKPOINT_DIR, verify=False) is None and (out / final_dir).exists():
        raise ValueError(f"--out {out} holds a finished run ({final_dir}/) but no checkpoint to resume from: {over}")
    saved_file = out / SETTINGS_FILE
    try:
        saved = json.loads(saved_file.read_text()) if saved_file.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{saved_file} is not valid JSON ({e}): {over}") from None
    changed = [k for k in settings if k in saved and saved[k] != settings[k]]
    if changed:
        desc = "; ".join(f"{flag_of(k)} was {saved[k]!r}, now {settings[k]!r}" for k in changed)
        raise ValueError(f"cannot resume {out}: {desc}. Resume with the saved values, or {over}")


def start_run(args, final_dir: str, settings: dict) -> None:
    """Right before training: clear the old run for --overwrite and record ``settings`` (those of
    the run resumed, where there is one: :func:`prepare_run` checked that they are the same)."""
    from ..io.serialization import atomic_write_text, remove_directory
    from ..training.train import CHECKPOINT_DIR

    out = Path(args.out)
    if getattr(args, "overwrite", False):
        for d in (CHECKPOINT_DIR, final_dir):
            remove_directory(out / d)
        for f in RUN_FILES:
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    fresh = not (out / SETTINGS_FILE).is_file() or not _run_parts(out, final_dir)
    if fresh:
        atomic_write_text(out / SETTINGS_FILE, json.dumps(settings, indent=1))
    earlier = [] if fresh else _recorded_commands(out)
    atomic_write_text(out / COMMANDS_FILE, json.dumps([*earlier, command()], indent=1))


def _recorded_commands(out: Path) -> list:
    """The command lines recorded for the run in ``out``; for a run from before commands.json,
    the one its run.json quotes (a run that finished), else none known."""
    for f, read in ((COMMANDS_FILE, lambda d: d), ("run.json", lambda d: [d["command"]])):
        try:
            found = read(json.loads((out / f).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(found, list) and all(isinstance(c, str) for c in found):
            return found
    return []


def run_commands(out) -> dict:
    """What run.json says about the commands of the run in ``out``: ``command``, the one that
    started it, and ``resumed``, the later ones (where there are any)."""
    commands = _recorded_commands(Path(out)) or [command()]
    return {"command": commands[0], **({"resumed": commands[1:]} if len(commands) > 1 else {})}


# ------------------------------------------------------------------ loading


def resolve(args) -> tuple:
    """(model directory, device) of ``args`` (ModelArgs' options); sets the thread count."""
    import torch

    check_model(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    return str(resolve_model_dir(args.model)), args.device or default_device()


def resolve_model_dir(model: str) -> Path:
    """The directory of a --model value: the embedded default model (fetched once), or the
    directory itself."""
    from ..data import fetch_default_model

    return fetch_default_model() if model == DEFAULT else Path(model).expanduser()


def load_tokenizer(args) -> tuple:
    """(tokenizer, model directory): cheap, so the data can be checked and packed before the
    model loads."""
    from transformers import AutoTokenizer

    path, _ = resolve(args)
    return AutoTokenizer.from_pretrained(path), path


def load_model(args, tok=None) -> tuple:
    """(model, tokenizer, model directory) for ModelArgs' options."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, device = resolve(args)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device)
    tok = tok if tok is not None else AutoTokenizer.from_pretrained(path)
    print(f"loaded {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params) "
          f"on {device} in {time.perf_counter() - t0:.1f}s")
    return model, tok, path


def eval_source(args) -> str:
    """Where the held-out text comes from: --eval-data, else --data, else (sampled token
    shards hold no held-out text) the embedded Wikipedia pages."""
    from ..data import is_token_shards

    if getattr(args, "eval_data", None):
        return args.eval_data
    return "wiki" if args.data not in BUILTIN_SOURCES and is_token_shards(args.data) else args.data


def packed(args, tok, split: str, max_tokens=None) -> tuple:
    """(ids [N, seq_len], documents, their UTF-8 bytes) of one split of DataArgs' text: the
    held-out split of :func:`eval_source`, or the calibration split of --data as it is
    (:func:`calibration` is what training reads)."""
    from ..data import count_bytes, load_documents, pack_documents

    source = eval_source(args) if split == "heldout" else args.data
    docs = load_documents(source, split=split, heldout_fraction=args.heldout_fraction, text_field=args.text_field)
    ids = pack_documents(docs, tok, args.seq_len, max_tokens=max_tokens)
    return ids, docs, count_bytes(docs) if docs and isinstance(docs[0], str) else None


def calibration(args, tok, max_tokens=None) -> tuple:
    """(ids [N, seq_len], decontamination report) of the calibration text: --data's
    calibration split without the documents that share a 13-gram with the held-out text or
    (--decontaminate all) the zero-shot tasks; the report says what was dropped."""
    from ..data import calibration_documents, describe_decontamination, pack_documents

    docs, report = calibration_documents(args.data, tokenizer=tok, heldout_fraction=args.heldout_fraction,
                                         text_field=args.text_field, eval_source=eval_source(args),
                                         decontaminate_mode=getattr(args, "decontaminate", "all"))
    print(describe_decontamination(report), flush=True)
    return pack_documents(docs, tok, args.seq_len, max_tokens=max_tokens), report


def heldout(args, tok) -> tuple:
    """(held-out ids, bytes per token of the held-out text)."""
    ids, docs, nbytes = packed(args, tok, "heldout")
    total_tokens = sum(len(x) for x in tok(docs, add_special_tokens=False)["input_ids"]) if args.exact_bpb else None
    # Bits per byte compare across tokenizers only through the bytes each token stands for.
    bpt = nbytes / (total_tokens or ids.numel())
    if args.max_eval_sequences:
        ids = ids[:args.max_eval_sequences]
    return ids, bpt


def evaluate_one(model, tok, args, heldout_ids, bytes_per_token, method: str, stage, reference=None) -> dict:
    """One quality record: held-out perplexity, bits per byte, realised sparsity and, with
    ``args.tasks``, zero-shot accuracy; with ``args.generation``, free-text quality against
    ``reference`` (the dense model; the model itself when None)."""
    from ..evaluation.evaluate import decode_perplexity, generation_quality, perplexity, zero_shot

    rec = {"op": "quality", "model": Path(args.model).name if args.model != DEFAULT else MODEL_NAME,
           "method": method, "stage": stage}
    ppl = perplexity(model, heldout_ids, batch_size=args.batch_size, bytes_per_token=bytes_per_token)
    rec.update(ppl=ppl["ppl"], bpb=ppl.get("bpb"), heldout_tokens=ppl["tokens"],
               sparsity=ppl.get("flop_sparsity", 0.0), group_sparsity=ppl.get("group_sparsity", 0.0),
               # every record, dense included, on the one axis all methods share (wide.method.sparsity.linear_macs)
               linear_sparsity=ppl.get("linear_sparsity") or 0.0,
               attn_core_sparsity=(ppl.get("sparsity") or {}).get("attn_core_rate") or 0.0)
    if "sparsity" in ppl:
        rec["sparsity_detail"] = ppl["sparsity"]
    state = getattr(model, "wide_state", None)
    if state is not None:  # what the routers chose among: the default group size depends on the model
        geo = state.geometry
        rec["groups"] = {"attn": geo.attn_groups, "attn_group_size": geo.attn_group_size,
                         "ffn": geo.ffn_groups, "ffn_group_size": geo.ffn_group_size}
    if getattr(args, "decode_batches", None):
        rec["decode"] = decode_perplexity(model, heldout_ids[:args.decode_windows], batch_sizes=args.decode_batches)
    if getattr(args, "generation", 0):
        rec.update(generation_quality(model, model if reference is None else reference, heldout_ids,
                                      prompts=args.generation, prompt_len=args.generation_prompt,
                                      new_tokens=args.generation_tokens, batch_size=args.batch_size))
    if args.tasks:
        zs = zero_shot(model, tok, args.tasks, limit=args.limit, batch_size=args.batch_size)
        for t in args.tasks:
            rec[t] = zs[t]["metric"]
        rec["avg"] = zs["avg"]
        rec["tasks_detail"] = {t: zs[t] for t in args.tasks}
        rec["limit"] = args.limit
    return rec


# Zero-shot requests tokenised per task to estimate their length (the mean of a sample stands for all).
ESTIMATE_SAMPLE = 256
ESTIMATE_TOKENS = 64  # of each held-out row in the timed forward


def eval_work(args, tok, heldout_ids, routed: bool) -> dict:
    """What :func:`evaluate_one` runs for one model, per phase: (tokens read in full forwards,
    decode steps on the KV cache). ``routed``: a routed model, whose generation measures continue
    the dense reference as well and whose decode perplexity runs batch-shared too."""
    N, L = heldout_ids.shape
    work = {"perplexity": (N * L, 0)}
    if getattr(args, "decode_batches", None):
        n, P = min(args.decode_windows, N), L // 2
        sizes = sorted(set(args.decode_batches))
        batches = [sizes[-1], *(sizes if routed else [])]  # its own masks at the largest batch, then shared
        work["decode perplexity"] = (len(batches) * n * P, sum(math.ceil(n / b) * (L - 1 - P) for b in batches))
    if getattr(args, "generation", 0):
        n, P, T = min(args.generation, N), args.generation_prompt, args.generation_tokens
        texts = 2 if routed else 1  # the dense reference's continuation, and the model's own
        # each continuation, then both models read prompt + continuation for the KL
        work["generation"] = (texts * n * P + 2 * n * (P + T), texts * math.ceil(n / args.batch_size) * (T - 1))
    if args.tasks:
        work["zero-shot"] = (_zero_shot_tokens(tok, tuple(args.tasks), args.limit), 0)
    return work


@functools.lru_cache(maxsize=4)
def _zero_shot_tokens(tok, tasks: tuple, limit: Optional[int]) -> int:
    """Tokens the zero-shot requests of ``tasks`` read (each choice with its context)."""
    from ..data import load_zero_shot
    from ..evaluation.evaluate import _encode_pair, build_requests

    tokens = 0.0
    for task in tasks:
        docs = load_zero_shot(task)
        reqs, _ = build_requests(task, docs[:limit] if limit else docs)
        sample = reqs[::max(1, len(reqs) // ESTIMATE_SAMPLE)]
        lengths = [sum(map(len, _encode_pair(tok, r.context, r.continuation))) for r in sample]
        tokens += len(reqs) * sum(lengths) / max(1, len(lengths))
    return int(tokens)


def eval_speed(model, heldout_ids, batch_size: int, decode: bool = True) -> tuple:
    """(seconds per token of a full forward, seconds per decode step) of ``model`` at
    ``batch_size``, the faster of two timings each after a warm-up: a forward of that many
    held-out rows cut to 64 tokens (a few seconds on a laptop CPU, where one row alone ran at
    half the speed of the batch), and a decode step on their KV cache (0.0, not timed, without
    ``decode``: no decode step to estimate). A wrapped model runs as the evaluation runs it, its
    realised sparsity tracked (:func:`wide.method.sparsity.track_sparsity`): its hooks,
    per-element masks and the tracking are what make it slower than the dense model."""
    import contextlib

    import torch

    from ..evaluation.evaluate import cache_kwargs
    from ..method.sparsity import track_sparsity

    device = next(model.parameters()).device
    rows = heldout_ids[:batch_size, :ESTIMATE_TOKENS].to(device)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    was_training = model.training
    model.eval()
    tracked = track_sparsity(model) if hasattr(model, "wide_state") else contextlib.nullcontext()
    per_step = 0.0
    try:
        with torch.no_grad(), tracked:
            model(input_ids=rows[:1, :8])
            per_token = timed(lambda: model(input_ids=rows)) / rows.numel()
            if decode:
                out = model(input_ids=rows[:, :8], use_cache=True)
                step = rows[:, 8:9] if rows.shape[1] > 8 else rows[:, -1:]
                out = model(input_ids=step, use_cache=True, **cache_kwargs(model, out))
                per_step = timed(lambda: model(input_ids=step, use_cache=True, **cache_kwargs(model, out)))
    finally:
        model.train(was_training)
    return per_token, per_step


def load_routed(args, model_path, rdir):
    """The model at ``model_path`` with the method directory ``rdir`` loaded onto it
    (:func:`wide.training.recovery.load_recovered`), on ``--device``: what ``wide eval``
    evaluates for each ``--routers``."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..training.recovery import load_recovered

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
    return load_recovered(model.to(args.device or default_device()), rdir)


def eval_speeds(args, model_path, dense, heldout_ids, decode: bool = True) -> tuple:
    """(the :func:`eval_speed` of each model ``wide eval`` evaluates, in its order: the dense
    model when it is evaluated, then each ``--routers`` set; what they were timed on, in words;
    the first set's model, loaded here and kept for its evaluation, or None without
    ``--routers``). Every set is timed on its own model: routers, per-element thresholds and
    adapters run slower PyTorch paths than the dense model (on an H100 a perplexity batch took
    ~1.8x dense's time for per-element thresholds, ~2.5x for head routers + thresholds), so an
    estimate timed on the dense model alone fell ~3x short of such a set's seven tasks. The
    cost: one timing per model and one extra load per set after the first (the later sets are
    loaded, timed and let go first, so that no more models are held at once than the evaluation
    itself holds)."""
    rdirs = list(args.routers or [])
    evaluated_dense = bool(args.dense or not rdirs)
    speeds, first = {}, None
    # each set once, the first one last: that model stays, for its own evaluation
    for rdir in [r for r in dict.fromkeys(rdirs) if r != rdirs[0]] + rdirs[:1]:
        model = load_routed(args, model_path, rdir)
        speeds[rdir] = eval_speed(model, heldout_ids, args.batch_size, decode=decode)
        if rdir == rdirs[0]:
            first = model
        del model
    timed = [eval_speed(dense, heldout_ids, args.batch_size, decode=decode)] if evaluated_dense else []
    timed += [speeds[r] for r in rdirs]
    sets = ("the routed set" if len(rdirs) == 1 else f"each of the {len(rdirs)} routed sets") if rdirs else ""
    on = " and ".join(x for x in ("the dense model" if evaluated_dense else "", sets) if x)
    return timed, on, first


def describe_estimate(work: list, speed, device: str, harness: bool = False, timed_on: str = "the dense model") -> str:
    """One line: the time the evaluations ``work`` (one :func:`eval_work` per model) should
    take at ``speed`` (:func:`eval_speed`: one for every model, or a list of one per model, as
    :func:`eval_speeds` gives), in all and per phase, and the flags that set it. ``timed_on``
    says which models the speeds were measured on. A routed model's generation counts the dense
    reference's share of it at the routed model's speed."""
    speeds = list(speed) if speed and isinstance(speed[0], (tuple, list)) else [speed] * len(work)
    if len(speeds) != len(work):
        raise ValueError(f"{len(work)} models to estimate but {len(speeds)} speeds")
    phases: dict = {}
    for w, (per_token, per_step) in zip(work, speeds):
        for phase, (tokens, steps) in w.items():
            phases[phase] = phases.get(phase, 0.0) + tokens * per_token + steps * per_step
    total = sum(phases.values())

    def t(seconds: float) -> str:
        return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"

    detail = ", ".join(f"{phase} {t(v)}" for phase, v in phases.items())
    models = f"{len(work)} model{'s' if len(work) > 1 else ''}"
    return (f"estimate: about {t(total)} for {models} on {device} ({detail}; timed on {timed_on}"
            f"{'; --harness tasks not included' if harness else ''}); --limit, --max-eval-sequences, --tasks and "
            "--generation set how much is evaluated")


def _offset_batches(args, train_ids) -> list:
    """The first ``--offset-batches`` batches of the calibration text, where offsets are set."""
    return list(train_ids[:args.offset_batches * args.batch_size].split(args.batch_size))


def calibrate_offsets(model, args, train_ids) -> Optional[dict]:
    """Router offsets set so that the inference masks hit the target exactly on the first
    ``--offset-batches`` batches of the calibration text (nothing with ``--offsets none``),
    with the time it took printed, so that a run's log shows where its time went."""
    if args.offsets == "none":
        return None
    from ..method.fine import get_fine, shift_to_target
    from ..method.offsets import calibrate_offsets as calibrate
    from ..method.state import get_state

    batches = _offset_batches(args, train_ids)
    t0 = time.perf_counter()
    fine = get_fine(model)
    if fine is not None and fine.config.allocation == "learned":
        # routers and learned thresholds share one linear-MAC budget: one shift of every threshold
        # lands the pair on it (the routers' own offsets stay as trained)
        shift = shift_to_target(model, batches, get_state(model).config.target_sparsity)
        print(f"thresholds shifted by {shift:+.3f} (log units) to the target on {sum(len(b) for b in batches)} "
              f"sequences in {time.perf_counter() - t0:.1f}s", flush=True)
        return {"threshold_shift": shift}
    if not any(p.numel() for p in model.wide_routers.parameters()):
        return None  # no router (per-element sparsity alone: its thresholds are its calibration)
    offsets = calibrate(model, batches, mode=args.offsets)
    print(f"offsets ({args.offsets}) calibrated on {sum(len(b) for b in batches)} sequences in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    return offsets


def core_rate(model, args, train_ids) -> float:
    """The attention-core sparsity the model's routers reach on the ``--offset-batches``
    calibration batches."""
    import torch

    from ..method.sparsity import track_sparsity

    with track_sparsity(model) as tracker, torch.no_grad():
        device = next(model.parameters()).device
        for b in _offset_batches(args, train_ids):
            model(input_ids=b.to(device))
    return tracker.summary().attn_core_rate


def is_heads_set(model) -> bool:
    """Head routers beside thresholds they did not train (``wide calibrate --thresholds``, or an
    experiment's library set): thresholds, routers on attention alone, a skip rule. Stage 2 keeps
    such thresholds as they are and sets the routers' offsets back to the set's attention-core rate."""
    from ..method.fine import get_fine

    state = getattr(model, "wide_state", None)
    cfg = None if state is None else state.config
    return (get_fine(model) is not None and cfg is not None and cfg.routes_attention and not cfg.routes_ffn
            and cfg.attn_rule != "independent")


def head_offsets(model, args, rate: float, train_ids) -> Optional[dict]:
    """Router offsets of head routers beside frozen thresholds (wide.method.head_choice): the
    attention-core rate ``rate`` on the ``--offset-batches`` calibration batches, the thresholds
    left as they are (the set's own calibration); the rate reached printed and returned."""
    if args.offsets == "none":
        return None
    from ..method.head_choice import calibrate_core_offsets

    batches = _offset_batches(args, train_ids)
    t0 = time.perf_counter()
    offsets = calibrate_core_offsets(model, batches, rate, args.offsets)
    reached = core_rate(model, args, train_ids)
    print(f"offsets ({args.offsets}) to attention-core sparsity {rate:g} on {sum(len(b) for b in batches)} "
          f"sequences in {time.perf_counter() - t0:.1f}s: reached {reached:.4f}", flush=True)
    return {"mode": args.offsets, "core_target": rate, "attn_core_rate": reached, "offsets": offsets}


def routing_name(meta: dict) -> str:
    """The routing rule of saved routers, as records name it: "token", or "tile<N>" (and
    "tile<N>prev") for route_tile N > 1, "skip_smallest<k>" for attention skipping the k
    smallest margins (docs/routing_structure.md)."""
    cfg = meta.get("wide_config") or {}
    return config_routing_name(cfg.get("route_tile", 1), cfg.get("tile_source", "first"),
                               cfg.get("attn_rule", "independent"), cfg.get("attn_skip", 1))


def training_fields(meta: Optional[dict]) -> dict:
    """What a quality record says about how the routers it measures were trained: ``loss``
    (ce | kd | mix), ``tokens`` (calibration tokens seen, both stages together for stage 2) and
    ``seed``, read from a router directory's metadata (``meta["run"]``, which ``wide
    calibrate`` / ``wide recover`` save); for stage 2 also ``stage1`` with the same three of
    its start. None where the directory does not say (routers saved from Python); the dense
    model's record has loss None, tokens 0, seed None."""
    if meta is None:
        return {"loss": None, "tokens": 0, "seed": None, "routing": None}
    run = meta.get("run") or {}
    # wide compare's method directories keep their TrainArgs in compare_settings (no run record)
    targs = run.get("train_args") or (meta.get("compare_settings") or {}).get("train") or {}
    loss = targs.get("loss", "ce" if targs else None)  # runs from before --loss trained with ce
    out = {"loss": loss, "tokens": run.get("tokens"), "seed": targs.get("seed"), "routing": routing_name(meta)}
    if run.get("stage1"):
        out["stage1"] = run["stage1"]
    return out


def command() -> str:
    """The command line this process runs, as results files quote it."""
    return "wide " + " ".join(sys.argv[1:])


def machine() -> dict:
    import torch

    d = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
         "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
    return d


def results_files(stem) -> tuple:
    """(STEM.json, STEM.md) of a results stem, taken literally: ``run.v1`` gives run.v1.json, where
    ``Path.with_suffix`` would take ``.v1`` for a suffix and write run.json."""
    stem = Path(stem).expanduser()
    return stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.md"


def check_results(flag: str, stem, overwrite: bool) -> None:
    """Results can be written at ``stem``: nothing in the way, and no earlier results there
    unless ``overwrite`` (a results file is an hour of evaluation, and nothing rewrites it)."""
    check_out(flag, stem, stem=True)
    existing = [f for f in results_files(stem) if f.exists()]
    if existing and not overwrite:
        raise ValueError(f"{flag} {stem}: {existing[0]} already exists: pass --overwrite to replace it, or give "
                         f"another {flag}")


def write_results(args, records) -> None:
    """``args.out``.json (records, device, date, command) and .md (table); nothing without --out."""
    import torch

    from ..evaluation.evaluate import harness_table, markdown_table

    if not args.out:
        return
    json_file, md_file = results_files(args.out)
    json_file.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": machine().get("gpu", platform.processor() or "cpu"), "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command(), "records": records}
    json_file.write_text(json.dumps(doc, indent=2))
    md = [f"# {Path(args.out).name}", "", f"Command: `{doc['command']}`", f"Date: {doc['date']}; torch {doc['torch']}; "
          f"device {doc['device']}", "", markdown_table(records, args.tasks or ()), ""]
    if any(r.get("harness") for r in records):
        h = next(r["harness"] for r in records if r.get("harness"))
        mode = getattr(args, "harness_mode", h["mode"])
        md += [f"lm-evaluation-harness (lm-eval {h.get('lm_eval')}, mode {mode}):", "", harness_table(records), ""]
    if args.limit:
        md.append(f"Zero-shot scores use the first {args.limit} validation documents of each task.")
    md_file.write_text("\n".join(md) + "\n")
    print(f"wrote {json_file} and {md_file}")


__all__ = ["DEFAULT", "ModelArgs", "DataArgs", "EvalArgs", "HarnessArgs", "RunArgs", "resolve", "load_model", "load_tokenizer",
           "model_config", "resolve_model_dir", "check_safetensors", "check_geometry", "check_model", "check_data", "check_out",
           "check_results", "check_routers", "check_thresholds", "resolve_thresholds", "check_mode", "checkpoint_contents", "run_settings", "prepare_run", "start_run",
           "SETTINGS_FILE", "COMMANDS_FILE", "run_commands", "packed", "calibration", "eval_source", "training_fields", "calibrate_offsets", "head_offsets",
           "heldout", "evaluate_one", "eval_work", "eval_speed", "eval_speeds", "load_routed", "describe_estimate", "command", "machine", "results_files", "write_results", "default_device"]
