"""The end-to-end benchmark runs on tiny models (CPU, interpreter) through the engine's public API
only, for two families in one run, and every record says which model it timed."""

import json
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (alone or in a suite)

from wide.benchmarks import e2e  # noqa: E402


def test_e2e_two_models_tiny(tmp_path):
    argv = ["--tiny", "--model", "llama-3.1-8b,qwen2.5-7b", "--sparsities", "0.5", "--prompt-lens", "16",
            "--batches", "1", "--decode-ctx", "8", "--decode-steps", "2", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["errors"] == [] and meta["models"] == ["llama-3.1-8b", "qwen2.5-7b"]
    recs = meta["records"]
    for model in meta["models"]:
        mine = {(r["op"], r["engine"]): r for r in recs if r["model"] == model}
        assert set(mine) == {(op, eng) for op in ("e2e_ttft", "e2e_tpot") for eng in ("dense", "routed")}
        assert all(r["ms"] > 0 for r in mine.values())
        assert {k: r["routing"] for k, r in mine.items()} == {
            (op, eng): None if eng == "dense" else "token" for op, eng in mine}
        assert mine[("e2e_tpot", "routed")]["speedup"] > 0  # against this model's own dense engine
        # the routed decode's masks, recorded through decode(record=...): about half the groups
        assert 0.2 < mine[("e2e_tpot", "routed")]["active_frac_per_token"] < 0.8
    assert set(meta["realised_sparsity_by_model"]) == set(meta["models"])
    md = (tmp_path / "e2e.md").read_text()
    assert "| model |" in md and "qwen2.5-7b" in md


def test_e2e_default_is_llama_only(tmp_path, monkeypatch):
    # Without --model a run times Llama-3.1-8B alone, and its records read as before, plus the
    # model's name.
    seen = []
    monkeypatch.setattr(e2e, "_bench_model", lambda name, first, *a: seen.append((name, first)))
    assert e2e.main(["--tiny", "--out-dir", str(tmp_path)]) == 0
    assert seen == [("llama-3.1-8b", True)]
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["model"] == "tiny random Llama"
    with pytest.raises(SystemExit):  # argparse's error: not a preset
        e2e.main(["--tiny", "--model", "gpt-9", "--out-dir", str(tmp_path)])


def test_e2e_routings_time_every_batch(tmp_path):
    # Tile routers are timed in prefill and at every decode batch, batch-shared decode at every
    # batch; each record names its rule.
    argv = ["--tiny", "--sparsities", "0.5", "--prompt-lens", "16", "--batches", "1,2", "--routings",
            "token,tile4,tile4prev,batch_shared", "--decode-ctx", "8", "--decode-steps", "2", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["errors"] == []
    got = {(r["op"], r["routing"], r.get("B")) for r in meta["records"] if r["engine"] != "dense"}
    for B in (1, 2):
        assert {("e2e_tpot", rule, B) for rule in ("token", "tile4", "tile4prev", "batch_shared")} <= got
    assert {("e2e_ttft", "tile4", 1), ("e2e_ttft", "tile4prev", 1)} <= got and not any(op == "e2e_ttft" and rule == "batch_shared"
                                                        for op, rule, _ in got)


def test_e2e_routing_names():
    assert e2e.tile_routing("tile16") == (16, "first") and e2e.tile_routing("tile8prev") == (8, "previous")
    assert all(e2e.tile_routing(r) is None for r in ("tile1", "tile", "tileprev", "tile4next", "token"))
    with pytest.raises(SystemExit):
        e2e.main(["--tiny", "--routings", "tile4last"])


def test_profiles_name_their_engine_and_rule():
    # The GPU's --profile tables (per-kernel time of one step) read in the markdown with the
    # engine and rule they profiled, a tile prefill included.
    pr = {"total_us_per_step": 10.0, "launches_per_step": 3.0,
          "top": [{"kernel": "_gemm_k_kernel", "us_per_step": 6.0, "launches_per_step": 2.0}]}
    meta = {"device": "GPU", "torch": "t", "triton": "t", "date": "d", "model": "m", "routers": "r", "command": "c",
            "records": [], "profile": {"routed prefill 4096": pr, "routed tile16 prefill 4096": pr,
                                       "routed batch_shared decode B=32": pr, "dense": pr}}
    md = e2e.markdown(meta)
    assert "B=1 prefill of 4096 tokens, routed engine:" in md
    assert "B=1 prefill of 4096 tokens, routed tile16 engine:" in md
    assert "Eager B=32 decode step, routed batch_shared engine:" in md
    assert "Eager B=1 decode step, dense engine:" in md


def test_kernel_choices_read_per_routing():
    # Each routing's engine measures its own cuBLAS-or-routed choices; the markdown keeps them
    # apart (one list per routing) and stays one plain list for a token-only run.
    meta = {"device": "GPU", "torch": "t", "triton": "t", "date": "d", "model": "m", "routers": "r", "command": "c",
            "records": [], "k_choices": [
                {"op": "q", "N": 8, "K": 8, "T_bucket": 1, "routing": "token", "impl": "routed"},
                {"op": "q", "N": 8, "K": 8, "T_bucket": 1, "routing": "tile16", "impl": "cublas"}]}
    md = e2e.markdown(meta)
    assert "- token: q 8x8 T<=1: routed" in md and "- tile16: q 8x8 T<=1: cublas" in md
    meta["k_choices"] = meta["k_choices"][:1]
    md = e2e.markdown(meta)
    assert "\nq 8x8 T<=1: routed\n" in md and "- token" not in md


def test_e2e_group_sizes(tmp_path):
    # Finer groups than the defaults (experiments/results/group_size_cpu) time through the same kernels;
    # the results say which sizes they timed.
    argv = ["--tiny", "--sparsities", "0.5", "--prompt-lens", "16", "--batches", "1", "--ffn-group-size", "16",
            "--attn-group-size", "1", "--decode-ctx", "8", "--decode-steps", "2", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["errors"] == []
    assert (meta["ffn_group_size"], meta["attn_group_size"]) == (16, 1)
    assert "FFN groups of 16 channels, attention groups of 1 head" in meta["routers"]
    routed = [r for r in meta["records"] if r["engine"] == "routed" and r["op"] == "e2e_tpot"]
    assert routed and 0.2 < routed[0]["active_frac_per_token"] < 0.8
