#!/usr/bin/env bash
# The union-penalty trial (experiments/union_penalty_cpu.py) at the GPU budget: stage 1 of the
# default model at 50 %, the best per-token recipe (dense start, lr 1.2e-2, 96 FFN groups of 16,
# ce, 200 steps of 128 x 256 = 6.55M tokens, seed 0) without the penalty and with coefficients
# COEFS (default "2 8", `--union-coef`) on the expected union of 8 tokens' masks. Then, for the router sets,
# the FLOP-weighted share of the weights that the union of 1, 8 and 32 random held-out tokens runs
# (`union_penalty_cpu.py measure`: what a decode batch of unrelated sequences reads with
# per-token routing) and the decode-mode perplexity with each sequence's own masks and with
# batch-shared masks over 8 and 32 windows (`wide eval --decode-batches 8 32`).
# Needs the assets (bench/quality_scaling.sh's header: WIDE_CACHE_DIR, RUNS, RESULTS, PACK_TO):
#   S="WIDE_CACHE_DIR=/root/wc RUNS=/root/union/runs RESULTS=/root/union/results PACK_TO=$OUT"
#   env $S BUDGET_S=540 bash experiments/union_penalty_gpu.sh
#   env $S BUDGET_S=540 SEED=1 COEFS=2 BASELINE=0 bash experiments/union_penalty_gpu.sh   # seed 1 of coef 2
# A call cut by BUDGET_S resumes where it stopped (finished runs, records and files are kept).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
RUNS=${RUNS:-runs/union}
RESULTS=${RESULTS:-experiments/results/union_penalty_gpu}
BASE=${BASE:-dense+lr1.2e-2+ffn16}
COEFS=${COEFS:-"2 8"}
SEED=${SEED:-0}           # another seed adds +sN to every variant (quality_routing.sh's part)
BASELINE=${BASELINE:-1}   # 0: only the penalised runs (e.g. further seeds)
T0=$SECONDS
BUDGET_S=${BUDGET_S:-3600}
left() { echo $(( BUDGET_S - (SECONDS - T0) )); }
mkdir -p "$RESULTS"
sfx=; [ "$SEED" = 0 ] || sfx=+s$SEED
variants=; [ "$BASELINE" = 0 ] || variants="$BASE$sfx"
for c in $COEFS; do variants+=" $BASE+union$c$sfx"; done
env RUNS="$RUNS" RESULTS="$RESULTS" VARIANTS="$variants" BUDGET_S="$(left)" PACK_TO= PY="$PY" \
    bash bench/quality_routing.sh
tag() { local t=${1%+s[0-9]*}; t=${t//./p}; echo "$RUNS/wide50-ce-6553600-s$SEED-$t/routers"; }
routers=()
for v in $variants; do
    r=$(tag "$v")
    [ -f "$r/routers.safetensors" ] || { echo "not trained (time is up?): $v"; exit 0; }
    routers+=("$r")
done
u=$RESULTS/unions${sfx/+/-}.jsonl dec=$RESULTS/decode${sfx/+/-}
if [ ! -s "$u" ] && [ "$(left)" -gt 60 ]; then
    timeout $(( $(left) - 10 )) $PY experiments/union_penalty_cpu.py measure "${routers[@]}" > "$u.part" && mv "$u.part" "$u"
fi
if [ ! -f "$dec.json" ] && [ "$(left)" -gt 60 ]; then
    timeout $(( $(left) - 10 )) $PY -m wide.cli eval --device "${DEVICE:-cuda}" --data wiki --seq-len 256 \
        --routers "${routers[@]}" --tasks --batch-size 64 --decode-batches 8 32 --decode-windows "${DECODE_WINDOWS:-64}" \
        --out "$dec" || echo "decode eval: exit $?"
fi
if [ -n "${PACK_TO:-}" ]; then
    tar czf "$PACK_TO/union_penalty_gpu.tgz" -C "$RESULTS" . \
        && tar czf "$PACK_TO/union_runs.tgz" -C "$RUNS" --exclude='*.safetensors' --exclude='*.pt' . || true
fi
