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
# Settings (environment): SEEDS, METHODS, TARGETS, LIMIT (documents per task, default 500),
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
inputs=()
for s in $SEEDS; do
    # shellcheck disable=SC2086
    $PY -m wide.cli compare --device "${DEVICE:-cuda}" --limit "${LIMIT:-500}" --quiet --seed "$s" \
        --methods $METHODS --targets $TARGETS --runs "$RUNS/seed$s" --out "$RESULTS/seed$s" "$@"
    inputs+=("$RESULTS/seed$s.json")
done
$PY bench/seeds_summary.py "${inputs[@]}" --out "$RESULTS/quality_smollm2_seeds"
