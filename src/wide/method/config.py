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

from ..base.cliargs import check_fields

SPARSE_TARGETS = ("attention", "ffn", "all", "none")
LOSS_MODES = ("flops", "groups", "linear")
ROUTER_INPUTS = ("residual", "normed")
ROUTER_INITS = ("random", "dense")
BUDGETS = ("global", "layer")
TILE_SOURCES = ("first", "previous")
ATTN_RULES = ("independent", "skip_smallest", "skip_upto")


# What wide did before each of these fields existed: a file that lacks one was written then, and
# loads or resumes with that behaviour even after the field's default changes.
PREDATES = {"route_tile": 1, "router_init": "random", "budget": "global", "tile_source": "first",
            "union_coef": 0.0, "union_tokens": 8, "attn_rule": "independent", "attn_skip": 1,
            "attn_dense_layers": []}
# Fields that only set where training starts: routers that differ only in these compute the same
# function, so loading or resuming them never counts these as a difference.
START_ONLY = frozenset({"router_init"})


def routing_name(route_tile: int = 1, tile_source: str = "first", attn_rule: str = "independent",
                 attn_skip: int = 1) -> str:
    """How records and engines name a routing rule: "token", "tile<N>" (a tile's first token
    decides) or "tile<N>prev" (the previous tile's mean input decides); with attention skipping
    the k smallest margins, "skip_smallest<k>" ("skip_upto<k>": at most k, those below 0; the
    engine's names) after a tile rule's "+"."""
    base = "token" if route_tile == 1 else f"tile{route_tile}" + ("prev" if tile_source == "previous" else "")
    if attn_rule in ("skip_smallest", "skip_upto"):
        rule = f"{attn_rule}{attn_skip}"
        return rule if base == "token" else f"{base}+{rule}"
    return base


def with_predating(saved: dict) -> dict:
    """A saved WideConfig dict with the fields it predates filled in as ``PREDATES`` says."""
    return {**{k: v for k, v in PREDATES.items() if k not in saved}, **saved}


