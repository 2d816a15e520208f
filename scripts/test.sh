#!/usr/bin/env bash
# The test suite: sets itself up, then runs every test on the CPU. Triton kernels run
# under the interpreter (TRITON_INTERPRET=1) against float32 PyTorch references.
# WIDE_TEST_WORKERS (default 2; 0 = one process): pytest-xdist workers. The interpreted
# kernels run in one Python thread, so 2 workers on CI's 2 cores about halve the wall time
# (docs/testing.md has the suite's measured times); work stealing keeps the few 10-25 s end-to-end tests from
# finishing last on one worker. One BLAS thread per worker: with two each, the torch-bound
# README example took 50 s instead of 21 and the suite 20 s longer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${WIDE_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  xdist=(-p no:xdist)
  threads=2
else
  xdist=(-n "$workers" --dist worksteal)
  threads=1
fi
export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
log=$(mktemp)
set +e
.venv/bin/python -m pytest -q -rs "${xdist[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# pytest exits 5 when it collects nothing; an empty run must never look green.
if [ "$rc" -eq 0 ] && ! grep -Eq "^[0-9]+ passed|[0-9]+ passed" "$log"; then
  echo "no tests passed: treating as a failure" >&2
  rc=1
fi
exit "$rc"
