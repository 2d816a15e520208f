"""RoPE + cache-write kernels (prefill and decode) against the fp32 reference, with and without
Qwen2's q/k/v bias and Qwen3's per-head q/k RMSNorm (CPU: Triton interpreter)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from wide.kernels import rope_decode, rope_prefill, rope_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _tol(dtype):
    return 1e-6 if dtype == torch.float32 else 1e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _cos_sin(n, D, gen):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(n).float()[:, None] * inv[None, :] + torch.rand(1, generator=gen)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()


def _extras(kind, Hq, Hkv, D, gen, dtype):
    bias = qk = None
    if kind in ("bias", "both"):
        bias = torch.randn((Hq + 2 * Hkv) * D, generator=gen).to(dtype).to(DEV)
    if kind in ("norm", "both"):
        qk = (1 + 0.3 * torch.randn(2 * D, generator=gen)).to(dtype).to(DEV)
    return bias, qk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", ["none", "bias", "norm", "both"])
@pytest.mark.parametrize("B,T,Hq,Hkv", [(2, 37, 7, 1), (1, 5, 4, 2)])
def test_rope_prefill_matches_reference(dtype, extra, B, T, Hq, Hkv):
    # T = 37: one full 32-token block and a ragged one; 7 query heads over one KV head.
    D = 64
    gen = torch.Generator().manual_seed(T + Hq)
    qkv = torch.randn(B * T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype).to(DEV)
    q, kv = qkv[:, :Hq * D].clone(), qkv[:, Hq * D:]  # k/v: row views with a wide stride
    k, v = kv[:, :Hkv * D], kv[:, Hkv * D:]
    cos, sin = (t.to(dtype).to(DEV) for t in _cos_sin(T + 3, D, gen))
    kc = torch.full((B, T + 3, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    bias, qk = _extras(extra, Hq, Hkv, D, gen, dtype)
    q_in = q.clone()
    rope_prefill(q, k, v, cos, sin, kc, vc, B, bias=bias, qk_norm=qk, eps=1e-6)
    c, s = cos[:T][None, :, None, :], sin[:T][None, :, None, :]
    rq, rk, rv = rope_reference(q_in.view(B, T, Hq, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D),
                                c, s, bias=bias, qk_norm=qk, eps=1e-6)
    assert _rel(q.view(B, T, Hq, D), rq) < _tol(dtype)
    assert _rel(kc[:, :T], rk) < _tol(dtype)
    assert _rel(vc[:, :T], rv) < _tol(dtype)
    assert torch.isnan(kc[:, T:]).all() and torch.isnan(vc[:, T:]).all()  # nothing past T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", ["none", "bias", "norm", "both"])
@pytest.mark.parametrize("B", [1, 3])
def test_rope_decode_matches_reference(dtype, extra, B):
    D, Hq, Hkv, L = 128, 6, 2, 20
    gen = torch.Generator().manual_seed(B)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen).to(dtype).to(DEV)
    q, kv = qkv[:, :Hq * D], qkv[:, Hq * D:]  # q in place inside the fused projection output
    k, v = kv[:, :Hkv * D], kv[:, Hkv * D:]
    pos = torch.tensor([19, 0, 7][:B], device=DEV)
    cos, sin = (t.to(dtype).to(DEV) for t in _cos_sin(L, D, gen))
    kc = torch.zeros(B, L, Hkv, D, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    bias, qk = _extras(extra, Hq, Hkv, D, gen, dtype)
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    rope_decode(q, k, v, cos, sin, pos, kc, vc, bias=bias, qk_norm=qk, eps=1e-6)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    rq, rk, rv = rope_reference(q_in.view(B, Hq, D), k_in.view(B, Hkv, D), v_in.view(B, Hkv, D), c, s,
                                bias=bias, qk_norm=qk, eps=1e-6)
    bi = torch.arange(B, device=DEV)
    assert _rel(q.view(B, Hq, D), rq) < _tol(dtype)
    assert _rel(kc[bi, pos], rk) < _tol(dtype)
    assert _rel(vc[bi, pos], rv) < _tol(dtype)
    written = torch.zeros(B, L, dtype=torch.bool, device=DEV)
    written[bi, pos] = True
    assert (kc[~written] == 0).all() and (vc[~written] == 0).all()  # only each sequence's position


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", ["none", "bias", "norm"])
@pytest.mark.parametrize("B", [1, 3])
def test_rope_decode_reads_fp32_sums_and_clears_them(dtype, extra, B):
    # q|k|v as a GEMV's fp32 sums: rounded to the cache's dtype first (the same results as the
    # rounded projection), q rotated into q_out, and the sums zeroed once read. The sums carry
    # bits below the model dtype's precision, so a kernel that did not round them first differs.
    D, Hq, Hkv, L = 64, 4, 2, 12
    gen = torch.Generator().manual_seed(10 + B)
    sums = (torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen) + 1e-3 * torch.rand(B, (Hq + 2 * Hkv) * D, generator=gen))
    sums = sums.to(DEV)
    big = torch.full((B + 1, sums.shape[1]), 7.0, device=DEV)  # rows [:B] of a larger buffer
    big[:B] = sums
    pos = torch.tensor([5, 0, 11][:B], device=DEV)
    cos, sin = (t.to(dtype).to(DEV) for t in _cos_sin(L, D, gen))
    bias, qk = _extras(extra, Hq, Hkv, D, gen, dtype)

    def run(qkv, q_out=None, clear=False):
        kc = torch.zeros(B, L, Hkv, D, dtype=dtype, device=DEV)
        vc = torch.zeros_like(kc)
        q, kv = qkv[:, :Hq * D], qkv[:, Hq * D:]
        rope_decode(q, kv, kv[:, Hkv * D:], cos, sin, pos, kc, vc, bias=bias, qk_norm=qk, eps=1e-6,
                    q_out=q_out, clear=clear)
        return (q if q_out is None else q_out), kc, vc

    want = run(sums.to(dtype).clone())
    q_out = torch.empty(B, Hq * D, dtype=dtype, device=DEV)
    got = run(big[:B], q_out=q_out, clear=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.all(big[:B] == 0) and torch.all(big[B:] == 7.0)
    kept = big[:B].clone().copy_(sums)  # without clear the sums stay
    run(kept, q_out=torch.empty_like(q_out))
    assert torch.equal(kept, sums)
    if dtype != torch.float32:
        with pytest.raises(ValueError, match="need q_out"):
            run(sums.clone())
    with pytest.raises(ValueError, match="give q_out"):
        run(sums.to(dtype), clear=True)
    with pytest.raises(ValueError, match="q_out must be"):
        run(sums.clone(), q_out=torch.empty(B, Hq * D, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="float32 sums"):
        run(sums.double(), q_out=q_out)
