"""Sampled token shards (written by wide.commands.sampling_data, ``wide sample-data``): the manifest
format, the tokenizer fingerprint they are tied to, and reading them back with every shard
checked against its sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .assets import AssetError, _verify_sha256

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
