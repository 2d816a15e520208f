"""Baselines against hand-written references: static width = explicitly zeroed weights,
dynamic depth = residual pass-through per token with K/V still computed, module skipping =
dropped module outputs per token; and the FLOP budget matching of static pruning."""

import pytest
import torch
from conftest import tiny_config, tiny_model

import wide
from wide.method import baselines
from wide.method.geometry import Geometry, ModelDims
from wide.method.state import get_state


def batches(n=2, seed=0):
    return [torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(seed + i)) for i in range(n)]


def test_static_width_equals_explicitly_zeroed_weights():
    model = tiny_model("llama")
    cfg = baselines.method_config("static_width", model.config, 0.5, ffn_group_size=16)
    wide.wrap(model, cfg)
    pruning = baselines.static_width(model, batches(), 0.5)
    geo = get_state(model).geometry
    ref = tiny_model("llama")  # same seed, same weights
    removed = 0
    with torch.no_grad():
        for (layer, kind), keep in pruning.keep.items():
            cols = geo.columns(kind)
            proj = ref.model.layers[layer].self_attn.o_proj if kind == "attn" else ref.model.layers[layer].mlp.down_proj
            for g in torch.nonzero(~keep).flatten().tolist():
                proj.weight[:, g * cols:(g + 1) * cols] = 0  # the group's heads / channels are gone
                removed += 1
    assert removed > 0
    ids = batches(1, seed=7)[0]
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    # every token uses the same mask
    with wide.track_sparsity(model) as tr:
        model(ids)
    assert float(tr.summary().flop_rate) == pytest.approx(pruning.rates(geo)["flop_rate"], abs=1e-6)


def test_channel_importance_by_hand():
    model = tiny_model("llama")
    seen = {}
    layer = model.model.layers[1]
    h = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("x", []).append(a[0].detach()))
    bs = batches()
    imp = baselines.channel_importance(model, bs)
    h.remove()
    # the measuring hooks are gone again and the hand hook saw the same activations
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen["x"]])
    expected = layer.mlp.down_proj.weight.norm(dim=0) * x.abs().mean(0)
    torch.testing.assert_close(imp[(1, "ffn")], expected, rtol=1e-5, atol=1e-7)


