"""Activation-sparse decode GEMVs (fine_gemv) against their fp32 reference.

Runs on the CPU through Triton's interpreter (set before triton is imported); on a CUDA
machine run with TRITON_INTERPRET=0 to test the compiled kernels, bf16 included.
"""
import json
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import wide.kernels.fine_gemv as fg  # noqa: E402
from wide.kernels.silu_mul import silu_mul_reference  # noqa: E402
from wide.kernels.fine_gemv import (fine_gemv, fine_gemv_reference, fine_layout, fine_segments,  # noqa: E402
                                    keep_mask_reference)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

# Under the interpreter bf16 math is unreliable, so bf16 only on CUDA.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOKENS = [1, 2, 3, 4]
K_RAGGED, N_RAGGED = 70, 90  # multiples of no block size


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def rel_err(y, ref):
    y, ref = y.float().cpu(), ref.float().cpu()
    assert not torch.isnan(y).any(), "NaN in output"
    return ((y - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _inputs(T, K, N, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    return x, w, gen


def _median_abs(x):
    return float(x.float().abs().median())


@pytest.fixture(params=[(1, False, 16), (3, False, 16), (3, True, 16), (3, False, 0), (3, True, 0)],
                ids=lambda p: f"split{p[0]}" + ("-ordered" if p[1] else "") + ("-compact" if p[2] else "-masked"))
def split(request, monkeypatch):
    # the interpreter's split-K factor: 1 = direct store, 3 = a reduction over an odd number
    # of splits, the last one shorter: atomic fp32 sums (the default) or, deterministic, the
    # ticketed in-order sum of the partials (the tests without this fixture run 2, atomic);
    # the kept rows listed first (16 at a time: ragged K ends mid-chunk) or walked under the mask
    n, ordered, compact = request.param
    monkeypatch.setattr(fg, "INTERPRET_SPLIT", n)
    monkeypatch.setattr(fg, "INTERPRET_COMPACT", compact)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(ordered)
    yield n
    torch.use_deterministic_algorithms(was)


# ---------------------------------------------------------------- layout
def test_fine_layout_and_segments():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 24, generator=gen) for n in (32, 8, 8))
    wt = fine_layout(q)
    assert wt.shape == (24, 32) and wt.is_contiguous() and torch.equal(wt, q.t())
    wt = fine_layout(q, k, v)
    assert wt.shape == (24, 48) and wt.is_contiguous()
    assert torch.equal(wt, torch.cat([q, k, v]).t())
    assert fine_segments(q, k, v) == [0, 32, 40, 48]
    with pytest.raises(ValueError, match="share K"):
        fine_layout(q, torch.randn(8, 25))
    with pytest.raises(ValueError, match="2-D"):
        fine_layout(torch.randn(4))


def test_keep_mask_reference():
    x = torch.tensor([[0.5, -2.0, 1.0, float("nan")], [0.0, 3.0, -0.99, 1.0]])
    assert keep_mask_reference(x, 1.0).tolist() == [[False, True, True, False], [False, True, False, True]]
    scale = torch.tensor([4.0, 1.0, 0.5, 1.0])
    assert keep_mask_reference(x, 1.0, scale).tolist() == [[True, True, False, False], [False, True, False, True]]
    gm = torch.tensor([[True, False], [False, True]])
    assert keep_mask_reference(x, 1.0, None, gm, 2).tolist() == [[False, True, False, False],
                                                                 [False, False, False, True]]


# ---------------------------------------------------------------- fine_gemv
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", TOKENS)
def test_matches_reference(T, dtype, split):
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, dtype, 10 + T)
    wt = fine_layout(w)
    th = _median_abs(x)  # about half of each token's inputs kept
    out = torch.full((T, N_RAGGED), float("nan"), dtype=dtype, device=DEVICE)  # poison
    y = fine_gemv(x, wt, th, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    ref = fine_gemv_reference(x, wt, th)
    keep = keep_mask_reference(x, th)
    assert 0.2 < keep.float().mean() < 0.8
    assert rel_err(y, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 3])
