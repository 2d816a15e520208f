"""``wrap(model, config)``: token-routed attention and FFN for Llama-family HF models.

The backbone's modules are left in place (so PEFT, ``save_pretrained`` and HF generation
keep working); routing is added with hooks:

* a hook on each norm that feeds a module (``input_layernorm``, ``post_attention_layernorm``)
  evaluates that module's router on the residual stream entering it (or on the normed
  input, if configured) and stores the 0/1 execute mask [B, T, groups];
* a pre-hook on the module's reduction projection (``o_proj``, ``down_proj``) multiplies its
  input by the mask, expanded over each group's columns.

Zeroing the o_proj input of a head for a token is exactly "this token does not run these
query heads": the head's attention output for token t depends only on q_t, and K/V are
computed for every token and head as usual. Likewise zeroing down_proj's input channels is
exactly "these gate/up columns were not computed". Training therefore computes skipped
groups densely and masks them, which is what lets gradients reach the routers; speed comes
from the kernels in ``wide.kernels`` (see ``wide.inference``).

Two structured rules give the kernels whole blocks to skip (docs/routing_structure.md):
``WideConfig.route_tile`` makes the tokens of a position tile share the mask of the tile's first
token (training and inference), and :func:`batch_shared_decode` makes a decode batch share one
group set per module (inference only).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..base import arch
from ..base.arch import KINDS, SUPPORTED_MODEL_TYPES
from .config import WideConfig
from .routers import TokenRouter, batch_shared_runs, group_runs


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
    return Geometry(dims, attn, ffn)


class LayerRouters(nn.Module):
    def __init__(self, geo: Geometry, config: WideConfig):
        super().__init__()
        h, r = geo.dims.hidden_size, config.router_rank
        if config.tie_modules:
            # One decision per token and layer, shared by attention and FFN.
            self.attn = TokenRouter(h, 1, r)
            self.ffn = None
        else:
            self.attn = TokenRouter(h, geo.attn_groups, r) if config.routes_attention else None
            self.ffn = TokenRouter(h, geo.ffn_groups, r) if config.routes_ffn else None

    def router(self, kind: str) -> Optional[TokenRouter]:
        return self.attn if kind == "attn" else self.ffn


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


def _past_length(state: WideState, kwargs: dict) -> int:
    """Tokens already in the KV cache as this forward starts (0 for a prefill). Read only where
    structured routing needs it: a cache's length may cost a device sync."""
    if state.config.route_tile == 1 and not state.batch_shared:
        return 0
    cache = kwargs.get("cache")  # transformers 5 calls it cache, 4 past_key_values
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    am = kwargs.get("attention_mask")
    if ids is not None and am is not None and am.dim() == 2:
        return max(am.shape[1] - ids.shape[1], 0)
    return 0


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


@dataclass
class _Tiles:
    """How one forward's tokens map onto routing tiles (``route_tile`` > 1)."""

    tile: torch.Tensor  # [B, T] position // route_tile
    lead: torch.Tensor  # [B, T] index of the token whose decision each token uses
    resumed: torch.Tensor  # [B, T] the token's tile began in an earlier forward (decode)
    last: torch.Tensor  # [B] each row's last valid token, -1 for none
    weight: torch.Tensor  # [B, T] valid tokens each token decides for (0: it does not decide)
    prev: torch.Tensor  # [B, T] the last valid token before each token, -1 for none
    pos: torch.Tensor  # [B, T] positions
    continuing: bool  # a decode step: the rows' tiles may have begun in an earlier forward


NO_TILE = torch.iinfo(torch.long).min


def _last_index(flags: torch.Tensor) -> torch.Tensor:
    """[B, T]: the largest j <= t with flags[b, j], or -1."""
    idx = torch.arange(flags.shape[1], device=flags.device).expand_as(flags)
    return torch.where(flags, idx, -1).cummax(dim=1).values


def plan_tiles(pos: torch.Tensor, valid: torch.Tensor, tile_size: int, continuing: bool) -> _Tiles:
    """The tile map of one forward from its positions [B, T] and valid tokens [B, T] (bool).

    A run of valid tokens starts at a tile boundary, at a row's first valid token, or where the
    positions leave the previous valid token's tile or go back (a new packed document); every
    token uses the decision of its run's first token. Padding decides for itself (its output is
    read by nothing). A row's first run that starts inside a tile is, in a ``continuing``
    forward (a decode step), the rest of a tile an earlier forward began: ``resumed``. Without a
    cache it is the start of a text cut mid-tile, and its first token leads.
    """
    idx = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
    tile = torch.div(pos, tile_size, rounding_mode="floor")
    upto = _last_index(valid)
    prev = torch.cat([upto.new_full((pos.shape[0], 1), -1), upto[:, :-1]], dim=1)
    first = prev < 0
    p = prev.clamp_min(0)
    start = valid & (first | (pos % tile_size == 0) | (tile != tile.gather(1, p)) | (pos <= pos.gather(1, p)))
    lead = torch.where(valid, _last_index(start), idx)
    resumed = valid & first.gather(1, lead) & (pos.gather(1, lead) % tile_size != 0) & continuing
    weight = torch.zeros(pos.shape, device=pos.device).scatter_add_(1, lead, (valid & ~resumed).float())
    return _Tiles(tile, lead, resumed, upto[:, -1], weight, prev, pos, continuing)


