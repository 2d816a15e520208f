"""scripts/ship_routers.py --eval: a set with its run, shipped with wide eval's records of the set
and of dense (one protocol, refused otherwise), into a stand-in for src/wide/shipped."""
import json
import sys

import pytest
from conftest import load_script


def _mod():
    return load_script("scripts/ship_routers.py")


def _eval(path, method, ppl, limit=500, device="NVIDIA H100 80GB HBM3"):
    rec = {"op": "quality", "method": method, "ppl": ppl, "linear_sparsity": 0.53 if method != "dense" else 0.0,
           "attn_core_sparsity": 0.249 if method != "dense" else 0.0, "avg": 0.42, "limit": limit,
           "heldout_tokens": 53805}
    path.write_text(json.dumps({"device": device, "command": f"wide eval {method}", "records": [rec]}))
    return path


def _set(d):
    d.mkdir()
    run = {"command": "python experiments/head_routers_fine_cpu.py --seed 0", "design": "(a)",
           "thresholds": "smollm2-135m-fine-50", "steps": 150, "tokens": 2457600, "date": "2026-12-07",
           "wall_s": 124.5, "tokens_per_s": 19796.0, "machine": {"gpu": "NVIDIA H100 80GB HBM3"},
           "train_args": {"loss": "kd", "seed": 0, "batch_size": 64},
           "to_library": {"command": "python experiments/head_routers_fine_cpu.py --to-library", "target": 0.25}}
    cfg = {"wide_config": {"target_sparsity": 0.26}, "fine": {"target": 0.5}, "run": run}
    (d / "wide_config.json").write_text(json.dumps(cfg))
    (d / "routers.safetensors").write_bytes(b"x")
    return d


def _ship(mod, monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["ship_routers.py", *map(str, argv)])
    mod.main()


def test_ship_eval_writes_provenance(tmp_path, monkeypatch):
    mod = _mod()
    monkeypatch.setattr(mod, "SHIPPED", tmp_path / "shipped")
    ck = _set(tmp_path / "set")
    ev, dense = _eval(tmp_path / "eval_set.json", "heads1of3+learned", 31.2), _eval(tmp_path / "dense.json", "dense", 22.5)
    _ship(mod, monkeypatch, ["--eval", ev, "--dense-eval", dense, "--checkpoint", ck, "--method", "heads",
                             "--code-commit", "abc123", "--results-in-repo", "experiments/results/x", "toy-heads"])
    out = tmp_path / "shipped" / "toy-heads"
    assert (out / "routers.safetensors").read_bytes() == b"x"
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["method"], prov["target_sparsity"], prov["attn_core_target"], prov["stage"]) == ("heads", 0.5, 0.25, 1)
    assert (prov["loss"], prov["tokens"], prov["batch"], prov["code_commit"]) == ("kd", 2457600, "64 x 256", "abc123")
    assert prov["conversion_command"].endswith("--to-library")
    ev_ = prov["evaluation"]
    assert (ev_["routers"]["ppl"], ev_["dense"]["ppl"], ev_["routers"]["attn_core_sparsity"]) == (31.2, 22.5, 0.249)
    assert ev_["results_files"] == ["experiments/results/x/eval_set.json", "experiments/results/x/dense.json"]
    assert "re_set" not in prov


def test_ship_eval_keeps_the_re_set(tmp_path, monkeypatch):
    # a set re-set after its conversion (experiments/heads_offsets_sample_cpu.py) ships that record too
    mod = _mod()
    monkeypatch.setattr(mod, "SHIPPED", tmp_path / "shipped")
    ck = _set(tmp_path / "set")
    cfg = json.loads((ck / "wide_config.json").read_text())
    re_set = {"command": "python experiments/heads_offsets_sample_cpu.py --linear-target 0.5", "threshold_shift": -0.08,
              "previous": {"command": "python experiments/heads_offsets_sample_cpu.py --target 0.26"}}
    cfg["run"]["offsets_resample"] = re_set
    (ck / "wide_config.json").write_text(json.dumps(cfg))
    ev, dense = _eval(tmp_path / "eval_set.json", "heads1of3+learned", 30.0), _eval(tmp_path / "dense.json", "dense", 22.5)
    monkeypatch.setattr(mod, "ROOT", tmp_path)  # records inside the repository: quoted by their own paths
    _ship(mod, monkeypatch, ["--eval", ev, "--dense-eval", dense, "--checkpoint", ck, "--method", "heads", "toy"])
    prov = json.loads((tmp_path / "shipped" / "toy" / "provenance.json").read_text())
    assert prov["re_set"] == re_set and prov["evaluation"]["results_files"] == ["eval_set.json", "dense.json"]


def test_ship_eval_refuses_two_protocols(tmp_path, monkeypatch):
    mod = _mod()
    monkeypatch.setattr(mod, "SHIPPED", tmp_path / "shipped")
    ck = _set(tmp_path / "set")
    ev = _eval(tmp_path / "eval_set.json", "heads1of3+learned", 31.2, limit=500)
    dense = _eval(tmp_path / "dense.json", "dense", 22.5, limit=100)
    with pytest.raises(SystemExit, match="not one protocol"):
        _ship(mod, monkeypatch, ["--eval", ev, "--dense-eval", dense, "--checkpoint", ck, "--method", "heads", "x"])
    assert not (tmp_path / "shipped" / "x").exists()
    with pytest.raises(SystemExit):  # --eval without --dense-eval
        _ship(mod, monkeypatch, ["--eval", ev, "--checkpoint", ck, "--method", "heads", "x"])
