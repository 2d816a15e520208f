"""The skip-the-k-smallest-margins attention rule (WideConfig.attn_rule="skip_smallest",
wide.method.group_rules) and attention layers kept dense (attn_dense_layers): the rule's masks,
its training samples, the saved config, the sparsity records, offset calibration, and the engine
(wide.engine.routing_rules.SkipSmallestRule) against the masked HF path."""
import argparse
import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402

import wide  # noqa: E402
from wide.base.cliargs import add_fields, from_args  # noqa: E402
from wide.evaluation.evaluate import cache_kwargs  # noqa: E402
from wide.method import group_rules  # noqa: E402
from wide.method.group_rules import skip_smallest_runs, skip_smallest_sample  # noqa: E402
from wide.method.modeling import batch_shared_decode, recording_masks  # noqa: E402

# 4 query heads, one per group (attn_group_size=1): 4 attention groups, so k = 1..3 are valid.
TINY = dict(hidden_size=64, head_dim=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, num_hidden_layers=3)


def wrapped(seed=0, k=2, dense=(0,), **cfg):
    config = dict(ffn_group_size=32, router_init="random", attn_group_size=1, attn_rule="skip_smallest",
                  attn_skip=k, attn_dense_layers=list(dense))
    config.update(cfg)
    return wide.wrap(tiny_model("llama", seed=seed, **TINY), wide.WideConfig(**config), seed=seed)


def ids_of(b, t, seed=3):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------ the rule's masks


@pytest.mark.parametrize("k", [1, 2, 4])
def test_skip_smallest_runs_skips_exactly_the_k_smallest(k):
    m = torch.randn(6, 5, 5, generator=torch.Generator().manual_seed(k))
    runs = skip_smallest_runs(m, k)
    assert runs.dtype == torch.bool and runs.shape == m.shape
    assert ((~runs).sum(-1) == k).all()
    smallest = m.sort(-1).indices[..., :k]
    assert (~runs).gather(-1, smallest).all()


def test_skip_smallest_ties_go_to_the_lowest_index():
    m = torch.tensor([[1.0, 0.0, 0.0, 2.0], [3.0, 3.0, 3.0, 3.0], [0.5, -1.0, 0.5, 0.5]])
    assert skip_smallest_runs(m, 1).tolist() == [[True, False, True, True], [False, True, True, True],
                                                 [True, False, True, True]]
    assert skip_smallest_runs(m, 2).tolist() == [[True, False, False, True], [False, False, True, True],
                                                 [False, False, True, True]]


def test_skip_smallest_refuses_k_outside_1_to_groups():
    for k in (0, 4):
        with pytest.raises(ValueError, match="fewer than the 4 groups"):
            skip_smallest_runs(torch.zeros(2, 4), k)
        with pytest.raises(ValueError, match="fewer than the 4 groups"):
            skip_smallest_sample(torch.zeros(2, 4), k, 1.0)


def test_hf_masks_follow_the_rule_and_ignore_offsets():
    model = wrapped(k=2)
    ids = ids_of(2, 12)
    seen = {}
    model.wide_state.input_observers.append(lambda layer, kind, x: seen.setdefault((layer, kind), x))
    with torch.no_grad(), recording_masks(model) as rec:
        ref = model(input_ids=ids).logits
    assert model.wide_routers[0].attn is None  # the dense layer has no router
    assert rec[(0, "attn")][0].all()  # and runs every group
    for layer in (1, 2):
        mask = rec[(layer, "attn")][0]
        assert ((~mask).sum(-1) == 2).all()
        margin = model.wide_routers[layer].attn.margin(seen[(layer, "attn")])
        assert torch.equal(mask, skip_smallest_runs(margin, 2))
        assert not torch.equal(mask, margin >= 0)  # not the independent rule's
    for layer in (1, 2):  # an offset shifts a router's margins alike: the choice stays
        model.wide_routers[layer].attn.offset.fill_(7.5)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


# ------------------------------------------------------------------ training samples