@dataclass
class WideConfig:
    # The metadata is each field's command-line option (wide.base.cliargs): its help, and its flag
    # where that is not --field-name. It is not part of asdict, so saved configs do not see it.
    # Every target lies below 1: routers trained to skip every group leave no model to evaluate.
    target_sparsity: float = field(default=0.5, metadata={
        "flag": "--target",
        "help": "target sparsity: share of the routable MACs skipped (q+o for attention, gate+up+down for "
                "the FFN) in FLOP mode, or the unweighted mean of the attention and FFN group rates in "
                "groups mode (the paper's definition)", "min": 0.0, "lt": 1.0})
    # With both separate targets set the penalty is the mean of the two absolute gaps
    # (docs/method.md, "Sparsity and loss").
    attn_target: Optional[float] = field(default=None, metadata={
        "help": "separate attention target (needs --ffn-target; --target is then ignored)", "min": 0.0, "lt": 1.0})
    ffn_target: Optional[float] = field(default=None, metadata={
        "help": "separate FFN target (needs --attn-target)", "min": 0.0, "lt": 1.0})
    sparse_target: str = field(default="all", metadata={
        # "none": no router at all, for models whose only sparsity is per-element (wide.fine:
        # TEAL, WINA), so that they save, load and recover like routed ones.
        "choices": SPARSE_TARGETS, "help": "which modules are routed (none: no router; per-element sparsity only)"})
    # One GQA pack per group (None): the K/V head of a skipped group is read by no other group.
    attn_group_size: Optional[int] = field(default=None, metadata={
        "help": "query heads per attention group (default: one GQA pack = query heads per KV head)", "min": 1})
    # None picks per model (wide.method.geometry.auto_ffn_group_size): 128 channels where that still cuts
    # the FFN into at least 64 groups, finer on small models, whose quality measured 19 % better at
    # 96 groups than at 12 (docs/method.md, "Group size"). wrap() stores the size it picked.
    ffn_group_size: Optional[int] = field(default=None, metadata={
        "help": "intermediate channels per FFN group, a multiple of 16 for the GPU kernels (default: 128 where "
                "that gives at least 64 groups, else the largest multiple of 16 that does: 16 on SmolLM2-135M)",
        "min": 1})
    router_rank: int = field(default=16, metadata={"help": "router bottleneck width r", "min": 1})
    router_input: str = field(default="residual", metadata={
        "choices": ROUTER_INPUTS,
        "help": "what routers read: the residual stream entering the module, or its normed input"})
    # Dense since 2026-12-04: from random decisions the first steps go to undoing the damage they
    # do (docs/method.md, "Router start"); files saved before the field read "random" (PREDATES).
    router_init: str = field(default="dense", metadata={
        "choices": ROUTER_INITS,
        "help": "routers' start: dense (every group runs with probability sigmoid(4) = 0.98; the target then "
                "rises over --sparsity-warmup) or random decisions (about half of the groups per token)"})
    loss_mode: str = field(default="flops", metadata={
        "choices": LOSS_MODES,
        "help": "sparsity the penalty measures: FLOP-weighted over the routable MACs, the paper's unweighted "
                "group rate, or linear: the share of all linear-layer MACs (q, k, v, o, gate, up, down) skipped, "
                "routed groups and per-element input sparsity (wide.fine) together"})
    # "global" lets the routers spend the budget unevenly over depth (some layers nearly dense,
    # others far sparser); "layer" holds every layer to the target, as static pruning does.
    budget: str = field(default="global", metadata={
        "choices": BUDGETS,
        "help": "where the target holds: over the whole model (global) or in every layer (layer: the penalty "
                "is the mean over layers of each layer's |target - rate|)"})
    sparsity_coef: float = field(default=20.0, metadata={"help": "weight of |target - rate| in the loss", "min": 0.0})
    # Per-token routers trained alone pick groups so independently that a decode batch of
    # unrelated sequences runs nearly every group (union of 32 tokens: 0.99 of the weights at 50 %),
    # so batched decode reads every weight. This term pulls the routers toward shared groups while
    # each token keeps its own mask (experiments/results/union_penalty_gpu: coef 2 -> 0.79 at
    # 1.15x the perplexity).
    union_coef: float = field(default=0.0, metadata={
        "help": "weight in the loss of the expected share of groups that --union-tokens random tokens of the "
                "batch run together (0: off); > 0 trades quality for fewer weights read by batched decode",
        "min": 0.0})
    union_tokens: int = field(default=8, metadata={
        "help": "batch size the --union-coef term stands for (the union of this many independent tokens)", "min": 2})
    tau_start: float = field(default=5.0, metadata={"help": "Gumbel temperature at step 0", "gt": 0.0})
    tau_end: float = field(default=0.5, metadata={"help": "Gumbel temperature at the last step", "gt": 0.0})
    # Structured routing for the kernels (docs/routing_structure.md): a tile's tokens share one
    # mask, so prefill kernels can skip whole (tile, group) blocks and decode can reuse one
    # compacted weight set for a tile's steps. Causal: earlier tokens decide (tile_source).
    route_tile: int = field(default=1, metadata={
        "help": "tokens per routing tile: the tokens at positions [k*N, (k+1)*N) all run the groups the "
                "routers pick for the tile (see --tile-source; 1 = every token decides for itself)", "min": 1})
    # Which input decides a tile: its first token's (15 of 16 tokens then run groups picked for
    # another token), or the mean of the previous tile's router inputs, which measured 8-12 %
    # lower perplexity on the CPU (experiments/results/tile_source_cpu). Both are causal.
    tile_source: str = field(default="first", metadata={
        "choices": TILE_SOURCES,
        "help": "what the routers read to decide a tile (--route-tile > 1): its first token's input, or the mean "
                "of the previous tile's inputs (the first tile of a text: its first token's)"})
    # How the attention router's margins become a mask (wide.method.group_rules). On SmolLM2-135M
    # (3 groups) skipping exactly the smallest-margin group per token was far better than the
    # independent per-group rule at the same rate (issue 48, experiments/head_routers_fine_cpu.py).
    attn_rule: str = field(default="independent", metadata={
        "choices": ATTN_RULES,
        "help": "how attention groups are picked: independent (each group runs iff its margin is >= 0, the "
                "paper's rule), skip_smallest (every token skips exactly --attn-skip groups per routed layer, "
                "those of smallest margin; offsets then change nothing) or skip_upto (at most --attn-skip: "
                "those of the smallest margins that are below 0, so offsets set the rate)"})
    attn_skip: int = field(default=1, metadata={
        "help": "attention groups each token skips (skip_smallest) or may skip (skip_upto) per routed layer "
                "(at least 1, fewer than the layer's groups)", "min": 1})
    # Layer 0's attention is the worst to prune (the oracle of issue 48 keeps it dense): these
    # layers get no attention router, and the rates count them as skipping nothing.
    attn_dense_layers: list[int] = field(default_factory=list, metadata={
        "nargs": "*",
        "help": "layers (0-based) whose attention has no router and always runs every head; counted in "
                "the rates as skipping nothing", "min": 0})
    # One decision per layer, shared by attention and FFN (dynamic depth pruning baseline):
    # set by wide.method.baselines, not a command-line option.
    tie_modules: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self)  # the ranges and choices declared in the fields' metadata
        if (self.attn_target is None) != (self.ffn_target is None):
            raise ValueError("set both attn_target and ffn_target, or neither")
        if self.attn_target is not None and self.sparse_target != "all":
            raise ValueError("separate attn/ffn targets need sparse_target='all'")
        if self.tie_modules and self.sparse_target != "all":
            raise ValueError("tie_modules (dynamic depth) routes both modules: use sparse_target='all'")
        if self.attn_rule != "independent" or self.attn_dense_layers:
            if not self.routes_attention or self.tie_modules:
                raise ValueError("attn_rule and attn_dense_layers shape attention routing: they need attention routed "
                                 "per group (sparse_target 'attention' or 'all', modules not tied)")
        if self.attn_rule == "independent" and self.attn_skip != 1:
            raise ValueError("attn_skip is the skip_smallest / skip_upto rules' count: set attn_rule with it")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in self.attn_dense_layers):
            raise ValueError(f"attn_dense_layers takes layer indices (ints), got {self.attn_dense_layers}")
        if len(set(self.attn_dense_layers)) != len(self.attn_dense_layers):
            raise ValueError(f"attn_dense_layers names a layer twice: {self.attn_dense_layers}")
        self.attn_dense_layers = sorted(self.attn_dense_layers)
        if self.loss_mode == "linear" and (self.attn_target is not None or self.budget != "global"):
            raise ValueError("loss_mode='linear' holds one target over all linear MACs: it takes neither separate "
                             "attn/ffn targets nor budget='layer'")

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
        return cls(**with_predating(d))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path) -> "WideConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
