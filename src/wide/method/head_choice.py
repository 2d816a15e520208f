"""Training aids for attention head-group routers that skip the smallest-margin groups
(``attn_rule`` skip_upto / skip_smallest), and the offsets of such routers beside frozen
per-element thresholds: issue 48's design (a), moved here from
experiments/head_routers_fine_cpu.py (``--oracle-ce``, ``--input-choice``, ``--to-library``).

* **Oracle cross-entropy** (``oracle_ce`` W): the training forward computes every group (the mask
  zeroes o_proj's input after attention ran), so a pre-hook on o_proj reads, per token and routed
  layer, the oracle's group: the one of smallest contribution norm ||h_g W_o[:, g]^T|| after the
  thresholds. W x the cross-entropy of the router's G skip scores (-margins) toward it joins the
  task loss. On SmolLM2-135M (CPU trials, experiments/results/head_routers_fine_cpu) the label
  took the trained routers from 2.09x to 1.90x dense perplexity at 40 steps, and W = 3 beat 1 and
  0.3 (1.58x / 1.65x / 1.76x at 80 steps).
* **Input-only choice** (``input_choice``): which group a token skips depends on its input alone.
  The down-projection's bias stays at zero (through up's weight it would be a per-group constant),
  and each up bias gets the mean of its kind's gradient over the groups (exec entries alike, skip
  entries alike), so the groups' exec-skip bias differences keep the spread they start with (none:
  both router starts give every group the same bias) and only their shared level, which sets how
  often a token skips nothing in training, moves. The experiment subtracted that spread from the
  margins instead; both give the bias the same gradient, and here nothing needs folding afterwards.
* **Offsets to an attention-core rate** (:func:`calibrate_core_offsets`): the share of QK^T and
  PV MACs skipped over all layers, those of ``attn_dense_layers`` at 0, on calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..base import arch
from ..base.cliargs import check_fields
from .fine import get_fine
from .offsets import calibrate_offsets
from .state import get_state

SKIP_RULES = ("skip_upto", "skip_smallest")


@dataclass
class HeadArgs:
    """``wide calibrate``'s options for head routers beside frozen thresholds (wide.base.cliargs
    metadata: each default declared here once)."""

    thresholds: Optional[str] = field(default=None, metadata={
        "help": "train the routers beside the frozen per-element thresholds of this set (a shipped name such as "
                "smollm2-135m-fine-50, or a directory wide wrote with thresholds), saved with them: attention "
                "routing only (--sparse-target attention), offsets to --core-target"})
    oracle_ce: float = field(default=0.0, metadata={
        "help": "with --attn-rule skip_upto or skip_smallest: add W x the cross-entropy of each routed layer's skip "
                "scores (-margins) toward the group of smallest contribution to o_proj's output (after the "
                "thresholds) to the task loss (issue 48's design (a): 3)", "min": 0.0})
    input_choice: bool = field(default=False, metadata={
        "help": "with --attn-rule skip_upto or skip_smallest: which attention group a token skips depends on its "
                "input only (no per-group router bias: the down bias stays 0, the up biases move alike)"})
    core_target: Optional[float] = field(default=None, metadata={
        "help": "with --thresholds: attention-core sparsity (share of QK^T and PV MACs skipped over all layers, "
                "--attn-dense-layers at 0) the offsets hit on calibration text (default: --target)",
        "gt": 0.0, "lt": 1.0})

    def __post_init__(self):
        check_fields(self)

    @property
    def trains_choice(self) -> bool:
        return self.oracle_ce > 0 or self.input_choice


def oracle_pick(x: torch.Tensor, weight: torch.Tensor, cols: int) -> torch.Tensor:
    """Per token, the index of the input group of ``cols`` columns of ``x`` [..., G * cols] whose
    contribution to ``x @ weight.T`` (weight [out, G * cols]) has the smallest L2 norm
    ||x_g W[:, g]^T||: the oracle's choice."""
    xs = x.reshape(*x.shape[:-1], -1, cols).float()
    w = weight.float().view(weight.shape[0], -1, cols)
    return torch.einsum("...gc,hgc->...gh", xs, w).norm(dim=-1).argmin(-1)


def oracle_cross_entropy(scores: dict, labels: dict) -> tuple:
    """(mean over layers of the cross-entropy of the skip scores ``scores[layer]`` [..., G] toward
    the oracle's groups ``labels[layer]`` [...], share of tokens whose highest score is the
    oracle's group) for the layers both hold; empties both, so a forward is read once."""
    layers = sorted(set(scores) & set(labels))
    if not layers:
        raise RuntimeError("no routed training forward since the oracle cross-entropy was last read")
    ce, hit = [], []
    for i in layers:
        s, y = scores[i], labels[i]
        ce.append(torch.nn.functional.cross_entropy(s.reshape(-1, s.shape[-1]).float(), y.reshape(-1)))
        hit.append((s.detach().argmax(-1) == y).float().mean())
    scores.clear()
    labels.clear()
    return torch.stack(ce).mean(), float(torch.stack(hit).mean())


