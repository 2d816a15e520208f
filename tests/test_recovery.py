"""Stage 2: LoRA save/load/merge round trip, masking of the LoRA branch, resume."""

import json

import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

import wide
from wide.training import recovery
from wide.method.state import get_state
from wide.training.train import TrainArgs


def routed(seed=0):
    model = tiny_model("llama", seed=seed)
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32, attn_group_size=1))
    with torch.no_grad():
        for p in model.wide_routers.parameters():
            p.normal_(0, 0.5)
    return model


def randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:  # lora_B starts at zero, which would hide a broken merge
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def skip_rate(model, ids):
    with wide.track_sparsity(model) as tr:
        model(ids)
    return float(tr.summary().group_rate)


def test_save_load_merge_round_trip(tmp_path):
    model = routed()
    params = recovery.add_lora(model)
    assert any(p is q for p in params for q in model.wide_routers.parameters())  # routers keep training
    randomize_adapters(model)
    model.eval()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    assert 0.1 < skip_rate(model, ids) < 0.9
    unmerged = model(ids).logits
    recovery.save_recovered(model, tmp_path / "rec", extra={"stage": 2})
    files = {p.name for p in (tmp_path / "rec").iterdir()}
    assert {"routers.safetensors", "wide_config.json", "adapter_model.safetensors", "adapter_config.json"} <= files
    assert json.loads((tmp_path / "rec" / "adapter_config.json").read_text())["r"] == 16

    loaded = recovery.load_recovered(tiny_model("llama"), tmp_path / "rec", merge_adapters=False)
    torch.testing.assert_close(loaded(ids).logits, unmerged, rtol=0, atol=0)

    merged = recovery.load_recovered(tiny_model("llama"), tmp_path / "rec")
    assert type(merged.model.layers[0].self_attn.o_proj) is nn.Linear
    assert not recovery.has_lora(merged)
    torch.testing.assert_close(merged(ids).logits, unmerged, rtol=1e-5, atol=1e-5)

    recovery.merge(model)
    torch.testing.assert_close(model(ids).logits, unmerged, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA"):
        recovery.merge(model)


def test_mask_gates_the_lora_branch_too():
    # A token that skips every group of a module must get nothing from that module, LoRA included.
    model = routed()
    recovery.add_lora(model)
    randomize_adapters(model)
    model.eval()
    ids = torch.randint(0, 96, (1, 6))
    state = get_state(model)
    state.mask_fn = lambda layer, kind, x: torch.zeros(*x.shape[:-1], state.geometry.groups(kind))
    seen = []
    h = model.model.layers[0].self_attn.o_proj.lora_B["default"].register_forward_hook(
        lambda m, a, o: seen.append(o.detach().abs().max()))
    model(ids)
    h.remove()
    assert float(seen[0]) == 0.0


def test_adapters_load_with_peft_too(tmp_path):
    from peft import PeftModel

    model = routed()
    recovery.add_lora(model)
    randomize_adapters(model)
    recovery.save_recovered(model, tmp_path / "rec")
    peft_model = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "rec")
    a = model.model.layers[1].mlp.up_proj.lora_A["default"].weight
    b = peft_model.base_model.model.model.layers[1].mlp.up_proj.lora_A["default"].weight
    torch.testing.assert_close(a, b)


def _stage2(tmp_path, stage1, steps, **kw):
    torch.manual_seed(0)  # adapter init
    model = recovery.load_recovered(tiny_model("llama"), stage1)
    ids = torch.randint(0, 96, (16, 8), generator=torch.Generator().manual_seed(0))
    args = TrainArgs(steps=steps, batch_size=2, lr=2e-3, eval_every=0, save_every=2, seed=1, sparsity_warmup=0.0)
    return model, recovery.recover(model, ids, args, tmp_path, progress=False, **kw)


