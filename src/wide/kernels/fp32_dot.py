"""``dot``: the kernels' ``tl.dot``, fp32-accurate when its operands are fp32.

On tensor cores ``tl.dot`` multiplies fp32 operands in TF32 by default (10-bit mantissa, ~1e-3
relative error), unlike torch, whose fp32 matmuls stay fp32 unless asked otherwise. Routed
groups tolerate that; per-element thresholds do not: a hard ``|x| >= t`` decision flips for the
inputs that rounding moves across ``t``, and the flips compound over the layers (TF32 rounding
emulated on the PyTorch path moves one fine-mode decode step's logits by 2-8 %, 1e-3 without
thresholds: experiments/results/fine_precision_cpu). fp32 operands therefore take "tf32x3"
(three TF32 products, fp32-level error, as the routers' kernel does) unless Triton's own switch
``TRITON_F32_DEFAULT`` names another precision when the kernels are imported ("tf32" for speed,
"ieee" for plain fp32 FMAs); bf16 and fp16 operands are multiplied exactly as by a plain
``tl.dot`` (the branch is resolved when the kernel compiles).
"""
import os

import triton
import triton.language as tl

__all__ = ["dot", "F32_PRECISION"]

F32_PRECISION = tl.constexpr(os.environ.get("TRITON_F32_DEFAULT", "tf32x3"))


@triton.jit
def dot(a, b, acc):
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision=F32_PRECISION)
    else:
        out = tl.dot(a, b, acc)
    return out