def test_training_sample_k1_draws_g_plus_one_outcomes_with_the_softmax_odds():
    # Gumbel-max: a hard sample at tau 1 picks outcome o with probability softmax(scores)[o],
    # scores [-margin_0 .. -margin_{G-1}, 0] ("skip nothing" last).
    torch.manual_seed(0)
    margin = torch.tensor([0.5, -1.0, 2.0])
    mask = skip_smallest_sample(margin.expand(20000, 3), 1, 1.0)
    assert set(mask.sum(-1).unique().tolist()) <= {2.0, 3.0}  # skips one group or none
    freq = torch.cat([(1 - mask).mean(0), (mask.sum(-1) == 3).float().mean()[None]])
    want = torch.cat([-margin, torch.zeros(1)]).softmax(-1)
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


def test_training_sample_k2_is_without_replacement_and_stops_after_skip_nothing():
    torch.manual_seed(1)
    mask = skip_smallest_sample(torch.randn(5000, 4), 2, 0.7)
    assert ((mask == 0) | (mask == 1)).all()  # no group skipped twice (a 0 would go to -1)
    counts = (1 - mask).sum(-1)
    assert set(counts.unique().tolist()) == {0.0, 1.0, 2.0}
    # very negative margins: both draws skip; very positive ones: nothing is skipped
    assert ((1 - skip_smallest_sample(torch.full((50, 4), -30.0), 2, 0.5)).sum(-1) == 2).all()
    assert skip_smallest_sample(torch.full((50, 4), 30.0), 2, 0.5).eq(1).all()
    # after "skip no more" the second draw may not skip: stop forced in draw 0
    gumbels = torch.zeros(1, 2, 5)
    gumbels[0, 0, 4] = 100.0
    assert skip_smallest_sample(torch.full((1, 4), -3.0), 2, 1.0, gumbels).eq(1).all()


@pytest.mark.parametrize("k", [1, 2])
def test_training_sample_gradient_reaches_every_margin(k):
    margin = torch.randn(8, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    mask = skip_smallest_sample(margin, k, 1.0)
    (mask * torch.arange(1.0, 5.0)).sum().backward()
    assert margin.grad is not None and (margin.grad != 0).all(0).all()


def test_training_forward_samples_and_trains_the_routers():
    model = wrapped(k=1, router_init="dense")  # margins 4: skip nothing with probability ~0.95
    model.train()
    model.wide_state.tau = 1.0
    torch.manual_seed(0)
    with recording_masks(model) as rec:
        model(input_ids=ids_of(2, 16))
    loss, sp = wide.sparsity_loss(model)
    loss.backward()
    skipped = torch.cat([(~rec[(layer, "attn")][0]).sum(-1).flatten() for layer in (1, 2)])
    assert set(skipped.unique().tolist()) == {0, 1}  # "skip nothing" happens, and so does a skip
    for layer in (1, 2):
        assert model.wide_routers[layer].attn.up.bias.grad.abs().sum() > 0


def test_keyed_noise_of_distributed_training_follows_the_rule():
    from wide.training import distributed
    model = wrapped(k=2)
    model.train()
    model.wide_state.tau = 1.0
    noise = distributed.KeyedGumbel(model, seed=1)
    noise.key = (0, 0, 0)
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    a, b = noise(1, "attn", x), noise(1, "attn", x)
    assert torch.equal(a, b)  # keyed: recomputation reproduces it
    assert ((1 - a).sum(-1) <= 2).all() and ((a == 0) | (a == 1)).all()
    model.eval()
    assert torch.equal(noise(1, "attn", x), skip_smallest_runs(model.wide_routers[1].attn.margin(x), 2).float())


# ------------------------------------------------------------------ config, saving, CLI


def test_config_checks():
    with pytest.raises(ValueError, match="attn_skip=4"):
        wrapped(k=4)
    with pytest.raises(ValueError, match="has 3 layers"):
        wrapped(dense=(3,))
    with pytest.raises(ValueError, match="set attn_rule with it"):
        wide.WideConfig(attn_skip=2)
    with pytest.raises(ValueError, match="need attention routed"):
        wide.WideConfig(sparse_target="ffn", attn_rule="skip_smallest")
    with pytest.raises(ValueError, match="need attention routed"):
        wide.WideConfig(tie_modules=True, attn_dense_layers=[0])
    with pytest.raises(ValueError, match="twice"):
        wide.WideConfig(attn_dense_layers=[1, 1])
    with pytest.raises(ValueError, match="must be one of"):
        wide.WideConfig(attn_rule="smallest")
    with pytest.raises(ValueError, match="attn_skip must be >= 1"):
        wide.WideConfig(attn_rule="skip_smallest", attn_skip=0)


def test_cli_flags_build_the_config():
    p = argparse.ArgumentParser()
    add_fields(p, wide.WideConfig)
    args = p.parse_args(["--attn-rule", "skip_smallest", "--attn-skip", "2", "--attn-dense-layers", "2", "0"])
    cfg = from_args(wide.WideConfig, args)
    assert (cfg.attn_rule, cfg.attn_skip, cfg.attn_dense_layers) == ("skip_smallest", 2, [0, 2])
    defaults = from_args(wide.WideConfig, p.parse_args([]))
    assert (defaults.attn_rule, defaults.attn_skip, defaults.attn_dense_layers) == ("independent", 1, [])
    assert "those of smallest margin" in " ".join(p.format_help().split())


def test_saved_routers_round_trip_the_rule(tmp_path):
    from wide.io.serialization import load, save_routers
    model = wrapped(k=2, dense=(0, 2))
    ids = ids_of(2, 10)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    save_routers(model, tmp_path / "r")
    saved = json.loads((tmp_path / "r" / "wide_config.json").read_text())["wide_config"]
    assert (saved["attn_rule"], saved["attn_skip"], saved["attn_dense_layers"]) == ("skip_smallest", 2, [0, 2])
    again = load(tiny_model("llama", seed=0, **TINY), tmp_path / "r")
    assert again.wide_state.config == model.wide_state.config
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, ref)


