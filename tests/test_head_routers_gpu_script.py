"""experiments/head_routers_gpu.sh's plumbing, with a stand-in for python that logs what it is asked
to run and writes what each stage leaves: stage 2 (LoRA, re-set, eval) on the library sets of an
earlier call (FROM, a directory or its archive), its out-of-memory retry and budget check, and the
summary's stage-2 rows (the real interpreter writes the summary)."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import python_stub

ROOT = Path(__file__).resolve().parents[1]

# Stands in for python3. Training writes routers, the conversion a library set, `wide recover` a
# recovered set (or, with OOM set, runs out of memory once per run directory), the re-set its
# record, `wide eval` records: dense 20, fine-50 24, a library set 30, a re-set stage-2 set 23 (with
# TASKS set and the tasks asked for, i.e. no bare --tasks, accuracies 0.6, 0.5, 0.45 and 0.5 on the
# tasks, chance 0.25; with CUT set, such an eval of a library set is killed at its limit: exit 124,
# nothing written; with SLOW set, the re-set sleeps that many seconds).
STUB = r'''#!/usr/bin/env bash
[ "$1" = - ] && exec "$REAL_PY" "$@"
echo "$*" >> "$LOG"
[ "$1" = -c ] && { echo "torch (stub)"; exit 0; }
out="" routers="" prev="" CMD="$*"
for a in "$@"; do
    case $prev in --out) out=$a ;; --routers) routers=$a ;; esac
    prev=$a
done
rec() {  # METHOD PPL [TASK ACCURACY]: with the tasks, the six above-chance tasks at that accuracy (chance 0.25)
    local t="" detail=""
    if [ -n "${TASKS:-}" ] && [[ " $CMD " != *" --tasks --out "* ]]; then
        for k in arc_easy arc_challenge winogrande piqa openbookqa hellaswag; do
            t="$t, \"$k\": $3"; detail="$detail${detail:+, }\"$k\": {\"chance\": 0.25}"
        done
        t="$t, \"avg\": $3, \"tasks_detail\": {$detail}"
    fi
    echo "{\"method\": \"$1\", \"ppl\": $2, \"linear_sparsity\": 0.53, \"attn_core_sparsity\": 0.25$t}"
}
case " $* " in
    *" recover "*)
        if [ -n "${OOM:-}" ] && [ ! -e "$out.oom" ]; then touch "$out.oom"; echo "torch.OutOfMemoryError: CUDA out of memory"; exit 1; fi
        mkdir -p "$out/recovered" && echo {} > "$out/recovered/wide_config.json"
        echo '{"stage2_tokens": 512, "wall_s": 2.0, "train_args": {"loss": "kd", "lr": 0.001, "amp": "bf16"}, "machine": {}}' > "$out/run.json" ;;
    *" --recalibrate "*)
        [ -n "${SLOW:-}" ] && sleep "$SLOW"
        mkdir -p "$out/routers"
        echo '{"before": {"attn_rate": 0.3, "linear": 0.5}, "calibration_attn_rate": 0.25, "attn_target": 0.25,
               "calibration_linear": 0.53, "linear_target": 0.53, "threshold_shift": 0.1}' > "$out/recalibrate.json" ;;
    *" --to-library "*) mkdir -p "$out/routers" && touch "$out/routers/routers.safetensors" ;;
    *" eval "*)
        [ -n "${CUT:-}" ] && [ -n "${TASKS:-}" ] && [[ " $CMD " != *" --tasks --out "* ]] && [[ $routers == *lib_s* ]] \
            && { echo "zero-shot ..."; exit 124; }
        case $routers in
            smollm2-135m-fine-50) echo "{\"records\": [$(rec dense 20 0.6), $(rec learned 24 0.5)]}" > "$out.json" ;;
            *lora_lib*) echo "{\"records\": [$(rec heads1of3+learned 23 0.5)]}" > "$out.json" ;;
            *) echo "{\"records\": [$(rec heads1of3+learned 30 0.45)]}" > "$out.json" ;;
        esac ;;
    *)
        mkdir -p "$out/routers" && echo {} > "$out/routers/wide_config.json"
        echo '{"tokens": 512, "wall_s": 1.0, "tokens_per_s": 512, "machine": {}}' > "$out/run.json" ;;
esac
exit 0
'''


def run_script(tmp_path, **env):
    log = tmp_path / "log"
    log.write_text("")
    stub = python_stub(tmp_path, STUB)
    full = dict(os.environ, PY=str(stub), REAL_PY=sys.executable, LOG=str(log), OUT=str(tmp_path / "out"),
                ORACLE="0", **env)
    p = subprocess.run(["bash", str(ROOT / "experiments/head_routers_gpu.sh")], env=full, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, log.read_text().splitlines()


def test_stage2_alone_on_an_earlier_calls_sets(tmp_path):
    res = tmp_path / "res"
    _, calls = run_script(tmp_path, RES=str(res), SEEDS="0 1", LIBRARY="0.25", DENSE="0", TRAINED_EVAL="0")
    assert not [c for c in calls if " recover " in c]  # STAGE2 is off without FROM
    assert not [c for c in calls if "--eval " in c] and len([c for c in calls if "--to-library" in c]) == 2
    # the second call: FROM alone, the records beside the first call's (RES = FROM, kept)
    out, calls = run_script(tmp_path, FROM=str(res), SEEDS="0 1 2")
    assert not [c for c in calls if "--skip-one" in c]  # no stage 1
    recover = [c for c in calls if " recover " in c]
    assert len(recover) == 2 and f"--routers {res}/lib_s0/routers --out {res}/lora_s0 " in recover[0]
    for flag in ("--steps 100", "--batch-size 64 --grad-accum 1", "--lr 1e-3", "--loss kd", "--amp bf16",
                 "--lora-r 16", "--seed 0", "--offsets none", "--freeze-routers"):
        assert flag in recover[0]
    assert [c for c in calls if f"--recalibrate {res}/lora_s1/recovered --offset-batches 128 --out {res}/lora_lib_s1" in c]
    assert [c for c in calls if f"eval --device cuda --routers {res}/lora_lib_s1/routers" in c]
    assert "stage 2, seed 2: no library set" in (res / "stages.log").read_text()
    summary = (res / "summary.md").read_text()
    assert "| seed 0, library set + LoRA, re-set (stage 2) | 23.00 | 1.15 |" in summary
    assert "| seed 1 as a library set (None) | 30.00 | 1.50 |" in summary  # the first call's rows stay
    assert "2 library set(s) + LoRA: mean ppl 23.00 = 1.150x dense" in summary
    assert "lora_lib_s0: after LoRA attention-core 0.3000" in summary and "lora_s1: LoRA on 512 tokens (kd" in out
    assert "7-task avg" not in summary and "stage 2: 100 steps x 64 (x1) x 256 tokens, lr 1e-3, loss kd, amp bf16," \
        in (res / "stages.log").read_text()
    # a fresh machine: the archive of these records, unpacked into another RES
    _, calls = run_script(tmp_path, FROM=str(tmp_path / "out/heads_gpu/heads_gpu.tgz"), RES=str(tmp_path / "res2"),
                          SEEDS="1", DENSE="0")
    assert [c for c in calls if f"--routers {tmp_path}/res2/lib_s1/routers" in c]


def test_summary_above_chance_kept_at_the_end(tmp_path):
    # the tasks' share of dense's above-chance accuracy (pooled over the six tasks): at the call's end only
    res = tmp_path / "res"
    out, _ = run_script(tmp_path, RES=str(res), SEEDS="0", LIBRARY="0.25", TRAINED_EVAL="0", STAGE2="1",
                        TASKS="all")
    assert "| seed 0 as a library set (None) | 30.00 | 1.50 | 0.530 | 0.250 | 0.450 | 57% |" in out
    assert "| seed 0, library set + LoRA, re-set (stage 2) | 23.00 | 1.15 | 0.530 | 0.250 | 0.500 | 71% |" in out
    assert "1 library set(s) + LoRA: mean ppl 23.00 = 1.150x dense, range 23.00-23.00; above-chance kept 71% (71%)" \
        in out
    log = (res / "stages.log").read_text()
    assert "stage lora_s0: exit 0" in log and "stage eval_lora_s0: exit 0" in log and "stage tasks_lora_s0: exit 0" in log


def test_tasks_after_the_perplexity_in_their_own_stage(tmp_path):
    # on the H100 a set's seven tasks overran the one call that also held its perplexity (16 s, computed
    # first): killed, it wrote nothing. The perplexity alone (bare --tasks) first, then the tasks
    res = tmp_path / "res"
    out, calls = run_script(tmp_path, RES=str(res), SEEDS="0", LIBRARY="0.25", TRAINED_EVAL="0", TASKS="all",
                            LIMIT="500", CUT="1")
    evals = [c for c in calls if " eval " in c]
    assert len(evals) == 4 and "--routers smollm2-135m-fine-50 --max-eval-sequences 24 --tasks --out" in evals[0]
    assert evals[1].endswith(f"--max-eval-sequences 24 --limit 500 --out {res}/tasks_dense_fine50 --overwrite")
    assert f"--tasks --out {res}/eval_lib_s0 " in evals[2] and f"--limit 500 --out {res}/tasks_lib_s0 " in evals[3]
    log = (res / "stages.log").read_text()
    assert "stage tasks_dense_fine50: exit 0" in log and "stage tasks_lib_s0: exit 124" in log
    # the cut set keeps its perplexity, its task columns empty; the others take theirs from the tasks stage
    assert "| seed 0 as a library set (None) | 30.00 | 1.50 | 0.530 | 0.250 | - | - |" in out
    assert "| smollm2-135m-fine-50 (thresholds alone) | 24.00 | 1.20 | 0.530 | 0.250 | 0.500 | 71% |" in out
    # a tasks stage that does not fit what is left is skipped (DENSE_TASKS_S for dense + fine-50, TASKS_S a
    # set), the tasks of the call before, on the perplexity now rerun, gone with it
    run_script(tmp_path, RES=str(res), SEEDS="0", LIBRARY="0.25", TRAINED_EVAL="0", TASKS="all", BUDGET_S="100",
               DENSE_TASKS_S="120", TASKS_S="60", START_S="1", STEPS="2", STEP_S="1")
    log = (res / "stages.log").read_text()
    assert "stage tasks_dense_fine50: skipped" in log and "stage tasks_lib_s0: exit 0" in log
    assert "| dense | 20.00 | 1.00 | 0.530 | 0.250 | - |" in (res / "summary.md").read_text()


def test_stage2_out_of_memory_retry_and_budget(tmp_path):
    res = tmp_path / "res"
    run_script(tmp_path, RES=str(res), SEEDS="0", LIBRARY="0.25", DENSE="0", TRAINED_EVAL="0", STAGE2="1", OOM="1")
    log = (res / "stages.log").read_text()
    assert "lora_s0: out of memory, again with S2_ACCUM=2" in log and (res / "lora_s0.oom.log").is_file()
    _, calls = run_script(tmp_path, FROM=str(res), OOM="", SEEDS="0", DENSE="0", BUDGET_S="100")
    assert not [c for c in calls if " recover " in c]
    assert "stage lora_s0: skipped" in (res / "stages.log").read_text()


def test_stage_limit(tmp_path):
    # A stage runs under STAGE_MAX_S (600 s on cuda, a device call's limit; the budget on the CPU,
    # where a re-set of 8 offset batches beside another job took 800 s and the 600 s cap killed it)
    res = tmp_path / "res"
    run_script(tmp_path, RES=str(res), SEEDS="0", LIBRARY="0.25", DENSE="0", TRAINED_EVAL="0", STAGE2="1",
               SLOW="3", STAGE_MAX_S="1")
    log = (res / "stages.log").read_text()
    assert "stage lora_lib_s0: exit 124" in log and "(timed out at 1 s)" in log
    assert "stage eval_lora_s0" not in log  # nothing to evaluate after a cut re-set
