"""The end-to-end benchmark runs on tiny models (CPU, interpreter) through the engine's public API
only, for two families in one run, and every record says which model it timed."""

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (alone or in a suite)

from wide.benchmarks import e2e  # noqa: E402


@pytest.fixture
def once(monkeypatch):
    """--tiny runs at half the benchmark's tiny widths and with one decoder layer, each timed
    prefill and decode loop run once without a warm-up. These tests read what the benchmark
    records, not its times (wide.base.timing's tests check reps and warm-ups), and under the
    interpreter every extra run, column or layer is paid for in whole decode steps; the kernels'
    and the engine's own tests cover the shapes and the layers (tests/test_inference.py and
    tests/test_engine_*.py run two)."""
    import wide.base.timing

    real = wide.base.timing.step_time_s
    calls = []

    def step_time_s(fn, reps, warmup=1, device="cuda"):
        calls.append((reps, warmup))
        return real(fn, reps=1, warmup=0, device=device)

    monkeypatch.setattr(wide.base.timing, "step_time_s", step_time_s)
    for key in ("vocab_size", "hidden_size", "intermediate_size"):
        monkeypatch.setitem(e2e.TINY, key, e2e.TINY[key] // 2)
    monkeypatch.setitem(e2e.TINY, "num_hidden_layers", 1)
    return calls


def test_e2e_two_models_tiny(tmp_path, once):
    argv = ["--tiny", "--model", "llama-3.1-8b,qwen2.5-7b", "--sparsities", "0.5", "--prompt-lens", "16",
            "--batches", "1", "--decode-ctx", "8", "--decode-steps", "2", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    assert once, "the benchmark no longer times through wide.base.timing.step_time_s: update the fixture"
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


def test_e2e_routings_time_every_batch(tmp_path, once):
    # Tile routers are timed in prefill and at every decode batch, batch-shared decode at every
    # batch; each record names its rule. One decode step per timed loop: no share of active
    # groups is read here (two steps' masks make one), and the steps after the first run the
    # same engine calls (tests/test_engine_routing.py covers steps inside a tile).
    argv = ["--tiny", "--sparsities", "0.5", "--prompt-lens", "16", "--batches", "1,2", "--routings",
            "token,tile4,tile4prev,batch_shared", "--decode-ctx", "8", "--decode-steps", "1", "--reps", "1", "--no-hf",
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


def test_attention_share_counts_the_attention_kernels_of_both_engines():
    # The engine's split-K decode and its combine, and SDPA's kernels, are attention; GEMMs,
    # GEMVs, norms and RoPE are not. The share reads in the TPOT table where it was measured.
    attn = ["_decode_split_kernel", "_decode_combine_kernel", "void pytorch_flash::flash_fwd_splitkv_kernel<...>",
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "fmha_cutlassF_bf16_aligned_64x128_rf_sm80"]
    other = ["_gemm_k_kernel", "_fine_gemv_kernel", "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "_norm_route_kernel",
             "_rope_decode_kernel", "_silu_mul_kernel", "void at::native::elementwise_kernel<...>"]
    assert all(e2e.ATTENTION_KERNELS.search(k) for k in attn)
    assert not any(e2e.ATTENTION_KERNELS.search(k) for k in other)
    meta = {"device": "GPU", "torch": "t", "triton": "t", "date": "d", "model": "m", "routers": "r", "command": "c",
            "records": [{"op": "e2e_tpot", "B": 8, "prompt_len": 16384, "engine": "dense", "sparsity": None,
                         "ms": 9.0, "attn_share": 0.42},
                        {"op": "e2e_tpot", "B": 1, "prompt_len": 4096, "engine": "dense", "sparsity": None, "ms": 5.0}]}
    md = e2e.markdown(meta)
    assert "| 8 | 16384 | dense | - | 9.000 | - | - | - | - | 42% |" in md
    assert "| 1 | 4096 | dense | - | 5.000 | - | - | - | - | - |" in md and "Attention share:" in md


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


def test_e2e_group_sizes(tmp_path, once):
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


def test_e2e_heads_beside_thresholds(tmp_path):
    # --heads R (issue 48): attention-only routers under skip_upto (layer 0 dense) at R per routed
    # layer, the hybrid's thresholds at the target itself; the records say so
    argv = ["--tiny", "--modes", "hybrid", "--heads", "0.25", "--sparsities", "0.5", "--prompt-lens", "16",
            "--batches", "1", "--decode-ctxs", "12", "--decode-steps", "1", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path), "--name", "heads"]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "heads.json").read_text())
    assert meta["errors"] == [] and meta["heads"]["attn_rule"] == "skip_upto"
    assert meta["hybrid_split"] == {"0.5": {"router_sparsity": 0.25, "fine_sparsity": 0.5}}
    rates = meta["realised_sparsity"]["0.5"]
    assert rates["ffn_rate"] is None and 0 < rates["attn_core_rate"] < 0.25
    hyb = [r for r in meta["records"] if r["mode"] == "hybrid"]
    assert len(hyb) == 2 and all(r["routing"].startswith("skip_upto") and r["router_sparsity"] == 0.25
                                 and r["fine_sparsity"] == 0.5 for r in hyb)
    assert "attention core" in (tmp_path / "heads.md").read_text()
    with pytest.raises(SystemExit):
        e2e.main(argv + ["--hybrid-router-sparsity", "0.2"])


