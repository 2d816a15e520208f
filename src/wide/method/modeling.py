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
from the kernels in ``wide.kernels`` (see ``wide.engine.inference``).

Two structured rules give the kernels whole blocks to skip (docs/routing_structure.md):
``WideConfig.route_tile`` makes the tokens of a position tile share the mask of the tile's first
token (training and inference), and :func:`batch_shared_decode` makes a decode batch share one
group set per module (inference only). How a module's margins become its mask (each group on its
own, or attention skipping the k smallest margins: ``WideConfig.attn_rule``) is
:mod:`wide.method.group_rules`; layers in ``attn_dense_layers`` have no attention router.

Beside this module: the model's groups and their costs (``geometry``), the state the hooks share
(``state``), the accounting of what they skip (``sparsity``) and offset calibration (``offsets``).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn

from ..base import arch
from ..base.arch import KINDS
from .config import WideConfig
from .group_rules import group_rule
from .geometry import Geometry, ModelDims, resolve_geometry
from .routers import TokenRouter, batch_shared_runs
from .sparsity import linear_macs
from .state import WideState, _positions, _Record, _valid_tokens, get_state


class LayerRouters(nn.Module):
    def __init__(self, geo: Geometry, config: WideConfig, layer: int = 0):
        super().__init__()
        h, r = geo.dims.hidden_size, config.router_rank
        if config.tie_modules:
            # One decision per token and layer, shared by attention and FFN.
            self.attn = TokenRouter(h, 1, r)
            self.ffn = None
        else:
            self.attn = (TokenRouter(h, geo.attn_groups, r)
                         if config.routes_attention and layer not in config.attn_dense_layers else None)
            self.ffn = TokenRouter(h, geo.ffn_groups, r) if config.routes_ffn else None

    def router(self, kind: str) -> Optional[TokenRouter]:
        return self.attn if kind == "attn" else self.ffn


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
        if kind == "attn" and layer in state.config.attn_dense_layers:
            # kept dense by the config: counted as running every group, as the rates promise
            return x.new_ones(*x.shape[:-1], state.geometry.attn_groups, dtype=torch.float32)
        return None
    if state.mask_fn is not None:
        mask = state.mask_fn(layer, kind, x)
        if mask is None:
            return None
        mask = mask.float()
        if state.config.tie_modules:
            mask = mask[..., :1]
        return _tiled(state, layer, kind, "mask", mask)
    rule = group_rule(state.config, kind)
    if router.training and state.tau is not None:
        return _tiled(state, layer, kind, "mask", rule.sample(router, x, state.tau))
    margin = _tiled(state, layer, kind, "margin", router.margin(x))
    if state.batch_shared and _decode_step(state, x):
        return _shared(state, margin, x)
    return rule.runs(margin).float()  # router.decide(x) when nothing is tiled under the independent rule


def _route(state: WideState, routers: LayerRouters, layer: int, kind: str, x: torch.Tensor) -> None:
    if not state.routing:
        return
    # Routers decide in float32 (wide.method.routers) also under a bf16 autocast of the backbone.
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
                # outside torch.no_grad kept carries the straight-through graph of the masks and
                # thresholds: the tracker wants the count alone (float() of it warned every forward)
                acc[0] += float(kept.detach() if isinstance(kept, torch.Tensor) else kept)
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
        model.wide_routers = nn.ModuleList(LayerRouters(geo, config, i) for i in range(len(layers))).to(device)
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


@contextlib.contextmanager
def routing_disabled(model):
    """Every forward inside the block runs the dense backbone: no router runs, no mask (learned
    or static) applies and nothing is recorded. What the last routed forward left (its masks and
    its sparsity records) is put back on exit, so a dense pass may run between a routed forward
    and its loss. The distillation teacher of ``wide.training.train`` runs under it."""
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
    group set per layer and module for the whole batch: ``wide.method.routers.batch_shared_runs`` of
    the sequences' (tile-rule) margins, as many groups as the batch's mean width asks for.
    Prefills and training forwards are unchanged.

    A sequence's output then depends on the sequences it is batched with. That is why this is
    a switch around the serving call and not a WideConfig field: it is a way of serving trained
    routers, not part of what was trained, saved or resumed, and the dependence on the batch
    should be asked for where the batch is formed.
    """
    state = get_state(model)
    if state.config.attn_rule != "independent":
        raise ValueError(f"batch-shared decode picks one group set per module from margins thresholded at 0; "
                         f"these routers' attention runs attn_rule={state.config.attn_rule!r}, which it would "
                         "ignore: serve them without batch_shared_decode")
    previous = state.batch_shared
    state.batch_shared = True
    try:
        yield model
    finally:
        state.batch_shared = previous


__all__ = [
    "wrap", "unwrap", "install_hooks", "router_parameters", "freeze_backbone", "routing_disabled",
    "recording_masks", "batch_shared_decode", "plan_tiles", "LayerRouters"
]
