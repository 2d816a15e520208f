"""Packing: documents tokenised once (the token stream cached on disk, keyed by the tokenizer
and the exact text), joined by the separator token and cut into non-overlapping windows."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..base.fileio import atomic_output
from .assets import _cache
from .shards import TokenDocuments

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
    with atomic_output(path, suffix=".npy") as tmp:
        np.save(tmp, array)


def _token_stream(docs: Sequence[np.ndarray], sep: int) -> np.ndarray:
    """Token documents joined as text documents are: each followed by the separator."""
    pieces = []
    sep_arr = np.array([sep], dtype=np.int64)
    for d in docs:
        pieces.append(np.asarray(d, dtype=np.int64))
        pieces.append(sep_arr)
    return np.concatenate(pieces)
