"""PyTorch formulas that several kernels' references and the engine's torch backend share, as HF
writes them (no Triton needed here)."""
from __future__ import annotations

import torch

__all__ = ["rms_norm_reference", "apply_rope"]


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