def _tiles(state: WideState, x: torch.Tensor) -> _Tiles:
    b, t = x.shape[0], x.shape[1]
    if state.tiles is None or state.tiles.tile.shape != (b, t):
        valid = _valid_tokens(state, x).bool()
        pos = _positions(state, b, t, x.device)
        state.tiles = plan_tiles(pos, valid, state.config.route_tile, state.past_length > 0)
    return state.tiles


def _tile_sources(state: WideState, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
    """``tile_source="previous"``: each token's router input [B, T, H] (fp32) replaced by its
    tile's source, the mean of the previous tile's inputs. A tile has none where its run of
    tokens starts mid-tile (a text cut there), at a document's first tile, or after a gap in the
    positions: then the run's first token's input decides, as under ``"first"``. Inputs of a tile
    an earlier forward began (decode) come from the store, which keeps each row's latest tile's
    (tile, input sum, count); the mean stays differentiable within a forward."""
    tiles = _tiles(state, x)
    b, t, h = x.shape
    xf = x.float()
    valid = _valid_tokens(state, x)
    lead3 = tiles.lead.unsqueeze(-1).expand(b, t, h)
    sums = torch.zeros_like(xf).scatter_add(1, lead3, xf * valid.unsqueeze(-1))  # per run, at its lead
    counts = torch.zeros_like(valid).scatter_add(1, tiles.lead, valid)
    key = (layer, kind, "source")
    entry = state.tile_store.get(key)
    fits = _fits(entry, x)
    first = valid.argmax(1, keepdim=True)  # each row's first valid token: the lead of any resumed run
    if fits:
        # A resumed run's earlier tokens: add the stored sum at its lead.
        hit = tiles.resumed.gather(1, first).squeeze(1) & (entry[0] == tiles.tile.gather(1, first).squeeze(1))
        sums = sums.scatter_add(1, first.unsqueeze(-1).expand(b, 1, h),
                                torch.where(hit[:, None, None], entry[1][:, None], 0.0))
        counts = counts.scatter_add(1, first, torch.where(hit[:, None], entry[2][:, None], 0.0))
    n = state.config.route_tile
    lead, prev = tiles.lead, tiles.prev.gather(1, tiles.lead)  # the token before each token's run
    p = prev.clamp_min(0)
    pos, tile = tiles.pos, tiles.tile
    lead_pos, lead_tile = pos.gather(1, lead), tile.gather(1, lead)
    at_boundary = (lead_pos % n == 0) & (lead_pos > 0)
    before = lead.gather(1, p)  # the lead of the run before: where its sum sits
    here = at_boundary & (prev >= 0) & (tile.gather(1, p) == lead_tile - 1) & (pos.gather(1, p) < lead_pos)
    mean_here = sums.gather(1, before.unsqueeze(-1).expand(b, t, h)) / counts.gather(1, before).clamp_min(1).unsqueeze(-1)
    source = torch.where(here.unsqueeze(-1), mean_here, xf.gather(1, lead3))
    if fits and tiles.continuing:  # a tile starting this forward after one an earlier forward ended
        stored = at_boundary & (prev < 0) & (entry[0].unsqueeze(1) == lead_tile - 1)
        mean_stored = (entry[1] / entry[2].clamp_min(1).unsqueeze(-1)).unsqueeze(1)
        source = torch.where(stored.unsqueeze(-1), mean_stored, source)
    # Each row's latest tile, for the next forward: the run of its last valid token.
    last_lead = lead.gather(1, tiles.last.clamp_min(0).unsqueeze(1))
    state.tile_store[key] = _keep_latest(entry, tiles, (
        sums.detach().gather(1, last_lead.unsqueeze(-1).expand(b, 1, h)).squeeze(1),
        counts.gather(1, last_lead).squeeze(1)))
    return source


def _decision_weights(state: WideState, x: torch.Tensor) -> torch.Tensor:
    """[B, T]: how many valid tokens each token's own router decision covers (1 or 0 per token
    with route_tile 1; a tile's tokens on its first token and 0 on the others)."""
    if state.config.route_tile == 1:
        return _valid_tokens(state, x)
    return _tiles(state, x).weight


def _tiled(state: WideState, layer: int, kind: str, what: str, values: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [B, T, G] (margins or 0/1 masks) as the tile rule hands them out:
    each token gets its tile's first token's, from this forward or, in a decode step inside a
    tile, from the store. Gathering keeps the straight-through gradient: it reaches the first
    token's sample from every token of the tile."""
    if state.config.route_tile == 1:
        return values
    tiles = _tiles(state, values)
    out = values.gather(1, tiles.lead.unsqueeze(-1).expand_as(values))
    key = (layer, kind, what)
    out = _resume(state.tile_store.get(key), tiles, out)
    state.tile_store[key] = _latest_tile(state.tile_store.get(key), tiles, out)
    return out


def _fits(entry, out: torch.Tensor) -> bool:
    return entry is not None and entry[1].shape == (out.shape[0], out.shape[2]) and entry[1].device == out.device


def _resume(entry, tiles: _Tiles, out: torch.Tensor) -> torch.Tensor:
    if not _fits(entry, out):  # no earlier forward of these sequences (or another batch)
        return out
    tile, values = entry
    hit = tiles.resumed & (tile.unsqueeze(1) == tiles.tile)
    return torch.where(hit.unsqueeze(-1), values.unsqueeze(1).to(out.dtype), out)


def _latest_tile(entry, tiles: _Tiles, out: torch.Tensor) -> tuple:
    """Each row's last valid token's (tile, values); a row without a valid token keeps its own."""
    last = tiles.last.clamp_min(0).unsqueeze(1)
    values = out.detach().gather(1, last.unsqueeze(-1).expand(-1, 1, out.shape[2])).squeeze(1)
    return _keep_latest(entry, tiles, (values,))


def _keep_latest(entry, tiles: _Tiles, values: tuple) -> tuple:
    """The store entry (tile [B], *values) of each row's latest tile from this forward's ``values``
    (each [B, ...], already taken at the row's last valid token); a row without a valid token
    keeps the earlier entry's."""
    last = tiles.last.clamp_min(0).unsqueeze(1)
    tile = tiles.tile.gather(1, last).squeeze(1)
    none = tiles.last < 0
    if (entry is not None and len(entry) == 1 + len(values)
            and all(e.shape == v.shape and e.device == v.device for e, v in zip(entry[1:], values))):
        return tuple(torch.where(none.view(-1, *[1] * (v.dim() - 1)), e, v) for e, v in zip(entry, (tile, *values)))
    return (tile.masked_fill(none, NO_TILE), *values)


def _decode_step(state: WideState, x: torch.Tensor) -> bool:
    return state.past_length > 0 and x.shape[1] == 1


def _shared(state: WideState, margin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The batch's one group set [B, 1, G] for this decode step (float 0/1)."""
    valid = _valid_tokens(state, x)[:, 0].bool()
    runs = batch_shared_runs(margin[:, 0], valid)
    return runs.float().view(1, 1, -1).expand(margin.shape[0], 1, -1)


def _decide(state: WideState, router: Optional[TokenRouter], layer: int, kind: str,
            x: torch.Tensor) -> Optional[torch.Tensor]:
    """This module's float 0/1 execute mask [B, T, G] under the tile rule, or None when the
    module is not routed. At inference the margins are tiled, so that a batch-shared decode
    step ranks groups by the margins that decided each sequence's tile."""
    if router is None:
        return None
    if state.mask_fn is not None:
        mask = state.mask_fn(layer, kind, x)
        if mask is None:
            return None
        mask = mask.float()
        if state.config.tie_modules:
            mask = mask[..., :1]
        return _tiled(state, layer, kind, "mask", mask)
    if router.training and state.tau is not None:
        return _tiled(state, layer, kind, "mask", router.decide(x, state.tau))
    margin = _tiled(state, layer, kind, "margin", router.margin(x))
    if state.batch_shared and _decode_step(state, x):
        return _shared(state, margin, x)
    return group_runs(margin).float()  # router.decide(x) when nothing is tiled


def _route(state: WideState, routers: LayerRouters, layer: int, kind: str, x: torch.Tensor) -> None:
    if not state.routing:
        return
    # Routers decide in float32 (wide.routers) also under a bf16 autocast of the backbone.
    with torch.autocast(x.device.type, enabled=False):
        _route_fp32(state, routers, layer, kind, x)


def _route_fp32(state: WideState, routers: LayerRouters, layer: int, kind: str, x: torch.Tensor) -> None:
    cfg = state.config
    if cfg.route_tile > 1 and cfg.tile_source == "previous" and not (cfg.tie_modules and kind == "ffn"):
        x = _tile_sources(state, layer, kind, x)  # what the routers read (offset calibration too)
    for fn in state.input_observers:
        fn(layer, kind, x)
    if cfg.tie_modules and kind == "ffn":
        # Dynamic depth: the FFN follows the decision taken at the layer's entry.
        base = state.masks.get((layer, "attn_decision"))
        if base is None:
            return
        mask = base.expand(*base.shape[:-1], state.geometry.ffn_groups)
    else:
        mask = _decide(state, routers.router(kind), layer, kind, x)
        if mask is None:  # module not routed by this config (or by the mask_fn)
            return
        if cfg.tie_modules:
            state.masks[(layer, "attn_decision")] = mask
            mask = mask.expand(*mask.shape[:-1], state.geometry.attn_groups)
    g = state.geometry.groups(kind)
    if mask.shape[-1] != g:
        raise ValueError(f"layer {layer} {kind} mask has {mask.shape[-1]} groups, expected {g}")
    state.masks[(layer, kind)] = mask
    valid = _valid_tokens(state, x)
    skipped = ((1.0 - mask) * valid.unsqueeze(-1)).sum()
    total = valid.sum() * g
    state.records.append(_Record(layer, kind, skipped, total))
    if state.accumulators is not None:
        acc = state.accumulators.setdefault((layer, kind), [0.0, 0.0])
        acc[0] += float(skipped.detach())
        acc[1] += float(total)
    for fn in state.mask_observers:
        fn(layer, kind, mask.detach(), valid)


def _apply_mask(state: WideState, layer: int, kind: str, inp: torch.Tensor) -> torch.Tensor:
    mask = state.masks.get((layer, kind))
    if mask is None:
        return inp
    cols = state.geometry.columns(kind)
    shape = inp.shape
    out = inp.view(*shape[:-1], shape[-1] // cols, cols) * mask.to(inp.dtype).unsqueeze(-1)
    return out.view(shape)


def install_hooks(model) -> None:
    """(Re-)attach the routing hooks to the modules currently at the hooked paths.

    Call again after anything replaces those modules (PEFT's LoRA wrapping, merging).
    """
    state: WideState = model.wide_state
    for h in state.handles:
        h.remove()
    state.handles.clear()
    spec = arch.spec_for(model)
    layers = arch.decoder_layers(model)

    def on_model(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        shape = tuple(ids.shape[:2]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
        state.new_forward(kwargs.get("attention_mask"), kwargs.get("position_ids"), _past_length(state, kwargs), shape)

    def after_model(module, args, kwargs, out):
        if state.linear_acc is not None and state.routing:
            for key, (kept, dense) in linear_macs(state).items():
                acc = state.linear_acc.setdefault(key, [0.0, 0.0])
                acc[0] += float(kept)
                acc[1] += float(dense)

    # The hook sits on the module that owns the layers, which receives the attention mask.
    owner = arch.get_path(model, spec.layers.rpartition(".")[0]) if "." in spec.layers else model
    state.handles.append(owner.register_forward_pre_hook(on_model, with_kwargs=True))
    state.handles.append(owner.register_forward_hook(after_model, with_kwargs=True))
    normed = state.config.router_input == "normed"
    for i, layer in enumerate(layers):
        routers = model.wide_routers[i]
        for kind in KINDS:
            norm = arch.module_norm(layer, spec, kind)
            proj = arch.reduction_projection(layer, spec, kind)
            if normed:
                def tap(mod, args, out, i=i, kind=kind, routers=routers):
                    _route(state, routers, i, kind, out)
                state.handles.append(norm.register_forward_hook(tap))
            else:
                def tap(mod, args, i=i, kind=kind, routers=routers):
                    _route(state, routers, i, kind, args[0])
                state.handles.append(norm.register_forward_pre_hook(tap))

            def gate(mod, args, i=i, kind=kind):
                return (_apply_mask(state, i, kind, args[0]),) + tuple(args[1:])
            state.handles.append(proj.register_forward_pre_hook(gate))
    for install in state.installers:
        install(model)


def wrap(model, config: Optional[WideConfig] = None, *, seed: Optional[int] = None):
    """Add token routers to a Llama/Mistral/Qwen2/Qwen3 causal LM, in place; returns it.

    ``seed`` makes the routers' initial weights a function of it alone, leaving torch's
    global RNG as it was; without it they draw from the global RNG.
    """
    config = config or WideConfig()
    if hasattr(model, "wide_state"):
        raise ValueError("model is already wrapped by wide; call wide.unwrap(model) first")
    dims = ModelDims.from_hf_config(model.config)
    geo = resolve_geometry(dims, config)
    # The size auto picked goes into the config, so that saved routers name their geometry.
    config = replace(config, ffn_group_size=geo.ffn_group_size)
    spec = arch.spec_for(model)
    layers = arch.decoder_layers(model)
    for i, layer in enumerate(layers):
        arch.check_layer(layer, spec, i)
    device = next(model.parameters()).device
    # Routers are built on the CPU, so forking the CPU generator is enough.
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model.wide_routers = nn.ModuleList(LayerRouters(geo, config) for _ in layers).to(device)
    if config.router_init == "dense":
        for r in model.wide_routers.modules():
            if isinstance(r, TokenRouter):
                r.start_dense()
    model.wide_state = WideState(config=config, geometry=geo)
    model.wide_config = config
    install_hooks(model)
    _follow_beams(model)
    return model


def _follow_beams(model) -> None:
    """Beam search (transformers' generate) reorders the KV cache between steps through the
    model's ``_reorder_cache`` where it has one: this instance gets one that reorders the tile
    rule's stored masks the same way, so that every beam keeps its own tile's groups. (A bound
    method, so that a deep copy of the model reorders its own store.)"""
    model._reorder_cache = types.MethodType(_reorder_cache, model)


def _reorder_cache(model, cache, beam_idx):
    store = model.wide_state.tile_store
    for key, entry in store.items():  # (tile [B], values [B, G]) per module
        store[key] = tuple(t.index_select(0, beam_idx.to(t.device)) for t in entry)
    inherited = inspect.getattr_static(type(model), "_reorder_cache", None)  # older models' own
    if inherited is not None:
        return inherited.__get__(model, type(model))(cache, beam_idx)
    cache.reorder_cache(beam_idx)
    return cache


def unwrap(model):
    """Remove routers and hooks, leaving the dense model."""
    state = getattr(model, "wide_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    del model.wide_routers
    del model.wide_state
    del model.wide_config
    if "wide_fine" in model._modules:  # per-element sparsity (wide.fine) hooks on the same state
        del model.wide_fine
    model.__dict__.pop("_reorder_cache", None)
    return model


def get_state(model) -> WideState:
    state = getattr(model, "wide_state", None)
    if state is None:
        raise ValueError("model is not wrapped: call wide.wrap(model, config) first")
    return state


def router_parameters(model) -> list[nn.Parameter]:
    """What stage 1 trains: the routers, and the learned thresholds of per-element sparsity
    (``model.wide_fine.learnable()``, wide.fine) where the model has them."""
    get_state(model)
    fine = model._modules.get("wide_fine")
    return list(model.wide_routers.parameters()) + (fine.learnable() if fine is not None else [])


def freeze_backbone(model) -> None:
    """Stage 1: only the routers train."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in router_parameters(model):
        p.requires_grad_(True)


# ---------------------------------------------------------------- sparsity accounting


@dataclass
class Sparsity:
    """Realised sparsity of one forward (differentiable) or of many (floats)."""

    flop_rate: torch.Tensor
    group_rate: torch.Tensor
    attn_rate: Optional[torch.Tensor]
    ffn_rate: Optional[torch.Tensor]
    per_layer: dict  # kind -> list of per-layer rates (None where not routed)
    module_macs: dict = field(default_factory=dict)  # kind -> routable MACs of one layer's module
    # Share of all linear-layer MACs skipped (q, k, v, o, gate, up, down; LM head excluded):
    # routed groups and per-element input sparsity together (see :func:`linear_macs`).
    linear_rate: Optional[torch.Tensor] = None
    linear: dict = field(default_factory=dict)  # projection -> its own skipped share
    attn_core_rate: Optional[torch.Tensor] = None  # share of the QK^T and PV MACs skipped

    def as_dict(self) -> dict:
        f = lambda v: None if v is None else float(v)  # noqa: E731
        return {
            "flop_rate": f(self.flop_rate),
            "group_rate": f(self.group_rate),
            "attn_rate": f(self.attn_rate),
            "ffn_rate": f(self.ffn_rate),
            "linear_rate": f(self.linear_rate),
            "linear": {k: f(v) for k, v in self.linear.items()},
            "attn_core_rate": f(self.attn_core_rate),
            "per_layer": {k: [f(v) for v in vals] for k, vals in self.per_layer.items()},
        }


def _summarise(geo: Geometry, sums: dict) -> Sparsity:
    """sums: (layer, kind) -> (skipped, total). Rates are averaged over layers per module;
    the group rate is the mean of the module rates, the FLOP rate weights each module by
    its routable MACs."""
    L = geo.dims.num_layers
    per_layer = {k: [None] * L for k in KINDS}
    module_rate = {}
    for kind in KINDS:
        rates = []
        for layer in range(L):
            if (layer, kind) in sums:
                skipped, total = sums[(layer, kind)]
                # skipped <= total, so a module with no valid token has rate 0; no host sync
                r = skipped / torch.as_tensor(total).clamp_min(1.0)
                per_layer[kind][layer] = r
                rates.append(r)
        if rates:
            module_rate[kind] = sum(rates) / len(rates)
    if not module_rate:
        zero = torch.zeros(())
        return Sparsity(zero, zero, None, None, per_layer, {})
    w = {k: geo.module_macs(k) for k in module_rate}
    flop_rate, group_rate = _combined(module_rate, w)
    return Sparsity(flop_rate, group_rate, module_rate.get("attn"), module_rate.get("ffn"), per_layer, w)


def _combined(rates: dict, macs: dict) -> tuple:
    """(FLOP-weighted, unweighted) rate of module rates {kind: rate}, weights {kind: MACs}."""
    return sum(rates[k] * macs[k] for k in rates) / sum(macs[k] for k in rates), sum(rates.values()) / len(rates)


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def projection_shapes(dims: ModelDims) -> dict:
    """projection -> (output features, input features): the MACs one token spends in it dense."""
    h, q = dims.hidden_size, dims.num_heads * dims.head_dim
    kv, i = dims.num_kv_heads * dims.head_dim, dims.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}


def linear_macs(state: WideState) -> dict:
    """The last forward's MACs, kept and dense, summed over layers and valid (non-padding)
    tokens: projection -> (kept, dense), plus ``"attn_core"`` (QK^T and PV of the query heads).

    Counted exactly, token by token: a projection's MACs are the output rows it computes times
    the input elements it reads. A routed attention group takes its heads' q rows and o input
    columns away, a routed FFN group its gate/up rows and down input columns; an input element
    zeroed per element (``state.kept_inputs``) takes its weight column away. K and V rows always
    run. Attention-core MACs are 2 x head_dim x (keys attended) per query head run, so they
    weigh each token by its position. Differentiable through straight-through masks."""
    shape = state.shape
    if shape is None:
        return {}
    geo = state.geometry
    dims = geo.dims
    some = next(iter(state.masks.values()), None)
    if some is None:
        some = next(iter(state.kept_inputs.values()), None)
    device = some.device if some is not None else None
    probe = torch.empty(shape, device=device)
    valid = _valid_tokens(state, probe)
    n_valid = valid.sum()
    shapes = projection_shapes(dims)
    out = {p: [0.0, 0.0] for p in PROJECTIONS}
    core = [0.0, 0.0]
    ctx = (_positions(state, shape[0], shape[1], probe.device) + 1).float() * valid
    ctx_sum = ctx.sum()
    core_per_head = 2 * dims.head_dim
    for layer in range(dims.num_layers):
        am, fm = state.masks.get((layer, "attn")), state.masks.get((layer, "ffn"))
        q_run = am.sum(-1) * geo.columns("attn") if am is not None else None  # q rows = o columns
        f_run = fm.sum(-1) * geo.ffn_group_size if fm is not None else None  # gate/up rows = down columns
        rows = {"q": q_run, "gate": f_run, "up": f_run}
        routed_inputs = {"o": q_run, "down": f_run}
        for p in PROJECTIONS:
            n_out, n_in = shapes[p]
            r = rows.get(p)
            k = state.kept_inputs.get((layer, p), routed_inputs.get(p))
            per_token = (r if r is not None else n_out) * (k if k is not None else n_in)
            out[p][0] = out[p][0] + (per_token * valid.to(per_token.dtype)).sum() \
                if isinstance(per_token, torch.Tensor) else out[p][0] + per_token * n_valid
            out[p][1] = out[p][1] + n_out * n_in * n_valid
        heads = am.sum(-1) * geo.attn_group_size if am is not None else None
        core[0] = core[0] + ((heads * ctx).sum() if heads is not None else dims.num_heads * ctx_sum) * core_per_head
        core[1] = core[1] + dims.num_heads * ctx_sum * core_per_head
    res = {p: tuple(v) for p, v in out.items()}
    res["attn_core"] = tuple(core)
    return res


def _linear_macs_per_layer(geo: Geometry) -> int:
    return sum(o * i for o, i in projection_shapes(geo.dims).values())


def _linear_rates(sums: dict) -> tuple:
    """(linear rate, {projection: rate}, attention-core rate) of ``linear_macs``-style sums."""
    if not sums:
        return None, {}, None
    kept = sum(sums[p][0] for p in PROJECTIONS)
    dense = sum(sums[p][1] for p in PROJECTIONS)
    rate = lambda k, d: 1.0 - k / d if float(d) > 0 else k * 0.0  # noqa: E731
    core = sums.get("attn_core")
    return (rate(kept, dense), {p: rate(*sums[p]) for p in PROJECTIONS},
            None if core is None else rate(*core))


def forward_sparsity(model) -> Sparsity:
    """Sparsity of the last forward pass, differentiable through the straight-through masks."""
    state = get_state(model)
    sums = {}
    for rec in state.records:
        s, t = sums.get((rec.layer, rec.kind), (0.0, 0.0))
        sums[(rec.layer, rec.kind)] = (rec.skipped + s, rec.total + t)
    sp = _summarise(state.geometry, sums)
    sp.linear_rate, sp.linear, sp.attn_core_rate = _linear_rates(linear_macs(state))
    return sp


def sparsity_penalty(sp: Sparsity, config: WideConfig) -> torch.Tensor:
    """|target - rate| in the configured mode (docs/method.md, "Sparsity and loss"), before
    the coefficient."""
    if config.budget == "layer":  # the same gap on each layer's own rates, averaged over layers
        gaps = []
        for layer in range(len(next(iter(sp.per_layer.values())))):
            rates = {k: v[layer] for k, v in sp.per_layer.items() if v[layer] is not None}
            if rates:
                flop, group = _combined(rates, sp.module_macs)
                gaps.append(_gap(rates, flop if config.loss_mode == "flops" else group, config))
        return sum(gaps) / len(gaps) if gaps else torch.zeros(())
    rates = {k: r for k, r in (("attn", sp.attn_rate), ("ffn", sp.ffn_rate)) if r is not None}
    rate = {"flops": sp.flop_rate, "groups": sp.group_rate, "linear": sp.linear_rate}[config.loss_mode]
    if rate is None:
        raise ValueError("loss_mode='linear' needs the linear MACs of a forward: none were recorded")
    return _gap(rates, rate, config)


def _gap(rates: dict, rate, config: WideConfig) -> torch.Tensor:
    """|target - rate|, or with separate module targets the mean of the modules' own gaps."""
    if config.attn_target is not None:
        targets = {"attn": config.attn_target, "ffn": config.ffn_target}
        return sum((targets[k] - r).abs() for k, r in rates.items()) / len(rates)
    return (config.target_sparsity - rate).abs()


def union_penalty(model, tokens: int) -> torch.Tensor:
    """Expected share of groups that ``tokens`` independent tokens of the last forward run
    together: mean over routed modules of mean_g 1 - (1 - f_g)^tokens, f_g the share of the
    forward's tokens that run group g (straight-through masks, so it reaches the routers). For a
    fixed per-token rate it is lowest when every token runs the same groups."""
    terms = []
    for (_, kind), mask in get_state(model).masks.items():
        if kind in KINDS and mask is not None:
            f = mask.float().flatten(0, -2).mean(0)
            terms.append((1 - (1 - f).pow(tokens)).mean())
    if not terms:
        raise RuntimeError("union_penalty needs the masks of a routed forward in training mode; none were recorded")
    return torch.stack(terms).mean()


def sparsity_loss(model) -> tuple[torch.Tensor, Sparsity]:
    """The routers' regulariser of the last forward: sparsity_coef x |target - rate|, plus
    union_coef x union_penalty where the config asks for it."""
    state = get_state(model)
    sp = forward_sparsity(model)
    loss = state.config.sparsity_coef * sparsity_penalty(sp, state.config)
    if state.config.union_coef > 0:
        loss = loss + state.config.union_coef * union_penalty(model, state.config.union_tokens)
    return loss, sp


@contextlib.contextmanager
def routing_disabled(model):
    """Every forward inside the block runs the dense backbone: no router runs, no mask (learned
    or static) applies and nothing is recorded. What the last routed forward left (its masks and
    its sparsity records) is put back on exit, so a dense pass may run between a routed forward
    and its loss. The distillation teacher of ``wide.train`` runs under it."""
    state = get_state(model)
    saved = (state.routing, dict(state.masks), list(state.records), dict(state.tile_store), dict(state.kept_inputs))
    forward = {k: getattr(state, k) for k in ("attention_mask", "position_ids", "past_length", "tiles", "shape")}
    state.routing = False
    try:
        yield model
    finally:
        state.routing = saved[0]
        state.masks.clear()
        state.masks.update(saved[1])
        state.records[:] = saved[2]
        state.tile_store.clear()
        state.tile_store.update(saved[3])
        state.kept_inputs.clear()
        state.kept_inputs.update(saved[4])
        for k, v in forward.items():
            setattr(state, k, v)


@contextlib.contextmanager
def track_sparsity(model):
    """Accumulate realised sparsity over every forward inside the block.

    >>> with track_sparsity(model) as tracker:
    ...     model(**batch)
    >>> tracker.summary().as_dict()
    """
    state = get_state(model)
    previous = state.accumulators, state.linear_acc
    state.accumulators, state.linear_acc = {}, {}
    tracker = _Tracker(state)
    try:
        yield tracker
    finally:
        tracker.sums = dict(state.accumulators)
        tracker.linear_sums = dict(state.linear_acc)
        state.accumulators, state.linear_acc = previous


@contextlib.contextmanager
def recording_masks(model):
    """Collect the execute masks of every routed forward inside the block.

    Yields a dict (layer, kind) -> list of bool masks [B, T, G], one per forward in order: a
    decode loop gives one [B, 1, G] per step (``torch.cat(..., dim=1)`` gives the whole text).
    """
    state = get_state(model)
    seen: dict = {}

    def observe(layer, kind, mask, valid):
        seen.setdefault((layer, kind), []).append(mask.bool())

    state.mask_observers.append(observe)
    try:
        yield seen
    finally:
        state.mask_observers.remove(observe)


@contextlib.contextmanager
def batch_shared_decode(model):
    """Inside the block, every decode step (one new token per sequence on a KV cache) runs one
    group set per layer and module for the whole batch: ``wide.routers.batch_shared_runs`` of
    the sequences' (tile-rule) margins, as many groups as the batch's mean width asks for.
    Prefills and training forwards are unchanged.

    A sequence's output then depends on the sequences it is batched with. That is why this is
    a switch around the serving call and not a WideConfig field: it is a way of serving trained
    routers, not part of what was trained, saved or resumed, and the dependence on the batch
    should be asked for where the batch is formed.
    """
    state = get_state(model)
    previous = state.batch_shared
    state.batch_shared = True
    try:
        yield model
    finally:
        state.batch_shared = previous


class _Tracker:
    def __init__(self, state: WideState):
        self.state = state
        self.sums = None
        self.linear_sums = None

    def summary(self) -> Sparsity:
        sums = self.sums if self.sums is not None else self.state.accumulators
        sums = {k: (torch.tensor(v[0]), torch.tensor(v[1])) for k, v in sums.items()}
        sp = _summarise(self.state.geometry, sums)
        linear = self.linear_sums if self.linear_sums is not None else self.state.linear_acc
        linear = {k: (torch.tensor(v[0], dtype=torch.float64), torch.tensor(v[1], dtype=torch.float64))
                  for k, v in (linear or {}).items()}
        sp.linear_rate, sp.linear, sp.attn_core_rate = _linear_rates(linear)
        return sp


# ---------------------------------------------------------------- offset calibration


@torch.no_grad()
def observed_pass(model, batches, observers: list, observe) -> None:
    """Run ``batches`` (input_ids tensors) in eval mode with ``observe`` added to ``observers``
    (``state.input_observers`` or ``state.mask_observers``) for the duration."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    observers.append(observe)
    try:
        for ids in batches:
            model(input_ids=ids.to(device))
    finally:
        observers.remove(observe)
        model.train(was_training)


@torch.no_grad()
def calibrate_offsets(model, batches, target: Optional[float] = None, mode: str = "global",
                      rounds: int = 2) -> dict:
    """Set router offsets so the deterministic inference masks hit ``target`` exactly on
    ``batches`` (an iterable of input_ids tensors).

    mode="global": one shift for every router, found by bisection on the FLOP-weighted
    (or group, per the config's loss mode) rate, keeping the learned allocation across
    layers. mode="per_module": each router skips exactly ``target`` of its groups.
    """
    state = get_state(model)
    cfg = state.config
    if cfg.attn_target is not None:
        raise ValueError("offset calibration needs a single target_sparsity")
    if mode not in ("global", "per_module"):
        raise ValueError(f"mode must be 'global' or 'per_module', got {mode!r}")
    target = cfg.target_sparsity if target is None else target
    routers = [(i, k, r) for i, lr in enumerate(model.wide_routers) for k in KINDS
               if (r := lr.router(k)) is not None]
    if cfg.loss_mode == "linear":
        # Routers alone skip only routable MACs: the same share of all linear MACs is that many
        # more of the routable ones (per-element sparsity is set by its own thresholds instead).
        target = target * _linear_macs_per_layer(state.geometry) / sum(
            state.geometry.module_macs(k) for k in KINDS if any(kk == k for _, kk, _ in routers))
        if target >= 1:
            raise ValueError(f"routers alone cannot skip that share of the linear MACs (needs {target:.3f} of the "
                             "routable ones)")
    for _, _, r in routers:
        r.offset.zero_()
    batches = list(batches)
    if not batches:
        raise ValueError("offset calibration needs at least one batch")

    def collect() -> dict:
        margins: dict = {}

        def observe(layer, kind, x):
            r = model.wide_routers[layer].router(kind)
            if r is not None:
                # Only deciding tokens count, each once per valid token it decides for: with
                # route_tile > 1 a tile's first token, as many times as the tile has tokens.
                weight = _decision_weights(state, x).flatten().long()
                m = r.gap(x).flatten(0, -2)
                # Kept on the model's device, where sorting them is quick: on the host, the old
                # comparison of every margin at each of the 50 bisection steps took 6 s a round
                # on 2 cores at an eighth of a GPU run's 262k tokens x 99 groups x 30 layers.
                margins.setdefault((layer, kind), []).append(m.repeat_interleave(weight, dim=0))

        observed_pass(model, batches, state.input_observers, observe)
        # [tokens * G] per module, offset excluded, sorted: the share of a module's decisions
        # below any threshold is then one binary search
        return {k: torch.cat(margins.pop(k)).flatten().float().sort().values for k in list(margins)}

    # Offsets change the routing of early layers and so the inputs of later routers: a
    # second pass with the first pass's offsets in place settles that.
    for _round in range(rounds):
        # not held in a name: one round's margins (GBs on a GPU run) are freed before the next
        _set_offsets(model, state, collect(), routers, target, mode)
    return {f"{layer}.{kind}": float(r.offset) for layer, kind, r in routers}


def _mid_gap(sorted_values: list, thr: float) -> float:
    """A threshold splitting the union of ``sorted_values`` (ascending 1-D tensors) exactly as
    ``thr`` does (runs iff value >= thr), moved to the middle of the gap between the largest
    value below it and the smallest at or above it. A threshold sitting on a calibration margin
    would flip that decision under any change of summation order (a fused kernel, another GPU);
    mid-gap it takes half a gap (nothing helps when the two neighbours are adjacent fp32 numbers)."""
    below, above = [], []
    for v in sorted_values:
        i = int(torch.searchsorted(v, torch.tensor([thr], dtype=v.dtype, device=v.device)))
        if i > 0:
            below.append(float(v[i - 1]))
        if i < v.numel():
            above.append(float(v[i]))
    if not above:  # above every value: on none of them
        return thr
    hi = min(above)
    if not below:  # everything runs: stay clear below the smallest value
        return hi - max(1.0, abs(hi))
    lo = max(below)
    mid = float(torch.tensor((lo + hi) / 2, dtype=torch.float32))  # offsets are fp32
    return mid if lo < mid <= hi else thr


def _skipped_share(sorted_margins: torch.Tensor, shift: float) -> float:
    """The share of (token, group) decisions that skip (margin + shift < 0) at ``shift``."""
    thr = torch.tensor([-shift], dtype=sorted_margins.dtype, device=sorted_margins.device)
    return int(torch.searchsorted(sorted_margins, thr)) / sorted_margins.numel()


def _set_offsets(model, state, margins, routers, target, mode) -> None:
    """margins: (layer, kind) -> that module's margins, flattened and sorted ascending. A module
    that decided for no token keeps its offset."""
    margins = {k: v for k, v in margins.items() if v.numel()}
    if not margins:
        raise ValueError("offset calibration saw no router decision: are the batches empty?")
    if mode == "per_module":
        for (layer, kind), v in margins.items():
            # offset = -threshold: a group runs iff margin + offset >= 0; the quantile as
            # torch.quantile interpolates it (rank and weight in the margins' fp32), which it
            # refuses to do past 16M values (262k tokens x 96 groups is 25M)
            rank = torch.tensor(target, dtype=v.dtype) * (v.numel() - 1)
            i = min(int(rank.floor()), v.numel() - 1)
            j = min(int(rank.ceil()), v.numel() - 1)
            q = float(torch.lerp(v[i], v[j], (rank - i).to(v.device)))
            model.wide_routers[layer].router(kind).offset.fill_(-_mid_gap([v], q))
    else:
        cfg = state.config

        def rate_at(shift: float) -> float:
            sums = {}
            for (layer, kind), v in margins.items():
                share = _skipped_share(v, shift)
                for k in (KINDS if cfg.tie_modules else (kind,)):
                    g = state.geometry.groups(k)
                    sums[(layer, k)] = (torch.tensor(share * g), torch.tensor(float(g)))
            sp = _summarise(state.geometry, sums)
            return float(sp.group_rate if cfg.loss_mode == "groups" else sp.flop_rate)

        # The rate falls as the shift rises; beyond the margins' range it is 0 or 1.
        lo = -max(float(v[-1]) for v in margins.values()) - 1.0
        hi = -min(float(v[0]) for v in margins.values()) + 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if rate_at(mid) > target:
                lo = mid
            else:
                hi = mid
        shift = -_mid_gap(list(margins.values()), -hi)
        for _, _, r in routers:
            r.offset.fill_(shift)


def geometry_dict(model) -> dict:
    state = get_state(model)
    return {"dims": asdict(state.geometry.dims), "attn_group_size": state.geometry.attn_group_size,
            "ffn_group_size": state.geometry.ffn_group_size,
            "macs_per_token": {k: state.geometry.module_macs(k) for k in KINDS},
            "groups": {k: state.geometry.groups(k) for k in KINDS}}


def dense_macs_per_token(dims: ModelDims) -> int:
    """All linear-layer MACs per token (embeddings excluded), for reporting."""
    h = dims.hidden_size
    attn = h * dims.num_heads * dims.head_dim * 2 + h * dims.num_kv_heads * dims.head_dim * 2
    ffn = 3 * h * dims.intermediate_size
    return dims.num_layers * (attn + ffn) + h * dims.vocab_size


__all__ = [
    "SUPPORTED_MODEL_TYPES", "ModelDims", "Geometry", "auto_ffn_group_size", "resolve_geometry", "wrap", "unwrap",
    "install_hooks", "get_state", "router_parameters", "freeze_backbone", "Sparsity",
    "forward_sparsity", "sparsity_penalty", "sparsity_loss", "union_penalty", "track_sparsity", "routing_disabled",
    "calibrate_offsets", "geometry_dict", "dense_macs_per_token", "recording_masks", "batch_shared_decode",
    "plan_tiles", "PROJECTIONS", "projection_shapes", "linear_macs",
]