def dims():
    return ModelDims(model_type="llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=96)


@pytest.mark.parametrize("target", [0.1, 0.25, 0.5, 0.75])
@pytest.mark.parametrize("normalize", ["module", "layer", "none"])
def test_static_selection_matches_the_flop_budget(target, normalize):
    geo = Geometry(dims(), attn_group_size=2, ffn_group_size=32)  # attn group 4096 MACs, ffn group 6144
    g = torch.Generator().manual_seed(1)
    scores = {(l, k): torch.rand(geo.groups(k), generator=g) for l in range(3) for k in ("attn", "ffn")}
    keep = baselines.select_groups(scores, geo, target, normalize)
    total = sum(geo.module_macs(k) for k in ("attn", "ffn")) * 3
    removed = sum(int((~v).sum()) * geo.group_macs(k) for (_, k), v in keep.items())
    # as close as the group sizes allow: within half of the smallest group's cost
    assert abs(removed - target * total) <= geo.group_macs("attn") / 2 + 1e-6
    rate = baselines.StaticPruning(keep, target).rates(geo)["flop_rate"]
    assert rate == pytest.approx(removed / total)


def test_static_selection_removes_the_least_important_groups():
    geo = Geometry(dims(), attn_group_size=4, ffn_group_size=96)  # one group each, equal-ish costs
    scores = {(0, "attn"): torch.tensor([5.0]), (1, "attn"): torch.tensor([1.0]), (2, "attn"): torch.tensor([3.0]),
              (0, "ffn"): torch.tensor([0.5]), (1, "ffn"): torch.tensor([4.0]), (2, "ffn"): torch.tensor([2.0])}
    keep = baselines.select_groups(scores, geo, 0.2, normalize="none")
    pruned = {k for k, v in keep.items() if not v.all()}
    assert pruned == {(0, "ffn")}  # 18432 of 73728 MACs removed: closest to 20%


def _decoder_output_hook(fn):
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (fn(args[0], out[0]),) + tuple(out[1:])
        return fn(args[0], out)
    return hook


def test_dynamic_depth_passes_the_residual_through_with_kv_computed():
    model = tiny_model("llama")
    wide.wrap(model, baselines.dynamic_depth_config(model.config, 0.5))
    ids = batches(1, seed=3)[0]
    g = torch.Generator().manual_seed(5)
    run = {l: (torch.rand(*ids.shape, 1, generator=g) > 0.5).float() for l in range(2)}
    run[0][0, 0] = 0.0  # a skipped token that later tokens still attend to
    get_state(model).mask_fn = lambda layer, kind, x: run[layer]
    out = model(ids).logits

    # Reference: each decoder layer runs densely on every token (so every token's K/V exist),
    # then the skipped tokens' outputs are replaced by the layer's input.
    ref = tiny_model("llama")
    for l, layer in enumerate(ref.model.layers):
        keep = run[l]
        layer.register_forward_hook(_decoder_output_hook(lambda x, y, keep=keep: keep * y + (1 - keep) * x),
                                    )
    torch.testing.assert_close(out, ref(ids).logits, rtol=1e-5, atol=1e-5)
    # the shared decision: attention and FFN rates are equal, and the FLOP rate is the skip rate
    with wide.track_sparsity(model) as tr:
        model(ids)
    sp = tr.summary()
    skip = 1 - sum(float(m.mean()) for m in run.values()) / 2
    assert float(sp.attn_rate) == pytest.approx(skip) and float(sp.ffn_rate) == pytest.approx(skip)
    assert float(sp.flop_rate) == pytest.approx(skip)


def test_dynamic_depth_skipped_token_still_feeds_later_tokens():
    # If skipping also dropped the token's K/V, later tokens would change; they must not,
    # relative to a model where the token runs the layer's attention for K/V purposes.
    model = tiny_model("llama")
    wide.wrap(model, baselines.dynamic_depth_config(model.config, 0.5))
    ids = batches(1, seed=4)[0][:1]
    skip_first = torch.ones(1, ids.shape[1], 1)
    skip_first[0, 0] = 0
    get_state(model).mask_fn = lambda layer, kind, x: skip_first if layer == 1 else torch.ones_like(skip_first)
    routed = model(ids).logits
    dense = tiny_model("llama")(ids).logits
    # token 0's own output changes (layer 1 skipped for it); tokens after it are exactly dense
    assert not torch.allclose(routed[0, 0], dense[0, 0])
    torch.testing.assert_close(routed[0, 1:], dense[0, 1:], rtol=1e-5, atol=1e-5)


def test_module_skipping_drops_each_module_output_per_token():
    cfg = tiny_config()
    model = tiny_model("llama")
    wide.wrap(model, baselines.module_skip_config(model.config, 0.5))
    assert get_state(model).geometry.attn_groups == 1 and get_state(model).geometry.ffn_groups == 1
    ids = batches(1, seed=6)[0]
    g = torch.Generator().manual_seed(2)
    run = {(l, k): (torch.rand(*ids.shape, 1, generator=g) > 0.5).float() for l in range(2) for k in ("attn", "ffn")}
    get_state(model).mask_fn = lambda layer, kind, x: run[(layer, kind)]
    out = model(ids).logits
    ref = tiny_model("llama")
    for l, layer in enumerate(ref.model.layers):
        layer.self_attn.register_forward_hook(
            lambda m, a, o, keep=run[(l, "attn")]: (o[0] * keep,) + tuple(o[1:]))
        layer.mlp.register_forward_hook(lambda m, a, o, keep=run[(l, "ffn")]: o * keep)
    torch.testing.assert_close(out, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.wide_routers[0].ffn is not None and cfg.num_attention_heads == 4


def test_method_configs_and_static_persistence(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown method"):
        baselines.method_config("layerdrop", model.config, 0.5)
    wide.wrap(model, baselines.method_config("static_width", model.config, 0.25, ffn_group_size=32))
    pruning = baselines.static_width(model, batches(), 0.25)
    ids = batches(1, seed=9)[0]
    expected = model(ids).logits
    from wide.training.recovery import load_recovered, save_recovered

    save_recovered(model, tmp_path / "s", write_more=pruning.save)
    again = load_recovered(tiny_model("llama"), tmp_path / "s")
    torch.testing.assert_close(again(ids).logits, expected, rtol=0, atol=0)
