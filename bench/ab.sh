#!/usr/bin/env bash
# A/B of this tree against another checkout of wide (BASE), in one device session, for changes
# that must not move speed: the kernel and end-to-end benchmarks alternate base / new for
# ROUNDS rounds, so drift of the card hits both sides alike; ab_summary.py then sets each
# base figure against the new one, with the spread between rounds beside it.
#   git archive <commit> src | (mkdir -p ab_base && tar -x -C ab_base)   # untracked: travels
#   BASE=ab_base OUT=/tmp/ab WHAT="kernels e2e" ROUNDS=2 bash bench/ab.sh
# E2E_ARGS overrides the e2e settings (both sides get the same); KERNEL_ARGS likewise.
set -u
cd "$(dirname "$0")/.."
BASE=${BASE:?BASE=path to the other checkout}
OUT=${OUT:-/tmp/ab}
WHAT=${WHAT:-kernels e2e}
ROUNDS=${ROUNDS:-2}
KERNEL_ARGS=${KERNEL_ARGS:---quick}
E2E_ARGS=${E2E_ARGS:---sparsities 0.5 --prompt-lens 4096,1024 --batches 1,8,32 --reps 3 --decode-steps 16 --no-hf}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
side() {  # name, source root, benchmark, round, args...
    local name=$1 root=$2 which=$3 r=$4; shift 4
    local dir="$OUT/$which-$name-$r" t0=$SECONDS
    mkdir -p "$dir"
    case $which in
        kernels) PYTHONPATH="$root/src" timeout "${KERNELS_TIMEOUT:-300}" python3 -m wide.benchmarks.kernels --out-dir "$dir" "$@" ;;
        e2e) PYTHONPATH="$root/src" timeout "${E2E_TIMEOUT:-400}" python3 -m wide.benchmarks.e2e --out-dir "$dir" "$@" ;;
    esac > "$dir/log" 2>&1
    echo "$which $name round $r: exit $? in $((SECONDS - t0)) s"
}
for r in $(seq 1 "$ROUNDS"); do
    for which in $WHAT; do
        args=$KERNEL_ARGS; [ "$which" = e2e ] && args=$E2E_ARGS
        # shellcheck disable=SC2086
        side base "$BASE" "$which" "$r" $args
        # shellcheck disable=SC2086
        side new . "$which" "$r" $args
    done
done
python3 bench/ab_summary.py "$OUT"
