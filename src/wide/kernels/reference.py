"""PyTorch formulas that several kernels' references and the engine's torch backend share, as HF
writes them (no Triton needed here)."""
from __future__ import annotations

import torch

__all__ = ["rms_norm_reference", "apply_rope", "batch_shared_runs"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (Llama's, Qwen3's q/k norm): statistics in fp32, ``x * rstd`` rounded to
    x's dtype, then the weight product rounded again."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (n.float() * weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``q*cos + rotate_half(q)*sin``; x [..., H, D], cos/sin broadcastable [..., 1, D]."""
    return (x * cos) + (_rotate_half(x) * sin)


def batch_shared_runs(margin: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One execute set [groups] for a whole decode batch (``margin`` [B, groups], ``valid`` [B]
    bool; rows that are not valid take no part).

    It keeps ceil(mean over the valid rows of their own execute counts) groups, the groups with
    the largest summed margins: the set is the union a kernel reads, and the cap keeps it at the
    batch's mean width instead of the union of per-token sets (which approaches every group
    as the batch grows). Ceil rather than round: the batch never runs narrower than its mean
    width, and a batch of one keeps exactly its own groups (its own top-n by margin). The margins
    are sorted over the batch before summing so that the sum, and so the set, does not depend
    on the order of the rows; ties go to the lower group index.
    """
    rows = torch.where(valid.unsqueeze(-1), margin, torch.zeros_like(margin))
    count = ((margin >= 0) & valid.unsqueeze(-1)).sum()  # wide.routers.group_runs
    n = valid.sum().clamp_min(1)
    keep = (count + n - 1) // n  # ceil, in integers: stays on the device
    score = rows.sort(dim=0).values.sum(dim=0)
    order = torch.sort(score, descending=True, stable=True).indices
    return order.argsort() < keep  # a group's rank in the order
