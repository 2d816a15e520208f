#!/usr/bin/env bash
# Token-budget scaling of WIDE stage 1 at 50% FLOP-weighted sparsity on the default model
# (SmolLM2-135M-Instruct): cross-entropy (--loss ce) against self-distillation (--loss kd) at
# 1.64M, 6.55M and 26.2M calibration tokens (50, 200 and 800 steps of 128 x 256 tokens), bf16
# autocast, seed 0; each run evaluated on held-out perplexity and the seven zero-shot tasks (first
# LIMIT documents each), the dense model once. Every quality record carries loss, tokens and seed;
# bench/scaling_plot.py then writes RESULTS/quality_scaling.{md,json,png}. Phase "extra" then
# runs, at SHIP_TOKENS with the loss that won there, the 25% routers (right after that budget's
# grid points) and more seeds at 50% and 25% (RESULTS/extra).
#
# Measured on one H200 (bench/results/quality_scaling/README.md): 128k tokens/s with ce and 93k
# with kd; each calibration or evaluation also pays ~15-25 s of start-up (Python, model, data,
# decontamination, the evaluation itself ~30 s), which dominates the small budgets. Calls 2-4
# took 25 device minutes (the grid about 20, the extra runs 5), the speed benchmark 1.5. A device call runs at most 10 min, so it runs in several calls on the
# same (warm) machine, each given BUDGET_S seconds: a command still running then is stopped and
# resumes from its checkpoint in the next call; finished runs and evaluations are skipped.
# The machine has no network: unpack the assets first (scripts/device_assets.py) and set
# WIDE_CACHE_DIR; keep RUNS and RESULTS outside the repository so that they survive between
# calls, and let PACK_TO=$OUT take RESULTS back as 15 MB parts of one tarball (a call returns at
# most 8 files of 16 MB; join with `cat quality_scaling.tgz.* | tar xz`). The calls that made
# bench/results/quality_scaling, back to back:
#   S="WIDE_CACHE_DIR=/root/wc RUNS=/root/scaling/runs RESULTS=/root/scaling/results PACK_TO=$OUT"
#   call 1, carry .device_assets/part1 (random weights of the same shape: no assets needed yet):
#   env $S PHASES=speed SPEED_MODEL=smollm2-135m BUDGET_S=420 bash bench/quality_scaling.sh
#   call 2, carry .device_assets/part2 (the last part; `pack` now makes as many parts as fit beside
#   the working tree, three since it passed ~6 MiB: carry each in turn, unpack in the last call);
#   calls 3 and 4 the same command (unpacking skipped):
#   ( [ -f /root/wc/.unpacked ] || { python3 scripts/device_assets.py unpack --cache /root/wc &&
#     touch /root/wc/.unpacked; } ) && env $S PHASES="train eval plot extra" BUDGET_S=555 bash bench/quality_scaling.sh
#
# Settings (environment): RESULTS (records, default $OUT or bench/results/quality_scaling),
# RUNS (run directories, default runs/scaling), TOKENS (budgets), LOSSES, BATCH, SEQ, SEED, AMP,
# LIMIT, PCT (the target in percent, default 50), EVAL_ARGS (more `wide eval` options), CAL_ARGS
# (more `wide calibrate` options, e.g.
# "--router-init dense --sparsity-warmup 0.5 --lr 6e-3") with TAG (a suffix that keeps those runs
# apart, e.g. -dense; give such runs their own RESULTS, the plot keys points by loss, tokens and
# seed), DEVICE, DATA (calibration source, default wiki, the
# corpus of every earlier quality number; DATA=samples trains on the model's own text: a first
# call with PHASES=sample samples SAMPLE_TOKENS tokens with wide sample-data, perplexity is then
# measured on wiki), EVAL_DATA. The steps of a budget are TOKENS / (BATCH x SEQ).
# CPU smoke test of the plumbing (a few minutes): DEVICE=cpu AMP=none TOKENS=256 BATCH=2 SEQ=64
#   LIMIT=2 EVAL_ARGS="--max-eval-sequences 4 --tasks arc_easy" PHASES="train eval plot" bash ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
WIDE=${WIDE:-"$PY -m wide.cli"}  # a trial that patches wide and runs its CLI may stand in
RESULTS=${RESULTS:-${OUT:-bench/results/quality_scaling}}
RUNS=${RUNS:-runs/scaling}
TOKENS=${TOKENS:-"1638400 6553600 26214400"}
LOSSES=${LOSSES:-"ce kd"}
BATCH=${BATCH:-128}
SEQ=${SEQ:-256}
SEED=${SEED:-0}
AMP=${AMP:-bf16}
LIMIT=${LIMIT:-500}
DATA=${DATA:-wiki}
EVAL_DATA=${EVAL_DATA:-}
DEVICE=${DEVICE:-cuda}
PHASES=${PHASES:-"speed train eval plot extra"}
# The committed grid started its routers from random decisions, the default before 2026-12-04;
# CAL_ARGS come after these, so "--router-init dense --sparsity-warmup 0.5" there wins.
START_ARGS=${START_ARGS:-"--router-init random --sparsity-warmup 0"}
# Every record here and in bench/quality_routing.sh was made at 12 FFN groups of 128 channels,
# the default until it became per model (16 channels on this model) on 2026-12-04: pinned, so
# the commands above still make them; CAL_ARGS' --ffn-group-size (quality_routing.sh's ffnN) wins.
FFN_GROUP=${FFN_GROUP:-128}
mkdir -p "$RESULTS" "$RUNS"
# BUDGET_S: seconds this call may use. Each command gets what is left minus a reserve for the
# packing at the end; a command cut short resumes from its checkpoint in the next call.
END=$(( $(date +%s) + ${BUDGET_S:-1000000} ))
bounded() {  # and how long each command took, so that the next call's plan can count on it
    local left=$(( END - $(date +%s) - ${RESERVE_S:-25} )) t0=$SECONDS rc=0
    if [ "$left" -lt 20 ]; then echo "skipped (time is up): $*"; return 1; fi
    timeout "$left" "$@" || rc=$?
    echo "[$(( SECONDS - t0 )) s, exit $rc] ${*:1:4} ... ${*: -1}"
    return $rc
}
has() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if [ "$DATA" = samples ]; then  # the model's own text, sampled once (resumable), then trained on
    SAMPLES="$RUNS/samples-s$SEED"  # sampled with the run's seed
    if has sample; then
        # Shards are written whole and kept by a rerun: a call cut here resumes in the next one,
        # and nothing trains on an unfinished directory (the loader refuses it).
        bounded $WIDE sample-data --device "$DEVICE" --dtype bfloat16 --tokens "${SAMPLE_TOKENS:-26214400}" \
            --batch-size "${SAMPLE_BATCH:-512}" --max-new-tokens 512 --seed "$SEED" --out "$SAMPLES" \
            || { echo "sample-data: exit $? (not finished: rerun to resume)"; exit 0; }
        cp "$SAMPLES/manifest.json" "$RESULTS/samples_manifest.json"
    fi
    DATA="$SAMPLES"
    EVAL_DATA=${EVAL_DATA:-wiki}
