"""Offset calibration: router offsets set so that the deterministic inference masks hit a target
exactly on calibration batches (``calibrate_offsets``), and ``observed_pass``."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..base.arch import KINDS
from . import modeling
from .group_rules import group_rule
from .sparsity import _linear_macs_per_layer, _summarise
from .state import get_state


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

    Routers whose rule skips a fixed share (``attn_rule="skip_smallest"``: k of G groups per
    token, which no offset changes) keep their offsets; the global rate counts their share, and
    layers kept dense (``attn_dense_layers``) at 0, as the sparsity records do. With no other
    router there is nothing to calibrate: a warning, and ``{}``.
    """
    state = get_state(model)
    cfg = state.config
    if cfg.attn_target is not None:
        raise ValueError("offset calibration needs a single target_sparsity")
    if mode not in ("global", "per_module"):
        raise ValueError(f"mode must be 'global' or 'per_module', got {mode!r}")
    target = cfg.target_sparsity if target is None else target
    routers, fixed = [], {}  # fixed: (layer, kind) -> the share a module skips whatever its offset
    for i, lr in enumerate(model.wide_routers):
        for k in KINDS:
            r = lr.router(k)
            share = None if r is None else group_rule(cfg, k).fixed_share(r.num_groups)
            if r is None and k == "attn" and i in cfg.attn_dense_layers:
                share = 0.0  # kept dense, and counted so by the rates
            if share is not None:
                fixed[(i, k)] = share
            elif r is not None:
                routers.append((i, k, r))
    calibrated = {(i, k) for i, k, _ in routers}
    if not routers and fixed:
        warnings.warn("calibrate_offsets: no router's decisions move with an offset (attn_rule='skip_smallest' "
                      "skips a fixed number of groups per token): nothing to calibrate", stacklevel=2)
        return {}
    if cfg.loss_mode == "linear":
        # Routers alone skip only routable MACs: the same share of all linear MACs is that many
        # more of the routable ones (per-element sparsity is set by its own thresholds instead).
        target = target * _linear_macs_per_layer(state.geometry) / sum(
            state.geometry.module_macs(k) for k in KINDS if any(kk == k for _, kk in [*fixed, *calibrated]))
        if target >= 1:
            raise ValueError(f"routers alone cannot skip that share of the linear MACs (needs {target:.3f} of the "
                             "routable ones)")
    for _, _, r in routers:
        r.offset.zero_()
    batches = list(batches)
    if not batches:
        raise ValueError("offset calibration needs at least one batch")

    scales: dict = {}  # (layer, kind) -> share of groups one decision value stands for

    def collect() -> dict:
        margins: dict = {}

        def observe(layer, kind, x):
            r = model.wide_routers[layer].router(kind)
            if (layer, kind) in calibrated:
                # Only deciding tokens count, each once per valid token it decides for: with
                # route_tile > 1 a tile's first token, as many times as the tile has tokens.
                # (modeling's own, looked up at each call as before the split: trials patch it,
                # experiments/tile_modules_cpu.py)
                weight = modeling._decision_weights(state, x).flatten().long()
                m, scales[(layer, kind)] = group_rule(cfg, kind).decision_margins(r.gap(x).flatten(0, -2))
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
        _set_offsets(model, state, collect(), routers, target, mode, fixed, scales)
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


def _set_offsets(model, state, margins, routers, target, mode, fixed=None, scales=None) -> None:
    """margins: (layer, kind) -> that module's margins, flattened and sorted ascending. A module
    that decided for no token keeps its offset. ``fixed``: (layer, kind) -> the share of groups a
    module skips whatever the offsets (a skip_smallest router, a layer kept dense), which the
    global rate counts as the records do. ``scales``: (layer, kind) -> the share of groups each
    margin value stands for (a skip_upto router: k / G, its tokens' k smallest margins; else 1)."""
    fixed = fixed or {}
    scales = scales or {}
    margins = {k: v for k, v in margins.items() if v.numel()}
    if not margins:
        raise ValueError("offset calibration saw no router decision: are the batches empty?")
    if mode == "per_module":
        for (layer, kind), v in margins.items():
            # offset = -threshold: a group runs iff margin + offset >= 0; the quantile as
            # torch.quantile interpolates it (rank and weight in the margins' fp32), which it
            # refuses to do past 16M values (262k tokens x 96 groups is 25M)
            scale = scales.get((layer, kind), 1.0)
            if target > scale:
                raise ValueError(f"router {layer}.{kind} skips at most {scale:.3f} of its groups "
                                 f"(attn_rule={state.config.attn_rule!r}): per_module cannot reach {target}")
            rank = torch.tensor(target / scale, dtype=v.dtype) * (v.numel() - 1)
            i = min(int(rank.floor()), v.numel() - 1)
            j = min(int(rank.ceil()), v.numel() - 1)
            q = float(torch.lerp(v[i], v[j], (rank - i).to(v.device)))
            model.wide_routers[layer].router(kind).offset.fill_(-_mid_gap([v], q))
    else:
        cfg = state.config

        def rate_at(shift: float) -> float:
            sums = {key: (torch.tensor(share * state.geometry.groups(key[1])),
                          torch.tensor(float(state.geometry.groups(key[1])))) for key, share in fixed.items()}
            for (layer, kind), v in margins.items():
                share = _skipped_share(v, shift) * scales.get((layer, kind), 1.0)
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


__all__ = ["calibrate_offsets", "observed_pass"]
