"""Per-element activation sparsity (wide.method.fine: TEAL, WINA, learned thresholds) and the exact
linear-MAC accounting every method's records carry (wide.method.sparsity.linear_macs)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import wide
from wide.base import arch
from wide.method import fine, modeling, sparsity
from wide.method.geometry import PROJECTIONS, projection_shapes
from wide.method.state import get_state
from wide.io.serialization import THRESHOLDS_FILE, CheckpointError


def batches(n=4, b=2, t=12, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, t), generator=g) for _ in range(n)]


def teal_model(criterion="magnitude", allocation="uniform", target=0.4, routers="none", **kw):
    model = tiny_model("llama")
    modeling.wrap(model, wide.WideConfig(sparse_target=routers, target_sparsity=target, loss_mode="linear"), seed=0)
    fine.attach(model, fine.FineConfig(criterion=criterion, allocation=allocation, target=target, **kw))
    return model


def projection_inputs(model, ids, fine_on=True):
    """(layer, projection) -> the input each projection received (fp32), from hooks registered
    after wide's, so after every mask."""
    seen = {}
    handles = []
    spec = arch.spec_for(model)
    for i, layer in enumerate(arch.decoder_layers(model)):
        for p in PROJECTIONS:
            def grab(mod, args, i=i, p=p):
                seen.setdefault((i, p), []).append(args[0].detach().float())
            handles.append(arch.projection(layer, spec, p).register_forward_pre_hook(grab))
    fn = fine.get_fine(model)
    if fn is not None:
        fn.enabled = fine_on
    try:
        with torch.no_grad():
            for x in ids:
                model(input_ids=x)
    finally:
        for h in handles:
            h.remove()
        if fn is not None:
            fn.enabled = True
    return {k: torch.cat([v.flatten(0, -2) for v in vals]) for k, vals in seen.items()}


def test_teal_threshold_is_the_hand_computed_quantile():
    model = teal_model(target=0.3)
    cal = batches()
    fine.calibrate(model, cal)
    dense = projection_inputs(model, cal, fine_on=False)
    fn = model.wide_fine
    for (layer, p) in [(0, "q"), (1, "o"), (0, "gate"), (1, "down")]:
        want = torch.quantile(dense[(layer, p)].abs().flatten(), 0.3)
        got = fn.threshold(layer, p)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    # q, k and v read one input: one threshold (TEAL's uniform allocation)
    th = fn.log_threshold.detach()
    assert torch.equal(th[:, 0], th[:, 1]) and torch.equal(th[:, 0], th[:, 2])
    assert torch.equal(th[:, 4], th[:, 5])


def test_wina_scores_weigh_each_projection_by_its_column_norms():
    model = teal_model(criterion="wina", target=0.5)
    cal = batches()
    fine.calibrate(model, cal)
    fn = model.wide_fine
    layer = arch.decoder_layers(model)[0]
    spec = arch.spec_for(model)
    dense = projection_inputs(model, cal, fine_on=False)
    for p in ("q", "k", "down"):
        norms = arch.projection(layer, spec, p).weight.float().norm(dim=0)
        assert torch.allclose(fn.scale(0, p), norms, rtol=1e-5)
        score = dense[(0, p)].abs() * norms
        assert float(fn.threshold(0, p)) == pytest.approx(float(torch.quantile(score.flatten(), 0.5)), rel=1e-5)
    # different column norms: q and k keep different elements of the one input
    assert not torch.equal(fn.log_threshold[0, 0], fn.log_threshold[0, 1])


def test_keep_rule_zeroes_exactly_the_elements_below_threshold():
    model = teal_model(target=0.5)
    cal = batches()
    fine.calibrate(model, cal)
    dense = projection_inputs(model, cal, fine_on=False)
    sparse = projection_inputs(model, cal[:1], fine_on=True)
    # layer 0's q input does not depend on any earlier sparsity
    x0 = dense[(0, "q")][: sparse[(0, "q")].shape[0]]
    t = float(model.wide_fine.threshold(0, "q"))
    assert torch.equal(sparse[(0, "q")], torch.where(x0.abs() >= t, x0, torch.zeros_like(x0)))


