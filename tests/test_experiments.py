"""The trials in experiments/ (measured, not kept in the library) carry their own copies of
kernels: checked here against the fp32 references on tiny shapes under the interpreter, so the
comparisons recorded in experiments/results stay reproducible from the scripts."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the scripts import triton (the library: see needs_interpreted_library)

import pathlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from wide.kernels import RouterPartials, gemm_k_reference, gemm_mn_reference  # noqa: E402
from wide.kernels.routing import split_tickets  # noqa: E402
from conftest import load_script  # noqa: E402

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the scripts' CPU mode; on a GPU run the scripts themselves")

def _library_kernels_interpreted() -> bool:
    """The setdefault above comes too late for the library: tests/conftest.py imports wide (and
    with it wide.kernels, whose @triton.jit functions read TRITON_INTERPRET when they are
    decorated) before this module. Run without TRITON_INTERPRET=1 in the environment, the
    library's jit helpers are then compiled-mode functions while the scripts' kernels, decorated
    later, are interpreted, and an interpreted kernel calling a library helper fails with
    "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    from triton.runtime.interpreter import InterpretedFunction

    from wide.kernels.gemm_mn import _router_decision

    return isinstance(_router_decision, InterpretedFunction)

# the trials' kernels that call the library's jit helpers (the router decision, ffn_up, gemm_k)
needs_interpreted_library = pytest.mark.skipif(
    not _library_kernels_interpreted(),
    reason="wide.kernels was imported before TRITON_INTERPRET=1 was set (tests/conftest.py imports wide): "
           "set TRITON_INTERPRET=1 in the environment, as scripts/test.sh does")

def _script(name):
    return load_script(f"experiments/{name}.py")

def _rel(y, ref):
    assert not torch.isnan(y).any(), "NaN in output"
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()

def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale

def test_prefill_sweep_variants_match_reference():
    # TMA-descriptor weight tiles, and the library kernel at tiles its autotuner does not try
    assert _script("prefill_gemm_sweep").main(["--check-only"]) == 0

@needs_interpreted_library
@pytest.mark.parametrize("masks", ["random", "all", "none", "router"])
def test_ffn_decode_trial_matches_reference(masks):
    # the one-kernel batch-1 FFN, with a given mask and with the router writing it
    mod = _script("ffn_decode_ab")
    gen = torch.Generator().manual_seed(3)
    K, G, ng, N = 80, 32, 4, 33
    x = _randn(gen, 1, K)
    wg, wu = (_randn(gen, G * ng, K, scale=K ** -0.5) for _ in range(2))
    wd = _randn(gen, N, G * ng, scale=(G * ng) ** -0.5)
    router = None
    if masks == "router":
        router = RouterPartials(_randn(gen, 3, 16), torch.zeros(16), _randn(gen, 2 * ng, 16),
                                torch.zeros(2 * ng), torch.zeros(()))
        mask = torch.zeros(1, ng, dtype=torch.bool)
    else:
        mask = {"random": torch.tensor([[True, False, False, True]]),
                "all": torch.ones(1, ng, dtype=torch.bool),
                "none": torch.zeros(1, ng, dtype=torch.bool)}[masks]
    y = mod.ffn_decode(x, wg, wu, wd, mask, G, router=router)
    ref = mod.ffn_decode_reference(x, wg, wu, wd, mask, G)  # the mask the router wrote
    if masks == "none":
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert _rel(y, ref) < 1e-5
    if masks == "router":
        assert 0 < int(mask.sum()) < ng  # both branches ran

@needs_interpreted_library
@pytest.mark.parametrize("flat,bk,split", [(0, 32, 1), (1, 32, 2), (2, 128, 1), (2, 64, 2), (2, 256, 1)])
def test_decode_gemv_sweep_variants_match_reference(flat, bk, split):
    # the CUDA-core GEMVs, incl. the --wide steps that span several groups (per-column
    # predication, FLAT=2) and whole rows
    mod = _script("decode_gemv_sweep")
    gen = torch.Generator().manual_seed(5 + flat)
    N, K, GS, ng = 16, 256, 32, 8
    x, w = _randn(gen, 1, K), _randn(gen, N, K, scale=K ** -0.5)
    mask = torch.rand(1, ng, generator=gen) < 0.5
    mask[0, 0], mask[0, 1] = True, False
    y = torch.empty(1, N)
    wsp = torch.empty(split, N)
    tick = split_tickets(torch.device("cpu"), N)
    mod._cc_k[(N // 4, split)](x, w, y, mask.view(torch.uint8), wsp, tick, N, K, ng, GS, BN=4, BK=bk,
                               NG_PAD=16, SPLIT=split > 1, FLAT=flat, STAGES=1, num_warps=4)
    assert _rel(y, gemm_k_reference(x, w, mask, GS)) < 1e-5
    mn_mask = torch.tensor([[True, False]])  # two 8-row groups, one active
    kc = K // split
    mod._cc_mn[(N // 4, split)](x, w, y, mn_mask.view(torch.uint8), wsp, tick, N, K, 8, 2, kc,
                                BN=4, BK=min(bk, kc), SPLIT=split > 1, STAGES=1, num_warps=4)
    assert _rel(y, gemm_mn_reference(x, w, mn_mask, 8)) < 1e-5

def test_tile_source_trial_is_causal_and_tile_coherent():
    """The tile-source trial's routers read, for every token of tile k, the mean of tile k-1's
    inputs (tile 0: its first token): the same within a tile, and never a later token's input."""
    src = _script("tile_source_cpu").previous_tile_source
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, 2, 37, 8)  # a ragged last tile
    s = src(x, 16)
    assert s.shape == x.shape
    torch.testing.assert_close(s[:, :16], x[:, :1].expand(-1, 16, -1))
    torch.testing.assert_close(s[:, 16:32], x[:, :16].mean(1, keepdim=True).expand(-1, 16, -1))
    torch.testing.assert_close(s[:, 32:], x[:, 16:32].mean(1, keepdim=True).expand(-1, 5, -1))
    later = x.clone()
    later[:, 20:] += 5.0  # change tokens from position 20 on
    s2 = src(later, 16)
    torch.testing.assert_close(s2[:, :32], s[:, :32])  # tiles 0 and 1 never read position 20+
    assert not torch.allclose(s2[:, 32:], s[:, 32:])
    assert torch.equal(src(x[:, :1], 16), x[:, :1])

def _tile_masks(model, ids):
    from wide.method.modeling import recording_masks

    with recording_masks(model) as seen, torch.no_grad():
        model(input_ids=ids)
    return {k: torch.cat(v, dim=1) for k, v in seen.items()}

def _wrapped(**cfg):
    from conftest import tiny_model

    import wide

    config = wide.WideConfig(ffn_group_size=16, attn_group_size=1, router_init="random", **cfg)
    return wide.wrap(tiny_model("llama"), config, seed=0)

def test_library_previous_tile_source_is_the_trials_rule(monkeypatch):
    """``--tile-source previous`` in the library routes full sequences as the trial did."""
    import wide.method.modeling as modeling

    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    library = _tile_masks(_wrapped(route_tile=4, tile_source="previous"), ids)
    monkeypatch.setattr(modeling, "_route_fp32", modeling._route_fp32)  # restored after the test
    _script("tile_source_cpu").install()
    trial = _tile_masks(_wrapped(route_tile=4), ids)
    assert library.keys() == trial.keys()
    assert all(torch.equal(library[k], trial[k]) for k in library)

@pytest.mark.parametrize("tiled", ["ffn", "attn"])
def test_tile_modules_trial_tiles_one_kind_only(tiled, monkeypatch):
    import wide.method.modeling as modeling

    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    per_token = _tile_masks(_wrapped(), ids)
    both = _tile_masks(_wrapped(route_tile=4), ids)
    for name in ("_route_fp32", "_tiled", "_decision_weights"):
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    _script("tile_modules_cpu").install(tiled)
    one = _tile_masks(_wrapped(route_tile=4), ids)
    lead = torch.arange(13) // 4 * 4
    # Layer 0's attention router reads the embeddings, so its mask is its rule's own; every later
    # router reads hidden states that the other kind's rule has changed.
    assert torch.equal(one[(0, "attn")], (both if tiled == "attn" else per_token)[(0, "attn")])
    assert all(torch.equal(m, m[:, lead]) for (layer, kind), m in one.items() if kind == tiled)
    assert any(not torch.equal(m, m[:, lead]) for (layer, kind), m in one.items() if kind != tiled)
    with pytest.raises(SystemExit, match="first argument"):
        _script("tile_modules_cpu").install("mlp")

def test_union_penalty_trial_adds_the_expected_union(monkeypatch):
    """The union trial's proxy is mean_g 1 - (1 - f_g)^k over the modules' training masks, and
    its penalty is the library's plus coef x that (over the sparsity coefficient train.py puts
    on the whole penalty); it pulls the masks toward shared groups."""
    import wide.training.train as train
    from wide.method.modeling import router_parameters
    from wide.method.sparsity import forward_sparsity, sparsity_penalty
    from wide.method.state import get_state

    trial = _script("union_penalty_cpu")
    model = _wrapped()
    model.train()
    get_state(model).tau = 1.0
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids)
    masks = {k: m for k, m in get_state(model).masks.items() if m is not None}
    want = torch.stack([(1 - (1 - m.float().flatten(0, -2).mean(0)).pow(8)).mean() for m in masks.values()]).mean()
    assert torch.allclose(trial.union_proxy(model, 8), want)
    assert 0.0 < float(want) < 1.0
    monkeypatch.setattr(train, "forward_sparsity", forward_sparsity)  # restored after the test
    monkeypatch.setattr(train, "sparsity_penalty", sparsity_penalty)
    trial.install(2.0, 8)
    config = get_state(model).config
    sp = train.forward_sparsity(model)
    got = train.sparsity_penalty(sp, config)
    assert torch.allclose(got, sparsity_penalty(sp, config) + 2.0 / config.sparsity_coef * want)
    got.backward()  # the union term reaches the routers
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in router_parameters(model))

