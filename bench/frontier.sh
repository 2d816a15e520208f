#!/usr/bin/env bash
# The quality-sparsity frontier (SUMMARY, default bench/results/frontier.{json,md,png}): every method on one axis,
# the share of all linear-layer MACs skipped (`wide compare --axis linear`), then bench/frontier.py.
#   1. seed 0: dense, the training-free per-element methods (FREE) and the trained ones (TRAINED)
#      at every target of TARGETS;
#   2. seed 0: the stage-2 methods (STAGE2) at STAGE2_TARGETS;
#   3. the other seeds of SEEDS: dense and TRAINED at SEED_TARGETS;
#   4. seed 0: GEN (dense and methods) at GEN_TARGETS with `--generation GEN_N` (free-text quality;
#      its own phase, since the generation settings enter the evaluation key);
#   5. the summary, with EXTRA (earlier FLOP-axis comparisons), E2E (mode records) when set and
#      phase 4's generation fields merged into phase 1's rows.
# Extra arguments go to every `wide compare`. Each phase is one `wide compare`, resumed on a rerun;
# CACHE_TO keeps the evaluation caches (evals_<run dir>.json) so that a later device session
# retrains and re-evaluates nothing finished; BUDGET_S is what this call may take (a compare cut
# by it resumes next time; no summary until every phase ends).
# Run directories: sequentially (default) the seed-0 phases share RUNS/seed0, so stage 2 and the
# generation phase reuse phase 1's stage-1 checkpoints; PARALLEL=1 runs every phase at once on the
# one GPU (a 135M model leaves most of an H100 idle; each phase logs to RESULTS/<phase>.log), each
# in its own run directory RUNS/<phase> (two compares never share a cache file), so stage 2 and the
# generation phase train their own stage 1 unless its final/ is put there first (a shipped set
# of the same settings passes compare's settings check: bench/results/frontier_runs/README.md).
#
# On the GPU (assets unpacked into /root/wc as bench/results/routing_quality/README.md says),
# one call at a time until it prints the summary (bench/results/frontier_runs/README.md has the
# calls of the committed run; put its evals_*.json in CACHE_TO to resume it):
#   env WIDE_CACHE_DIR=/root/wc RUNS=/root/f RESULTS=/root/f/results CACHE_TO=/root/f/cache BUDGET_S=530 \
#       FREE="teal teal_greedy wina" TRAINED="learned" STAGE2="learned_lora teal_lora" TARGETS="0.5 0.25 0.4 0.6" \
#       GEN="dense teal teal_greedy wina learned" PARALLEL=1 \
#       bash bench/frontier.sh --steps 100 --batch-size 64 --amp bf16 --lr 8.5e-3 --ffn-group-size 16 \
#       --router-init dense --sparsity-warmup 0 --fine-per-channel --fine-lr-scale 1 --recovery-lr 1e-3
# Issue 48's head routers beside the learned thresholds (wide compare's heads, heads_lora): add them to TRAINED and
# STAGE2 (TRAINED="learned heads" STAGE2="learned_lora teal_lora heads_lora") with --heads-core-target C (one core
# target a summary; another in another SUMMARY and RESULTS, the same RUNS: learned's checkpoints are shared).
# CPU smoke test (minutes):
#   DEVICE=cpu LIMIT=2 TARGETS="0.25 0.5" SEED_TARGETS=0.5 SEEDS="0 1" STAGE2_TARGETS=0.5 GEN="dense teal" \
#       GEN_TARGETS=0.5 GEN_N=2 bash bench/frontier.sh --steps 2 --batch-size 2 --seq-len 64 \
#       --max-eval-sequences 4 --tasks arc_easy --fine-calib-sequences 4 --greedy-step 0.2
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
FREE=${FREE-"teal teal_greedy wina wina_greedy"}
TRAINED=${TRAINED-"learned"}
STAGE2=${STAGE2-"learned_lora teal_lora"}
TARGETS=${TARGETS:-"0.25 0.4 0.5 0.6"}
SEED_TARGETS=${SEED_TARGETS:-"0.25 0.5"}
STAGE2_TARGETS=${STAGE2_TARGETS:-"0.5"}
SEEDS=${SEEDS:-"0 1 2"}
GEN=${GEN-""}
GEN_TARGETS=${GEN_TARGETS:-"0.25 0.5"}
GEN_N=${GEN_N:-128}
RUNS=${RUNS:-runs/frontier}
RESULTS=${RESULTS:-runs/frontier/results}
SUMMARY=${SUMMARY:-bench/results/frontier}
mkdir -p "$RESULTS"
END=$(( $(date +%s) + ${BUDGET_S:-1000000} ))
complete=1 failed=0

. bench/compare_run.sh
phase() {  # SEED OUT_NAME METHODS TARGETS [compare arguments...]
    compare_run "$1" "$2" "$3" "$4" --axis linear "${@:5}"
}

seeds=($SEEDS)
first=${seeds[0]}
# NAME SEED METHODS TARGETS [compare arguments...]: one phase, its run directory as above
phases=()
one() {
    local name=$1
    shift
    [ -n "$2" ] || return 0
    if [ "${PARALLEL:-0}" = 1 ]; then
        RUN_DIR=$name phase "$1" "$name" "${@:2}" > "$RESULTS/$name.log" 2>&1 &
        phases+=("$name")
    else
        RUN_DIR=seed$1 phase "$1" "$name" "${@:2}"
    fi
}
one "seed$first" "$first" "dense $FREE $TRAINED" "$TARGETS" "$@"
one "seed${first}_stage2" "$first" "${STAGE2:+dense $STAGE2}" "$STAGE2_TARGETS" "$@"
for s in "${seeds[@]:1}"; do
    one "seed$s" "$s" "dense $TRAINED" "$SEED_TARGETS" "$@"
done
one "seed${first}_gen" "$first" "${GEN}" "$GEN_TARGETS" "$@" --generation "$GEN_N"
if [ ${#phases[@]} -gt 0 ]; then
    wait || true
    logs=()
    for n in "${phases[@]}"; do
        echo "== $n"; sed "/^\s*$/d" "$RESULTS/$n.log" | tail -n 3
        logs+=("$RESULTS/$n.log")
    done
    compare_status "${logs[@]}" > /dev/null
fi
if [ "$failed" = 1 ]; then echo "a comparison failed (above): no summary"; exit 1; fi
if [ "$complete" != 1 ]; then echo "not every phase finished: no summary yet"; exit 0; fi
inputs=("$RESULTS/seed$first.json")
[ -n "$STAGE2" ] && inputs+=("$RESULTS/seed${first}_stage2.json")
for s in "${seeds[@]:1}"; do inputs+=("$RESULTS/seed$s.json"); done
$PY bench/frontier.py "${inputs[@]}" ${EXTRA:+--extra $EXTRA} ${E2E:+--e2e $E2E} \
    ${GEN:+--generation "$RESULTS/seed${first}_gen.json"} --out "$SUMMARY"