def test_with_scale(T, dtype):
    x, w, gen = _inputs(T, K_RAGGED, N_RAGGED, dtype, 20 + T)
    wt = fine_layout(w)
    scale = w.float().norm(dim=0).to(DEVICE)  # WINA: |x_k| times the norm of weight column k
    scale[::3] *= 4.0
    th = float((x.float().abs() * scale).median())
    y = fine_gemv(x, wt, th, scale=scale)
    ref = fine_gemv_reference(x, wt, th, scale=scale)
    assert rel_err(y, ref) < tol(dtype)
    # the scale changes which columns are kept
    assert not torch.equal(keep_mask_reference(x, th, scale), keep_mask_reference(x, th))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", TOKENS)
def test_all_kept_is_dense(T, dtype):
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, dtype, 30 + T)
    y = fine_gemv(x, fine_layout(w), 0.0)
    assert rel_err(y, x.float() @ w.float().t()) < tol(dtype)


@pytest.mark.parametrize("T", TOKENS)
def test_none_kept_is_exact_zeros(T, split):
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, torch.float16, 40 + T)
    out = torch.full((T, N_RAGGED), float("nan"), dtype=torch.float16, device=DEVICE)
    y = fine_gemv(x, fine_layout(w), float("inf"), out=out)
    assert torch.all(y == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", TOKENS)
def test_exactly_one_column(T, dtype):
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, dtype, 50 + T)
    x = (x.float() * 0.1).clamp(-0.5, 0.5)
    cols = [(17 + 23 * t) % K_RAGGED for t in range(T)]  # a different column per token
    for t, c in enumerate(cols):
        x[t, c] = -3.0 if t % 2 else 3.0
    x = x.to(dtype)
    wt = fine_layout(w)
    y = fine_gemv(x, wt, 1.0)
    want = torch.stack([x[t, c].float() * wt[c].float() for t, c in enumerate(cols)])
    assert rel_err(y, want) < tol(dtype)


def test_nan_inputs_are_dropped():
    T = 2
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, torch.float32, 60)
    x[0, 5] = float("nan")
    x[1, 40] = float("nan")
    wt = fine_layout(w)
    y = fine_gemv(x, wt, 0.3)
    ref = fine_gemv_reference(x, wt, 0.3)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("kind", ["all", "none", "random", "one_token"])