def test_library_union_coef_trains_what_the_union_trial_trained(monkeypatch, tmp_path):
    """``--union-coef`` is the trial's term: two steps through the trial's patched penalty and
    two with the option give the same losses and routers (to float rounding: the trial divides
    and multiplies by the sparsity coefficient)."""
    import wide
    import wide.training.train as train
    from wide.method.sparsity import forward_sparsity, sparsity_penalty

    monkeypatch.setattr(train, "forward_sparsity", forward_sparsity)  # restored after the test
    monkeypatch.setattr(train, "sparsity_penalty", sparsity_penalty)
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    args = train.TrainArgs(steps=2, batch_size=2, eval_every=0, save_every=0)
    option = _wrapped(union_coef=2.0)
    wide.freeze_backbone(option)
    h_option = train.train(option, ids, args, tmp_path / "option", progress=False)["history"]
    _script("union_penalty_cpu").install(2.0, 8)
    trial = _wrapped()
    wide.freeze_backbone(trial)
    h_trial = train.train(trial, ids, args, tmp_path / "trial", progress=False)["history"]
    for a, b in zip(h_option, h_trial):
        assert a["ce"] == pytest.approx(b["ce"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # the trial's penalty carries the term
        assert a["loss"] - 2.0 * a["union"] == pytest.approx(a["ce"] + 20.0 * abs(0.5 - a["flop_sparsity"]), rel=1e-5)
    for p, q in zip(wide.router_parameters(option), wide.router_parameters(trial)):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)

def test_union_speed_spread_hits_its_union_and_keeps_the_rate(monkeypatch):
    """The union-speed trial biases each router's groups apart until k random tokens together
    run the asked share of groups, then calibrates as the e2e benchmark does: the per-token rate
    stays at the target, and more spread means a smaller union."""
    import wide

    trial = _script("union_speed")
    monkeypatch.setattr(wide, "calibrate_offsets", wide.calibrate_offsets)  # restored after the test
    model = _wrapped()
    ids = torch.randint(0, 96, (1, 96), generator=torch.Generator().manual_seed(5))
    wide.calibrate_offsets(model, [ids], target=0.5, mode="per_module", rounds=2)
    plain = trial.union_of(model, ids, k=8)
    found = trial.install({"attn": 0.75, "ffn": 0.7}, k=8, steps=8)
    wide.calibrate_offsets(model, [ids], target=0.5, mode="per_module", rounds=2)
    got = found[0.5]["union"]
    assert plain["ffn"] > 0.9 and abs(got["ffn"] - 0.7) < 0.05 and abs(got["attn"] - 0.75) < 0.1, (plain, got)
    with torch.no_grad(), wide.track_sparsity(model) as tr:
        model(input_ids=ids)
    assert abs(float(tr.summary().group_rate) - 0.5) < 0.05

def test_oracle_trial_choices_keep_the_budget():
    """The oracle trial's masks: the routers' count per row (or per tile, or in total), the
    groups of largest contribution ||h_g W_g^T||, computed through Gram matrices."""
    trial = _script("oracle_masks_cpu")
    gen = torch.Generator().manual_seed(4)
    B, T, G, cols, out = 2, 21, 6, 4, 5
    h = _randn(gen, B, T, G * cols)
    w = _randn(gen, out, G * cols)
    gram = trial.contribution_gram(w, G)
    brute = torch.stack([(h[..., g * cols:(g + 1) * cols] @ w[:, g * cols:(g + 1) * cols].T).square().sum(-1)
                         for g in range(G)], -1)
    torch.testing.assert_close(trial.contribution_sq(h, gram), brute, rtol=1e-4, atol=1e-5)
    routed = torch.rand(B, T, G, generator=gen) < 0.5
    count = routed.sum(-1)
    score = trial.contribution_sq(h, gram)
    for mode in ("router", "random", "oracle", "oracle-act"):
        m = trial.choose(mode, 0, h, score, routed.float(), gen)
        assert torch.equal(m.sum(-1), count), mode
    best = trial.choose("oracle", 0, h, score, routed.float(), gen)
    # every kept group outweighs every dropped one of its row
    low = brute.masked_fill(~best, float("inf")).amin(-1)
    high = brute.masked_fill(best, -float("inf")).amax(-1)
    assert (low >= high).all()
    assert torch.equal(trial.choose("oracle-pool", 0, h, score, routed.float(), gen).sum(), count.sum())
    flat = trial.choose("oracle-flat", 0, h, score, routed.float(), gen).sum(-1)
    assert (flat == round(float(count.float().mean()))).all()
    tiled = trial.choose("oracle-tile", 8, h, score, routed.float(), gen)
    lead = torch.arange(T) // 8 * 8
    assert torch.equal(tiled, tiled[:, lead])  # one mask per tile, the ragged last one included
    assert torch.equal(tiled[:, 16].sum(-1), count[:, 16:].float().mean(-1).round().long())
    assert trial.parse_mode("oracle-tile16:ffn") == ("oracle-tile", 16, ("ffn",))
    for bad in ("oracle-tile", "oracle:mlp", "best"):
        with pytest.raises(SystemExit):
            trial.parse_mode(bad)

@pytest.mark.parametrize("mode", ["oracle-ce", "oracle-kl"])
def test_oracle_trial_first_order_gain_is_the_loss_slope(mode):
    """The first-order modes' gain of a group is minus the slope of their loss in that group's
    contribution: checked by central differences on the last layer's FFN (no router after it to
    change its mind), every group of every token scaled by 1 +- eps."""
    import torch.nn.functional as F

    from wide.method.state import get_state

    trial = _script("oracle_masks_cpu")
    model = _wrapped().double()  # more digits for the differences (HF's RMSNorm still runs in fp32)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    policy = trial.MaskPolicy(model, mode, kinds=("ffn",))
    policy.prepare(ids)
    last = len(policy.first_order) - 1
    gain, _ = policy.first_order[(last, "ffn")]
    routed = get_state(model).masks[(last, "ffn")]
    policy.remove()
    from wide.method.modeling import routing_disabled

    with torch.no_grad(), routing_disabled(model):
        dense = F.log_softmax(model(input_ids=ids).logits.float(), -1)
    proj = policy.projs[(last, "ffn")]
    cols = get_state(model).geometry.columns("ffn")

    def loss(g, scale):
        def pre(mod, args):
            h = args[0].clone()
            h[..., g * cols:(g + 1) * cols] *= scale
            return (h,)
        handle = proj.register_forward_pre_hook(pre)  # after wide's mask: scales what runs
        try:
            with torch.no_grad():
                logits = model(input_ids=ids).logits.double()
        finally:
            handle.remove()
        if mode == "oracle-kl":
            return float(F.kl_div(F.log_softmax(logits, -1), dense.double(), log_target=True, reduction="sum"))
        return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))

    eps = 1e-2
    for g in range(gain.shape[-1]):
        slope = (loss(g, 1 + eps) - loss(g, 1 - eps)) / (2 * eps)
        want = -float((gain[..., g] * routed[..., g]).sum())  # only the tokens that run g move
        assert abs(want) > 1e-8 and abs(slope - want) <= 2e-2 * abs(want), (g, slope, want)

