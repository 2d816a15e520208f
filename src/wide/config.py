"""WideConfig: what is routed, how finely, and how hard the sparsity is pushed.

One config describes WIDE and the baselines built from the same machinery:
module skipping is WIDE with a single group per module, dynamic depth pruning is module
skipping with one decision per layer (``tie_modules``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SPARSE_TARGETS = ("attention", "ffn", "all")
LOSS_MODES = ("flops", "groups")
ROUTER_INPUTS = ("residual", "normed")


@dataclass
class WideConfig:
    # Fraction of routable work to skip. With ``loss_mode="flops"`` it is the share of the
    # routable MACs (q+o for attention, gate+up+down for the FFN); with "groups" the
    # unweighted mean of the attention and FFN group rates (the paper's definition).
    target_sparsity: float = 0.5
    # Separate targets per module type; when both are set the penalty is the mean of the
    # two absolute gaps (docs/method.md, "Sparsity and loss") and ``target_sparsity`` is ignored.
    attn_target: Optional[float] = None
    ffn_target: Optional[float] = None
    sparse_target: str = "all"
    # Query heads per attention group. None = query heads per KV head, so a group is one
    # GQA pack and a skipped group never needs a K/V head the others do not need.
    attn_group_size: Optional[int] = None
    # Intermediate channels per FFN group. Multiples of 16 keep the GPU kernels usable.
    ffn_group_size: int = 128
    router_rank: int = 16
    router_input: str = "residual"
    loss_mode: str = "flops"
    sparsity_coef: float = 20.0
    tau_start: float = 5.0
    tau_end: float = 0.5
    # One decision per layer, shared by attention and FFN (dynamic depth pruning baseline).
    tie_modules: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.sparse_target not in SPARSE_TARGETS:
            raise ValueError(f"sparse_target must be one of {SPARSE_TARGETS}, got {self.sparse_target!r}")
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {self.loss_mode!r}")
        if self.router_input not in ROUTER_INPUTS:
            raise ValueError(f"router_input must be one of {ROUTER_INPUTS}, got {self.router_input!r}")
        for name in ("target_sparsity", "attn_target", "ffn_target"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {v}")
        if (self.attn_target is None) != (self.ffn_target is None):
            raise ValueError("set both attn_target and ffn_target, or neither")
        if self.attn_target is not None and self.sparse_target != "all":
            raise ValueError("separate attn/ffn targets need sparse_target='all'")
        if self.router_rank < 1:
            raise ValueError(f"router_rank must be >= 1, got {self.router_rank}")
        if self.ffn_group_size < 1 or (self.attn_group_size is not None and self.attn_group_size < 1):
            raise ValueError("group sizes must be positive")
        if not self.tau_start > 0 or not self.tau_end > 0:
            raise ValueError("Gumbel temperatures must be positive")
        if self.tie_modules and self.sparse_target != "all":
            raise ValueError("tie_modules (dynamic depth) routes both modules: use sparse_target='all'")

    @property
    def routes_attention(self) -> bool:
        return self.sparse_target in ("attention", "all")

    @property
    def routes_ffn(self) -> bool:
        return self.sparse_target in ("ffn", "all")

    def temperature(self, step: int, total_steps: int) -> float:
        """Linear fall from tau_start to tau_end over the optimizer steps."""
        if total_steps <= 1:
            return self.tau_end
        frac = min(max(step / (total_steps - 1), 0.0), 1.0)
        return self.tau_start + (self.tau_end - self.tau_start) * frac

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WideConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown WideConfig fields {sorted(unknown)}: written by a newer version of wide?")
        return cls(**d)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path) -> "WideConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
