"""``silu_mul``: ``silu(g) * u`` from cuBLAS gate/up outputs in one pass, optionally masked per
group. The dense engine's FFN activation (the routed ``ffn_up`` kernel fuses it into its
epilogue, so the baseline gets a fused pass too), and the routed engine's when cuBLAS measured
faster than ``ffn_up`` (exact zeros in a token's inactive groups, as down's input must be).
Rounds where ``F.silu(g) * u`` rounds: the activation in g's dtype, then the product."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["silu_mul", "silu_mul_reference"]


@triton.jit
def silu_mul_rounded(g, u, out_ty: tl.constexpr):
    """silu(g) * u in ``out_ty``, rounded where ``F.silu(g) * u`` on ``out_ty`` tensors rounds:
    g and u (if given wider), the activation, then the product. The fine GEMV's gate|up epilogue
    calls it on its fp32 sums, so fusing the activation there changes no bit."""
    gf = g.to(out_ty).to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(out_ty)
    return (a.to(tl.float32) * u.to(out_ty).to(tl.float32)).to(out_ty)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, m_ptr, I, GS, stride_g, stride_u, stride_y, stride_m,
                     BLOCK: tl.constexpr, MASKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    if MASKED:
        ok = ok & (tl.load(m_ptr + row * stride_m + c // GS, mask=ok, other=0) != 0)
    g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0)
    u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0)
    tl.store(y_ptr + row * stride_y + c, silu_mul_rounded(g, u, g.dtype), mask=c < I)


def silu_mul(g: torch.Tensor, u: torch.Tensor, mask: Optional[torch.Tensor] = None,
             group_size: int = 1) -> torch.Tensor:
    """silu(g) * u [T, I] in one Triton pass (rows of g and u with unit column stride), with
    exact zeros in the groups where ``mask [T, I // group_size]`` is False when given."""
    T, I = g.shape
    y = torch.empty((T, I), dtype=g.dtype, device=g.device)
    if T:
        m = mask.contiguous().view(torch.uint8) if mask is not None else y
        _silu_mul_kernel[(T, triton.cdiv(I, 1024))](
            g, u, y, m, I, group_size, g.stride(0), u.stride(0), y.stride(0),
            m.stride(0) if mask is not None else 0, BLOCK=1024, MASKED=mask is not None,
            num_warps=4)
    return y


def silu_mul_reference(g: torch.Tensor, u: torch.Tensor, mask: Optional[torch.Tensor] = None,
                       group_size: int = 1) -> torch.Tensor:
    """PyTorch reference of :func:`silu_mul` (HF's ``act(gate) * up`` and its rounding)."""
    y = F.silu(g) * u
    if mask is not None:
        y = y * mask.repeat_interleave(group_size, dim=-1).to(y.dtype)
    return y