def test_linear_sparsity_counts_a_hand_built_mask_exactly():
    """Routed groups and per-element zeros on a forward whose masks are chosen by hand: the
    counted MACs equal rows computed x inputs read, summed projection by projection."""
    model = tiny_model("llama")  # hidden 64, 4 heads of 16 over 2 KV heads, intermediate 96, 2 layers
    modeling.wrap(model, wide.WideConfig(ffn_group_size=16), seed=0)
    state = get_state(model)
    geo = state.geometry
    assert (geo.attn_groups, geo.ffn_groups, geo.columns("attn")) == (2, 6, 32)
    T = 3
    masks = {("attn", 0): [[1, 0], [1, 1], [0, 0]], ("attn", 1): [[0, 1], [0, 1], [1, 1]],
             ("ffn", 0): [[1, 1, 1, 0, 0, 0], [0] * 6, [1] * 6], ("ffn", 1): [[1, 0, 1, 0, 1, 0]] * 3}

    def fn(layer, kind, x):
        return torch.tensor(masks[(kind, layer)], dtype=torch.float32)[None]
    state.mask_fn = fn
    fine.attach(model, fine.FineConfig(target=0.5))
    # thresholds that keep everything but layer 1's down input: zero it for all tokens
    model.wide_fine.log_threshold.data[1, PROJECTIONS.index("down")] = float("inf")
    with torch.no_grad(), sparsity.track_sparsity(model) as t:
        model(input_ids=torch.tensor([[5, 6, 7]]))
    sp = t.summary()
    H, I = 64, 96
    q_rows = {0: [32, 64, 0], 1: [32, 32, 64]}
    f_rows = {0: [48, 0, 96], 1: [48, 48, 48]}
    kept = {p: 0 for p in PROJECTIONS}
    for layer in (0, 1):
        for tok in range(T):
            kept["q"] += q_rows[layer][tok] * H
            kept["k"] += 32 * H
            kept["v"] += 32 * H
            kept["o"] += H * q_rows[layer][tok]
            kept["gate"] += f_rows[layer][tok] * H
            kept["up"] += f_rows[layer][tok] * H
            kept["down"] += 0 if layer == 1 else H * f_rows[layer][tok]
    shapes = projection_shapes(geo.dims)
    dense = {p: 2 * T * shapes[p][0] * shapes[p][1] for p in PROJECTIONS}
    for p in PROJECTIONS:
        assert float(sp.linear[p]) == pytest.approx(1 - kept[p] / dense[p], abs=1e-9), p
    assert float(sp.linear_rate) == pytest.approx(1 - sum(kept.values()) / sum(dense.values()), abs=1e-9)
    # attention core: query heads run x keys attended (positions 1, 2, 3)
    heads = {0: [2, 4, 0], 1: [2, 2, 4]}
    core_kept = sum(heads[l][t] * (t + 1) for l in (0, 1) for t in range(T))
    assert float(sp.attn_core_rate) == pytest.approx(1 - core_kept / (2 * 4 * (1 + 2 + 3)), abs=1e-9)


