"""bench/variants_table.py: the router-choice table regenerates from the committed records, reads
each run's settings from its run.json (not from its name), and refuses a record whose run.json is
missing."""
import importlib.util
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "routing_quality"


def load():
    spec = importlib.util.spec_from_file_location("variants_table", ROOT / "bench" / "variants_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def copy_results(tmp_path) -> pathlib.Path:
    out = tmp_path / "rq"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("variants.*"))
    return out


def test_table_regenerates_from_committed_results(tmp_path):
    mod = load()
    folder = copy_results(tmp_path)
    assert mod.main([str(folder)]) == 0
    assert (folder / "variants.md").read_text() == (RESULTS / "variants.md").read_text().replace(
        str(RESULTS.relative_to(ROOT)), str(folder))
    rows = {(r["variant"], r["tokens"], r["seed"]): r for r in json.loads((folder / "variants.json").read_text())
            if r["name"] != "dense"}
    lr = rows[("dense+lr1p2e-2", 6553600, 1)]
    assert lr["settings"]["lr"] == 0.012 and lr["settings"]["start"] == "dense"
    assert rows[("tile16", 6553600, 0)]["settings"]["tile"] == 16
    assert rows[("tile16", 6553600, 0)]["settings"]["budget"] == "global"  # the run predates --budget


def test_settings_come_from_the_run_not_the_name(tmp_path):
    mod = load()
    folder = copy_results(tmp_path)
    run = folder / "runs" / "wide50-ce-6553600-s0-dense+lr6e-3.run.json"
    data = json.loads(run.read_text())
    data["train_args"]["lr"] = 0.5
    run.write_text(json.dumps(data))
    rec = next(r for r in mod.collect(folder) if r["name"] == "wide50-ce-6553600-s0-dense+lr6e-3")
    assert rec["settings"]["lr"] == 0.5
    run.unlink()
    with pytest.raises(FileNotFoundError, match="run.json"):
        mod.collect(folder)