def test_oracle_trial_probes_recover_a_linear_target():
    """The probes' least squares with a full-rank bias: a target exactly linear in the input
    comes back at full rank; at rank R the weight has rank R and is the best rank-R fit (no
    worse than the rank-R truncation of the true weight); fitted on the tiny model, every
    module gets one."""
    trial = _script("oracle_masks_cpu")
    gen = torch.Generator().manual_seed(7)
    N, H, G = 400, 12, 6
    x = _randn(gen, N, H) * 3 + 1
    a, c = _randn(gen, H, G), _randn(gen, G)
    y = x @ a + c
    stats = [0, 0.0, 0.0, 0.0, 0.0]
    trial.accumulate(stats, x[:150], y[:150])
    trial.accumulate(stats, x[150:], y[150:])  # streamed in parts
    fits = trial.solve(stats, [0, 2])
    w, b = fits[0]
    torch.testing.assert_close(x @ w + b, y, rtol=1e-3, atol=1e-3)
    w2, b2 = fits[2]
    assert int(torch.linalg.matrix_rank(w2)) == 2
    u, s, vh = torch.linalg.svd(a)
    naive = (u[:, :2] * s[:2]) @ vh[:2]
    err = lambda w_, b_: float((x @ w_ + b_ - y).square().mean())  # noqa: E731
    assert err(w2, b2) <= err(naive, (y - x @ naive).mean(0)) + 1e-4

    model = _wrapped()
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(6))
    pairs = []
    trial.capture_pairs(model, ids, lambda key, x_, y_: pairs.append((key, x_, y_)), kinds=("ffn",))
    layers = len(pairs)
    assert layers > 1 and [k for k, _, _ in pairs] == [(i, "ffn") for i in range(layers)]
    torch.testing.assert_close(pairs[0][2].mean(-1), torch.zeros(64, dtype=torch.float64))  # rows centred
    probes = trial.fit_probes(model, ids, [0, 2], kinds=("ffn",))
    assert set(probes[0]) == set(probes[2]) == {(i, "ffn") for i in range(layers)}
    for key, x_, y_ in pairs[:2]:  # the full-rank probe beats predicting nothing
        assert (probes[0][key](x_) - y_).square().mean() < y_.square().mean()
    mlp = trial.fit_mlp_probes(model, ids, [8], kinds=("ffn",), steps=200)
    for key, x_, y_ in pairs[:2]:
        assert (mlp[8][key](x_) - y_).square().mean() < 0.8 * y_.square().mean()

def test_oracle_trial_paired_se():
    trial = _script("oracle_masks_cpu")
    base = [10.0, 12.0, 11.0, 9.0]
    assert trial.paired_se(base, base, 5) == 0.0  # the same losses: no spread
    shifted = [b + 5.0 for b in base]  # every window 1 nat per token worse: a sure shift
    assert trial.paired_se(shifted, base, 5) == 0.0
    noisy = [b + d for b, d in zip(base, (1.0, -1.0, 1.0, -1.0))]
    assert abs(trial.paired_se(noisy, base, 5) - (4 / 3) ** 0.5 / 5 / 2) < 1e-12

@pytest.mark.parametrize("mode", ["gate", "gate-flops"])
def test_oracle_trial_gate_modes(mode):
    """The gate modes keep, per token, the FFN groups of largest ||SiLU(gate)_g||: as many as the
    routers chose (gate) or 1.5x as many skipped (gate-flops, rounded up), and count the gate
    projection as run for every group; attention keeps the routers' masks."""
    import torch.nn.functional as F

    from wide.base import arch
    from wide.method.modeling import recording_masks
    from wide.method.state import get_state

    trial = _script("oracle_masks_cpu")
    model = _wrapped()
    state = get_state(model)
    spec = arch.spec_for(model)
    gates, hooks = {}, []
    for i, layer in enumerate(arch.decoder_layers(model)):
        hooks.append(arch.projection(layer, spec, "gate").register_forward_hook(
            lambda m, a, out, i=i: gates.__setitem__(i, F.silu(out.float()))))
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(8))
    name, tile, kinds = trial.parse_mode(mode)
    assert kinds == ("ffn",)
    policy = trial.MaskPolicy(model, name, tile, kinds)
    with recording_masks(model) as routed, torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    policy.remove()
    G = state.geometry.ffn_groups
    kept_ffn = 0
    for (layer, kind), masks in routed.items():
        final = state.masks[(layer, kind)].bool()
        if kind == "attn":
            assert torch.equal(final, masks[0])
            continue
        k = masks[0].sum(-1)
        want = k if mode == "gate" else (G - ((G - k) * 3 + 1) // 2).clamp_min(0)
        assert torch.equal(final.sum(-1), want)
        norms = gates[layer].view(2, 11, G, -1).square().sum(-1)
        assert torch.equal(final, trial.top_by_count(norms, want))
        kept_ffn += float(final.sum())
    slots = 2 * 11 * G * len(arch.decoder_layers(model))
    assert policy.kept["ffn"] == pytest.approx(kept_ffn + (slots - kept_ffn) / 3)
    with pytest.raises(SystemExit, match="FFN groups only"):
        trial.parse_mode("gate:attn")

def test_oracle_trial_low_rank_mode():
    """lowrankR scores FFN groups from a rank-R copy of gate and up: at full rank that is the
    module itself, so it keeps the oracle's groups; a rank-R copy is the truncated SVD; its
    multiply-adds, 2R(H + F) per token, come off the FLOP sparsity; attention is refused."""
    from wide.base import arch
    from wide.method.modeling import recording_masks
    from wide.method.state import get_state

    trial = _script("oracle_masks_cpu")
    assert trial.parse_mode("lowrank32:ffn") == ("lowrank", 32, ("ffn",)) == trial.parse_mode("lowrank32")
    for bad in ("lowrank", "lowrank0", "lowrank8:attn"):
        with pytest.raises(SystemExit):
            trial.parse_mode(bad)
    gen = torch.Generator().manual_seed(10)
    w = _randn(gen, 9, 7)
    a, b = trial.low_rank(w, 3)
    u, s, vh = torch.linalg.svd(w)
    torch.testing.assert_close(a @ b, (u[:, :3] * s[:3]) @ vh[:3])
    model = _wrapped()
    state = get_state(model)
    spec = arch.spec_for(model)
    layer0 = arch.decoder_layers(model)[0]
    full = max(arch.projection(layer0, spec, "gate").weight.shape)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(11))
    outs = {}
    for mode, rank in (("oracle", 0), ("lowrank", full), ("lowrank", 2)):
        policy = trial.MaskPolicy(model, mode, rank, ("ffn",))
        with recording_masks(model) as routed, torch.no_grad():
            model(input_ids=ids)
        policy.remove()
        outs[(mode, rank)] = ({k: v.clone() for k, v in state.masks.items() if k[1] == "ffn"}, policy)
        for (layer, kind), masks in routed.items():  # the routers' counts, every mode
            if kind == "ffn":
                assert torch.equal(state.masks[(layer, kind)].sum(-1), masks[0].sum(-1).float())
    oracle, lr_full, lr_2 = (outs[k][0] for k in (("oracle", 0), ("lowrank", full), ("lowrank", 2)))
    assert all(torch.equal(oracle[k], lr_full[k]) for k in oracle)
    assert any(not torch.equal(oracle[k], lr_2[k]) for k in oracle)
    dims = state.geometry.dims
    layers = len(arch.decoder_layers(model))
    assert outs[("lowrank", 2)][1].predictor_macs == 2 * 10 * layers * 2 * 2 * (dims.hidden_size + dims.intermediate_size)
    assert outs[("lowrank", 2)][1].flop_sparsity() < outs[("oracle", 0)][1].flop_sparsity()
    # restricted to layer 1 (lowrank2@1-1): the other layers keep the routers' masks, and only
    # layer 1's predictions are paid for
    policy = trial.MaskPolicy(model, "lowrank", 2, ("ffn",), layers=range(1, 2))
    with recording_masks(model) as routed, torch.no_grad():
        model(input_ids=ids)
    policy.remove()
    assert torch.equal(state.masks[(0, "ffn")].bool(), routed[(0, "ffn")][0])
    final1, routed1 = state.masks[(1, "ffn")].bool(), routed[(1, "ffn")][0]
    assert torch.equal(final1.sum(-1), routed1.sum(-1)) and not torch.equal(final1, routed1)
    assert policy.predictor_macs == 2 * 10 * 2 * 2 * (dims.hidden_size + dims.intermediate_size)

