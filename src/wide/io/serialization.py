"""Saving and loading routers: a directory with ``routers.safetensors`` + ``wide_config.json``.

The JSON records the model's shape, so routers trained for one model are refused, with the
differences spelled out, by any other.

Directories are written with a protocol that survives ``kill -9`` at any instruction
(:func:`atomic_directory`): the files go to a temporary sibling ``.NAME.tmp-PID-*``, are
fsync'd, and a manifest (``wide_manifest.json``: each file's size and sha256, the write time)
is written last, so a directory is complete exactly when its manifest matches its files.
Then ``NAME`` is renamed aside (``.NAME.old-PID-*``), the new directory renamed into place
and the old one removed. A kill between those renames leaves ``NAME`` missing but both
versions complete beside it: :func:`recover_directory` finds the newest complete one among
``NAME`` and its hidden siblings, puts it in place and removes the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from ..method.config import START_ONLY, WideConfig, with_predating
from ..base.fileio import atomic_write_text as _write_text
from ..base.fileio import sha256_file, umask_mode
from ..method.fine import FineConfig, attach, get_fine
from ..method.geometry import ModelDims
from ..method.modeling import wrap
from ..method.state import get_state

ROUTERS_FILE = "routers.safetensors"
# Per-element thresholds (wide.fine), beside the routers; their FineConfig is wide_config.json's "fine".
THRESHOLDS_FILE = "thresholds.safetensors"
CONFIG_FILE = "wide_config.json"
MANIFEST_FILE = "wide_manifest.json"
FORMAT_VERSION = 1
# Keys every router directory's wide_config.json holds; without them nothing can be loaded.
REQUIRED_META = ("wide_config", "model")
# Test hook: seconds to sleep at each step of a directory write, to widen the windows a
# fault-injection test aims its kill -9 at. Unset outside tests.
SLOW_WRITE_ENV = "WIDE_TEST_SLOW_WRITE"


class CheckpointError(ValueError):
    pass


class BaseModelWarning(UserWarning):
    """Routers loaded onto another model than the one they were trained on (same shape)."""


def _pause() -> None:
    delay = os.environ.get(SLOW_WRITE_ENV)
    if delay:
        time.sleep(float(delay))


def _fsync(path: Path) -> None:
    # Directories too: a rename is durable only once its directory entry is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():  # some filesystems cannot fsync a directory; a file must be
            raise
    finally:
        os.close(fd)


def _files(root: Path) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _seal(tmp: Path, info: Optional[dict]) -> None:
    """Make ``tmp`` durable and mark it complete: every file fsync'd and hashed, then the
    manifest, written through a rename so that it is itself whole or absent."""
    files, listed = {}, _files(tmp)
    mode = umask_mode()
    for p in listed:
        if p.stat().st_mode & 0o777 != mode:  # shareable like every other output (safetensors writes 0600)
            os.chmod(p, mode)
        _fsync(p)
        files[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        _pause()
    for d in sorted({p.parent for p in listed} | {tmp}, key=lambda d: -len(d.parts)):
        _fsync(d)
    manifest = {"written_ns": time.time_ns(), **(info or {}), "files": files}
    part = tmp / (MANIFEST_FILE + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / MANIFEST_FILE)
    _fsync(tmp)


def read_manifest(path: Union[str, Path], verify: bool = True) -> Optional[dict]:
    """The manifest of a complete directory, or None when ``path`` is missing, unsealed or its
    files do not match (``verify`` hashes them)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        for rel, want in manifest["files"].items():
            f = path / rel
            if f.stat().st_size != want["size"] or (verify and sha256_file(f) != want["sha256"]):
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest


def leftovers(path: Union[str, Path]) -> list:
    """Leftovers of interrupted writes of ``path``: ``.NAME.tmp-*`` and ``.NAME.old-*`` (not
    those of another name that merely starts with NAME and a dot)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-[A-Za-z0-9_-]+")
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name))


def _owner_alive(p: Path) -> bool:
    """Whether the process named in a leftover's name (``.NAME.tmp-PID-*``) still runs and is
    not this one: its write may be in progress, so it is not ours to remove."""
    parts = p.name.rsplit(".", 1)[-1].split("-")
    if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) == os.getpid() or os.name != "posix":
        return False  # (elsewhere os.kill(pid, 0) would end the process, not probe it)
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _remove_leftovers(path: Path) -> None:
    for p in leftovers(path):
        if not _owner_alive(p):
            _remove(p)


def _put_in_place(new: Path, path: Path) -> None:
    """Rename complete directory ``new`` to ``path``, replacing it. At every instant the newest
    complete version is ``path``, ``new`` or the renamed-aside old one."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
        _fsync(path.parent)
        _pause()
    os.replace(new, path)
    _fsync(path.parent)
    _pause()
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(path: Union[str, Path], info: Optional[dict] = None):
    """Yield a temporary directory that replaces ``path`` only if the block succeeds (see the
    module docstring for why a kill at any point loses nothing). ``info`` (e.g. the step) goes
    into the manifest. Leftovers of earlier interrupted writes are removed after the switch."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # not tempfile.mkdtemp, whose 0700 would stay with the directory once renamed into place
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        yield tmp
        _seal(tmp, info)
        _put_in_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_leftovers(path)


def _version(p: Path, is_target: bool, verify: bool = True) -> Optional[tuple]:
    """Sort key of a complete version of a directory (newest last), None if incomplete."""
    manifest = read_manifest(p, verify)
    if manifest is not None:
        return (int(manifest.get("written_ns", 0)), is_target)
    # Written before manifests existed: the rename-into-place alone made the target complete.
    if is_target and p.is_dir() and not (p / MANIFEST_FILE).exists() and (p / CONFIG_FILE).is_file():
        return ((p / CONFIG_FILE).stat().st_mtime_ns, is_target)
    return None


def newest_version(path: Union[str, Path], verify: bool = True) -> Optional[Path]:
    """The newest complete version of ``path`` (itself, or a temporary or old copy an
    interrupted write left beside it), or None; reads only. Raises CheckpointError when
    ``path`` itself is unsealed or damaged and nothing else is complete. ``verify=False``
    checks the manifests' file sizes only, not their hashes (a cheap "is there one?")."""
    path = Path(path)
    found = []
    for p in [path, *leftovers(path)]:
        if p == path or not _owner_alive(p):
            key = _version(p, p == path, verify)
            if key is not None:
                found.append((key, p))
    if found:
        return max(found)[1]
    if path.is_dir():
        # Not something atomic_directory leaves: it puts only sealed directories in place.
        raise CheckpointError(f"{path} is incomplete or damaged (its files do not match {MANIFEST_FILE}): "
                              "delete it to start over")
    return None


def recover_directory(path: Union[str, Path]) -> Optional[Path]:
    """After a crash: put the newest complete version of ``path`` in place
    (:func:`newest_version`), remove every other leftover, and return ``path``; None when no
    complete version exists. Leftovers of a process that still runs are left alone."""
    path = Path(path)
    best = newest_version(path)
    if best is not None and best != path:
        _put_in_place(best, path)
    _remove_leftovers(path)
    return path if best is not None else None


