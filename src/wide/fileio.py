"""Small file helpers shared by the asset cache (data), checkpoints (serialization) and
sampled-data shards: one sha256 and one whole-file text replacement."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Union


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    """Replace ``path`` whole, durably: a kill leaves the old text or the new one, never half.
    The temporary sibling is ``.NAME.tmp-PID-*``, the pattern of wide's leftover cleanup
    (wide.serialization.leftovers)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(part, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