def test_stage2_resume_equals_uninterrupted(tmp_path):
    wide.save_routers(routed(), tmp_path / "s1")
    full_model, full = _stage2(tmp_path / "full", tmp_path / "s1", 5)
    _, part = _stage2(tmp_path / "part", tmp_path / "s1", 5, stop_at=3)
    assert part["stopped_at"] == 3 and (tmp_path / "part" / "checkpoint" / "adapter_model.safetensors").is_file()
    resumed_model, resumed = _stage2(tmp_path / "part", tmp_path / "s1", 5, resume=True)
    for a, b in zip(full["history"], resumed["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    sd_full, sd_res = full_model.state_dict(), resumed_model.state_dict()
    changed = 0
    for k in sd_full:
        torch.testing.assert_close(sd_full[k], sd_res[k], rtol=1e-5, atol=1e-6, msg=k)
        changed += "lora_B" in k and bool(sd_full[k].abs().sum() > 0)
    assert changed > 0  # the adapters did train
    # the final directory holds both, and loads back to the same model
    again = recovery.load_recovered(tiny_model("llama"), full["recovered_dir"], merge_adapters=False)
    ids = torch.randint(0, 96, (2, 8))
    full_model.eval()
    torch.testing.assert_close(again(ids).logits, full_model(ids).logits, rtol=1e-6, atol=1e-6)
    assert json.loads((tmp_path / "full" / "recovered" / "wide_config.json").read_text())["stage"] == 2


def test_freeze_routers_trains_adapters_only(tmp_path):
    wide.save_routers(routed(), tmp_path / "s1")
    model, _ = _stage2(tmp_path / "run", tmp_path / "s1", 2, freeze_routers=True)
    before = wide.load(tiny_model("llama"), tmp_path / "s1")
    for p, q in zip(model.wide_routers.parameters(), before.wide_routers.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _merge_check(tmp_path, model) -> tuple:
    """compare's merge check on MODEL saved as stage 1, then with random adapters as stage 2:
    (the check's result on stage 2, and on stage 1)."""
    from wide.commands.compare import Comparison

    recovery.save_recovered(model, tmp_path / "m-50" / "stage1" / "final", extra={"stage": 1})
    recovery.add_lora(model)
    randomize_adapters(model)
    recovery.save_recovered(model, tmp_path / "m-50" / "stage2" / "final", extra={"stage": 2})
    c = Comparison.__new__(Comparison)
    c.heldout = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(5))
    c.device = "cpu"
    c.fresh = lambda: tiny_model("llama")
    return c.merge_check(tmp_path / "m-50" / "stage2" / "final"), c.merge_check(tmp_path / "m-50" / "stage1" / "final")


def test_compare_merge_check_sets_merge_error_against_stage2_change(tmp_path):
    res, stage1 = _merge_check(tmp_path, routed())
    assert res["tokens"] == 48
    assert res["logits_rel_err"] < 1e-5
    assert res["stage2_change_rel"] > 1e-2  # the adapters did change the model
    assert res["argmax_agreement"] == 1.0
    assert stage1 == {}  # nothing to merge
    assert "thresholds_off" not in res


def test_merge_check_of_a_thresholded_model_measures_the_merge_with_thresholds_off(tmp_path):
    # Hard per-element thresholds amplify the merge's rounding into flipped inputs: the merge
    # itself is judged with them off (exact up to rounding), the thresholded error beside it.
    from wide.method import fine

    m = wide.wrap(tiny_model("llama"), wide.WideConfig(ffn_group_size=16, sparse_target="none"))
    fine.attach(m, fine.FineConfig(target=0.5))
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    fine.set_thresholds(m, fine.collect_scores(m, [ids]), fine.uniform_sparsity(m.wide_state.geometry.dims, 0.5))
    res, _ = _merge_check(tmp_path, m)
    assert res["thresholds_off"] is True and res["logits_rel_err"] < 1e-5 and res["stage2_change_rel"] > 1e-2
    assert 0 <= res["logits_rel_err_thresholded"] and 0 <= res["argmax_agreement_thresholded"] <= 1


def test_stage2_keeps_the_full_target_from_the_first_step_while_stage1_warms_up():
    """Stage 1's default target warm-up exists for routers that start dense; stage 2 starts from
    trained routers, so compare's stage 2 and `wide recover` run the full target from step 1
    (a warm-up there would let the trained routers drift dense first)."""
    from wide.cli import build_parser
    from wide.commands.compare import Comparison

    args = build_parser().parse_args(["compare", "--recovery-steps", "3", "--sparsity-warmup", "0.25"])
    c = Comparison.__new__(Comparison)
    c.args = args
    assert c.train_args(1).sparsity_warmup == 0.25
    two = c.train_args(2)
    assert (two.sparsity_warmup, two.steps, two.lr) == (0.0, 3, args.recovery_lr)
    assert recovery.TrainArgs().sparsity_warmup == 0.5 and wide.WideConfig().router_init == "dense"
    rec = build_parser().parse_args(["recover", "--routers", "r", "--out", "o"])
    assert (rec.sparsity_warmup, rec.lr) == (0.0, recovery.RECOVERY_LR)


def test_stage2_with_a_target_warmup_warns(tmp_path):
    model = routed()
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="drift towards dense"):
        recovery.recover(model, ids, TrainArgs(steps=1, batch_size=2, eval_every=0, save_every=0), tmp_path,
                         progress=False)
