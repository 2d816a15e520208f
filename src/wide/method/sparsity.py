"""Sparsity accounting: the routable-FLOP and group rates of the routers' records, the exact
linear-MAC count every record carries (routed groups and per-element input sparsity together),
the sparsity penalty and loss, and ``track_sparsity`` over many forwards."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..base.arch import KINDS
from .config import WideConfig
from .geometry import PROJECTIONS, Geometry, projection_shapes
from .state import WideState, _positions, _valid_tokens, get_state


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

    def floats(self) -> "Sparsity":
        """The same rates as Python floats (None where a module is not routed)."""
        f = lambda v: None if v is None else float(v)  # noqa: E731
        return replace(
            self, flop_rate=f(self.flop_rate), group_rate=f(self.group_rate), attn_rate=f(self.attn_rate),
            ffn_rate=f(self.ffn_rate), linear_rate=f(self.linear_rate), attn_core_rate=f(self.attn_core_rate),
            linear={k: f(v) for k, v in self.linear.items()},
            per_layer={k: [f(v) for v in vals] for k, vals in self.per_layer.items()})

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


class _Tracker:
    def __init__(self, state: WideState):
        self.state = state
        self.sums = None
        self.linear_sums = None

    def summary(self) -> Sparsity:
        """The sparsity realised over the block's forwards, in Python floats: a total to read or
        print, not a loss (:func:`forward_sparsity` is the differentiable one)."""
        sums = self.sums if self.sums is not None else self.state.accumulators
        sums = {k: (torch.tensor(v[0]), torch.tensor(v[1])) for k, v in sums.items()}
        sp = _summarise(self.state.geometry, sums)
        linear = self.linear_sums if self.linear_sums is not None else self.state.linear_acc
        linear = {k: (torch.tensor(v[0], dtype=torch.float64), torch.tensor(v[1], dtype=torch.float64))
                  for k, v in (linear or {}).items()}
        sp.linear_rate, sp.linear, sp.attn_core_rate = _linear_rates(linear)
        return sp.floats()


__all__ = [
    "Sparsity", "forward_sparsity", "sparsity_penalty", "sparsity_loss", "union_penalty", "track_sparsity",
    "linear_macs"
]