def test_oracle_trial_layer_range():
    """``@FIRST-LAST`` applies a mode to those layers only; the others keep the routers' masks."""
    from wide.method.modeling import recording_masks
    from wide.method.state import get_state

    trial = _script("oracle_masks_cpu")
    assert trial.split_layers("oracle:ffn@1-2") == ("oracle:ffn", range(1, 3))
    assert trial.split_layers("oracle") == ("oracle", None)
    for bad in ("oracle@3", "oracle@2-1", "oracle@a-b"):
        with pytest.raises(SystemExit, match="layer range"):
            trial.split_layers(bad)
    model = _wrapped()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(9))
    policy = trial.MaskPolicy(model, "random", 0, ("ffn",), layers=range(1, 2))
    with recording_masks(model) as routed, torch.no_grad():
        model(input_ids=ids)
    policy.remove()
    final = get_state(model).masks
    assert torch.equal(final[(0, "ffn")].bool(), routed[(0, "ffn")][0])
    assert not torch.equal(final[(1, "ffn")].bool(), routed[(1, "ffn")][0])  # random groups there
    assert torch.equal(final[(1, "ffn")].sum(-1), routed[(1, "ffn")][0].sum(-1).float())

def _compensation_trial(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))  # it imports the oracle trial's helpers
    return _script("skip_compensation_cpu")

@pytest.mark.parametrize("conditional", [True, False])
def test_skip_compensation_fit_is_the_mean_contribution(monkeypatch, conditional):
    """C_g is the mean of h_g W_g^T over the tokens that skip g (or over all), first position
    left out, computed by brute force from the projections' unmasked inputs and the masks."""
    from wide.base import arch
    from wide.method.state import get_state

    trial = _compensation_trial(monkeypatch)
    model = _wrapped()
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(3))
    means = trial.fit(model, ids, batch_size=2, conditional=conditional)
    state, spec = get_state(model), arch.spec_for(model)
    seen, hooks = {}, []
    for i, layer in enumerate(arch.decoder_layers(model)):
        for kind in ("attn", "ffn"):
            proj = arch.reduction_projection(layer, spec, kind)
            hooks.append(proj.register_forward_pre_hook(
                lambda mod, args, key=(i, kind): seen.setdefault(key, []).append(
                    (args[0].detach().clone(), state.masks[key].detach().clone(), mod.weight.detach())),
                prepend=True))
    with torch.no_grad():
        for b in range(0, 4, 2):
            model(input_ids=ids[b:b + 2])
    for h in hooks:
        h.remove()
    assert set(means) == set(seen)
    for key, parts in seen.items():
        w = parts[0][2]
        G = parts[0][1].shape[-1]
        cols = w.shape[1] // G
        want = torch.zeros(G, w.shape[0])
        for g in range(G):
            rows = []
            for h, m, _ in parts:
                c = h[:, 1:, g * cols:(g + 1) * cols] @ w[:, g * cols:(g + 1) * cols].T  # [B, T-1, out]
                keep = (m[:, 1:, g] == 0) if conditional else torch.ones_like(m[:, 1:, g], dtype=torch.bool)
                rows.append(c[keep])
            rows = torch.cat(rows)
            if len(rows):
                want[g] = rows.mean(0)
        torch.testing.assert_close(means[key], want, rtol=1e-4, atol=1e-5)

def test_skip_compensation_adds_what_skipped_groups_mean(monkeypatch):
    """The hook adds (1 - m) @ C to the projection's output and nothing else; C = 0 changes nothing."""
    from wide.base import arch
    from wide.method.state import get_state

    trial = _compensation_trial(monkeypatch)
    model = _wrapped()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    last = len(arch.decoder_layers(model)) - 1
    proj = arch.reduction_projection(arch.decoder_layers(model)[last], arch.spec_for(model), "ffn")
    outs = []
    handle = proj.register_forward_hook(lambda mod, args, out: outs.append(out.detach().clone()))
    state = get_state(model)
    G = state.geometry.ffn_groups
    c = torch.randn(G, proj.weight.shape[0], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        zero = trial.Compensation(model, {(last, "ffn"): torch.zeros_like(c)})
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)
        zero.remove()
        comp = trial.Compensation(model, {(last, "ffn"): c})
        after = []  # registered after the compensation's hook: sees its output
        h2 = proj.register_forward_hook(lambda mod, args, out: after.append(out.detach().clone()))
        model(input_ids=ids)
        h2.remove()
        comp.remove()
    handle.remove()
    mask = state.masks[(last, "ffn")]
    assert 0 < float(mask.sum()) < mask.numel()  # some groups skipped, some run
    # outs: plain, zero, comp (the hook above sees the output before the compensation's hook)
    torch.testing.assert_close(outs[2], outs[0])
    torch.testing.assert_close(after[0], outs[0] + (1 - mask.float()) @ c, rtol=1e-5, atol=1e-5)

def test_skip_compensation_trainable_starts_at_zero_and_learns(monkeypatch):
    """``calibrate``'s C: zeros at the start (the model's output unchanged), among the routers'
    parameters (trained, saved and loaded with them), and reached by the loss's gradient."""
    import wide.method.modeling as modeling
    from wide.method.modeling import router_parameters

    monkeypatch.setattr(modeling, "install_hooks", modeling.install_hooks)  # restored after the test
    trial = _compensation_trial(monkeypatch)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = _wrapped()(input_ids=ids).logits
    trial.install_trainable()
    model = _wrapped()
    comp = [p for n, p in model.wide_routers.named_parameters() if ".comp." in n]
    assert len(comp) == 2 * len(model.wide_routers)
    assert all(float(p.detach().abs().sum()) == 0 for p in comp)
    assert {id(p) for p in comp} <= {id(p) for p in router_parameters(model)}
    torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)
    model(input_ids=ids).logits.square().mean().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in comp)

def _heads_model(trial, fine: bool = False):
    """The head-router trials' tiny model: a 3-layer Llama with 3 KV groups, attention routers from
    a random start, layer 0 dense; with ``fine``, thresholds that drop a share of every input."""
    import math

    from conftest import tiny_model

    import wide
    from wide.method import fine as wf

    model = tiny_model("llama", hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3)
    model = wide.wrap(model, wide.WideConfig(sparse_target="attention", router_init="random"), seed=0)
    if fine:
        wf.attach(model, wf.FineConfig(target=0.5))
        with torch.no_grad():
            model.wide_fine.log_threshold.fill_(math.log(0.05))  # drops a share of every input
    trial.dense_layers(model, [0])
    return model

def _one_skipped(model, state, ids):
    """Runs the heads model on ``ids`` [2, 11] (no grad) and yields (layer, attention mask, router
    input) of each routed layer, after checking the shape, layer 0 dense and exactly one group
    skipped per token everywhere else."""
    seen = {}
    state.input_observers.append(lambda layer, kind, x: seen.__setitem__((layer, kind), x))
    with torch.no_grad():
        model(input_ids=ids)
    for layer in range(3):
        mask = state.masks[(layer, "attn")]
        assert mask.shape == (2, 11, 3)
        if layer == 0:
            assert bool((mask == 1).all())
            continue
        assert bool(((1 - mask).sum(-1) == 1).all())  # exactly one skipped per token
        yield layer, mask, seen[(layer, "attn")]


def test_head_routers_skip_one_rule():
    """The head-router trial's ``--skip-one`` rule: at inference exactly one attention group per
    token (the smallest margin's) in every routed layer and none in the dense ones; in training
    at most one, a hard 0/1 mask whose straight-through gradient reaches the routers, and from
    the dense start nearly nothing skipped."""

    from wide.method.modeling import router_parameters
    from wide.method.sparsity import forward_sparsity
    from wide.method.state import get_state

    trial = _script("head_routers_fine_cpu")
    model = _heads_model(trial)
    trial.install_skip_one(model, [0])
    state = get_state(model)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    for layer, mask, x in _one_skipped(model, state, ids):
        want = model.wide_routers[layer].attn.margin(x).argmin(-1)
        assert torch.equal((1 - mask).argmax(-1), want)
    sp = forward_sparsity(model)
    assert float(sp.per_layer["attn"][1]) == pytest.approx(1 / 3) and float(sp.per_layer["attn"][0]) == 0

    model.train()
    state.tau = 1.0
    torch.manual_seed(0)
    model(input_ids=ids)
    masks = [state.masks[(layer, "attn")] for layer in (1, 2)]
    assert all(bool(((m == 0) | (m == 1)).all()) and bool(((1 - m).sum(-1) <= 1).all()) for m in masks)
    forward_sparsity(model).attn_rate.backward()
    grads = [p.grad for p in router_parameters(model) if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert model.wide_routers[0].attn.up.weight.grad is None  # layer 0 is frozen dense

    for layer in (1, 2):  # dense start: margins 4, so skip-nothing has probability 1 / (1 + 3 e^-4)
        model.wide_routers[layer].attn.start_dense()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (8, 64), generator=torch.Generator().manual_seed(6)))
    assert float(forward_sparsity(model).attn_rate) < 0.05