@pytest.mark.parametrize("T", TOKENS)
def test_group_mask(T, kind, split):
    gs = 10
    x, w, gen = _inputs(T, K_RAGGED, N_RAGGED, torch.float32, 70 + T)
    wt = fine_layout(w)
    ng = K_RAGGED // gs
    if kind == "all":
        gm = torch.ones(T, ng, dtype=torch.bool)
    elif kind == "none":
        gm = torch.zeros(T, ng, dtype=torch.bool)
    elif kind == "one_token":
        gm = torch.zeros(T, ng, dtype=torch.bool)
        gm[T // 2] = torch.rand(ng, generator=gen) < 0.6
        gm[T // 2, 0] = True
    else:
        gm = torch.rand(T, ng, generator=gen) < 0.5
    gm = gm.to(DEVICE)
    th = _median_abs(x)
    y = fine_gemv(x, wt, th, group_mask=gm, group_size=gs)
    ref = fine_gemv_reference(x, wt, th, group_mask=gm, group_size=gs)
    off = ~gm.any(1)  # tokens with no group on: exact zeros
    assert torch.all(y[off] == 0)
    if kind == "all":
        assert torch.equal(y, fine_gemv(x, wt, th))
    if kind != "none":
        assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("bounds", [[0, 50, 70, 90], [0, 7, 40, 41, 90], [0, 45, 90]], ids=["qkv", "four", "gateup"])
def test_segments(T, bounds, dtype, split):
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, dtype, 80 + T)
    wt = fine_layout(w)
    ths = [0.2, 1.0, 0.0, float("inf")][: len(bounds) - 1]
    if len(bounds) == 3:
        ths = [1.5, 0.4]
    y = fine_gemv(x, wt, segments=bounds, thresholds=ths)
    ref = fine_gemv_reference(x, wt, segments=bounds, thresholds=ths)
    assert rel_err(y, ref) < tol(dtype)
    for (lo, hi), th in zip(zip(bounds[:-1], bounds[1:]), ths):  # each segment its own threshold
        seg = fine_gemv(x, fine_layout(w[lo:hi]), th)
        assert rel_err(y[:, lo:hi], seg) < tol(dtype) or (th == float("inf") and torch.all(y[:, lo:hi] == 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 4])
def test_glu_is_silu_mul_of_gate_and_up(T, dtype, split):
    # silu(gate) * up from the epilogue: the same bits as the two-launch path (fine_gemv of
    # gate|up, then silu_mul), with gate and up at different thresholds, ragged widths
    from wide.kernels.silu_mul import silu_mul
    x, g, _ = _inputs(T, K_RAGGED, 45, dtype, 53)
    _, u, _ = _inputs(T, K_RAGGED, 45, dtype, 54)
    wt, seg = fine_layout(g, u), [0, 45, 90]
    ths = [_median_abs(x), 0.5 * _median_abs(x)]
    y = fine_gemv(x, wt, thresholds=ths, segments=seg, glu=True)
    assert y.shape == (T, 45) and y.dtype == dtype
    gu = fine_gemv(x, wt, thresholds=ths, segments=seg)
    assert torch.equal(y, silu_mul(gu[:, :45], gu[:, 45:]))
    assert rel_err(y, fine_gemv_reference(x, wt, thresholds=ths, segments=seg, glu=True)) < tol(dtype)
    assert torch.all(fine_gemv(x, wt, thresholds=[float("inf")] * 2, segments=seg, glu=True) == 0)
    with pytest.raises(ValueError, match="equal width"):
        fine_gemv(x, wt, thresholds=ths, segments=[0, 40, 90], glu=True)
    with pytest.raises(ValueError, match="equal width"):
        fine_gemv(x, wt, ths[0], glu=True)


CONFIGS = [fg._cfg(64, 16, 8, 4, 8, False), fg._cfg(256, 1, 16, 1, 16, True), fg._cfg(32, 32, 1, 4, 8, True),
           fg._cfg(128, 8, 2, 4, 4, True), fg._cfg(128, 16, 4, 4, 64, False, atomic=True),
           fg._cfg(64, 8, 2, 2, 32, True, atomic=True),
           # compacting: rows across threads too, a chunk longer than K; weight loads masked by
           # the list alone; without prefetch (the compiler's pipeline, num_stages > 1)
           fg._cfg(64, 4, 2, 1, 8, True, atomic=True, compact=32), fg._cfg(32, 2, 4, 1, 8, True, compact=128),
           fg._cfg(64, 4, 2, 1, 8, True, atomic=True, compact=32, maskw=False),
           fg._cfg(32, 1, 8, 1, 8, True, compact=16, maskw=False),
           fg._cfg(64, 2, 4, 1, 8, False, stages=3, atomic=True, compact=16),
           fg._cfg(32, 1, 8, 1, 8, False, atomic=True, compact=16, maskw=False)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.kwargs.items()))
def test_tile_configs(config):
    # the tuned tile shapes (with and without prefetch, one row per thread-row, one step per
    # thread), not only the interpreter's default
    T = 3
    x, w, _ = _inputs(T, K_RAGGED, 2 * 45, torch.float32, 97)
    wt = fine_layout(w)
    bounds, ths = [0, 50, 70, 90], [0.3, 1.0, 0.6]
    y = fine_gemv(x, wt, segments=bounds, thresholds=ths, config=config)
    assert rel_err(y, fine_gemv_reference(x, wt, segments=bounds, thresholds=ths)) < 1e-5


def test_threshold_tensors_are_read_on_the_device():
    T = 3
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, torch.float32, 90)
    wt = fine_layout(w)
    bounds = [0, 50, 70, 90]
    th = torch.tensor([0.3, 1.2, 0.6], device=DEVICE)
    y = fine_gemv(x, wt, segments=bounds, thresholds=th)
    assert rel_err(y, fine_gemv_reference(x, wt, segments=bounds, thresholds=[0.3, 1.2, 0.6])) < 1e-5
    th.fill_(float("inf"))  # the same launch arguments, new values
    assert torch.all(fine_gemv(x, wt, segments=bounds, thresholds=th) == 0)
    one = torch.tensor(0.5, device=DEVICE)
    assert rel_err(fine_gemv(x, wt, one), fine_gemv_reference(x, wt, 0.5)) < 1e-5


