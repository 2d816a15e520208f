"""``wide sample-data``: calibration text sampled from a model itself, kept as token shards.

Calibration at scale needs more text than the embedded corpora hold (the Wikipedia pages give
~600k tokens). A model's own samples are as much text as one asks for, come from the
distribution the dense model is (which is what self-distillation matches), and cost only
generation time: on a GPU, Hugging Face ``generate`` with large batches is enough.

Every sample starts from a prompt: the document separator alone (``prompt_source="bos"``: the
``<|endoftext|>`` token that precedes every document in packed windows, so the model starts a
new document) or ``prompt_tokens`` tokens drawn from the calibration split of a text source
(``"calibration"``; decontaminated like any calibration text, never held-out or evaluation
text). A sample ends at the separator or the tokenizer's eos, or after ``max_new_tokens``; it
is kept as the prompt's tokens (none for "bos") followed by what was generated.

The output directory holds ``shard_NNNNN.safetensors`` files (``tokens`` int32, ``offsets``
int64: document k is tokens[offsets[k]:offsets[k+1]]) and ``manifest.json``: the model (path,
sha256 of its config and weights), the tokenizer (sha256 of its vocabulary), the seed, every
sampling setting, each shard's sha256 and token count, the wide version and commit, the
command. Shard k is a function of (settings, seed, k, its token target) alone: the seed of
each ``generate`` call is ``mix_seed(seed, k, call)``, so the same command gives the same
tokens (on the same kind of device and software; tested on the CPU), an interrupted run
resumes keeping every shard it finished (verified against its sha256), and asking for more
tokens later keeps every full shard. ``wide.data.read_token_shards`` verifies every shard on
load; ``--data DIR`` trains on them.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..base.cliargs import check_fields
from ..data import SHARD_FORMAT, SHARD_MANIFEST, _separator_id, tokenizer_fingerprint
from ..base.fileio import atomic_output, sha256_file
from ..io.serialization import atomic_write_text

PROMPT_SOURCES = ("bos", "calibration")
MANIFEST_VERSION = 1
MAX_IDLE_CALLS = 10  # generate() calls in a row with nothing but empty samples before giving up


@dataclass
class SampleArgs:
    # The metadata is each field's command-line option (wide.base.cliargs).
    tokens: int = field(default=1_000_000, metadata={
        "help": "tokens to sample, counting one separator per document as packing does", "min": 1})
    seed: int = field(default=0, metadata={"help": "seed of every generate() call", "min": 0, "max": 2 ** 63 - 1})
    batch_size: int = field(default=64, metadata={"help": "sequences per generate() call", "min": 1})
    max_new_tokens: int = field(default=512, metadata={"help": "longest continuation of one prompt", "min": 1})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature (1 = the model's own distribution)", "gt": 0})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus sampling: the smallest set of tokens whose probability reaches P (1 = all)", "gt": 0, "max": 1})
    prompt_source: str = field(default="bos", metadata={
        "choices": PROMPT_SOURCES,
        "help": "bos: every sample starts from the document separator alone; calibration: from --prompt-tokens "
                "tokens drawn from the (decontaminated) calibration split of --data"})
    prompt_tokens: int = field(default=16, metadata={"help": "prompt length with --prompt-source calibration", "min": 1})
    shard_tokens: int = field(default=1 << 20, metadata={"help": "tokens per shard (the unit of resuming)", "min": 1})

    def __post_init__(self):
        check_fields(self)  # ranges and choices

    def shard_targets(self) -> list:
        """Token target of each shard: full shards, then the remainder."""
        full, rest = divmod(self.tokens, self.shard_tokens)
        return [self.shard_tokens] * full + ([rest] if rest else [])


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.safetensors"


def model_fingerprint(model_dir) -> dict:
    """Path and sha256 of a model directory's config.json and weight files."""
    d = Path(model_dir)
    h = hashlib.sha256()
    weights = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    for p in weights:
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode() + b"\0")
    return {"path": str(d.resolve()), "config_sha256": sha256_file(d / "config.json") if (d / "config.json").is_file()
            else None, "weights_sha256": h.hexdigest(), "weight_files": [p.name for p in weights]}