def test_head_routers_skip_share_calibrates_the_rate():
    # --skip-share S: per routed layer a cut on the smallest margin from calibration text, so about
    # S of the tokens skip their smallest-margin group and the rest skip nothing
    from wide.method.sparsity import forward_sparsity
    from wide.method.state import get_state

    trial = _script("head_routers_fine_cpu")
    model = _heads_model(trial)
    rule = trial.install_skip_one(model, [0])
    state = get_state(model)
    ids = torch.randint(0, 96, (8, 64), generator=torch.Generator().manual_seed(7))
    cut = trial.calibrate_share(rule, model, ids, 0.5, 4)
    assert sorted(cut) == [1, 2] and rule.mins is None
    with torch.no_grad():
        model(input_ids=ids)
    for layer in (1, 2):
        m = state.masks[(layer, "attn")]
        skipped = (1 - m).sum(-1)
        assert bool(((skipped == 0) | (skipped == 1)).all())
        assert float((skipped == 1).float().mean()) == pytest.approx(0.5, abs=0.02)
    assert float(forward_sparsity(model).per_layer["attn"][1]) == pytest.approx(0.5 / 3, abs=0.01)
    assert trial.calibrate_share(rule, model, ids, 1.0, 4) and rule.cut is not None
    with torch.no_grad():
        model(input_ids=ids)
    assert bool(((1 - state.masks[(1, "attn")]).sum(-1) == 1).all())  # S = 1: every token skips one


def test_head_routers_fold_input_choice_keeps_the_choice_margin():
    # --to-library: the folded router's plain margin is the input-only choice margin it was trained with
    trial = _script("head_routers_fine_cpu")
    model = _heads_model(trial)
    r = model.wide_routers[1].attn
    with torch.no_grad():
        r.up.bias.copy_(torch.randn(r.up.bias.shape, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(4))
    want = trial.choice_margin(r, x, input_only=True)
    assert not torch.allclose(r.margin(x), want)
    trial.fold_input_choice(r)
    assert torch.allclose(r.margin(x), want, atol=1e-6)


def test_head_routers_oracle_ce_and_input_choice():
    """The head-router trial's third rule (``--skip-one --oracle-ce W --input-choice``): in a routed
    training forward the label of every routed layer is the group of smallest contribution norm
    ||h_g W_o[:, g]^T|| of o's input after the thresholds (before the routing mask zeroes the
    skipped one), the loss is the cross-entropy of the skip scores (-margins) toward it, which
    reaches the routers; the teacher's forward records nothing; the wrapped micro-batch loss adds
    exactly W x that cross-entropy; and with the input-only choice a per-group bias does not change
    which group is skipped, and its gradient is the same for every group."""
    from wide.base import arch
    from wide.method.modeling import routing_disabled
    from wide.method.state import get_state
    from wide.training.train import TrainArgs, micro_batch_loss

    trial = _script("head_routers_fine_cpu")
    gen = torch.Generator().manual_seed(3)
    # oracle_pick is the brute-force argmin of the per-group contribution norms
    x, w = torch.randn(2, 5, 12, generator=gen), torch.randn(7, 12, generator=gen)
    want = torch.stack([torch.stack([(x[..., 4 * g:4 * g + 4] @ w[:, 4 * g:4 * g + 4].T).norm(dim=-1)
                                     for g in range(3)], -1)]).squeeze(0).argmin(-1)
    assert torch.equal(trial.oracle_pick(x, w, 4), want)

    model = _heads_model(trial, fine=True)
    trial.input_only_routers(model)
    rule = trial.install_skip_one(model, [0], input_only=True, collect=True)
    handles = rule.hook_labels()
    state = get_state(model)
    spec, cols = arch.spec_for(model), state.geometry.columns("attn")
    raw = {}
    for i, layer in enumerate(arch.decoder_layers(model)):
        o = arch.projection(layer, spec, "o")
        o.register_forward_pre_hook(lambda mod, a, i=i: raw.__setitem__(i, a[0].detach().clone()), prepend=True)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))

    model.train()
    state.tau = 1.0
    with torch.no_grad(), routing_disabled(model):  # the teacher's forward: no label, no score
        model(input_ids=ids)
    assert rule.labels == {} and rule.scores == {}
    torch.manual_seed(0)
    model(input_ids=ids)
    assert sorted(rule.labels) == sorted(rule.scores) == [1, 2]
    dropped = 0
    for i in (1, 2):
        keep = model.wide_fine.keep(i, "o", raw[i])
        dropped += int((~keep).sum())
        o = arch.projection(arch.decoder_layers(model)[i], spec, "o")
        assert torch.equal(rule.labels[i], trial.oracle_pick(raw[i] * keep, o.weight, cols))
    assert dropped > 0
    labels = dict(rule.labels)
    scores = {i: s.detach() for i, s in rule.scores.items()}
    ce, hit = rule.oracle_loss()
    ref = sum(torch.nn.functional.cross_entropy(scores[i].reshape(-1, 3), labels[i].reshape(-1)) for i in (1, 2)) / 2
    assert float(ce.detach()) == pytest.approx(float(ref), rel=1e-6)
    assert hit == pytest.approx(float(sum((scores[i].argmax(-1) == labels[i]).float().mean() for i in (1, 2)) / 2))
    assert rule.labels == {} and rule.scores == {}
    ce.backward()
    r = model.wide_routers[1].attn
    assert r.up.weight.grad is not None and float(r.up.weight.grad.abs().sum()) > 0
    assert r.down.bias.grad is None  # held at zero: no per-group constant through up's weight
    gb = r.up.bias.grad.view(3, 2)
    # the bias gets the same gradient in every group (the shared level's: here through the next
    # layer's input, since the cross-entropy's own sums to zero over the groups)
    assert torch.allclose(gb, gb[:1].expand(3, 2), rtol=1e-3, atol=1e-9)

    with torch.no_grad():  # a per-group bias does not move the input-only choice
        x4 = torch.randn(4, 48, generator=gen)
        before = trial.choice_margin(r, x4, True)
        r.up.bias.view(3, 2)[:, 0] += torch.tensor([3.0, -2.0, 0.5])
        after = trial.choice_margin(r, x4, True)
        assert torch.allclose(after - after.mean(-1, keepdim=True), before - before.mean(-1, keepdim=True), atol=1e-5)
        assert not torch.allclose(trial.choice_margin(r, x4, False) - r.offset, before - r.offset)
        r.up.bias.view(3, 2)[:, 0] -= torch.tensor([3.0, -2.0, 0.5])

    log = []
    args = TrainArgs(loss="kd")
    original, wrapped = trial.with_oracle_ce(rule, 2.0, log)
    assert original is micro_batch_loss
    torch.manual_seed(1)
    plain = micro_batch_loss(model, ids, args)
    rule.scores.clear()
    rule.labels.clear()
    torch.manual_seed(1)
    out = wrapped(model, ids, args)
    assert len(log) == 1 and out["kd"] is not None
    assert float(out["task"].detach()) == pytest.approx(float(plain["task"].detach()) + 2.0 * log[0]["oracle_ce"], rel=1e-5)
    for h in handles:
        h.remove()

