#!/usr/bin/env bash
# Stage-1 router calibration of SmolLM2-135M at 50% FLOP-weighted sparsity on the embedded
# Wikipedia text, then dense vs routed evaluation. CPU, about 1-2 hours on 2 cores.
# Usage: bash bench/quality_stage1.sh [run_dir]   (re-running resumes the calibration)
set -euo pipefail
# the `wide` CLI: the project venv's if there is one (bash scripts/test.sh makes it), else PATH's
WIDE=${WIDE:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/wide}
[ -x "$WIDE" ] || WIDE=wide
RUN=${1:-runs/smollm2-50}
STEPS=${STEPS:-240}
LIMIT=${LIMIT:-100}
# the committed run's random start (the default before 2026-12-04)
"$WIDE" calibrate --target 0.5 --loss-mode flops --steps "$STEPS" --batch-size 4 --seq-len 256 \
  --router-init random --sparsity-warmup 0 --eval-every 60 --eval-batches 4 --save-every 20 --out "$RUN" --resume
"$WIDE" eval --routers "$RUN/routers" --dense --limit "$LIMIT" --batch-size 8 --overwrite \
  --out experiments/results/quality_smollm2_firstwave/quality_smollm2_stage1
