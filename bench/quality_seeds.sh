#!/usr/bin/env bash
# The headline comparison over seeds: `wide compare` once per seed (each its own run directory,
# resumable), then bench/seeds_summary.py for the mean and range of every method at every target
# (SUMMARY.{json,md,png}, default RESULTS/quality_smollm2_seeds). Extra arguments go to every
# `wide compare`.
#
#   SEEDS="0 1 2" METHODS="dense wide dynamic_depth" TARGETS="0.25 0.5" \
#       bash bench/quality_seeds.sh --steps 400 --batch-size 32 --amp bf16
#
# The headline at the recipe (issue 19: 3 seeds of WIDE and dynamic depth at 25 % and 50 %, then
# every method at both stages on the first seed, the paper re-test), on the GPU machine with the
# assets unpacked into /root/wc (bench/results/routing_quality/README.md says how), one call at a
# time until it prints the summary; each call resumes where the last one stopped:
#   env WIDE_CACHE_DIR=/root/wc RUNS=/root/q/seeds RESULTS=bench/results/quality_seeds BUDGET_S=540 \
#       CACHE_TO=bench/results/quality_seeds METHODS_FIRST=all SUMMARY=bench/results/quality_smollm2 \
#       bash bench/quality_seeds.sh \
#       --steps 200 --batch-size 128 --amp bf16 --router-init dense --sparsity-warmup 0.5 --lr 1.2e-2 \
#       --ffn-group-size 16 --recovery-lr 1e-3
# and return RESULTS and SUMMARY (tar czf $OUT/seeds.tgz bench/results/quality_seeds
# bench/results/quality_smollm2.*) with $OUT. ~5.3 min per seed of three methods on an H100 (four
# trainings of 6.55M tokens at ~80 s each with their evaluations), ~19 more for the other methods
# of the first seed (a stage 2 takes ~2 min, and trains its stage 1 again on a machine that did
# not keep it: the caches keep evaluations, not routers).
#
# The seeds run one after the other: run as three processes at once on one H200 (beside a fourth
# training run) they were far slower than in turn (none finished a 400-step stage 1 in 7 minutes,
# ~1 minute alone; the fourth ran at 47k tokens/s against 128k alone): the GPU time-slices
# between processes.
# GPUS="0 1 2" runs the seeds on those GPUs side by side (seed k on GPU k mod n, each seed's
# output in RESULTS/seedK.log); on one GPU they run in turn.
# Settings (environment): SEEDS, METHODS, TARGETS, GPUS, LIMIT (documents per task, default 500),
# DEVICE (default cuda), RUNS (run directories, default runs/seeds), RESULTS (default
# bench/results/quality_seeds), SUMMARY (the summary's stem), PY. On the offline GPU machine
# unpack the assets first (scripts/device_assets.py) and set WIDE_CACHE_DIR, as in
# bench/quality_scaling.sh.
# METHODS_FIRST: after every seed has run METHODS, the first seed runs these too (all: every method
#   of `wide compare`, both stages) into RESULTS/seedK_all.* (with METHODS), which the summary reads
#   in place of seedK.
# BUDGET_S: seconds this call may use; a `wide compare` cut by it resumes from its checkpoints in
#   the next call on the same machine, and the summary waits for a call that finishes.
# CACHE_TO: a directory that keeps each seed's evaluation cache (evals_seedK.json, the records of
#   every finished method): restored into a fresh RUNS, so that a later machine (another device
#   session) re-evaluates and retrains nothing finished. The cache keys hold every setting that
#   changes a number, the model's path included: keep WIDE_CACHE_DIR the same.
# CPU smoke test (minutes): DEVICE=cpu SEEDS="0 1" METHODS="dense wide" TARGETS=0.5 LIMIT=2 \
#   bash bench/quality_seeds.sh --steps 2 --batch-size 2 --seq-len 64 --max-eval-sequences 4 --tasks arc_easy
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
SEEDS=${SEEDS:-"0 1 2"}
METHODS=${METHODS:-"dense wide dynamic_depth"}
TARGETS=${TARGETS:-"0.25 0.5"}
RUNS=${RUNS:-runs/seeds}
RESULTS=${RESULTS:-bench/results/quality_seeds}
mkdir -p "$RESULTS"
ALL="dense wide wide_lora dynamic_depth dynamic_depth_lora module_skip module_skip_lora static_width static_width_lora"
END=$(( $(date +%s) + ${BUDGET_S:-1000000} ))
complete=1 failed=0
. bench/compare_run.sh
one_seed() {  # SEED METHODS OUT [compare arguments...]
    local seed=$1 methods=$2 out=$3
    shift 3
    [ "$methods" = all ] && methods=$ALL
    compare_run "$seed" "$out" "$methods" "$TARGETS" "$@"
}
inputs=()
seeds=($SEEDS)
gpus=(${GPUS:-})
if [ ${#gpus[@]} -gt 1 ]; then
    # One queue of seeds per GPU (seed k on GPU k mod n), the queues side by side: the seeds
    # run in parallel only across GPUs, never two on one.
    pids=()
    for i in "${!gpus[@]}"; do
        (
            for k in "${!seeds[@]}"; do
                [ $(( k % ${#gpus[@]} )) -eq "$i" ] || continue
                CUDA_VISIBLE_DEVICES=${gpus[i]} one_seed "${seeds[k]}" "$METHODS" "seed${seeds[k]}" "$@" > "$RESULTS/seed${seeds[k]}.log" 2>&1
            done
        ) &
        pids+=($!)
    done
    wait "${pids[@]}" || true  # what each seed left is in its log, read next
    logs=()
    for s in "${seeds[@]}"; do logs+=("$RESULTS/seed$s.log"); done
    compare_status "${logs[@]}"
else
    for s in "${seeds[@]}"; do one_seed "$s" "$METHODS" "seed$s" "$@"; done
fi
# Its own results file: `wide compare` rewrites its file after every method, so a call cut
# half-way through the wider set would otherwise leave the first seed's file without the rows
# that the headline methods had (the same run directory keeps their trainings and evaluations).
if [ -n "${METHODS_FIRST:-}" ]; then
    first=$METHODS_FIRST
    # the summary reads this file in place of the headline one: it must hold METHODS too
    [ "$first" = all ] || first=$(printf '%s\n' $METHODS $METHODS_FIRST | awk '!seen[$0]++' | xargs)
    one_seed "${seeds[0]}" "$first" "seed${seeds[0]}_all" "$@"
fi
if [ "$failed" = 1 ]; then echo "a comparison failed (above): no summary"; exit 1; fi
if [ "$complete" != 1 ]; then echo "not every seed finished: no summary yet"; exit 0; fi
for s in "${seeds[@]}"; do inputs+=("$RESULTS/seed$s.json"); done
if [ -n "${METHODS_FIRST:-}" ]; then inputs[0]="$RESULTS/seed${seeds[0]}_all.json"; fi  # a superset of seedK
$PY bench/seeds_summary.py "${inputs[@]}" --out "${SUMMARY:-$RESULTS/quality_smollm2_seeds}"
