#!/usr/bin/env bash
# Quality of the routing rules (issue 20) and of router choices (issue 19), on the default model
# at 50%, stage 1, ce, the 6.55M-token budget of bench/quality_scaling.sh (200 steps of 128 x 256,
# seed 0): per-token routing from a random start is that grid's point (ppl 110.7).
# A variant is one or more parts joined by "+", each adding `wide calibrate` options:
#   dense       --router-init dense --sparsity-warmup 0.5 (routers start at "run every group" and
#               the target ramps over the first half of the run; wide's default since 2026-12-04,
#               but a variant without it starts random, as the grid did: quality_scaling.sh's
#               START_ARGS)
#   tileN       --route-tile N (the tokens of a tile of N positions share the mask of the tile's
#               first token, in training and inference)
#   prev        --tile-source previous (with tileN: a tile's mask is decided on the mean of the
#               previous tile's router inputs instead of its first token's)
#   lrX         --lr X                  rankN   --router-rank N
#   ffnN        --ffn-group-size N      attnN   --attn-group-size N (the default model has 3
#               attention groups of 3 heads, where Llama-3.1-8B has 8; attn1 gives it 9. A variant
#               without ffnN runs 12 FFN groups of 128, as every record before 2026-12-04 did
#               (quality_scaling.sh's FFN_GROUP), although wide's default on this model is now 16
#               channels, 96 groups: ffn16 asks for that)
#   normed      --router-input normed   layer   --budget layer (the target holds in every layer)
#   tauA-B      --tau-start A --tau-end B
#   sN          seed N instead of SEED (the run's name keeps the seed where the grid's does)
#   pN          target N% instead of 50% (the run's name starts wide<N>- where it says wide50-)
#   kd, mix     that loss instead of ce, in both stages (the run's name carries it where ce stands)
#   samples     both stages calibrate on text sampled from the dense model (`wide sample-data`,
#               SAMPLE_TOKENS tokens, default 2 x TOKENS so that stage 1 and 2 together see each
#               sample about once, batches of SAMPLE_BATCH, default 2048; sampled once into
#               RUNS/samples-s<seed>, resumable shard by shard) instead of the 600k-token wiki corpus
#               (which 6.55M tokens repeat 11 times); perplexity is still held-out wiki
#   comp        every wide command of the run goes through experiments/skip_compensation_cpu.py: each
#               routed module also learns, per group, what to add when a token skips it (a trial,
#               not in the library)
#   unionC      --union-coef C (a loss term on the expected union of 8 tokens' masks; the runs of
#               2026-12-05 made it through experiments/union_penalty_cpu.py, the same term before it
#               landed; experiments/union_penalty_gpu.sh measures the unions and decode-mode ppl)
#   sotu        both stages calibrate on the 233 State of the Union addresses (`--data sotu`, 1.58M
#               tokens after decontamination, 2.8x wiki's 0.57M: 6.55M tokens repeat it 4 times);
#               perplexity is still held-out wiki
#   loraX       then stage 2 on those routers: `wide recover --lr X` for LORA_TOKENS (default
#               TOKENS; another budget adds -t<LORA_TOKENS> to the name) at the same batch,
#               evaluated like stage 1; the stage-1 run is the variant without this part
#               (shared with it, not trained again). loraXrN: the same with --lora-r N (LoRA rank;
#               default 16)
# (dots in a name become "p": tau2-0.2 is tagged tau2-0p2)
# e.g. "dense+lr6e-3+s1" -> runs/records wide50-ce-6553600-s1-dense+lr6e-3;
# "lr1.2e-2+lora1e-3" -> stage 1 wide50-ce-6553600-s0-lr1p2e-2, stage 2 ...-s0-lr1p2e-2+lora1e-3.
# The variant "shared" is the batch-shared decode measurement instead: the decode-mode perplexity
# of `wide eval --decode-batches 8 32` (half of each held-out window prefilled, the other half
# decoded one token per step on the KV cache, teacher-forced), with each sequence's own masks and
# with one mask per batch of 8 or 32 unrelated windows, for the shipped 50% routers (and the
# dense model as the reference).
# A stage-1 run that an earlier machine finished and whose routers ship with the package (their
# provenance names its record) is not trained again: RUNS gets the shipped routers and the
# committed run.json, RESULTS the committed record, so that its loraX stage 2 starts at once.
# Records go to RESULTS (default bench/results/routing_quality); the same settings as
# bench/quality_scaling.sh otherwise (read its header for the device set-up: assets, WIDE_CACHE_DIR,
# RUNS, BUDGET_S, PACK_TO). VARIANTS picks and orders the runs; a call cut by BUDGET_S resumes.
# GPUS="0 1 2 3" (a machine of several GPUs) runs the variants in one queue per GPU, side by side,
# each queue's output in RUNS/gpuN.log: a variant and its loraX stage 2 share a queue, and so do
# all variants with `samples`. The device's time counts per machine, not per GPU.
#   env $S VARIANTS="dense tile16 tile64" BUDGET_S=540 bash bench/quality_routing.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
RESULTS=${RESULTS:-bench/results/routing_quality}
RUNS=${RUNS:-runs/routing}
TOKENS=${TOKENS:-6553600}
VARIANTS=${VARIANTS:-"dense tile16 tile64 tile128 shared"}
LIMIT=${LIMIT:-500}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-128}
SEQ=${SEQ:-256}
AMP=${AMP:-bf16}
mkdir -p "$RESULTS" "$RUNS"
# The dense reference is the scaling grid's (same command and settings): not measured again.
# DENSE=eval measures it again instead (bench/quality_scaling.sh does, before the first variant):
# records since 2026-12-05 carry per-document task scores, which pair with a dense record's only
# if it has them too (wide.evaluation.evaluate.above_chance_se).
[ -f "$RESULTS/dense.json" ] || [ "${DENSE:-copy}" = eval ] || cp bench/results/quality_scaling/dense.json "$RESULTS/"
END=$(( $(date +%s) + ${BUDGET_S:-1000000} ))
left() { echo $(( END - $(date +%s) )); }
COMMITTED=bench/results/routing_quality
from_shipped() {  # RUN: a finished stage-1 run, rebuilt from the package if it shipped
    local run=$1 prov d
    [ -f "$RUNS/$run/run.json" ] && return 0
    prov=$(grep -lF "\"results_file\": \"$COMMITTED/$run.json\"" src/wide/shipped/*/provenance.json 2>/dev/null | head -n 1 || true)
    [ -n "$prov" ] && [ -f "$COMMITTED/runs/$run.run.json" ] || return 0
    d=$(dirname "$prov")
    echo "== $run: stage 1 from the shipped $(basename "$d") (not trained again)"
    mkdir -p "$RUNS/$run/routers" "$RESULTS/runs"
    cp "$d/routers.safetensors" "$d/wide_config.json" "$d/wide_manifest.json" "$RUNS/$run/routers/"
    cp "$COMMITTED/runs/$run.run.json" "$RUNS/$run/run.json"
    if [ "$(cd "$RESULTS" && pwd)" != "$(cd "$COMMITTED" && pwd)" ]; then
        cp "$COMMITTED/$run.json" "$COMMITTED/$run.md" "$RESULTS/" 2>/dev/null || true
        cp "$COMMITTED/runs/$run.run.json" "$RESULTS/runs/"
        cp "$COMMITTED/runs/$run.history.json" "$RESULTS/runs/" 2>/dev/null || true
    fi
}
one_variant() {  # VARIANT
    local v=$1
    if [ "$(left)" -lt 60 ]; then echo "skipped (time is up): $v"; return 0; fi
    if [ "$v" = shared ]; then
        for r in dense smollm2-135m-50; do
            [ -f "$RESULTS/decode-$r.json" ] && continue
            rt=(); [ "$r" = dense ] || rt=(--routers "$r")
            timeout $(( $(left) - 10 )) $PY -m wide.cli eval --device "$DEVICE" --data wiki --seq-len 256 "${rt[@]}" \
                --tasks --batch-size 64 --decode-batches 8 32 --decode-windows "${DECODE_WINDOWS:-64}" \
                --out "$RESULTS/decode-$r" || echo "decode eval $r: exit $?"
        done
        return 0
    fi
    local args="" seed=${SEED:-0} tag="" lora="" loss=ce data=wiki pct=50 wide="$PY -m wide.cli"
    local part r rt t s1 name lt run2 steps lrank d ed phases
    for part in ${v//+/ }; do
        case $part in
            dense) args+=" --router-init dense --sparsity-warmup 0.5" ;;
            tile*) args+=" --route-tile ${part#tile}" ;;
            prev) args+=" --tile-source previous" ;;
            lr*) args+=" --lr ${part#lr}" ;;
            rank*) args+=" --router-rank ${part#rank}" ;;
            ffn[0-9]*) args+=" --ffn-group-size ${part#ffn}" ;;
            attn[0-9]*) args+=" --attn-group-size ${part#attn}" ;;
            normed) args+=" --router-input normed" ;;
            layer) args+=" --budget layer" ;;
            tau*-*) t=${part#tau}; args+=" --tau-start ${t%-*} --tau-end ${t#*-}" ;;
            s[0-9]*) seed=${part#s}; continue ;;
            p[0-9]*) pct=${part#p}; continue ;;
            lora*) lora=${part#lora}; continue ;;
            kd|mix) loss=$part; continue ;;
            samples) data=samples ;;
            sotu) data=sotu ;;
            comp) wide="$PY experiments/skip_compensation_cpu.py" ;;
            union[0-9]*) args+=" --union-coef ${part#union}" ;;
            *) echo "unknown part $part of variant $v"; exit 2 ;;
        esac
        tag+="+${part//./p}"  # no dots: `--out NAME` takes what follows one as a suffix
    done
    from_shipped "wide$pct-$loss-$TOKENS-s$seed${tag:+-${tag#+}}"
    phases="train eval"; [ "$data" = samples ] && phases="sample $phases"
    ed=; [ "$data" = sotu ] && ed=wiki  # held-out perplexity stays wiki's (samples: quality_scaling.sh's own)
    env RESULTS="$RESULTS" RUNS="$RUNS" TOKENS="$TOKENS" LOSSES="$loss" PCT="$pct" PHASES="$phases" LIMIT="$LIMIT" SEED="$seed" \
        DATA="$data" EVAL_DATA="$ed" SAMPLE_TOKENS="${SAMPLE_TOKENS:-$(( 2 * TOKENS ))}" SAMPLE_BATCH="${SAMPLE_BATCH:-2048}" \
        DEVICE="$DEVICE" BATCH="$BATCH" SEQ="$SEQ" AMP="$AMP" CAL_ARGS="$args" TAG="${tag:+-${tag#+}}" WIDE="$wide" \
        BUDGET_S="$(left)" PACK_TO= bash bench/quality_scaling.sh
    [ -n "$lora" ] || return 0
    s1="wide$pct-$loss-$TOKENS-s$seed${tag:+-${tag#+}}"
    name="wide$pct-$loss-$TOKENS-s$seed-${tag#+}${tag:++}lora${lora//./p}"
    lt=${LORA_TOKENS:-$TOKENS}; [ "$lt" = "$TOKENS" ] || name+="-t$lt"  # stage 2's own budget
    [ -f "$RESULTS/$name.json" ] && return 0
    if [ ! -f "$RUNS/$s1/run.json" ]; then echo "stage 2 $name: stage 1 ($s1) not finished"; return 0; fi
    if [ "$(left)" -lt 60 ]; then echo "skipped (time is up): $name"; return 0; fi
    run2="$RUNS/$name" steps=$(( lt / (BATCH * SEQ) ))
    lrank=(); case $lora in *r*) lrank=(--lora-r "${lora##*r}"); lora=${lora%r*} ;; esac
    if [ ! -f "$run2/run.json" ]; then
        echo "== $name: stage 2, $steps steps of $BATCH x $SEQ tokens at lr $lora"
        d=$data; [ "$data" = samples ] && d="$RUNS/samples-s$seed"  # quality_scaling.sh's SAMPLES
        [ "$data" = wiki ] || d+=" --eval-data wiki"
        # shellcheck disable=SC2086
        timeout $(( $(left) - 10 )) $wide recover --device "$DEVICE" --data $d --seq-len "$SEQ" \
            --routers "$RUNS/$s1/routers" --steps "$steps" --batch-size "$BATCH" --amp "$AMP" --lr "$lora" --loss "$loss" \
            --seed "$seed" "${lrank[@]}" --eval-every 0 --save-every 50 --out "$run2" --resume || { echo "recover $name: exit $?"; return 0; }
    fi
    timeout $(( $(left) - 10 )) $wide eval --device "$DEVICE" --data wiki --seq-len "$SEQ" \
        --routers "$run2/recovered" --limit "$LIMIT" --batch-size 64 ${EVAL_ARGS:-} --out "$RESULTS/$name" \
        || { echo "eval $name: exit $?"; return 0; }
    mkdir -p "$RESULTS/runs"
    cp "$run2/run.json" "$RESULTS/runs/$name.run.json"
    cp "$run2/history.json" "$RESULTS/runs/$name.history.json" 2>/dev/null || true
}
# The stage-1 run a variant trains or reads: the variant without its loraX part
stage1_of() { local v="+$1+" p; for p in ${1//+/ }; do case $p in lora*) v=${v/+$p+/+} ;; esac; done; v=${v#+}; echo "${v%+}"; }
gpus=(${GPUS:-})
if [ ${#gpus[@]} -gt 1 ]; then
    # One queue of variants per GPU, the queues side by side (never two runs on one GPU: they
    # time-slice, bench/quality_seeds.sh). Variants that share a stage-1 run share a queue, and so
    # do all that sample text (one sample directory per seed): nothing is trained twice at once.
    declare -A home=()
    queues=()
    n=0
    for v in $VARIANTS; do
        case "+$v+" in *+samples+*) key=samples ;; *) key=$(stage1_of "$v") ;; esac
        if [ -z "${home[$key]+x}" ]; then home[$key]=$(( n % ${#gpus[@]} )); n=$(( n + 1 )); fi
        queues[${home[$key]}]+=" $v"
    done
    pids=()
    for i in "${!gpus[@]}"; do
        [ -n "${queues[i]:-}" ] || continue
        echo "GPU ${gpus[i]}:${queues[i]} (log: $RUNS/gpu${gpus[i]}.log)"
        ( for v in ${queues[i]}; do CUDA_VISIBLE_DEVICES=${gpus[i]} one_variant "$v"; done ) > "$RUNS/gpu${gpus[i]}.log" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}" || true
    for i in "${!gpus[@]}"; do
        [ -f "$RUNS/gpu${gpus[i]}.log" ] && grep -a "^| wide\|exit\|skipped\|not finished" "$RUNS/gpu${gpus[i]}.log" | sed "s/^/[GPU ${gpus[i]}] /"
    done
else
    for v in $VARIANTS; do one_variant "$v"; done
fi
# every run so far in one table, each beside the settings its run.json holds
$PY bench/variants_table.py "$RESULTS" > /dev/null || echo "variants_table: exit $?"
if [ -n "${PACK_TO:-}" ]; then
    tar czf - --exclude=routers -C "$RESULTS" . | split -b 15m - "$PACK_TO/routing_quality.tgz."
fi
