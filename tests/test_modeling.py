"""Routed forward passes against dense and against a hand-written masked Llama forward."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import wide
from wide.method.state import get_state


def random_masks(model, seed=1, p=0.5):
    """Fixed random 0/1 masks per (layer, kind), installed through the state's mask_fn."""
    state = get_state(model)
    g = torch.Generator().manual_seed(seed)
    masks = {}

    def fn(layer, kind, x):
        key = (layer, kind, tuple(x.shape[:2]))
        if key not in masks:
            groups = state.geometry.groups(kind)
            masks[key] = (torch.rand(*x.shape[:2], groups, generator=g) >= p).float()
        return masks[key]

    state.mask_fn = fn
    return masks


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def lin(module, x):
    # F.linear on the weights: calling the module would run wide's hooks.
    return F.linear(x, module.weight, module.bias)


def manual_forward(model, ids, masks):
    """Llama/Qwen forward written out by hand, with routing applied where the method says:
    masked Q rows, no attention for skipped heads, masked gate/up columns."""
    cfg = model.config
    m = model.model
    T = ids.shape[1]
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    geo = get_state(model).geometry
    x = m.embed_tokens(ids)
    pos = torch.arange(T)[None]
    cos, sin = m.rotary_emb(x, pos)
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
    causal = torch.full((T, T), float("-inf")).triu(1)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        am = masks.get((i, "attn", tuple(ids.shape)), torch.ones(*ids.shape, geo.attn_groups))
        head_mask = am.repeat_interleave(geo.attn_group_size, -1)  # [B, T, H]
        q = lin(a.q_proj, h).view(*ids.shape, H, D) * head_mask[..., None]  # skipped q rows not computed
        k = lin(a.k_proj, h).view(*ids.shape, Hkv, D)
        v = lin(a.v_proj, h).view(*ids.shape, Hkv, D)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = H // Hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D) + causal
        o = att.softmax(-1) @ v  # [B, H, T, D]
        o = o.transpose(1, 2) * head_mask[..., None]  # skipped heads produce nothing
        x = x + lin(a.o_proj, o.reshape(*ids.shape, H * D))
        mlp = layer.mlp
        h = rms(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        fm = masks.get((i, "ffn", tuple(ids.shape)), torch.ones(*ids.shape, geo.ffn_groups))
        col = fm.repeat_interleave(geo.ffn_group_size, -1)
        inter = F.silu(lin(mlp.gate_proj, h) * col) * (lin(mlp.up_proj, h) * col)
        x = x + lin(mlp.down_proj, inter)
    x = rms(x, m.norm.weight, m.norm.variance_epsilon)
    return lin(model.lm_head, x)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_all_groups_kept_equals_dense(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, 96, (2, 11))
    dense = model(ids).logits
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32))
    for lr in model.wide_routers:  # every group executes
        for r in (lr.attn, lr.ffn):
            r.offset.fill_(1e6)
    routed = model(ids).logits
    torch.testing.assert_close(routed, dense, rtol=0, atol=0)
    assert wide.forward_sparsity(model).flop_rate == 0


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("sparse_target", ["all", "attention", "ffn"])
def test_random_masks_match_hand_written_forward(model_type, sparse_target):
    model = tiny_model(model_type)
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=16, attn_group_size=1, sparse_target=sparse_target))
    masks = random_masks(model)
    ids = torch.randint(0, 96, (2, 9))
    routed = model(ids).logits
    routed_kinds = {"all": ("attn", "ffn"), "attention": ("attn",), "ffn": ("ffn",)}[sparse_target]
    assert {k[1] for k in masks} == set(routed_kinds)  # unrouted modules are never masked
    expected = manual_forward(model, ids, masks)
    torch.testing.assert_close(routed, expected, rtol=1e-4, atol=1e-5)
    dense = manual_forward(model, ids, {})
    torch.testing.assert_close(dense, tiny_model(model_type)(ids).logits, rtol=1e-4, atol=1e-5)
    assert (routed - dense).abs().max() > 1e-3  # the masks did something


def test_kv_cache_is_dense_whatever_the_routing(llama):
    ids = torch.randint(0, 96, (1, 7))
    dense_kv = llama(ids, use_cache=True).past_key_values
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    get_state(llama).mask_fn = lambda layer, kind, x: torch.zeros(*x.shape[:2], get_state(llama).geometry.groups(kind))
    routed = llama(ids, use_cache=True)
    kv = routed.past_key_values
    # Layer 0 sees the same input, so its K/V are identical; every layer caches every head.
    k0d, v0d = dense_kv.layers[0].keys, dense_kv.layers[0].values
    torch.testing.assert_close(kv.layers[0].keys, k0d, rtol=0, atol=0)
    torch.testing.assert_close(kv.layers[0].values, v0d, rtol=0, atol=0)
    for layer in kv.layers:
        assert layer.keys.shape == k0d.shape
        assert (layer.keys.abs().sum(-1) > 0).all()  # no head left empty
    assert wide.forward_sparsity(llama).flop_rate == 1


