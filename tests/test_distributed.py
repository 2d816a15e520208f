"""FSDP2 data-parallel calibration and recovery: 2 gloo processes match one process on the same
global batch, and a checkpoint written by 2 processes resumes on 1. Also the --dry-run estimator."""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import tiny_model

import wide
from wide.base import arch
from wide.training import distributed, recovery
from wide.method.config import WideConfig
from wide.training.distributed import DistContext
from wide.commands.estimate import estimate
from wide.training.train import TrainArgs, train

STEPS, STOP = 5, 3


def _ids():
    return torch.randint(0, 96, (24, 8), generator=torch.Generator().manual_seed(0))


def _args():
    # batch_size is the global micro-batch: 2 sequences per rank on 2 ranks.
    return TrainArgs(steps=STEPS, batch_size=4, grad_accum=2, eval_every=0, save_every=0, seed=3)


def _model():
    model = tiny_model("llama")
    wide.wrap(model, WideConfig(router_init="random", ffn_group_size=32))
    wide.freeze_backbone(model)
    return model


def _routers(model):
    return {k: v.detach().clone() for k, v in model.wide_routers.state_dict().items()}


def _stage2(model, out, dist, **kw):
    # No dropout: its masks are drawn per rank, so they differ between world sizes by design.
    return recovery.recover(model, _ids(), TrainArgs(steps=2, batch_size=4, eval_every=0, save_every=0, seed=3, sparsity_warmup=0.0), out,
                            lora=recovery.LoraArgs(dropout=0.0), progress=False, dist=dist, **kw)