def test_strided_x_and_out():
    T = 2
    x, w, _ = _inputs(T, K_RAGGED + 10, N_RAGGED, torch.float32, 95)
    xs = x[:, :K_RAGGED]  # row stride K + 10
    wt = fine_layout(w[:, :K_RAGGED])
    big = torch.zeros(T, N_RAGGED + 6, device=DEVICE)
    y = fine_gemv(xs, wt, 0.4, out=big[:, 3:3 + N_RAGGED])
    assert rel_err(y, fine_gemv_reference(xs, wt, 0.4)) < 1e-5
    assert torch.all(big[:, :3] == 0) and torch.all(big[:, 3 + N_RAGGED:] == 0)


@pytest.mark.parametrize("T", TOKENS)
def test_acc_out_adds_the_fp32_sums(T, split):
    # acc_out: the products added into the caller's fp32 sums, nothing rounded or cleared: two
    # launches hold twice the sums; a launch keeping nothing leaves them as they were.
    if torch.are_deterministic_algorithms_enabled():
        pytest.skip("acc_out adds atomically")
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, torch.float32, 71 + T)
    wt = fine_layout(w)
    bounds, ths = [0, 50, 70, 90], [_median_abs(x), 0.3, 2 * _median_abs(x)]
    ref = fine_gemv_reference(x, wt, segments=bounds, thresholds=ths)
    acc = torch.zeros(T, N_RAGGED, device=DEVICE)
    assert fine_gemv(x, wt, segments=bounds, thresholds=ths, acc_out=acc) is acc
    assert rel_err(acc, ref) < 1e-5
    fine_gemv(x, wt, segments=bounds, thresholds=ths, acc_out=acc)
    assert rel_err(acc, 2 * ref) < 1e-5
    before = acc.clone()
    fine_gemv(x, wt, float("inf"), acc_out=acc)
    assert torch.equal(acc, before)
    acc.zero_()
    fine_gemv(x, wt, 0.0, acc_out=acc)  # all kept: the dense product
    assert rel_err(acc, x @ wt) < 1e-5
    gm = torch.rand(T, K_RAGGED // 7, generator=torch.Generator().manual_seed(T)).to(DEVICE) < 0.5
    acc.zero_()
    fine_gemv(x, wt, 0.3, group_mask=gm, group_size=7, acc_out=acc)
    assert rel_err(acc, fine_gemv_reference(x, wt, 0.3, group_mask=gm, group_size=7)) < 1e-5


def test_acc_out_errors_and_shared_buffers():
    from wide.kernels.routing import split_tickets, zeroed_accumulator
    x, w, _ = _inputs(2, 32, 48, torch.float32, 98)
    wt = fine_layout(w)
    acc = torch.zeros(2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="glu or out"):
        fine_gemv(x, wt, 0.1, out=torch.empty(2, 48, device=DEVICE), acc_out=acc)
    with pytest.raises(ValueError, match="glu or out"):
        fine_gemv(x, wt, segments=[0, 24, 48], thresholds=[0.1, 0.1], glu=True, acc_out=acc)
    with pytest.raises(ValueError, match="deterministic"):
        fine_gemv(x, wt, 0.1, deterministic=True, acc_out=acc)
    with pytest.raises(ValueError, match="ATOMIC"):
        fine_gemv(x, wt, 0.1, config=fg._cfg(64, 16, 8, 4, 8, False), acc_out=acc)
    for bad in (torch.zeros(2, 47, device=DEVICE), torch.zeros(2, 48, device=DEVICE, dtype=torch.float16),
                torch.zeros(48, 2, device=DEVICE).t()):
        with pytest.raises(ValueError, match="acc_out must be"):
            fine_gemv(x, wt, 0.1, acc_out=bad)
    # the shared atomic sums and tickets are left as they were (zero)
    fine_gemv(x, wt, 0.1, acc_out=acc)
    assert torch.all(zeroed_accumulator(x.device, 2 * 48) == 0)
    assert torch.all(split_tickets(x.device, 1) == 0)
    assert rel_err(acc, fine_gemv_reference(x, wt, 0.1)) < 1e-5


def test_compacting_tiles_run_one_warp():
    # the two-warp compacting tile lost rows on an H100 (experiments/results/fine_gemv_race_h100/)
    with pytest.raises(ValueError, match="one warp"):
        fg._cfg(512, 1, 8, 2, 8, True, atomic=True, compact=128)
    with pytest.raises(ValueError, match="maskw=False"):
        fg._cfg(256, 1, 16, 1, 8, True, atomic=True, maskw=False)
    assert all(c.num_warps == 1 for c in fg._CONFIGS if fg._compact(c))


def test_errors():
    x, w, _ = _inputs(2, 32, 48, torch.float32, 99)
    wt = fine_layout(w)
    with pytest.raises(ValueError, match="1..4 decode tokens"):
        fine_gemv(torch.zeros(5, 32, device=DEVICE), wt, 0.1)
    with pytest.raises(ValueError, match="1..4 decode tokens"):
        fine_gemv(torch.zeros(0, 32, device=DEVICE), wt, 0.1)
    with pytest.raises(ValueError, match="2-D"):
        fine_gemv(x[0], wt, 0.1)
    with pytest.raises(ValueError, match="fine_layout"):
        fine_gemv(x, w, 0.1)  # an [N, K] weight
    with pytest.raises(ValueError, match="dtype"):
        fine_gemv(x.half(), wt, 0.1)
    with pytest.raises(ValueError, match="unsupported dtype"):
        fine_gemv(x.to(torch.float64), wt.to(torch.float64), 0.1)
    with pytest.raises(ValueError, match="NaN"):
        fine_gemv(x, wt, float("nan"))
    with pytest.raises(ValueError, match=">= 0"):
        fine_gemv(x, wt, -1.0)
    with pytest.raises(ValueError, match="threshold is required"):
        fine_gemv(x, wt)
    with pytest.raises(ValueError, match="scale"):
        fine_gemv(x, wt, 0.1, scale=torch.ones(31, device=DEVICE))
    with pytest.raises(ValueError, match="scale"):
        fine_gemv(x, wt, 0.1, scale=torch.ones(32, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="group_mask must have shape"):
        fine_gemv(x, wt, 0.1, group_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE), group_size=8)
    with pytest.raises(ValueError, match="torch.bool"):
        fine_gemv(x, wt, 0.1, group_mask=torch.ones(2, 4, device=DEVICE), group_size=8)
    with pytest.raises(ValueError, match="does not divide"):
        fine_gemv(x, wt, 0.1, group_mask=torch.ones(2, 3, dtype=torch.bool, device=DEVICE), group_size=10)
    with pytest.raises(ValueError, match="without group_mask"):
        fine_gemv(x, wt, 0.1, group_size=8)
    with pytest.raises(ValueError, match="start at 0 and end at N"):
        fine_gemv(x, wt, 0.1, segments=[0, 20, 40])
    with pytest.raises(ValueError, match="strictly increasing"):
        fine_gemv(x, wt, 0.1, segments=[0, 20, 20, 48])
    with pytest.raises(ValueError, match="boundaries"):
        fine_gemv(x, wt, 0.1, segments=[0, 1, 2, 3, 4, 48])
    with pytest.raises(ValueError, match="expected 3 thresholds"):
        fine_gemv(x, wt, segments=[0, 20, 30, 48], thresholds=[0.1, 0.2])
    with pytest.raises(ValueError, match="need segments"):
        fine_gemv(x, wt, thresholds=[0.1])
    with pytest.raises(ValueError, match="not both"):
        fine_gemv(x, wt, 0.1, segments=[0, 20, 48], thresholds=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"thresholds\[1\] is NaN"):
        fine_gemv(x, wt, segments=[0, 20, 48], thresholds=[0.1, float("nan")])
    with pytest.raises(ValueError, match="float32"):
        fine_gemv(x, wt, torch.tensor([0.1], dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        fine_gemv(x, wt, 0.1, out=torch.empty(2, 47, device=DEVICE))


def test_empty_dims():
    x, w, _ = _inputs(2, 32, 48, torch.float32, 98)
    assert fine_gemv(x, torch.empty(32, 0, device=DEVICE), 0.1).shape == (2, 0)
    y = fine_gemv(torch.empty(2, 0, device=DEVICE), torch.empty(0, 48, device=DEVICE), 0.1)
    assert y.shape == (2, 48) and torch.all(y == 0)


# ---------------------------------------------------------------- benchmark smoke
@pytest.mark.skipif(not INTERPRET, reason="the CPU path of the benchmark runs under the interpreter")
def test_benchmark_cpu_records(tmp_path):
    from wide.benchmarks import fine_gemv as bench

    out = tmp_path / "fine_gemv"
    assert bench.main(["--device", "cpu", "--out", str(out), "--tokens", "1", "4", "--shapes", "qkv",
                       "gate_up"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    for key in ("device", "torch", "triton", "date", "command", "records"):
        assert key in doc
    assert "wide.benchmarks.fine_gemv --device cpu" in doc["command"]
    recs = doc["records"]
    assert {(r["op"], r["shape"], r["T"]) for r in recs} == {
        ("fine_gemv", "qkv", 1), ("fine_gemv", "qkv", 4), ("fine_gemv", "gate_up", 1), ("fine_gemv", "gate_up", 4)}
    for r in recs:
        for key in ("op", "shape", "N", "K", "T", "kept", "union", "dense_us", "fine_us", "floor_us",
                    "speedup", "vs_floor", "gbps", "rel_err"):
            assert key in r, key
        assert r["rel_err"] < 1e-5 and r["kept"] == 0.5
        assert math.isclose(r["speedup"], r["dense_us"] / r["fine_us"], rel_tol=1e-3, abs_tol=1e-4)
        assert math.isclose(r["vs_floor"], r["fine_us"] / r["floor_us"], rel_tol=1e-3, abs_tol=1e-4)
        assert (r["union"] == 0.5) if r["T"] == 1 else (0.5 < r["union"] <= 1.0)
    assert "| tiny qkv | fp32 |" in out.with_suffix(".md").read_text()
    assert all(r["dtype"] == "fp32" and r["sparsity"] == 0.5 and r["dense_t_us"] > 0 for r in recs)


def test_compact_lists_only_kept_rows(monkeypatch):
    # The row lists are scratch: stale entries from a launch with other inputs (more rows kept)
    # must not leak into the next, and a launch keeping nothing must read nothing.
    from wide.kernels.routing import row_lists
    monkeypatch.setattr(fg, "INTERPRET_SPLIT", 3)
    monkeypatch.setattr(fg, "INTERPRET_COMPACT", 16)
    x, w, _ = _inputs(2, K_RAGGED, N_RAGGED, torch.float32, 43)
    wt = fine_layout(w)
    assert rel_err(fine_gemv(x, wt, 0.0), x @ wt) < 1e-5
    assert torch.any(row_lists(x.device, 1) != 0)
    for th in (_median_abs(x), 2 * _median_abs(x)):
        assert rel_err(fine_gemv(x, wt, th), fine_gemv_reference(x, wt, th)) < 1e-5
    assert torch.all(fine_gemv(x, wt, float("inf")) == 0)
    # the GPU smoke's check counts the counters and sums, not these lists (an H100 smoke of
    # 2026-12-07 read the lists' indices as 462737385 tickets left raised)
    from wide.kernels.routing import raised_counters
    fine_gemv(x, wt, 0.0)
    assert torch.any(row_lists(x.device, 1) != 0) and raised_counters() == 0


@pytest.mark.parametrize("ordered", [False, True], ids=["atomic", "ordered"])
def test_reductions_leave_their_buffers_clear(ordered, monkeypatch):
    # Every launch must find the atomic sums and the tickets at zero: the program that reads a
    # slice's sum clears it, so a second launch (a graph replay) gives the same output.
    from wide.kernels.routing import split_tickets, zeroed_accumulator
    monkeypatch.setattr(fg, "INTERPRET_SPLIT", 3)
    T = 2
    x, w, _ = _inputs(T, K_RAGGED, N_RAGGED, torch.float32, 41)
    wt = fine_layout(w)
    th = _median_abs(x)
    ref = fine_gemv_reference(x, wt, th)
    first = fine_gemv(x, wt, th, deterministic=ordered)
    assert rel_err(first, ref) < 1e-5
    assert torch.all(zeroed_accumulator(x.device, T * N_RAGGED) == 0)
    assert torch.all(split_tickets(x.device, 1) == 0)
    assert rel_err(fine_gemv(x, wt, th, deterministic=ordered), ref) < 1e-5
    with pytest.raises(ValueError, match="deterministic"):
        fine_gemv(x, wt, th, deterministic=True, config=fg._cfg(64, 8, 2, 2, 32, True, atomic=True))


# ---------------------------------------------------------------- clear=
def _same(a, b):
    # the interpreter runs programs one after another, so the atomic sums add in one order
    # and a launch with clear= must give the same bits; a GPU may add them in another
    if DEVICE == "cpu":
        return torch.equal(a, b)
    return rel_err(a, b) < 1e-5


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kind", ["plain", "glu", "acc_out"])
@pytest.mark.parametrize("size", [1, 5, 129, 3 * N_RAGGED, 1573])
def test_clear_zeros_the_buffer_and_leaves_the_result(T, kind, size, split):
    # sizes: fewer elements than programs (most programs clear nothing), ragged ones, and more
    # than programs x CLEAR_BLOCK (each program loops over its slice)
    if kind == "acc_out" and torch.are_deterministic_algorithms_enabled():
        pytest.skip("acc_out adds atomically")
    x, w, _ = _inputs(T, K_RAGGED, 2 * 45, torch.float32, 5 + T)
    wt = fine_layout(w)
    kw = dict(segments=[0, 45, 90], thresholds=[_median_abs(x), 0.5 * _median_abs(x)])
    if kind == "glu":
        kw["glu"] = True

    def run(clear=None):
        if kind == "acc_out":
            acc = torch.zeros(T, 90, device=DEVICE)
            fine_gemv(x, wt, acc_out=acc, clear=clear, **kw)
            return acc
        return fine_gemv(x, wt, clear=clear, **kw)

    want = run()
    buf = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(DEVICE) + 3.0
    assert _same(run(buf), want)
    assert torch.all(buf == 0)
    ref = fine_gemv_reference(x, wt, **kw)
    assert rel_err(want, ref) < 1e-5


def test_clear_shapes_edges_and_errors():
    x, w, _ = _inputs(2, 32, 48, torch.float32, 99)
    wt = fine_layout(w)
    buf = torch.ones(4, 48, device=DEVICE)
    fine_gemv(x, wt, 0.1, clear=buf[1:3])  # a contiguous row slice: only those rows
    assert torch.all(buf[1:3] == 0) and torch.all(buf[0] == 1) and torch.all(buf[3] == 1)
    empty = torch.ones(0, device=DEVICE)
    assert torch.equal(fine_gemv(x, wt, 0.1, clear=empty), fine_gemv(x, wt, 0.1))
    # no launch (K = 0 or N = 0): zeroed all the same
    for xx, ww in ((x[:, :0], wt[:0]), (x, wt[:, :0])):
        buf.fill_(1.0)
        fine_gemv(xx, ww, 0.1, clear=buf)
        assert torch.all(buf == 0)
    out = torch.empty(2, 48, device=DEVICE)
    acc = torch.zeros(2, 48, device=DEVICE)
    for bad in (torch.ones(8, device=DEVICE, dtype=torch.float16), torch.ones(8, 4, device=DEVICE).t(), [0.0]):
        with pytest.raises(ValueError, match="clear must be a contiguous float32"):
            fine_gemv(x, wt, 0.1, clear=bad)
    with pytest.raises(ValueError, match="shares memory with out"):
        fine_gemv(x, wt, 0.1, out=out, clear=out[1])
    with pytest.raises(ValueError, match="shares memory with acc_out"):
        fine_gemv(x, wt, 0.1, acc_out=acc, clear=acc.view(-1)[40:60])
    with pytest.raises(ValueError, match="shares memory with x"):
        fine_gemv(x, wt, 0.1, clear=x[1])
    with pytest.raises(ValueError, match="shares memory with thresholds"):
        th = torch.full((1,), 0.1, device=DEVICE)
        fine_gemv(x, wt, th, clear=th)


# ---------------------------------------------------------------- glu_input
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", TOKENS)
def test_glu_input_reads_silu_mul_of_the_sums(T, dtype, split):
    # x: fp32 gate and up sums [T, 2K]; the input is silu(gate) * up rounded to the weight's dtype
    gen = torch.Generator().manual_seed(60 + T)
    sums = torch.randn(T, 2 * K_RAGGED, generator=gen).to(DEVICE)
    w = (torch.randn(N_RAGGED, K_RAGGED, generator=gen) / K_RAGGED ** 0.5).to(dtype).to(DEVICE)
    wt = fine_layout(w)
    u = fine_gemv_reference(sums, wt, 0.0, glu_input=True)  # every input kept: the dense product
    xin = silu_mul_reference(sums[:, :K_RAGGED].to(dtype), sums[:, K_RAGGED:].to(dtype)).to(dtype)
    assert rel_err(u, xin.float() @ wt.float()) < 1e-6
    v = xin.float().abs().flatten().sort().values  # a threshold midway between two inputs: the
    th = float(v[v.numel() // 2: v.numel() // 2 + 2].mean())  # kernel's silu may differ by an ulp
    y = fine_gemv(sums, wt, th, glu_input=True)
    assert y.dtype == dtype and y.shape == (T, N_RAGGED)
    assert rel_err(y, fine_gemv_reference(sums, wt, th, glu_input=True)) < tol(dtype)
    if not torch.are_deterministic_algorithms_enabled():
        acc = torch.zeros(T, N_RAGGED, device=DEVICE)
        fine_gemv(sums, wt, th, glu_input=True, acc_out=acc)
        assert rel_err(acc, fine_gemv_reference(sums, wt, th, glu_input=True)) < 1e-5


def test_glu_input_chains_a_gate_up_launch_into_down():
    # the engine's fp32-sums FFN: gate|up adds into sums, down reads silu(gate) * up from them; the
    # same bits as gate|up with its silu epilogue (glu=True), then down on that output
    dtype = torch.float16
    T, K, I = 2, 40, 24
    gen = torch.Generator().manual_seed(61)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    wg, wu = ((torch.randn(I, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE) for _ in range(2))
    wd = (torch.randn(K, I, generator=gen) / I ** 0.5).to(dtype).to(DEVICE)
    wgu, wdt = fine_layout(wg, wu), fine_layout(wd)
    seg, ths = [0, I, 2 * I], [0.3, 0.5]
    sums = torch.zeros(T, 2 * I, device=DEVICE)
    fine_gemv(x, wgu, segments=seg, thresholds=ths, acc_out=sums)
    u = fine_gemv(x, wgu, segments=seg, thresholds=ths, glu=True)
    assert torch.equal(fine_gemv(sums, wdt, 0.05, glu_input=True), fine_gemv(u, wdt, 0.05))


def test_glu_input_errors():
    w = torch.randn(16, 8, device=DEVICE)
    wt = fine_layout(w)  # K = 8
    with pytest.raises(ValueError, match=r"\[T, 2K\] = \[T, 16\]"):
        fine_gemv(torch.zeros(1, 8, device=DEVICE), wt, 0.1, glu_input=True)
    with pytest.raises(ValueError, match="float32 gate and up sums"):
        fine_gemv(torch.zeros(1, 16, device=DEVICE, dtype=torch.float16), wt, 0.1, glu_input=True)
    with pytest.raises(ValueError, match="1..4 decode tokens"):
        fine_gemv(torch.zeros(5, 16, device=DEVICE), wt, 0.1, glu_input=True)
    with pytest.raises(ValueError, match="not both"):
        fine_gemv(torch.zeros(1, 16, device=DEVICE), fine_layout(w, w), segments=[0, 16, 32],
                  thresholds=[0.1, 0.1], glu=True, glu_input=True)