def test_generation_with_cache_matches_full_forward(llama):
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    ids = torch.randint(0, 96, (1, 6))
    out = llama.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    # Routing is per token and K/V are dense, so incremental decoding equals a full pass.
    full = llama(out[:, :-1]).logits
    assert torch.equal(full[0, 5:].argmax(-1), out[0, 6:])


def test_gradients_reach_only_the_routers(llama):
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    wide.freeze_backbone(llama)
    llama.train()
    get_state(llama).tau = 1.0
    ids = torch.randint(0, 96, (2, 8))
    out = llama(ids, labels=ids)
    loss, _ = wide.sparsity_loss(llama)
    (out.loss + loss).backward()
    for name, p in llama.named_parameters():
        if name.startswith("wide_routers"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_training_masks_are_hard_and_inference_deterministic(llama):
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    state = get_state(llama)
    seen = []
    state.mask_observers.append(lambda layer, kind, mask, valid: seen.append(mask))
    llama.train()
    state.tau = 2.0
    llama(torch.randint(0, 96, (1, 5)))
    assert all(((m == 0) | (m == 1)).all() for m in seen)
    llama.eval()
    ids = torch.randint(0, 96, (1, 5))
    assert torch.equal(llama(ids).logits, llama(ids).logits)


def test_routers_stay_fp32_under_dtype_casts(llama):
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    llama.to(torch.bfloat16)
    assert llama.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in llama.wide_routers.parameters())
    llama(torch.randint(0, 96, (1, 4)))  # runs with a bf16 backbone


def test_padding_is_excluded_from_rates(llama):
    wide.wrap(llama, wide.WideConfig(ffn_group_size=32, router_init="random"))
    state = get_state(llama)
    state.mask_fn = lambda layer, kind, x: torch.cat(
        [torch.ones(x.shape[0], 3, state.geometry.groups(kind)), torch.zeros(x.shape[0], x.shape[1] - 3, state.geometry.groups(kind))], 1)
    ids = torch.randint(0, 96, (2, 6))
    am = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    llama(ids, attention_mask=am)
    assert float(wide.forward_sparsity(llama).flop_rate) == 0.0  # skipped tokens were padding
    llama(ids)
    assert float(wide.forward_sparsity(llama).flop_rate) == 0.5


@pytest.mark.parametrize("intermediate, size", [
    (14336, 128),  # Llama-3.1-8B: 112 groups of 128, the kernels' best
    (11008, 128),  # Llama-2-7B: 86
    (8192, 128),  # Llama-3.2-1B: exactly 64
    (4864, 64),  # Qwen2.5-0.5B: 38 groups of 128 are too few, 76 of 64
    (3072, 48),  # Qwen3-0.6B: a multiple of 16 that is no power of two
    (1536, 16),  # SmolLM2-135M: 96 groups
    (96, 16),  # tiny: no size gives 64 groups, so the finest
])
def test_auto_ffn_group_size(intermediate, size):
    from wide.method.geometry import auto_ffn_group_size

    assert auto_ffn_group_size(intermediate) == size


def test_auto_ffn_group_size_is_stored(tmp_path):
    """wrap() writes the size it picked into the config, so saved routers name their geometry and
    load into a model wrapped with the default config; an explicit size still wins."""
    model = wide.wrap(tiny_model("llama"), wide.WideConfig())
    assert model.wide_config.ffn_group_size == 16 and get_state(model).geometry.ffn_groups == 6
    wide.save_routers(model, tmp_path / "r")
    again = wide.load(tiny_model("llama"), tmp_path / "r")
    assert again.wide_config.ffn_group_size == 16
    wide.load(wide.wrap(tiny_model("llama"), wide.WideConfig()), tmp_path / "r")  # same config: loads
    with pytest.raises(wide.CheckpointError, match="ffn_group_size: checkpoint 16 vs model 32"):
        wide.load(wide.wrap(tiny_model("llama"), wide.WideConfig(ffn_group_size=32)), tmp_path / "r")
    with pytest.raises(ValueError, match="intermediate_size=100 has no divisor that is a multiple of 16"):
        wide.wrap(tiny_model("llama", intermediate_size=100))
    assert wide.wrap(tiny_model("llama", intermediate_size=100), wide.WideConfig(ffn_group_size=25)) \
        .wide_state.geometry.ffn_groups == 4
