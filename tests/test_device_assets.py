"""scripts/device_assets.py: the assets split into as many parts as fit beside the working tree,
and come back whole (sha256 checked), on a fake cache."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mod():
    spec = importlib.util.spec_from_file_location("device_assets", ROOT / "scripts" / "device_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_fits_each_call_and_unpack_restores(tmp_path, monkeypatch):
    mod = _mod()
    cache = tmp_path / "cache"
    gguf = cache / mod.GGUF_REL
    gguf.parent.mkdir(parents=True)
    payload = bytes(range(256)) * 4000  # ~1 MB
    gguf.write_bytes(payload)
    (cache / "wiki").mkdir()
    (cache / "wiki" / "a.txt").write_text("text")
    monkeypatch.setattr(mod, "OUT", tmp_path / "parts")
    monkeypatch.setattr(mod, "tree_bytes", lambda: 0)
    monkeypatch.setattr(mod, "CALL_LIMIT", 2**20 + 400_000)  # room for ~400 kB a part
    installed = []

    def fake_run(cmd, **kw):  # no pip here: record the calls
        installed.append(cmd)

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    mod.pack(cache)
    parts = sorted((tmp_path / "parts").glob("part*"))
    assert len(parts) == 3
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 400_000 + 1000
    gguf.unlink()
    mod.unpack(cache, tmp_path / "parts")
    assert gguf.read_bytes() == payload
    assert (cache / "wiki" / "a.txt").read_text() == "text"
    # a corrupt part is refused
    last = parts[-1] / "gguf.2"
    last.write_bytes(b"x" + last.read_bytes()[1:])
    with pytest.raises(SystemExit, match="corrupt"):
        mod.unpack(cache, tmp_path / "parts")
