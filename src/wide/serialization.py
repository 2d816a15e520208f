"""Saving and loading routers: a directory with ``routers.safetensors`` + ``wide_config.json``.

The JSON records the model's shape, so routers trained for one model are refused, with the
differences spelled out, by any other. Directories are written to a temporary sibling and
renamed into place, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from .config import WideConfig
from .modeling import ModelDims, get_state, wrap

ROUTERS_FILE = "routers.safetensors"
CONFIG_FILE = "wide_config.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    pass


@contextmanager
def atomic_directory(path: Union[str, Path]):
    """Yield a temporary directory that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_routers(model, path, *, extra: Optional[dict] = None,
                 write_more: Optional[Callable[[Path], None]] = None) -> Path:
    """Write the routers (weights, biases, calibrated offsets) and config to ``path``.

    ``write_more(tmp_dir)`` adds files (trainer state, adapters) inside the same atomic write.
    """
    state = get_state(model)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.wide_routers.state_dict().items()}
    meta = {
        "format_version": FORMAT_VERSION,
        "wide_config": state.config.to_dict(),
        "model": asdict(state.geometry.dims),
        "base_model": getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None),
        **(extra or {}),
    }
    with atomic_directory(path) as tmp:
        save_file(tensors, str(tmp / ROUTERS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        if write_more is not None:
            write_more(tmp)
    return Path(path)


def read_meta(path) -> dict:
    path = Path(path)
    cfg = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"router checkpoint {path} does not exist or is not a directory")
    if not cfg.is_file() or not (path / ROUTERS_FILE).is_file():
        raise CheckpointError(f"{path} is not a wide router checkpoint: it needs {CONFIG_FILE} and {ROUTERS_FILE}")
    try:
        meta = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON (corrupt checkpoint?): {e}") from e
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer wide (format {meta['format_version']})")
    return meta


def load(model, path):
    """Wrap ``model`` with the routers saved in ``path`` (or load them into an already
    wrapped model with the same config). Refuses routers made for another model shape."""
    meta = read_meta(path)
    saved = meta["model"]
    actual = asdict(ModelDims.from_hf_config(model.config))
    diffs = {k: (saved.get(k), actual[k]) for k in actual if saved.get(k) != actual[k]}
    if diffs:
        desc = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diffs.items())
        raise CheckpointError(f"routers in {path} were trained for a different model ({desc})")
    config = WideConfig.from_dict(meta["wide_config"])
    if hasattr(model, "wide_state"):
        if model.wide_state.config != config:
            raise CheckpointError(f"model is wrapped with a different WideConfig than {path}")
    else:
        wrap(model, config)
    try:
        tensors = load_file(str(Path(path) / ROUTERS_FILE))
    except Exception as e:  # safetensors' error type moved between releases
        raise CheckpointError(f"{Path(path) / ROUTERS_FILE} is corrupt or unreadable: {e}") from e
    device = next(model.wide_routers.parameters()).device
    try:
        model.wide_routers.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"router tensors in {path} do not match the config: {e}") from e
    return model


def resolve_base_model(path, base_model=None, **hf_kwargs):
    """The model a checkpoint applies to: ``base_model`` itself, a local HF directory to load,
    or (None) the directory recorded in the checkpoint at save time."""
    if base_model is None:
        base_model = read_meta(path).get("base_model")
        if not base_model:
            raise CheckpointError(f"{path} records no base model: pass base_model=")
    if isinstance(base_model, (str, Path)):
        from transformers import AutoModelForCausalLM

        hf_kwargs.setdefault("dtype", torch.float32)
        base_model = AutoModelForCausalLM.from_pretrained(str(base_model), **hf_kwargs)
    return base_model


def from_pretrained(path, base_model=None, **hf_kwargs):
    """Load base model + routers in one call, like ``PeftModel.from_pretrained``.

    ``base_model`` is a model, a local HF directory, or None to use the directory recorded
    at save time.
    """
    return load(resolve_base_model(path, base_model, **hf_kwargs), path)
