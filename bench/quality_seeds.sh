#!/usr/bin/env bash
# The headline comparison over seeds: `wide compare` once per seed (each its own run directory,
# resumable), then bench/seeds_summary.py for the mean and range of every method at every target
# (RESULTS/quality_smollm2_seeds.{json,md,png}). Extra arguments go to every `wide compare`.
#
#   SEEDS="0 1 2" METHODS="dense wide dynamic_depth" TARGETS="0.25 0.5" \
#       bash bench/quality_seeds.sh --steps 400 --batch-size 32 --amp bf16
#
# The seeds run one after the other: run as three processes at once on one H200 (beside a fourth
# training run) they were far slower than in turn (none finished a 400-step stage 1 in 7 minutes,
# ~1 minute alone; the fourth ran at 47k tokens/s against 128k alone): the GPU time-slices
# between processes.
# GPUS="0 1 2" runs the seeds on those GPUs side by side (seed k on GPU k mod n, each seed's
# output in RESULTS/seedK.log); on one GPU they run in turn.
# Settings (environment): SEEDS, METHODS, TARGETS, GPUS, LIMIT (documents per task, default 500),
# DEVICE (default cuda), RUNS (run directories, default runs/seeds), RESULTS (default
# bench/results/quality_seeds), PY. On the offline GPU machine unpack the assets first
# (scripts/device_assets.py) and set WIDE_CACHE_DIR, as in bench/quality_scaling.sh.
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
one_seed() {
    # shellcheck disable=SC2086
    $PY -m wide.cli compare --device "${DEVICE:-cuda}" --limit "${LIMIT:-500}" --quiet --seed "$1" \
        --methods $METHODS --targets $TARGETS --runs "$RUNS/seed$1" --out "$RESULTS/seed$1" "${@:2}"
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
                CUDA_VISIBLE_DEVICES=${gpus[i]} one_seed "${seeds[k]}" "$@" > "$RESULTS/seed${seeds[k]}.log" 2>&1 \
                    || echo "seed ${seeds[k]} on GPU ${gpus[i]}: exit $? (log: $RESULTS/seed${seeds[k]}.log)"
            done
        ) &
        pids+=($!)
    done
    wait "${pids[@]}"
else
    for s in "${seeds[@]}"; do one_seed "$s" "$@"; done
fi
for s in "${seeds[@]}"; do inputs+=("$RESULTS/seed$s.json"); done
$PY bench/seeds_summary.py "${inputs[@]}" --out "$RESULTS/quality_smollm2_seeds"
