"""How a config cuts a model's modules into groups: the model's dimensions (``ModelDims``), the
groups and what each costs (``Geometry``, ``resolve_geometry``), the projections' shapes."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import arch
from .config import WideConfig


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelDims":
        model_type = arch.spec_for(cfg).model_type
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            model_type=model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )


@dataclass(frozen=True)
class Geometry:
    """How a config cuts one model's modules into groups, and what each group costs."""

    dims: ModelDims
    attn_group_size: int  # query heads per group
    ffn_group_size: int  # intermediate channels per group

    @property
    def attn_groups(self) -> int:
        return self.dims.num_heads // self.attn_group_size

    @property
    def ffn_groups(self) -> int:
        return self.dims.intermediate_size // self.ffn_group_size

    def groups(self, kind: str) -> int:
        return self.attn_groups if kind == "attn" else self.ffn_groups

    def group_macs(self, kind: str) -> int:
        """Multiply-accumulates one token saves by skipping one group of this module."""
        h = self.dims.hidden_size
        if kind == "attn":  # q rows + o columns of the group's heads
            return 2 * self.attn_group_size * self.dims.head_dim * h
        return 3 * self.ffn_group_size * h  # gate + up columns, down rows

    def module_macs(self, kind: str) -> int:
        return self.group_macs(kind) * self.groups(kind)

    def columns(self, kind: str) -> int:
        """Width of the reduction projection's input that one group owns."""
        return self.attn_group_size * self.dims.head_dim if kind == "attn" else self.ffn_group_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Every supported model of 1B parameters or more has at least this many FFN groups of 128
# channels (Llama-3.2-1B 64, Llama-2-7B 86, Llama-3.1-8B 112).
MIN_FFN_GROUPS = 64


MAX_FFN_GROUP = 128  # the routed GEMMs' best: 256 contiguous bytes per row in bf16


def auto_ffn_group_size(intermediate: int) -> int:
    """The FFN group size ``WideConfig(ffn_group_size=None)`` picks: 128 channels (the kernels'
    best) where that cuts the FFN into at least ``MIN_FFN_GROUPS`` groups, else the largest
    multiple of 16 that does, else 16. Small models thus route about as finely as the large
    ones, which their quality needs: SmolLM2-135M at 50 % reached perplexity 49.4 with 96 groups
    of 16 against 61.3 with 12 of 128 (bench/results/routing_quality, "Finer groups")."""
    sizes = [d for d in range(16, MAX_FFN_GROUP + 1, 16) if intermediate % d == 0]
    if not sizes:
        raise ValueError(f"intermediate_size={intermediate} has no divisor that is a multiple of 16 up to "
                         f"{MAX_FFN_GROUP}; pass ffn_group_size (a divisor of it: {_divisors(intermediate)[:12]})")
    fine_enough = [d for d in sizes if intermediate // d >= MIN_FFN_GROUPS]
    return max(fine_enough) if fine_enough else min(sizes)


def resolve_geometry(dims: ModelDims, config: WideConfig) -> Geometry:
    """Check group sizes against the model before any compute."""
    attn = config.attn_group_size or dims.num_heads // dims.num_kv_heads
    if dims.num_heads % attn:
        raise ValueError(
            f"attn_group_size={attn} does not divide the model's {dims.num_heads} query heads; "
            f"valid sizes: {_divisors(dims.num_heads)}"
        )
    ffn = config.ffn_group_size or auto_ffn_group_size(dims.intermediate_size)
    if dims.intermediate_size % ffn:
        good = [d for d in _divisors(dims.intermediate_size) if d % 16 == 0]
        raise ValueError(
            f"ffn_group_size={ffn} does not divide intermediate_size={dims.intermediate_size}; "
            f"sizes that divide it and suit the GPU kernels (multiples of 16): {good}"
        )
    groups = dims.num_heads // attn
    if config.attn_rule != "independent" and not 1 <= config.attn_skip < groups:
        raise ValueError(f"attn_skip={config.attn_skip}: the {config.attn_rule} rule skips at least 1 and fewer than the "
                         f"{groups} attention groups of this model (attn_group_size={attn})")
    far = [i for i in config.attn_dense_layers if i >= dims.num_layers]
    if far:
        raise ValueError(f"attn_dense_layers={config.attn_dense_layers}: the model has {dims.num_layers} layers "
                         f"(0..{dims.num_layers - 1}), not {far}")
    return Geometry(dims, attn, ffn)


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def projection_shapes(dims: ModelDims) -> dict:
    """projection -> (output features, input features): the MACs one token spends in it dense."""
    h, q = dims.hidden_size, dims.num_heads * dims.head_dim
    kv, i = dims.num_kv_heads * dims.head_dim, dims.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}


def dense_macs_per_token(dims: ModelDims) -> int:
    """All linear-layer MACs per token (embeddings excluded), for reporting."""
    h = dims.hidden_size
    attn = h * dims.num_heads * dims.head_dim * 2 + h * dims.num_kv_heads * dims.head_dim * 2
    ffn = 3 * h * dims.intermediate_size
    return dims.num_layers * (attn + ffn) + h * dims.vocab_size


__all__ = [
    "ModelDims", "Geometry", "auto_ffn_group_size", "resolve_geometry", "dense_macs_per_token", "PROJECTIONS",
    "projection_shapes"
]
