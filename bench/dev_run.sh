#!/usr/bin/env bash
# A quick check in one device call (~3 min on one H200): the plain-read floors, the GEMM kernel
# tests compiled (bf16 included), and the e2e benchmark at 50 % (TTFT 4k, TPOT batch 1).
# PROBE=0 / TESTS=0 skip a part; TESTS_K narrows the tests (pytest -k); KERNELS=1 adds the T=1
# kernel bench; E2E=0 skips the e2e bench; E2E_ARGS=--profile adds the per-kernel profiles.
# ROUTING=1 adds the routing rules (issue 20): scripts/gpu_routing_check.py (graph = eager in
# bf16, engine vs masked HF path in fp32 with flipped decisions counted, then again with the
# kernels' fp32 dots in ieee instead of TF32, where nothing should flip), the batch-shared and
# norm_route kernel tests compiled, and an e2e run of token, tile16 and batch_shared at batches
# 1, 8 and 32 with per-kernel profiles (ROUTING_S seconds, default 300).
# Trials from experiments/ ride along: SWEEP_ARGS="--wide --shapes q" the decode GEMV sweep,
# PREFILL_SWEEP=1 the prefill gemm_mn/ffn_up tile and TMA sweep. Everything is packed into
# ${OUT:-/tmp}/r.tgz (the device tool returns at most 8 files; it sets OUT).
#   run: E2E_ARGS=--profile bash bench/dev_run.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $R/gpu.txt
if [ "${PROBE:-1}" != 0 ]; then
  timeout ${PROBE_S:-150} python -m wide.benchmarks.read_floors --out $R > $R/read_floors.log 2>&1
  echo "read floors exit $?"; grep -E "^\| read" $R/read_floors.md
fi
if [ -n "${SWEEP_ARGS:-}" ]; then
  timeout ${SWEEP_S:-300} python experiments/decode_gemv_sweep.py $SWEEP_ARGS --out $R/sweep > $R/sweep.log 2>&1
  echo "sweep exit $?"; cat $R/sweep/decode_gemv_sweep.md 2>/dev/null | tail -n 20
fi
if [ "${TESTS:-1}" != 0 ]; then
  TRITON_INTERPRET=0 timeout ${TESTS_S:-240} python -m pytest -q -x tests/test_kernels_gemm.py \
    ${TESTS_K:+-k "$TESTS_K"} > $R/gemm_tests.log 2>&1
  echo "gemm tests exit $?"; tail -n 3 $R/gemm_tests.log
fi
if [ "${KERNELS:-0}" != 0 ]; then
  mkdir -p $R/k
  timeout ${KERNELS_S:-150} python -m wide.benchmarks.kernels --tokens 1 --sparsity 0.5 \
    --out-dir $R/k > $R/k/kernels.log 2>&1
  echo "kernels exit $?"; grep -E "^\| (gemm|ffn)" $R/k/kernels.md
fi
if [ "${PREFILL_SWEEP:-0}" != 0 ]; then
  timeout ${PREFILL_SWEEP_S:-300} python experiments/prefill_gemm_sweep.py --out $R/prefill_gemm_sweep \
    > $R/prefill_sweep.log 2>&1
  echo "prefill sweep exit $?"; cat $R/prefill_gemm_sweep.md 2>/dev/null | tail -n 8
fi
if [ "${E2E:-1}" != 0 ]; then
  timeout ${E2E_S:-240} python -m wide.benchmarks.e2e --out-dir $R --sparsities 0.5 --prompt-lens 4096 \
    --batches 1 --reps 3 --decode-steps 16 --budget-s 150 --no-hf ${E2E_ARGS:-} > $R/e2e.log 2>&1
  echo "e2e exit $?"; grep -E "TTFT|TPOT" $R/e2e.log | grep -v Warn | tail -n 20
  grep -E "^\| 1 \|" $R/e2e.md | head
fi
if [ "${ROUTING:-0}" != 0 ]; then
  timeout 240 python scripts/gpu_routing_check.py $R/routing_check.json > $R/routing_check.log 2>&1
  echo "routing check exit $?"; tail -n 4 $R/routing_check.log
  timeout 200 python scripts/gpu_routing_check.py --precision ieee $R/routing_check_ieee.json \
    > $R/routing_check_ieee.log 2>&1
  echo "routing check (ieee dots) exit $?"; tail -n 3 $R/routing_check_ieee.log
  TRITON_INTERPRET=0 timeout 180 python -m pytest -q tests/test_kernels_batch_shared.py \
    tests/test_kernels_norm_route.py > $R/routing_tests.log 2>&1
  echo "routing kernel tests exit $?"; tail -n 2 $R/routing_tests.log
  timeout ${ROUTING_S:-300} python -m wide.benchmarks.e2e --out-dir $R --name e2e_routing --sparsities 0.5 \
    --prompt-lens 4096 --batches 1,8,32 --routings token,tile16,batch_shared --reps 3 --decode-steps 16 \
    --no-hf --profile --budget-s $(( ${ROUTING_S:-300} - 30 )) > $R/e2e_routing.log 2>&1
  echo "e2e routing exit $?"; grep -E "^\| (1|8|32) \|" $R/e2e_routing.md | head -n 20
fi
tar czf ${OUT:-/tmp}/r.tgz -C $R .
