#!/usr/bin/env bash
# Every GPU speed benchmark in one go (one device call): routed GEMMs, routed attention and the
# end-to-end engine, each checked against its reference before timing. Writes
# OUT/{kernels,attention,e2e}.{json,md,png,log} and OUT/bounds.{json,md}. ~8-9 min on one H200.
#   OUT=bench/results bash bench/gpu_all.sh
# ONLY="kernels e2e" runs a subset. The device tool returns at most 8 files, so a device call
# writes elsewhere and packs them:  OUT=/tmp/r bash bench/gpu_all.sh; tar czf $OUT/gpu.tgz -C /tmp/r .
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
ONLY=${ONLY:-kernels attention e2e bounds}
run() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
    tail -n 4 "$OUT/$name.log"
}
run kernels "${KERNELS_S:-170}" python3 -m wide.benchmarks.kernels --out-dir "$OUT"
run attention "${ATTENTION_S:-170}" python3 -m wide.benchmarks.attention --out "$OUT"
run e2e "${E2E_S:-200}" python3 -m wide.benchmarks.e2e --out-dir "$OUT" --sparsities 0.5,0.75,0.25 \
    --prompt-lens 4096,1024,16384 --batches 1,8,32 --reps 3 --decode-steps 16 --budget-s 150 --profile
# Bounds from the e2e profiles above and plain-read floors measured now (bench/bounds.py)
run bounds "${BOUNDS_S:-150}" bash -c "python3 bench/decode_gemv_sweep.py --probe-only --out '$OUT/probe' \
    && cp '$OUT/probe/decode_gemv_sweep.json' '$OUT/read_floors.json' && python3 bench/bounds.py --results '$OUT'"