def test_linear_sparsity_matches_the_inputs_projections_really_read():
    """TEAL thresholds inside routed groups: the count equals the nonzero inputs each projection
    received (hooks after wide's) times the rows it computes."""
    model = tiny_model("llama")
    modeling.wrap(model, wide.WideConfig(ffn_group_size=16, target_sparsity=0.3), seed=0)
    for r in model.wide_routers.modules():  # random routers: some groups run, some do not
        if isinstance(r, wide.TokenRouter):
            torch.nn.init.normal_(r.up.bias, 0, 1.0)
    fine.attach(model, fine.FineConfig(target=0.3))
    ids = batches(1, b=2, t=10, seed=3)
    fine.calibrate(model, ids)
    with torch.no_grad(), sparsity.track_sparsity(model) as t, modeling.recording_masks(model) as rec:
        seen = projection_inputs(model, ids)
    geo = get_state(model).geometry
    shapes = projection_shapes(geo.dims)
    kept = 0
    for layer in range(2):
        am = torch.cat(rec[(layer, "attn")], 0).flatten(0, 1).float()
        fm = torch.cat(rec[(layer, "ffn")], 0).flatten(0, 1).float()
        rows = {"q": am.sum(-1) * geo.columns("attn"), "gate": fm.sum(-1) * 16, "up": fm.sum(-1) * 16}
        for p in PROJECTIONS:
            nz = (seen[(layer, p)] != 0).float().sum(-1)
            kept += float((rows.get(p, torch.full_like(nz, shapes[p][0])) * nz).sum())
    dense = 2 * 10 * sum(o * i for o, i in shapes.values()) * 2
    assert float(t.summary().linear_rate) == pytest.approx(1 - kept / dense, rel=1e-6)


def test_dense_and_router_only_models_count_linear_sparsity():
    model = tiny_model("llama")
    modeling.wrap(model, wide.WideConfig(sparse_target="none"), seed=0)
    with torch.no_grad(), sparsity.track_sparsity(model) as t:
        model(input_ids=batches(1)[0])
    assert float(t.summary().linear_rate) == 0.0 and float(t.summary().attn_core_rate) == 0.0


def test_surrogate_gradient_matches_a_finite_difference():
    """The learned threshold's and scale's straight-through gradients are the exact derivatives
    of the surrogate forward x * sigmoid((log|x| + log s - log t) / tau) (central differences),
    through the output and through the kept count; the forward value is the hard rule."""
    model = teal_model(allocation="learned", per_channel=True, tau_start=0.7, tau_end=0.7)
    fn = model.wide_fine
    fn.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.float64, generator=g)
    w = torch.randn(5, 64, dtype=torch.float64, generator=g)
    c = torch.randn(5, dtype=torch.float64, generator=g)
    fn.log_threshold.data.fill_(-0.3)
    fn.log_scale["q"].data.normal_(0, 0.2, generator=g)
    y, count = fn.apply(0, "q", x, surrogate=True)
    ((y * w).sum() + (count.double() * c).sum()).backward()
    got_t = float(fn.log_threshold.grad[0, 0])
    got_s = fn.log_scale["q"].grad[0].double()

    def surrogate(theta, log_s):
        soft = torch.sigmoid((x.abs().log() + log_s - theta) / 0.7)
        return float((soft * x * w).sum() + (soft.sum(-1) * c).sum())
    eps = 1e-5
    s0 = fn.log_scale["q"].detach()[0].double()
    want_t = (surrogate(-0.3 + eps, s0) - surrogate(-0.3 - eps, s0)) / (2 * eps)
    assert got_t == pytest.approx(want_t, rel=1e-4) and got_t != 0.0
    for k in (0, 7, 33):
        e = torch.zeros(64, dtype=torch.float64)
        e[k] = eps
        want = (surrogate(-0.3, s0 + e) - surrogate(-0.3, s0 - e)) / (2 * eps)
        assert float(got_s[k]) == pytest.approx(want, rel=1e-4, abs=1e-9)
    keep = fn.keep(0, "q", x)
    assert torch.equal(y.detach(), x * keep) and torch.equal(count.detach(), keep.float().sum(-1))


def test_learned_thresholds_train_and_seeds_reproduce(tmp_path):
    from wide.training.train import TrainArgs, train

    def run(seed, name):
        model = teal_model(allocation="learned", routers="all", target=0.5)
        cal = batches(6, b=2, t=12)
        fine.calibrate(model, cal)
        modeling.freeze_backbone(model)
        assert model.wide_fine.log_threshold.requires_grad
        ids = torch.cat(cal)
        before = model.wide_fine.log_threshold.detach().clone()
        hist = train(model, ids, TrainArgs(steps=3, batch_size=2, seed=seed, save_every=0, eval_every=0),
                     tmp_path / name, progress=False)["history"]
        assert all(h["linear_sparsity"] > 0 for h in hist)
        return before, model.wide_fine.log_threshold.detach().clone(), model
    b1, a1, m1 = run(0, "a")
    _, a2, _ = run(0, "b")
    assert not torch.equal(b1, a1)  # the thresholds moved
    assert torch.equal(a1, a2)  # and the same seed moves them the same way
    # the run's saved routers carry the learned thresholds
    back = wide.load(tiny_model("llama"), tmp_path / "a" / "routers")
    assert torch.equal(back.wide_fine.log_threshold, m1.wide_fine.log_threshold)


