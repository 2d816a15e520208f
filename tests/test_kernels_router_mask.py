"""Prefill router kernel against the router module (CPU: Triton interpreter; bf16 too on a
GPU, where its dots run as TF32x3): ragged token counts, ranks below the 16-wide dot tile,
group counts past one tile, 3-D input, all-run / none-run / one token."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from wide.kernels import router_mask, router_mask_reference  # noqa: E402
from wide.method.routers import TokenRouter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _router(H, G, rank, offset=None):
    torch.manual_seed(G * 100 + rank)
    r = TokenRouter(H, G, rank).to(DEV)
    with torch.no_grad():
        r.down.bias.normal_(0, 0.3)
        r.up.bias.normal_(0, 0.3)
        if offset is not None:
            r.offset.fill_(offset)
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37,), (2, 19), (1,)])
@pytest.mark.parametrize("G,rank", [(4, 16), (20, 5), (1, 16)])
def test_router_mask_matches_module(dtype, shape, G, rank):
    H = 96  # one full 64-wide K step and a ragged one
    x = torch.randn(*shape, H, generator=torch.Generator().manual_seed(G)).to(dtype).to(DEV)
    router = _router(H, G, rank)
    mask = router_mask(router, x)
    want = router_mask_reference(router, x)
    assert mask.shape == (*shape, G) and mask.dtype == torch.bool
    with torch.no_grad():
        margin = router.margin(x.float())
    # Summation order differs from the module's: only a margin within rounding of 0 may flip.
    near = margin.abs() < 1e-4 * margin.abs().max()
    assert bool(((mask == want) | near).all())
    if x.numel() // H * G > 8:
        assert 0 < mask.float().mean() < 1


@pytest.mark.parametrize("offset,want", [(1e4, True), (-1e4, False)])
@pytest.mark.parametrize("T", [1, 33])
def test_all_run_none_run(offset, want, T):
    router = _router(64, 6, 16, offset=offset)
    mask = router_mask(router, torch.randn(T, 64, device=DEV))
    assert mask.shape == (T, 6) and bool((mask == want).all())


def test_no_tokens():
    assert router_mask(_router(64, 3, 16), torch.randn(0, 64, device=DEV)).shape == (0, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("G", [8, 112])
def test_on_gpu_4096_tokens_tf32x3(G):
    # A 4k-token prefill of Llama-3.1-8B's width in bf16, where the dots run as TF32x3 on the
    # tensor cores: decisions equal the fp32 module's except within 1e-3 std of the threshold.
    router = _router(4096, G, 16)
    x = torch.randn(4096, 4096, device=DEV).bfloat16()
    mask = router_mask(router, x)
    with torch.no_grad():
        margin = router.margin(x.float())
    near = margin.abs() < 1e-3 * margin.std()
    assert bool(((mask == (margin >= 0)) | near).all())
    assert float((mask != (margin >= 0)).float().mean()) < 1e-3
