#!/usr/bin/env bash
# Same-machine A/B of the batch-1 deferred router (WIDE_DEFER_ROUTER=1: the q and gate/up GEMVs
# finish the router and write the masks; 0: the decode norm kernel does, with its cross-program
# ticket). Alternates 0/1 twice so drift shows; each run is the e2e bench at 50 %, TTFT 4k and
# TPOT batch 1 (a cold first run may spend its time budget compiling: its rows are skipped).
#   OUT=/tmp/o bash experiments/defer_router_ab.sh     (results packed into $OUT/ab.tgz)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src
for v in 0 1 0 1; do
  d=/tmp/ab/$v$SECONDS; mkdir -p $d
  WIDE_DEFER_ROUTER=$v timeout 200 python -m wide.benchmarks.e2e --out-dir $d --sparsities 0.5 --prompt-lens 4096 \
    --batches 1 --reps 5 --decode-steps 32 --budget-s 120 --no-hf > $d/log 2>&1
  echo "WIDE_DEFER_ROUTER=$v exit $?"; grep -E "^\| 1 \|" $d/e2e.md; grep -c FAILED $d/log
done
tar czf ${OUT:-/tmp}/ab.tgz -C /tmp ab