def remove_directory(path: Union[str, Path]) -> None:
    """Delete ``path`` and every leftover of its interrupted writes (starting a run over)."""
    path = Path(path)
    for p in [path, *leftovers(path)]:
        if p == path or not _owner_alive(p):
            _remove(p)


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    """Replace a small file of a run whole (wide.base.fileio.atomic_write_text), then remove what
    writes of it killed earlier left behind."""
    _write_text(path, text)
    _remove_leftovers(path)


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
        "base_model": base_model_id(getattr(model.config, "_name_or_path", None)
                                    or getattr(model, "name_or_path", None)),
        **(extra or {}),
    }
    fine = get_fine(model)
    if fine is not None:
        meta["fine"] = fine.config.to_dict()
    info = {"step": meta["step"]} if "step" in meta else None
    with atomic_directory(path, info) as tmp:
        save_file(tensors, str(tmp / ROUTERS_FILE), metadata={"format": "pt"})
        if fine is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in fine.state_dict().items()},
                      str(tmp / THRESHOLDS_FILE), metadata={"format": "pt"})
        _pause()
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        if write_more is not None:
            write_more(tmp)
    return Path(path)


def read_meta(path) -> dict:
    path = Path(path)
    cfg = path / CONFIG_FILE
    if not path.is_dir():
        # a bare word is most often a mistyped shipped name (those resolve before reaching here)
        hint = ", and is no shipped set's name (wide.pretrained.names() lists them)" if len(path.parts) == 1 else ""
        raise CheckpointError(f"router checkpoint {path} does not exist or is not a directory{hint}")
    if not cfg.is_file() or not (path / ROUTERS_FILE).is_file():
        raise CheckpointError(f"{path} is not a wide router checkpoint: it needs {CONFIG_FILE} and {ROUTERS_FILE}")
    try:
        meta = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON (corrupt checkpoint?): {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{cfg} holds a {type(meta).__name__}, not the object wide writes (corrupt checkpoint?)")
    missing = [k for k in REQUIRED_META if not isinstance(meta.get(k), dict)]
    if missing:
        raise CheckpointError(f"{cfg} lacks {', '.join(repr(k) for k in missing)} (corrupt or not written by wide?)")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer wide (format {meta['format_version']})")
    return meta


def config_differences(saved: dict, config: WideConfig) -> dict:
    """``{field: (saved value, value in config)}`` for each WideConfig field that differs, except
    those that only set where training started (``START_ONLY``: trained routers are the same
    function whatever their start)."""
    now = config.to_dict()
    saved = with_predating(saved)  # a field a file predates is what wide did before it
    return {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k] and k not in START_ONLY}


def verify_manifest(path, required: bool = True) -> None:
    """Refuse a directory whose files no longer match the sha256 manifest it was sealed with
    (bytes overwritten in place keep the size but not the hash), and, unless ``required`` is
    False, one without a manifest: every directory wide writes is sealed, and without the record
    nothing tells damaged weights from the ones written (16 flipped bytes of a shipped set's
    routers loaded without a word, at 5 % worse perplexity). A directory whose files are the
    ones meant (written before manifests, or edited on purpose) is sealed as it is with
    :func:`seal` (``wide seal``)."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        if required:
            raise CheckpointError(f"{path} has no {MANIFEST_FILE}, the sha256 record every router directory is "
                                  "written with, so damaged files would load unnoticed: restore it from where the "
                                  "directory came from or, if its files are the ones meant (a directory from before "
                                  f"manifests, or edited on purpose), seal them as they are with `wide seal {path}`")
        return
    if read_manifest(path) is not None:
        return
    bad = "its manifest"
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
        bad = next((rel for rel, want in files.items() if not (path / rel).is_file()
                    or (path / rel).stat().st_size != want["size"] or sha256_file(path / rel) != want["sha256"]),
                   bad)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    raise CheckpointError(f"{path} does not match its {MANIFEST_FILE}: {bad} is corrupt or was changed after the "
                          "directory was written; restore it or write the directory again")


def seal(path) -> Path:
    """Write the sha256 manifest of a router directory that has none, so that from now on its
    files load only as they are now: the explicit step that vouches for a directory written
    before manifests or edited on purpose. Refuses a directory that has a manifest (one its
    files fail means they changed: delete it first if the files as they are now are meant)."""
    path = Path(path)
    read_meta(path)
    if (path / MANIFEST_FILE).exists():
        match = "match it" if read_manifest(path) is not None else "do not match it (delete it to seal them as they are)"
        raise CheckpointError(f"{path} is sealed already: its files {match}")
    _seal(path, None)
    return path


def shape_differences(meta: dict, hf_config) -> str:
    """How the model shape recorded in a router directory's metadata differs from a transformers
    config's ("num_layers: checkpoint 2 vs model 3, ..."); empty when they agree."""
    saved = meta["model"]
    actual = asdict(ModelDims.from_hf_config(hf_config))
    return ", ".join(f"{k}: checkpoint {saved.get(k)} vs model {v}" for k, v in actual.items() if saved.get(k) != v)


