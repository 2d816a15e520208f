"""Head routers beside frozen per-element thresholds (issue 48's design (a) in the library):
wide.method.head_choice (the oracle label, the input-only choice, offsets to an attention-core
rate) and `wide calibrate --thresholds` end to end on a tiny local model."""

import json
import shutil

import pytest
import torch
from conftest import tiny_model, write_tiny_run
from safetensors.torch import load_file

import wide
from wide.base import arch
from wide.cli import main
from wide.io.serialization import ROUTERS_FILE, THRESHOLDS_FILE
from wide.method.head_choice import HeadChoice, calibrate_core_offsets, oracle_pick

HEADS = dict(sparse_target="attention", attn_rule="skip_upto", attn_skip=1, attn_dense_layers=[0])


def _heads_model(**kw):
    model = wide.wrap(tiny_model("llama", num_hidden_layers=3), wide.WideConfig(**HEADS, **kw), seed=0)
    wide.freeze_backbone(model)
    return model


def _training_forward(model, ids):
    model.train()
    model.wide_state.tau = 1.0
    try:
        return model(input_ids=ids, labels=ids).loss
    finally:
        model.wide_state.tau = None


def test_input_choice_keeps_the_down_bias_at_zero_and_moves_the_up_biases_alike():
    model = _heads_model(router_init="random")
    with torch.no_grad():
        for lr in model.wide_routers:
            if lr.attn is not None:
                lr.attn.down.bias.normal_()
    choice = HeadChoice(model, input_choice=True)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    _training_forward(model, ids).backward()
    routed = [lr.attn for lr in model.wide_routers if lr.attn is not None]
    assert model.wide_routers[0].attn is None and len(routed) == 2
    for r in routed:
        assert not r.down.bias.requires_grad and torch.equal(r.down.bias, torch.zeros_like(r.down.bias))
        g = r.up.bias.grad.view(-1, 2)
        assert g.abs().sum() > 0 and torch.equal(g, g[:1].expand_as(g))  # every group's exec / skip alike
    choice.remove()
    for r in routed:
        r.up.bias.grad = None
    _training_forward(model, ids).backward()
    assert any(not torch.equal(g, g[:1].expand_as(g)) for g in (r.up.bias.grad.view(-1, 2) for r in routed))


def test_the_oracle_label_is_the_smallest_contribution_and_its_loss_reaches_the_routers():
    model = _heads_model()
    choice = HeadChoice(model, oracle_ce=3.0)
    spec, cols = arch.spec_for(model), model.wide_state.geometry.columns("attn")
    raw, handles = {}, []
    for i, layer in enumerate(arch.decoder_layers(model)):
        o = arch.projection(layer, spec, "o")
        handles.append(o.register_forward_pre_hook(lambda mod, a, i=i: raw.__setitem__(i, a[0].detach()),
                                                   prepend=True))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    task = _training_forward(model, ids)
    assert sorted(choice.labels) == sorted(choice.scores) == [1, 2]  # layer 0 is dense: no label, no score
    for i in (1, 2):
        o = arch.projection(arch.decoder_layers(model)[i], spec, "o")
        assert torch.equal(choice.labels[i], oracle_pick(raw[i], o.weight, cols))
    # the cross-entropy of the skip scores (-margins) toward the label, weighted
    want = torch.stack([torch.nn.functional.cross_entropy(choice.scores[i].reshape(-1, 2), choice.labels[i].reshape(-1))
                        for i in (1, 2)]).mean() * 3.0
    aux = choice.loss()
    assert torch.allclose(aux, want) and not choice.scores and not choice.labels
    (task + aux).backward()
    assert all(lr.attn.up.weight.grad.abs().sum() > 0 for lr in model.wide_routers[1:])
    # nothing is read outside a routed training forward (evaluation, the distillation teacher)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert not choice.scores and not choice.labels
    with pytest.raises(RuntimeError, match="no routed training forward"):
        choice.loss()
    choice.remove()
    for h in handles:
        h.remove()
    assert choice._observe not in model.wide_state.input_observers


def test_head_choice_needs_a_skip_rule():
    model = wide.wrap(tiny_model("llama"), wide.WideConfig(sparse_target="attention"))
    with pytest.raises(ValueError, match="attn_rule"):
        HeadChoice(model, oracle_ce=1.0)


