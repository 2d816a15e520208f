"""``batch_shared_mask``: one group set for a whole decode batch, from the routers' margins, in
one launch (``wide.method.routers.batch_shared_runs`` on the device, for the engine's batch-shared
decode).

Every row of the output is the same set: the ``ceil(active / B)`` groups with the largest sums
of margins over the batch, where ``active`` counts the (row, group) pairs whose own margin says
run. The union the GEMMs read is then the set itself, at the batch's mean width. As in the
reference, margins are summed as integers in units of 2^-20 (``shared_units``), exactly: the set
equals PyTorch's bit for bit and does not depend on the order of the rows; ties go to the lower
group index.

PyTorch needs ~8 launches per module for this (sum, sort, argsort, compare, count): 500 a step
over 32 layers x 2 modules. The kernel's first version cost 15-26 us per launch, the largest
single cost of a batch-shared step; this one (runtime loops, no sort) 6.6 us at batch 32 on an
H200 (bench/results/routing/e2e_reuse.md). At batch 1 the engine does not launch it: a batch of
one's set is its own mask (wide.engine.routing_rules.SharedRule).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import SHARED_CLAMP, SHARED_SCALE, batch_shared_runs

__all__ = ["batch_shared_mask", "batch_shared_mask_reference"]


@triton.jit
def _batch_shared_kernel(m_ptr, out_ptr, score_ptr, B, G, stride_mb, stride_ob,
                         SCALE: tl.constexpr, CLAMP: tl.constexpr, G_PAD: tl.constexpr,
                         RB: tl.constexpr, RH: tl.constexpr):
    # One program, written as runtime loops over the batch and over the groups: the first
    # version (a bitonic sort of a [groups, batch] tile and a [groups, groups] rank, ~3,000
    # straight-line PTX instructions) took 26 us per launch on an H200 (1.7 ms of a 6.2 ms
    # decode step at B=32, experiments/results/routing/e2e_routing_profile.md), far more than its
    # arithmetic: instruction fetch of that much straight-line code is the likely cost.
    # Chunks of rows and of groups keep a few loads in flight per iteration without unrolling
    # the whole problem.
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    score = tl.zeros([G_PAD], dtype=tl.int64)
    count = tl.zeros([G_PAD], dtype=tl.int32)
    for r0 in range(0, B, RB):
        r = r0 + tl.arange(0, RB)
        ok = (r < B)[:, None] & g_ok[None, :]
        m = tl.load(m_ptr + r[:, None] * stride_mb + g[None, :], mask=ok, other=-1.0)
        count += tl.sum((m >= 0).to(tl.int32), axis=0)
        units = tl.floor(tl.minimum(tl.maximum(m, -CLAMP), CLAMP) * SCALE).to(tl.int64)  # exact sums
        score += tl.sum(tl.where(ok, units, 0), axis=0)
    keep = (tl.sum(count, axis=0) + B - 1) // B
    tl.store(score_ptr + g, score, mask=g_ok)
    tl.debug_barrier()  # every thread's scores are in memory before any is read back
    # rank of g: groups with a larger score, or an equal one at a lower index
    rank = tl.zeros([G_PAD], dtype=tl.int32)
    for h0 in range(0, G, RH):
        h = h0 + tl.arange(0, RH)
        s_h = tl.load(score_ptr + h, mask=h < G, other=-9223372036854775807)
        ahead = (s_h[:, None] > score[None, :]) | ((s_h[:, None] == score[None, :]) & (h[:, None] < g[None, :]))
        rank += tl.sum((ahead & (h < G)[:, None]).to(tl.int32), axis=0)
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
    score = torch.empty(G, dtype=torch.int64, device=margin.device)
    _batch_shared_kernel[(1,)](margin, out.view(torch.uint8), score, B, G, margin.stride(0), out.stride(0),
                               SCALE=SHARED_SCALE, CLAMP=SHARED_CLAMP, G_PAD=max(16, triton.next_power_of_2(G)),
                               RB=8, RH=16, num_warps=4)
    return out


def batch_shared_mask_reference(margin: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: ``wide.method.routers.batch_shared_runs`` over every row, as a [B, groups] mask."""
    valid = torch.ones(margin.shape[0], dtype=torch.bool, device=margin.device)
    return batch_shared_runs(margin, valid).unsqueeze(0).expand(margin.shape[0], -1)
