"""The engine's per-element modes (wide.accelerate(mode="fine" | "hybrid"), wide.engine.fine_engine) against
the masked HF path with the same thresholds, on tiny Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k
norms) models, both backends (the kernels under the Triton interpreter, fp32).

The HF hooks apply the thresholds to every token, prompt tokens included, and the engine only to
decode steps; so the reference prefills with the thresholds off (``wide_fine.enabled = False``:
dense for fine, routed for hybrid) and decodes on its KV cache with them on."""
import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import AlwaysLibrary, tiny_model, write_tiny_run  # noqa: E402

import wide  # noqa: E402
from wide.method import fine as wf  # noqa: E402
from wide.evaluation.evaluate import cache_kwargs  # noqa: E402
from wide.engine.inference import AcceleratedModel  # noqa: E402
from wide.method.modeling import batch_shared_decode  # noqa: E402

# head_dim 64 (the attention kernels take 64 or 128), 4 query / 2 KV heads, FFN 128 = 4 x 32.
TINY = dict(hidden_size=64, head_dim=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)


def ids_of(b, t, seed=3):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


def model_with_thresholds(model_type="llama", seed=0, routers=True, criterion="magnitude", shares=None, **router_cfg):
    """A tiny model with routers at 50 % (or none: sparse_target "none") and thresholds that drop
    a different share of each projection's input in each layer (TEAL greedy-like: q, k and v
    keep different elements of one input), calibrated on the dense activations."""
    model = tiny_model(model_type, seed=seed, **TINY)
    cfg = dict(ffn_group_size=32, router_init="random", **router_cfg) if routers else dict(sparse_target="none")
    model = wide.wrap(model, wide.WideConfig(**cfg), seed=seed)
    calib = ids_of(2, 24, seed=seed + 1)
    if routers:
        wide.calibrate_offsets(model, [calib], target=0.5, mode="per_module", rounds=1)
    wf.attach(model, wf.FineConfig(criterion=criterion))
    model.wide_state.mask_fn = lambda *a: None  # the dense model's scores: skipped groups' zeros would set 0
    try:
        scores = wf.collect_scores(model, [calib])
    finally:
        model.wide_state.mask_fn = None
    if shares is None:
        g = torch.Generator().manual_seed(seed)
        shares = 0.3 + 0.4 * torch.rand(model.wide_fine.log_threshold.shape, generator=g)
    wf.set_thresholds(model, scores, shares)
    return model


class thresholds_at_decode:
    """The HF reference's settings: routers off in fine mode, thresholds off until entered."""

    def __init__(self, model, mode):
        self.model, self.mode = model, mode

    def __enter__(self):
        self.model.wide_fine.enabled = False
        if self.mode == "fine":
            self.model.wide_state.mask_fn = lambda *a: None  # fine ignores the routers
        return self

    def decode(self):
        self.model.wide_fine.enabled = True

    def __exit__(self, *exc):
        self.model.wide_fine.enabled = True
        self.model.wide_state.mask_fn = None
        return False


@torch.no_grad()
def hf_steps(model, ids, start, mode):
    """[(t, logits [B, V])] of the HF path decoding ids[:, t] for t >= start after a prefill of
    ids[:, :start] (dense for fine, routed for hybrid), the thresholds on at decode."""
    out_steps = []
    with thresholds_at_decode(model, mode) as ref:
        out = model(input_ids=ids[:, :start], use_cache=True)
        ref.decode()
        for t in range(start, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(model, out))
            out_steps.append((t, out.logits[:, -1].clone()))
    return out_steps