def test_e2e_modes_carry_mode_and_split(tmp_path, once):
    # Fine and hybrid beside coarse, against the dense engine at each decode context; thresholds
    # from a calibration pass on random tokens (no trained weights); every record names its mode.
    argv = ["--tiny", "--modes", "coarse,fine,hybrid", "--sparsities", "0.5", "--prompt-lens", "16", "--batches", "1",
            "--decode-ctxs", "8,12", "--decode-steps", "1", "--reps", "1", "--no-hf", "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["errors"] == [] and meta["modes"] == ["dense", "coarse", "fine", "hybrid"]
    recs = meta["records"]
    assert {(r["op"], r["mode"], r["prompt_len"]) for r in recs} == {
        *(("e2e_ttft", m, 16) for m in ("dense", "coarse", "fine", "hybrid")),
        *(("e2e_tpot", m, c) for m in ("dense", "coarse", "fine", "hybrid") for c in (8, 12))}
    for r in recs:
        assert r["engine"] == {"coarse": "routed"}.get(r["mode"], r["mode"])
        assert r["routing"] == ("token" if r["mode"] in ("coarse", "hybrid") else None)
        if r["mode"] != "dense":  # timed in turns with the dense engine (CPU: both caches fit)
            assert r["speedup"] > 0 and r["dense_ms"] > 0
            assert r["dense_ms"] == r["paired_dense_ms"] and r["speedup"] == r["dense_ms"] / r["ms"]
        if r["mode"] in ("fine", "hybrid"):  # the linear MACs kept: 1 - target
            assert abs((1 - r["router_sparsity"]) * (1 - r["fine_sparsity"]) - 0.5) < 1e-9
    for r in recs:
        if r["op"] == "e2e_tpot" and r["mode"] == "fine":  # thresholds at half of every input, read by the GEMVs
            assert 0.35 < r["active_frac_per_token"] < 0.65
            assert r["active_frac_per_token"] <= r["weight_bytes_frac_kernel"] == r["weight_bytes_frac_union"] < 1
    assert "Hybrid at 0.5: routers at 0.293" in (tmp_path / "e2e.md").read_text()


def test_e2e_mode_options_refused():
    with pytest.raises(SystemExit):
        e2e.main(["--tiny", "--modes", "coarse,teal"])
    with pytest.raises(SystemExit):  # routers alone past the target
        e2e.main(["--tiny", "--modes", "hybrid", "--sparsities", "0.5", "--hybrid-router-sparsity", "0.6"])
    assert e2e.hybrid_split(0.5, 0.25) == (0.25, 1 - 0.5 / 0.75)


def test_fine_bytes_fraction_reads_the_union_up_to_the_gemv_limit():
    # one layer-less model's shares: q reads 0.5 of its rows for the batch, one token 0.25
    class Cfg:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads = 8, 16, 2, 1
        num_hidden_layers, vocab_size = 1, 4

    class Head:
        weight = torch.zeros(1, dtype=torch.bfloat16)

    class M:
        config, lm_head = Cfg, Head

    shares = {p: torch.tensor([0.5, 0.25]) for p in ("q", "k", "v", "o", "gate", "up", "down")}
    recs = [(0, 0, p, s) for p, s in shares.items()]
    wb = e2e.weight_bytes(M)
    layers = wb["q"] + wb["o"] + wb["kv"] + wb["gate_up"] + wb["down"]
    out = e2e.fine_bytes_fraction(M, recs, 1, "fine")
    assert out["weight_bytes_frac_union"] == pytest.approx((0.5 * layers + wb["lm_head"]) / (layers + wb["lm_head"]))
    assert out["active_frac_per_token"] == pytest.approx(0.25)
    assert out["weight_bytes_frac_kernel"] == out["weight_bytes_frac_union"]
    assert e2e.fine_bytes_fraction(M, recs, 8, "fine")["weight_bytes_frac_kernel"] == 1.0  # GEMMs on every row


def test_e2e_fine_sums_timed_both_ways(tmp_path, once):
    # --fine-sums fp32,rounded: the fine engine's decode timed with each (records of their own,
    # fine_sums in each); its prefill, the dense one's either way, once.
    argv = ["--tiny", "--modes", "fine", "--fine-sums", "fp32,rounded", "--sparsities", "0.5", "--prompt-lens", "16",
            "--batches", "1", "--decode-ctxs", "8", "--decode-steps", "1", "--reps", "1", "--no-hf",
            "--out-dir", str(tmp_path)]
    assert e2e.main(argv) == 0
    meta = json.loads((tmp_path / "e2e.json").read_text())
    assert meta["errors"] == [] and meta["fine_sums"] == ["fp32", "rounded"]
    fine = [(r["op"], r["fine_sums"]) for r in meta["records"] if r["engine"] == "fine"]
    assert sorted(fine) == [("e2e_tpot", "fp32"), ("e2e_tpot", "rounded"), ("e2e_ttft", "fp32")]
    assert all(r["mode"] == "fine" and r["speedup"] > 0 for r in meta["records"] if r["engine"] == "fine")
    md = (tmp_path / "e2e.md").read_text()
    assert "fine (fp32 sums)" in md and "fine (rounded sums)" in md
    with pytest.raises(SystemExit):
        e2e.main(["--tiny", "--modes", "fine", "--fine-sums", "fp16"])


def test_attention_bound_of_head_skipping_rows():
    # issue 48: attention at the realised core skip, the rest at the dense engine's time
    from wide.benchmarks.e2e import attention_bound, markdown

    dense = dict(op="e2e_tpot", engine="dense", B=8, prompt_len=16384, model="m", attn_share=0.5, ms=10.0)
    heads = dict(op="e2e_tpot", engine="hybrid", B=8, prompt_len=16384, model="m", sparsity=0.5,
                 routing="skip_upto3", ms=9.0, speedup=10.0 / 9.0)
    realised = {"0.5": {"attn_core_rate": 0.25}}
    got = attention_bound(heads, [dense], realised)
    assert got["attn_bound"] == pytest.approx(1 / (1 - 0.125)) and got["of_attn_bound"] == pytest.approx(
        (10 / 9) * (1 - 0.125))
    assert attention_bound(dict(heads, routing="token"), [dense], realised) == {}  # no head-skip rule
    assert attention_bound(dict(heads, B=32), [dense], realised) == {}  # no dense share at that shape
    meta = dict(device="cpu", torch="x", triton="y", date="d", model="m", routers="r", command="c",
                records=[dense, dict(heads, **got, dense_ms=10.0)], errors=[])
    assert "| 8 | 16384 | hybrid (skip_upto3) | 1.11x | 1.14x | 97% |" in markdown(meta)
