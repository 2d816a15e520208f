#!/usr/bin/env bash
# The first-wave quality comparison in experiments/results/quality_smollm2_firstwave/quality_smollm2_firstwave.{md,json,png}: dense, WIDE stage 1
# and 2, token-level dynamic depth, module skipping and static width pruning at 25% and 50%
# FLOP-weighted sparsity, one token budget (400 x 16 x 256 tokens per stage) and seed.
# One H200: ~13 min. A 2-core CPU: roughly a day (same command with DEVICE=cpu).
# Resumable: rerun the same command after an interruption (finished methods are cached in RUNS).
set -euo pipefail
# the `wide` CLI: the project venv's if there is one (bash scripts/test.sh makes it), else PATH's
WIDE=${WIDE:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/wide}
[ -x "$WIDE" ] || WIDE=wide
cd "$(dirname "$0")/.."
# --router-init random --sparsity-warmup 0 --ffn-group-size 128: the start and the groups these
# results were made with (the defaults before 2026-12-04); later arguments in "$@" win.
"$WIDE" compare --device "${DEVICE:-cuda}" --limit 200 --steps 400 --batch-size 16 --quiet \
    --router-init random --sparsity-warmup 0 --ffn-group-size 128 --runs "${RUNS:-runs/compare}" --out experiments/results/quality_smollm2_firstwave/quality_smollm2_firstwave "$@"