@torch.no_grad()
def hf_greedy(model, prompt, n, mode):
    toks = []
    with thresholds_at_decode(model, mode) as ref:
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        ref.decode()
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, **cache_kwargs(model, out))
    return toks


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_decode(model, eng, mode, batches=(2,), start=9, end=12):
    ids = ids_of(max(batches), end, seed=21)
    for B in batches:
        eng.setup_cache(B, 32)
        eng.prefill(ids[:B, :start])
        for t, ref in hf_steps(model, ids[:B, :end], start, mode):
            got = eng.decode(ids[:B, t], torch.full((B,), t, dtype=torch.long))
            assert rel(got, ref) < 1e-5, (mode, B, t)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", ["fine", "hybrid"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_decode_matches_masked_path(model_type, mode, backend):
    # Fine mode runs on a model with routers too: it must ignore them.
    model = model_with_thresholds(model_type, seed=5)
    eng = wide.accelerate(model, backend=backend, mode=mode)
    assert (eng.backend, eng.mode, eng.routing) == (backend, mode, "token" if mode == "hybrid" else None)
    assert not model.wide_fine.log_threshold.isinf().any()  # every projection drops elements
    check_decode(model, eng, mode)  # batch 2; batch 1 below
    prompt = ids_of(1, 7, seed=8)[0].tolist()
    assert eng.generate([prompt], max_new_tokens=4).tokens == [hf_greedy(model, prompt, 4, mode)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rule", ["tile4", "batch_shared"])
def test_hybrid_keeps_the_routing_rule(rule, backend):
    # Tile-coherent routers and batch-shared decode give hybrid decode their group masks as they
    # give coarse decode (the batch-shared set is one row for every sequence: a stride-0 mask).
    model = model_with_thresholds(seed=13, **(dict(route_tile=4) if rule == "tile4" else {}))
    eng = wide.accelerate(model, backend=backend, mode="hybrid", batch_shared=rule == "batch_shared")
    assert eng.routing == rule
    with batch_shared_decode(model) if rule == "batch_shared" else contextlib.nullcontext():
        check_decode(model, eng, "hybrid", start=10, end=13)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_thresholds_alone_no_routers(backend):
    # The TEAL-only checkpoint: wrapped with sparse_target "none"; fine, and hybrid (no groups to skip).
    model = model_with_thresholds(seed=6, routers=False)
    for mode in ("fine", "hybrid"):
        check_decode(model, wide.accelerate(model, backend=backend, mode=mode), mode, batches=(2,))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_wina_scales_split_the_fused_launches(backend):
    # WINA scores q, k and v (and gate, up) with their own column norms: one launch each, into one output.
    model = model_with_thresholds(seed=7, criterion="wina")
    eng = wide.accelerate(model, backend=backend, mode="hybrid")
    f = eng.layers[0].fine
    assert not f.qkv_one_scale and not f.gu_one_scale
    check_decode(model, eng, "hybrid", batches=(2,))
    check_decode(model, wide.accelerate(model, backend=backend, mode="fine"), "fine", batches=(1,))


@pytest.mark.parametrize("mode", ["fine", "hybrid"])
def test_batches_above_the_gemv_limit_run_gemms_on_thresholded_inputs(mode):
    # The GEMVs take up to 4 tokens; 5 sequences run the routed kernels (hybrid) or cuBLAS (fine)
    # on the thresholded inputs: the same values.
    model = model_with_thresholds(seed=9)
    check_decode(model, wide.accelerate(model, backend="triton", mode=mode), mode, batches=(5,), end=12)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_thresholds_that_keep_everything_reproduce_coarse_and_dense(backend):
    model = model_with_thresholds(seed=10, shares=torch.zeros(2, 7))
    assert model.wide_fine.log_threshold.isinf().all()
    ids = ids_of(2, 14, seed=4)
    coarse, hybrid = (wide.accelerate(model, backend=backend, mode=m) for m in ("coarse", "hybrid"))
    dense, fine = (AcceleratedModel(model, backend=backend, mode=m) for m in ("dense", "fine"))
    for a, b in ((coarse, hybrid), (dense, fine)):
        for e in (a, b):
            e.setup_cache(2, 32)
            e.prefill(ids[:, :9])
        for t in range(9, 12):
            pos = torch.full((2,), t, dtype=torch.long)
            want, got = a.decode(ids[:, t], pos), b.decode(ids[:, t], pos)
            if backend == "torch" and a is coarse:
                assert torch.equal(got, want), t  # the same matmuls on the same inputs
            else:
                assert rel(got, want) < 1e-5, (a.mode, t)
        prompt = ids[0, :6].tolist()
        assert b.generate([prompt], max_new_tokens=3).tokens == a.generate([prompt], max_new_tokens=3).tokens


def test_modes_named_and_refused():
    routed_only = tiny_model("llama", seed=1, **TINY)
    routed_only = wide.wrap(routed_only, wide.WideConfig(ffn_group_size=32, router_init="random"))
    for mode in ("fine", "hybrid"):
        with pytest.raises(ValueError, match="no per-element thresholds.*wide calibrate --hybrid.*coarse"):
            wide.accelerate(routed_only, backend="torch", mode=mode)
    for name in ("coarse", "routed"):
        eng = wide.accelerate(routed_only, backend="torch", mode=name)
        assert (eng.mode, eng.mode_name, eng.decode_ops is eng.ops) == ("routed", "coarse", True)
    with pytest.raises(ValueError, match="mode must be one of auto, coarse, fine, hybrid, dense .*got 'teal'"):
        wide.accelerate(routed_only, mode="teal")
    model = model_with_thresholds(seed=2)
    with pytest.raises(ValueError, match="routed-engine option"):
        wide.accelerate(model, backend="torch", mode="fine", batch_shared=True)
    assert wide.accelerate(model, backend="torch", mode="hybrid", batch_shared=True).routing == "batch_shared"


# attention-only routers under skip_upto, layer 0 dense: the e2e benchmark's --heads sets (issue 48)
HEADS = dict(sparse_target="attention", attn_rule="skip_upto", attn_skip=1, attn_dense_layers=[0])


def model_carrying(what: str):
    """A tiny model with what ``what`` names: routers and/or thresholds, head routers, or neither."""
    if what in ("thresholds", "both", "heads"):
        return model_with_thresholds(seed=14, routers=what != "thresholds", **(HEADS if what == "heads" else {}))
    model = tiny_model("llama", seed=14, **TINY)
    if what == "neither":
        return model
    cfg = dict(ffn_group_size=32, router_init="random", **(HEADS if what == "heads_alone" else {}))
    return wide.wrap(model, wide.WideConfig(**cfg), seed=14)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("what, mode", [("thresholds", "fine"), ("both", "hybrid"), ("heads", "hybrid"),
                                        ("routers", "coarse"), ("heads_alone", "coarse"), ("neither", "dense")])
def test_auto_runs_what_the_model_carries(what, mode, backend, caplog):
    # mode="auto" (issue 48): the one mode that serves any set, chosen once at construction,
    # giving the tokens of the engine asked for that mode by name
    model = model_carrying(what)
    with caplog.at_level("INFO", logger="wide.engine.inference"):
        auto = wide.accelerate(model, backend=backend, mode="auto")
    assert (auto.requested_mode, auto.mode_name, auto.backend) == ("auto", mode, backend)
    assert f"mode auto: {mode}" in caplog.text
    named = wide.accelerate(model, backend=backend, mode=mode)
    assert (named.mode, named.routing) == (auto.mode, auto.routing)
    prompts = [ids_of(1, 7, seed=8)[0].tolist(), ids_of(1, 5, seed=9)[0].tolist()]
    assert auto.generate(prompts, max_new_tokens=4).tokens == named.generate(prompts, max_new_tokens=4).tokens


def test_threshold_changes_reach_the_engine_in_place():
    # The kernels read the thresholds from one device tensor (what a captured graph replays),
    # which setup_cache (and so generate) refreshes from model.wide_fine.
    model = model_with_thresholds(seed=3)
    eng = wide.accelerate(model, backend="triton", mode="hybrid")
    th = eng.fine.th
    with torch.no_grad():
        model.wide_fine.log_threshold += 0.3
    check_decode(model, eng, "hybrid", batches=(1,), end=11)
    assert eng.fine.th is th and torch.equal(th, model.wide_fine.log_threshold.exp())


def test_transposed_weights_are_laid_out_once_per_model():
    model = model_with_thresholds(seed=4)
    a = wide.accelerate(model, backend="triton", mode="fine")
    b = wide.accelerate(model, backend="triton", mode="hybrid")
    for x, y in zip(a.layers, b.layers):
        assert x.fine.wqkv_t is y.fine.wqkv_t and x.fine.wd_t is y.fine.wd_t
    w = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(a.layers[0].fine.wd_t, w.t())
    assert wide.accelerate(model, backend="torch", mode="fine").layers[0].fine.wd_t is None  # torch: no copy
    # a head-router set (FFN unrouted: hybrid keeps gate|up in the layout alone) after a fine engine
    heads = model_carrying("heads")
    a = wide.accelerate(heads, backend="triton", mode="fine")
    b = wide.accelerate(heads, backend="triton", mode="hybrid")
    for x, y in zip(a.layers, b.layers):
        assert x.fine.wgu_t is y.fine.wgu_t and x.fine.wqkv_t is y.fine.wqkv_t


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_recorded_decode_step_gives_each_projections_read_share(backend):
    model = model_with_thresholds(seed=12)
    ids = ids_of(2, 10)
    for mode in ("fine", "hybrid"):
        eng = wide.accelerate(model, backend=backend, mode=mode)
        eng.setup_cache(2, 32)
        eng.prefill(ids[:, :9])
        record = []
        eng.decode(ids[:, 9], torch.full((2,), 9, dtype=torch.long), record=record)
        shares = {(i, p): s for i, p, s in record if p in wf.INPUTS}
        assert set(shares) == {(i, p) for i in range(2) for p in wf.INPUTS}
        for s in shares.values():  # union over the batch >= one token's share; both below 1 at 30-70 %
            assert 0 < float(s[1]) <= float(s[0]) < 1
        kinds = {k for _, k, m in record if k in ("attn", "ffn") and m is not None}
        assert kinds == (set() if mode == "fine" else {"attn", "ffn"})


def test_cli_generate_modes(tmp_path, capsys):
    from wide.cli import main

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wide.training.recovery import load_recovered

    opts = write_tiny_run(tmp_path)
    common = opts[:2]

    base = AutoModelForCausalLM.from_pretrained(opts[1], dtype=torch.float32)
    plain = wide.wrap(base, wide.WideConfig(router_init="random", ffn_group_size=32))
    calib = ids_of(2, 24, seed=1) % 20
    wide.calibrate_offsets(plain, [calib], target=0.5, mode="per_module", rounds=1)
    wide.save_routers(plain, tmp_path / "coarse")
    wf.attach(plain, wf.FineConfig(target=0.5))
    wf.calibrate(plain, [calib], progress=False)
    wide.save_routers(plain, tmp_path / "hybrid")
    for name, cfg in (("fine", dict(sparse_target="none")), ("heads", dict(ffn_group_size=32, **HEADS))):
        other = wide.wrap(AutoModelForCausalLM.from_pretrained(opts[1], dtype=torch.float32), wide.WideConfig(**cfg))
        wf.attach(other, wf.FineConfig(target=0.5))
        wf.calibrate(other, [calib], progress=False)
        wide.save_routers(other, tmp_path / name)

    def generate(*extra):
        assert main(["generate", *common, "--prompt", "the cat sat", "--max-new-tokens", "5", *extra]) == 0
        out, err = capsys.readouterr()
        return out.split("--- ")[1].splitlines()[1], out, err

    text, out, err = generate("--routers", str(tmp_path / "hybrid"), "--mode", "hybrid")
    assert "[hybrid, backend torch]" in out
    assert "the Triton kernels need a CUDA GPU" in err and "PyTorch path" in err
    # the same greedy tokens as the library's engine on the same checkpoint
    tok = AutoTokenizer.from_pretrained(opts[1])
    again = load_recovered(AutoModelForCausalLM.from_pretrained(opts[1], dtype=torch.float32), tmp_path / "hybrid")
    res = wide.accelerate(again, backend="torch", mode="hybrid").generate([tok.encode("the cat sat")], max_new_tokens=5)
    assert text == tok.decode(res.tokens[0], skip_special_tokens=True)
    assert "[fine, backend torch]" in generate("--routers", str(tmp_path / "hybrid"), "--mode", "fine")[1]
    assert "[coarse, backend torch]" in generate("--routers", str(tmp_path / "hybrid"), "--mode", "coarse")[1]
    assert "[dense, backend torch]" in generate("--routers", str(tmp_path / "hybrid"), "--mode", "dense")[1]
    assert "[dense, backend torch]" in generate("--mode", "coarse")[1]  # no routers: the dense engine, as before
    # --mode auto, the default: the mode that runs what the set carries, named in the result line
    auto_text, out, _ = generate("--routers", str(tmp_path / "hybrid"))
    assert "[auto -> hybrid, backend torch]" in out and auto_text == text
    assert "[auto -> coarse, backend torch]" in generate("--routers", str(tmp_path / "coarse"))[1]
    assert "[auto -> dense, backend torch]" in generate()[1]
    assert "[auto -> fine, backend torch]" in generate("--routers", str(tmp_path / "fine"))[1]
    assert "[auto -> hybrid, skip_upto1, backend torch]" in generate("--routers", str(tmp_path / "heads"))[1]
    for argv in (["--routers", str(tmp_path / "coarse"), "--mode", "hybrid"], ["--mode", "fine"]):
        assert main(["generate", *common, "--prompt", "a", *argv]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        # refused before the model loads (issue 49, defects 2 and 5): what the mode needs, and where to get it
        assert len(errors) == 1 and "decodes with per-element thresholds" in errors[0] \
            and "smollm2-135m-fine-50" in errors[0]


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_engines_keep_one_copy_of_the_weights():
    # fine on the kernels: the model's projection weights become views of the GEMVs' transposed
    # layout (same values), which its prefill and dense steps run on; dense: views of its fused
    # q|k|v and gate|up weights. A routed engine built later still gets row-major weights.
    model = model_with_thresholds(seed=5)
    layer = model.model.layers[0]
    before = {n: p.detach().clone() for n, p in layer.named_parameters() if n.endswith("proj.weight")}
    fine = wide.accelerate(model, backend="triton", mode="fine")
    f = fine.layers[0].fine
    for name, lay in (("self_attn.q_proj", f.wqkv_t), ("self_attn.v_proj", f.wqkv_t), ("self_attn.o_proj", f.wo_t),
                      ("mlp.up_proj", f.wgu_t), ("mlp.down_proj", f.wd_t)):
        w = layer.get_submodule(name).weight
        assert _storage(w) == _storage(lay), name
        assert torch.equal(w, before[name + ".weight"]), name
    assert _storage(fine.layers[0].wqkv) == _storage(f.wqkv_t)
    dense = AcceleratedModel(model, backend="triton", mode="dense")
    assert _storage(layer.self_attn.k_proj.weight) == _storage(dense.layers[0].wqkv)
    assert _storage(layer.mlp.gate_proj.weight) == _storage(dense.layers[0].wgu)
    coarse = wide.accelerate(model, backend="triton", mode="coarse")
    assert all(t.is_contiguous() for t in (coarse.layers[0].wq, coarse.layers[0].wo, coarse.layers[0].wd))
    for n, p in layer.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n
    check_decode(model, fine, "fine", batches=(1,), end=11)


def test_hybrid_with_attention_routers_keeps_one_copy_of_the_ffn():
    # head routers beside thresholds (issue 48): the FFN is not routed, so its weights live in the
    # GEMVs' transposed layout alone (the prefill's dense GEMMs run on views of it); the routed
    # attention keeps its row-major weights. With FFN routers both layouts stay.
    model = model_carrying("heads")
    layer = model.model.layers[1]
    before = {n: p.detach().clone() for n, p in layer.named_parameters() if n.endswith("proj.weight")}
    q_storage = _storage(layer.self_attn.q_proj.weight)
    eng = wide.accelerate(model, backend="triton", mode="hybrid")
    f, L = eng.layers[1].fine, eng.layers[1]
    for name, lay in (("mlp.gate_proj", f.wgu_t), ("mlp.up_proj", f.wgu_t), ("mlp.down_proj", f.wd_t)):
        assert _storage(layer.get_submodule(name).weight) == _storage(lay), name
    assert _storage(L.wg) == _storage(L.wu) == _storage(f.wgu_t) and _storage(L.wd) == _storage(f.wd_t)
    assert _storage(L.wkv) == _storage(f.wqkv_t)  # k|v: no concatenated copy either
    # gate|up as one GEMM and q|k|v as one where cuBLAS is chosen: views of the same layout
    assert _storage(L.wgu) == _storage(f.wgu_t) and _storage(L.wqkv_cublas) == _storage(f.wqkv_t)
    assert _storage(layer.self_attn.q_proj.weight) == q_storage != _storage(f.wqkv_t)
    for n, p in layer.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n
    check_decode(model, eng, "hybrid", batches=(2,), end=11)
    routed = model_with_thresholds(seed=15)  # FFN routers too
    eng = wide.accelerate(routed, backend="triton", mode="hybrid")
    assert _storage(routed.model.layers[0].mlp.up_proj.weight) != _storage(eng.layers[0].fine.wgu_t)


def test_unrouted_ffn_runs_one_gate_up_gemm_on_one_copy():
    # Head routers alone (coarse): gate|up as one weight the model's gate/up become views of (one
    # GEMM and the fused silu_mul, as the dense engine runs them); with FFN routers, no such copy.
    model = model_carrying("heads_alone")
    layer = model.model.layers[1]
    before = layer.mlp.gate_proj.weight.detach().clone()
    eng = wide.accelerate(model, backend="triton", mode="coarse")
    L = eng.layers[1]
    assert _storage(layer.mlp.gate_proj.weight) == _storage(layer.mlp.up_proj.weight) == _storage(L.wgu)
    assert torch.equal(layer.mlp.gate_proj.weight, before)
    ids = ids_of(2, 12, seed=4)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    eng.setup_cache(2, 32)
    assert rel(eng.prefill(ids[:, :9]), ref[:, 8]) < 1e-5
    for t in range(9, 12):
        assert rel(eng.decode(ids[:, t], torch.full((2,), t, dtype=torch.long)), ref[:, t]) < 1e-5, t
    assert wide.accelerate(model_carrying("routers"), backend="triton", mode="coarse").layers[1].wgu is None


@pytest.mark.parametrize("qkv", ["cublas", "whole"])
def test_hybrid_heads_on_library_paths_match_the_routed_kernels(qkv, monkeypatch):
    # Where the engine measures the library faster (forced here: q|k|v as two GEMMs or one on the
    # GEMVs' transposed layout, prefill attention in SDPA with the skipped heads zeroed), a
    # head-router set's hybrid engine gives the routed kernels' values, prefill and decode with
    # the routers alone (fine_max_batch=0).
    import wide.engine.ops

    model = model_carrying("heads")
    ids = ids_of(2, 12, seed=6)
    kernels = wide.accelerate(model, backend="triton", mode="hybrid", fine_max_batch=0)
    library = wide.accelerate(model, backend="triton", mode="hybrid", fine_max_batch=0)
    outs = {}
    for name, eng, choices in (("kernels", kernels, {}), ("library", library, AlwaysLibrary(qkv))):
        monkeypatch.setattr(wide.engine.ops, "K_CHOICES", choices)
        eng.setup_cache(2, 32)
        outs[name] = [eng.prefill(ids[:, :9])]
        for t in range(9, 12):
            outs[name].append(eng.decode(ids[:, t], torch.full((2,), t, dtype=torch.long)))
    for t, (a, b) in enumerate(zip(outs["kernels"], outs["library"])):
        assert rel(a, b) < 1e-5, t


def test_fine_max_batch_decodes_dense_above_it():
    model = model_with_thresholds(seed=6)
    ids = ids_of(2, 12, seed=8)
    dense = AcceleratedModel(model, backend="triton", mode="dense")
    eng = wide.accelerate(model, backend="triton", mode="fine", fine_max_batch=1)
    assert (eng.decode_path(1), eng.decode_path(2), dense.decode_path(2)) == ("fine", "dense", "main")
    assert wide.accelerate(model, backend="triton", mode="fine").decode_path(8) == "fine"  # off CUDA: never measured
    for e in (dense, eng):
        e.setup_cache(2, 32)
        e.prefill(ids[:, :9])
    for t in range(9, 12):
        pos = torch.full((2,), t, dtype=torch.long)
        assert rel(eng.decode(ids[:, t], pos), dense.decode(ids[:, t], pos)) < 1e-5, t
    check_decode(model, eng, "fine", batches=(1,), end=11)  # batch 1: the thresholds
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="fine_max_batch"):
            wide.accelerate(model, backend="torch", mode="fine", fine_max_batch=bad)
    with pytest.raises(ValueError, match="fine_max_batch"):
        wide.accelerate(model, backend="torch", mode="coarse", fine_max_batch=2)


def test_hybrid_decodes_with_the_routers_alone_above_fine_max_batch():
    # Above the limit a hybrid batch runs its prefill ops, the routers without the thresholds:
    # the coarse engine's step (a batch's kept inputs cover about every weight row, while its
    # skipped head groups still skip their K/V reads); at or under it, the thresholds too.
    model = model_with_thresholds(seed=7)
    ids = ids_of(2, 12, seed=9)
    coarse = wide.accelerate(model, backend="triton", mode="coarse")
    eng = wide.accelerate(model, backend="triton", mode="hybrid", fine_max_batch=1)
    assert (eng.decode_path(1), eng.decode_path(2), coarse.decode_path(2)) == ("fine", "routed", "main")
    assert wide.accelerate(model, backend="triton", mode="hybrid").decode_path(8) == "fine"  # off CUDA: never measured
    assert wide.accelerate(model, backend="torch", mode="hybrid", fine_max_batch=1).decode_path(2) == "fine"
    for e in (coarse, eng):
        e.setup_cache(2, 32)
        e.prefill(ids[:, :9])
    for t in range(9, 12):
        pos = torch.full((2,), t, dtype=torch.long)
        rec_c, rec_h = [], []
        assert rel(eng.decode(ids[:, t], pos, record=rec_h), coarse.decode(ids[:, t], pos, record=rec_c)) < 1e-5, t
        assert all(torch.equal(a[2], b[2]) for a, b in zip(rec_h, rec_c) if a[2] is not None), t  # same group masks
    check_decode(model, eng, "hybrid", batches=(1,), end=11)  # batch 1: the thresholds


# ---------------------------------------------------------------- fp32 sums (fine_sums)
def _launches(monkeypatch):
    """Records, per fine_gemv launch of the engine, whether it added into sums (acc_out) or
    cleared a buffer (clear), and which buffer."""
    from wide.engine import fine_engine

    calls = []
    real = fine_engine.fine_gemv

    def spy(*a, **kw):
        calls.append((kw.get("acc_out"), kw.get("clear")))
        return real(*a, **kw)

    monkeypatch.setattr(fine_engine, "fine_gemv", spy)
    return calls


def _which(t, ops, B):
    """The engine buffer whose rows [:B] ``t`` is (its name), or None."""
    if t is None:
        return None
    for name in ("o_sum", "down_sum", "qkv_sum", "gu_sum"):
        buf = getattr(ops, name)
        if t.data_ptr() == buf.data_ptr() and tuple(t.shape) == (B, buf.shape[1]):
            return name
    return "another"


def _sums_steps(fp32, rounded, ref, ids, batches, calls):
    """Decode steps 9 and 10 of each batch size in ``batches`` on the engine with fp32 sums, the
    rounding one and the PyTorch path, asserting the first equal to the second (the interpreter
    adds the sums in one order) and close to the third; yields ``(B, t, launches)``, the
    fine_gemv launches (``calls``, from :func:`_launches`) of the fp32 engine's step."""
    for B in batches:
        for e in (fp32, rounded, ref):
            e.setup_cache(B, 32)
            e.prefill(ids[:B, :9])
        for t in range(9, 11):
            pos = torch.full((B,), t, dtype=torch.long)
            calls.clear()
            got = fp32.decode(ids[:B, t], pos)
            launches = list(calls)
            want, slow = rounded.decode(ids[:B, t], pos), ref.decode(ids[:B, t], pos)
            assert torch.equal(got, want), (B, t)
            assert rel(got, slow) < 1e-5, (B, t)
            yield B, t, launches


@pytest.mark.parametrize("criterion", ["magnitude", "wina"])
def test_fp32_sums_match_the_rounded_path_and_torch(criterion, monkeypatch):
    # o and down add into fp32 sums that the next norm (and the final norm) rounds and reads,
    # q|k|v into sums that the RoPE launch rounds, reads and clears, gate|up into sums that down
    # reads silu(gate) * up from (cleared by the next o): the same logits as GEMVs
    # that round their own outputs and as the PyTorch path, over batch sizes that change
    # between steps (rows a larger batch left in the down sums are cleared before the next step
    # adds). WINA: q, k, v (and gate, up) in launches of their own that round (no contiguous
    # sums), the down sums cleared by the first of them only.
    model = model_with_thresholds(seed=5, routers=False, criterion=criterion)
    ids = ids_of(4, 13, seed=21)
    fp32, rounded = (wide.accelerate(model, backend="triton", mode="fine", fine_sums=v) for v in ("fp32", "rounded"))
    ref = wide.accelerate(model, backend="torch", mode="fine")
    assert (fp32.fine_sums, rounded.fine_sums) == ("fp32", "rounded")
    ops = fp32.decode_ops
    H, L = model.config.hidden_size, len(fp32.layers)
    calls = _launches(monkeypatch)
    for B, t, launches in _sums_steps(fp32, rounded, ref, ids, (2, 4, 1, 4), calls):
        # between steps: o and q|k|v sums zero, down sums the last layer's (read by the final norm)
        assert torch.all(ops.o_sum == 0) and torch.all(ops.qkv_sum == 0)
        assert bool(ops.down_sum[:B].abs().sum() > 0)
        if criterion == "magnitude":  # q|k|v, o, gate|up, down (reading the gate|up sums)
            layer = [("qkv_sum", "down_sum"), ("o_sum", "gu_sum"), ("gu_sum", "o_sum"), ("down_sum", None)]
            # the last layer's gate|up sums stay until the next step's first o GEMV clears them
            assert bool(ops.gu_sum[:B].abs().sum() > 0)
        else:  # q, k, v, o, gate, up, down
            layer = [(None, "down_sum"), (None, None), (None, None), ("o_sum", "gu_sum"), (None, "o_sum"),
                     (None, None), ("down_sum", None)]
            assert torch.all(ops.gu_sum == 0)
        assert [(_which(a, ops, B), _which(c, ops, B)) for a, c in launches] == layer * L
        assert not any(a is not None or c is not None for a, c in calls[len(launches):])  # rounded: none
    prompt = ids_of(1, 7, seed=8)[0].tolist()
    assert fp32.generate([prompt], max_new_tokens=5).tokens == rounded.generate([prompt], max_new_tokens=5).tokens \
        == ref.generate([prompt], max_new_tokens=5).tokens
    # two [MAX_T, H] fp32 buffers per engine, whatever the model's depth
    from wide.kernels.fine_gemv import MAX_T
    assert ops.o_sum.shape == ops.down_sum.shape == (MAX_T, H) and ops.o_sum.dtype == torch.float32
    assert ops.o_sum.untyped_storage().nbytes() + ops.down_sum.untyped_storage().nbytes() == 2 * MAX_T * H * 4
    c = model.config
    assert ops.qkv_sum.shape == (MAX_T, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fp32_sums_in_half_precision(model_type):
    # fp16 (bf16's rounding, on the interpreter): the norms and the RoPE launch round the fp32
    # sums to fp16 before the residual add / the q|k|v bias (Qwen2) and q/k norms (Qwen3), which
    # is what the GEMVs' epilogues did: the same bits.
    model = model_with_thresholds(model_type, seed=6, routers=False).half()
    ids = ids_of(2, 12, seed=22)
    fp32, rounded = (wide.accelerate(model, backend="triton", mode="fine", fine_sums=v) for v in ("fp32", "rounded"))
    for e in (fp32, rounded):
        e.setup_cache(2, 32)
        e.prefill(ids[:, :9])
    for t in range(9, 12):
        pos = torch.full((2,), t, dtype=torch.long)
        got, want = fp32.decode(ids[:, t], pos), rounded.decode(ids[:, t], pos)
        assert torch.equal(got, want), t
        ops = fp32.decode_ops
        assert bool(ops.down_sum[:2].abs().sum() > 0) and torch.all(ops.o_sum == 0) and torch.all(ops.qkv_sum == 0)


@pytest.mark.parametrize("what", ["both", "heads"])
def test_hybrid_fp32_sums_match_the_rounded_path_and_torch(what, monkeypatch):
    # hybrid (routers' group masks beside the thresholds; issue 48's head routers too) adds into
    # the same fp32 sums as fine: o with the attention mask, down with the FFN mask (its gate|up
    # rounds where FFN groups are routed, and adds into sums where only attention is)
    model = model_carrying(what)
    ids = ids_of(3, 12, seed=24)
    fp32, rounded = (wide.accelerate(model, backend="triton", mode="hybrid", fine_sums=v, fine_max_batch=4)
                     for v in ("fp32", "rounded"))
    ref = wide.accelerate(model, backend="torch", mode="hybrid")
    calls = _launches(monkeypatch)
    for B, t, launches in _sums_steps(fp32, rounded, ref, ids, (2, 3, 1), calls):
        sums = {_which(a, fp32.decode_ops, B) for a, _ in launches} - {None}
        assert sums == ({"qkv_sum", "o_sum", "down_sum"} | ({"gu_sum"} if what == "heads" else set())), sums


def test_fp32_sums_off_under_deterministic_algorithms_and_above_the_gemv_limit(monkeypatch):
    # The atomic adds into the sums have no fixed order: deterministic mode keeps the ordered
    # GEMVs that round their own outputs. Batches above MAX_T run GEMMs, with no sums either.
    model = model_with_thresholds(seed=7, routers=False)
    ids = ids_of(5, 12, seed=23)
    eng = wide.accelerate(model, backend="triton", mode="fine")
    ref = wide.accelerate(model, backend="torch", mode="fine")
    calls = _launches(monkeypatch)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for e in (eng, ref):
            e.setup_cache(2, 32)
            e.prefill(ids[:2, :9])
        pos = torch.full((2,), 9, dtype=torch.long)
        assert rel(eng.decode(ids[:2, 9], pos), ref.decode(ids[:2, 9], pos)) < 1e-5
        assert calls and not any(a is not None or c is not None for a, c in calls)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.all(t == 0) for t in (eng.decode_ops.o_sum, eng.decode_ops.down_sum, eng.decode_ops.qkv_sum))
    calls.clear()
    check_decode(model, eng, "fine", batches=(5,), start=9, end=11)
    assert not any(a is not None or c is not None for a, c in calls)


def test_fine_sums_refused_values():
    model = model_with_thresholds(seed=2, routers=False)
    for bad in ("bf16", None, True):
        with pytest.raises(ValueError, match="fine_sums must be one of"):
            wide.accelerate(model, backend="triton", mode="fine", fine_sums=bad)