fi
DATA_ARGS=(--data "$DATA" ${EVAL_DATA:+--eval-data "$EVAL_DATA"} --seq-len "$SEQ")

if has speed; then  # stage-1 tokens/s: ce and kd, fp32 and bf16 autocast, three batch sizes
    # SPEED_MODEL=smollm2-135m: the same shape with random weights, before the assets are unpacked
    bounded $PY -m wide.benchmarks.train_speed --model "${SPEED_MODEL:-default}" --device "$DEVICE" \
        --batch-size 16 64 128 --seq-len "$SEQ" --loss ce kd --amp none bf16 --out "$RESULTS/train_speed" \
        || echo "train_speed: exit $?"
fi

# One calibration, then its evaluation at once, so that a call cut by its limit keeps every
# finished pair. Budgets go from small to large with the losses interleaved: if the device time
# runs out, what is missing is the largest budget, not a whole loss.
calibrate_and_eval() {  # NAME TARGET LOSS TOKENS SEED RESULTS_DIR
    local name=$1 target=$2 loss=$3 tokens=$4 seed=$5 dir=$6
    local steps=$(( tokens / (BATCH * SEQ) )) run="$RUNS/$1"
    if has train && [ ! -f "$run/run.json" ]; then
        echo "== $name: $steps steps of $BATCH x $SEQ tokens"
        bounded $WIDE calibrate --device "$DEVICE" "${DATA_ARGS[@]}" --target "$target" --loss "$loss" \
            --amp "$AMP" --steps "$steps" --batch-size "$BATCH" --seed "$seed" --eval-every 0 --save-every 50 \
            --ffn-group-size "$FFN_GROUP" $START_ARGS ${CAL_ARGS:-} --out "$run" --resume || return 0
    fi
    if has eval && [ -f "$run/run.json" ] && [ ! -f "$dir/$name.json" ]; then
        bounded $WIDE eval --device "$DEVICE" "${DATA_ARGS[@]}" --routers "$run/routers" --limit "$LIMIT" \
            --batch-size 64 ${EVAL_ARGS:-} --out "$dir/$name" || return 0
        mkdir -p "$dir/runs" "$dir/routers/$name"  # how it was trained, and the routers themselves
        cp "$run/run.json" "$dir/runs/$name.run.json"
        cp "$run/history.json" "$dir/runs/$name.history.json" 2>/dev/null || true
        cp -r "$run/routers/." "$dir/routers/$name/"
    fi
}