def _default_model_dir(p: Path) -> bool:
    """Whether ``p`` is wide's own copy of the default model (wide.data.fetch_default_model)."""
    from ..data import MODEL_NAME

    return p.name == MODEL_NAME and (p / "wide_source.json").is_file()


def base_model_id(name_or_path) -> Optional[str]:
    """How a router directory names the model it was trained on: the default model's name for
    wide's copy of it (every machine gets its own, wherever its cache is), an existing directory
    as an absolute path (a relative one means nothing from another working directory), anything
    else (a hub id) as given; None when the model does not say."""
    from ..data import MODEL_NAME

    if not name_or_path:
        return None
    p = Path(str(name_or_path)).expanduser()
    if p.is_dir():
        return MODEL_NAME if _default_model_dir(p) else str(p.resolve())
    return str(name_or_path)


def recorded_base_model(path) -> tuple:
    """(id, directory) of the base model recorded in router directory ``path``: the id as
    :func:`base_model_id` gives it, and the local directory that holds it (None for the default
    model, which wide fetches, and for a model that is not here). A relative path, which
    checkpoints recorded before absolute ones, is looked for beside the router directory's
    parents, nearest first, then in the working directory; a directory named like the default
    model that is not here is wide's copy on the machine that trained them (the shipped routers)."""
    from ..data import MODEL_NAME

    recorded = read_meta(path).get("base_model")
    if not recorded or recorded == MODEL_NAME:
        return (recorded or None), None
    p = Path(recorded).expanduser()
    candidates = [p] if p.is_absolute() else [*(d / p for d in Path(path).resolve().parents), Path.cwd() / p]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is not None:
        return base_model_id(found), (None if _default_model_dir(found) else found.resolve())
    return (MODEL_NAME if p.name == MODEL_NAME else recorded), None


def load(model, path, *, check_base: bool = True, require_manifest: bool = True):
    """Wrap ``model`` with the routers saved in ``path`` (or load them into an already
    wrapped model with the same config), with their per-element thresholds where the directory
    has them. Refuses routers made for another model shape, and damaged files: files that fail
    the directory's sha256 manifest, and a directory without one unless ``require_manifest=False``
    (:func:`verify_manifest`). Routers of the same shape trained on another model load with a
    :class:`BaseModelWarning` naming both, unless ``check_base=False`` says that model is meant."""
    meta = read_meta(path)
    verify_manifest(path, required=require_manifest)
    desc = shape_differences(meta, model.config)
    if desc:
        raise CheckpointError(f"routers in {path} were trained for a different model ({desc})")
    if check_base:
        trained_on = recorded_base_model(path)[0]
        given = base_model_id(getattr(model.config, "_name_or_path", None))
        if trained_on and given and trained_on != given:
            warnings.warn(f"routers in {path} were trained on {trained_on}, not on {given}, which has the same "
                          "shape: loading them anyway (pass that model on purpose with check_base=False, or "
                          "wide.from_pretrained(..., base_model=...))", BaseModelWarning, stacklevel=2)
    try:
        config = WideConfig.from_dict(meta["wide_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(path) / CONFIG_FILE} holds an invalid WideConfig: {e}") from e
    if hasattr(model, "wide_state"):
        diffs = config_differences(meta["wide_config"], model.wide_state.config)
        if diffs:
            desc = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in diffs.items())
            raise CheckpointError(f"model is wrapped with a different WideConfig than {path} ({desc})")
    else:
        wrap(model, config)
    try:
        tensors = load_file(str(Path(path) / ROUTERS_FILE))
    except Exception as e:  # safetensors' error type moved between releases
        raise CheckpointError(f"{Path(path) / ROUTERS_FILE} is corrupt or unreadable: {e}") from e
    device = next(model.parameters()).device  # sparse_target='none' has no router parameter
    try:
        model.wide_routers.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"router tensors in {path} do not match the config: {e}") from e
    if "fine" in meta:
        load_thresholds(model, path, meta["fine"])
    return model


