"""bench/quality_seeds.sh's plumbing, with a stand-in for python that logs what it is asked to run:
evaluation caches carried between machines, the first seed's wider method set, and no summary
until every seed has finished."""

import os
import subprocess
from pathlib import Path

import pytest
from conftest import python_stub

ROOT = Path(__file__).resolve().parents[1]

# Stands in for python3: logs its arguments; `wide compare` writes its results file and its
# evaluation cache (or fails when FAIL_SEED names its seed); the summary writes its table.
STUB = r'''#!/usr/bin/env bash
echo "$*" >> "$LOG"
if [ "$3" = compare ]; then
    out="" runs="" seed="" prev=""
    for a in "$@"; do
        case $prev in --out) out=$a ;; --runs) runs=$a ;; --seed) seed=$a ;; esac
        prev=$a
    done
    [ "$seed" = "${FAIL_SEED:-}" ] && exit "${FAIL_RC:-124}"
    echo "{\"seed\": $seed, \"had\": $(cat "$runs/evals.json" 2>/dev/null || echo null)}" > "$runs/evals.json.new"
    mv "$runs/evals.json.new" "$runs/evals.json"
    echo '{"records": []}' > "$out.json"
elif [ "$1" = bench/seeds_summary.py ]; then
    echo summary > "${@: -1}.md"
fi
exit 0
'''


@pytest.fixture
def stub(tmp_path):
    return python_stub(tmp_path, STUB)


def run_script(tmp_path, stub, runs, rc=0, **env_extra):
    log = tmp_path / "log"
    log.write_text("")
    env = dict(os.environ, PY=str(stub), LOG=str(log), RUNS=str(tmp_path / runs), RESULTS=str(tmp_path / "res"),
               CACHE_TO=str(tmp_path / "cache"), DEVICE="cpu", TARGETS="0.5", **{"SEEDS": "0 1", **env_extra})
    p = subprocess.run(["bash", str(ROOT / "bench/quality_seeds.sh"), "--steps", "2"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == rc, p.stdout + p.stderr
    return p.stdout, log.read_text().splitlines()


def test_first_seed_runs_every_method_last_and_the_summary_follows(tmp_path, stub):
    out, calls = run_script(tmp_path, stub, "runs", METHODS_FIRST="all", SUMMARY=str(tmp_path / "sum" / "headline"))
    compares = [c for c in calls if " compare " in c]
    assert len(compares) == 3
    assert "--seed 0" in compares[0] and "--methods dense wide dynamic_depth --targets" in compares[0]
    assert "--seed 1" in compares[1]
    assert "--seed 0" in compares[2] and "module_skip_lora static_width static_width_lora --targets" in compares[2]
    # the wider set writes a file of its own: a cut call leaves the headline file of seed 0 whole
    assert "/res/seed0_all " in compares[2] and "/res/seed0 " in compares[0]
    assert all(c.endswith("--steps 2") for c in compares)  # the script's arguments reach every compare
    summary = calls[-1].split()
    assert summary[0] == "bench/seeds_summary.py"
    assert [Path(f).name for f in summary[1:3]] == ["seed0_all.json", "seed1.json"]
    assert summary[-2:] == ["--out", str(tmp_path / "sum" / "headline")]
    assert (tmp_path / "cache" / "evals_seed0.json").is_file() and (tmp_path / "cache" / "evals_seed1.json").is_file()


def test_a_cut_seed_leaves_no_summary_and_a_new_machine_resumes_from_the_cache(tmp_path, stub):
    out, calls = run_script(tmp_path, stub, "runs_a", FAIL_SEED="1")
    assert "incomplete: seed 1" in out and "no summary yet" in out
    assert not [c for c in calls if "seeds_summary" in c]
    # another machine: RUNS is empty, the cache of seed 0 comes back into it before compare runs
    out, calls = run_script(tmp_path, stub, "runs_b")
    assert '"had": {"seed": 0, "had": null}' in (tmp_path / "runs_b" / "seed0" / "evals.json").read_text()
    summary = [c for c in calls if "seeds_summary" in c]
    assert summary and [Path(f).name for f in summary[0].split()[1:3]] == ["seed0.json", "seed1.json"]


def test_no_time_left_skips_every_seed(tmp_path, stub):
    out, calls = run_script(tmp_path, stub, "runs", BUDGET_S="30")
    assert out.count("incomplete:") == 2 and not [c for c in calls if " compare " in c]


def test_an_error_is_not_taken_for_the_time_limit(tmp_path, stub):
    out, calls = run_script(tmp_path, stub, "runs", rc=1, FAIL_SEED="0", FAIL_RC="2")
    assert "failed: seed 0" in out and "no summary" in out
    assert [c for c in calls if "--seed 1" in c]  # the other seeds still ran


def test_seeds_side_by_side_on_gpus(tmp_path, stub):
    # seed 0 stops at the time limit on GPU 0's queue: seed 2, queued behind it, still runs
    out, calls = run_script(tmp_path, stub, "runs", SEEDS="0 1 2", GPUS="0 1", FAIL_SEED="0")
    assert sorted(c.split("--seed ")[1].split()[0] for c in calls if " compare " in c) == ["0", "1", "2"]
    assert "incomplete: seed 0" in out and "no summary yet" in out
    assert "incomplete:" not in (tmp_path / "res" / "seed2.log").read_text()
    out, calls = run_script(tmp_path, stub, "runs", rc=1, SEEDS="0 1 2", GPUS="0 1", FAIL_SEED="1", FAIL_RC="3")
    assert "failed: seed 1" in out and not [c for c in calls if "seeds_summary" in c]
    out, calls = run_script(tmp_path, stub, "runs", SEEDS="0 1 2", GPUS="0 1")
    assert [c for c in calls if "seeds_summary" in c]


def test_a_narrower_first_set_keeps_the_headline_methods(tmp_path, stub):
    # the summary reads seed0_all in place of seed0: it must hold the headline methods as well
    out, calls = run_script(tmp_path, stub, "runs", METHODS_FIRST="module_skip wide")
    compares = [c for c in calls if " compare " in c]
    assert "--methods dense wide dynamic_depth module_skip --targets" in compares[-1]
    assert "/res/seed0_all " in compares[-1]
