"""The prefill router (``router_mask``): a :class:`~wide.method.routers.TokenRouter`'s bool mask for
many rows in one launch, straight from the model-dtype rows.

PyTorch ran this as an fp32 copy of x plus a narrow sgemm: ~10 of 109 ms of a 4k-token prefill
on an H200. The dots are "tf32x3" (three TF32 tensor-core products with fp32 accumulation, ~fp32
accurate; bf16 x is exact in TF32): "ieee" fp32 FMAs took 180 us per 4k-token call there,
slower than PyTorch. The kernel backend runs on sm80+ only (TF32 present); the interpreter
computes the dots in fp32 regardless.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .env import interpret_mode
from .routing import group_runs

__all__ = ["router_mask", "router_mask_reference"]


@triton.jit
def _router_mask_kernel(x_ptr, dw_ptr, db_ptr, uw_ptr, ub_ptr, off_ptr, m_ptr,
                        T, H, G, R, stride_x, stride_m,
                        BM: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr,
                        G_PAD: tl.constexpr):
    # [BM tokens] per program: h = x W_down^T + b, then both logits of every group and the
    # mask, in one launch.
    pid = tl.program_id(0)
    rows = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    r_ok = rows < T
    rr = tl.arange(0, R_PAD)
    rr_ok = rr < R
    acc = tl.zeros([BM, R_PAD], dtype=tl.float32)
    for k0 in range(0, H, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < H
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(dw_ptr + rr[None, :] * H + k[:, None], mask=rr_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision="tf32x3")
    h = acc + tl.load(db_ptr + rr, mask=rr_ok, other=0.0)[None, :]
    gs = tl.arange(0, G_PAD)
    g_ok = gs < G
    u_ok = rr_ok[:, None] & g_ok[None, :]
    u0 = tl.load(uw_ptr + (2 * gs)[None, :] * R + rr[:, None], mask=u_ok, other=0.0)
    u1 = tl.load(uw_ptr + (2 * gs + 1)[None, :] * R + rr[:, None], mask=u_ok, other=0.0)
    l0 = tl.dot(h, u0, input_precision="tf32x3") + tl.load(ub_ptr + 2 * gs, mask=g_ok, other=0.0)[None, :]
    l1 = tl.dot(h, u1, input_precision="tf32x3") + tl.load(ub_ptr + 2 * gs + 1, mask=g_ok, other=0.0)[None, :]
    runs = group_runs(l0, l1, tl.load(off_ptr))
    tl.store(m_ptr + rows[:, None] * stride_m + gs[None, :], runs.to(tl.uint8),
             mask=r_ok[:, None] & g_ok[None, :])


def router_mask(router, x: torch.Tensor) -> torch.Tensor:
    """Bool mask ``[..., groups]`` of ``router`` (a TokenRouter) on rows ``x [..., H]``, in one
    launch; the router module's own decision up to fp32 summation order."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    T, G, R = x2.shape[0], router.num_groups, router.down.out_features
    mask = torch.empty((T, G), dtype=torch.bool, device=x.device)
    if T:
        bm = 32 if T >= 2048 or interpret_mode() else 16  # enough programs for every SM
        _router_mask_kernel[(triton.cdiv(T, bm),)](
            x2, router.down.weight, router.down.bias, router.up.weight, router.up.bias,
            router.offset, mask.view(torch.uint8), T, H, G, R, x2.stride(0), mask.stride(0),
            BM=bm, BK=64, R_PAD=max(16, triton.next_power_of_2(R)),
            G_PAD=max(16, triton.next_power_of_2(G)), num_warps=4)
    return mask.view(*x.shape[:-1], G)


def router_mask_reference(router, x: torch.Tensor) -> torch.Tensor:
    """fp32 PyTorch reference of :func:`router_mask`: the router module's decision."""
    return router.runs(x.float())
