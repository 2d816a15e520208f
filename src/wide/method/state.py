"""The per-model routing state the hooks, the sparsity accounting and the offset calibration
share (``WideState``, on ``model.wide_state``), and what every forward's tokens are: valid
tokens and positions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from ..base.arch import KINDS
from .config import WideConfig
from .geometry import Geometry


@dataclass
class _Record:
    layer: int
    kind: str
    skipped: torch.Tensor  # skipped (token, group) pairs over valid tokens; differentiable
    total: torch.Tensor  # valid tokens x groups


@dataclass
class WideState:
    """Per-model routing state shared by the hooks. Not a module: nothing here is saved."""

    config: WideConfig
    geometry: Geometry
    tau: Optional[float] = None  # Gumbel temperature while training
    masks: dict = field(default_factory=dict)  # (layer, kind) -> float mask [B, T, G]
    records: list = field(default_factory=list)  # this forward's accounting
    attention_mask: Optional[torch.Tensor] = None
    # Replaces the routers' decision: fn(layer, kind, router_input) -> mask [B, T, G].
    # Used by the static baselines, analysis and tests.
    mask_fn: Optional[Callable] = None
    accumulators: Optional[dict] = None  # (layer, kind) -> [skipped, total] while tracking
    input_observers: list = field(default_factory=list)  # fn(layer, kind, router_input)
    mask_observers: list = field(default_factory=list)  # fn(layer, kind, mask, valid)
    handles: list = field(default_factory=list)
    routing: bool = True  # False inside routing_disabled(): the hooks let the dense backbone run
    # Where this forward's tokens sit (route_tile > 1 and batch-shared decode only).
    position_ids: Optional[torch.Tensor] = None
    past_length: int = 0  # tokens already in the KV cache: > 0 in a decode step
    tiles: Optional["_Tiles"] = None  # this forward's token -> tile map, built on first use
    # (layer, kind, "margin" | "mask") -> (tile [B], values [B, G]): each sequence's latest
    # tile and its decision, which the decode steps inside that tile reuse. Reset by a prefill.
    tile_store: dict = field(default_factory=dict)
    batch_shared: bool = False  # inside batch_shared_decode()
    # (layer, projection) -> [B, T] input elements each token feeds that projection, written by
    # whatever sparsifies projection inputs per element (wide.fine) and already net of the
    # columns a routed group skips; a projection absent here reads its whole routed input.
    kept_inputs: dict = field(default_factory=dict)
    shape: Optional[tuple] = None  # (B, T) of this forward's tokens
    linear_acc: Optional[dict] = None  # projection -> [kept MACs, dense MACs] while tracking
    # fn(model) run at the end of every install_hooks: other sparsity kinds' hooks (wide.fine),
    # so that they follow the modules PEFT replaces, as the routing hooks do.
    installers: list = field(default_factory=list)

    def new_forward(self, attention_mask, position_ids=None, past_length: int = 0, shape=None) -> None:
        self.masks.clear()
        self.records.clear()
        self.kept_inputs.clear()
        self.shape = shape
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.past_length = past_length
        self.tiles = None
        if past_length == 0:  # a new prefill: the tiles of the previous sequences are gone
            self.tile_store.clear()


def _valid_tokens(state: WideState, x: torch.Tensor) -> torch.Tensor:
    """[B, T] float, 1 for real tokens; padding is excluded from every rate."""
    am = state.attention_mask
    b, t = x.shape[0], x.shape[1]
    if am is not None and am.dim() == 2 and am.shape[0] == b and am.shape[1] >= t:
        return am[:, -t:].to(device=x.device, dtype=torch.float32)
    return torch.ones(b, t, device=x.device, dtype=torch.float32)


def _positions(state: WideState, b: int, t: int, device) -> torch.Tensor:
    """[B, T] absolute positions: the position ids the model was given (what its RoPE uses, so
    packed documents that restart at 0 restart their tiles), else the count of valid tokens
    before each token over the whole attention mask (left padding takes no position, as in HF
    generate), else the cache length plus the index."""
    pid = state.position_ids
    if pid is not None and pid.dim() == 2 and pid.shape[0] in (1, b) and pid.shape[1] >= t:
        return pid[:, -t:].to(device=device, dtype=torch.long).expand(b, t)
    am = state.attention_mask
    if am is not None and am.dim() == 2 and am.shape[0] == b and am.shape[1] >= t:
        return (am.to(device).long().cumsum(-1) - 1)[:, -t:]
    return (torch.arange(t, device=device) + state.past_length).expand(b, t)


def get_state(model) -> WideState:
    state = getattr(model, "wide_state", None)
    if state is None:
        raise ValueError("model is not wrapped: call wide.wrap(model, config) first")
    return state


def geometry_dict(model) -> dict:
    state = get_state(model)
    return {"dims": asdict(state.geometry.dims), "attn_group_size": state.geometry.attn_group_size,
            "ffn_group_size": state.geometry.ffn_group_size,
            "macs_per_token": {k: state.geometry.module_macs(k) for k in KINDS},
            "groups": {k: state.geometry.groups(k) for k in KINDS}}


__all__ = ["WideState", "get_state", "geometry_dict"]
