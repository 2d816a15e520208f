"""Routers shipped inside the package, loadable by name.

    import wide
    model = wide.from_pretrained("smollm2-135m-50")     # default model + shipped routers
    wide.load(my_smollm2, "smollm2-135m-25")              # onto a model already in hand
    wide.pretrained.names()                               # what is shipped
    wide.pretrained.provenance("smollm2-135m-50")         # command, commit, tokens, metrics

Each name is a router directory under ``wide/shipped/`` exactly as ``wide calibrate`` wrote it
(routers, config, sha256 manifest) plus ``provenance.json``, written by
``scripts/ship_routers.py`` from the results folder that measured it. The command line takes
the same names wherever it takes ``--routers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from . import serialization
from .serialization import CheckpointError, read_manifest

SHIPPED = Path(__file__).resolve().parents[1] / "shipped"
PROVENANCE_FILE = "provenance.json"


def names() -> list:
    """The shipped router sets, sorted."""
    if not SHIPPED.is_dir():
        return []
    return sorted(p.name for p in SHIPPED.iterdir() if (p / PROVENANCE_FILE).is_file())


def is_shipped(name_or_path) -> bool:
    """True for a shipped name that no local directory of the same name shadows."""
    return isinstance(name_or_path, str) and name_or_path in names() and not Path(name_or_path).exists()


def path(name: str) -> Path:
    """The directory of a shipped router set."""
    if name not in names():
        raise CheckpointError(f"no shipped routers named {name!r}; shipped: {', '.join(names()) or 'none'}")
    return SHIPPED / name


def resolve(name_or_path: Union[str, Path]) -> Union[str, Path]:
    """A shipped name as its directory, checked against its manifest; anything else unchanged
    (a local directory of the same name wins)."""
    if not is_shipped(name_or_path):
        return name_or_path
    verify(name_or_path)
    return path(name_or_path)


def name_of(directory) -> Union[str, None]:
    """The shipped name of a directory under wide/shipped/, else None."""
    d = Path(directory).resolve()
    return d.name if d.parent == SHIPPED and d.name in names() else None


def provenance(name: str) -> dict:
    """How the shipped routers were made and what they measured (provenance.json)."""
    return json.loads((path(name) / PROVENANCE_FILE).read_text())


def verify(name: str) -> None:
    """Refuse a shipped directory whose files no longer match its sha256 manifest (a damaged
    installation), naming the name."""
    if read_manifest(path(name)) is None:
        raise CheckpointError(f"shipped routers {name!r} in {path(name)} fail their sha256 manifest: "
                              "reinstall wide")


def base_model_for(name_or_path, base_model=None):
    """The base model to load routers onto: ``base_model`` when given, else the default model
    for shipped routers, else None (the directory recorded in the checkpoint)."""
    if base_model is None and is_shipped(name_or_path):
        from ..data import fetch_default_model

        return fetch_default_model()
    return base_model


def load(model, name_or_path, *, check_base: bool = True, require_manifest: bool = True):
    """``wide.load``: routers from a directory or a shipped name onto ``model`` (warning when
    they were trained on another model of its shape, unless ``check_base=False``; a directory
    without its sha256 manifest is refused unless ``require_manifest=False``)."""
    return serialization.load(model, resolve(name_or_path), check_base=check_base,
                              require_manifest=require_manifest)


def from_pretrained(name_or_path, base_model=None, *, require_manifest: bool = True, **hf_kwargs):
    """``wide.from_pretrained``: base model + routers in one call, like
    ``PeftModel.from_pretrained``. ``name_or_path`` is a router directory or the name of shipped
    routers (:func:`names`, e.g. "smollm2-135m-50"); ``base_model`` is a model, a local HF
    directory, or None: the default model for shipped routers, else the directory recorded at
    save time."""
    return serialization.from_pretrained(resolve(name_or_path), base_model_for(name_or_path, base_model),
                                         require_manifest=require_manifest, **hf_kwargs)