def test_directories_before_the_fields_load_as_the_independent_rule(tmp_path):
    from wide.io.serialization import load, save_routers
    model = wide.wrap(tiny_model("llama", seed=0, **TINY), wide.WideConfig(ffn_group_size=32), seed=0)
    save_routers(model, tmp_path / "old")
    path = tmp_path / "old" / "wide_config.json"
    meta = json.loads(path.read_text())
    for key in ("attn_rule", "attn_skip", "attn_dense_layers"):
        del meta["wide_config"][key]
    path.write_text(json.dumps(meta))
    (tmp_path / "old" / "wide_manifest.json").unlink()
    cfg = load(tiny_model("llama", seed=0, **TINY), tmp_path / "old", require_manifest=False).wide_state.config
    assert (cfg.attn_rule, cfg.attn_skip, cfg.attn_dense_layers) == ("independent", 1, [])


# ------------------------------------------------------------------ records and offsets


def test_records_count_the_rule_and_the_dense_layers():
    model = wrapped(k=1, dense=(0,))
    ids = ids_of(2, 12)
    with torch.no_grad(), wide.track_sparsity(model) as tracker:
        model(input_ids=ids)
    sp = tracker.summary()
    assert sp.per_layer["attn"] == [0.0, 0.25, 0.25]
    assert sp.attn_rate == pytest.approx(0.5 / 3)
    assert sp.linear["q"] == pytest.approx(0.5 / 3) and sp.linear["o"] == pytest.approx(0.5 / 3)
    assert sp.attn_core_rate == pytest.approx(0.5 / 3)
    assert sp.linear["k"] == 0.0