def test_thresholds_round_trip_through_the_router_checkpoint(tmp_path):
    model = teal_model(criterion="wina", target=0.4)
    fine.calibrate(model, batches())
    wide.save_routers(model, tmp_path / "r")
    meta = json.loads((tmp_path / "r" / "wide_config.json").read_text())
    assert meta["fine"]["criterion"] == "wina" and (tmp_path / "r" / THRESHOLDS_FILE).is_file()
    ids = batches(1)[0]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    back = wide.load(tiny_model("llama"), tmp_path / "r")
    assert torch.equal(back.wide_fine.log_threshold, model.wide_fine.log_threshold)
    for p in PROJECTIONS:
        assert torch.equal(back.wide_fine.log_scale[p], model.wide_fine.log_scale[p])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)


@pytest.mark.parametrize("routers", ["none", "all"])
def test_tracked_sparsity_is_python_floats_without_a_grad_warning(routers):
    # issue 49, defect 6: README's snippet (a forward without torch.no_grad) printed
    # tensor(0.4086, dtype=torch.float64) and torch's "Converting a tensor with requires_grad=True
    # to a scalar" warning from the tracker's sums
    import warnings

    model = teal_model(target=0.4, routers=routers)
    fine.calibrate(model, batches())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with wide.track_sparsity(model) as t:
            model(batches()[0])
        sp = t.summary()
    rates = [sp.flop_rate, sp.group_rate, sp.linear_rate, sp.attn_core_rate, *sp.linear.values(),
             *(r for kind in sp.per_layer.values() for r in kind if r is not None)]
    if routers == "all":
        rates += [sp.attn_rate, sp.ffn_rate]
    assert all(type(r) is float for r in rates), [type(r) for r in rates]
    assert 0.3 < sp.linear_rate < 0.6 and sp.as_dict()["linear_rate"] == sp.linear_rate
    assert repr(sp.linear_rate) == repr(float(sp.linear_rate))  # prints as a number


def test_checkpoints_without_thresholds_still_load(tmp_path):
    model = tiny_model("llama")
    modeling.wrap(model, wide.WideConfig(), seed=0)
    wide.save_routers(model, tmp_path / "r")
    assert not (tmp_path / "r" / THRESHOLDS_FILE).exists()
    back = wide.load(tiny_model("llama"), tmp_path / "r")
    assert fine.get_fine(back) is None


def _saved(tmp_path):
    model = teal_model(target=0.4)
    fine.calibrate(model, batches())
    d = tmp_path / "r"
    wide.save_routers(model, d)
    # the files are edited below on purpose: without the manifest (loaded with require_manifest=False)
    # only their own checks speak
    (d / "wide_manifest.json").unlink()
    return d


def test_bad_thresholds_files_give_one_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _saved(tmp_path)
    f = d / THRESHOLDS_FILE
    good = load_file(str(f))
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        wide.load(tiny_model("llama"), d, require_manifest=False)
    save_file({**good, "log_threshold": good["log_threshold"][:1]}, str(f))
    with pytest.raises(CheckpointError, match=r"shape \(1, 7\).*needs \(2, 7\)"):
        wide.load(tiny_model("llama"), d, require_manifest=False)
    bad = good["log_threshold"].clone()
    bad[1, 3] = float("nan")
    save_file({**good, "log_threshold": bad}, str(f))
    with pytest.raises(CheckpointError, match="NaN"):
        wide.load(tiny_model("llama"), d, require_manifest=False)
    f.unlink()
    with pytest.raises(CheckpointError, match=f"no {THRESHOLDS_FILE}"):
        wide.load(tiny_model("llama"), d, require_manifest=False)


