"""Routed attention kernels vs the fp32 references (CPU: Triton interpreter)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from conftest import tile_id  # noqa: E402
from wide.kernels import attention  # noqa: E402  (the module, for its tile lists)
from wide.kernels.attention import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
    prefill_attention,
    prefill_attention_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
D = 64


def _rel(out, ref):
    assert not torch.isnan(out).any(), "NaN in output"
    den = ref.norm().item()
    num = (out.float() - ref).norm().item()
    return num / den if den > 0 else num


def _tol(dtype):
    return 2e-3 if dtype == torch.float32 and DEV == "cpu" else 1e-2


def _mask(kind, shape, gen):
    if kind == "all":
        return torch.ones(shape, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(shape, dtype=torch.bool)
    return torch.rand(shape, generator=gen) < 0.5


def _check_prefill(q, k, v, mask, **kw):
    out = prefill_attention(q, k, v, mask, **kw)
    kw.pop("block_m", None)
    kw.pop("block_n", None)
    ref = prefill_attention_reference(q, k, v, mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    Hq, G = q.shape[2], mask.shape[2]
    head_on = mask.repeat_interleave(Hq // G, dim=2)
    # Inactive pairs must be exact zeros, not merely small.
    assert (out[~head_on] == 0).all()
    if ref.abs().sum() == 0:
        assert (out == 0).all()
    else:
        assert _rel(out, ref) < _tol(q.dtype)
    return out, ref


def _qkv(B, T, Tk, Hq, Hkv, dtype, gen, d=D):
    q = torch.randn(B, T, Hq, d, generator=gen).to(dtype).to(DEV)
    k = torch.randn(B, Tk, Hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(B, Tk, Hkv, d, generator=gen).to(dtype).to(DEV)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("T,Tk", [(37, 37), (21, 40)])
def test_prefill_random_mask(dtype, hq, hkv, T, Tk):
    gen = torch.Generator().manual_seed(hq * 100 + T)
    q, k, v = _qkv(2, T, Tk, hq, hkv, dtype, gen)
    mask = _mask("random", (2, T, hkv), gen).to(DEV)
    _check_prefill(q, k, v, mask)


@pytest.mark.parametrize("kind", ["all", "none"])
def test_prefill_all_or_none(kind):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(1, 33, 33, 4, 1, torch.float16, gen)
    mask = _mask(kind, (1, 33, 1), gen).to(DEV)
    out, _ = _check_prefill(q, k, v, mask)
    if kind == "none":
        assert (out == 0).all()


def test_prefill_non_causal_and_finer_groups():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(2, 19, 27, 8, 2, torch.float16, gen)
    mask = _mask("random", (2, 19, 4), gen).to(DEV)  # G=4 groups of 2 heads within GQA packs of 4
    _check_prefill(q, k, v, mask, causal=False)
    _check_prefill(q, k, v, mask, causal=True, sm_scale=0.3)


def test_prefill_head_dim_128_block_shapes():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(1, 40, 40, 4, 2, torch.float16, gen, d=128)
    mask = _mask("random", (1, 40, 2), gen).to(DEV)
    _check_prefill(q, k, v, mask, block_m=32, block_n=16)


@pytest.mark.parametrize("side", ["right", "left"])
def test_prefill_variable_length(side):
    gen = torch.Generator().manual_seed(4)
    B, T, Tk = 3, 24, 36
    q, k, v = _qkv(B, T, Tk, 6, 2, torch.float16, gen)
    q_lens = torch.tensor([24, 9, 17], dtype=torch.int32, device=DEV)
    k_lens = torch.tensor([36, 9, 30], dtype=torch.int32, device=DEV)
    mask = _mask("random", (B, T, 2), gen).to(DEV)
    mask[:, :, 0] = True
    # Poison the padding: a kernel that reads padded rows or keys would turn NaN.
    for b in range(B):
        ql, kl = int(q_lens[b]), int(k_lens[b])
        if side == "right":
            q[b, ql:] = float("nan")
            k[b, kl:] = float("nan")
            v[b, kl:] = float("nan")
        else:
            q[b, : T - ql] = float("nan")
            k[b, : Tk - kl] = float("nan")
            v[b, : Tk - kl] = float("nan")
    out = prefill_attention(q, k, v, mask, q_lens=q_lens, k_lens=k_lens, padding_side=side)
    qc, kc, vc = (x.nan_to_num(0.0) for x in (q, k, v))
    ref = prefill_attention_reference(qc, kc, vc, mask, q_lens=q_lens, k_lens=k_lens, padding_side=side)
    assert _rel(out, ref) < 1e-2
    for b in range(B):
        ql = int(q_lens[b])
        pad = out[b, ql:] if side == "right" else out[b, : T - ql]
        assert (pad == 0).all()


def test_prefill_never_reads_inactive_queries():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(1, 30, 30, 4, 2, torch.float16, gen)
    mask = _mask("random", (1, 30, 2), gen).to(DEV)
    head_on = mask.repeat_interleave(2, dim=2)
    q_poison = q.clone()
    q_poison[~head_on] = float("nan")
    out = prefill_attention(q_poison, k, v, mask)
    ref = prefill_attention_reference(q, k, v, mask)
    assert _rel(out, ref) < 1e-2


def _paged(k, v, lens, block_size, gen):
    """Scatter contiguous caches into shuffled pages; returns (k_pages, v_pages, table)."""
    B, Tk, Hkv, d = k.shape
    nblk = -(-Tk // block_size)
    total = B * nblk + 3
    perm = torch.randperm(total, generator=gen)[: B * nblk].view(B, nblk)
    kp = torch.randn(total, block_size, Hkv, d, generator=gen).to(k.dtype).to(DEV)
    vp = torch.randn(total, block_size, Hkv, d, generator=gen).to(k.dtype).to(DEV)
    for b in range(B):
        for i in range(nblk):
            s, e = i * block_size, min(Tk, (i + 1) * block_size)
            kp[perm[b, i], : e - s] = k[b, s:e]
            vp[perm[b, i], : e - s] = v[b, s:e]
    return kp, vp, perm.to(torch.int32).to(DEV)


def _check_decode(q, kc, vc, mask, lens, **kw):
    out = decode_attention(q, kc, vc, mask, lens, **kw)
    for launch_only in ("num_splits", "block_n", "combine_block", "num_warps", "num_stages"):
        kw.pop(launch_only, None)
    ref = decode_attention_reference(q, kc, vc, mask, lens, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    head_on = mask.repeat_interleave(q.shape[1] // mask.shape[1], dim=1)
    assert (out[~head_on] == 0).all()
    if ref.abs().sum() == 0:
        assert (out == 0).all()
    else:
        assert _rel(out, ref) < _tol(q.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_random(dtype, hq, hkv, paged):
    gen = torch.Generator().manual_seed(hq * 10 + int(paged))
    B, Tk = 3, 40
    q = torch.randn(B, hq, D, generator=gen).to(dtype).to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype).to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype).to(DEV)
    lens = torch.tensor([40, 7, 23], dtype=torch.int32, device=DEV)
    mask = _mask("random", (B, hkv), gen).to(DEV)
    mask[0, 0] = True
    if paged:
        kp, vp, table = _paged(k, v, lens, 8, gen)
        _check_decode(q, kp, vp, mask, lens, block_table=table, num_splits=3)
    else:
        _check_decode(q, k, v, mask, lens, num_splits=3)
        _check_decode(q, k, v, mask, lens, num_splits=1)


@pytest.mark.parametrize("kind", ["all", "none"])
def test_decode_all_or_none(kind):
    gen = torch.Generator().manual_seed(7)
    B, Tk, hq, hkv = 2, 33, 8, 2
    q = torch.randn(B, hq, D, generator=gen).half().to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    lens = torch.tensor([33, 12], dtype=torch.int32, device=DEV)
    mask = _mask(kind, (B, hkv), gen).to(DEV)
    out = _check_decode(q, k, v, mask, lens)
    if kind == "none":
        assert (out == 0).all()


def test_decode_never_reads_inactive_kv_heads():
    gen = torch.Generator().manual_seed(8)
    B, Tk, hq, hkv = 2, 30, 8, 4
    q = torch.randn(B, hq, D, generator=gen).half().to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    lens = torch.tensor([30, 19], dtype=torch.int32, device=DEV)
    mask = torch.tensor([[True, False, True, False], [False, False, True, True]], device=DEV)
    kp, vp = k.clone(), v.clone()
    for b in range(B):
        for h in range(hkv):
            if not mask[b, h]:
                kp[b, :, h] = float("nan")
                vp[b, :, h] = float("nan")
    out = decode_attention(q, kp, vp, mask, lens, num_splits=2)
    ref = decode_attention_reference(q, k, v, mask, lens)
    assert _rel(out, ref) < 1e-2


def test_decode_finer_groups_and_block_sizes():
    gen = torch.Generator().manual_seed(9)
    B, Tk, hq, hkv = 2, 37, 8, 2
    q = torch.randn(B, hq, D, generator=gen).half().to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    lens = torch.tensor([37, 5], dtype=torch.int32, device=DEV)
    mask = _mask("random", (B, 4), gen).to(DEV)  # 4 groups of 2 heads: half a KV pack each
    mask[0] = torch.tensor([True, False, False, True])
    _check_decode(q, k, v, mask, lens)
    kp, vp, table = _paged(k, v, lens, 16, gen)
    _check_decode(q, kp, vp, mask, lens, block_table=table, block_n=32)


def test_value_errors():
    gen = torch.Generator().manual_seed(10)
    q, k, v = _qkv(1, 8, 8, 4, 2, torch.float16, gen)
    m = torch.ones(1, 8, 2, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="head dim"):
        q2, k2, v2 = _qkv(1, 8, 8, 4, 2, torch.float16, gen, d=96)
        prefill_attention(q2, k2, v2, m)
    with pytest.raises(ValueError, match="groups"):
        prefill_attention(q, k, v, torch.ones(1, 8, 3, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        q3, k3, v3 = _qkv(1, 8, 8, 4, 3, torch.float16, gen)
        prefill_attention(q3, k3, v3, torch.ones(1, 8, 4, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(q, k.float(), v, m)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        prefill_attention(q.to(torch.float64), k, v, m)
    with pytest.raises(ValueError, match="bool"):
        prefill_attention(q, k, v, m.int())
    with pytest.raises(ValueError, match="mask shape"):
        prefill_attention(q, k, v, m[:, :4])
    with pytest.raises(ValueError, match="at least the queries"):
        prefill_attention(q, k[:, :4], v[:, :4], m)
    with pytest.raises(ValueError, match="4-D"):
        prefill_attention(q[0], k, v, m)
    with pytest.raises(ValueError, match="padding_side"):
        prefill_attention(q, k, v, m, padding_side="middle")
    with pytest.raises(ValueError, match="q_lens"):
        prefill_attention(q, k, v, m, q_lens=torch.ones(2, dtype=torch.int32, device=DEV))
    qd = torch.randn(1, 4, D).half().to(DEV)
    md = torch.ones(1, 2, dtype=torch.bool, device=DEV)
    lens = torch.tensor([8], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="3-D"):
        decode_attention(q, k, v, md, lens)
    with pytest.raises(ValueError, match="mask shape"):
        decode_attention(qd, k, v, md[0], lens)
    with pytest.raises(ValueError, match="groups"):
        decode_attention(qd, k, v, torch.ones(1, 3, dtype=torch.bool, device=DEV), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(qd, k, v, md, lens.float())
    with pytest.raises(ValueError, match="block_table"):
        decode_attention(qd, k, v, md, lens, block_table=torch.zeros(1, 2, device=DEV))
    with pytest.raises(ValueError, match="head dim"):
        decode_attention(torch.randn(1, 4, 32).half().to(DEV), k[..., :32], v[..., :32], md, lens)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_graph_capture():
    gen = torch.Generator().manual_seed(11)
    q, k, v = _qkv(1, 256, 256, 8, 2, torch.bfloat16, gen, d=128)
    mask = (torch.rand(1, 256, 2, generator=gen) < 0.5).to(DEV)
    qd = torch.randn(4, 8, 128, generator=gen).bfloat16().to(DEV)
    kd = torch.randn(4, 512, 2, 128, generator=gen).bfloat16().to(DEV)
    vd = torch.randn(4, 512, 2, 128, generator=gen).bfloat16().to(DEV)
    lens = torch.tensor([512, 100, 3, 300], dtype=torch.int32, device=DEV)
    md = (torch.rand(4, 2, generator=gen) < 0.5).to(DEV)
    prefill_attention(q, k, v, mask)
    decode_attention(qd, kd, vd, md, lens)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        po = prefill_attention(q, k, v, mask)
        do = decode_attention(qd, kd, vd, md, lens)
    mask.copy_((torch.rand(1, 256, 2, generator=gen) < 0.5).to(DEV))
    md.copy_((torch.rand(4, 2, generator=gen) < 0.5).to(DEV))
    g.replay()
    torch.cuda.synchronize()
    assert _rel(po, prefill_attention_reference(q, k, v, mask)) < 1e-2
    assert _rel(do, decode_attention_reference(qd, kd, vd, md, lens)) < 1e-2


@pytest.mark.parametrize("kind", ["all", "none", "random"])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_combine_many_splits(kind, hq, hkv, paged):
    """24 splits merged 4 (or 16) at a time: several online-rescaling iterations, a partial
    last block, and sequences that end after 24, 6 and 0 splits."""
    gen = torch.Generator().manual_seed(hq * 7 + int(paged) + len(kind))
    B, Tk = 3, 3000  # 24 splits of 128 keys (chunks are multiples of 128)
    dtype = torch.float16 if hq != 6 else torch.float32
    q = torch.randn(B, hq, D, generator=gen).to(dtype).to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype).to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).to(dtype).to(DEV)
    lens = torch.tensor([3000, 700, 0], dtype=torch.int32, device=DEV)
    mask = _mask(kind, (B, hkv), gen).to(DEV)
    if kind == "random":
        mask[0, 0] = True
        mask[1, 1] = True
    kw = {}
    if paged:
        k, v, table = _paged(k, v, lens, 64, gen)
        kw["block_table"] = table
    # block_n=128: one key block per split, to keep the interpreter quick.
    out = _check_decode(q, k, v, mask, lens, num_splits=24, block_n=128,
                        combine_block=16 if kind == "random" else 4, **kw)
    assert (out[2] == 0).all()  # an empty sequence gives zeros, active or not
    if kind == "none":
        assert (out == 0).all()


def test_decode_split_candidates():
    from wide.kernels import attention as A

    cpu = torch.device("cpu")  # 8 "SMs" off CUDA: the heuristic targets 12 * 8 programs
    for B, Hkv, Tk in [(1, 8, 32768), (1, 8, 4096), (8, 8, 32768), (32, 8, 4096), (2, 2, 5000),
                       (1, 1, 1), (3, 4, 129), (1, 8, 100)]:
        cands = A.decode_split_candidates(B, Hkv, Tk, cpu)
        assert cands[0] == A.decode_splits(B, Hkv, Tk, cpu)  # the heuristic comes first
        assert len(cands) == len(set(cands)) and 1 <= len(cands) <= 4
        for splits, chunk in cands:
            assert splits >= 1 and chunk % 128 == 0
            assert (splits - 1) * chunk < max(Tk, 1) <= splits * chunk  # no empty split
    base = A.decode_splits(1, 8, 32768, cpu)[0]
    assert base == 12
    assert [s for s, _ in A.decode_split_candidates(1, 8, 32768, cpu)] == [12, 3, 6, 24]
    assert A.decode_split_candidates(1, 8, 100, cpu) == [(1, 128)]
    assert A.decode_split_candidates(32, 8, 4096, cpu) == [(1, 4096), (2, 2048)]
    # 2 * base splits would cut chunks below 128 keys: clipped to the 128-key plan.
    assert max(s for s, _ in A.decode_split_candidates(1, 1, 1024, cpu)) == 8
    assert A._split_plan(5000, 40) == (40, 128)
    assert A._split_plan(4096, 64) == (32, 128)

    # The plan: pinned count, else the cached (tuned) count for the shape key, else the heuristic.
    q = torch.zeros(1, 32, 128, dtype=torch.float16)
    kc = torch.zeros(1, 3000, 8, 128, dtype=torch.float16)
    key = A._decode_key(q, kc, None, 3000)
    assert key == (1, 4096, 32, 8, 128, False, torch.float16)
    assert A.decode_split_plan(q, kc) == A.decode_splits(1, 8, 3000, cpu)
    assert A.decode_split_plan(q, kc, num_splits=5) == A._split_plan(3000, 5)
    A._DECODE_SPLITS_TUNED[key] = 3
    try:
        assert A.decode_split_plan(q, kc) == (3, 1024)
        kp = torch.zeros(400, 16, 8, 128, dtype=torch.float16)
        table = torch.zeros(1, 200, dtype=torch.int32)  # paged: another key
        assert A.decode_split_plan(q, kp, table) == A.decode_splits(1, 8, 3200, cpu)
    finally:
        del A._DECODE_SPLITS_TUNED[key]
    # Off CUDA (and under the interpreter) nothing is tuned.
    assert A.autotune_enabled() is (os.environ.get("TRITON_INTERPRET") != "1"
                                      and os.environ.get("WIDE_AUTOTUNE", "1") != "0")


def test_decode_split_autotune_flow(monkeypatch):
    """Tune once per shape key (outside capture), then reuse; never tune while capturing."""
    from wide.kernels import attention as A

    calls = []

    def fake_tune(launch, cands):
        calls.append(cands)
        for splits, chunk in cands:  # every candidate must run and be correct
            launch(splits, chunk)
        return cands[-1][0]

    monkeypatch.setattr(A, "_should_tune", lambda q: True)
    monkeypatch.setattr(A, "_tune_decode_splits", fake_tune)
    monkeypatch.setattr(A, "_DECODE_SPLITS_TUNED", {})
    capturing = [False]
    monkeypatch.setattr(A, "_is_capturing", lambda: capturing[0])
    gen = torch.Generator().manual_seed(12)
    B, Tk, hq, hkv = 1, 1000, 4, 1  # heuristic: 8 splits of 128 keys; candidates 8, 2, 4
    q = torch.randn(B, hq, D, generator=gen).half().to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).half().to(DEV)
    lens = torch.tensor([1000], dtype=torch.int32, device=DEV)
    mask = torch.ones(B, 1, dtype=torch.bool, device=DEV)
    cpu = torch.device("cpu")
    assert [s for s, _ in A.decode_split_candidates(B, hkv, Tk, cpu)] == [8, 2, 4]
    capturing[0] = True  # a capture of an unseen shape: heuristic, nothing cached
    _check_decode(q, k, v, mask, lens, block_n=128)
    assert calls == [] and A._DECODE_SPLITS_TUNED == {}
    capturing[0] = False
    _check_decode(q, k, v, mask, lens, block_n=128)
    assert len(calls) == 1
    key = A._decode_key(q, k, None, Tk)
    assert A._DECODE_SPLITS_TUNED == {key: 4}
    assert A.decode_split_plan(q, k) == (4, 256)
    capturing[0] = True
    _check_decode(q, k, v, mask, lens, block_n=128)  # cached: no tuning, same plan
    _check_decode(q, k[:, :900], v[:, :900], mask, lens.clamp(max=900), block_n=128)  # same key
    assert len(calls) == 1
    _check_decode(q, k, v, mask, lens, num_splits=3, block_n=128)  # pinned: never tuned
    assert len(calls) == 1

    def broken(launch, cands):
        raise RuntimeError("no timer")

    capturing[0] = False
    monkeypatch.setattr(A, "_tune_decode_splits", broken)
    with pytest.warns(UserWarning, match="autotuning failed"):
        _check_decode(q, k[:, :400], v[:, :400], mask, lens.clamp(max=400), block_n=128)
    assert A._DECODE_SPLITS_TUNED[A._decode_key(q, k, None, 400)] == A.decode_splits(B, hkv, 400, cpu)[0]

    assert A._pick_splits([(8, 128), (2, 512), (4, 256)], [10.0, 9.9, 9.0]) == 4
    assert A._pick_splits([(8, 128), (2, 512), (4, 256)], [10.0, 9.9, 9.85]) == 8  # within noise


@pytest.mark.parametrize("cfg", attention._PREFILL_CONFIGS, ids=tile_id)
def test_every_prefill_tile_matches_reference(cfg):
    # Each tile the GPU autotuner may pick (no GPU run checks the ones it did not pick): T and
    # Tk ragged against the tile, GQA, variable lengths, one sequence with no active head.
    gen = torch.Generator().manual_seed(21)
    B, T, Tk = 2, 150, 150
    q, k, v = _qkv(B, T, Tk, 4, 2, torch.float32, gen)
    mask = _mask("random", (B, T, 2), gen).to(DEV)
    mask[1] = False
    lens = torch.tensor([150, 131], dtype=torch.int32, device=DEV)
    _check_prefill(q, k, v, mask, q_lens=lens, k_lens=lens,
                   block_m=cfg.kwargs["BLOCK_M"], block_n=cfg.kwargs["BLOCK_N"])


@pytest.mark.parametrize("cfg", attention._DECODE_CONFIGS, ids=tile_id)
@pytest.mark.parametrize("paged", [False, True])
def test_every_decode_tile_matches_reference(cfg, paged):
    gen = torch.Generator().manual_seed(22)
    B, Tk, hq, hkv = 3, 300, 8, 2
    q = torch.randn(B, hq, D, generator=gen).to(DEV)
    k = torch.randn(B, Tk, hkv, D, generator=gen).to(DEV)
    v = torch.randn(B, Tk, hkv, D, generator=gen).to(DEV)
    lens = torch.tensor([300, 1, 129], dtype=torch.int32, device=DEV)
    mask = _mask("random", (B, hkv), gen).to(DEV)
    mask[0] = True
    kw = dict(num_splits=2, block_n=cfg.kwargs["BLOCK_N"], num_warps=cfg.num_warps,
              num_stages=cfg.num_stages)
    if paged:
        kp, vp, table = _paged(k, v, lens, 128, gen)
        _check_decode(q, kp, vp, mask, lens, block_table=table, **kw)
    else:
        _check_decode(q, k, v, mask, lens, **kw)


@pytest.mark.parametrize("hq,hkv,G", [(7, 1, 1), (14, 2, 2), (14, 2, 7), (14, 2, 14)])
def test_packs_of_seven_heads_and_groups_across_packs(hq, hkv, G):
    # Qwen2.5-7B's 7 query heads per KV head (not a power of two), with groups of a whole pack,
    # of 2 heads that straddle two packs (14 heads, G=7) and of one head: prefill and decode.
    gen = torch.Generator().manual_seed(hq + G)
    q, k, v = _qkv(2, 21, 21, hq, hkv, torch.float16, gen)
    _check_prefill(q, k, v, _mask("random", (2, 21, G), gen).to(DEV))
    qd = torch.randn(2, hq, D, generator=gen).half().to(DEV)
    md = _mask("random", (2, G), gen).to(DEV)
    md[0, 0] = True
    lens = torch.tensor([21, 9], dtype=torch.int32, device=DEV)
    _check_decode(qd, k, v, md, lens, num_splits=2)
