"""``batch_shared_mask``: one group set for a whole decode batch, from the routers' margins, in
one launch (``wide.routers.batch_shared_runs`` on the device, for the engine's batch-shared
decode).

Every row of the output is the same set: the ``ceil(active / B)`` groups with the largest sums
of margins over the batch, where ``active`` counts the (row, group) pairs whose own margin says
run. The union the GEMMs read is then the set itself, at the batch's mean width. As in the
reference, each group's margins are sorted over the batch before they are summed, so the set
does not depend on the order of the rows; ties go to the lower group index. Sums may differ from
PyTorch's in the last bit (another summation tree), which can only swap groups whose sums tie to
within that.

PyTorch needs ~8 launches per module for this (sort, sum, sort, argsort, compare, count): 500 a
step over 32 layers x 2 modules. This one launch still costs 15-26 us (one program walking a
bitonic sort), the largest single cost of a batch-shared step; folding the choice into the norm
kernel's last program (a batch-wide ticket) is the next step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import batch_shared_runs

__all__ = ["batch_shared_mask", "batch_shared_mask_reference"]


@triton.jit
def _batch_shared_kernel(m_ptr, out_ptr, B, G, stride_mb, stride_ob,
                         B_PAD: tl.constexpr, G_PAD: tl.constexpr):
    # One program. It is latency-bound: 26 us per module at B=32 on an H200 (1.7 ms of a 6.2 ms
    # decode step, bench/results/routing/e2e_routing_profile.md). A version without the sort,
    # on a [batch, groups] tile, measured slower still (B=8 step 4.57 vs 4.12 ms).
    g = tl.arange(0, G_PAD)
    b = tl.arange(0, B_PAD)
    g_ok = g < G
    ok = g_ok[:, None] & (b < B)[None, :]
    # [groups, batch]: Triton sorts along the last dimension only.
    m = tl.load(m_ptr + b[None, :] * stride_mb + g[:, None], mask=ok, other=0.0)
    count = tl.sum(tl.sum(((m >= 0) & ok).to(tl.int32), axis=1), axis=0)
    keep = (count + B - 1) // B
    score = tl.sum(tl.sort(m, dim=1), axis=1)
    score = tl.where(g_ok, score, float("-inf"))
    # rank of g: groups with a larger score, or an equal one at a lower index
    s_g = score[:, None]
    s_h = tl.reshape(score, (1, G_PAD))
    h = tl.reshape(g, (1, G_PAD))
    ahead = (s_h > s_g) | ((s_h == s_g) & (h < g[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    runs = (rank < keep).to(tl.uint8)
    for r in range(0, B):
        tl.store(out_ptr + r * stride_ob + g, runs, mask=g_ok)


def batch_shared_mask(margin: torch.Tensor) -> torch.Tensor:
    """Bool mask ``[B, groups]`` whose rows are all the batch's shared set, from the routers'
    fp32 margins ``[B, groups]`` of one decode step (every row a sequence of the batch).
"""
    if margin.dim() != 2 or margin.dtype != torch.float32:
        raise ValueError(f"margin must be a float32 [B, groups] tensor, got {margin.dtype} {list(margin.shape)}")
    B, G = margin.shape
    out = torch.empty((B, G), dtype=torch.bool, device=margin.device)
    if B == 0 or G == 0:
        return out
    if margin.stride(1) != 1:
        margin = margin.contiguous()
    _batch_shared_kernel[(1,)](margin, out.view(torch.uint8), B, G, margin.stride(0), out.stride(0),
                               B_PAD=max(2, triton.next_power_of_2(B)), G_PAD=max(16, triton.next_power_of_2(G)),
                               num_warps=4)
    return out


def batch_shared_mask_reference(margin: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: ``wide.routers.batch_shared_runs`` over every row, as a [B, groups] mask."""
    valid = torch.ones(margin.shape[0], dtype=torch.bool, device=margin.device)
    return batch_shared_runs(margin, valid).unsqueeze(0).expand(margin.shape[0], -1)