def test_core_offsets_count_the_dense_layers():
    model = _heads_model(router_init="random")
    batches = [torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    for mode in ("per_module", "global"):
        calibrate_core_offsets(model, batches, 0.2, mode)
        with wide.track_sparsity(model) as tracker, torch.no_grad():
            for b in batches:
                model(input_ids=b)
        assert tracker.summary().attn_core_rate == pytest.approx(0.2, abs=0.02)


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory):
    """A thresholds set (wide calibrate --hybrid, no router), head routers trained beside it, and a
    routers-only set, on the tiny local model."""
    tmp = tmp_path_factory.mktemp("heads")
    common = write_tiny_run(tmp)
    train = ["--steps", "3", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "4"]
    assert main(["calibrate", *common, *train, "--hybrid", "--sparse-target", "none", "--fine-per-channel",
                 "--out", str(tmp / "thr")]) == 0
    assert main(["calibrate", *common, "--steps", "1", "--batch-size", "2", "--eval-every", "0",
                 "--offset-batches", "1", "--sparse-target", "attention", "--out", str(tmp / "plain")]) == 0
    heads = ["--thresholds", str(tmp / "thr" / "routers"), "--sparse-target", "attention", "--attn-rule", "skip_upto",
             "--attn-skip", "1", "--attn-dense-layers", "0", "--loss", "kd", "--loss-mode", "groups", "--budget",
             "layer", "--target", "0.26", "--oracle-ce", "3", "--input-choice", "--lr", "1e-2", "--offsets",
             "per_module", "--core-target", "0.2"]
    assert main(["calibrate", *common, *train, *heads, "--out", str(tmp / "heads")]) == 0
    return tmp, common, heads


def test_calibrate_trains_head_routers_beside_frozen_thresholds(head_runs, capsys):
    tmp, common, _ = head_runs
    thr, out = tmp / "thr" / "routers", tmp / "heads" / "routers"
    # the thresholds are the set's, bit for bit
    a, b = load_file(str(thr / THRESHOLDS_FILE)), load_file(str(out / THRESHOLDS_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "wide_config.json").read_text())
    assert meta["fine"] == json.loads((thr / "wide_config.json").read_text())["fine"]
    cfg = meta["wide_config"]
    assert (cfg["sparse_target"], cfg["attn_rule"], cfg["attn_skip"], cfg["attn_dense_layers"]) == \
        ("attention", "skip_upto", 1, [0])
    # attention routers in layer 1 only (the tiny model has 2 layers; layer 0 dense), trained, input-only
    routers = load_file(str(out / ROUTERS_FILE))
    assert {k.split(".")[0] for k in routers if k.endswith("weight")} == {"1"}
    assert not any(".ffn." in k for k in routers)
    assert routers["1.attn.up.weight"].abs().sum() > 0  # dense start: zero before training
    assert torch.equal(routers["1.attn.down.bias"], torch.zeros_like(routers["1.attn.down.bias"]))
    d = routers["1.attn.up.bias"].view(-1, 2)
    assert torch.equal(d[:, 0] - d[:, 1], (d[:, 0] - d[:, 1])[:1].expand(d.shape[0]))
    run = json.loads((tmp / "heads" / "run.json").read_text())
    h = run["heads"]
    assert (h["thresholds"], h["oracle_ce"], h["input_choice"], h["core_target"]) == (str(thr), 3.0, True, 0.2)
    assert h["oracle_log"]["calls"] == 3 and 0 <= h["oracle_log"]["oracle_match"] <= 1
    assert h["offsets"]["attn_core_rate"] == pytest.approx(0.2, abs=0.05)
    assert all("aux" in r for r in json.loads((tmp / "heads" / "history.json").read_text()))

    # the set evaluates and generates on its own, thresholds and routers together
    assert main(["eval", *common, "--routers", str(out), "--tasks", "--out", str(tmp / "res")]) == 0
    rec = json.loads((tmp / "res.json").read_text())["records"][0]
    assert rec["attn_core_sparsity"] == pytest.approx(0.2, abs=0.1) and rec["linear_sparsity"] > 0.3
    assert rec["routing"] == "skip_upto1"
    capsys.readouterr()
    model_args = [*common[:2], "--device", "cpu"]  # (generate reads no data)
    assert main(["generate", *model_args, "--routers", str(out), "--prompt", "the cat sat",
                 "--max-new-tokens", "3"]) == 0
    assert "[auto -> hybrid, skip_upto1, backend torch]" in capsys.readouterr().out


