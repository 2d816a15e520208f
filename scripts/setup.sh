#!/usr/bin/env bash
# Creates .venv and installs wide with its test tools (lm-eval among them, for the harness tests).
# torch is installed first and on its own: a bare torch requirement with no torch present would
# pull a multi-GB CUDA build, while torch==2.13.0 here resolves to the CPU wheel (PyPI's CPU index
# as a fallback); lm-eval's torch>=1.8 is then satisfied without a download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "torch==2.13.0" 2>/dev/null \
    || "${PIP[@]}" install --index-url https://download.pytorch.org/whl/cpu torch
fi
"${PIP[@]}" install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, triton, transformers, lm_eval, xdist, wide; print('wide', wide.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| lm-eval', lm_eval.__version__)"