def test_offsets_leave_the_rule_alone():
    ids = ids_of(2, 16)
    attn_only = wrapped(k=1, sparse_target="attention")
    with pytest.warns(UserWarning, match="nothing to calibrate"):
        assert wide.calibrate_offsets(attn_only, [ids], target=0.3) == {}
    model = wrapped(k=1, loss_mode="groups")
    offsets = wide.calibrate_offsets(model, [ids], target=0.3)
    assert set(offsets) == {f"{i}.ffn" for i in range(3)}  # attention routers keep offset 0
    assert all(float(model.wide_routers[i].attn.offset) == 0 for i in (1, 2))
    with torch.no_grad(), wide.track_sparsity(model) as tracker:
        model(input_ids=ids)
    sp = tracker.summary()
    # the group rate is the mean of attention's fixed (0 + 1/4 + 1/4) / 3 and the FFN's calibrated rate
    assert sp.attn_rate == pytest.approx(0.5 / 3)
    assert sp.group_rate == pytest.approx(0.3, abs=0.01)


# ------------------------------------------------------------------ the engine


def hf_decode_steps(model, ids, start):
    with torch.no_grad():
        out = model(input_ids=ids[:, :start], use_cache=True)
        for t in range(start, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(model, out))
            yield t, out.logits[:, -1]


@pytest.mark.parametrize("backend,k", [("triton", 1), ("torch", 1), ("torch", 2)])
def test_engine_runs_the_rule_in_prefill_and_decode(backend, k):
    model = wrapped(seed=4, k=k)
    ids = ids_of(2, 14, seed=5)
    eng = wide.accelerate(model, backend=backend)
    assert eng.routing == f"skip_smallest{k}"
    with torch.no_grad(), recording_masks(model) as rec:
        ref = model(input_ids=ids).logits
    assert rel(eng.logits(ids), ref) < 1e-5
    for B in (2, 1):  # batch 1 on the kernels leaves the FFN's router (only) to the GEMVs
        eng.setup_cache(B, 32)
        eng.prefill(ids[:B, :9])
        for t, want in hf_decode_steps(model, ids[:B], 9):
            masks = []
            got = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long), record=masks)
            assert rel(got, want) < 1e-5, (B, t)
            attn = {layer: m for layer, kind, m in masks if kind == "attn"}
            assert attn[0] is None  # the dense layer runs dense
            for layer in (1, 2):
                assert ((~attn[layer]).sum(-1) == k).all()
                assert torch.equal(attn[layer], rec[(layer, "attn")][0][:B, t])
    prompt = ids[0, :6].tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert eng.generate([prompt], max_new_tokens=5).tokens[0] == seq[len(prompt):]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_hybrid_engine_runs_the_rule(backend):
    from test_engine_fine import check_decode, model_with_thresholds
    model = model_with_thresholds(seed=13, attn_group_size=1, attn_rule="skip_smallest", attn_skip=1,
                                  attn_dense_layers=[0])
    eng = wide.accelerate(model, backend=backend, mode="hybrid")
    assert eng.routing == "skip_smallest1"
    check_decode(model, eng, "hybrid", batches=(2, 1), start=10, end=13)


def test_engine_refuses_tiles_and_batch_shared_with_the_rule():
    with pytest.raises(ValueError, match="per-token routing only.*tile of 4"):
        wide.accelerate(wrapped(route_tile=4), backend="torch")
    with pytest.raises(ValueError, match="per-token routing only.*batch-shared"):
        wide.accelerate(wrapped(), backend="torch", batch_shared=True)
    with pytest.raises(ValueError, match="attn_rule='skip_smallest'"):
        with batch_shared_decode(wrapped()):
            pass