def test_recover_keeps_a_heads_sets_thresholds_and_attention_rate(head_runs):
    # stage 2 on a heads set (wide recover): the adapters train, the thresholds stay the set's bit
    # for bit, and the offsets return to the attention-core rate the set had (not a threshold
    # shift onto its routers' training target)
    tmp, common, _ = head_runs
    src = tmp / "heads" / "routers"
    train = ["--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "4"]
    assert main(["recover", *common, *train, "--routers", str(src), "--lora-r", "4", "--out", str(tmp / "s2h")]) == 0
    out = tmp / "s2h" / "recovered"
    a, b = load_file(str(src / THRESHOLDS_FILE)), load_file(str(out / THRESHOLDS_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "wide_config.json").read_text())
    before = json.loads((tmp / "heads" / "run.json").read_text())["heads"]["offsets"]["attn_core_rate"]
    h = meta["head_offsets"]
    assert h["core_target"] == pytest.approx(before, abs=0.02) and h["attn_core_rate"] == pytest.approx(before, abs=0.05)


def test_calibrate_thresholds_errors(head_runs, capsys):
    tmp, common, heads = head_runs
    corrupt = tmp / "corrupt"
    shutil.copytree(tmp / "thr" / "routers", corrupt, dirs_exist_ok=True)
    (corrupt / THRESHOLDS_FILE).write_bytes(b"not a safetensors file")
    base = ["calibrate", *common, "--steps", "1", "--out", str(tmp / "bad")]

    def swap(flag, value):
        i = heads.index(flag)
        return heads[:i + 1] + [value] + heads[i + 2:]

    cases = [
        (swap("--thresholds", str(tmp / "missing")), "--thresholds: router checkpoint"),
        (swap("--thresholds", str(corrupt)), "--thresholds"),
        (swap("--thresholds", str(tmp / "plain" / "routers")), "holds no per-element thresholds"),
        (swap("--sparse-target", "all"), "attention head routers only"),
        ([*heads, "--hybrid"], "--hybrid learns new thresholds"),
        (swap("--loss-mode", "linear"), "--loss-mode groups or flops"),
        (swap("--attn-rule", "independent")[:heads.index("--attn-skip")] + heads[heads.index("--attn-skip") + 2:],
         "--oracle-ce and --input-choice train the choice"),
        (["--core-target", "0.2"], "--core-target sets the offsets"),
    ]
    for argv, message in cases:
        assert main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    assert not (tmp / "bad").exists()


def test_compare_heads_rows_beside_the_learned_row(tmp_path, monkeypatch, capsys):
    """`wide compare`'s heads and heads_lora: head routers beside the learned row's thresholds at
    the same target (frozen in both stages), at the attention-core target, served from the cache
    on a rerun."""
    from wide import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    common = write_tiny_run(tmp_path)
    argv = ["compare", *common, "--axis", "linear", "--methods", "dense", "learned", "heads", "heads_lora",
            "--targets", "0.5", "--steps", "3", "--batch-size", "2", "--tasks", "--offset-batches", "4",
            "--fine-calib-sequences", "2", "--fine-per-channel", "--heads-core-target", "0.2", "--heads-target",
            "0.26", "--lr", "1e-2", "--quiet", "--runs", str(tmp_path / "cmp"), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["settings"]["heads"]["core_target"] == 0.2 and doc["settings"]["heads"]["loss"] == "kd"
    recs = {r["name"]: r for r in doc["records"]}
    assert list(recs) == ["dense", "learned", "heads", "heads_lora"]
    learned = recs["learned"]
    for name, stage in (("heads", 1), ("heads_lora", 2)):
        r = recs[name]
        assert (r["method"], r["stage"], r["loss"], r["routing"]) == ("heads", stage, "kd", "skip_upto1")
        assert r["attn_core_sparsity"] == pytest.approx(0.2, abs=0.1) and r["attn_core_target"] == 0.2
        assert r["linear_sparsity"] > learned["linear_sparsity"] > 0
    assert learned["attn_core_sparsity"] == 0.0
    runs = tmp_path / "cmp"
    thr = load_file(str(runs / "learned-50" / "stage1" / "final" / THRESHOLDS_FILE))
    for stage in (1, 2):
        own = load_file(str(runs / "heads20-50" / f"stage{stage}" / "final" / THRESHOLDS_FILE))
        assert own.keys() == thr.keys() and all(torch.equal(own[k], thr[k]) for k in thr), stage
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("cached evaluation") == 4 and "stage 1 for" not in out and "stage 2" not in out
