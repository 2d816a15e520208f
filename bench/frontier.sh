#!/usr/bin/env bash
# The quality-sparsity frontier (SUMMARY, default bench/results/frontier.{json,md,png}): every method on one axis,
# the share of all linear-layer MACs skipped (`wide compare --axis linear`), then bench/frontier.py.
#   1. seed 0: dense, the training-free per-element methods (FREE) and the trained ones (TRAINED)
#      at every target of TARGETS;
#   2. seed 0: the stage-2 methods (STAGE2) at STAGE2_TARGETS (their stage 1 is phase 1's);
#   3. the other seeds of SEEDS: dense and TRAINED at SEED_TARGETS;
#   4. the summary, with EXTRA (earlier FLOP-axis comparisons) and E2E (mode records) when set.
# Extra arguments go to every `wide compare`. Each phase is one `wide compare` with its own run
# directory per seed, resumed on a rerun; CACHE_TO keeps the evaluation caches (evals_seedK.json)
# so that a later device session retrains and re-evaluates nothing finished; BUDGET_S is what
# this call may take (a compare cut by it resumes next time; no summary until every phase ends).
#
# On the GPU (assets unpacked into /root/wc as bench/results/routing_quality/README.md says),
# one call at a time until it prints the summary (bench/results/frontier_runs/README.md has the
# calls of the committed run; put its evals_seed0.json in CACHE_TO to resume it):
#   env WIDE_CACHE_DIR=/root/wc RUNS=/root/f RESULTS=/root/f/results CACHE_TO=/root/f/cache BUDGET_S=530 \
#       FREE="teal teal_greedy wina" TRAINED="hybrid learned" STAGE2="hybrid_lora" TARGETS="0.5 0.25 0.4 0.6" \
#       bash bench/frontier.sh --steps 100 --batch-size 64 --amp bf16 --lr 8.5e-3 --ffn-group-size 16 \
#       --router-init dense --sparsity-warmup 0 --fine-per-channel --fine-lr-scale 1 --recovery-lr 1e-3
# CPU smoke test (minutes):
#   DEVICE=cpu LIMIT=2 TARGETS="0.25 0.5" SEED_TARGETS=0.5 SEEDS="0 1" STAGE2_TARGETS=0.5 \
#       bash bench/frontier.sh --steps 2 --batch-size 2 --seq-len 64 --max-eval-sequences 4 --tasks arc_easy \
#       --fine-calib-sequences 4 --greedy-step 0.2
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
FREE=${FREE-"teal teal_greedy wina wina_greedy"}
TRAINED=${TRAINED-"hybrid"}
STAGE2=${STAGE2-"hybrid_lora teal_lora"}
TARGETS=${TARGETS:-"0.25 0.4 0.5 0.6"}
SEED_TARGETS=${SEED_TARGETS:-"0.25 0.5"}
STAGE2_TARGETS=${STAGE2_TARGETS:-"0.5"}
SEEDS=${SEEDS:-"0 1 2"}
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
phase "$first" "seed$first" "dense $FREE $TRAINED" "$TARGETS" "$@"
phase "$first" "seed${first}_stage2" "${STAGE2:+dense $STAGE2}" "$STAGE2_TARGETS" "$@"
for s in "${seeds[@]:1}"; do
    phase "$s" "seed$s" "dense $TRAINED" "$SEED_TARGETS" "$@"
done
if [ "$failed" = 1 ]; then echo "a comparison failed (above): no summary"; exit 1; fi
if [ "$complete" != 1 ]; then echo "not every phase finished: no summary yet"; exit 0; fi
inputs=("$RESULTS/seed$first.json")
[ -n "$STAGE2" ] && inputs+=("$RESULTS/seed${first}_stage2.json")
for s in "${seeds[@]:1}"; do inputs+=("$RESULTS/seed$s.json"); done
$PY bench/frontier.py "${inputs[@]}" ${EXTRA:+--extra $EXTRA} ${E2E:+--e2e $E2E} --out "$SUMMARY"