@pytest.mark.parametrize("tile", [1, 4])
def test_engine_keeps_dense_layers_dense_under_the_independent_rule(tile):
    # attn_dense_layers alone: layer 1 has no attention router, in the HF path and the engine
    # (the tile rule keeps no mask for it: a reused step must not read an empty store)
    model = wide.wrap(tiny_model("llama", seed=2, **TINY),
                      wide.WideConfig(ffn_group_size=32, router_init="random", attn_dense_layers=[1], route_tile=tile),
                      seed=2)
    wide.calibrate_offsets(model, [ids_of(2, 16)], target=0.5, mode="per_module", rounds=1)
    assert model.wide_routers[1].attn is None and model.wide_routers[0].attn is not None
    ids = ids_of(1, 14, seed=6)
    eng = wide.accelerate(model, backend="torch")
    with torch.no_grad():
        assert rel(eng.logits(ids), model(input_ids=ids).logits) < 1e-5
    eng.setup_cache(1, 32)
    eng.prefill(ids[:, :9])
    for t, want in hf_decode_steps(model, ids, 9):
        masks = []
        got = eng.decode(ids[:, t], torch.full((1,), t, dtype=torch.long), record=masks, positions=[t])
        assert rel(got, want) < 1e-5, t
        assert [m for layer, kind, m in masks if kind == "attn"][1] is None


def test_group_rule_picks_per_module():
    cfg = wide.WideConfig(attn_rule="skip_smallest", attn_skip=2)
    assert isinstance(group_rules.group_rule(cfg, "attn"), group_rules.SkipSmallest)
    assert isinstance(group_rules.group_rule(cfg, "ffn"), group_rules.Independent)
    assert isinstance(group_rules.group_rule(wide.WideConfig(), "attn"), group_rules.Independent)


def test_records_name_the_rule():
    from wide.commands.runs import routing_name
    from wide.method.config import routing_name as config_name

    assert config_name() == "token" and config_name(attn_rule="skip_smallest", attn_skip=2) == "skip_smallest2"
    assert config_name(4, "previous", "skip_smallest", 1) == "tile4prev+skip_smallest1"
    assert routing_name({"wide_config": {"attn_rule": "skip_smallest", "attn_skip": 1}}) == "skip_smallest1"
    assert routing_name({"wide_config": {"route_tile": 8}}) == "tile8"  # a directory predating the rule


# ------------------------------------------------------------------ at most k: skip_upto


def test_skip_upto_skips_the_smallest_only_below_zero():
    m = torch.tensor([[-2.0, -1.0, 3.0, 0.5], [1.0, 2.0, 3.0, 4.0], [-1.0, -3.0, -2.0, 5.0]])
    runs = group_rules.SkipUpTo(2).runs(m)
    assert runs.tolist() == [[False, False, True, True], [True, True, True, True], [True, False, False, True]]
    assert group_rules.SkipUpTo(1).runs(m).tolist() == [[False, True, True, True], [True] * 4,
                                                        [True, False, True, True]]
    vals, share = group_rules.SkipUpTo(2).decision_margins(m)
    assert share == 0.5 and torch.equal(vals.sort(-1).values, torch.tensor([[-2.0, -1.0], [1.0, 2.0], [-3.0, -2.0]]))


def test_skip_upto_offsets_set_the_rate_in_the_records_and_the_engine():
    # the rate moves with the offsets, so offset calibration sets it; the engine runs the same masks
    model = wrapped(k=1, sparse_target="attention", attn_rule="skip_upto", loss_mode="groups")
    ids = ids_of(4, 24, seed=8)
    offsets = wide.calibrate_offsets(model, [ids], target=0.12)
    assert set(offsets) == {"1.attn", "2.attn"}
    with torch.no_grad(), wide.track_sparsity(model) as tracker, recording_masks(model) as rec:
        ref = model(input_ids=ids).logits
    sp = tracker.summary()
    assert sp.attn_rate == pytest.approx(0.12, abs=0.01)  # layer 0 dense counts as 0
    for layer in (1, 2):
        skipped = (~rec[(layer, "attn")][0].bool()).sum(-1)
        assert int(skipped.max()) <= 1 and 0 < float((skipped == 1).float().mean()) < 1
    eng = wide.accelerate(model, backend="torch")
    assert eng.routing == "skip_upto1"
    assert rel(eng.logits(ids), ref) < 1e-5
    with pytest.raises(ValueError, match="skips at most"):
        wide.calibrate_offsets(model, [ids], target=0.3, mode="per_module")
