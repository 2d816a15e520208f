"""Routers shipped inside the package (wide.io.pretrained): listed, traceable to a results file and a
command, loadable by name from Python and the CLI, refused when damaged or made for another shape."""
import json
import shutil

import pytest
import torch
from conftest import tiny_model, write_tiny_run
from safetensors.torch import load_file

import wide
from wide.base import arch
from wide.io import pretrained
from wide.cli import main
from wide.io.serialization import CheckpointError, read_manifest

NAMES = ("smollm2-135m-25", "smollm2-135m-50")


def test_names_and_provenance():
    assert set(NAMES) <= set(pretrained.names())
    for name in NAMES:
        prov = pretrained.provenance(name)
        meta = json.loads((pretrained.path(name) / "wide_config.json").read_text())
        run = meta["run"]
        # provenance agrees with what wide calibrate recorded in the routers themselves
        assert prov["command"] == run["command"] and prov["command"].startswith("wide calibrate")
        assert prov["tokens"] == run["tokens"] == run["steps"] * run["train_args"]["batch_size"] * 256
        assert (prov["seed"], prov["loss"]) == (run["train_args"]["seed"], run["train_args"]["loss"])
        assert prov["target_sparsity"] == meta["wide_config"]["target_sparsity"] == int(name[-2:]) / 100
        assert prov["code_commit"] and prov["data"]["data"] == "wiki" and prov["decontamination"]["dropped"] > 0
        ev = prov["evaluation"]
        assert ev["routers"]["limit"] == ev["dense"]["limit"] == 500
        assert ev["dense"]["ppl"] < ev["routers"]["ppl"]
        assert abs(ev["routers"]["sparsity"] - prov["target_sparsity"]) < 0.02
        assert ev["results_file"].startswith(("bench/results/quality_scaling/", "bench/results/routing_quality/"))
        assert read_manifest(pretrained.path(name)) is not None  # files as wide calibrate sealed them


def test_results_file_named_in_provenance_holds_the_same_numbers():
    root = pretrained.SHIPPED.parents[2]
    for name in NAMES:
        ev = pretrained.provenance(name)["evaluation"]
        f = root / ev["results_file"]
        if not f.is_file():
            pytest.skip("not a source checkout")
        rec = json.loads(f.read_text())["records"][0]
        assert rec["ppl"] == ev["routers"]["ppl"] and rec["avg"] == ev["routers"]["avg"]


def _smollm2_shape():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(arch.hf_config("smollm2-135m"), dtype=torch.float32)


def test_from_pretrained_by_name_loads_the_shipped_tensors():
    # Random weights of the default model's shape: the shipped routers load onto them exactly.
    model = wide.from_pretrained("smollm2-135m-50", base_model=_smollm2_shape())
    saved = load_file(str(pretrained.path("smollm2-135m-50") / "routers.safetensors"))
    state = model.wide_routers.state_dict()
    assert set(saved) == set(state)
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert model.wide_state.config.target_sparsity == 0.5
    ids = torch.randint(0, 1000, (1, 16))
    with wide.track_sparsity(model) as tracker:
        model(input_ids=ids)
    assert 0.0 < tracker.summary().flop_rate < 1.0


def test_shipped_routers_refuse_another_model_shape():
    with pytest.raises(CheckpointError, match="trained for a different model"):
        wide.load(tiny_model(), "smollm2-135m-25")


def test_unknown_name_and_damaged_copy(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match=r"does not exist .*no shipped set's name \(wide.pretrained.names"):
        wide.load(tiny_model(), "smollm2-135m-75")
    with pytest.raises(CheckpointError, match="is not a directory$"):  # a path: no shipped-name hint
        wide.load(tiny_model(), str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no shipped routers named 'x'; shipped: smollm2-135m-25"):
        pretrained.path("x")
    fake = tmp_path / "shipped"
    shutil.copytree(pretrained.SHIPPED, fake)
    monkeypatch.setattr(pretrained, "SHIPPED", fake)
    f = fake / "smollm2-135m-50" / "routers.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fail their sha256 manifest: reinstall wide"):
        pretrained.resolve("smollm2-135m-50")
    assert pretrained.resolve("smollm2-135m-25") == fake / "smollm2-135m-25"  # the other one is intact