def code_version() -> dict:
    """wide's version and, in a git checkout, its commit (and whether the tree had changes)."""
    from .. import __version__

    out = {"version": __version__, "commit": None, "dirty": None}
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode == 0:
            out["commit"] = commit.stdout.strip()
            status = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def settings_of(args: SampleArgs, model_info: dict, tokenizer, *, dtype: str, device: str,
                prompts: Optional[dict]) -> dict:
    """Everything that decides the sampled tokens (the requested total does not: each shard
    depends on its own target only)."""
    sampling = {k: v for k, v in asdict(args).items() if k != "tokens"}
    return {"model": {k: model_info[k] for k in ("config_sha256", "weights_sha256")},
            "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "")), "sha256": tokenizer_fingerprint(tokenizer),
                          "separator": _separator_id(tokenizer), "eos": tokenizer.eos_token_id},
            "sampling": sampling, "prompts": prompts, "dtype": dtype, "device_type": torch.device(device).type}


def _generate(model, input_ids: torch.Tensor, args: SampleArgs, stop: list, pad: int, seed: int) -> torch.Tensor:
    from transformers import GenerationConfig

    # Every setting explicit: the model's generation_config.json (top_k=50, a repetition penalty ...)
    # must not change what "temperature T, top-p P" means.
    cfg = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                           max_new_tokens=args.max_new_tokens, eos_token_id=stop, pad_token_id=pad,
                           repetition_penalty=1.0, num_beams=1, use_cache=True)
    torch.manual_seed(seed)  # all devices: generate draws from the global generators
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=cfg)


def sample_shard(model, args: SampleArgs, k: int, target: int, *, separator: int, eos: Optional[int],
                 prompts: Optional[torch.Tensor] = None) -> dict:
    """Documents (token id arrays) of shard ``k``: ``generate`` calls until the documents and
    one separator each reach ``target`` tokens. Returns tokens, offsets and counts."""
    from ..training.distributed import mix_seed

    device = next(model.parameters()).device
    stop = [separator] + ([eos] if eos is not None and eos != separator else [])
    pad = eos if eos is not None else separator
    docs, total, empty, call, idle = [], 0, 0, 0, 0
    while total < target:
        if idle == MAX_IDLE_CALLS:
            raise RuntimeError(f"{idle} generate() calls in a row gave only empty samples (the model ends every "
                               "document at once): try another --prompt-source or --temperature")
        seed = mix_seed(args.seed, k, call)
        if prompts is None:
            inp = torch.full((args.batch_size, 1), separator, dtype=torch.long)
        else:
            g = torch.Generator().manual_seed(seed)
            inp = prompts[torch.randint(0, prompts.shape[0], (args.batch_size,), generator=g)]
        out = _generate(model, inp.to(device), args, stop, pad, seed).cpu()
        width = inp.shape[1]
        before = len(docs)
        for row in range(out.shape[0]):
            new = out[row, width:]
            ends = torch.isin(new, torch.tensor(stop)).nonzero()
            new = new[: int(ends[0]) if len(ends) else len(new)]
            doc = new if prompts is None else torch.cat([inp[row], new])
            if doc.numel() == 0:
                empty += 1
                continue
            docs.append(doc.numpy().astype(np.int32))
            total += doc.numel() + 1
            if total >= target:
                break
        call += 1
        idle = idle + 1 if len(docs) == before else 0
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    return {"tokens": np.concatenate(docs), "offsets": offsets, "documents": len(docs), "stream_tokens": total,
            "empty": empty, "calls": call}


def _write_shard(path: Path, shard: dict) -> str:
    from safetensors.numpy import save_file

    with atomic_output(path, prefix=f".{path.name}.") as tmp:
        save_file({"tokens": shard["tokens"], "offsets": shard["offsets"]}, tmp)
        digest = sha256_file(tmp)
    return digest


def _differences(saved: dict, now: dict, prefix: str = "") -> list:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} was {a!r}, now {b!r}")
    return out


def existing_shards(out: Path, settings: dict, *, overwrite: bool) -> list:
    """The shard entries of ``out``'s manifest that a run with ``settings`` may keep (all of
    them, checked later); refuses a directory sampled with other settings unless
    ``overwrite``."""
    f = out / SHARD_MANIFEST
    if not f.is_file() or overwrite:
        return []
    saved = json.loads(f.read_text())
    if saved.get("format") != SHARD_FORMAT:
        raise ValueError(f"--out {out} holds a {SHARD_MANIFEST} that is not a {SHARD_FORMAT} manifest")
    diff = _differences(saved.get("settings", {}), settings)
    if diff:
        raise ValueError(f"--out {out} was sampled with other settings ({'; '.join(diff)}): give another --out, or "
                         "--overwrite to sample it again")
    return saved.get("shards", [])


