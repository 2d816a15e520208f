#!/usr/bin/env bash
# K-major O/down weights on one H200, in one device call (~6 min): the batch-1 K-major GEMV
# sweep (bench/decode_kmajor_sweep.py, T=1), the compiled K-major kernel tests, the full e2e
# benchmark with the K-major layout (the default), and the e2e at 50 % with WIDE_K_MAJOR=0 (the
# HF layout) for an A/B in the same session. Everything is packed into $OUT/r.tgz.
#   OUT=/tmp/out bash bench/kmajor_ab.sh
set -u
export PYTHONPATH=src
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $R/gpu.txt
timeout ${SWEEP_S:-150} python bench/decode_kmajor_sweep.py --tokens 1 --out $R ${SWEEP_ARGS:-} \
    > $R/kmajor.log 2>&1
echo "sweep exit $?"; grep -E "BAD|FAIL" $R/kmajor.log | head -5; grep -E "\| 1 \|" $R/decode_kmajor_sweep.md
TRITON_INTERPRET=0 timeout 120 python -m pytest -q -x tests/test_kernels_gemm.py -k "k_major" \
    > $R/gemm_tests.log 2>&1
echo "k_major tests exit $?"; tail -n 1 $R/gemm_tests.log
mkdir -p $R/full $R/hf_layout
WIDE_K_MAJOR=1 timeout ${E2E_S:-200} python -m wide.benchmarks.e2e --out-dir $R/full \
    --sparsities 0.5,0.75,0.25 --prompt-lens 4096,1024,16384 --batches 1,8,32 --reps 3 \
    --decode-steps 16 --budget-s 150 --profile > $R/full/e2e.log 2>&1
echo "e2e (K-major) exit $?"; grep -E "e2e_t" $R/full/e2e.log | head -12
WIDE_K_MAJOR=0 timeout 120 python -m wide.benchmarks.e2e --out-dir $R/hf_layout --sparsities 0.5 \
    --prompt-lens 4096 --batches 1 --reps 3 --decode-steps 16 --budget-s 80 --no-hf --profile \
    > $R/hf_layout/e2e.log 2>&1
echo "e2e (HF layout) exit $?"; grep -E "e2e_t" $R/hf_layout/e2e.log | head -4
tar czf ${OUT:-/tmp}/r.tgz -C $R .
