# Sourced by bench/quality_seeds.sh and bench/frontier.sh: one resumable `wide compare` call.
#   compare_run SEED NAME "METHODS" "TARGETS" [compare arguments...]
# runs the methods at the targets with seed SEED in RUNS/RUN_DIR (default seedSEED; resumed on a
# rerun), writes RESULTS/NAME.{json,md,png}, restores and keeps the run directory's evaluation
# cache in CACHE_TO as evals_RUN_DIR.json (when set)
# so that a later machine re-evaluates nothing finished, and stops at END (epoch seconds). It sets
# complete=0 when cut by the clock (a rerun resumes) and failed=1 on an error (a rerun won't help).
# Reads PY, DEVICE (default cuda), LIMIT (documents per task, default 500).
compare_run() {
    local seed=$1 name=$2 methods=$3 targets=$4 rc=0 left=$(( END - $(date +%s) - 20 ))
    local dir=${RUN_DIR:-seed$1}
    shift 4
    [ -n "$methods" ] || return 0
    mkdir -p "$RUNS/$dir"
    if [ -n "${CACHE_TO:-}" ] && [ ! -f "$RUNS/$dir/evals.json" ] && [ -f "$CACHE_TO/evals_$dir.json" ]; then
        cp "$CACHE_TO/evals_$dir.json" "$RUNS/$dir/evals.json"
    fi
    if [ "$left" -lt 60 ]; then echo "incomplete: seed $seed ($methods -> $name) skipped, time is up"; complete=0; return 0; fi
    # shellcheck disable=SC2086
    timeout "$left" $PY -m wide.cli compare --device "${DEVICE:-cuda}" --limit "${LIMIT:-500}" --quiet --seed "$seed" \
        --methods $methods --targets $targets --runs "$RUNS/$dir" --out "$RESULTS/$name" "$@" || rc=$?
    if [ -n "${CACHE_TO:-}" ] && [ -f "$RUNS/$dir/evals.json" ]; then
        mkdir -p "$CACHE_TO"
        cp "$RUNS/$dir/evals.json" "$CACHE_TO/evals_$dir.json"
    fi
    case $rc in
        0) ;;
        124|137) echo "incomplete: seed $seed ($methods -> $name) stopped by the time limit (rerun to resume)"; complete=0 ;;
        *) echo "failed: seed $seed ($methods -> $name) exit $rc"; failed=1 ;;  # an error, not the clock: rerunning won't help
    esac
    return 0
}

# compare_status LOG...: complete=0 / failed=1 from the notices compare_run wrote into the logs
# of calls that ran in subshells (whose variables stay there). Unanchored: a call cut by the
# clock mid progress bar leaves the bar's line unterminated, and the notice shares it.
compare_status() {
    local log
    for log in "$@"; do
        grep -a "incomplete: seed" "$log" && complete=0
        grep -a "failed: seed" "$log" && failed=1
    done
    return 0
}