def sample_data(model, tokenizer, args: SampleArgs, out_dir, *, model_info: dict, dtype: str,
                prompts: Optional[torch.Tensor] = None, prompt_info: Optional[dict] = None,
                overwrite: bool = False, command: Optional[str] = None, progress: bool = True) -> dict:
    """Sample ``args.tokens`` tokens into ``out_dir`` (see the module's docstring); returns
    the manifest. Shards already there with the same settings and target, whose files match
    their sha256, are kept."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    settings = settings_of(args, model_info, tokenizer, dtype=dtype, device=str(device), prompts=prompt_info)
    old = {s["index"]: s for s in existing_shards(out, settings, overwrite=overwrite)}
    targets = args.shard_targets()
    manifest = {"format": SHARD_FORMAT, "version": MANIFEST_VERSION, "settings": settings,
                "model_path": model_info["path"], "requested_tokens": args.tokens, "complete": False,
                "command": command, "wide": code_version(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "shards": []}
    import transformers

    manifest["transformers"] = transformers.__version__
    sep, eos = _separator_id(tokenizer), tokenizer.eos_token_id
    t0, made = time.perf_counter(), 0
    model.eval()
    bar = tqdm(total=args.tokens, disable=not progress, desc="sampling", unit="tok", dynamic_ncols=True)
    for k, target in enumerate(targets):
        path = out / shard_name(k)
        prev = old.get(k)
        if prev is not None and prev.get("target") == target and path.is_file() and sha256_file(path) == prev["sha256"]:
            entry = prev
        else:
            shard = sample_shard(model, args, k, target, separator=sep, eos=eos, prompts=prompts)
            digest = _write_shard(path, shard)
            entry = {"index": k, "file": path.name, "sha256": digest, "target": target,
                     "tokens": shard["stream_tokens"], "documents": shard["documents"], "empty": shard["empty"],
                     "generate_calls": shard["calls"]}
            made += shard["stream_tokens"]
        manifest["shards"].append(entry)
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
        manifest["documents"] = sum(s["documents"] for s in manifest["shards"])
        atomic_write_text(out / SHARD_MANIFEST, json.dumps(manifest, indent=1))
        bar.update(entry["tokens"])
    bar.close()
    for stale in sorted(out.glob("shard_*.safetensors")):  # shards of a larger earlier request
        if stale.name not in {s["file"] for s in manifest["shards"]}:
            stale.unlink()
    wall = time.perf_counter() - t0
    manifest.update(complete=True, sampled_tokens_this_run=made, wall_s=wall,
                    tokens_per_s=made / wall if made and wall > 0 else None)
    atomic_write_text(out / SHARD_MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def run(args) -> dict:
    """``wide sample-data``: load the model, pick prompts, sample (cli.py wires the options)."""
    from . import runs
    from ..base.cliargs import from_args

    sargs = from_args(SampleArgs, args)
    tok, path = runs.load_tokenizer(args)
    prompts, prompt_info = None, None
    if sargs.prompt_source == "calibration":
        window = argparse_namespace(args, seq_len=sargs.prompt_tokens)
        prompts, report = runs.calibration(window, tok)
        prompt_info = {"source": "calibration", "data": runs.run_settings(args, ("data",))["data"],
                       "heldout_fraction": args.heldout_fraction, "text_field": args.text_field,
                       "decontaminate": args.decontaminate, "eval_data": runs.eval_source(args),
                       "windows": int(prompts.shape[0]), "windows_sha256": hashlib.sha256(
                           prompts.numpy().astype(np.int64).tobytes()).hexdigest(),
                       "decontamination": {k: report.get(k) for k in ("dropped", "kept", "documents_hit")}}
    model, tok, _ = runs.load_model(args, tok)
    info = model_fingerprint(path)
    manifest = sample_data(model, tok, sargs, args.out, model_info=info, dtype=args.dtype, prompts=prompts,
                           prompt_info=prompt_info, overwrite=args.overwrite, command=runs.command())
    rate = manifest.get("tokens_per_s")
    print(f"{manifest['tokens']} tokens in {manifest['documents']} documents, {len(manifest['shards'])} shards in "
          f"{args.out}" + (f" ({rate:.0f} tokens/s sampled this run)" if rate else " (all shards kept)"))
    return manifest


def argparse_namespace(args, **changes):
    """A copy of a parsed namespace with some values changed."""
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


__all__ = ["SampleArgs", "PROMPT_SOURCES", "sample_data", "sample_shard", "model_fingerprint", "code_version",
           "settings_of", "existing_shards", "shard_name", "run"]