def test_head_routers_per_sequence_rule():
    """The head-router trial's ``--per-sequence P --refresh N`` rule (issue 48 design (c)): tokens
    t < P skip their own smallest-margin group; tokens t >= P the group of smallest mean margin over
    the tokens before the last refresh point (P, P + N, ...; or the group most often the per-token
    choice among them, ``--sequence-score vote``), so the choice is strictly causal; the
    mask_fn applies it to every routed layer's margins, refuses decode steps on a KV cache, and the
    per-position NLL adds up to the perplexity and scores the decode part alone."""
    import itertools
    import math

    from wide.evaluation.evaluate import perplexity
    from wide.method.state import get_state

    trial = _script("head_routers_fine_cpu")
    # one sequence by hand, P = 4: the prompt favours group 2 (mean 1.75 / 1.25 / 0.75), the decode part group 0
    prompt = torch.tensor([[1.0, 2, 0], [1, 0, 2], [2, 1, 0], [3, 2, 1]])
    m = torch.cat([prompt, torch.tensor([[-4.0, 3, 3]]).expand(6, 3)]).unsqueeze(0)  # [1, 10, 3]
    assert trial.sequence_choice(m, 4).tolist() == [[2, 1, 2, 2, 2, 2, 2, 2, 2, 2]]  # never refreshed
    # refresh 2: t 4-5 from tokens 0-3 (group 2), t 6-7 from 0-5 (sums -1 / 11 / 9: group 0), t 8-9 from 0-7
    assert trial.sequence_choice(m, 4, 2).tolist() == [[2, 1, 2, 2, 2, 2, 0, 0, 0, 0]]
    # refresh 1: t 5 already from tokens 0-4 (sums 3 / 8 / 6: group 0); the token's own margin never counts
    assert trial.sequence_choice(m, 4, 1).tolist() == [[2, 1, 2, 2, 2, 0, 0, 0, 0, 0]]
    assert trial.sequence_choice(m, 10).tolist() == [m[0].argmin(-1).tolist()]  # P >= T: per token
    # vote: the prompt's most frequent per-token group (1, twice) where the mean picks group 0 (one -10)
    v = torch.tensor([[[1.0, 0, 2], [1, 0, 2], [-10, 2, 2], [0, 1, 1], [0, 1, 1]]])
    assert trial.sequence_choice(v, 3).tolist() == [[1, 1, 0, 0, 0]]
    assert trial.sequence_choice(v, 3, vote=True).tolist() == [[1, 1, 0, 1, 1]]
    assert trial.sequence_choice(v, 3, 1, vote=True).tolist() == [[1, 1, 0, 1, 0]]  # t 4: votes 2 / 2 / 0, tie to 0

    # random margins: brute force (argmin of the mean over tokens before r(t)) and causality
    scores = torch.randn(3, 13, 3, generator=torch.Generator().manual_seed(7))
    votes = torch.nn.functional.one_hot(scores.argmin(-1), 3).float()
    for (P, N), vote in itertools.product([(4, 0), (4, 3), (5, 1), (1, 4)], [False, True]):
        pick = trial.sequence_choice(scores, P, N, vote)
        for t in range(13):
            r = P + (t - P) // N * N if N else P
            want = scores[:, t].argmin(-1) if t < P else (votes[:, :r].sum(1).argmax(-1) if vote
                                                          else scores[:, :r].mean(1).argmin(-1))
            assert torch.equal(pick[:, t], want), (P, N, t)
        for k in range(13):  # a change at token k moves no choice before it, nor its own from P on
            moved = scores.clone()
            moved[:, k] += torch.randn(3, 3, generator=torch.Generator().manual_seed(k)) * 10
            again = trial.sequence_choice(moved, P, N, vote)
            upto = k + 1 if k >= P else k
            assert torch.equal(again[:, :upto], pick[:, :upto]), (P, N, k)

    # the mask_fn on a tiny model: routed layers skip sequence_choice's group, layer 0 none
    model = _heads_model(trial)
    rule = trial.install_skip_one(model, [0], input_only=True, prompt=4, refresh=3)
    assert isinstance(rule, trial.PerSequence)
    state = get_state(model)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for layer, mask, x in _one_skipped(model, state, ids):
            margin = trial.choice_margin(model.wide_routers[layer].attn, x, True)
            assert torch.equal((1 - mask).argmax(-1), trial.sequence_choice(margin, 4, 3))
            assert torch.equal((1 - mask[:, :4]).argmax(-1), margin[:, :4].argmin(-1))
        out = model(input_ids=ids[:, :6], use_cache=True)
        with pytest.raises(NotImplementedError):
            cache = {"cache": out.cache} if getattr(out, "cache", None) is not None else {
                "past_key_values": out.past_key_values}
            model(input_ids=ids[:, 6:7], use_cache=True, **cache)

        # the per-position NLL: adds up to the perplexity, and scores the predictions at t >= S alone
        nll = trial.PositionNLL(model)
        res = perplexity(model, ids, batch_size=1, progress=False)
        nll.remove()
        assert nll.windows == 2 and nll.nll_from(0) == pytest.approx(res["nll"], rel=1e-5)
        logits = model(input_ids=ids).logits
        tail = torch.nn.functional.cross_entropy(logits[:, 4:-1].flatten(0, 1), ids[:, 5:].flatten())
        assert nll.ppl_from([4])["4"] == pytest.approx(math.exp(float(tail)), rel=1e-5)

def test_head_routers_joint_trains_thresholds_and_routers(tmp_path, monkeypatch):
    """The head-router trial's design (b) (``--joint --skip-one``): started from a learned threshold
    set (here a one-step ``wide calibrate --hybrid`` of the tiny model, with per-channel scales), the
    thresholds and scales are trained beside the routers (in the library's threshold group: lr x the
    set's lr scale, no weight decay) and move, the routers too, the linear penalty joins the loss;
    the saved directory holds the trained thresholds (shifted onto the linear target) and the
    trial's ``--skip-one --eval`` evaluates it."""
    import json

    from conftest import write_tiny_run

    from wide import data
    from wide.cli import main as wide_main
    from wide.io.serialization import read_meta
    from wide.training.train import _param_groups

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    quick = ["--batch-size", "2", "--eval-every", "0", "--offset-batches", "1"]
    assert wide_main(["calibrate", *common, *quick, "--steps", "1", "--hybrid", "--sparse-target", "none",
                      "--fine-per-channel", "--fine-lr-scale", "1", "--target", "0.5", "--out", str(tmp_path / "thr")]) == 0
    thr = tmp_path / "thr" / "routers"
    assert read_meta(thr)["fine"]["per_channel"]

    trial = _script("head_routers_fine_cpu")
    seen = {}
    real_train = trial.train

    def spy(model, train_ids, targs, out, *, parameters, **kw):
        fine = model.wide_fine
        seen["ids"] = {id(p) for p in parameters}
        seen["fine"] = [id(p) for p in fine.learnable()]
        seen["router"] = [id(p) for p in model.wide_routers[1].attn.parameters() if p.requires_grad]
        seen["start"] = {id(p): p.detach().clone() for p in parameters}
        seen["params"] = list(parameters)
        groups = _param_groups(model, seen["params"], targs)
        seen["groups"] = [({id(p) for p in g["params"]}, g.get("lr"), g.get("weight_decay")) for g in groups]
        res = real_train(model, train_ids, targs, out, parameters=parameters, **kw)
        seen["end"] = {id(p): p.detach().clone() for p in seen["params"]}
        seen["fine_state"] = {k: v.detach().clone() for k, v in fine.state_dict().items()}
        return res

    monkeypatch.setattr(trial, "train", spy)
    out = tmp_path / "joint"
    run = trial.main(["--joint", "--skip-one", "--oracle-ce", "3.0", "--input-choice", "--thresholds", str(thr),
                      *common, *quick, "--steps", "2", "--seed", "0", "--budget", "layer", "--target", "0.3333",
                      "--offsets", "none", "--out", str(out)])
    assert len(seen["fine"]) == 1 + 7  # log thresholds and the seven projections' per-channel scales
    assert set(seen["fine"]) <= seen["ids"] and set(seen["router"]) <= seen["ids"]
    moved = lambda i: not torch.equal(seen["start"][i], seen["end"][i])  # noqa: E731
    assert moved(seen["fine"][0]) and any(moved(i) for i in seen["fine"][1:])
    assert any(moved(i) for i in seen["router"])
    j = run["joint"]
    assert j["threshold_lr_scale"] == 1.0 and j["linear_coef"] == 20.0 and j["mean_abs_change"]["log_threshold"] > 0
    assert len(j["linear_log"]) == 2 and j["threshold_shift"] is not None
    assert j["linear_after_shift"] == pytest.approx(0.5, abs=0.05)
    assert run["oracle_log"] and run["design"].startswith("(b)")
    # the library's threshold group: lr x the set's lr scale (1), no weight decay; the routers in the other
    (rest, _, _), (thr_ids, thr_lr, thr_wd) = seen["groups"]
    assert thr_ids == set(seen["fine"]) and thr_lr == pytest.approx(2e-3) and thr_wd == 0.0
    assert set(seen["router"]) <= rest
    saved = out / "routers"
    meta = read_meta(saved)
    assert meta["method"] == "heads1of3+learned-joint" and meta["fine"]["allocation"] == "learned"
    # the directory's thresholds are the trained ones (shifted onto the target), not the starting set's
    from safetensors.torch import load_file

    mine, first = load_file(saved / "thresholds.safetensors"), load_file(thr / "thresholds.safetensors")
    assert not torch.equal(mine["log_threshold"], first["log_threshold"])
    for k, v in mine.items():
        if k.startswith("log_scale"):
            torch.testing.assert_close(v, seen["fine_state"][k])  # the shift moves thresholds only
    assert any(not torch.equal(v, first[k]) for k, v in mine.items() if k.startswith("log_scale"))
    assert trial.main(["--skip-one", "--input-choice", "--eval", *common, "--routers", str(saved), "--tasks",
                       "--max-eval-sequences", "2", "--out", str(tmp_path / "ev")]) == 0
    rec = json.loads((tmp_path / "ev.json").read_text())["records"][0]
    assert rec["ppl"] > 0 and rec["attn_core_sparsity"] > 0 and rec["linear_sparsity"] > 0.3
    # --reshift (the matched-sparsity control): one threshold shift onto another linear target
    moved_run = trial.main(["--skip-one", "--input-choice", "--reshift", str(saved), "--linear-target", "0.4", *common,
                            *quick, "--out", str(tmp_path / "re")])
    assert moved_run["linear_after_shift"] == pytest.approx(0.4, abs=0.05) and moved_run["threshold_shift"] < 0
    again = load_file(tmp_path / "re" / "routers" / "thresholds.safetensors")
    finite = torch.isfinite(mine["log_threshold"])
    torch.testing.assert_close(again["log_threshold"][finite], mine["log_threshold"][finite] + moved_run["threshold_shift"])

