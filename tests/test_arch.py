"""The architecture registry: one spec per family, read by every module that touches structure."""

import pytest
import torch
from conftest import tiny_model

import wide
from wide.base import arch
from wide.method.geometry import ModelDims
from wide.method.state import get_state
from wide.training.recovery import LoraArgs


@pytest.mark.parametrize("model_type", arch.SUPPORTED_MODEL_TYPES)
def test_every_named_module_exists(model_type):
    model = tiny_model(model_type)
    spec = arch.spec_for(model)
    assert spec.model_type == model_type
    layers = arch.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    for i, layer in enumerate(layers):
        arch.check_layer(layer, spec, i)
        for role in spec.projections:
            proj = arch.projection(layer, spec, role)
            assert isinstance(proj, torch.nn.Linear)
            # Biases only where the spec allows them (the fast engine relies on it).
            assert proj.bias is None or role in spec.bias_ok, (model_type, role)
    for path in (spec.embed, spec.final_norm, spec.lm_head, spec.rotary):
        assert arch.get_path(model, path) is not None, path


def test_unsupported_architecture_is_named():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(arch.UnsupportedArchitecture, match=r"'gpt2'.*ARCHS"):
        arch.spec_for(cfg)
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        ModelDims.from_hf_config(cfg)


def test_missing_module_is_refused():
    model = tiny_model("qwen3")
    del model.model.layers[1].self_attn.k_norm
    with pytest.raises(arch.UnsupportedArchitecture, match=r"layer 1 has no self_attn.k_norm"):
        wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32))


def test_hooks_sit_on_the_spec_modules():
    model = wide.wrap(tiny_model("qwen2"), wide.WideConfig(router_init="random", ffn_group_size=32))
    spec = arch.spec_for(model)
    layer = arch.decoder_layers(model)[0]
    for kind in arch.KINDS:
        assert arch.module_norm(layer, spec, kind)._forward_pre_hooks
        assert arch.reduction_projection(layer, spec, kind)._forward_pre_hooks
    # the model-level pre- and post-forward hooks (new forward; the linear-MAC count), then per layer and kind
    assert len(get_state(model).handles) == 2 + 4 * len(arch.decoder_layers(model))


@pytest.mark.parametrize("model_type", arch.SUPPORTED_MODEL_TYPES)
def test_lora_targets_come_from_the_spec(model_type):
    model = tiny_model(model_type)
    lora = LoraArgs().resolved(model)
    assert set(lora.targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert LoraArgs(targets=("q_proj",)).resolved(model).targets == ("q_proj",)


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_presets_resolve(name):
    cfg = arch.hf_config(name)
    dims = ModelDims.from_hf_config(cfg)
    assert dims.num_heads % dims.num_kv_heads == 0
    assert dims.head_dim * dims.num_heads >= dims.hidden_size // 2
    assert arch.spec_for(cfg).model_type == cfg.model_type


def test_qwen25_preset_has_packs_that_kv_does_not_fill():
    dims = ModelDims.from_hf_config(arch.hf_config("qwen2.5-7b"))
    pack_cols = dims.num_heads // dims.num_kv_heads * dims.head_dim
    assert (pack_cols, 2 * dims.num_kv_heads * dims.head_dim) == (896, 1024)