if has eval && [ ! -f "$RESULTS/dense.json" ]; then
    bounded $WIDE eval --device "$DEVICE" "${DATA_ARGS[@]}" --limit "$LIMIT" --batch-size 64 ${EVAL_ARGS:-} \
        --out "$RESULTS/dense" || true
fi
# Beside the grid, at SHIP_TOKENS with the loss whose 50% perplexity was lower there: the 25%
# routers (shipped with the package beside the 50% ones), run as soon as that budget's grid
# points exist, and at the end more seeds at 50% and 25% (the spread). Their records go to
# RESULTS/extra so that the scaling table stays one seed per point.
SHIP_TOKENS=${SHIP_TOKENS:-6553600}
best_loss() {
    $PY - "$RESULTS" "$SHIP_TOKENS" "$SEED" "${TAG:-}" $LOSSES <<'PYEOF'
import json, sys
from pathlib import Path
results, tokens, seed, tag, losses = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
ppl = {}
for loss in losses:
    f = results / f"wide50-{loss}-{tokens}-s{seed}{tag}.json"
    if f.is_file():
        ppl[loss] = min(r["ppl"] for r in json.loads(f.read_text())["records"] if r.get("op") == "quality")
print(min(ppl, key=ppl.get) if ppl else "")
PYEOF
}
extra_runs() {  # "TARGETS" "SEEDS"
    has extra || return 0
    local best t s
    best=$(best_loss)
    if [ -z "$best" ]; then echo "extra: no 50% result at $SHIP_TOKENS tokens yet"; return 0; fi
    for s in $2; do
        for t in $1; do
            calibrate_and_eval "wide$(awk "BEGIN { print $t * 100 }")-$best-$SHIP_TOKENS-s$s${TAG:-}" "$t" "$best" "$SHIP_TOKENS" "$s" "$RESULTS/extra"
        done
    done
}

PCT=${PCT:-50}  # the grid's target in percent (records wide<PCT>-...)
for tokens in $TOKENS; do
    for loss in $LOSSES; do
        calibrate_and_eval "wide$PCT-$loss-$tokens-s$SEED${TAG:-}" "$(awk "BEGIN { print $PCT / 100 }")" "$loss" \
            "$tokens" "$SEED" "$RESULTS"
    done
    if [ "$tokens" = "$SHIP_TOKENS" ]; then extra_runs 0.25 "$SEED"; fi
done
if has plot; then
    $PY bench/scaling_plot.py "$RESULTS" || echo "scaling_plot: exit $?"
fi
extra_runs "0.5 0.25" "${EXTRA_SEEDS:-1 2}"
if [ -n "${PACK_TO:-}" ]; then  # everything so far, as one tarball in parts (and the tables to look at)
    tar czf - -C "$RESULTS" . | split -b 15m - "$PACK_TO/quality_scaling.tgz."
    cp "$RESULTS"/quality_scaling.md "$RESULTS"/train_speed.md "$PACK_TO"/ 2>/dev/null || true
fi
