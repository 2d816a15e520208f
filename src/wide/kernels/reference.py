"""PyTorch formulas that several kernels' references and the engine's torch backend share, as HF
writes them (no Triton needed here)."""
from __future__ import annotations

import torch

__all__ = ["rms_norm_reference", "apply_rope", "batch_shared_runs", "shared_units", "skip_smallest_runs"]


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


# Margins are summed over the batch as integers in units of 2^-20 (rounded down, after a clamp
# that keeps 1024 rows of them inside int64): integer sums are exact, so the sum, and the set,
# does not depend on the order of the rows, and the kernel's sum equals this one bit for bit
# without sorting each group's margins first. Down, not toward zero: every margin that says
# skip (< 0) stays below every one that says run (>= 0), so a batch of one keeps exactly its
# own groups (truncation sent both -1e-7 and +1e-7 to 0, a tie the lower group index won).
SHARED_SCALE = 2.0 ** 20
SHARED_CLAMP = 1e9


def shared_units(margin: torch.Tensor) -> torch.Tensor:
    """fp32 margins as int64 counts of 2^-20 (what batch_shared_runs sums)."""
    return torch.floor(margin.float().clamp(-SHARED_CLAMP, SHARED_CLAMP) * SHARED_SCALE).to(torch.int64)


def batch_shared_runs(margin: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One execute set [groups] for a whole decode batch (``margin`` [B, groups], ``valid`` [B]
    bool; rows that are not valid take no part).

    It keeps ceil(mean over the valid rows of their own execute counts) groups, the groups with
    the largest summed margins: the set is the union a kernel reads, and the cap keeps it at the
    batch's mean width instead of the union of per-token sets (which approaches every group
    as the batch grows). Ceil rather than round: the batch never runs narrower than its mean
    width, and a batch of one keeps exactly its own groups (its own top-n by margin, which
    ``shared_units`` keeps apart from the groups it skips). The
    margins are summed exactly (``shared_units``), so the set does not depend on the order of
    the rows; ties go to the lower group index.
    """
    count = ((margin >= 0) & valid.unsqueeze(-1)).sum()  # wide.method.routers.group_runs
    n = valid.sum().clamp_min(1)
    keep = (count + n - 1) // n  # ceil, in integers: stays on the device
    score = torch.where(valid.unsqueeze(-1), shared_units(margin), 0).sum(dim=0)
    order = torch.sort(score, descending=True, stable=True).indices
    return order.argsort() < keep  # a group's rank in the order


def skip_smallest_runs(margin: torch.Tensor, k: int) -> torch.Tensor:
    """Bool execute mask [..., G]: False on the ``k`` smallest margins of each row, ties to the
    lower index. A rank count (no sort), so the engine's CUDA graphs capture it and both paths
    pick the same groups: group g's rank is the number of groups j with m_j < m_g, or m_j == m_g
    and j < g."""
    g = margin.shape[-1]
    if not 1 <= k < g:
        raise ValueError(f"skip_smallest skips at least 1 and fewer than the {g} groups, got k={k}")
    a, b = margin.unsqueeze(-1), margin.unsqueeze(-2)  # [..., g, 1] (this group), [..., 1, j] (the others)
    idx = torch.arange(g, device=margin.device)
    before = (b < a) | ((b == a) & (idx[None, :] < idx[:, None]))
    return before.sum(-1) >= k
