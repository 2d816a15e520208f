"""Decontamination: calibration documents that share a 13-word sequence with the held-out text
or with any zero-shot task are dropped before packing (:func:`calibration_documents`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..base.fileio import atomic_write_text
from .assets import _cache
from .packing import _atomic_save_npy, _load_npy
from .shards import TokenDocuments, is_token_shards, read_token_shards
from .sources import BUILTIN_SOURCES, _document_pairs
from .zero_shot import EVAL_PACKAGE, ZERO_SHOT_TASKS, load_zero_shot

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
