"""wide.accelerate / wide.generate on tiny random Llama, Mistral, Qwen2 and Qwen3 models, on
the CPU.

The routed kernels run under the Triton interpreter (set before triton is imported), so the
same code that runs on the GPU is checked against the masked PyTorch path of the HF model.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import wide  # noqa: E402
from wide.base import arch  # noqa: E402
from wide.engine.graphs import warm_up  # noqa: E402
from wide.engine.inference import AcceleratedModel, accelerate, generate, sample_logits  # noqa: E402

from conftest import AlwaysLibrary, tiny_model  # noqa: E402

# head_dim 64 (the attention kernels take 64 or 128), 4 query / 2 KV heads, FFN 128 = 4 x 32.
TINY = dict(hidden_size=64, head_dim=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)


def routed(seed=0, target=0.5, model_type="llama", shape=None, **cfg):
    model = tiny_model(model_type, seed=seed, **(shape or TINY))
    model = wide.wrap(model, wide.WideConfig(ffn_group_size=32, **{"router_init": "random", **cfg}))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    if target is not None:
        wide.calibrate_offsets(model, [ids], target=target, mode="per_module", rounds=1)
    return model


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("backend,attn_gs", [("triton", None), ("triton", 1), ("torch", None)])
def test_logits_match_masked_path(backend, attn_gs):
    model = routed(attn_group_size=attn_gs)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), wide.track_sparsity(model) as tr:
        ref = model(input_ids=ids).logits
    sp = tr.summary()
    assert 0.3 < float(sp.attn_rate) < 0.7 and 0.3 < float(sp.ffn_rate) < 0.7
    eng = accelerate(model, backend=backend)
    assert eng.backend == backend
    assert rel(eng.logits(ids), ref) < 1e-5


def test_greedy_generation_matches_reference():
    model = routed(seed=1)
    prompt = [3, 17, 40, 5, 88, 21, 9]
    ref = hf_greedy(model, prompt, 6)
    res = generate(model, torch.tensor(prompt), max_new_tokens=6)
    assert res.tokens == [ref]
    # the decode step is the fused one: check the engine picked the kernels
    assert model.wide_engine.backend == "triton"


@pytest.mark.parametrize("router_input", ["residual", "normed"])
def test_decode_steps_match_masked_path_across_column_chunks(router_input):
    # hidden 320 = one 256-column chunk + a ragged 64: the fused norm/router kernel splits each
    # row over two programs and the last one to finish adds the router's partial sums; two
    # sequences, three steps, so the per-token tickets must re-arm between calls (twice).
    model = tiny_model("llama", seed=7, hidden_size=320, head_dim=64, intermediate_size=128,
                       num_attention_heads=5, num_key_value_heads=1, vocab_size=96,
                       max_position_embeddings=256)
    model = wide.wrap(model, wide.WideConfig(ffn_group_size=32, router_input=router_input, router_init="random"))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(8))
    wide.calibrate_offsets(model, [ids], target=0.5, mode="per_module", rounds=1)
    with torch.no_grad(), wide.track_sparsity(model) as tr:
        ref = model(input_ids=ids).logits
    sp = tr.summary()
    assert 0.2 < float(sp.attn_rate) < 0.8 and 0.2 < float(sp.ffn_rate) < 0.8
    eng = accelerate(model, backend="triton")
    # batch 2: the norm kernel's last chunk program finishes the router; batch 1: the q and
    # gate/up GEMVs finish it from the partial sums and write the masks (deferred router)
    for B in (2, 1):
        eng.setup_cache(B, 32)
        eng.prefill(ids[:B, :10])
        for t in range(10, 13):
            out = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long))
            assert rel(out, ref[:B, t]) < 1e-5, (B, t)


def test_batched_prompts_equal_one_at_a_time():
    model = routed(seed=2)
    eng = accelerate(model, backend="triton")
    prompts = [[5, 6, 7, 8, 9], [11, 2, 3, 4, 60, 61, 62, 63, 70], [42, 43]]
    batched = eng.generate(prompts, max_new_tokens=4).tokens
    single = [eng.generate([p], max_new_tokens=4).tokens[0] for p in prompts]
    assert batched == single
    assert single[2] == hf_greedy(model, prompts[2], 4)


def test_torch_backend_generation_and_hf_generate_still_works():
    model = routed(seed=3)
    prompt = [1, 2, 3, 4, 5, 6]
    eng = accelerate(model, backend="torch")
    assert eng.generate([prompt], max_new_tokens=5).tokens == [hf_greedy(model, prompt, 5)]
    # the HF model is left on the masked path: its own generate still runs
    out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
    assert out[0, len(prompt):].tolist() == hf_greedy(model, prompt, 3)


def test_dense_mode_matches_unrouted_model():
    model = routed(seed=4, target=None)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    state = model.wide_state
    state.mask_fn = lambda layer, kind, x: torch.ones(*x.shape[:-1], state.geometry.groups(kind))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    state.mask_fn = None
    eng = AcceleratedModel(model, backend="triton", mode="dense")
    assert rel(eng.logits(ids), ref) < 1e-5
    prompt = ids[0, :6].tolist()
    state.mask_fn = lambda layer, kind, x: torch.ones(*x.shape[:-1], state.geometry.groups(kind))
    want = hf_greedy(model, prompt, 3)
    state.mask_fn = None
    assert eng.generate([prompt], max_new_tokens=3).tokens == [want]


def test_mask_fn_and_eos():
    model = routed(seed=5, target=None)
    state = model.wide_state

    def fixed(layer, kind, x):  # depends on the token's values only: same in prefill and decode
        g = state.geometry.groups(kind)
        return (x[..., :g] > 0)

    state.mask_fn = fixed
    prompt = [7, 8, 9, 10]
    ref = hf_greedy(model, prompt, 4)
    eos = ref[2]
    res = generate(model, [prompt], max_new_tokens=4, eos_token_id=eos)
    assert res.tokens == [ref[:ref.index(eos) + 1]]


def test_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample_logits(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    assert sample_logits(logits, 1.0, top_k=1, generator=g).tolist() == [1, 0]
    assert sample_logits(logits, 1.0, top_p=0.01, generator=g).tolist() == [1, 0]
    draws = {tuple(sample_logits(logits, 1.0, top_k=2, generator=g).tolist()) for _ in range(50)}
    assert {d[0] for d in draws} == {1, 3}
    model = routed(seed=6)
    a = generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1).tokens
    b = generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1).tokens
    assert a == b


def test_clear_errors(monkeypatch):
    dense = tiny_model("llama", **TINY)
    with pytest.raises(ValueError, match="not wrapped"):
        accelerate(dense)
    small_heads = wide.wrap(tiny_model("llama"), wide.WideConfig(router_init="random", ffn_group_size=32))  # head_dim 16
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        accelerate(small_heads, backend="triton")
    assert accelerate(small_heads).backend == "torch"  # auto falls back
    odd = wide.wrap(tiny_model("llama", **dict(TINY, intermediate_size=96)), wide.WideConfig(router_init="random", ffn_group_size=24))
    with pytest.raises(ValueError, match="multiple of 16"):
        accelerate(odd, backend="triton")
    with pytest.raises(ValueError, match="interpreter"):
        accelerate(routed().to(torch.bfloat16), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        accelerate(routed(), backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        accelerate(routed(), backend="triton")
    assert accelerate(routed()).backend == "torch"


def test_choose_fastest_measures_once_per_key():
    from wide.engine.ops import choose_fastest

    calls, choices = [], {}
    timer = {"a": 2.0, "b": 1.0}

    def t(fn):
        calls.append(fn())
        return timer[fn()]

    fns = {"a": lambda: "a", "b": lambda: "b"}
    assert choose_fastest(("k", 1), fns, choices, t, default="a") == "b"
    assert choose_fastest(("k", 1), fns, choices, t, default="a") == "b"
    assert calls == ["a", "b"]  # timed once, then cached
    timer["a"] = 0.5
    assert choose_fastest(("k", 2), fns, choices, t, default="b") == "a"


def test_offsets_sit_mid_gap():
    # Calibration puts each threshold halfway between neighbouring margins, so a change of
    # summation order cannot flip a calibration token, and the realised rate stays exact.
    from wide.method.offsets import _mid_gap
    v = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert _mid_gap([v], 2.0) == 1.5 and _mid_gap([v], 1.2) == 1.5
    assert _mid_gap([v], 5.0) == 5.0  # above every margin already
    assert _mid_gap([v], 0.0) == -1.0 and _mid_gap([v + 10], 10.0) == 0.0  # all run: clear below
    model = routed()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    margins = []

    def grab(layer, kind, x):
        r = model.wide_routers[layer].router(kind)
        if r is not None:
            margins.append(r.margin(x).flatten())

    from wide.method.offsets import observed_pass
    from wide.method.state import get_state
    observed_pass(model, [ids], get_state(model).input_observers, grab)
    m = torch.cat(margins)
    assert float(m.abs().min()) > 1e-6


def _mid_gap_brute(v: torch.Tensor, thr: float) -> float:
    below, above = v[v < thr], v[v >= thr]
    if above.numel() == 0:
        return thr
    if below.numel() == 0:
        return float(above.min()) - max(1.0, abs(float(above.min())))
    lo, hi = float(below.max()), float(above.min())
    mid = float(torch.tensor((lo + hi) / 2, dtype=torch.float32))
    return mid if lo < mid <= hi else thr


def test_offset_search_on_sorted_margins_matches_brute_force():
    # Offset calibration sorts each module's margins once and binary-searches them, instead of
    # comparing every margin at each bisection step: the same shares, gaps and quantiles.
    from wide.method.offsets import _mid_gap, _set_offsets, _skipped_share
    g = torch.Generator().manual_seed(3)
    # rounded so that many margins tie, at the thresholds tried too
    chunks = [torch.round(torch.randn(n, generator=g) * 8) / 8 for n in (1, 7, 500, 2048)]
    union = torch.cat(chunks)
    srt = [c.sort().values for c in chunks]
    for thr in [-9.0, -0.25, 0.0, 0.1, 0.125, 1.0, 9.0] + union[::97].tolist():
        assert _mid_gap(srt, thr) == _mid_gap_brute(union, thr)
        for c, v in zip(chunks, srt):
            assert _skipped_share(v, -thr) * c.numel() == pytest.approx(int((c + -thr < 0).sum()), abs=1e-9)

    class R:
        def __init__(self):
            self.offset = torch.zeros(())

    class Routers:
        def __init__(self):
            self.r = R()

        def router(self, kind):
            return self.r

    class Model:
        wide_routers = [Routers() for _ in chunks]

    for target in (0.0, 0.3, 0.5, 0.999):
        margins = {(i, "ffn"): v for i, v in enumerate(srt)}
        _set_offsets(Model, None, margins, [], target, "per_module")
        for i, c in enumerate(chunks):
            q = _mid_gap_brute(c, float(torch.quantile(c, target)))
            assert float(Model.wide_routers[i].r.offset) == pytest.approx(-q, abs=1e-6)
    # torch.quantile's own rounding (rank and weight in fp32), where a rank computed in float64
    # would land one margin over, e.g. 46 values at 0.6
    for n in range(2, 60):
        v = torch.arange(n, dtype=torch.float32) + 1
        for target in (0.1, 0.25, 0.3, 0.6, 0.7, 0.9):
            _set_offsets(Model, None, {(0, "ffn"): v}, [], target, "per_module")
            q = _mid_gap_brute(v, float(torch.quantile(v, target)))
            assert float(Model.wide_routers[0].r.offset) == -q, (n, target)
    with pytest.raises(ValueError, match="no router decision"):
        _set_offsets(Model, None, {(0, "ffn"): torch.zeros(0)}, [], 0.5, "per_module")
    # more margins than torch.quantile takes (2**24): a GPU run's 262k tokens x 96 groups
    big = torch.arange(2 ** 24 + 3, dtype=torch.float32)
    _set_offsets(Model, None, {(0, "ffn"): big}, [], 0.5, "per_module")
    # the interpolated median lands on a margin, whose neighbours are adjacent fp32 numbers
    assert float(Model.wide_routers[0].r.offset) == -_mid_gap_brute(big, 2.0 ** 23 + 1)


def test_prefill_kernels_match_torch_backend_across_token_blocks():
    # Prefill RoPE/cache (32-token blocks), per-row norm and dense SiLU*up kernels against the
    # PyTorch backend of the same engine: two right-padded prompts longer than one block, a
    # hidden size that is not a power of two, then a decode step from the written cache.
    model = tiny_model("llama", seed=9, hidden_size=96, head_dim=64, intermediate_size=128,
                       num_attention_heads=3, num_key_value_heads=1, vocab_size=96,
                       max_position_embeddings=256)
    model = wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32))
    lens = torch.tensor([70, 41])
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(2))
    outs = []
    for backend in ("triton", "torch"):
        eng = AcceleratedModel(model, backend=backend, mode="dense", cuda_graphs=False)
        eng.setup_cache(2, 128)
        first = eng.prefill(ids, lens)
        nxt = eng.decode(first.argmax(-1), lens)
        outs.append((first, nxt, eng.k_cache[1][:, :70].clone()))
    for a, b in zip(*outs):
        assert rel(a, b) < 1e-5



@pytest.mark.parametrize("qkv", ["cublas", "whole"])
def test_cublas_choices_match_masked_path(monkeypatch, qkv):
    # On a GPU the engine measures routed kernel vs cuBLAS per projection and T bucket (the
    # union of many tokens' groups is ~every group). Forced to cuBLAS everywhere here (q|k|v as
    # two GEMMs or one, prefill attention in SDPA with the skipped heads zeroed after): prefill
    # and batch-2 decode must still match the masked path (inactive q heads unused, the FFN
    # activation zero in inactive groups); batch 1 keeps the routed q and gate/up (they write
    # the deferred router's masks) with O and down on cuBLAS.
    import wide.engine.ops

    monkeypatch.setattr(wide.engine.ops, "K_CHOICES", AlwaysLibrary(qkv))
    model = routed(seed=4)
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng = accelerate(model, backend="triton")
    for B in (2, 1):
        eng.setup_cache(B, 32)
        out = eng.prefill(ids[:B, :10])
        assert rel(out, ref[:B, 9]) < 1e-5, B
        for t in range(10, 14):
            out = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long))
            assert rel(out, ref[:B, t]) < 1e-5, (B, t)


def test_short_prefill_graph_buckets(monkeypatch):
    # On a GPU a short prefill replays a CUDA graph captured on the second use of a (batch,
    # length rounded up to 128) bucket, on padded static buffers. Here the capture is replaced
    # by a graph whose replay reruns the same step into the same output buffer, which checks
    # what the GPU path relies on: padded prompts of different lengths give the eager
    # prefill's logits from one graph, the cache holds the right keys for the decode steps
    # that follow, and a mask_fn, long prompts and all_logits stay eager.
    class ReplayGraph:
        def __init__(self, step, out):
            self.step, self.out = step, out

        def replay(self):
            self.out.copy_(self.step())

    def fake_capture(step, pool=None, keep=()):
        # GraphCapture's warm-up, and one more run for the output buffer a capture would allocate
        out = warm_up(step, keep, runs=3)
        return ReplayGraph(step, out), out

    model = routed(seed=6)
    eng = accelerate(model, backend="triton")
    monkeypatch.setattr(eng, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eng.cuda_graphs = True
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 96, (1, 40), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng.setup_cache(1, 256)
    for T in (30, 17):
        got = eng.prefill(ids[:, :T])
        assert rel(got, eng._prefill_eager(ids[:, :T])) < 1e-5, T
        assert rel(got, ref[:, T - 1]) < 1e-5, T
    # the first prefill of a bucket ran eagerly, the second captured the bucket's graph
    assert [k for k in eng._graphs if isinstance(k, tuple)] == [("prefill", 1, 128)]
    assert eng._graphs[("prefill", 1, 128)] is not None
    eng.prefill(ids[:, :17])  # keys of positions 17..127 are padding, overwritten as decode goes
    for t in range(17, 21):
        out = eng.decode(ids[:, t], torch.tensor([t]))
        assert rel(out, ref[:, t]) < 1e-5, t
    import wide.engine.inference as inf

    eng.setup_cache(1, 384)
    assert not eng._graphs  # a new cache drops the graphs (they captured the old one)
    # A limit under one 128-token bucket: a 6-token prompt's bucket is over it, so it must stay
    # eager (a limit read against the unrounded length would capture it; a 130-token prompt under
    # a 128 limit, as before, could not tell the two apart, and cost an interpreted long prefill).
    monkeypatch.setattr(inf, "PREFILL_GRAPH_MAX_TOKENS", 127)
    eng.prefill(ids[:, :5], all_logits=True)
    eng.prefill(torch.randint(0, 96, (1, 6), generator=gen))
    model.wide_state.mask_fn = lambda *a: None  # a Python mask_fn may do anything: eager
    try:
        eng.prefill(ids[:, :5])
    finally:
        model.wide_state.mask_fn = None
    assert not eng._graphs


def _llamas_spec(model_type) -> bool:
    import dataclasses

    return dataclasses.replace(arch.ARCHS[model_type], model_type="llama") == arch.ARCHS["llama"]


# Mistral's spec is Llama's but for its name (arch.ARCHS) and the engine runs it through the same
# kernels: the interpreted kernels take such a family once, as Llama (each interpreted family
# costs about 8 CPU-s); the torch backend checks every family against its HF model.
@pytest.mark.parametrize("backend,model_type", [
    *[("triton", t) for t in arch.SUPPORTED_MODEL_TYPES if t == "llama" or not _llamas_spec(t)],
    *[("torch", t) for t in arch.SUPPORTED_MODEL_TYPES]])
def test_every_family_matches_masked_path(model_type, backend):
    # Qwen2's q/k/v biases (nonzero: tiny_model draws them) and Qwen3's per-head q/k RMSNorms
    # (weights drawn around 1) are applied in the RoPE kernels on "triton", by HF's own ops
    # on "torch". Prefill logits, then greedy generation: batch-1 decode with the router
    # finished inside the q and gate/up GEMVs, against greedy decoding of the HF path.
    model = routed(seed=11, model_type=model_type)
    ids = torch.randint(0, 96, (1, 18), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng = accelerate(model, backend=backend)
    assert eng.backend == backend
    assert rel(eng.logits(ids), ref) < 1e-5
    prompt = ids[0, :7].tolist()
    assert eng.generate([prompt], max_new_tokens=5).tokens == [hf_greedy(model, prompt, 5)]
    eng.setup_cache(1, 32)
    eng.prefill(ids[:, :14])
    for t in range(14, 16):  # decode logits too: a few greedy tokens can agree by chance
        assert rel(eng.decode(ids[:, t], torch.tensor([t])), ref[:, t]) < 1e-5, t


# Qwen2.5-7B's GQA ratio, scaled down: 7 query heads per KV head.
GQA7 = dict(TINY, num_attention_heads=14, num_key_value_heads=2)


@pytest.mark.parametrize("attn_gs", [None, 2])
def test_seven_query_heads_per_kv_head(attn_gs):
    # A GQA pack is 7 heads (448 columns) and K/V (256 columns) are not whole groups of it, so
    # decode runs routed q and dense k/v apart; with attn_group_size 2, groups of 2 heads
    # straddle the packs and K/V fuse behind q as always-on groups. Batch 2 (tl.dot paths) and
    # batch 1 (GEMVs finishing the router) against the masked path's logits, and the masks the
    # engine used against the HF hooks' masks, token by token.
    model = routed(seed=12, model_type="qwen2", shape=GQA7, attn_group_size=attn_gs)
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    hf_masks = {k: v.bool() for k, v in model.wide_state.masks.items() if k[1] in ("attn", "ffn")}
    eng = accelerate(model, backend="triton")
    assert (eng.layers[0].wqkv is None) == (attn_gs is None)
    for B in (2, 1):
        eng.setup_cache(B, 32)
        assert rel(eng.prefill(ids[:B, :10]), ref[:B, 9]) < 1e-5, B
        for t in range(10, 12):
            record = []
            out = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long), record=record)
            assert rel(out, ref[:B, t]) < 1e-5, (B, t)
            assert len(record) == 2 * len(eng.layers)
            for layer, kind, m in record:
                assert torch.equal(m, hf_masks[(layer, kind)][:B, t]), (B, t, layer, kind)


def test_tied_routing_matches_masked_path():
    # Dynamic depth: one decision per token and layer, taken at the attention norm and reused
    # by the FFN; the engine evaluates it in PyTorch (no fused router), prefill and decode.
    model = routed(seed=14, tie_modules=True)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(15))
    with wide.track_sparsity(model) as tr, torch.no_grad():
        ref = model(input_ids=ids).logits
    assert 0 < float(tr.summary().attn_rate) < 1
    eng = accelerate(model, backend="triton")
    assert rel(eng.logits(ids), ref) < 1e-5
    prompt = ids[0, :6].tolist()
    assert eng.generate([prompt], max_new_tokens=4).tokens == [hf_greedy(model, prompt, 4)]


def test_sliding_window_shorter_than_the_cache_is_refused():
    # The kernels attend to the whole causal prefix: a cache longer than the window would give
    # other tokens than the model, so it is refused; within the window the engine runs.
    model = routed(seed=16, model_type="mistral", shape=dict(TINY, sliding_window=64), target=None)
    eng = accelerate(model, backend="torch")
    with pytest.raises(ValueError, match="sliding window of 64"):
        eng.setup_cache(1, 128)
    prompt = [4, 5, 6, 7]
    assert eng.generate([prompt], max_new_tokens=3).tokens == [hf_greedy(model, prompt, 3)]
    qwen = dict(TINY, use_sliding_window=True, sliding_window=96, max_window_layers=0)
    eng = accelerate(routed(seed=16, model_type="qwen2", shape=qwen, target=None), backend="torch")
    with pytest.raises(ValueError, match="sliding window of 96"):
        eng.generate([prompt], max_new_tokens=100)
    off = dict(qwen, use_sliding_window=False)
    assert accelerate(routed(seed=16, model_type="qwen2", shape=off, target=None)).window is None


def test_what_the_spec_refuses(monkeypatch):
    import dataclasses

    model = routed(seed=17, model_type="qwen3", target=None)
    spec = arch.ARCHS["qwen3"]
    monkeypatch.setitem(arch.ARCHS, "qwen3", dataclasses.replace(spec, engine=False))
    with pytest.raises(ValueError, match="ArchSpec.engine"):
        accelerate(model)
    monkeypatch.setitem(arch.ARCHS, "qwen3", dataclasses.replace(spec, embed_scale=8.0))
    with pytest.raises(ValueError, match="scale embeddings"):
        accelerate(model)
    monkeypatch.setitem(arch.ARCHS, "qwen3", spec)
    biased = wide.wrap(tiny_model("qwen3", attention_bias=True, **TINY), wide.WideConfig(router_init="random", ffn_group_size=32))
    with pytest.raises(ValueError, match="q_proj has a bias"):  # Qwen3's spec allows none
        accelerate(biased)
    with pytest.raises(ValueError, match="SiLU"):
        accelerate(routed(model_type="qwen2", shape=dict(TINY, hidden_act="gelu"), target=None))


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1.0), "temperature must be >= 0"),
                                    (dict(top_k=-2), "top_k must be >= 0"),
                                    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
                                    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
                                    (dict(max_new_tokens=250), "exceeds the model's 256 positions")])
def test_generate_refuses_bad_settings(kw, msg):
    eng = accelerate(routed(), backend="torch")
    with pytest.raises(ValueError, match=msg):
        eng.generate([[1, 2, 3, 4, 5, 6, 7]], **{"max_new_tokens": 4, **kw})