def test_a_local_directory_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pretrained.resolve("smollm2-135m-50") == pretrained.SHIPPED / "smollm2-135m-50"
    (tmp_path / "smollm2-135m-50").mkdir()
    assert pretrained.resolve("smollm2-135m-50") == "smollm2-135m-50"
    assert pretrained.name_of(pretrained.SHIPPED / "smollm2-135m-25") == "smollm2-135m-25"
    assert pretrained.name_of(tmp_path / "smollm2-135m-50") is None


def test_cli_takes_names_where_it_takes_router_directories(tmp_path, capsys):
    opts = write_tiny_run(tmp_path)
    model_dir = opts[opts.index("--model") + 1]
    # The name resolves (no "does not exist"); the tiny model's shape is then refused in one line.
    rc = main(["generate", "--model", model_dir, "--routers", "smollm2-135m-50", "--prompt", "the cat",
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "trained for a different model" in err and "Traceback" not in err
    rc = main(["eval", "--model", model_dir, "--routers", "no-such-routers"])
    err = capsys.readouterr().err
    assert rc == 2 and "--routers" in err and "no-such-routers" in err


def test_package_data_declares_the_shipped_files():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    cfg = tomllib.loads((pretrained.SHIPPED.parents[2] / "pyproject.toml").read_text())
    assert "shipped/*/*" in cfg["tool"]["setuptools"]["package-data"]["wide"]
    for name in NAMES:
        files = {p.name for p in pretrained.path(name).iterdir()}
        assert files == {"routers.safetensors", "wide_config.json", "wide_manifest.json", "provenance.json"}


def _routers_for(model_dir, out, **config):
    """Routers of a model loaded from ``model_dir`` (so they record it as their base), saved to ``out``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wide.wrap(model, wide.WideConfig(ffn_group_size=32, **config), seed=0)
    wide.save_routers(model, out)
    return out


def test_a_local_directory_overwritten_in_place_is_refused_before_anything_loads(tmp_path, capsys):
    # issue 41, defect 1: 64 KiB of routers.safetensors overwritten, its size unchanged; the
    # directory's own manifest catches it, in Python and on the command line before any load
    opts = write_tiny_run(tmp_path)
    d = _routers_for(opts[1], tmp_path / "r", router_rank=128)  # a file well over 64 KiB
    f = d / "routers.safetensors"
    size = f.stat().st_size
    assert size > 96 * 1024
    with open(f, "r+b") as fh:
        fh.seek(16 * 1024)
        fh.write(torch.randint(0, 256, (64 * 1024,), generator=torch.Generator().manual_seed(0),
                               dtype=torch.uint8).numpy().tobytes())
    assert f.stat().st_size == size
    with pytest.raises(CheckpointError, match="routers.safetensors is corrupt or was changed"):
        wide.load(tiny_model(), d)
    capsys.readouterr()
    assert main(["eval", *opts, "--routers", str(d), "--tasks"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--routers" in err and "routers.safetensors is corrupt" in err, err
    assert "loaded " not in out and "Traceback" not in err, out  # refused before the model or data loads


def test_routers_record_their_base_model_as_an_absolute_path_and_load_from_anywhere(tmp_path, monkeypatch):
    # issue 41, defect 7: a relative recorded path sent wide.from_pretrained to the hub when run
    # from another working directory
    write_tiny_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    _routers_for("model", tmp_path / "runs" / "a" / "routers")  # --model model, as typed in tmp_path
    meta_file = tmp_path / "runs" / "a" / "routers" / "wide_config.json"
    assert json.loads(meta_file.read_text())["base_model"] == str(tmp_path / "model")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert wide.from_pretrained(tmp_path / "runs" / "a" / "routers").config.num_hidden_layers == 2
    # what a checkpoint from before recorded: the path relative to where the command ran, found
    # beside one of the router directory's parents
    old = json.loads(meta_file.read_text())
    (tmp_path / "runs" / "a" / "routers" / "wide_manifest.json").unlink()  # (the file below is edited)
    meta_file.write_text(json.dumps({**old, "base_model": "model"}))
    assert wide.from_pretrained(tmp_path / "runs" / "a" / "routers",
                                require_manifest=False).config.num_hidden_layers == 2
    # a base model that is nowhere here: one clear error, no hub lookup
    for missing in ("gone/model", str(tmp_path / "gone"), "some-org/some-model"):
        meta_file.write_text(json.dumps({**old, "base_model": missing}))
        with pytest.raises(CheckpointError, match=f"trained on {missing}, which is not a model directory here.*"
                                                  "base_model="):
            wide.from_pretrained(tmp_path / "runs" / "a" / "routers")


def test_loading_routers_onto_another_model_of_the_same_shape_warns(tmp_path, capsys):
    # issue 41, defect 7: the recorded base model was never compared
    import warnings

    from transformers import AutoModelForCausalLM

    from wide.io.serialization import BaseModelWarning

    opts = write_tiny_run(tmp_path)
    shutil.copytree(tmp_path / "model", tmp_path / "other")  # same shape, another model
    routers = _routers_for(tmp_path / "model", tmp_path / "r")
    other = lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "other", dtype=torch.float32)  # noqa: E731
    with pytest.warns(BaseModelWarning) as caught:
        wide.load(other(), routers)
    text = str(caught[0].message)
    assert "\n" not in text and str(tmp_path / "model") in text and str(tmp_path / "other") in text, text
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseModelWarning)
        wide.load(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), routers)  # its own base: silent
        wide.from_pretrained(routers, base_model=other())  # another model, on purpose: silent
        wide.load(other(), routers, check_base=False)
    capsys.readouterr()
    assert main(["eval", *opts, "--model", str(tmp_path / "other"), "--routers", str(routers), "--tasks",
                 "--max-eval-sequences", "1"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "trained on" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: routers in {routers} were trained on "), warned


FINE_NAMES = ("smollm2-135m-fine-25", "smollm2-135m-fine-50")


def test_shipped_learned_thresholds_trace_to_the_frontier():
    root = pretrained.SHIPPED.parents[2]
    for name in FINE_NAMES:
        prov = pretrained.provenance(name)
        meta = json.loads((pretrained.path(name) / "wide_config.json").read_text())
        assert (prov["method"], prov["axis"], prov["stage"]) == (meta["method"], "linear", 1) == ("learned", "linear", 1)
        assert prov["target_sparsity"] == meta["target"] == int(name[-2:]) / 100
        assert prov["command"].startswith("wide compare") and "--axis linear" in prov["command"]
        assert prov["tokens"] == prov["steps"] * 64 * 256 and prov["code_commit"]
        ev = prov["evaluation"]
        assert ev["routers"]["limit"] == ev["dense"]["limit"] == 500
        assert abs(ev["routers"]["linear_sparsity"] - prov["target_sparsity"]) < 0.01
        assert read_manifest(pretrained.path(name)) is not None
        f = root / ev["results_file"]
        if f.is_file():  # a source checkout: the numbers are the committed record's
            rec = next(r for r in json.loads(f.read_text())["records"]
                       if (r["method"], r.get("target")) == ("learned", prov["target_sparsity"]))
            assert rec["ppl"] == ev["routers"]["ppl"] and rec["avg"] == ev["routers"]["avg"]


def test_from_pretrained_restores_shipped_thresholds():
    from wide.method import fine

    model = wide.from_pretrained("smollm2-135m-fine-50", base_model=_smollm2_shape())
    saved = load_file(str(pretrained.path("smollm2-135m-fine-50") / "thresholds.safetensors"))
    f = fine.get_fine(model)
    assert f is not None and torch.equal(f.log_threshold.detach().cpu(), saved["log_threshold"])
    assert set(f.log_scale) and not any(p.numel() for p in model.wide_routers.parameters())  # thresholds only
    ids = torch.randint(0, 1000, (1, 16))
    with wide.track_sparsity(model) as tracker:
        model(input_ids=ids)
    sp = tracker.summary()
    assert sp.flop_rate == 0.0 and 0.0 < sp.linear_rate < 1.0  # no group skipped, elements are


HEADS_NAME = "smollm2-135m-heads25-fine-50"


def test_shipped_heads_set_traces_to_its_records():
    # issue 48's design (a): head-group routers (at most one of SmolLM2's three KV groups skipped per
    # token, layer 0 dense) trained beside the frozen smollm2-135m-fine-50 thresholds
    root = pretrained.SHIPPED.parents[2]
    prov = pretrained.provenance(HEADS_NAME)
    meta = json.loads((pretrained.path(HEADS_NAME) / "wide_config.json").read_text())
    cfg = meta["wide_config"]
    assert (cfg["sparse_target"], cfg["attn_rule"], cfg["attn_skip"], cfg["attn_dense_layers"]) == (
        "attention", "skip_upto", 1, [0])
    assert (prov["method"], prov["axis"], prov["stage"], prov["loss"]) == ("heads", "linear", 1, "kd")
    assert prov["thresholds"] == "smollm2-135m-fine-50" and prov["target_sparsity"] == meta["fine"]["target"] == 0.5
    assert prov["tokens"] == prov["steps"] * 64 * 256 and prov["code_commit"] and prov["conversion_command"]
    ev = prov["evaluation"]
    for key in ("limit", "heldout_tokens"):  # one protocol for the set and dense
        assert ev["routers"][key] == ev["dense"][key]
    # the offsets were re-set a little over the target (0.26 of the groups) so that held-out text, which
    # skips slightly less than calibration text, still sees >= 25 % (heads_offsets_sample_cpu)
    assert 0 <= ev["routers"]["attn_core_sparsity"] - prov["attn_core_target"] < 0.02
    # thresholds shifted so that all linear MACs, the skipped groups' q/o included, are at the target
    assert prov["re_set"]["linear_target"] == prov["target_sparsity"]
    assert abs(ev["routers"]["linear_sparsity"] - prov["target_sparsity"]) < 0.01
    assert read_manifest(pretrained.path(HEADS_NAME)) is not None
    for f, kind in zip(ev["results_files"], ("routers", "dense")):
        path = root / f
        if path.is_file():  # a source checkout: the numbers are the committed records'
            recs = [r for r in json.loads(path.read_text())["records"]
                    if (r["method"] == "dense") == (kind == "dense")]
            assert any(r["ppl"] == ev[kind]["ppl"] and r.get("avg") == ev[kind]["avg"] for r in recs), f


def test_shipped_heads_set_runs_hybrid_from_the_cli_on_the_pytorch_path(default_model_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The history of the city begins in the twelfth century, when"
    # (--backend torch: under the tests' TRITON_INTERPRET=1 "auto" would pick the interpreted kernels)
    assert main(["generate", "--model", str(default_model_dir), "--routers", HEADS_NAME, "--device", "cpu",
                 "--backend", "torch", "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "[auto -> hybrid, skip_upto1, backend torch]" in out
    text = out.split("--- ")[1].splitlines()[1]
    model = wide.from_pretrained(HEADS_NAME, AutoModelForCausalLM.from_pretrained(default_model_dir,
                                                                                  dtype=torch.float32))
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    eng = wide.accelerate(model, backend="torch", mode="auto")
    assert eng.mode == "hybrid"
    res = eng.generate([tok.encode(prompt)], max_new_tokens=6)
    assert text == tok.decode(res.tokens[0], skip_special_tokens=True)
