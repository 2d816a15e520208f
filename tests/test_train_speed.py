"""The stage-1 throughput benchmark (wide.benchmarks.train_speed) in its CPU smoke mode."""

import json

from wide.benchmarks import train_speed
from wide.cli import main


def test_tiny_smoke_run_reports_every_configuration(tmp_path, capsys):
    out = tmp_path / "speed"
    assert train_speed.main(["--tiny", "--steps", "2", "--warmup", "1", "--batch-size", "2", "3", "--seq-len", "16",
                             "--loss", "ce", "kd", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["model"] == "tiny" and doc["device"] == "cpu"
    got = [(r["loss"], r["amp"], r["batch_size"]) for r in doc["records"]]
    assert got == [("ce", "none", 2), ("ce", "none", 3), ("kd", "none", 2), ("kd", "none", 3)]
    for r in doc["records"]:
        assert r["tokens_per_s"] > 0 and r["steps_timed"] == 2 and r["tokens_per_step"] == r["batch_size"] * 16
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert abs(r["step_s"] * r["tokens_per_s"] - r["tokens_per_step"]) < 1e-6 * r["tokens_per_step"]
    md = out.with_suffix(".md").read_text()
    assert "| kd | none | 3 x 16 |" in md


def test_bench_command_runs_it(tmp_path):
    assert main(["bench", "train_speed", "--tiny", "--steps", "1", "--warmup", "0", "--batch-size", "2",
                 "--seq-len", "8", "--loss", "mix", "--amp", "bf16", "--out", str(tmp_path / "s")]) == 0
    rec = json.loads((tmp_path / "s.json").read_text())["records"][0]
    assert (rec["loss"], rec["amp"]) == ("mix", "bf16") and rec["tokens_per_s"] > 0
