"""``skip_rule``: the attention mask of the ``skip_smallest`` / ``skip_upto`` rules from router
margins in one launch. Per row, group g runs unless it is among the ``k`` smallest margins (ties
to the lower index; ``upto``: and below 0). The PyTorch form
(:func:`wide.kernels.reference.skip_smallest_runs`, which the rules in
:mod:`wide.method.group_rules` call: a rank count) is ~10 elementwise launches
per layer, which in a CUDA-graph decode step at batch 8 cost more than the skipped K/V reads
saved (bench/results/h100/e2e_heads25.md: ~1.1 ms a step outside attention)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import skip_smallest_runs

__all__ = ["skip_rule", "skip_rule_reference"]


@triton.jit
def _skip_rule_kernel(m_ptr, out_ptr, R, G, K, stride_m, stride_o, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                      UPTO: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.arange(0, BLOCK_G)
    ok = (r < R)[:, None] & (g < G)[None, :]
    m = tl.load(m_ptr + r[:, None].to(tl.int64) * stride_m + g[None, :], mask=ok, other=0.0).to(tl.float32)
    rank = tl.zeros((BLOCK_R, BLOCK_G), dtype=tl.int32)
    for j in range(0, G):  # group g's rank: groups j of smaller margin, or equal and before it
        mj = tl.load(m_ptr + r.to(tl.int64) * stride_m + j, mask=r < R, other=0.0).to(tl.float32)[:, None]
        before = (mj < m) | ((mj == m) & (j < g[None, :]))
        rank += before.to(tl.int32)
    runs = rank >= K
    if UPTO:
        runs = runs | (m >= 0)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + g[None, :], runs.to(tl.uint8), mask=ok)


def skip_rule(margin: torch.Tensor, k: int, upto: bool = False) -> torch.Tensor:
    """Bool mask ``[..., G]`` from margins ``[..., G]`` (any float dtype; rows with unit column
    stride): False on each row's ``k`` smallest margins (``upto``: only those below 0)."""
    G = margin.shape[-1]
    if not 1 <= k < G:
        raise ValueError(f"skip_smallest skips at least 1 and fewer than the {G} groups, got k={k}")
    m = margin.reshape(-1, G)
    if m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.empty(m.shape, dtype=torch.bool, device=m.device)
    R = m.shape[0]
    if R:
        BLOCK_G = triton.next_power_of_2(G)
        BLOCK_R = max(1, min(64, 4096 // BLOCK_G, triton.next_power_of_2(R)))
        _skip_rule_kernel[(triton.cdiv(R, BLOCK_R),)](
            m, out.view(torch.uint8), R, G, k, m.stride(0), out.stride(0), BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G,
            UPTO=upto, num_warps=1 if BLOCK_R * BLOCK_G <= 256 else 4)
    return out.reshape(margin.shape)


def skip_rule_reference(margin: torch.Tensor, k: int, upto: bool = False) -> torch.Tensor:
    """PyTorch reference of :func:`skip_rule` (the rules' own form)."""
    runs = skip_smallest_runs(margin, k)
    return runs | (margin >= 0) if upto else runs
