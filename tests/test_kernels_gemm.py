"""Routed GEMM kernels (gemm_mn, ffn_up, gemm_k) and the routing index against fp32 references.

Runs on the CPU through Triton's interpreter (set before triton is imported); on a CUDA
machine run with TRITON_INTERPRET=0 to test the compiled kernels, bf16 included.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from conftest import tile_id  # noqa: E402
from wide.kernels.gemm_k import gemm_k, gemm_k_reference  # noqa: E402
from wide.kernels.gemm_mn import ffn_up, ffn_up_reference, gemm_mn, gemm_mn_reference  # noqa: E402
from wide.kernels.routing import (RouteIndex, RouterPartials, build_route,  # noqa: E402
                                  route_reference, split_tickets, used_groups_reference)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

# Under the interpreter tl.dot on bf16 is wrong (bf16 loads are fine), so bf16 only on CUDA.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOKENS = [1, 3, 17, 70]
MASK_KINDS = ["random", "all", "none", "one_token"]


def kinds_by_dtype(kinds, dtypes=DTYPES, half_kinds=("random", "none")):
    """(kind, dtype) pairs: every mask kind in float32, the 16-bit types under the interpreter
    with ``half_kinds`` only. The interpreter runs the same kernel code for every dtype (the
    dtype changes the element type of loads and stores, not which groups, programs or branches
    run, which the kind decides): a random mask checks the 16-bit values, "none" the exact
    zeros they store. Compiled (CUDA), where each dtype is its own binary, every pair runs."""
    return [pytest.param(k, d, id=f"{k}-{d}") for d in dtypes for k in kinds
            if d == torch.float32 or DEVICE == "cuda" or k in half_kinds]


@pytest.fixture(autouse=True)
def _split_gemv(monkeypatch):
    # run the batch-1 GEMV kernels split in two along K (partials + last-program reduction)
    import wide.kernels.routing as routing
    monkeypatch.setattr(routing, "INTERPRET_GEMV_SPLIT", 2)


def make_mask(T, ng, kind, gen):
    if kind == "all":
        return torch.ones(T, ng, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(T, ng, dtype=torch.bool)
    if kind == "one_token":  # exactly one token active, in a subset of groups
        m = torch.zeros(T, ng, dtype=torch.bool)
        m[T // 2] = torch.rand(ng, generator=gen) < 0.6
        m[T // 2, 0] = True
        return m
    return torch.rand(T, ng, generator=gen) < 0.5


def rel_err(y, ref):
    y = y.float().cpu()
    ref = ref.float().cpu()
    assert not torch.isnan(y).any(), "NaN in output"
    return ((y - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 5e-3


def _inputs(T, K, N, dtype, gen, n_w=1):
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE) for _ in range(n_w)]
    return x, ws


# ---------------------------------------------------------------- routing
@pytest.mark.parametrize("T", [0, 1, 5, 70, 300])
@pytest.mark.parametrize("ng", [1, 3, 8])
def test_route_idx_matches_reference(T, ng):
    gen = torch.Generator().manual_seed(T * 10 + ng)
    mask = (torch.rand(T, ng, generator=gen) < 0.4).to(DEVICE)
    r = build_route(mask)
    idx_ref, cnt_ref = route_reference(mask.cpu())
    assert r.idx.dtype == torch.int32 and r.counts.dtype == torch.int32
    assert torch.equal(r.idx.cpu(), idx_ref)
    assert torch.equal(r.counts.cpu(), cnt_ref)
    assert r.num_tokens == T and r.num_groups == ng


@pytest.mark.parametrize("T,ng,bm", [(70, 8, 16), (100, 5, 32), (33, 70, 16), (7, 4, 16)])
def test_route_token_tiles(T, ng, bm):
    gen = torch.Generator().manual_seed(T + ng)
    mask = (torch.rand(T, ng, generator=gen) < 0.3).to(DEVICE)
    perm, tg, tc = RouteIndex(mask).token_tiles(bm)
    order = torch.arange(T) if perm is None else perm.cpu().long()
    if perm is not None:
        assert sorted(order.tolist()) == list(range(T))
        # tokens grouped by pattern: sorted keys are non-decreasing
        w = 2 ** torch.arange(ng - 1, -1, -1)
        keys = (mask.cpu()[order].long() * w).sum(1)
        assert torch.all(keys[1:] >= keys[:-1])
    for i in range(triton_cdiv(T, bm)):
        rows = order[i * bm:(i + 1) * bm]
        want = torch.nonzero(mask.cpu()[rows].any(0)).flatten().tolist()
        c = int(tc[i])
        assert c == len(want)
        assert tg[i, :c].cpu().tolist() == want


@pytest.mark.parametrize("T", [0, 1, 3, 16, 40])
@pytest.mark.parametrize("ng", [1, 5, 112])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_route_used_groups(T, ng, p):
    gen = torch.Generator().manual_seed(T * 1000 + ng + int(p * 10))
    mask = (torch.rand(T, ng, generator=gen) < p).to(DEVICE)
    r = build_route(mask)
    groups, count = r.used_groups()
    assert groups.dtype == torch.int32 and count.dtype == torch.int32 and count.shape == (1,)
    want = [g for g in range(ng) if any(bool(mask[t, g]) for t in range(T))]  # ascending
    assert int(count) == len(want)
    assert groups[:len(want)].cpu().tolist() == want
    assert groups[len(want):].cpu().tolist() == [g for g in range(ng) if g not in want]
    g_ref, c_ref = used_groups_reference(mask.cpu())
    assert torch.equal(groups.cpu(), g_ref) and torch.equal(count.cpu(), c_ref)
    assert r.used_groups()[0] is groups  # cached


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------- gemm_mn / ffn_up
@pytest.mark.parametrize("kind,dtype", kinds_by_dtype(MASK_KINDS))
@pytest.mark.parametrize("T", TOKENS)
def test_gemm_mn(T, kind, dtype):
    gen = torch.Generator().manual_seed(1000 + T)
    G, ng, K = 32, 3, 40  # K not a multiple of the block size
    x, (w,) = _inputs(T, K, G * ng, dtype, gen)
    mask = make_mask(T, ng, kind, gen).to(DEVICE)
    out = torch.full((T, G * ng), float("nan"), dtype=dtype, device=DEVICE)  # poison
    y = gemm_mn(x, w, mask, G, out=out)
    assert y.data_ptr() == out.data_ptr()
    ref = gemm_mn_reference(x, w, mask, G)
    inactive = ~mask.repeat_interleave(G, 1)
    assert torch.all(y[inactive] == 0), "inactive outputs must be exact zeros"
    if kind != "none":
        assert rel_err(y, ref) < tol(dtype)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("T", [1, 3, 16, 40])
def test_gemm_mn_dense_tail(T, kind):
    # Routed Q with dense K/V in one call: 3 masked groups then 2 always-on ones. T <= 16 runs
    # one launch (the decode path); T = 40 runs the routed part and a plain GEMM for the tail.
    gen = torch.Generator().manual_seed(2000 + T)
    G, ng, tail, K = 32, 3, 2, 300
    x, (w,) = _inputs(T, K, G * (ng + tail), torch.float32, gen)
    mask = make_mask(T, ng, kind, gen).to(DEVICE)
    out = torch.full((T, G * (ng + tail)), float("nan"), dtype=torch.float32, device=DEVICE)
    y = gemm_mn(x, w, mask, G, out=out, dense_tail=G * tail)
    ref = gemm_mn_reference(x, w, mask, G, dense_tail=G * tail)
    assert torch.all(y[:, :G * ng][~mask.repeat_interleave(G, 1)] == 0)
    assert rel_err(y, ref) < 5e-3
    assert rel_err(y[:, G * ng:], x @ w[G * ng:].t()) < 5e-3
    with pytest.raises(ValueError, match="dense_tail"):
        gemm_mn(x, w, mask, G, dense_tail=G + 1)
    with pytest.raises(ValueError, match="mask"):
        gemm_mn(x, w, mask, G, dense_tail=G)  # mask then needs 4 columns


@pytest.mark.parametrize("kind,dtype", kinds_by_dtype(MASK_KINDS))
@pytest.mark.parametrize("T", TOKENS)
def test_ffn_up(T, kind, dtype):
    gen = torch.Generator().manual_seed(2000 + T)
    G, ng, K = 48, 2, 64  # group size not a power of two
    x, (wg, wu) = _inputs(T, K, G * ng, dtype, gen, n_w=2)
    mask = make_mask(T, ng, kind, gen).to(DEVICE)
    route = build_route(mask)
    y = ffn_up(x, wg, wu, mask, G, route=route if T > 1 else None)
    ref = ffn_up_reference(x, wg, wu, mask, G)
    assert torch.all(y[~mask.repeat_interleave(G, 1)] == 0)
    if kind != "none":
        assert rel_err(y, ref) < tol(dtype)


# ---------------------------------------------------------------- gemm_k
@pytest.mark.parametrize("kind,dtype", kinds_by_dtype(MASK_KINDS))
@pytest.mark.parametrize("T", TOKENS)
def test_gemm_k(T, kind, dtype):
    gen = torch.Generator().manual_seed(3000 + T)
    G, ng, N = 16, 5, 37  # N ragged
    x, (w,) = _inputs(T, G * ng, N, dtype, gen)
    mask = make_mask(T, ng, kind, gen).to(DEVICE)
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_k(x, w, mask, G, out=out)
    ref = gemm_k_reference(x, w, mask, G)
    if kind == "none":
        assert torch.all(y == 0)
    else:
        assert rel_err(y, ref) < tol(dtype)
    if kind == "one_token":  # rows of tokens with no active group are exact zeros
        assert torch.all(y[torch.arange(T, device=DEVICE) != T // 2] == 0)


DECODE_KINDS = ["random", "all", "none", "one_group", "one_token"]


def make_decode_mask(T, ng, kind, gen):
    if kind == "one_group":  # a single used group (some tokens active in it)
        m = torch.zeros(T, ng, dtype=torch.bool)
        g = int(torch.randint(ng, (1,), generator=gen))
        m[:, g] = torch.rand(T, generator=gen) < 0.5
        m[T - 1, g] = True
        return m
    return make_mask(T, ng, kind, gen)


@pytest.mark.parametrize("kind,dtype", kinds_by_dtype(DECODE_KINDS, [torch.float16, torch.float32]))
@pytest.mark.parametrize("G,ng", [(16, 6), (32, 2), (64, 3), (256, 3), (384, 2)])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_gemm_k_decode_used_groups(T, G, ng, kind, dtype):
    # (256 and 384 wide groups at T=1 take the batch-1 GEMV kernel, the others the tl.dot loop)
    # Decode path: loops over the used groups only, split-K over the used steps (3 splits
    # under the interpreter when K > 64, some of them empty for a single used group). The
    # weight columns of unused groups and the X entries of inactive (token, group) pairs are
    # poisoned with NaN: the kernel must never read them into the result.
    gen = torch.Generator().manual_seed(4000 + 97 * T + G + ng)
    N = 37  # ragged
    x, (w,) = _inputs(T, G * ng, N, dtype, gen)
    mask = make_decode_mask(T, ng, kind, gen).to(DEVICE)
    ref = gemm_k_reference(x, w, mask, G)
    cols = mask.repeat_interleave(G, 1)
    xp = x.masked_fill(~cols, float("nan"))
    wp = w.masked_fill(~cols.any(0)[None, :], float("nan"))
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_k(xp, wp, mask, G, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any()
    idle = ~mask.any(1)  # tokens with no active group: exact zeros
    assert torch.all(y[idle] == 0)
    if kind == "none":
        assert torch.all(y == 0)
    else:
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 and INTERPRET else tol(dtype))


def test_gemm_k_decode_many_groups_shared_route():
    # 112 groups (the FFN down layout, narrow), one route reused by two calls
    gen = torch.Generator().manual_seed(8)
    T, G, ng, N = 2, 16, 112, 20
    x, (w,) = _inputs(T, G * ng, N, torch.float32, gen)
    mask = (torch.rand(T, ng, generator=gen) < 0.5).to(DEVICE)
    route = build_route(mask)
    ref = gemm_k_reference(x, w, mask, G)
    for _ in range(2):
        assert rel_err(gemm_k(x, w, mask, G, route=route), ref) < (1e-5 if INTERPRET else 5e-3)


def test_gemm_k_many_groups_unsorted():
    # more groups than the pattern sort handles: identity order, per-tile group lists
    gen = torch.Generator().manual_seed(7)
    T, G, ng, N = 40, 16, 70, 20
    x, (w,) = _inputs(T, G * ng, N, torch.float32, gen)
    mask = (torch.rand(T, ng, generator=gen) < 0.5).to(DEVICE)
    assert rel_err(gemm_k(x, w, mask, G), gemm_k_reference(x, w, mask, G)) < (1e-3 if INTERPRET else 5e-3)


@pytest.mark.parametrize("kind,dtype", kinds_by_dtype(["runs", "random", "all", "none", "one_token"],
                                                     [torch.float16, torch.float32], ("runs", "random", "none")))
@pytest.mark.parametrize("T,runs", [(17, 16), (40, 16), (70, 32), (24, 24), (33, 64)])
def test_gemm_k_row_runs(T, runs, kind, dtype):
    # row_runs (tile-coherent routing, batch-shared decode): rows in aligned runs of `runs` share
    # a mask, and a row tile loops over the groups its rows use, 70 groups (more than the
    # pattern sort takes, as FFN down). Exact for any mask, the promise only buys speed: "random"
    # breaks it. Inactive X entries and the weights of groups no row uses are NaN-poisoned.
    gen = torch.Generator().manual_seed(6000 + 7 * T + runs)
    G, ng, N = 16, 70, 37
    x, (w,) = _inputs(T, G * ng, N, dtype, gen)
    if kind == "runs":
        lead = torch.rand(-(-T // runs), ng, generator=gen) < 0.5
        mask = lead.repeat_interleave(runs, 0)[:T]
        mask[-1] = False  # a padding row inside the last run
    else:
        mask = make_mask(T, ng, kind, gen)
    mask = mask.to(DEVICE)
    ref = gemm_k_reference(x, w, mask, G)
    cols = mask.repeat_interleave(G, 1)
    xp = x.masked_fill(~cols, float("nan"))
    wp = w.masked_fill(~cols.any(0)[None, :], float("nan"))
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_k(xp, wp, mask, G, out=out, row_runs=runs)
    assert not torch.isnan(y).any()
    assert torch.all(y[~mask.any(1)] == 0)
    if kind != "none":
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 and INTERPRET else tol(dtype))


def test_shared_route_between_ops():
    gen = torch.Generator().manual_seed(11)
    T, G, ng, D = 33, 16, 4, 32
    x, (wg, wu) = _inputs(T, D, G * ng, torch.float32, gen, n_w=2)
    wd = (torch.randn(D, G * ng, generator=gen) / 8).to(DEVICE)
    mask = (torch.rand(T, ng, generator=gen) < 0.5).to(DEVICE)
    route = build_route(mask)
    h = ffn_up(x, wg, wu, mask, G, route=route)
    y = gemm_k(h, wd, mask, G, route=route)
    ref = gemm_k_reference(ffn_up_reference(x, wg, wu, mask, G), wd, mask, G)
    assert rel_err(y, ref) < (1e-3 if INTERPRET else 5e-3)  # CUDA fp32 dots use tf32


def test_empty_and_zero_k():
    x = torch.randn(0, 32, device=DEVICE)
    w = torch.randn(64, 32, device=DEVICE)
    assert gemm_mn(x, w, torch.zeros(0, 4, dtype=torch.bool, device=DEVICE), 16).shape == (0, 64)
    assert gemm_k(x, w, torch.zeros(0, 2, dtype=torch.bool, device=DEVICE), 16).shape == (0, 64)


# ---------------------------------------------------------------- errors
def test_errors():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(96, 64, device=DEVICE)
    ok = torch.ones(4, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm_mn(x, w, torch.ones(4, 4, dtype=torch.bool, device=DEVICE), 24)
    with pytest.raises(ValueError, match="does not divide"):
        gemm_mn(x, w, ok, 64)
    with pytest.raises(ValueError, match="dtype torch.bool"):
        gemm_mn(x, w, ok.int(), 32)
    with pytest.raises(ValueError, match="shape"):
        gemm_mn(x, w, torch.ones(4, 2, dtype=torch.bool, device=DEVICE), 32)
    with pytest.raises(ValueError, match="int"):
        gemm_mn(x, w, ok, 32.0)
    with pytest.raises(ValueError, match="unsupported dtype"):
        gemm_mn(x.double(), w.double(), ok, 32)
    with pytest.raises(ValueError):
        gemm_mn(x, w.half(), ok, 32)
    with pytest.raises(ValueError):
        ffn_up(x, w, w[:64], ok, 32)
    with pytest.raises(ValueError, match="route"):
        gemm_mn(torch.randn(20, 64, device=DEVICE), w,
                torch.ones(20, 3, dtype=torch.bool, device=DEVICE), 32,
                route=build_route(torch.ones(19, 3, dtype=torch.bool, device=DEVICE)))
    wk = torch.randn(10, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm_k(x, wk, torch.ones(4, 8, dtype=torch.bool, device=DEVICE), 8)
    with pytest.raises(ValueError, match="does not divide"):
        gemm_k(x, wk, torch.ones(4, 1, dtype=torch.bool, device=DEVICE), 48)
    with pytest.raises(ValueError, match="shape"):
        gemm_k(x, wk, torch.ones(3, 2, dtype=torch.bool, device=DEVICE), 32)
    with pytest.raises(ValueError):
        RouteIndex(torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("T", [1, 5])
def test_decode_split_k(T):
    # decode GEMVs split the reduction (fp32 partials + ordered reduce) once K is large
    gen = torch.Generator().manual_seed(50 + T)
    x, (w,) = _inputs(T, 560, 64, torch.float32, gen)
    mask = (torch.rand(T, 2, generator=gen) < 0.5).to(DEVICE)
    mask[0, 0] = True
    assert rel_err(gemm_mn(x, w, mask, 32), gemm_mn_reference(x, w, mask, 32)) < 5e-3
    xk, (wk,) = _inputs(T, 576, 24, torch.float32, gen)
    mk = (torch.rand(T, 36, generator=gen) < 0.5).to(DEVICE)
    mk[0, 0] = True
    assert rel_err(gemm_k(xk, wk, mk, 16), gemm_k_reference(xk, wk, mk, 16)) < 5e-3
    # The last split program of each tile reduces and re-arms its ticket: a second call (as
    # in a CUDA-graph replay) gives the same bits, and the tickets are back at zero.
    y1 = gemm_mn(x, w, mask, 32)
    k1 = gemm_k(xk, wk, mk, 16)
    assert torch.equal(gemm_mn(x, w, mask, 32), y1) and torch.equal(gemm_k(xk, wk, mk, 16), k1)
    assert int(split_tickets(x.device, 1).abs().sum()) == 0



def _router_partials(ng, R, nchunk, gen, offset=0.0):
    f = dict(dtype=torch.float32, device=DEVICE)
    return RouterPartials(torch.randn(nchunk, R, generator=gen).to(**f),
                          torch.randn(R, generator=gen).to(**f),
                          torch.randn(2 * ng, R, generator=gen).to(**f),
                          torch.randn(2 * ng, generator=gen).to(**f),
                          torch.tensor(offset, **f))


def _router_margin(rp):
    h = rp.partials.sum(0) + rp.down_bias
    logits = rp.up_weight @ h + rp.up_bias
    return logits[0::2] - logits[1::2] + rp.offset


@pytest.mark.parametrize("op", ["q", "qkv", "ffn_up"])
@pytest.mark.parametrize("offset", [0.0, 1e3, -1e3])
def test_batch1_gemv_finishes_the_router(op, offset):
    # Batch-1 decode: the norm kernel leaves the router at its per-chunk partial sums and the
    # GEMV derives each group's decision, computes only the active groups and writes the mask
    # (every group, whichever program owns it) for the ops after it. offset +-1e3: all / none.
    # 128-wide groups: two 64-row programs per group under the interpreter (and more on a GPU),
    # so only the group's first program may store its decision
    gen = torch.Generator().manual_seed(11 + len(op))
    G, ng, tail_groups, K = 128, 4, (1 if op == "qkv" else 0), 96
    x, ws = _inputs(1, K, G * (ng + tail_groups), torch.float32, gen, n_w=2)
    rp = _router_partials(ng, 16, 3, gen, offset)
    margin = _router_margin(rp)
    want = (margin >= 0)[None]
    mask = torch.full((1, ng), offset < 0, dtype=torch.bool, device=DEVICE)  # stale values
    if op == "ffn_up":
        y = ffn_up(x, ws[0], ws[1], mask, G, router=rp)
    else:
        y = gemm_mn(x, ws[0], mask, G, dense_tail=G * tail_groups, router=rp)
    near = (margin.abs() < 1e-5)[None]  # fp32 summation order may differ at exactly ~0
    assert torch.equal(mask | near, want | near)
    if offset > 0:
        assert bool(mask.all())
    if offset < 0:
        assert not bool(mask.any())
    if op == "ffn_up":
        ref = ffn_up_reference(x, ws[0], ws[1], mask, G)
    else:
        ref = gemm_mn_reference(x, ws[0], mask, G, dense_tail=G * tail_groups)
    assert rel_err(y, ref) < 1e-5 or (float(ref.norm()) == 0 and bool((y == 0).all()))


def test_router_partials_errors():
    gen = torch.Generator().manual_seed(2)
    x, (w,) = _inputs(2, 64, 64, torch.float32, gen)
    rp = _router_partials(2, 16, 2, gen)
    with pytest.raises(ValueError, match="one token"):
        gemm_mn(x, w, torch.zeros(2, 2, dtype=torch.bool, device=DEVICE), 32, router=rp)
    with pytest.raises(ValueError, match="up_weight"):
        gemm_mn(x[:1], w, torch.zeros(1, 2, dtype=torch.bool, device=DEVICE), 32,
                router=_router_partials(3, 16, 2, gen))
    bad = RouterPartials(rp.partials.double(), rp.down_bias, rp.up_weight, rp.up_bias, rp.offset)
    with pytest.raises(ValueError, match="partials"):
        gemm_mn(x[:1], w, torch.zeros(1, 2, dtype=torch.bool, device=DEVICE), 32, router=bad)
    with pytest.raises(ValueError, match="routed groups"):  # only a dense tail: nothing to route
        gemm_mn(x[:1], w, torch.zeros(1, 0, dtype=torch.bool, device=DEVICE), 32, dense_tail=64,
                router=_router_partials(0, 16, 2, gen))


@pytest.mark.parametrize("op", ["gemm_mn", "ffn_up"])
def test_batch1_gemv_reads_a_strided_mask(op):
    # a column of a wider bool tensor: non-contiguous, the GEMV must not read it as contiguous
    gen = torch.Generator().manual_seed(21)
    G, ng, K = 16, 4, 64
    x, ws = _inputs(1, K, G * ng, torch.float32, gen, n_w=2)
    mask = (torch.rand(ng, 3, generator=gen) < 0.5).to(DEVICE).t()[:1]
    mask[0, 0], mask[0, 1] = True, False
    assert not mask.is_contiguous()
    if op == "ffn_up":
        y, ref = ffn_up(x, ws[0], ws[1], mask, G), ffn_up_reference(x, ws[0], ws[1], mask, G)
    else:
        y, ref = gemm_mn(x, ws[0], mask, G), gemm_mn_reference(x, ws[0], mask, G)
    assert rel_err(y, ref) < 1e-5


def _kernel_modules():
    # by import_module: the package's gemm_mn / gemm_k attributes are the functions
    import importlib
    return (importlib.import_module("wide.kernels.gemm_mn"),
            importlib.import_module("wide.kernels.gemm_k"))


def _gemv_tiles():
    gm, gk = _kernel_modules()
    return ([("gemm_mn", c) for c in gm._GEMV_CFGS] + [("ffn_up", c) for c in gm._GEMV_FUSED_CFGS]
            + [("gemm_k", c) for c in gk._GEMV_CFGS])


def _mma_tiles():
    gm, gk = _kernel_modules()
    return ([("gemm_mn", c) for c in gm._DECODE_CFGS + gm._PREFILL_CFGS]
            + [("ffn_up", c) for c in gm._DECODE_CFGS + gm._FUSED_PREFILL_CFGS]
            + [("gemm_k", c) for c in gk._DECODE_CFGS + gk._PREFILL_CFGS])


def _pin(monkeypatch, module, name, value):
    """Make ``module.name`` (an untuned launch's tile heuristic) return ``value``; the list
    returned records each launch that used it."""
    used = []

    def pick(*_):
        used.append(value)
        return value

    monkeypatch.setattr(module, name, pick)
    return used


@pytest.mark.parametrize("op,cfg", _gemv_tiles(), ids=tile_id)
def test_every_batch1_gemv_tile_matches_reference(op, cfg, monkeypatch):
    # On a GPU the autotuner may pick any tile of these lists and no test would see the others:
    # run each one here (ragged K and N against the tile, a dense tail, both kinds of group).
    gm, gk = _kernel_modules()
    meta = dict(cfg.kwargs, num_warps=cfg.num_warps)
    gen = torch.Generator().manual_seed(5)
    if op == "gemm_k":
        G, ng, N = 512, 3, 33
        if G % meta["BK"]:
            pytest.skip("pruned for this group size (gemm_k._gemv_prune)")
        used = _pin(monkeypatch, gk, "_gemv_heuristic", meta)
        x, (w,) = _inputs(1, G * ng, N, torch.float32, gen)
        mask = torch.tensor([[True, False, True]], device=DEVICE)
        y, ref = gemm_k(x, w, mask, G), gemm_k_reference(x, w, mask, G)
    else:
        used = _pin(monkeypatch, gm, "_gemv_heuristic", meta)
        G, ng, tail, K = 16, 4, 16, 2048 + 96
        mask = torch.tensor([[True, False, False, True]], device=DEVICE)
        if op == "ffn_up":
            x, ws = _inputs(1, K, G * ng, torch.float32, gen, n_w=2)
            y, ref = ffn_up(x, ws[0], ws[1], mask, G), ffn_up_reference(x, ws[0], ws[1], mask, G)
        else:
            x, (w,) = _inputs(1, K, G * ng + tail, torch.float32, gen)
            y = gemm_mn(x, w, mask, G, dense_tail=tail)
            ref = gemm_mn_reference(x, w, mask, G, dense_tail=tail)
    assert used, "the tile was not launched"
    assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("op,cfg", _mma_tiles(), ids=tile_id)
def test_every_tl_dot_tile_matches_reference(op, cfg, monkeypatch):
    # The tl.dot paths' autotune lists (decode tiles for T <= 16, prefill tiles above), each
    # tile run here as the GPU autotuner could pick it: K and N ragged against the tile, T
    # not a multiple of BM, random masks with empty and full groups.
    gm, gk = _kernel_modules()
    gen = torch.Generator().manual_seed(9)
    if op == "gemm_k":
        decode = any(cfg is c for c in gk._DECODE_CFGS)
        T, G, ng, other = (5 if decode else 45), 128, 3, 200  # other: N
        used = _pin(monkeypatch, gk, "_heuristic", cfg)
    else:
        decode = cfg.kwargs["BM"] == 16
        T, G, ng, other = (5 if decode else 70), 256, 2, 300  # other: K
        used = _pin(monkeypatch, gm, "_heuristic", cfg)
    mask = make_mask(T, ng, "random", gen)
    mask[0], mask[-1] = True, False
    mask = mask.to(DEVICE)
    if op == "gemm_k":
        x, (w,) = _inputs(T, G * ng, other, torch.float32, gen)
        y, ref = gemm_k(x, w, mask, G), gemm_k_reference(x, w, mask, G)
    elif op == "ffn_up":
        x, ws = _inputs(T, other, G * ng, torch.float32, gen, n_w=2)
        y, ref = ffn_up(x, ws[0], ws[1], mask, G), ffn_up_reference(x, ws[0], ws[1], mask, G)
    else:
        x, (w,) = _inputs(T, other, G * ng, torch.float32, gen)
        y, ref = gemm_mn(x, w, mask, G), gemm_mn_reference(x, w, mask, G)
    assert used, "the tile was not launched"
    assert rel_err(y, ref) < 1e-5



def test_autotune_configs_fit_shared_memory_in_fp32():
    # fp32 on an H200 raised OutOfResources (288 KB asked of 227 KB) from bf16-sized tiles:
    # the prune keeps only configs whose pipelined tiles fit, and still keeps some.
    import importlib

    # (the package exports functions of the same names as these modules)
    gk = importlib.import_module("wide.kernels.gemm_k")
    gm = importlib.import_module("wide.kernels.gemm_mn")

    x32 = torch.zeros(1, dtype=torch.float32)
    for bm in (16, 64, 128):
        keep = gk._prune(gk._DECODE_CFGS + gk._PREFILL_CFGS, {"GS": 512, "T": 4096, "x_ptr": x32}, BM=bm)
        assert keep and all(c.num_stages * c.kwargs["BK"] * (bm + c.kwargs["BN"]) * 4 <= gk._SMEM_BYTES
                            for c in keep)
    cfgs = gm._DECODE_CFGS + gm._FUSED_PREFILL_CFGS
    keep = gm._prune(cfgs, {"T_BUCKET": 4096, "GS": 512, "x_ptr": x32})
    assert keep and all(c.num_stages * c.kwargs["BK"] * (c.kwargs["BM"] + 2 * c.kwargs["BN"]) * 4 <= 220 * 1024
                        for c in keep)
    # bf16 keeps what it kept before
    x16 = torch.zeros(1, dtype=torch.bfloat16)
    assert gm._prune(cfgs, {"T_BUCKET": 4096, "GS": 512, "x_ptr": x16}) == gm._prune(cfgs, {"T_BUCKET": 4096, "GS": 512})
