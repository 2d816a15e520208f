"""bench/variants_table.py: the router-choice table regenerates from the committed records, reads
each run's settings from its run.json (not from its name), and refuses a record whose run.json is
missing."""
import json
import pathlib
import shutil

import pytest
from conftest import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "routing_quality"


def load():
    return load_script("bench/variants_table.py")


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
    assert lr["settings"]["data"] == "wiki"
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


def test_stage2_rows_carry_their_stage_tokens_and_settings(tmp_path):
    # a loraX variant of bench/quality_routing.sh: its record counts stage 1's tokens and its own,
    # its run.json is stage 2's (lr, no warm-up)
    mod = load()
    folder = copy_results(tmp_path)
    s1, s2 = "wide50-ce-6553600-s0-dense+lr1p2e-2", "wide50-ce-6553600-s0-dense+lr1p2e-2+lora1e-3"
    doc = json.loads((folder / f"{s1}.json").read_text())
    for r in doc["records"]:
        r.update(stage=2, tokens=2 * 6553600, ppl=r["ppl"] * 0.8)
    (folder / f"{s2}.json").write_text(json.dumps(doc))
    run = json.loads((folder / "runs" / f"{s1}.run.json").read_text())
    run["train_args"].update(lr=1e-3, sparsity_warmup=0.0)
    del run["wide_config"]  # `wide recover` records the adapters, not the routers' settings
    (folder / "runs" / f"{s2}.run.json").write_text(json.dumps(run))
    rec = next(r for r in mod.collect(folder) if r["name"] == s2)
    assert (rec["stage"], rec["tokens"], rec["variant"]) == (2, 2 * 6553600, "dense+lr1p2e-2+lora1e-3")
    assert (rec["settings"]["lr"], rec["settings"]["warm-up"]) == (1e-3, 0.0)
    assert rec["settings"]["start"] == "dense" and rec["settings"]["rank"] == 16  # stage 1's routers
    assert next(r for r in mod.collect(folder) if r["name"] == s1)["stage"] == 1
    assert "| dense+lr1p2e-2+lora1e-3 | 50% | 2 | 13.1M | 0 | ce | wiki |" in mod.table(mod.collect(folder))


def test_target_comes_from_the_name_and_sorts_first(tmp_path):
    # a pN variant of bench/quality_routing.sh is named wide<N>-...: its rows come after the 50% ones
    mod = load()
    folder = copy_results(tmp_path)
    s50 = "wide50-ce-6553600-s0-dense+lr1p2e-2"
    s25 = "wide25-ce-6553600-s0-dense+lr1p2e-2"
    shutil.copy(folder / f"{s50}.json", folder / f"{s25}.json")
    shutil.copy(folder / "runs" / f"{s50}.run.json", folder / "runs" / f"{s25}.run.json")
    recs = {r["name"]: r for r in mod.collect(folder)}
    assert (recs[s25]["target"], recs[s50]["target"]) == (0.25, 0.5)
    rows = [line for line in mod.table(list(recs.values())).splitlines() if line.startswith("| dense+lr1p2e-2 |")]
    assert " 25% " in rows[-1] and all(" 50% " in r for r in rows[:-1])