def _trained(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    ctx = distributed.init("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        model = _model()
        ctx.shard(model)
        assert type(model.model.layers[0]).__name__.startswith("FSDP")
        res = train(model, _ids(), _args(), Path(tmp) / "run", progress=False, stop_at=STOP, dist=ctx)
        s2_model = _model()
        s2 = _stage2(s2_model, Path(tmp) / "stage2", ctx)
        assert type(s2_model.model.layers[0]).__name__.startswith("FSDP")  # sharded after LoRA was added
        torch.save({"history": res["history"], "routers": _routers(model), "stage2": s2["history"],
                    "stage2_trained": _trained(s2_model)}, Path(tmp) / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


def _assert_same_history(a, b):
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for key in ("loss", "ce", "flop_sparsity", "group_sparsity", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)


def _assert_same_routers(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_two_gloo_processes_match_one_and_resume_on_one(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    dist_run = torch.load(tmp_path / "rank0.pt", weights_only=False)
    other = torch.load(tmp_path / "rank1.pt", weights_only=False)
    _assert_same_routers(dist_run["routers"], other["routers"])  # replicated routers stay in sync

    torch.set_num_threads(1)
    ref3_model = _model()
    ref3 = train(ref3_model, _ids(), _args(), tmp_path / "ref3", progress=False, stop_at=STOP, dist=DistContext())
    _assert_same_history(dist_run["history"], ref3["history"])
    _assert_same_routers(dist_run["routers"], _routers(ref3_model))
    # The routing really was stochastic and sparse, so matching is not trivial.
    assert len({round(h["flop_sparsity"], 6) for h in ref3["history"]}) > 1

    ref_model = _model()
    ref = train(ref_model, _ids(), _args(), tmp_path / "ref", progress=False, dist=DistContext())

    ckpt = tmp_path / "run" / "checkpoint"
    assert (ckpt / distributed.DCP_DIR).is_dir() and (ckpt / "routers.safetensors").is_file()
    assert json.loads((ckpt / "wide_config.json").read_text())["world_size"] == 2
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no staging left
    resumed_model = _model()
    resumed = train(resumed_model, _ids(), _args(), tmp_path / "run", progress=False, resume=True,
                    dist=DistContext())
    _assert_same_history(resumed["history"], ref["history"])
    _assert_same_routers(_routers(resumed_model), _routers(ref_model))
    # The finished run is an ordinary router directory.
    loaded = wide.load(tiny_model("llama"), tmp_path / "run" / "routers")
    _assert_same_routers(_routers(loaded), _routers(ref_model))

    # Stage 2: LoRA adapters and routers, replicated, trained on 2 processes as on one.
    _assert_same_routers(dist_run["stage2_trained"], other["stage2_trained"])
    s2_model = _model()
    s2 = _stage2(s2_model, tmp_path / "stage2_ref", DistContext(), shard=False)
    _assert_same_history(dist_run["stage2"], s2["history"])
    assert any("lora_" in k for k in dist_run["stage2_trained"])
    _assert_same_routers(dist_run["stage2_trained"], _trained(s2_model))
    assert (tmp_path / "stage2" / "recovered" / "adapter_model.safetensors").is_file()  # written by rank 0
    s2_ckpt = tmp_path / "stage2" / "checkpoint"
    assert (s2_ckpt / distributed.DCP_DIR).is_dir() and (s2_ckpt / "adapter_model.safetensors").is_file()
    assert json.loads((s2_ckpt / "wide_config.json").read_text())["world_size"] == 2


def test_dcp_checkpoint_needs_the_distributed_loop_to_resume(tmp_path):
    train(_model(), _ids(), _args(), tmp_path, progress=False, stop_at=1, dist=DistContext())
    with pytest.raises(ValueError, match="distributed run"):
        train(_model(), _ids(), _args(), tmp_path, progress=False, resume=True)


def test_init_outside_torchrun_makes_a_one_process_group(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    ctx = distributed.init("gloo")
    try:
        assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.collective) == (0, 1, True, False)
    finally:
        distributed.shutdown()


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="divisible"):
        DistContext(rank=0, world_size=3).local_slice(4)


def test_keyed_noise_ignores_the_split():
    model = _model()
    noise = distributed.KeyedGumbel(model, seed=1)
    noise.key = (2, 0, 0)
    whole = noise.noise((4, 5, 3, 2), 1, "ffn", torch.device("cpu"))
    noise.key = (2, 0, 2)
    tail = noise.noise((2, 5, 3, 2), 1, "ffn", torch.device("cpu"))
    torch.testing.assert_close(whole[2:], tail, rtol=0, atol=0)
    noise.key = (3, 0, 2)
    assert not torch.equal(noise.noise((2, 5, 3, 2), 1, "ffn", torch.device("cpu")), tail)


def test_estimate_llama_8b():
    cfg = arch.hf_config("llama-3.1-8b")
    wc = WideConfig()
    one = estimate(cfg, wc, world_size=1, seq_len=4096, batch_size=1)
    assert one.detail["total_params"] == pytest.approx(8.03e9, rel=0.01)
    assert one.rows[0][1] == pytest.approx(8.03e9 * 2 / 2 ** 30, rel=0.01)
    four = estimate(cfg, wc, world_size=4, seq_len=4096, batch_size=4)
    assert four.rows[0][1] == pytest.approx(one.rows[0][1] / 4)
    assert four.detail["tokens_per_rank"] == one.detail["tokens_per_rank"] == 4096
    ac = estimate(cfg, wc, world_size=4, seq_len=4096, batch_size=4, activation_checkpointing=True)
    assert ac.peak_gib < four.peak_gib and ac.step_s > four.step_s
    assert "estimated peak" in ac.table()
    # the figure checked against the H200's measured 48.7 GiB (bench/results/fsdp_h200.md)
    assert one.peak_gib == pytest.approx(47.76, abs=0.01)


def test_estimate_counts_kd_thresholds_and_dense_attention_layers():
    from wide.commands.estimate import FINE_BACKWARD_BYTES, LOGIT_BYTES
    from wide.method.fine import FineConfig

    cfg = arch.hf_config("llama-3.1-8b")
    H, L, I, V = 4096, 32, 14336, 128256
    ce = estimate(cfg, WideConfig(), seq_len=2048, batch_size=2)
    kd = estimate(cfg, WideConfig(), seq_len=2048, batch_size=2, loss="kd")
    rows = lambda e: {name: gib for name, gib, _ in e.rows}  # noqa: E731
    assert rows(kd)["logits and loss"] == pytest.approx(rows(ce)["logits and loss"] * LOGIT_BYTES["kd"] / 14)
    assert kd.step_s == pytest.approx(ce.step_s * 3 / 2)  # the teacher's forward
    assert kd.detail["loss"] == "kd" and ce.detail["loss"] == "ce"
    with pytest.raises(ValueError, match="loss 'lm'"):
        estimate(cfg, WideConfig(), loss="lm")
    # attention routers only, none in layer 0: 31 routers of 8 GQA groups, one fp32 input saved each
    heads = WideConfig(sparse_target="attention", attn_rule="skip_upto", attn_skip=3, attn_dense_layers=[0])
    est = estimate(cfg, heads, seq_len=2048, batch_size=2)
    assert est.detail["router_params"] == 31 * (H * 16 + 16 + 16 * 16 + 16)
    assert rows(ce)["activations"] - rows(est)["activations"] == pytest.approx((2 * L - 31) * 4 * H * 4096 / 2 ** 30)
    # learned thresholds with per-channel scales: 7 per layer, and a scale per input channel of
    # every projection (q, k, v, gate, up read H; o reads the 32 x 128 heads; down reads I)
    fine = FineConfig(allocation="learned", per_channel=True)
    n = L * 7 + L * (6 * H + I)
    none = WideConfig(sparse_target="none", loss_mode="linear")
    learned = estimate(cfg, none, seq_len=2048, batch_size=2, loss="kd", fine=fine)
    assert learned.detail["threshold_params"] == learned.detail["trainable_params"] == n
    assert learned.detail["router_params"] == 0 and learned.detail["fixed_threshold_params"] == 0
    assert rows(learned)["backward workspace"] == pytest.approx(FINE_BACKWARD_BYTES * I * 4096 / 2 ** 30)
    plain = estimate(cfg, none, seq_len=2048, batch_size=2, loss="kd")
    assert rows(learned)["activations"] - rows(plain)["activations"] == pytest.approx(L * 2 * 2 * H * 4096 / 2 ** 30)
    frozen = estimate(cfg, heads, seq_len=2048, batch_size=2, loss="kd", fine=fine, fine_trained=False)
    assert frozen.detail["threshold_params"] == 0 and frozen.detail["fixed_threshold_params"] == n
    assert frozen.detail["trainable_params"] == est.detail["router_params"]
    assert rows(frozen)["trainable state (replicated)"] == pytest.approx(
        (est.detail["router_params"] * 16 + n * 4) / 2 ** 30)
    assert "fixed threshold params" in frozen.table()


def test_cli_dry_run(capsys):
    from wide.cli import main

    assert main(["calibrate", "--dry-run", "--model", "llama-3.1-8b", "--world-size", "8", "--seq-len", "4096",
                 "--batch-size", "8", "--out", "/nonexistent/unused"]) == 0
    out = capsys.readouterr().out
    assert "backbone parameters (sharded)" in out and "estimated peak" in out and "8 x h200" in out


def test_cli_dry_run_of_learned_thresholds_and_kd(capsys):
    from wide.cli import main

    assert main(["calibrate", "--dry-run", "--model", "llama-3.1-8b", "--dtype", "bfloat16", "--seq-len", "2048",
                 "--batch-size", "2", "--hybrid", "--sparse-target", "none", "--fine-per-channel", "--loss", "kd",
                 "--out", "/nonexistent/unused"]) == 0
    out = capsys.readouterr().out
    assert "loss kd, learned thresholds (--hybrid)" in out and "28 B per token (kd)" in out
    assert "1.25M params x 16 B" in out and "the thresholds' backward" in out
