"""silu(gate) * up kernel against PyTorch (CPU: Triton interpreter; bf16 too on a GPU): ragged
widths, strided gate/up views of one fused GEMM output, and the masked variant that writes
exact zeros in a token's inactive groups (all-run, none-run, one token)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from wide.kernels import silu_mul, silu_mul_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _gu(T, I, dtype, seed):
    gu = torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)
    return gu[:, :I], gu[:, I:]  # the dense engine's views of its fused gate/up GEMM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(3, 1100), (1, 96), (5, 2048)])
def test_silu_mul_matches_reference(dtype, T, I):
    g, u = _gu(T, I, dtype, seed=I)
    y = silu_mul(g, u)
    ref = silu_mul_reference(g.float(), u.float())
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert y.dtype == dtype and float((y.float() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("kind", ["random", "all", "none"])
@pytest.mark.parametrize("T", [1, 4])
def test_masked_silu_mul_zeroes_inactive_groups(kind, T):
    I, gs = 1100 - 1100 % 20, 20  # 55 groups; a 1024-wide block ends inside group 51
    g, u = _gu(T, I, torch.float32, seed=T)
    gen = torch.Generator().manual_seed(7)
    mask = {"random": torch.rand(T, I // gs, generator=gen) < 0.5,
            "all": torch.ones(T, I // gs, dtype=torch.bool),
            "none": torch.zeros(T, I // gs, dtype=torch.bool)}[kind].to(DEV)
    y = silu_mul(g, u, mask, gs)
    ref = silu_mul_reference(g, u, mask, gs)
    off = ~mask.repeat_interleave(gs, dim=1)
    assert (y[off] == 0).all()
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-7)
    if kind == "none":
        assert (y == 0).all()
