"""bench/seeds_summary.py: mean and range over seeds of `wide compare` results, from synthetic files."""
import json

import pytest
from conftest import load_script

TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "boolq": 0.5, "winogrande": 0.5, "piqa": 0.5, "openbookqa": 0.25,
          "hellaswag": 0.25}


def _mod():
    return load_script("bench/seeds_summary.py")


def _rec(name, stage, target, ppl, acc, seed):
    return {"op": "quality", "name": name, "label": name, "method": name, "stage": stage, "target": target,
            "sparsity": target or 0.0, "ppl": ppl, **{t: acc for t in TASKS}, "avg": acc, "limit": 200,
            "tasks_detail": {t: {"metric": acc, "chance": CHANCE[t]} for t in TASKS}, "loss": "ce",
            "tokens": 1000, "seed": None if name == "dense" else seed, "routing": None if name == "dense" else "token"}


def _write(tmp_path, seed, wide_ppl, wide_acc, **settings):
    doc = {"command": f"wide compare --seed {seed}", "device": "NVIDIA H100", "torch": "2.11.0",
           "date": f"2026-12-0{seed + 1}T10:00:00",
           "settings": {"seed": seed, "steps": 400, "lr": 0.002, "targets": [0.5], **settings},
           "records": [_rec("dense", 0, None, 22.5, 0.45, seed), _rec("wide", 1, 0.5, wide_ppl, wide_acc, seed),
                       _rec("dynamic_depth", 1, 0.5, 1000.0 + seed, 0.34, seed)]}
    p = tmp_path / f"s{seed}.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_mean_and_range_over_seeds(tmp_path):
    ss = _mod()
    files = [_write(tmp_path, s, ppl, acc) for s, ppl, acc in ((0, 60.0, 0.40), (1, 90.0, 0.38), (2, 75.0, 0.42))]
    assert ss.main([*files, "--out", str(tmp_path / "out" / "q")]) == 0
    doc = json.loads((tmp_path / "out" / "q.json").read_text())
    assert len(doc["records"]) == 9 and [i["seed"] for i in doc["inputs"]] == [0, 1, 2]
    assert (doc["device"], doc["torch"], doc["date"]) == ("NVIDIA H100", "2.11.0", "2026-12-03T10:00:00")
    wide = next(r for r in doc["aggregated"] if r["name"] == "wide")
    assert wide["seeds"] == [0, 1, 2] and wide["n"] == 3
    assert (wide["routing"], wide["tokens"], wide["loss"]) == ("token", 1000, "ce")  # the record fields ANCHORS.md names
    # perplexity pools as the mean cross-entropy: exp(mean(log ppl)), not the arithmetic 75
    assert wide["ppl"] == pytest.approx((60.0 * 90.0 * 75.0) ** (1 / 3)) and (wide["ppl_min"], wide["ppl_max"]) == (60.0, 90.0)
    assert wide["avg"] == pytest.approx(0.40)
    c = (4 * 0.25 + 2 * 0.5) / 6  # mean chance over the six tasks without BoolQ
    kept = [(a - c) / (0.45 - c) for a in (0.40, 0.38, 0.42)]
    assert wide["above_chance_kept"] == pytest.approx(sum(kept) / 3)
    assert (wide["above_chance_kept_min"], wide["above_chance_kept_max"]) == pytest.approx((min(kept), max(kept)))
    dense = next(r for r in doc["aggregated"] if r["name"] == "dense")
    assert dense["seeds"] is None and dense["ppl"] == 22.5 and dense["above_chance_kept"] == pytest.approx(1.0)
    md = (tmp_path / "out" / "q.md").read_text()
    assert "| wide | 1 | 50% | 0,1,2 | 0.500 | 74.0 (60.0-90.0) | 0.400 (0.380-0.420) |" in md
    assert "| dense | 0 | - | - | 0.000 | 22.5 | 0.450 | 100% |" in md  # no range where all seeds agree
    assert (tmp_path / "out" / "q.png").stat().st_size > 1000


def test_refuses_repeated_seeds_and_other_settings(tmp_path):
    ss = _mod()
    a = _write(tmp_path, 0, 60.0, 0.4)
    with pytest.raises(ValueError, match="share a seed"):
        ss.main([a, a, "--out", str(tmp_path / "x")])
    b = _write(tmp_path, 1, 70.0, 0.4, lr=0.006)
    with pytest.raises(ValueError, match="differs from .* in lr"):
        ss.main([a, b, "--out", str(tmp_path / "x")])
    c = _write(tmp_path, 2, 70.0, 0.4, ffn_group_size=16)  # the group size is a setting too
    with pytest.raises(ValueError, match="differs from .* in ffn_group_size"):
        ss.main([a, c, "--out", str(tmp_path / "x")])
