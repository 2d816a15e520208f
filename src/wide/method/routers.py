"""Token routers: two small linears that give each (token, group) an execute/skip decision.

Routers always hold and compute in float32, whatever the backbone dtype: their logits are
compared against each other and against a calibrated offset, and bf16 rounding flips
decisions near the boundary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.reference import batch_shared_runs  # noqa: F401  (the rule lives beside its kernel's tests)


class Float32Module(nn.Module):
    """A module whose parameters and buffers stay float32 when the model around it moves to
    another dtype: ``model.to(torch.bfloat16)`` moves it but does not downcast it (decisions
    compared against thresholds flip under bf16 rounding)."""

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self


class TokenRouter(Float32Module):
    """Linear(hidden -> rank, bias) -> Linear(rank -> 2*groups, bias), no activation.

    ``offset`` is added to (logit_exec - logit_skip) at inference only; calibrating it moves
    the realised sparsity to an exact target without retraining.
    """

    def __init__(self, hidden_size: int, num_groups: int, rank: int = 16):
        super().__init__()
        self.num_groups = num_groups
        self.down = nn.Linear(hidden_size, rank, bias=True, dtype=torch.float32)
        self.up = nn.Linear(rank, 2 * num_groups, bias=True, dtype=torch.float32)
        self.register_buffer("offset", torch.zeros((), dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.down, self.up):
            nn.init.kaiming_uniform_(lin.weight, nonlinearity="linear")
            nn.init.zeros_(lin.bias)

    def start_dense(self, gap: float = 4.0) -> None:
        """Every group runs at first, whatever the token: ``up``'s weight at zero and its biases
        at +gap/2 (execute) and -gap/2 (skip), so logit_exec - logit_skip = gap for every input
        and a hard Gumbel sample executes with probability sigmoid(gap). ``down`` keeps its
        random weights, so ``up`` gets input-dependent gradients from the first step (as
        LoRA's zero-initialised B matrix does)."""
        with torch.no_grad():
            self.up.weight.zero_()
            self.up.bias.view(self.num_groups, 2).copy_(torch.tensor([gap / 2, -gap / 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [..., groups, 2] with index 0 = execute, 1 = skip."""
        h = self.up(self.down(x.float()))
        return h.view(*x.shape[:-1], self.num_groups, 2)

    def gap(self, x: torch.Tensor) -> torch.Tensor:
        """logit_exec - logit_skip, before the offset (what offset calibration thresholds: taking
        the offset back out of a margin would not give these values exactly in fp32)."""
        logits = self(x)
        return logits[..., 0] - logits[..., 1]

    def margin(self, x: torch.Tensor) -> torch.Tensor:
        """logit_exec - logit_skip + offset; a group runs iff this is >= 0."""
        return self.gap(x) + self.offset

    def runs(self, x: torch.Tensor) -> torch.Tensor:
        """Bool execute mask [..., groups]: the deterministic inference rule."""
        return group_runs(self.margin(x))

    def decide(self, x: torch.Tensor, tau: float | None = None) -> torch.Tensor:
        """Float 0/1 execute mask [..., groups].

        With ``tau`` (training): hard Gumbel-softmax straight-through, so the forward pass
        sees exact 0/1 and the backward pass the soft sample's gradient. Without: the
        deterministic inference rule.
        """
        if tau is None:
            return self.runs(x).float()
        return gumbel_straight_through(self(x), tau)[..., 0]


def group_runs(margin: torch.Tensor) -> torch.Tensor:
    """The inference rule: a group runs iff its margin (logit_exec - logit_skip + offset, summed
    in that order) is >= 0. The Triton kernels that decide (fused norm, prefill router, batch-1
    GEMV) compute the same expression through ``wide.kernels.routing.group_runs``: keep the two
    identical."""
    return margin >= 0


def gumbel_straight_through(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Hard one-hot forward, soft Gumbel-softmax gradient, over the last dim."""
    return F.gumbel_softmax(logits.float(), tau=tau, hard=True, dim=-1)
