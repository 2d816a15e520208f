"""bench/quality_routing.sh's plumbing, with a stand-in for python that logs what it is asked to
run: a stage-1 run whose routers ship with the package is not trained again before its stage 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import python_stub

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_RUN = "wide50-ce-26214400-s0-dense+lr1p2e-2+ffn16"  # smollm2-135m-50's run

# Stands in for python3: logs its arguments, writes what the script looks for next (a
# finished run's run.json, an eval's record).
STUB = r'''#!/usr/bin/env bash
echo "$*" >> "$LOG"
echo "${CUDA_VISIBLE_DEVICES:--} $*" >> "$LOG.gpu"
sub=""
if [ "$1" = -m ] && [ "$2" = wide.cli ]; then sub=$3; fi
case $1 in *skip_compensation_cpu.py) sub=$2 ;; esac  # the trial that runs wide's CLI patched
if [ -n "$sub" ]; then
    out=""; prev=""
    for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
    case $sub in
        calibrate|recover) mkdir -p "$out/routers"; echo '{}' > "$out/run.json" ;;
        eval) echo '{"records": []}' > "$out.json" ;;
        sample-data) mkdir -p "$out"; echo '{}' > "$out/manifest.json" ;;
    esac
fi
exit 0
'''


@pytest.fixture
def stub(tmp_path):
    return python_stub(tmp_path, STUB)


def run_script(tmp_path, stub, variants, tokens, **env_extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "log"
    log.touch()
    env = dict(os.environ, PY=str(stub), LOG=str(log), RUNS=str(tmp_path / "runs"), RESULTS=str(tmp_path / "res"),
               TOKENS=str(tokens), VARIANTS=variants, DEVICE="cpu", **env_extra)
    p = subprocess.run(["bash", str(ROOT / "bench/quality_routing.sh")], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, log.read_text().splitlines()


def test_stage_two_starts_from_shipped_routers(tmp_path, stub):
    out, calls = run_script(tmp_path, stub, "dense+lr1.2e-2+ffn16+lora1e-3", 26214400)
    assert "from the shipped smollm2-135m-50" in out
    assert not [c for c in calls if " calibrate " in f" {c} "], calls  # stage 1 not trained again
    recover = [c for c in calls if "wide.cli recover" in c]
    assert len(recover) == 1 and f"--routers {tmp_path}/runs/{SHIPPED_RUN}/routers" in recover[0]
    routers = tmp_path / "runs" / SHIPPED_RUN / "routers"
    shipped = ROOT / "src/wide/shipped/smollm2-135m-50"
    assert (routers / "routers.safetensors").read_bytes() == (shipped / "routers.safetensors").read_bytes()
    run = json.loads((tmp_path / "runs" / SHIPPED_RUN / "run.json").read_text())
    assert run["tokens"] == 26214400
    # its committed record comes along, so stage 1 is not evaluated again either
    assert (tmp_path / "res" / f"{SHIPPED_RUN}.json").is_file()
    assert not [c for c in calls if "wide.cli eval" in c and f"runs/{SHIPPED_RUN}/routers" in c]


def test_a_run_that_did_not_ship_is_trained(tmp_path, stub):
    _, calls = run_script(tmp_path, stub, "dense+lr1.2e-2+ffn16+s7", 26214400)
    cal = [c for c in calls if "wide.cli calibrate" in c]
    assert len(cal) == 1 and "--seed 7" in cal[0] and "--router-init dense" in cal[0], calls


def test_dense_reference_copied_or_measured_again(tmp_path, stub):
    _, calls = run_script(tmp_path / "a", stub, "dense+s7", 6553600)
    assert (tmp_path / "a/res/dense.json").read_text() == (ROOT / "bench/results/quality_scaling/dense.json").read_text()
    assert not [c for c in calls if c.endswith("/res/dense")]
    _, calls = run_script(tmp_path / "b", stub, "dense+s7", 6553600, DENSE="eval")
    dense = [c for c in calls if "wide.cli eval" in c and c.endswith(f"--out {tmp_path}/b/res/dense")]
    assert len(dense) == 1 and "--routers" not in dense[0], calls


def test_comp_runs_every_stage_through_the_trial(tmp_path, stub):
    """The part ``comp``: stage 1, stage 2 and both evaluations run the compensation trial's
    patched CLI, none the plain one (the dense reference is copied)."""
    _, calls = run_script(tmp_path, stub, "dense+ffn16+comp+lora1e-3", 6553600)
    trial = [c for c in calls if c.startswith("experiments/skip_compensation_cpu.py ")]
    assert [c.split()[1] for c in trial] == ["calibrate", "eval", "recover", "eval"], calls
    assert not [c for c in calls if "wide.cli" in c], calls
    assert any("-dense+ffn16+comp/routers" in c for c in trial if c.split()[1] == "recover")



def test_union_part_asks_calibrate_for_the_union_term(tmp_path, stub):
    """The part ``unionC`` is ``--union-coef C`` of the plain CLI; the run's name keeps the part."""
    _, calls = run_script(tmp_path, stub, "dense+ffn16+union2.5", 6553600)
    cal = [c for c in calls if "wide.cli calibrate" in c]
    assert len(cal) == 1 and "--union-coef 2.5" in cal[0], calls
    assert "--out " + str(tmp_path / "runs" / "wide50-ce-6553600-s0-dense+ffn16+union2p5") in cal[0]


def test_variants_side_by_side_on_gpus(tmp_path, stub):
    """GPUS: one queue per GPU; a stage 2 runs on the GPU of its stage 1, after it, and the
    variants that sample text share one queue (one sample directory per seed)."""
    variants = "dense+s7 dense+s7+lora1e-3 dense+s8 dense+s9+samples dense+s10+samples"
    out, _ = run_script(tmp_path, stub, variants, 6553600, GPUS="0 1")
    calls = [line.split(" ", 1) for line in (tmp_path / "log.gpu").read_text().splitlines()]
    gpu_of = {}
    for gpu, c in calls:
        for run in ("-s7-dense ", "-s7-dense+lora1e-3", "-s8-dense ", "samples-s9", "samples-s10"):
            if run in c + " ":
                gpu_of.setdefault(run, set()).add(gpu)
    assert all(len(g) == 1 for g in gpu_of.values()), gpu_of  # every run on one GPU
    assert gpu_of["-s7-dense "] == gpu_of["-s7-dense+lora1e-3"] == gpu_of["samples-s9"] == gpu_of["samples-s10"]
    assert gpu_of["-s8-dense "] != gpu_of["-s7-dense "]
    on_s7 = [c for gpu, c in calls if gpu in gpu_of["-s7-dense "]]
    cal = next(i for i, c in enumerate(on_s7) if "calibrate" in c and "-s7-dense " in c + " ")
    rec = next(i for i, c in enumerate(on_s7) if " recover " in c)
    assert cal < rec
    assert "GPU 0: dense+s7 dense+s7+lora1e-3 dense+s9+samples dense+s10+samples" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