def _tiny_run_and_thresholds(tmp_path, monkeypatch) -> list:
    """write_tiny_run's options (the data cache in tmp_path), and a threshold set of its model in
    tmp_path/thr that drops a share of every input: what the head-router trial freezes."""
    import math

    from conftest import tiny_model, write_tiny_run

    import wide
    from wide import data
    from wide.io.serialization import save_routers
    from wide.method import fine as wf

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    base = wide.wrap(tiny_model("llama"), wide.WideConfig(sparse_target="none"), seed=0)
    wf.attach(base, wf.FineConfig(target=0.5))
    with torch.no_grad():
        base.wide_fine.log_threshold.fill_(math.log(0.05))
    save_routers(base, tmp_path / "thr")
    return common

def test_head_routers_query_input(tmp_path, monkeypatch, capsys):
    """The head-router trial's ``--router-input query`` (sixth trial): each routed layer's router
    reads the layer's query (q_proj's output after the thresholds) and decides there, before
    o_proj: exactly one group skipped per token in the routed layers at inference (the smallest
    input-only margin of that query), none in the dense one, one sparsity record per layer (the
    norm's call routes nothing); in training at most one, and the oracle cross-entropy and the rate
    reach the routers' parameters. The saved directory records the input, and the script's
    ``--eval`` and ``--mask-stats`` load it with the rule (a contrary --router-input is refused)."""
    import json

    from wide.base import arch
    from wide.io.serialization import CONFIG_FILE
    from wide.method import modeling
    from wide.method.sparsity import forward_sparsity
    from wide.method.state import get_state

    trial = _script("head_routers_fine_cpu")
    model = _heads_model(trial, fine=True)
    trial.input_only_routers(model)
    rule = trial.install_skip_one(model, [0], input_only=True, collect=True, query=True)
    modeling.install_hooks(model)  # a re-install (as PEFT's or fine's) keeps one query hook per layer
    state, spec = get_state(model), arch.spec_for(model)
    raw, resid = {}, {}
    for i, layer in enumerate(arch.decoder_layers(model)):  # q's input before the thresholds' pre-hook
        arch.projection(layer, spec, "q").register_forward_pre_hook(
            lambda mod, a, i=i: raw.__setitem__(i, a[0].detach().clone()), prepend=True)
    state.input_observers.append(lambda layer, kind, x: resid.__setitem__(layer, x) if x.shape[-1] == 48 else None)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids=ids)
    assert [(r.layer, r.kind) for r in state.records] == [(0, "attn"), (1, "attn"), (2, "attn")]
    differs = 0
    for i, layer in enumerate(arch.decoder_layers(model)):
        mask = state.masks[(i, "attn")]
        assert mask.shape == (2, 11, 3)
        if i == 0:
            assert bool((mask == 1).all())
            continue
        assert bool(((1 - mask).sum(-1) == 1).all())  # exactly one skipped per token
        q_proj = arch.projection(layer, spec, "q")
        keep = model.wide_fine.keep(i, "q", raw[i])
        assert int((~keep).sum()) > 0
        with torch.no_grad():
            q = torch.nn.functional.linear(raw[i] * keep, q_proj.weight, q_proj.bias)
            want = trial.choice_margin(model.wide_routers[i].attn, q, True).argmin(-1)
            from_resid = trial.choice_margin(model.wide_routers[i].attn, resid[i], True).argmin(-1)
        assert torch.equal((1 - mask).argmax(-1), want)
        differs += int((want != from_resid).sum())
    assert differs > 0  # the query, not the residual, decides
    sp = forward_sparsity(model)
    assert float(sp.per_layer["attn"][1]) == pytest.approx(1 / 3) and float(sp.per_layer["attn"][0]) == 0

    model.train()
    state.tau = 1.0
    handles = rule.hook_labels()
    torch.manual_seed(0)
    model(input_ids=ids)
    for i in (1, 2):
        m = state.masks[(i, "attn")]
        assert bool(((m == 0) | (m == 1)).all()) and bool(((1 - m).sum(-1) <= 1).all())
    assert sorted(rule.scores) == sorted(rule.labels) == [1, 2]
    ce, _ = rule.oracle_loss()
    (ce + forward_sparsity(model).attn_rate).backward()
    for i in (1, 2):
        r = model.wide_routers[i].attn
        assert all(float(p.grad.abs().sum()) > 0 for p in (r.up.weight, r.down.weight, r.up.bias))
    assert model.wide_routers[0].attn.up.weight.grad is None  # layer 0 is frozen dense
    for h in handles:
        h.remove()

    # through the script: train 2 steps on a tiny run with frozen thresholds, then --eval / --mask-stats
    common = _tiny_run_and_thresholds(tmp_path, monkeypatch)
    train = ["--skip-one", "--oracle-ce", "1.0", "--input-choice", "--router-input", "query", *common,
             "--thresholds", str(tmp_path / "thr"), "--steps", "2", "--batch-size", "2", "--eval-every", "0",
             "--save-every", "0", "--budget", "layer", "--target", "0.5", "--offsets", "none", "--out",
             str(tmp_path / "q")]
    run = trial.main(train)
    assert run["router_input"] == "query" and len(run["oracle_log"]) == 2
    saved = tmp_path / "q" / "routers"
    assert json.loads((saved / CONFIG_FILE).read_text())[trial.QUERY_KEY] == "query"
    assert trial.main(["--skip-one", "--input-choice", "--eval", *common, "--routers", str(saved), "--tasks",
                       "--out", str(tmp_path / "res")]) == 0
    assert "routers reading the layer's query" in capsys.readouterr().out  # from the directory's record
    rec = json.loads((tmp_path / "res.json").read_text())["records"][0]
    # the tiny model: 2 layers of 2 groups, layer 0 dense: one group of 4
    assert rec["method"] == "heads1of3+learned" and rec["attn_core_sparsity"] == pytest.approx(0.25)
    stats = trial.main(["--skip-one", "--input-choice", "--mask-stats", str(saved), "--eval-sequences", "2",
                        *common])
    assert stats["tokens_skipping_k"]["attn"] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert stats["oracle_agreement"] is not None and "read the layer's query" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--router-input query"):
        trial.main(["--skip-one", "--input-choice", "--router-input", "residual", "--mask-stats", str(saved),
                    "--eval-sequences", "2", *common])

