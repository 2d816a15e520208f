"""Fused residual + RMSNorm + router kernel against its PyTorch reference (CPU: Triton
interpreter; bf16 too on a GPU): values, masks (random, all-run, none-run, one token), the
cross-program reduction of the router's partial sums, the batch-1 deferred router that the
q and gate/up GEMVs finish, and the previous-tile rule's running sums updated in the same launch."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from wide.kernels import ffn_up, gemm_mn, norm_route, norm_route_reference  # noqa: E402
from wide.method.routers import TokenRouter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _router(H, G, rank=16, seed=0, offset=None):
    torch.manual_seed(seed)
    r = TokenRouter(H, G, rank).to(DEV)
    with torch.no_grad():
        for lin in (r.down, r.up):
            lin.bias.normal_(0, 0.3)
        if offset is not None:
            r.offset.fill_(offset)
    return r


def _margin(router, x):
    with torch.no_grad():
        return router.margin(x.float())


def _same_decisions(mask, want, margin, rel_band=1e-4):
    """Equal decisions, except where the fp32 margin is within rounding of zero (summation
    order differs between the kernel and the module)."""
    assert mask.dtype == torch.bool and mask.shape == want.shape
    near = margin.abs() < rel_band * margin.abs().max().clamp_min(1.0)
    assert bool(((mask == want) | near).all()), int((mask != want).sum())


def _rows(B, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, generator=g).to(dtype).to(DEV)
    d = torch.randn(B, H, generator=g).to(dtype).to(DEV)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype).to(DEV)
    return x, d, w


def _tol(dtype):
    return 1e-6 if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", [(1, 64), (3, 320), (5, 96)])
@pytest.mark.parametrize("chunk", ["decode", "prefill"])
@pytest.mark.parametrize("normed_input", [False, True])
def test_norm_route_matches_reference(dtype, B, H, chunk, normed_input):
    # H = 320 with 256-column chunks: two programs per row (one ragged), whose partial router
    # sums the last one to finish reduces; "prefill" is one program per row.
    x, d, w = _rows(B, H, dtype, seed=B * H)
    router = _router(H, 5, seed=H)
    ch = 256 if chunk == "decode" else 1 << (H - 1).bit_length()
    scratch = {}
    for rep in range(2):  # the per-token tickets must be re-armed for the second call
        resid, normed, mask, rp = norm_route(x, d, w, 1e-5, router, normed_input=normed_input,
                                             chunk=ch, scratch=scratch)
        r_ref, n_ref, m_ref = norm_route_reference(x, d, w, 1e-5, router, normed_input=normed_input)
        assert rp is None
        assert torch.equal(resid, r_ref)
        assert float((normed.float() - n_ref.float()).norm() / n_ref.float().norm()) < _tol(dtype)
        _same_decisions(mask, m_ref, _margin(router, n_ref if normed_input else r_ref))
        assert 0 < mask.float().mean() < 1
    assert all(int(cnt.abs().sum()) == 0 for _, cnt in scratch.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_without_router_or_delta(dtype):
    x, _, w = _rows(4, 200, dtype, seed=1)
    resid, normed, mask, rp = norm_route(x, None, w, 1e-6)
    r_ref, n_ref, _ = norm_route_reference(x, None, w, 1e-6)
    assert resid is x and mask is None and rp is None
    assert float((normed.float() - n_ref.float()).norm() / n_ref.float().norm()) < _tol(dtype)


@pytest.mark.parametrize("kind,offset", [("all", 1e4), ("none", -1e4)])
@pytest.mark.parametrize("B", [1, 4])
def test_all_run_none_run_single_token(kind, offset, B):
    x, d, w = _rows(B, 320, torch.float32, seed=2)
    router = _router(320, 3, offset=offset)
    _, _, mask, _ = norm_route(x, d, w, 1e-5, router)
    assert bool(mask.all()) if kind == "all" else not bool(mask.any())


def _check_deferred(op, H, G, gs, tail, dtype, rows, band):
    """Batch 1: the norm kernel stops at the router's partial sums; the q (or q+k/v with a dense
    ``tail``) and gate/up GEMVs finish the router for their own group and write the mask, which
    starts out wrong everywhere here. Returns (wrong decisions, running decisions)."""
    router = _router(H, G, seed=4)
    torch.manual_seed(3)
    w1 = (0.05 * torch.randn(G * gs + tail, H)).to(dtype).to(DEV)
    w2 = (0.05 * torch.randn(G * gs, H)).to(dtype).to(DEV)
    wrong = on = 0
    for seed in range(rows):
        x, d, w = _rows(1, H, dtype, seed=10 + seed)
        _, normed, mask, rp = norm_route(x, d, w, 1e-5, router, defer=True, scratch={})
        r_ref, _, m_ref = norm_route_reference(x, d, w, 1e-5, router)
        mask.copy_(~m_ref)
        if op == "ffn_up":
            ffn_up(normed, w1, w2, mask, gs, router=rp)
        else:
            gemm_mn(normed, w1, mask, gs, router=rp, dense_tail=tail)
        _same_decisions(mask, m_ref, _margin(router, r_ref), band)
        wrong += int((mask != m_ref).sum())
        on += int(m_ref.sum())
    return wrong, on


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["q", "qkv", "ffn_up"])
def test_deferred_router_finished_by_the_gemv(dtype, op):
    # H = 320 gives two partial-sum chunks.
    wrong, on = _check_deferred(op, 320, 6, 32, 64 if op == "qkv" else 0, dtype, rows=6, band=1e-4)
    assert on > 0 and wrong <= 1


def test_deferred_router_needs_one_token():
    x, d, w = _rows(2, 64, torch.float32, seed=5)
    with pytest.raises(ValueError, match="one token"):
        norm_route(x, d, w, 1e-5, _router(64, 2), defer=True)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("G", [8, 112])
def test_on_gpu_llama_width_many_rows(G):
    # Llama-3.1-8B's width in bf16: 16 column-chunk programs per row whose partial router sums
    # the last one to finish reduces (an acquire/release ticket): 32 rows, three times over, so
    # a missed partial or a ticket left raised shows on the GPU, where programs really race.
    H = 4096
    router = _router(H, G, seed=G)
    scratch = {}
    for rep in range(3):
        x, d, w = _rows(32, H, torch.bfloat16, seed=rep)
        resid, normed, mask, _ = norm_route(x, d, w, 1e-5, router, scratch=scratch)
        r_ref, n_ref, m_ref = norm_route_reference(x, d, w, 1e-5, router)
        assert torch.equal(resid, r_ref)
        assert float((normed.float() - n_ref.float()).norm() / n_ref.float().norm()) < 1e-2
        margin = _margin(router, r_ref)
        near = margin.abs() < 1e-2 * margin.std()  # fp32 summation order only
        assert bool(((mask == m_ref) | near).all())
    torch.cuda.synchronize()
    assert all(int(cnt.abs().sum()) == 0 for _, cnt in scratch.values())


@gpu
@pytest.mark.parametrize("op", ["qkv", "ffn_up"])
def test_on_gpu_deferred_router_llama_width(op):
    # Batch 1 at Llama-3.1-8B's width in bf16: the GEMVs (autotuned tiles, split-K) finish the
    # router from the norm kernel's 16 partial sums and write the mask for attention, O, down.
    G, gs = (8, 512) if op == "qkv" else (112, 128)
    wrong, on = _check_deferred(op, 4096, G, gs, 2048 if op == "qkv" else 0, torch.bfloat16, rows=16,
                                band=1e-2)
    assert on > 0 and wrong <= 2


@pytest.mark.parametrize("normed_input", [False, True])
@pytest.mark.parametrize("B,H", [(1, 64), (3, 320)])
def test_margins_for_batch_shared_decode(B, H, normed_input):
    # margins=True: the fp32 margins the mask is decided from (>= 0 runs), for a batch-wide choice
    x, d, w = _rows(B, H, torch.float32, seed=7 * B + H)
    router = _router(H, 6, seed=H + 1)
    _, _, mask, _ = norm_route(x, d, w, 1e-5, router, normed_input=normed_input, chunk=256)
    resid, normed, margin, rp = norm_route(x, d, w, 1e-5, router, normed_input=normed_input, chunk=256,
                                           margins=True)
    r_ref, n_ref, _ = norm_route_reference(x, d, w, 1e-5, router, normed_input=normed_input)
    want = _margin(router, n_ref if normed_input else r_ref)
    assert rp is None and margin.dtype == torch.float32 and margin.shape == (B, 6)
    assert torch.allclose(margin, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(margin >= 0, mask)  # the same decision as the mask the kernel writes
    with pytest.raises(ValueError, match="deferred"):
        norm_route(x[:1], d[:1], w, 1e-5, router, defer=True, margins=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,H", [(1, 64), (3, 320)])
@pytest.mark.parametrize("normed_input", [False, True])
@pytest.mark.parametrize("delta", [True, False])
def test_tile_sums_in_the_norm_launch(dtype, B, H, normed_input, delta):
    # The previous-tile rule's running sums: done <- acc; acc <- row where a tile starts, else
    # acc + row; the row being the residual or the normed input (fp32), as the router reads it.
    x, d, w = _rows(B, H, dtype, seed=4)
    d = d if delta else None
    g = torch.Generator().manual_seed(5)
    acc0 = torch.randn(B, H, generator=g).to(DEV)
    for start in (torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool),
                  torch.arange(B) % 2 == 0):
        start = start.to(DEV)
        acc, done = acc0.clone(), torch.full((B, H), float("nan"), device=DEV)
        resid, normed, mask, _ = norm_route(x, d, w, 1e-5, normed_input=normed_input, tile_sums=(acc, done, start[:, None]))
        ref_resid, ref_normed, _ = norm_route_reference(x, d, w, 1e-5)
        torch.testing.assert_close(resid, ref_resid, rtol=_tol(dtype), atol=_tol(dtype))
        torch.testing.assert_close(normed, ref_normed, rtol=_tol(dtype), atol=_tol(dtype))
        row = (normed if normed_input else resid).float()
        assert mask is None
        assert torch.equal(done, acc0)
        torch.testing.assert_close(acc, torch.where(start[:, None], row, acc0 + row), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp32"):
        norm_route(x, d, w, 1e-5, tile_sums=(acc.half(), done, start))
    with pytest.raises(ValueError, match="start flags"):
        norm_route(x, d, w, 1e-5, tile_sums=(acc, done, start.float()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H", [(1, 64), (3, 320)])
@pytest.mark.parametrize("router", [False, True])
def test_fp32_delta_is_rounded_first(dtype, B, H, router):
    # An fp32 delta (a GEMV's unrounded sums) gives exactly what the same sums rounded to x's
    # dtype give: the rounding the GEMV's epilogue did before is now the norm's. Deltas with
    # bits below x's precision make the check fail if the kernel added the fp32 values as they are.
    x, _, w = _rows(B, H, dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    d32 = (torch.randn(B, H, generator=g) * 3 + 1e-3 * torch.rand(B, H, generator=g)).to(DEV)
    r = _router(H, 5, seed=H) if router else None
    got = norm_route(x, d32, w, 1e-5, r, chunk=256)
    want = norm_route(x, d32.to(dtype), w, 1e-5, r, chunk=256)
    ref = norm_route_reference(x, d32, w, 1e-5, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0], ref[0])
    assert torch.equal(ref[0], norm_route_reference(x, d32.to(dtype), w, 1e-5)[0])
    if dtype != torch.float32:  # the test's deltas do carry bits the rounding drops
        assert not torch.equal(ref[0], (x.float() + d32).to(dtype))
    if router:
        assert torch.equal(got[2], want[2])
    # the fused final norm of the engine reads it as well
    assert torch.equal(norm_route(x, d32, w, 1e-5)[1], norm_route(x, d32.to(dtype), w, 1e-5)[1])


def test_delta_errors():
    x, d, w = _rows(2, 64, torch.float16, seed=8)
    with pytest.raises(ValueError, match="float32 sums"):
        norm_route(x, d.double(), w, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be a \[2, 64\]"):
        norm_route(x, d[:1], w, 1e-5)
    with pytest.raises(ValueError, match="unit column stride"):
        norm_route(x, torch.zeros(64, 2, dtype=torch.float16, device=DEV).t(), w, 1e-5)
