"""Self-distillation (wide.training.train: --loss ce | kd | mix): the loss against a hand-written
reference, the teacher (the same backbone without routers, and without LoRA in stage 2),
gradients, bf16 autocast with float32 routers, resume checks and seed determinism."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model, write_tiny_run

import wide
from wide import data
from wide.training import recovery, train as training
from wide.cli import main
from wide.method.config import WideConfig
from wide.method.state import get_state
from wide.training.train import TrainArgs, distillation_loss, micro_batch_loss, teacher_mode, train


def reference_kl(student_logits, teacher_logits, T):
    """KL(teacher || student) per position, written out over the vocabulary in float64."""
    s = student_logits.double().reshape(-1, student_logits.shape[-1]) / T
    t = teacher_logits.double().reshape(-1, teacher_logits.shape[-1]) / T
    total = 0.0
    for i in range(s.shape[0]):
        ps = [math.exp(v) for v in s[i].tolist()]
        pt = [math.exp(v) for v in t[i].tolist()]
        zs, zt = sum(ps), sum(pt)
        total += sum((b / zt) * (math.log(b / zt) - math.log(a / zs)) for a, b in zip(ps, pt))
    return total / s.shape[0] * T * T


@pytest.mark.parametrize("T", [1.0, 2.5])
def test_distillation_loss_equals_the_written_out_kl(T):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 11, generator=g) * 3, torch.randn(2, 3, 11, generator=g) * 3
    assert float(distillation_loss(s, t, T)) == pytest.approx(reference_kl(s, t, T), rel=1e-5)
    assert float(distillation_loss(t, t, T)) == pytest.approx(0.0, abs=1e-6)
    # bf16 logits are taken to float32 before the softmax
    got = distillation_loss(s.bfloat16(), t.bfloat16(), T)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(reference_kl(s.bfloat16(), t.bfloat16(), T), rel=1e-4)


def routed(seed=0, **cfg):
    model = tiny_model("llama", seed=seed)
    wide.wrap(model, WideConfig(ffn_group_size=32, attn_group_size=1, **{"router_init": "random", **cfg}), seed=seed)
    wide.freeze_backbone(model)
    return model


def fixed_masks(model, keep=0.5, seed=1):
    """Deterministic random masks (no Gumbel noise), so that a reference can be built."""
    state = get_state(model)
    g = torch.Generator().manual_seed(seed)
    table = {}

    def fn(layer, kind, x):
        key = (layer, kind, tuple(x.shape[:-1]))
        if key not in table:
            table[key] = (torch.rand(*x.shape[:-1], state.geometry.groups(kind), generator=g) < keep).float()
        return table[key]

    state.mask_fn = fn


@pytest.mark.parametrize("loss", ["kd", "mix"])
def test_micro_batch_loss_against_a_dense_copy_and_the_reference(loss):
    model = routed()
    fixed_masks(model)
    model.train()
    dense = tiny_model("llama", seed=0)  # the same backbone, never wrapped
    x = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    args = TrainArgs(loss=loss, kd_temperature=2.0, mix_weight=0.3)
    got = micro_batch_loss(model, x, args)

    with torch.no_grad():
        teacher = dense(input_ids=x).logits[:, :-1]
        student = model(input_ids=x).logits[:, :-1]
    assert (student - teacher).abs().max() > 1e-3  # the masks change the model
    ce = F.cross_entropy(student.reshape(-1, 96), x[:, 1:].reshape(-1))
    kd = reference_kl(student, teacher, 2.0)
    assert float(got["ce"]) == pytest.approx(float(ce), rel=1e-5)
    assert float(got["kd"]) == pytest.approx(kd, rel=1e-4)
    want = kd if loss == "kd" else 0.7 * float(ce) + 0.3 * kd
    assert float(got["task"]) == pytest.approx(want, rel=1e-4)


def test_ce_needs_no_teacher_and_keeps_the_hf_loss():
    model = routed()
    fixed_masks(model)
    x = torch.randint(0, 96, (2, 7))
    got = micro_batch_loss(model, x, TrainArgs())
    assert got["kd"] is None and got["task"] is got["ce"]
    assert float(got["ce"]) == pytest.approx(float(model(input_ids=x, labels=x).loss), rel=1e-6)


def test_kd_is_zero_when_routing_skips_nothing():
    model = routed(target_sparsity=0.0)
    with torch.no_grad():  # every router runs every group, whatever the Gumbel noise draws
        for lr in model.wide_routers:
            for r in (lr.attn, lr.ffn):
                r.up.bias.copy_(torch.tensor([100.0, -100.0]).repeat(r.num_groups))
    model.train()
    get_state(model).tau = 1.0
    x = torch.randint(0, 96, (2, 9))
    got = micro_batch_loss(model, x, TrainArgs(loss="kd"))
    assert float(wide.method.sparsity.forward_sparsity(model).group_rate) == 0.0
    assert float(got["kd"]) == pytest.approx(0.0, abs=1e-7)


def test_teacher_is_the_dense_backbone_and_ignores_lora():
    model = routed()
    fixed_masks(model)
    recovery.add_lora(model, recovery.LoraArgs(r=4))
    g = torch.Generator().manual_seed(5)
    dense = tiny_model("llama", seed=0)
    x = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        want = dense(input_ids=x).logits
        for n, p in model.named_parameters():
            if "lora_" in n:  # lora_B starts at zero: perturb every adapter
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        with teacher_mode(model):
            teacher = model(input_ids=x).logits
        student = model(input_ids=x).logits
        geo = get_state(model).geometry
        get_state(model).mask_fn = lambda layer, kind, x: torch.ones(*x.shape[:-1], geo.groups(kind))
        adapters_only = model(input_ids=x).logits  # no group skipped: only the adapters differ
    torch.testing.assert_close(teacher, want, rtol=0, atol=0)
    assert (student - want).abs().max() > 1e-2
    assert (adapters_only - want).abs().max() > 1e-3  # the adapters are on again after the block
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads


def test_teacher_pass_leaves_the_students_sparsity_records():
    model = routed()
    fixed_masks(model)
    x = torch.randint(0, 96, (1, 6))
    model(input_ids=x)
    before = float(wide.method.sparsity.forward_sparsity(model).flop_rate)
    with torch.no_grad(), teacher_mode(model):
        model(input_ids=x)
    assert float(wide.method.sparsity.forward_sparsity(model).flop_rate) == before > 0


def test_stage1_kd_gradients_reach_only_the_routers():
    model = routed(sparsity_coef=0.0)
    model.train()
    get_state(model).tau = 1.0
    x = torch.randint(0, 96, (2, 9))
    micro_batch_loss(model, x, TrainArgs(loss="kd"))["task"].backward()
    routers = {id(p) for p in model.wide_routers.parameters()}
    for n, p in model.named_parameters():
        if id(p) in routers:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        else:
            assert p.grad is None, n
    assert sum(float(p.grad.abs().sum()) for p in model.wide_routers.parameters()) > 0


def test_kd_training_moves_routers_only_logs_both_losses_and_is_seeded(tmp_path):
    ids = torch.randint(0, 96, (16, 8), generator=torch.Generator().manual_seed(0))
    args = TrainArgs(steps=3, batch_size=2, eval_every=0, save_every=0, seed=4, loss="mix", mix_weight=0.25,
                     sparsity_warmup=0.0)  # the penalty below is against the full target
    runs = []
    for name in ("a", "b"):
        model = routed(seed=4)
        backbone = {n: p.clone() for n, p in model.named_parameters() if "wide_routers" not in n}
        res = train(model, ids, args, tmp_path / name, progress=False)
        assert all(torch.equal(p, backbone[n]) for n, p in model.named_parameters() if n in backbone)
        runs.append((res["history"], {n: p.detach().clone() for n, p in model.wide_routers.named_parameters()}))
    (hist, routers), (hist2, routers2) = runs
    for h in hist:
        task = 0.75 * h["ce"] + 0.25 * h["kd"]
        assert h["kd"] > 0 and h["loss"] == pytest.approx(task + 20.0 * abs(0.5 - h["flop_sparsity"]), rel=1e-4)
    assert hist == [dict(h, tokens_per_s=a["tokens_per_s"]) for h, a in zip(hist2, hist)]  # same seed, same run
    assert all(torch.equal(routers[n], routers2[n]) for n in routers)


def test_resume_with_another_loss_is_refused_and_an_old_checkpoint_resumes(tmp_path):
    ids = torch.randint(0, 96, (16, 8), generator=torch.Generator().manual_seed(0))
    args = TrainArgs(steps=3, batch_size=2, eval_every=0, save_every=1, seed=1)
    train(routed(), ids, args, tmp_path, progress=False, stop_at=1)
    with pytest.raises(ValueError, match="loss was 'ce', now 'kd'"):
        train(routed(), ids, TrainArgs(**{**vars(args), "loss": "kd"}), tmp_path, resume=True, progress=False)
    # A checkpoint written before these fields existed resumes as the cross-entropy run it was.
    state_file = tmp_path / "checkpoint" / training.TRAINER_STATE
    ts = torch.load(state_file, weights_only=False)
    for k in ("loss", "kd_temperature", "mix_weight", "amp"):
        del ts["args"][k]
    torch.save(ts, state_file)
    from wide.io.serialization import MANIFEST_FILE, _seal  # the checkpoint's seal covers the edited file

    sealed = json.loads((tmp_path / "checkpoint" / MANIFEST_FILE).read_text())
    _seal(tmp_path / "checkpoint", {k: v for k, v in sealed.items() if k != "files"})
    res = train(routed(), ids, args, tmp_path, resume=True, progress=False)
    assert [h["step"] for h in res["history"]] == [1, 2, 3]


def test_cli_resume_names_the_loss_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    argv = ["calibrate", *common, "--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offsets", "none",
            "--ffn-group-size", "32", "--out", str(tmp_path / "r")]
    assert main([*argv, "--stop-at", "1"]) == 0
    assert main([*argv, "--resume", "--loss", "kd"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "--loss was 'ce', now 'kd'" in errors[0]
    assert main([*argv, "--resume", "--kd-temperature", "2"]) == 2
    assert "--kd-temperature was 1.0, now 2.0" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0


def test_bf16_autocast_keeps_router_decisions_in_float32():
    model = routed()
    model.eval()
    state = get_state(model)
    seen = []
    state.input_observers.append(lambda layer, kind, x: seen.append((layer, kind, x.detach().clone())))
    masks = []
    state.mask_observers.append(lambda layer, kind, mask, valid: masks.append(mask))
    router_out = []
    handle = model.wide_routers[1].ffn.register_forward_hook(lambda m, a, o: router_out.append(o.dtype))
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad(), training.autocast(TrainArgs(amp="bf16"), torch.device("cpu")):
        logits = model(input_ids=x).logits
    handle.remove()
    assert logits.dtype == torch.bfloat16  # the backbone did run in bf16
    assert router_out == [torch.float32]
    assert masks and all(m.dtype == torch.float32 for m in masks)
    for (layer, kind, inp), mask in zip(seen, masks):
        router = model.wide_routers[layer].router(kind)
        with torch.no_grad():
            assert torch.equal(router.runs(inp.float()).float(), mask)  # the float32 rule, outside autocast


def test_bf16_training_step_runs_and_stays_close_to_float32(tmp_path):
    ids = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for amp in ("none", "bf16"):
        model = routed()
        res = train(model, ids, TrainArgs(steps=1, batch_size=4, eval_every=0, save_every=0, loss="kd", amp=amp),
                    tmp_path / amp, progress=False)
        out[amp] = res["history"][0]
        assert all(p.dtype == torch.float32 for p in model.wide_routers.parameters())
    assert out["bf16"]["ce"] == pytest.approx(out["none"]["ce"], rel=0.05)


def test_train_args_validate_the_new_fields():
    with pytest.raises(ValueError, match="kd_temperature"):
        TrainArgs(kd_temperature=0)
    with pytest.raises(ValueError, match="mix_weight"):
        TrainArgs(mix_weight=1.5)
    with pytest.raises(ValueError, match="loss must be one of"):
        TrainArgs(loss="kl")
    with pytest.raises(ValueError, match="amp must be one of"):
        TrainArgs(amp="fp8")


def test_kd_in_the_data_parallel_loop_and_in_stage2(tmp_path):
    from wide.training.distributed import DistContext

    ids = torch.randint(0, 96, (16, 8), generator=torch.Generator().manual_seed(0))
    args = TrainArgs(steps=2, batch_size=4, eval_every=0, save_every=0, seed=2, loss="kd")
    res = train(routed(), ids, args, tmp_path / "dp", progress=False, dist=DistContext())
    assert all(h["kd"] > 0 and math.isfinite(h["kd"]) for h in res["history"])
    # Stage 2: the adapters train against the dense model, which they never touch.
    model = routed()
    fixed_masks(model)
    dense = tiny_model("llama", seed=0)
    res = recovery.recover(model, ids, TrainArgs(**{**vars(args), "lr": 1e-2, "sparsity_warmup": 0.0}), tmp_path / "s2",
                           lora=recovery.LoraArgs(r=4, dropout=0.0), progress=False)
    assert all(h["kd"] > 0 for h in res["history"])
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b)  # lora_B starts at zero: it trained
    x = ids[:2]
    with torch.no_grad(), teacher_mode(model):
        torch.testing.assert_close(model(input_ids=x).logits, dense(input_ids=x).logits, rtol=0, atol=0)