def test_head_routers_recalibrate_after_lora(tmp_path, monkeypatch):
    """Stage 2 of a ``--to-library`` set (experiments/head_routers_gpu.sh, STAGE2=1): ``wide recover
    --freeze-routers --offsets none`` trains adapters only, then ``--recalibrate`` brings the set
    back to its stage-1 rates on the same calibration batches (the offsets onto the attention-core
    target, one shift of every threshold onto the linear sparsity), keeps the adapters and the
    stage-2 record, and ``wide eval`` reads the result."""
    import json

    from safetensors.torch import load_file

    from wide.cli import main as wide_main
    from wide.io.serialization import read_meta

    common = _tiny_run_and_thresholds(tmp_path, monkeypatch)
    trial = _script("head_routers_fine_cpu")
    quick = ["--batch-size", "2", "--offset-batches", "2"]  # the conversion's and the re-set's batches
    trial.main(["--skip-one", "--input-choice", *common, "--thresholds", str(tmp_path / "thr"), "--steps", "1",
                "--batch-size", "2", "--eval-every", "0", "--save-every", "0", "--budget", "layer", "--target", "0.3",
                "--offsets", "none", "--out", str(tmp_path / "s0")])
    # the tiny model: 2 layers of 2 groups, layer 0 dense: 0.15 = 60 % of the tokens skip one in layer 1
    lib_run = trial.main(["--skip-one", "--input-choice", "--to-library", str(tmp_path / "s0" / "routers"),
                          "--library-target", "0.15", *common, *quick, "--out", str(tmp_path / "lib")])
    lib = tmp_path / "lib" / "routers"
    assert wide_main(["recover", *common, "--routers", str(lib), "--out", str(tmp_path / "lora"), "--steps", "2",
                      "--batch-size", "2", "--lr", "1e-2", "--loss", "kd", "--eval-every", "0", "--save-every", "0",
                      "--offsets", "none", "--freeze-routers"]) == 0
    recovered = tmp_path / "lora" / "recovered"
    for f in ("routers.safetensors", "thresholds.safetensors"):  # frozen, and --offsets none shifted nothing
        assert all(torch.equal(v, load_file(lib / f)[k]) for k, v in load_file(recovered / f).items())

    run = trial.main(["--recalibrate", str(recovered), *common, *quick, "--out", str(tmp_path / "re")])
    assert run["stage1"] == str(lib) and run["sequences"] == lib_run["sequences"] == 4
    assert run["attn_target"] == 0.15 and run["linear_target"] == lib_run["calibration_linear"]
    assert run["calibration_attn_rate"] == pytest.approx(0.15, abs=0.02)
    assert run["calibration_linear"] == pytest.approx(lib_run["calibration_linear"], abs=0.05)
    out = tmp_path / "re" / "routers"
    meta = read_meta(out)
    assert meta["stage"] == 2 and meta["stage1_dir"] == str(lib) and meta["run"]["recalibrate"]["threshold_shift"] == \
        run["threshold_shift"] and meta["run"]["stage2_tokens"] > 0
    assert meta["wide_config"]["attn_rule"] == "skip_upto" and meta["fine"]["per_channel"] is False
    adapters = load_file(recovered / "adapter_model.safetensors")
    assert adapters and all(torch.equal(v, load_file(out / "adapter_model.safetensors")[k]) for k, v in adapters.items())
    thr, start = load_file(out / "thresholds.safetensors")["log_threshold"], load_file(lib / "thresholds.safetensors")
    finite = torch.isfinite(start["log_threshold"])
    torch.testing.assert_close(thr[finite], start["log_threshold"][finite] + run["threshold_shift"])
    assert wide_main(["eval", *common, "--routers", str(out), "--tasks", "--max-eval-sequences", "2",
                      "--out", str(tmp_path / "ev")]) == 0
    rec = json.loads((tmp_path / "ev.json").read_text())["records"][0]
    assert rec["stage"] == 2 and rec["routing"] == "skip_upto1" and rec["attn_core_sparsity"] > 0
    with pytest.raises(SystemExit, match="no LoRA adapters"):
        trial.main(["--recalibrate", str(lib), "--stage1", str(lib), *common, *quick, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="run.to_library"):
        trial.main(["--recalibrate", str(recovered), "--stage1", str(tmp_path / "thr"), *common, *quick,
                    "--out", str(tmp_path / "x")])


def test_heads_offsets_resample_to_a_linear_target(tmp_path, monkeypatch):
    """experiments/heads_offsets_sample_cpu.py --from a library set --linear-target L: every
    threshold moved by one shift until all linear MACs (the skipped groups' q/o counted) are
    skipped at L, then the offsets set; the saved set records both, and ``--recalibrate`` of a
    stage-2 set made from it restores those rates, not the conversion's."""
    from safetensors.torch import load_file

    from wide.cli import main as wide_main
    from wide.io.serialization import read_meta

    common = _tiny_run_and_thresholds(tmp_path, monkeypatch)
    trial = _script("head_routers_fine_cpu")
    quick = ["--batch-size", "2", "--offset-batches", "2"]
    trial.main(["--skip-one", "--input-choice", *common, "--thresholds", str(tmp_path / "thr"), "--steps", "1",
                "--batch-size", "2", "--eval-every", "0", "--save-every", "0", "--budget", "layer", "--target", "0.3",
                "--offsets", "none", "--out", str(tmp_path / "s0")])
    lib_run = trial.main(["--skip-one", "--input-choice", "--to-library", str(tmp_path / "s0" / "routers"),
                          "--library-target", "0.15", *common, *quick, "--out", str(tmp_path / "lib")])
    goal = round(lib_run["calibration_linear"] - 0.1, 3)
    resample = _script("heads_offsets_sample_cpu")
    run = resample.main(["--from", str(tmp_path / "lib" / "routers"), "--linear-target", str(goal), "--sequences", "4",
                         "--shift-sequences", "4", "--target", "0.15", "--after-only", *common, *quick,
                         "--out", str(tmp_path / "re50")])
    assert run["linear_target"] == goal and run["threshold_shift"] < 0  # fewer linear MACs skipped: lower thresholds
    assert run["before"]["after shift, calibration[:4]"]["linear"] == pytest.approx(goal, abs=0.02)
    assert run["after"]["calibration[:4]"]["attn_group"] == pytest.approx(0.15, abs=0.02)
    out = tmp_path / "re50" / "routers"
    assert read_meta(out)["run"]["offsets_resample"]["linear_target"] == goal
    # the shift found, applied again with the source's offsets kept: the same thresholds, the offsets untouched
    again = resample.main(["--from", str(tmp_path / "lib" / "routers"), "--linear-target", str(goal),
                           "--threshold-shift", str(run["threshold_shift"]), "--keep-offsets", "--sequences", "4",
                           "--after-only", *common, *quick, "--out", str(tmp_path / "kept")])
    assert again["offsets"] is None and again["offsets_kept_from"]["target"] == 0.15
    kept, shifted = (load_file(d / "routers" / "thresholds.safetensors") for d in (tmp_path / "kept", tmp_path / "re50"))
    torch.testing.assert_close(kept["log_threshold"], shifted["log_threshold"])
    routers_kept, routers_src = (load_file(d / "routers" / "routers.safetensors") for d in (tmp_path / "kept", tmp_path / "lib"))
    assert all(torch.equal(v, routers_src[k]) for k, v in routers_kept.items())
    chained = resample.main(["--from", str(out), "--keep-offsets", "--sequences", "4", "--after-only", *common, *quick,
                             "--out", str(tmp_path / "chained")])
    assert chained["previous"]["linear_target"] == goal and chained["previous"]["threshold_shift"] == run["threshold_shift"]
    assert wide_main(["recover", *common, "--routers", str(out), "--out", str(tmp_path / "lora"), "--steps", "1",
                      "--batch-size", "2", "--lr", "1e-2", "--loss", "kd", "--eval-every", "0", "--save-every", "0",
                      "--offsets", "none", "--freeze-routers"]) == 0
    re = trial.main(["--recalibrate", str(tmp_path / "lora" / "recovered"), *common, *quick,
                     "--out", str(tmp_path / "re")])
    assert re["linear_target"] == goal and re["attn_target"] == 0.15
    assert re["calibration_linear"] == pytest.approx(goal, abs=0.05)


@needs_interpreted_library
def test_fine_gemv_race_check_runs_and_counts(tmp_path):
    # the GPU race check's own CPU mode: every case of one tile, right, and written down
    out = tmp_path / "race.json"
    assert _script("fine_gemv_race_gpu").main(["--cpu", "--out", str(out), "--launches", "2", "--repeats", "2",
                                               "--match", "BN256-BR1-BU8-P16-pf-w1-s1-atomic-compact64"]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    # the tile and its twin that loads weights under the list alone (-nomask): 9 cases each
    assert len(rows) == 18 and all(r["bad"] == r["repeat_bad"] == 0 and r["launches"] == 2 for r in rows)
    assert sum(r["config"].endswith("-nomask") for r in rows) == 9
