"""How a router's margins become a module's execute mask (``WideConfig.attn_rule``).

* :class:`Independent` (the paper's rule, every module's by default): each group runs iff its
  margin (logit_exec - logit_skip + offset) is >= 0; training draws a hard Gumbel-softmax sample
  per (token, group).
* :class:`SkipUpTo` (``attn_rule="skip_upto"``): at most ``k``, those of the k smallest margins
  that are below 0 (offsets set the rate, as for the independent rule).
* :class:`SkipSmallest` (``attn_rule="skip_smallest"``, attention only): every token skips
  exactly ``k`` groups, those of smallest margin (ties: the lowest index). Issue 48 found that on
  SmolLM2-135M (3 KV groups) skipping the smallest-margin group per token is far better than the
  independent rule at the same rate (experiments/head_routers_fine_cpu.py, ``--skip-one``). The
  rate is ``k / G`` by construction: offsets (one scalar per router) shift every margin alike and
  change no choice, so offset calibration leaves these routers alone.

Training under :class:`SkipSmallest` draws ``k`` times without replacement, each draw one hard
Gumbel-softmax sample over the groups not yet skipped and a "skip no more" outcome, scores
``[-margin_g ..., 0]``; once "skip no more" is drawn the later draws skip nothing either. For
``k = 1`` that is one sample over G + 1 outcomes (the experiment's ``SkipOne``). The mask is 1
minus the sum of the draws' group entries, straight-through, so the soft samples' gradient reaches
every margin, and the "skip nothing" slack lets the dense router start and the target's warm-up
work as under the independent rule. Inference has no slack: always exactly ``k``.

The masked HF path (:mod:`wide.method.modeling`) and the engine's rule
(:class:`wide.engine.routing_rules.SkipSmallestRule`) both call :func:`skip_smallest_runs` (kept
beside the kernels' references; on the kernels the engine runs the same mask in one launch,
:func:`wide.kernels.skip_rule`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.reference import skip_smallest_runs
from .config import WideConfig
from .routers import TokenRouter, group_runs


class Independent:
    """Each (token, group) decides alone: the paper's rule."""

    name = "independent"

    def fixed_share(self, groups: int) -> Optional[float]:
        """The share of groups the rule skips whatever the margins, or None: offsets move it."""
        return None

    def sample(self, router: TokenRouter, x: torch.Tensor, tau: float, gumbels=None) -> torch.Tensor:
        """Training mask, float 0/1 [..., G] (straight-through). ``gumbels``: the noise to use,
        [..., G, 2] (keyed noise of distributed training), else drawn."""
        if gumbels is None:
            return router.decide(x, tau)
        return _straight_through((router(x) + gumbels) / tau)[..., 0]

    def noise_shape(self, lead: tuple, groups: int) -> tuple:
        return (*lead, groups, 2)

    def runs(self, margin: torch.Tensor) -> torch.Tensor:
        return group_runs(margin)

    def decision_margins(self, margin: torch.Tensor) -> tuple:
        """(values [tokens, n], share): each value below the threshold is one skipped group, and
        a module's skipped share of groups is ``share`` x the share of values below it. Offset
        calibration searches these (every margin here: each group decides alone)."""
        return margin, 1.0


class SkipSmallest:
    """Every token skips exactly ``k`` groups, those of smallest margin (see the module docstring)."""

    name = "skip_smallest"

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"skip_smallest skips at least one group per token, got k={k}")
        self.k = int(k)

    def sample(self, router: TokenRouter, x: torch.Tensor, tau: float, gumbels=None) -> torch.Tensor:
        return skip_smallest_sample(router.margin(x), self.k, tau, gumbels)

    def noise_shape(self, lead: tuple, groups: int) -> tuple:
        return (*lead, self.k, groups + 1)

    def fixed_share(self, groups: int) -> Optional[float]:
        return self.k / groups

    def runs(self, margin: torch.Tensor) -> torch.Tensor:
        return skip_smallest_runs(margin, self.k)


class SkipUpTo(SkipSmallest):
    """Every token skips at most ``k`` groups: those of the ``k`` smallest margins that are below
    0. The noise-free form of the training sampler (whose "skip no more" outcome scores 0), so the
    rate moves with the offsets and ``calibrate_offsets`` sets it; at the issue-48 rate (one group of
    three for 78 % of the tokens) its oracle was 1.32x dense against 1.45x for every token
    (experiments/results/head_routers_share_cpu)."""

    name = "skip_upto"

    def fixed_share(self, groups: int) -> Optional[float]:
        return None

    def runs(self, margin: torch.Tensor) -> torch.Tensor:
        return skip_smallest_runs(margin, self.k) | (margin >= 0)

    def decision_margins(self, margin: torch.Tensor) -> tuple:
        # only a token's k smallest margins can skip, each one group of G
        return margin.topk(self.k, dim=-1, largest=False).values, self.k / margin.shape[-1]


def group_rule(config: WideConfig, kind: str):
    """The rule that turns module ``kind``'s margins into masks under ``config``."""
    if kind == "attn" and config.attn_rule == "skip_smallest":
        return SkipSmallest(config.attn_skip)
    if kind == "attn" and config.attn_rule == "skip_upto":
        return SkipUpTo(config.attn_skip)
    return Independent()


def skip_smallest_sample(margin: torch.Tensor, k: int, tau: float,
                         gumbels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Training mask, float 0/1 [..., G]: ``k`` hard Gumbel-softmax draws without replacement
    over [skip group g (score -margin_g), skip no more (score 0)], straight-through; a group
    skipped by an earlier draw, and every group after a "skip no more", is out of later draws.
    ``gumbels`` [..., k, G + 1]: the noise to use, else standard Gumbel noise is drawn."""
    g = margin.shape[-1]
    if not 1 <= k < g:
        raise ValueError(f"skip_smallest skips at least 1 and fewer than the {g} groups, got k={k}")
    m = margin.float()
    if gumbels is None:
        gumbels = -torch.empty(*m.shape[:-1], k, g + 1, device=m.device).exponential_().log()
    scores = torch.cat([-m, torch.zeros_like(m[..., :1])], -1)
    out = torch.zeros_like(m)  # groups skipped so far (straight-through)
    gone = torch.zeros(scores.shape, dtype=torch.bool, device=m.device)  # "skip no more" is never gone
    for draw in range(k):
        y = _straight_through((scores.masked_fill(gone, float("-inf")) + gumbels[..., draw, :]) / tau)
        out = out + y[..., :g]
        hard = y.detach() > 0.5
        # out of later draws: the group just skipped, and after a "skip no more" every group
        skipped = hard[..., :g] | hard[..., g:]
        gone = gone | torch.cat([skipped, torch.zeros_like(hard[..., g:])], -1)
    return 1.0 - out


def _straight_through(z: torch.Tensor) -> torch.Tensor:
    """One-hot argmax of ``z`` over the last dim forward, softmax(z) backward."""
    y = z.softmax(-1)
    hard = torch.zeros_like(y).scatter_(-1, y.argmax(-1, keepdim=True), 1.0)
    return hard - y.detach() + y


__all__ = ["Independent", "SkipSmallest", "SkipUpTo", "group_rule", "skip_smallest_runs", "skip_smallest_sample"]