def load_thresholds(model, path, saved_config: dict) -> None:
    """The per-element thresholds of ``path`` into ``model`` (attached first if the model has
    none), each defect refused with one error naming the file: a config wide cannot read, a
    missing or unreadable file, a threshold count that does not match the model, NaN."""
    file = Path(path) / THRESHOLDS_FILE
    try:
        config = FineConfig.from_dict(saved_config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(path) / CONFIG_FILE} holds an invalid per-element sparsity config: {e}") from e
    if not file.is_file():
        raise CheckpointError(f"{path} records per-element thresholds but has no {THRESHOLDS_FILE}")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # safetensors' error type moved between releases
        raise CheckpointError(f"{file} is corrupt or unreadable: {e}") from e
    fine = get_fine(model)
    if fine is None:
        fine = attach(model, config)
    elif fine.config != config:
        raise CheckpointError(f"model has per-element sparsity configured otherwise than {path}")
    want = fine.state_dict()
    if set(tensors) != set(want):
        raise CheckpointError(f"{file} holds {sorted(tensors)}, the model's per-element sparsity needs {sorted(want)}")
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise CheckpointError(f"{file}: {k} has shape {tuple(v.shape)} but this model needs {tuple(want[k].shape)} "
                                  "(thresholds for another model?)")
        if v.is_floating_point() and torch.isnan(v).any():
            raise CheckpointError(f"{file}: {k} holds NaN")
    fine.load_state_dict({k: v.to(want[k].device) for k, v in tensors.items()})
    try:
        fine.check(get_state(model).geometry.dims, where=str(file))
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def resolve_base_model(path, base_model=None, **hf_kwargs):
    """The model a checkpoint applies to: ``base_model`` itself, a local HF directory to load,
    or (None) the model recorded in the checkpoint at save time (:func:`recorded_base_model`),
    which must be here: a hub lookup is never tried for it."""
    if base_model is None:
        from ..data import MODEL_NAME, fetch_default_model

        trained_on, directory = recorded_base_model(path)
        if not trained_on:
            raise CheckpointError(f"{path} records no base model: pass base_model=")
        if directory is None and trained_on != MODEL_NAME:
            raise CheckpointError(f"routers in {path} were trained on {trained_on}, which is not a model directory "
                                  "here: pass base_model= (the model, or its directory)")
        base_model = fetch_default_model() if directory is None else directory
    if isinstance(base_model, (str, Path)):
        from transformers import AutoModelForCausalLM

        hf_kwargs.setdefault("dtype", torch.float32)
        base_model = AutoModelForCausalLM.from_pretrained(str(base_model), **hf_kwargs)
    return base_model


def from_pretrained(path, base_model=None, *, require_manifest: bool = True, **hf_kwargs):
    """Load base model + routers in one call, like ``PeftModel.from_pretrained``.

    ``base_model`` is a model, a local HF directory, or None to use the model recorded at save
    time; one given here is meant, so another model than the recorded one loads silently.
    ``require_manifest``: as :func:`load`'s.
    """
    return load(resolve_base_model(path, base_model, **hf_kwargs), path, check_base=base_model is None,
                require_manifest=require_manifest)
