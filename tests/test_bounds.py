"""wide.benchmarks.bounds on the committed results: the bounds it derives must be consistent with
what was measured (a routed engine cannot beat a bound computed from its own parts). And the
plain-read floors those bounds take (wide.benchmarks.read_floors), run on the CPU."""
import json
import os
import pathlib

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from wide.benchmarks import bounds, read_floors  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bounds_from_committed_results(tmp_path):
    res = ROOT / "bench" / "results"
    assert bounds.main(["--results", str(res), "--out", str(tmp_path / "b")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    t, d = b["ttft"], b["tpot"]
    assert 1.0 < t["measured"] <= t["bound"] < t["bound_o_skips"] < t["bound_all_skip"] < 2.0
    assert 1.0 < d["measured"] <= d["bound"] < 2.0
    # the floor per layer is below what the routed GEMVs take now
    assert d["layer_floor_us"] < d["layer_gemv_now_us"]
    assert "TTFT 4k" in (tmp_path / "b.md").read_text()


def test_bounds_missing_inputs(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        bounds.main(["--results", str(tmp_path)])


def test_read_floors_dry_run_writes_rows_bounds_can_read(tmp_path):
    assert read_floors.main(["--dry-run", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "read_floors.json").read_text())
    rows = doc["rows"]
    assert [r["cfg"] for r in rows] == ["CH=4096 w=4", "CH=8192 w=4"]
    # the keys bounds.tpot_floor selects the floors by
    assert all(r["impl"] == "read_floor" and r["shape"] == "read0.0328" for r in rows)
    assert all(r["rel_err"] < 1e-5 and r["us"] > 0 for r in rows)
    assert "wide.benchmarks.read_floors --dry-run" in doc["env"]["command"]
    assert "| read0.0328 | CH=4096 w=4 |" in (tmp_path / "read_floors.md").read_text()


def test_plain_read_sums_whole_chunks_only():
    from wide.kernels.plain_read import plain_read

    w = torch.randn(3 * 1024 + 100, generator=torch.Generator().manual_seed(0))
    out = torch.full((3,), float("nan"))
    plain_read(w, out, 1024, block=256)
    torch.testing.assert_close(out, w[:3072].view(3, 1024).sum(1), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of block"):
        plain_read(w, out, 1000, block=256)
    with pytest.raises(ValueError, match="float32"):
        plain_read(w, torch.empty(4), 1024, block=256)


def test_fine_mode_bound_from_committed_h100_results(tmp_path):
    res = ROOT / "bench" / "results" / "h100"
    assert bounds.main(["--results", str(res), "--modes", str(res / "e2e_modes.json"),
                        "--fine", str(res / "fine_gemv.json"), "--out", str(tmp_path / "b")]) == 0
    f = json.loads((tmp_path / "b.json").read_text())["tpot_fine"]
    # the fine engine cannot beat a bound built from its own parts, nor its GEMVs their read floor
    assert 1.0 < f["measured"] <= f["bound"] < 2.0
    assert f["layer_floor_us"] < f["layer_fine_us"] < f["layer_dense_us"]
    # the kernels' own timings predict the measured step to within 10 %
    assert abs(f["predicted_step_us"] / (f["fine_ms"] * 1e3) - 1) < 0.1
    assert "fine mode" in (tmp_path / "b.md").read_text()


def test_fine_mode_bound_refuses_other_cards_and_half_inputs(tmp_path):
    res = ROOT / "bench" / "results" / "h100"
    with pytest.raises(SystemExit, match="go together"):
        bounds.main(["--results", str(res), "--modes", str(res / "e2e_modes.json")])
    other = json.loads((res / "fine_gemv.json").read_text())
    other["device"] = "NVIDIA H200"
    (tmp_path / "fine.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="one card"):
        bounds.main(["--results", str(res), "--modes", str(res / "e2e_modes.json"),
                     "--fine", str(tmp_path / "fine.json"), "--out", str(tmp_path / "b")])
