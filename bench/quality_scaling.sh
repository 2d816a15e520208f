#!/usr/bin/env bash
# Token-budget scaling of WIDE stage 1 at 50% FLOP-weighted sparsity on the default model
# (SmolLM2-135M-Instruct): cross-entropy (--loss ce) against self-distillation (--loss kd) at
# 1.64M, 6.55M and 26.2M calibration tokens (100, 400 and 1600 steps of 64 x 256 tokens), bf16
# autocast, seed 0; each run evaluated on held-out perplexity and the seven zero-shot tasks (first
# LIMIT documents each), the dense model once. Every quality record carries loss, tokens and seed;
# bench/scaling_plot.py then writes RESULTS/quality_scaling.{md,json,png}.
#
# Expected time on one H200 (from 100k tokens/s for ce and ~70k for kd in stage 1): training
# 34.4M ce tokens ~6 min and 34.4M kd tokens ~8 min, plus ~15 s of start-up per run; seven
# evaluations ~25 s each, ~3 min; the throughput benchmark ~2 min. About 20 min in all (the
# machine's start and the asset transfer come on top). A device call runs at most 10 min, so it
# runs in four calls on the same (warm) machine; everything is resumable (finished runs and
# evaluations are skipped, a cut run resumes from its checkpoint).
# The machine has no network: unpack the assets first (scripts/device_assets.py) and set
# WIDE_CACHE_DIR; keep RUNS and RESULTS outside the repository so that they survive between
# calls, and let PACK_TO=$OUT take RESULTS back as one tarball (a call returns at most 8 files):
#   S="WIDE_CACHE_DIR=/root/wc RUNS=/root/scaling/runs RESULTS=/root/scaling/results PACK_TO=$OUT"
#   call 1, carry .device_assets/part1 (random weights of the same shape: no assets needed yet):
#   env $S PHASES=speed SPEED_MODEL=smollm2-135m bash bench/quality_scaling.sh            # ~2.5 min
#   call 2, carry .device_assets/part2:
#   python3 scripts/device_assets.py unpack --cache /root/wc &&
#   env $S PHASES=train LOSSES=ce bash bench/quality_scaling.sh                           # ~7.5 min
#   call 3: env $S PHASES=train LOSSES=kd bash bench/quality_scaling.sh                  # ~9 min
#   call 4: env $S PHASES="eval plot" bash bench/quality_scaling.sh                      # ~3.5 min
# A call cut by its limit is simply repeated: the run resumes from its last checkpoint.
#
# Settings (environment): RESULTS (records, default $OUT or bench/results/quality_scaling),
# RUNS (run directories, default runs/scaling), TOKENS (budgets), LOSSES, BATCH, SEQ, SEED, AMP,
# LIMIT, EVAL_ARGS (more `wide eval` options), DEVICE, DATA (calibration source, default wiki, the
# corpus of every earlier quality number; DATA=samples trains on the model's own text: a first
# call with PHASES=sample samples SAMPLE_TOKENS tokens with wide sample-data, perplexity is then
# measured on wiki), EVAL_DATA. The steps of a budget are TOKENS / (BATCH x SEQ).
# CPU smoke test of the plumbing (a few minutes): DEVICE=cpu AMP=none TOKENS=256 BATCH=2 SEQ=64
#   LIMIT=2 EVAL_ARGS="--max-eval-sequences 4 --tasks arc_easy" PHASES="train eval plot" bash ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
WIDE="$PY -m wide.cli"
RESULTS=${RESULTS:-${OUT:-bench/results/quality_scaling}}
RUNS=${RUNS:-runs/scaling}
TOKENS=${TOKENS:-"1638400 6553600 26214400"}
LOSSES=${LOSSES:-"ce kd"}
BATCH=${BATCH:-64}
SEQ=${SEQ:-256}
SEED=${SEED:-0}
AMP=${AMP:-bf16}
LIMIT=${LIMIT:-200}
DATA=${DATA:-wiki}
EVAL_DATA=${EVAL_DATA:-}
DEVICE=${DEVICE:-cuda}
PHASES=${PHASES:-"speed train eval plot"}
mkdir -p "$RESULTS" "$RUNS"
has() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if [ "$DATA" = samples ]; then  # the model's own text, sampled once (resumable), then trained on
    SAMPLES="$RUNS/samples"
    if has sample; then
        $WIDE sample-data --device "$DEVICE" --dtype bfloat16 --tokens "${SAMPLE_TOKENS:-26214400}" \
            --batch-size "${SAMPLE_BATCH:-512}" --max-new-tokens 512 --seed "$SEED" --out "$SAMPLES"
        cp "$SAMPLES/manifest.json" "$RESULTS/samples_manifest.json"
    fi
    DATA="$SAMPLES"
    EVAL_DATA=${EVAL_DATA:-wiki}
fi
DATA_ARGS=(--data "$DATA" ${EVAL_DATA:+--eval-data "$EVAL_DATA"} --seq-len "$SEQ")

if has speed; then  # stage-1 tokens/s: ce and kd, fp32 and bf16 autocast, three batch sizes
    # SPEED_MODEL=smollm2-135m: the same shape with random weights, before the assets are unpacked
    timeout 300 $PY -m wide.benchmarks.train_speed --model "${SPEED_MODEL:-default}" --device "$DEVICE" \
        --batch-size 16 64 128 --seq-len "$SEQ" --loss ce kd --amp none bf16 --out "$RESULTS/train_speed" \
        || echo "train_speed: exit $?"
fi

for loss in $LOSSES; do
    for tokens in $TOKENS; do
        steps=$(( tokens / (BATCH * SEQ) ))
        name="wide50-$loss-$tokens-s$SEED"
        run="$RUNS/$name"
        if has train && [ ! -f "$run/run.json" ]; then
            echo "== $name: $steps steps of $BATCH x $SEQ tokens"
            $WIDE calibrate --device "$DEVICE" "${DATA_ARGS[@]}" --target 0.5 --loss "$loss" --amp "$AMP" \
                --steps "$steps" --batch-size "$BATCH" --seed "$SEED" --eval-every 0 --save-every 100 \
                --out "$run" --resume
        fi
        if has eval && [ -f "$run/run.json" ] && [ ! -f "$RESULTS/$name.json" ]; then
            $WIDE eval --device "$DEVICE" "${DATA_ARGS[@]}" --routers "$run/routers" --limit "$LIMIT" \
                --batch-size 64 ${EVAL_ARGS:-} --out "$RESULTS/$name"
            mkdir -p "$RESULTS/runs"  # how it was trained: tokens/s, command, data, decontamination
            cp "$run/run.json" "$run/history.json" "$RESULTS/runs/" 2>/dev/null || true
            mv "$RESULTS/runs/run.json" "$RESULTS/runs/$name.run.json"
            mv "$RESULTS/runs/history.json" "$RESULTS/runs/$name.history.json"
        fi
    done
done
if has eval && [ ! -f "$RESULTS/dense.json" ]; then
    $WIDE eval --device "$DEVICE" "${DATA_ARGS[@]}" --limit "$LIMIT" --batch-size 64 ${EVAL_ARGS:-} \
        --out "$RESULTS/dense"
fi
if has plot; then
    $PY bench/scaling_plot.py "$RESULTS"
fi
if [ -n "${PACK_TO:-}" ]; then  # everything so far, as one file (and the table and plot to look at)
    tar czf "$PACK_TO/quality_scaling.tgz" -C "$RESULTS" .
    cp "$RESULTS"/quality_scaling.md "$RESULTS"/quality_scaling.png "$RESULTS"/train_speed.md "$PACK_TO"/ 2>/dev/null || true
fi
