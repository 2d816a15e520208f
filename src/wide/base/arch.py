"""The architecture registry: what wide needs to know about each model family, in one place.

Every module that touches a backbone's structure (the routing hooks, static pruning, LoRA
targets, FSDP sharding, the fast engine, the memory estimator, the test fixtures) reads an
:class:`ArchSpec` from here instead of spelling out module names. Adding an architecture is
one entry in ``ARCHS`` (plus its tests); a family outside the registry is refused with the
list of those inside it.

Names are attribute paths relative to the causal LM (``model``), to one decoder layer, or to
the layer's attention / MLP module, as noted on each field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

KINDS = ("attn", "ffn")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    # Paths from the causal LM.
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    # Paths from a decoder layer.
    attn: str = "self_attn"
    mlp: str = "mlp"
    # The norm in front of each routed module: its input is the residual stream the router
    # reads (``router_input="residual"``), its output the normed input ("normed").
    attn_norm: str = "input_layernorm"
    ffn_norm: str = "post_attention_layernorm"
    # Projections, relative to the attention / MLP module. ``o`` and ``down`` are the
    # reduction projections whose input columns a skipped group zeroes.
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    # Per-head RMSNorms of q and k before RoPE (Qwen3), relative to the attention module.
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    # Projections that may carry a bias (Qwen2: q, k, v). A bias anywhere else is refused by
    # the fast engine; the masked PyTorch path runs whatever the HF module does.
    bias_ok: tuple = ()
    # Gated MLP activation: act(gate(x)) * up(x). The GPU kernels implement SiLU only.
    activation: str = "silu"
    # Embedding output multiplier (Gemma-style sqrt(hidden)); None = embeddings as they are.
    embed_scale: Optional[float] = None
    # Whether wide.accelerate (the static-cache engine) runs this family.
    engine: bool = True

    @property
    def projections(self) -> dict:
        """Role -> (layer sub-module, attribute) for the seven linear projections."""
        return {"q": (self.attn, self.q), "k": (self.attn, self.k), "v": (self.attn, self.v),
                "o": (self.attn, self.o), "gate": (self.mlp, self.gate), "up": (self.mlp, self.up),
                "down": (self.mlp, self.down)}

    @property
    def lora_targets(self) -> tuple:
        """PEFT ``target_modules``: the leaf names of every linear projection."""
        return tuple(name for _, name in self.projections.values())

    def norm_name(self, kind: str) -> str:
        return self.attn_norm if kind == "attn" else self.ffn_norm


ARCHS = {
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", bias_ok=("q", "k", "v")),
    "qwen3": ArchSpec("qwen3", q_norm="q_norm", k_norm="k_norm"),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHS)


class UnsupportedArchitecture(ValueError):
    pass


def spec_for(config_or_model) -> ArchSpec:
    """The spec of a HF config, or of a model (its ``.config``)."""
    cfg = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(cfg, "model_type", None)
    spec = ARCHS.get(model_type)
    if spec is None:
        raise UnsupportedArchitecture(
            f"wide supports the Llama-family architectures {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model is {model_type!r} (add an ArchSpec to wide.base.arch.ARCHS to route another)")
    return spec


def get_path(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def require_path(root: nn.Module, path: str, spec: ArchSpec, where: str = "model"):
    """``get_path``, refusing the model when the spec's path leads nowhere."""
    obj = get_path(root, path)
    if obj is None:
        raise UnsupportedArchitecture(f"{where} has no {path}: unsupported {spec.model_type} variant")
    return obj


def decoder_layers(model) -> nn.ModuleList:
    spec = spec_for(model)
    return require_path(model, spec.layers, spec)


def projection(layer: nn.Module, spec: ArchSpec, role: str) -> nn.Module:
    """One of q, k, v, o, gate, up, down of a decoder layer."""
    parent, name = spec.projections[role]
    return getattr(getattr(layer, parent), name)


def share_projection_weights(layer: nn.Module, spec: ArchSpec, views: dict) -> None:
    """Point the layer's projection weights (role -> a tensor of the same shape, dtype, device
    and values) at an engine's copy, so that the model keeps one copy of each weight: its own
    storage is freed where nothing else holds it. The parameters stay the same objects with
    the same values; only their storage (and so their strides) changes."""
    with torch.no_grad():
        for role, v in views.items():
            p = projection(layer, spec, role).weight
            if p.shape != v.shape or p.dtype != v.dtype or p.device != v.device:
                raise ValueError(f"cannot share {role}: {tuple(p.shape)} {p.dtype} {p.device} vs "
                                 f"{tuple(v.shape)} {v.dtype} {v.device}")
            p.data = v


def reduction_projection(layer: nn.Module, spec: ArchSpec, kind: str) -> nn.Module:
    """The projection whose input columns a skipped group of ``kind`` zeroes: o or down."""
    return projection(layer, spec, "o" if kind == "attn" else "down")


def module_norm(layer: nn.Module, spec: ArchSpec, kind: str) -> nn.Module:
    return getattr(layer, spec.norm_name(kind))


def check_layer(layer: nn.Module, spec: ArchSpec, idx: int) -> None:
    """Every module the spec names exists in decoder layer ``idx``."""
    paths = [spec.attn_norm, spec.ffn_norm] + [f"{p}.{n}" for p, n in spec.projections.values()]
    paths += [f"{spec.attn}.{n}" for n in (spec.q_norm, spec.k_norm) if n]
    for path in paths:
        require_path(layer, path, spec, f"decoder layer {idx}")


# ---------------------------------------------------------------- named shapes

# Configurations of public checkpoints, for the memory estimator (``wide calibrate --dry-run``)
# and the speed benchmarks (random weights of the real shapes).
PRESETS = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    # 28 query heads over 4 KV heads: a GQA pack is 7 heads, and K/V (1024 columns) do not
    # fill a whole number of 896-column query groups.
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, use_sliding_window=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, attention_bias=False),
}


def hf_config(model: str, **overrides):
    """A transformers config from a preset name (``PRESETS``) or a local HF model directory."""
    from pathlib import Path

    from transformers import AutoConfig

    if model.lower() in PRESETS:
        return AutoConfig.for_model(**{**PRESETS[model.lower()], **overrides})
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json")
    return AutoConfig.from_pretrained(model, **overrides)


__all__ = ["KINDS", "ArchSpec", "ARCHS", "SUPPORTED_MODEL_TYPES", "UnsupportedArchitecture", "spec_for",
           "get_path", "require_path", "decoder_layers", "projection", "reduction_projection", "module_norm", "check_layer",
           "PRESETS", "hf_config"]
