"""Small file helpers shared by the asset cache (data), checkpoints (serialization) and
sampled-data shards: one sha256, one whole-file replacement (text, or any writer's file), and the
mode the umask gives."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import Union


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def umask_mode(directory: bool = False) -> int:
    """The mode the process umask gives a new file (``0o666 & ~umask``) or directory (``0o777 &
    ~umask``): 0644 / 0755 under the usual 022. What outputs get, whatever a library that wrote
    them chose (safetensors writes 0600). Read from /proc on Linux: setting the umask to read it
    would change it for every thread for an instant."""
    try:
        with open("/proc/self/status") as f:
            mask = int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    """Replace ``path`` whole, durably: a kill leaves the old text or the new one, never half.
    The temporary sibling is ``.NAME.tmp-PID-*``, the pattern of wide's leftover cleanup
    (wide.io.serialization.leftovers)."""
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


@contextlib.contextmanager
def atomic_output(path: Union[str, Path], *, prefix: str = "", suffix: str = ".part"):
    """Yield a temporary sibling of ``path`` for a writer that takes a file name; when the block
    ends without an error it gets the umask's mode (mkstemp's 0600 would stay: token caches and
    shards are outputs other users read) and replaces ``path`` whole; on an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
