"""bench/scaling_plot.py: the table, summary and plot of a token-budget scaling run, from
synthetic `wide eval` results files."""
import json

import pytest
from conftest import load_script

TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")


def _mod():
    return load_script("bench/scaling_plot.py")


CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "boolq": 0.5, "winogrande": 0.5, "piqa": 0.5, "openbookqa": 0.25,
          "hellaswag": 0.25}


def _record(method, ppl, avg, **kw):
    return {"op": "quality", "model": "SmolLM2-135M-Instruct", "method": method, "stage": 1 if method != "dense" else 0,
            "sparsity": 0.5 if method != "dense" else 0.0, "ppl": ppl, "bpb": 1.2, **{t: avg for t in TASKS},
            "avg": avg, "limit": 200, "tasks_detail": {t: {"metric": avg, "chance": CHANCE[t]} for t in TASKS}, **kw}


def _write(folder, name, records):
    (folder / f"{name}.json").write_text(json.dumps({"command": "wide eval ...", "records": records}))


def test_table_summary_and_plot(tmp_path):
    sp = _mod()
    _write(tmp_path, "dense", [_record("dense", 22.5, 0.434, loss=None, tokens=0, seed=None)])
    for loss, ppls in (("ce", (95.0, 60.0, 45.0)), ("kd", (80.0, 50.0, 36.0))):
        for tokens, ppl in zip((1_638_400, 6_553_600, 26_214_400), ppls):
            _write(tmp_path, f"{loss}-{tokens}", [_record("wide", ppl, 0.40 if loss == "kd" else 0.38, loss=loss,
                                                          tokens=tokens, seed=0)])
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a results file: ignored
    assert sp.main([str(tmp_path)]) == 0
    md = (tmp_path / "quality_scaling.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "loss" not in line]
    assert [r.split(" | ")[0:2] for r in rows] == [["| dense", "-"], ["| ce", "1.64M"], ["| ce", "6.55M"],
                                                    ["| ce", "26.2M"], ["| kd", "1.64M"], ["| kd", "6.55M"],
                                                    ["| kd", "26.2M"]]
    assert "26.2M tokens, seed 0: kd perplexity 0.800x of ce, average +0.020" in md
    # Above chance kept, six tasks pooled (BoolQ out): chance 1/3 on average; dense 0.434.
    kept = [r.split(" | ")[-1].rstrip(" |").split(" ± ")[0] for r in rows]  # (± its standard error)
    assert all(" ± " in r.split(" | ")[-1] for r in rows[1:])
    c = (4 * 0.25 + 2 * 0.5) / 6
    assert kept == ["100%"] + [f"{(0.38 - c) / (0.434 - c):.0%}"] * 3 + [f"{(0.40 - c) / (0.434 - c):.0%}"] * 3
    assert [r.split(" | ")[5] for r in rows][:2] == ["1.00", f"{95 / 22.5:.2f}"]  # ppl / dense
    doc = json.loads((tmp_path / "quality_scaling.json").read_text())
    assert [round(s["ppl_ratio_vs_ce"], 4) for s in doc["kd_vs_ce"]] == [round(80 / 95, 4), round(50 / 60, 4), 0.8]
    assert len(doc["records"]) == 7
    assert (tmp_path / "quality_scaling.png").stat().st_size > 1000
    # A second run reads its own output back as nothing new.
    assert sp.main([str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "quality_scaling.json").read_text())["records"]) == 7


def test_records_without_loss_tokens_or_seed_are_refused(tmp_path):
    sp = _mod()
    _write(tmp_path, "old", [_record("wide", 90.0, 0.37, tokens=100)])
    with pytest.raises(ValueError, match="old.json: a wide record lacks loss, seed"):
        sp.main([str(tmp_path)])
    (tmp_path / "old.json").unlink()
    _write(tmp_path, "dense", [_record("dense", 22.5, 0.43)])
    assert sp.main([str(tmp_path)]) == 1  # nothing routed to plot


def test_series_from_named_files_are_their_own_lines(tmp_path):
    sp = _mod()
    grid = tmp_path / "grid"
    grid.mkdir()
    _write(grid, "dense", [_record("dense", 22.5, 0.434, loss=None, tokens=0, seed=None)])
    for tokens, ppl in ((1_638_400, 95.0), (6_553_600, 60.0)):
        _write(grid, f"ce-{tokens}", [_record("wide", ppl, 0.38, loss="ce", tokens=tokens, seed=0)])
    other = tmp_path / "other"
    other.mkdir()
    _write(other, "s1-6m", [_record("wide", 49.4, 0.397, loss="ce", tokens=6_553_600, seed=0)])
    _write(other, "s2-13m", [_record("wide", 39.4, 0.412, loss="ce", tokens=13_107_200, seed=0, stage=2),
                             _record("dense", 22.5, 0.434, loss=None, tokens=0, seed=None)])  # dense: not again
    files = f"{other / 's1-6m.json'},{other / 's2-13m.json'}"
    assert sp.main([str(grid), "--series", f"recipe 50%={files}"]) == 0
    md = (grid / "quality_scaling.md").read_text()
    rows = [line.split(" | ")[0:3] for line in md.splitlines() if line.startswith("| ") and "loss" not in line]
    assert rows == [["| dense", "-", "-"], ["| ce", "1.64M", "0"], ["| ce", "6.55M", "0"],
                    ["| recipe 50%", "6.55M", "0"], ["| recipe 50%", "13.1M", "0"]]
    assert f'--series "recipe 50%={files}"' in md  # the command that made it
    doc = json.loads((grid / "quality_scaling.json").read_text())
    assert doc["kd_vs_ce"] == [] and sum(r.get("series") == "recipe 50%" for r in doc["records"]) == 2
    with pytest.raises(ValueError, match="no results file"):
        sp.main([str(grid), "--series", f"x={other / 'missing.json'}"])
    with pytest.raises(ValueError, match="expected LABEL=FILE"):
        sp.main([str(grid), "--series", "no-files"])
