"""bench/bounds.py on the committed results: the bounds it derives must be consistent with what
was measured (a routed engine cannot beat a bound computed from its own parts)."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bounds():
    spec = importlib.util.spec_from_file_location("bounds", ROOT / "bench" / "bounds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bounds_from_committed_results(tmp_path):
    res = ROOT / "bench" / "results"
    assert _bounds().main(["--results", str(res), "--out", str(tmp_path / "b")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    t, d = b["ttft"], b["tpot"]
    assert 1.0 < t["measured"] <= t["bound"] < t["bound_o_skips"] < t["bound_all_skip"] < 2.0
    assert 1.0 < d["measured"] <= d["bound"] < 2.0
    # the floor per layer is below what the routed GEMVs take now
    assert d["layer_floor_us"] < d["layer_gemv_now_us"]
    assert "TTFT 4k" in (tmp_path / "b.md").read_text()


def test_bounds_missing_inputs(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        _bounds().main(["--results", str(tmp_path)])
