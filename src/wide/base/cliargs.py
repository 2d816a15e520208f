"""Command-line options generated from dataclass fields, the way PEFT's and transformers'
config fields carry their own help: ``field(default=..., metadata={"help": ...})``. The
default lives in the dataclass alone; the parser reads it from there and :func:`from_args`
builds the dataclass back from the parsed namespace.

A field is an option when its metadata has ``help``. Other metadata keys: ``flag`` (the
option string, default ``--field-name``), ``choices`` and ``nargs`` (passed to argparse), and
the field's range: ``min`` / ``max`` (inclusive), ``gt`` / ``lt`` (exclusive). The parser
refuses a value outside the range, and a float that is not finite (inf, nan), naming the flag,
before any command runs; the dataclass itself checks the same with :func:`check_fields`.
The option's ``dest`` is argparse's own for the flag (``--target`` -> ``args.target``), so
the namespace keeps the names the commands have always read.

transformers' ``HfArgumentParser`` does the same from a whole parser, but it names options
after the fields (``--target_sparsity`` and ``--target-sparsity``) and turns booleans into
``--flag [BOOL]``; the flags users type must stay as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from typing import Any, Iterable, Optional


def options(cls) -> list:
    """The fields of ``cls`` that are command-line options."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def dest(f: dataclasses.Field) -> str:
    return flag(f).lstrip("-").replace("-", "_")


def flag_of(dest: str) -> str:
    """The flag of an argparse dest: every dest here is argparse's own for its flag."""
    return "--" + dest.replace("_", "-")


def default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default, so it cannot be an optional flag")


RANGE_KEYS = ("min", "max", "gt", "lt")
FLOAT32_MAX = 3.4028234663852886e38


def range_error(value, *, min=None, max=None, gt=None, lt=None) -> Optional[str]:
    """Why ``value`` is outside the range ("must lie in [0, 1]"), or None when it is inside.
    A float must also be finite, and within float32's range: inf passes every lower bound, and no
    option means either."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        # the models, optimiser steps and thresholds are float32: --lr 1e300 passed every range
        # and overflowed inside AdamW's step with a traceback
        return "must lie within float32's range (|x| <= 3.4e38)"
    lo = (min, "[") if min is not None else (gt, "(") if gt is not None else None
    hi = (max, "]") if max is not None else (lt, ")") if lt is not None else None
    inside = ((min is None or value >= min) and (gt is None or value > gt)
              and (max is None or value <= max) and (lt is None or value < lt))
    if inside:
        return None
    if lo and hi:
        return f"must lie in {lo[1]}{lo[0]}, {hi[0]}{hi[1]}"
    if lo:
        return f"must be {'>=' if lo[1] == '[' else '>'} {lo[0]}"
    return f"must be {'<=' if hi[1] == ']' else '<'} {hi[0]}"


def bounded(kind, **limits):
    """An argparse ``type`` that converts with ``kind`` and refuses values outside ``limits``
    (``min``, ``max``, ``gt``, ``lt``) and, for floats, inf and nan; argparse then names the
    flag in its error."""
    def convert(text):
        value = kind(text)
        why = range_error(value, **limits)
        if why:
            raise argparse.ArgumentTypeError(f"{why}, got {text}")
        return value

    convert.__name__ = kind.__name__  # argparse's "invalid int value" names the type so
    return convert


def check_fields(obj) -> None:
    """Raise ValueError when a field of dataclass ``obj`` lies outside its declared range or
    choices (the same declarations the parser enforces)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        limits = {k: f.metadata[k] for k in RANGE_KEYS if k in f.metadata}
        for v in value if isinstance(value, (list, tuple)) else [value]:  # nargs: each value
            why = range_error(v, **limits) if limits or isinstance(v, float) else None
            if why:
                raise ValueError(f"{f.name} {why}, got {v}")
        choices = f.metadata.get("choices")
        if choices is not None:
            values = value if "nargs" in f.metadata else [value]
            bad = [v for v in values if v not in choices]
            if bad:
                raise ValueError(f"{f.name} must be one of {tuple(choices)}, got {bad[0]!r}")


def _value_type(hint):
    """The type argparse converts one value to: Optional[X] -> X, list[X] / tuple[X, ...] -> X,
    a bare list or tuple -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    if args:
        if len(args) != 1:
            raise TypeError(f"cannot make a command-line option of type {hint}")
        return _value_type(args[0])
    return str if hint in (list, tuple) else hint


def add_fields(container, cls, *, only: Optional[Iterable[str]] = None, skip: Iterable[str] = (),
               defaults: Optional[dict] = None) -> None:
    """Add the options of dataclass ``cls`` to ``container`` (a parser or an argument group).

    ``only`` / ``skip`` select fields by name; ``defaults`` gives some of them another default
    on this command (stage 2's learning rate, say): the one place that value is declared.
    """
    fields = {f.name: f for f in options(cls)}
    only = list(fields) if only is None else list(only)
    skip, defaults = set(skip), dict(defaults or {})
    unknown = (set(only) | skip | set(defaults)) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no command-line fields {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    for name in fields:
        if name not in only or name in skip:
            continue
        f = fields[name]
        value = defaults.get(name, default(f))
        kind = _value_type(hints[name])
        text = f.metadata["help"]
        kw = {key: f.metadata[key] for key in ("choices", "nargs") if key in f.metadata}
        limits = {k: f.metadata[k] for k in RANGE_KEYS if k in f.metadata}
        if kind is bool:
            if value is not False:
                raise TypeError(f"{cls.__name__}.{name}: a boolean option must default to False (store_true)")
            kw["action"] = "store_true"
        else:
            kw["type"] = bounded(kind, **limits) if limits or kind is float else kind
            if value is not None and "(default" not in text:
                text += " (default: %(default)s)"
        container.add_argument(flag(f), dest=dest(f), default=value, help=text, **kw)


def from_args(cls, args, **overrides):
    """``cls`` built from a parsed namespace: each option the parser had gives its value, the
    other fields keep the dataclass's defaults, and ``overrides`` win over both."""
    values = {f.name: getattr(args, dest(f)) for f in options(cls) if hasattr(args, dest(f))}
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(with_flags(cls, str(e))) from None


def with_flags(cls, text: str) -> str:
    """A message that names fields of dataclass ``cls`` (its own checks', or code reading it)
    with the flags the user typed instead. Names with an underscore only: a short name like "r"
    would also match ordinary words."""
    for f in options(cls):
        if "_" in f.name:
            text = re.sub(rf"\b{f.name}\b", flag(f), text)
    return text


__all__ = ["add_fields", "from_args", "with_flags", "options", "flag", "dest", "flag_of", "default", "bounded",
           "check_fields", "range_error", "RANGE_KEYS"]
