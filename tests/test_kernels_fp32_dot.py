"""kernels.fp32_dot: fp32 operands multiplied at fp32 accuracy (tf32x3 by default: TF32's
~1e-3 error flips per-element thresholds), bf16 / fp16 exactly as a plain tl.dot, Triton's
TRITON_F32_DEFAULT honoured. Under the interpreter every dot is exact, so the accuracy test
judges only on a GPU, where it also compiles both branches (gpu_smoke runs `-k on_gpu`)."""
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from wide.kernels.fp32_dot import dot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = "cuda" if GPU else "cpu"


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    acc = dot(a, b, tl.zeros((M, N), dtype=tl.float32))
    tl.store(c_ptr + m[:, None] * N + n[None, :], acc)


def _mm(a, b):
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    _mm_kernel[(1,)](a, b, c, M=a.shape[0], N=b.shape[1], K=a.shape[1])
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else []))
def test_on_gpu_fp32_operands_at_fp32_accuracy(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(DEV, dtype)
    b = torch.randn(64, 32, generator=g).to(DEV, dtype)
    got = _mm(a, b).double()
    want = a.double() @ b.double()
    err = float((got - want).norm() / want.norm())
    # TF32 gives ~5e-4 here; tf32x3 and the interpreter ~1e-7; half-precision operands are exact
    # products summed in fp32
    assert err < (1e-5 if dtype == torch.float32 else 1e-6), err


def test_triton_f32_default_names_the_precision():
    code = "from wide.kernels.fp32_dot import F32_PRECISION as p; print(p.value)"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("TRITON_F32_DEFAULT", None)
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "tf32x3"
    env["TRITON_F32_DEFAULT"] = "ieee"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "ieee"
