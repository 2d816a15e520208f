"""The end-to-end benchmark's correctness checks run on a tiny model (CPU, interpreter)."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (alone or in a suite)

from wide.benchmarks import e2e  # noqa: E402


def test_e2e_checks_only_tiny(tmp_path):
    assert e2e.main(["--tiny", "--checks-only", "--out-dir", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    names = [c["check"] for c in meta["checks"]]
    assert any("fp32 masked model" in n for n in names)
    assert any("RMSNorm+router kernel" in n for n in names)
    assert any("router finished inside the q and gate/up GEMVs" in n for n in names)
    assert all(c["ok"] and c["rel_err"] < 1e-4 for c in meta["checks"])  # fp32 on the CPU: exact
    assert meta["precision"][0]["routed_vs_fp32"] < 1e-4
    assert "Precision, first" in (tmp_path / "e2e.md").read_text()
