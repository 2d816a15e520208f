"""TEAL's sparse decode GEMV, rebuilt as its authors describe it, for a same-process comparison.

FasterDecoding/TEAL (kernels/sparse_gemv.py, from Deja Vu's gather GEMV): the weight is stored
once, column-major (``w_t [K, N]``, as :func:`wide.kernels.fine_gemv.fine_layout` lays it
out); one program per ``[BLOCK_M input rows x BLOCK_N outputs]`` tile loads its inputs once,
loads the weight rows whose ``|x| > threshold`` under that mask, multiplies in fp32 and
``atomic_add``s its partial sums into the output in the output's dtype (fp16 / bf16
accumulation across tiles), which a pre-hook zeroes before every launch. Configs autotuned per
shape and sparsity bin. Batch 1 only. Used by :mod:`wide.benchmarks.fine_gemv`
(``--teal``); never by the library.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["teal_gemv"]

# TEAL's list (BLOCK_M input rows x BLOCK_N outputs per program)
_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
            for m, n, w in ((8, 128, 2), (16, 256, 4), (32, 256, 4), (64, 128, 2), (64, 64, 4),
                            (128, 64, 4), (128, 128, 4), (32, 128, 2), (16, 128, 2))]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "SPARSITY_BIN"], reset_to_zero=["y_ptr"])
@triton.jit
def _teal_kernel(y_ptr, w_ptr, x_ptr, threshold, N, K, stride_wk, SPARSITY_BIN,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + rm, mask=rm < K, other=0.0)
    keep = tl.abs(x) > threshold
    w = tl.load(w_ptr + rm[:, None] * stride_wk + rn[None, :], mask=keep[:, None] & (rn[None, :] < N), other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None], 0)
    tl.atomic_add(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def teal_gemv(x: torch.Tensor, w_t: torch.Tensor, threshold: float, sparsity: float,
              out: torch.Tensor = None) -> torch.Tensor:
    """``y [1, N]`` = the inputs of ``x [1, K]`` with ``|x| > threshold`` times ``w_t [K, N]``.
    ``sparsity`` picks the tuning bin (TEAL keys its autotuner on it)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError("TEAL's kernel takes one token: x [1, K]")
    K, N = w_t.shape
    y = torch.zeros(1, N, dtype=x.dtype, device=x.device) if out is None else out
    y.zero_()  # what its pre-hook does at every launch
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K, meta["BLOCK_M"]))  # noqa: E731
    _teal_kernel[grid](y, w_t, x, float(threshold), N, K, w_t.stride(0), int(sparsity * 10))
    return y
