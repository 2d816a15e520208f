"""bench/frontier.sh's phases (with a stand-in for python) and bench/frontier.py's summary: one
axis for every method, seeds pooled, earlier FLOP-axis records placed exactly, speed columns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import python_stub

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import frontier  # noqa: E402

STUB = r'''#!/usr/bin/env bash
echo "$*" >> "$LOG"
if [ "$3" = compare ]; then
    out="" runs="" prev=""
    for a in "$@"; do
        case $prev in --out) out=$a ;; --runs) runs=$a ;; esac
        prev=$a
    done
    echo '{}' > "$runs/evals.json"
    echo '{"records": []}' > "$out.json"
elif [ "$1" = bench/frontier.py ]; then
    echo summary > "${@: -1}.md"
fi
exit 0
'''


def _frontier_sh(tmp_path, stub_text=STUB, *args, **env):
    """bench/frontier.sh with python stood in for by STUB_TEXT (its calls logged to tmp/log);
    ENV over a CPU default of two seeds. Returns the finished process."""
    stub = python_stub(tmp_path, stub_text)
    (tmp_path / "log").touch()
    full = dict(os.environ, PY=str(stub), LOG=str(tmp_path / "log"), RUNS=str(tmp_path / "runs"),
                RESULTS=str(tmp_path / "res"), CACHE_TO=str(tmp_path / "cache"), SUMMARY=str(tmp_path / "sum"))
    full.update({"DEVICE": "cpu", "SEEDS": "0 1", "TARGETS": "0.25 0.5", "SEED_TARGETS": "0.5", **env})
    return subprocess.run(["bash", str(ROOT / "bench/frontier.sh"), *args], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_phases_run_every_method_then_the_stage_2_and_the_other_seeds(tmp_path):
    p = _frontier_sh(tmp_path, STUB, "--steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    log = tmp_path / "log"
    calls = log.read_text().splitlines()
    compares = [c for c in calls if " compare " in c]
    assert len(compares) == 3
    assert all("--axis linear" in c and c.endswith("--steps 2") for c in compares)
    assert "--seed 0 --methods dense teal teal_greedy wina wina_greedy learned --targets 0.25 0.5" in compares[0]
    assert "--seed 0 --methods dense learned_lora teal_lora --targets 0.5" in compares[1]
    assert "--seed 1 --methods dense learned --targets 0.5" in compares[2]
    # one after another, the seed-0 phases share a run directory (stage 2 reuses phase 1's stage 1)
    assert [c.split("--runs ")[1].split()[0].rsplit("/", 1)[1] for c in compares] == ["seed0", "seed0", "seed1"]
    summary = [c for c in calls if c.startswith("bench/frontier.py")]
    assert len(summary) == 1 and all(f"/res/{n}.json" in summary[0] for n in ("seed0", "seed0_stage2", "seed1"))
    assert "--generation" not in summary[0]
    assert (tmp_path / "cache" / "evals_seed1.json").is_file()  # caches kept for a later machine


def test_parallel_phases_get_their_own_run_directories_and_the_generation_phase(tmp_path):
    p = _frontier_sh(tmp_path, STUB, "--steps", "2", PARALLEL="1", GEN="dense teal", GEN_N="7")
    assert p.returncode == 0, p.stdout + p.stderr
    log = tmp_path / "log"
    compares = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in log.read_text().splitlines()
                if " compare " in c}
    assert set(compares) == {"seed0", "seed0_stage2", "seed1", "seed0_gen"}
    for name, c in compares.items():  # no two compares share a run directory, hence an evaluation cache
        assert c.split("--runs ")[1].split()[0].endswith(f"/runs/{name}")
        assert (tmp_path / "cache" / f"evals_{name}.json").is_file() and (tmp_path / "res" / f"{name}.log").is_file()
    assert "--methods dense teal --targets 0.25 0.5" in compares["seed0_gen"]
    assert compares["seed0_gen"].endswith("--steps 2 --generation 7")
    summary = [c for c in log.read_text().splitlines() if c.startswith("bench/frontier.py")]
    assert len(summary) == 1 and summary[0].split("--generation ")[1].startswith(str(tmp_path / "res/seed0_gen.json"))
    assert "seed0_gen.json" not in summary[0].split("--generation")[0]  # not pooled as another seed


def test_parallel_phase_that_fails_stops_the_summary(tmp_path):
    p = _frontier_sh(tmp_path, STUB.replace('if [ "$3" = compare ]; then',
                                            'if [ "$3" = compare ] && [[ "$*" == *"--seed 1 "* ]]; then exit 3\n'
                                            'elif [ "$3" = compare ]; then'), PARALLEL="1")
    assert p.returncode == 1 and "no summary" in p.stdout and "failed: seed 1" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "sum.md").exists()


def _doc(seed, records, **settings):
    base = {"steps": 2, "seq_len": 256, "limit": 500, "targets": [0.25, 0.5], "axis": "linear"}
    return {"device": "H100", "torch": "2.11", "date": f"2026-12-0{seed + 1}", "command": f"wide compare --seed {seed}",
            "settings": {**base, **settings, "seed": seed}, "records": records}


CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "winogrande": 0.5, "piqa": 0.5, "openbookqa": 0.25, "hellaswag": 0.25}
TASKS = {"arc_easy": 0.5, "arc_challenge": 0.3, "winogrande": 0.52, "piqa": 0.64, "openbookqa": 0.3, "hellaswag": 0.37}


def _rec(name, method, stage, target, ppl, lin, seed, scale=1.0):
    return {"op": "quality", "name": name, "label": name, "method": method, "stage": stage, "target": target,
            "ppl": ppl, "linear_sparsity": lin, "sparsity": lin, "seed": seed, "model": "SmolLM2-135M-Instruct",
            **{t: CHANCE[t] + (v - CHANCE[t]) * scale for t, v in TASKS.items()},
            # the uniform guess of the documents scored, as `score` records it (no task data read here)
            "tasks_detail": {t: {"chance": CHANCE[t]} for t in TASKS}}


def _summarize(tmp_path, docs: dict, *argv) -> tuple:
    """Writes each doc as NAME.json, runs bench/frontier.py on ARGV (NAME stands for its file);
    returns its JSON document, its aggregated rows by (name, target) and its markdown."""
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    out = tmp_path / "frontier"
    args = [str(tmp_path / f"{a}.json") if a in docs else a for a in argv]
    assert frontier.main(args + ["--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    return doc, {(r["name"], r["target"]): r for r in doc["aggregated"]}, out.with_suffix(".md").read_text()


def test_summary_pools_seeds_and_places_flop_axis_records(tmp_path):
    s0 = _doc(0, [_rec("dense", "dense", 0, None, 22.5, 0.0, None),
                  _rec("teal", "teal", 1, 0.5, 36.0, 0.52, None, 0.6),
                  _rec("hybrid", "hybrid", 1, 0.5, 25.0, 0.50, 0, 0.8)])
    s1 = _doc(1, [_rec("dense", "dense", 0, None, 22.5, 0.0, None),
                  _rec("hybrid", "hybrid", 1, 0.5, 36.0, 0.50, 1, 0.8)], targets=[0.5])
    old = {"device": "H200", "command": "wide compare", "records": [
        {**_rec("dense", "dense", 0, None, 22.5, 0.0, None)},
        {**_rec("wide", "wide", 1, 0.5, 49.4, None, 0, 0.45), "sparsity": 0.4968}]}
    _, rows, md = _summarize(tmp_path, {"s0": s0, "s1": s1, "old": old}, "s0", "s1", "--extra", "old")
    hyb = rows[("hybrid", 0.5)]
    assert hyb["seeds"] == [0, 1] and hyb["ppl"] == pytest.approx(30.0) and hyb["ppl_min"] == 25.0  # geometric mean
    assert hyb["above_chance_kept"] == pytest.approx(0.8) and hyb["ppl_vs_dense"] == pytest.approx(30.0 / 22.5)
    teal = rows[("teal", 0.5)]
    assert teal["n"] == 1 and teal["above_chance_kept"] == pytest.approx(0.6)
    # the FLOP-axis record: linear = FLOP rate x routable / linear MACs (SmolLM2: 3317760 / 3538944)
    w = rows[("wide@flops", 0.5)]
    assert w["linear_sparsity"] == pytest.approx(0.4968 * 3317760 / 3538944) and w["linear_sparsity_from"]
    assert "(FLOP-axis target)" in md and "1.33x" in md and (tmp_path / "frontier.png").is_file()


def test_parallel_phase_cut_mid_progress_bar_is_incomplete(tmp_path):
    # A compare cut by the clock mid progress bar leaves the bar's line unterminated: the
    # "incomplete" notice then shares its line, and must still stop the summary (it once didn't).
    p = _frontier_sh(tmp_path, STUB.replace('if [ "$3" = compare ]; then',
                                            'if [ "$3" = compare ] && [[ "$*" == *"--generation"* ]]; then '
                                            'printf "\\rboolq:  75%%|###  | 12/16" >&2; exit 124\n'
                                            'elif [ "$3" = compare ]; then'),
                     SEEDS="0", PARALLEL="1", GEN="dense teal", STAGE2="")
    assert p.returncode == 0 and "not every phase finished" in p.stdout, p.stdout + p.stderr
    assert "12/16incomplete: seed 0" in (tmp_path / "res" / "seed0_gen.log").read_text()
    assert not (tmp_path / "sum.md").exists()


def test_generation_fields_join_the_first_seeds_rows_and_refuse_another_model(tmp_path):
    gen_fields = {"gen_kl": 0.3, "gen_match": 0.6, "gen_prefix": 9.5, "gen_distinct2": 0.8, "gen_distinct2_dense": 0.85,
                  "gen_settings": {"prompts": 7, "prompt_len": 32, "new_tokens": 32, "seed": 0}}
    s0 = _doc(0, [_rec("dense", "dense", 0, None, 22.5, 0.0, None),
                  _rec("teal", "teal", 1, 0.5, 36.0, 0.52, None, 0.6)])
    s1 = _doc(1, [_rec("dense", "dense", 0, None, 22.5, 0.0, None)], targets=[0.5])
    gen = _doc(0, [{**_rec("teal", "teal", 1, 0.5, 36.01, 0.52, None, 0.6), **gen_fields}], generation=7)
    doc, rows, md = _summarize(tmp_path, {"s0": s0, "s1": s1, "gen": gen}, "s0", "s1", "--generation", "gen")
    assert rows[("teal", 0.5)]["gen_kl"] == 0.3 and rows[("teal", 0.5)]["gen_prefix"] == 9.5
    assert rows[("dense", None)].get("gen_kl") is None and rows[("dense", None)]["n"] == 2  # not a third seed
    assert doc["generation"]["rows"] == [["teal", 1, 0.5]] and doc["generation"]["settings"]["prompts"] == 7
    assert "gen KL" in md and "| 0.300 | 60% | 9.5 | 0.80 |" in md and "7 held-out prompts" in md
    # another model's generation (its perplexity differs) or another seed is refused
    (tmp_path / "bad.json").write_text(json.dumps(_doc(0, [{**_rec("teal", "teal", 1, 0.5, 40.0, 0.52, None), **gen_fields}])))
    with pytest.raises(ValueError, match="not the same model"):
        frontier.main([str(tmp_path / "s0.json"), "--generation", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")])
    (tmp_path / "bad.json").write_text(json.dumps(_doc(1, [{**_rec("teal", "teal", 1, 0.5, 36.0, 0.52, None), **gen_fields}])))
    with pytest.raises(ValueError, match="seed 1"):
        frontier.main([str(tmp_path / "s0.json"), "--generation", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")])


def test_summary_refuses_inputs_of_other_settings(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_doc(0, [], steps=2)))
    (tmp_path / "b.json").write_text(json.dumps(_doc(1, [], steps=3)))
    with pytest.raises(ValueError, match="differs .* in steps"):
        frontier.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "x")])


def test_speed_columns_come_from_mode_records(tmp_path):
    e2e = {"device": "NVIDIA H100", "records": [
        {"op": "e2e_tpot", "mode": "fine", "B": 1, "prompt_len": 4096, "speedup": 1.9},
        {"op": "e2e_tpot", "mode": "dense", "B": 1, "prompt_len": 4096, "speedup": 1.0},
        {"op": "e2e_ttft", "mode": "hybrid", "B": 1, "prompt_len": 4096, "speedup": 1.3}]}
    (tmp_path / "e2e.json").write_text(json.dumps(e2e))
    sp = frontier.speed_columns(tmp_path / "e2e.json")
    assert sp == {"device": "NVIDIA H100", "modes": {"fine": {(1, 4096): 1.9}}}


def test_levels_interpolate_log_perplexity_between_measured_points():
    rows = [{"name": "dense", "stage": 0, "ppl": 20.0, "linear_sparsity": 0.0},
            {"name": "teal", "stage": 1, "ppl": 25.0, "linear_sparsity": 0.41},
            {"name": "teal", "stage": 1, "ppl": 36.0, "linear_sparsity": 0.52},
            {"name": "hyb", "stage": 1, "ppl": 28.0, "linear_sparsity": 0.50}]
    got = frontier.at_levels(rows, levels=(0.4, 0.5))
    import math
    want = math.exp(math.log(25) + (0.5 - 0.41) / 0.11 * (math.log(36) - math.log(25)))
    assert got[("teal", 1)] == pytest.approx({0.5: want}) and 0.4 not in got[("teal", 1)]  # 0.4 lies outside
    assert got[("hyb", 1)] == {0.5: 28.0}  # measured at the level itself
    assert "ppl at 50%" in frontier.levels_table(rows, levels=(0.5,))