def test_a_changed_file_fails_the_directory_manifest(tmp_path):
    model = teal_model(target=0.4)
    fine.calibrate(model, batches())
    d = tmp_path / "r"
    wide.save_routers(model, d)
    f = d / THRESHOLDS_FILE
    data = bytearray(f.read_bytes())
    data[-8:] = b"\x00" * 8  # same size, other bytes
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its wide_manifest.json"):
        wide.load(tiny_model("llama"), d)


def test_greedy_path_takes_equal_weight_steps_up_to_the_target():
    model = teal_model(allocation="greedy", target=0.5, greedy_step=0.2)
    cal = batches(2)
    scores = fine.collect_scores(model, cal)
    tables = fine.greedy_tables(model, cal, scores, 0.5, progress=False)
    dims = get_state(model).geometry.dims
    w = fine.projection_weights(dims)
    assert len(tables) == dims.num_layers
    for path in tables:
        effs = [e for e, _ in path]
        assert effs[0] == 0.0 and effs[-1] >= 0.5 - 1e-9
        assert all(b > a for a, b in zip(effs, effs[1:]))
        for (e0, s0), (e1, s1) in zip(path, path[1:]):  # one projection moves per step
            changed = [j for j in range(7) if s0[j] != s1[j]]
            assert len(changed) == 1
            if s1[changed[0]] < 1.0:  # a full step: the same number of weights each time
                assert e1 - e0 == pytest.approx(0.2 * float(w[0]), rel=1e-6)
    fine.calibrate(model, cal, scores=scores, progress=False)
    sp = model.wide_fine.sparsity
    eff = (sp.double() * w).sum(-1)
    assert all(abs(float(e) - 0.5) <= 0.2 * float(w[0]) for e in eff)


def test_greedy_leaves_the_model_as_it_was():
    model = teal_model(allocation="greedy", target=0.3, greedy_step=0.25)
    before = model.wide_fine.log_threshold.detach().clone()
    cal = batches(1)
    fine.greedy_tables(model, cal, fine.collect_scores(model, cal), 0.3, progress=False)
    assert torch.equal(model.wide_fine.log_threshold.detach(), before) and model.wide_fine.enabled


def test_shift_lands_learned_thresholds_on_the_target():
    model = teal_model(allocation="learned", target=0.35)
    cal = batches(3)
    fine.calibrate(model, cal)
    model.wide_fine.log_threshold.data += 0.5  # as if training had drifted above the budget
    fine.shift_to_target(model, cal, 0.35, iterations=20)
    assert fine.measured_linear_sparsity(model, cal) == pytest.approx(0.35, abs=0.02)


def test_bad_fine_configs_are_refused():
    with pytest.raises(ValueError, match="per_channel"):
        fine.FineConfig(per_channel=True)
    with pytest.raises(ValueError, match="criterion must be one of"):
        fine.FineConfig(criterion="x")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="not wrapped"):
        fine.attach(model)
    model = teal_model()
    with pytest.raises(ValueError, match="already has"):
        fine.attach(model)


def test_teacher_mode_runs_the_dense_backbone():
    from wide.training.train import teacher_mode

    model = teal_model(target=0.6)
    cal = batches(2)
    fine.calibrate(model, cal)
    dense = tiny_model("llama")
    with torch.no_grad(), teacher_mode(model):
        a = model(input_ids=cal[0]).logits
    with torch.no_grad():
        b = dense(input_ids=cal[0]).logits
        c = model(input_ids=cal[0]).logits
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(c, b, atol=1e-3)


def test_unwrap_removes_the_thresholds_and_their_hooks():
    model = teal_model(target=0.6)
    fine.calibrate(model, batches(2))
    modeling.unwrap(model)
    assert fine.get_fine(model) is None
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, tiny_model("llama")(input_ids=ids).logits, atol=1e-6)