class HeadChoice:
    """The oracle label and the input-only choice on a wrapped model's attention routers, from
    construction to :meth:`remove`. :meth:`loss` is ``oracle_ce`` x the oracle cross-entropy of the
    last routed training forward (mean over routed layers), for ``wide.training.train.train``'s
    ``aux_loss``; ``log`` gets (ce, share of tokens whose smallest margin is the oracle's group)
    per call."""

    def __init__(self, model, oracle_ce: float = 0.0, input_choice: bool = False):
        state = get_state(model)
        cfg = state.config
        if cfg.attn_rule not in SKIP_RULES:
            raise ValueError("the oracle label and the input-only choice pick the group a token skips: they need "
                             f"attn_rule in {SKIP_RULES}, got {cfg.attn_rule!r}")
        if oracle_ce > 0 and cfg.route_tile != 1:
            raise ValueError("the oracle label is per token: it needs route_tile 1")
        self.model, self.state, self.weight = model, state, float(oracle_ce)
        self.routers = {i: lr.attn for i, lr in enumerate(model.wide_routers) if lr.attn is not None}
        self.scores, self.labels, self.log = {}, {}, []
        self.handles = []
        if input_choice:
            for r in self.routers.values():
                with torch.no_grad():
                    r.down.bias.zero_()
                r.down.bias.requires_grad_(False)
                self.handles.append(r.up.bias.register_hook(_shared_bias_grad))
        if self.weight > 0:
            state.input_observers.append(self._observe)
            spec, cols = arch.spec_for(model), state.geometry.columns("attn")
            for i, layer in enumerate(arch.decoder_layers(model)):
                if i in self.routers:
                    o = arch.projection(layer, spec, "o")
                    # prepended: before the routing mask, which zeroes the skipped group
                    self.handles.append(o.register_forward_pre_hook(
                        lambda mod, a, i=i: self._label(i, mod, a[0], cols), prepend=True))

    def _training(self) -> bool:
        return self.state.routing and self.state.tau is not None and torch.is_grad_enabled()

    def _observe(self, layer: int, kind: str, x: torch.Tensor) -> None:
        r = self.routers.get(layer) if kind == "attn" else None
        if r is not None and r.training and self._training():
            self.scores[layer] = -r.margin(x)

    def _label(self, layer: int, mod, x: torch.Tensor, cols: int) -> None:
        if not self._training():
            return
        with torch.no_grad():
            fine = get_fine(self.model)
            if fine is not None and fine.enabled:  # the o input the model reads
                x = x * fine.keep(layer, "o", x).to(x.dtype)
            self.labels[layer] = oracle_pick(x, mod.weight, cols)

    def loss(self) -> torch.Tensor:
        ce, hit = oracle_cross_entropy(self.scores, self.labels)
        self.log.append((float(ce.detach()), hit))
        return self.weight * ce

    @property
    def aux_loss(self):
        """``train``'s ``aux_loss``: :meth:`loss` with the oracle label on, else None."""
        return self.loss if self.weight > 0 else None

    def summary(self, last: int = 10) -> Optional[dict]:
        """Mean oracle cross-entropy and match over the last ``last`` calls (None before any)."""
        if not self.log:
            return None
        tail = self.log[-last:]
        return {"oracle_ce": sum(c for c, _ in tail) / len(tail), "oracle_match": sum(m for _, m in tail) / len(tail),
                "calls": len(self.log)}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._observe in self.state.input_observers:
            self.state.input_observers.remove(self._observe)


def _shared_bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """up's bias gradient [2G] (exec, skip per group) with each kind's entries at their mean."""
    g = grad.view(-1, 2)
    return g.mean(0, keepdim=True).expand_as(g).reshape(grad.shape)


@torch.no_grad()
def calibrate_core_offsets(model, batches, rate: float, mode: str = "per_module") -> dict:
    """Attention router offsets so that ``rate`` of the attention core (QK^T and PV) is skipped over
    all layers on ``batches``: per_module, every routed layer skips the same share (``rate`` x
    layers / routed layers, as the kept design's sets were made), global one shift for all."""
    cfg = get_state(model).config
    if cfg.routes_ffn:
        raise ValueError("offsets to an attention-core rate need attention-only routing (sparse_target attention)")
    n = len(model.wide_routers)
    routed = sum(lr.attn is not None for lr in model.wide_routers)
    if not routed:
        raise ValueError("no attention router to calibrate: every layer is in attn_dense_layers")
    target = rate * n / routed if mode == "per_module" else rate
    return calibrate_offsets(model, batches, target=target, mode=mode)


__all__ = ["HeadArgs", "HeadChoice", "oracle_pick", "oracle_cross_entropy", "calibrate_core_offsets", "SKIP_RULES"]
