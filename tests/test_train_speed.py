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


def test_design_heads_times_both_phases_beside_the_estimate(tmp_path):
    out = tmp_path / "calib"
    assert train_speed.main(["--tiny", "--design", "heads", "--steps", "2", "--warmup", "1", "--batch-size", "2",
                             "--seq-len", "16", "--amp", "bf16", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["design"] == "heads" and list(doc["phases"]) == ["thresholds", "heads"]
    assert all(doc[k] for k in ("torch", "triton", "transformers", "gpu", "command", "date"))
    assert doc["command"].startswith("python -m wide.benchmarks.train_speed --tiny --design heads")
    th, hd = doc["phases"]["thresholds"], doc["phases"]["heads"]
    assert th["thresholds_trained"] and th["wide_config"]["sparse_target"] == "none"
    assert th["fine_config"]["allocation"] == "learned" and th["fine_config"]["per_channel"]
    assert not hd["thresholds_trained"] and hd["fine_config"] == th["fine_config"]
    heads = hd["wide_config"]
    assert (heads["sparse_target"], heads["attn_rule"], heads["attn_dense_layers"]) == ("attention", "skip_upto", [0])
    recs = doc["records"]
    assert [(r["phase"], r["loss"], r["amp"], r["batch_size"]) for r in recs] == \
        [("thresholds", "kd", "bf16", 2), ("heads", "kd", "bf16", 2)]
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["steps_timed"] == 2
        # the estimator counts what the phase trains
        assert r["estimate"]["trainable_params"] == r["trainable_params"] > 0
        assert r["estimate"]["peak_gib"] > 0 and r["estimate"]["step_s"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| thresholds | kd | bf16 | 2 x 16 |" in md and "| heads | kd | bf16 | 2 x 16 |" in md


def _options(**kw):
    import argparse

    return argparse.Namespace(**{"target": 0.5, "heads": 0.25, "tiny": False, **kw})


def test_heads_phase_trains_the_routers_on_frozen_thresholds():
    import torch

    a = _options(tiny=True)
    model = train_speed.load_model("tiny", True, torch.float32, "cpu")
    calib = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    train_speed.setup_phase(model, "thresholds", a, calib)
    start = {k: v.clone() for k, v in model.wide_fine.state_dict().items()}
    assert train_speed.trained_parameters(model) == sum(p.numel() for p in model.wide_fine.learnable())
    train_speed.measure(model, loss="kd", amp="none", batch_size=2, seq_len=16, steps=1, warmup=0)
    learned = {k: v.clone() for k, v in model.wide_fine.state_dict().items()}
    assert not torch.equal(learned["log_threshold"], start["log_threshold"])
    train_speed.setup_phase(model, "heads", a, calib)
    assert model.wide_routers[0].attn is None and model.wide_routers[1].attn is not None
    assert all(r.ffn is None for r in model.wide_routers)
    routers = {k: v.clone() for k, v in model.wide_routers.state_dict().items()}
    train_speed.measure(model, loss="kd", amp="none", batch_size=2, seq_len=16, steps=1, warmup=0)
    for k, v in model.wide_fine.state_dict().items():
        assert torch.equal(v, learned[k]), k
    assert any(not torch.equal(v, routers[k]) for k, v in model.wide_routers.state_dict().items())


def test_llama_8b_phases_train_what_the_estimator_counts():
    import torch
    from transformers import AutoModelForCausalLM

    from wide.base import arch
    from wide.commands.estimate import estimate
    from wide.method import fine, modeling

    cfg = arch.hf_config("llama-3.1-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # thresholds: 7 a layer and a scale per input channel; heads: 31 rank-16 routers of 8 groups
    wants = {"thresholds": 32 * 7 + 32 * (6 * 4096 + 14336), "heads": 31 * (4096 * 16 + 16 + 16 * 16 + 16)}
    for phase, want in wants.items():
        wcfg, fcfg, trained = train_speed.phase_configs(phase, cfg, _options())
        modeling.wrap(model, wcfg, seed=0)
        fine.attach(model, fcfg)
        modeling.freeze_backbone(model)
        if not trained:
            for p in model.wide_fine.parameters():
                p.requires_grad_(False)
        assert train_speed.trained_parameters(model) == want
        assert estimate(cfg, wcfg, fine=fcfg, fine_trained=trained).detail["trainable_params"] == want
        modeling.unwrap(model)


def test_estimates_are_the_dry_runs_of_the_same_settings(capsys):
    from wide.base import arch
    from wide.cli import build_parser
    from wide.commands.estimate import dry_run

    cfg = arch.hf_config("llama-3.1-8b")
    a = _options(model="llama-3.1-8b", dtype="bfloat16", seq_len=2048)
    for phase in ("routers", "thresholds"):
        rec = train_speed.predicted(cfg, *train_speed.phase_configs(phase, cfg, a), loss="kd", batch_size=2,
                                    seq_len=2048, dtype="bfloat16", gpu="h100")
        cmd = train_speed.dry_run_command(a, phase, "kd", 2, "h100")
        got = dry_run(build_parser().parse_args(cmd.split()[1:]))
        assert (got["peak_gib"], got["step_s"], got["trainable_params"]) == \
            (rec["peak_gib"], rec["step_s"], rec["trainable_params"]), phase
    assert train_speed.dry_run_command(a, "heads", "kd", 2, "h100") is None
    assert train_speed.dry_run_command(_options(tiny=True), "thresholds", "kd", 2, "h100") is None


def test_out_of_memory_is_recorded_and_larger_batches_are_not_tried(tmp_path, monkeypatch):
    import torch

    real = train_speed.measure

    def measure(model, *, batch_size, **kw):
        if batch_size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, batch_size=batch_size, **kw)

    monkeypatch.setattr(train_speed, "measure", measure)
    out = tmp_path / "oom"
    assert train_speed.main(["--tiny", "--steps", "1", "--warmup", "0", "--batch-size", "2", "3", "4",
                             "--seq-len", "8", "--loss", "ce", "--out", str(out)]) == 0
    recs = json.loads(out.with_suffix(".json").read_text())["records"]
    assert [r.get("error") for r in recs] == [None, "out of memory", "not run (a smaller batch ran out of memory)"]
    assert recs[0]["tokens_per_s"] > 0 and "tokens_per_s" not in recs[1]
    assert "| routers | ce | none | 3 x 8 | out of memory |" in out.with_suffix(".md").read_text()
