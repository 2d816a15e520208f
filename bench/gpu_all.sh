#!/usr/bin/env bash
# Every GPU speed benchmark in one go: the engine's correctness on the GPU first
# (scripts/gpu_smoke.py: graph replay = eager, greedy tokens = HF for Llama, Qwen2 and Qwen3, the
# fine and hybrid modes against their PyTorch path, `wide generate --mode hybrid` included, the
# GPU-only kernel tests), then routed GEMMs and routed attention (each kernel checked against its
# fp32 reference before it is timed), the end-to-end engine, and the engine's modes (coarse, fine,
# hybrid against dense at 50 %, B = 1/8/32, prompts and decode contexts of 4k and 16k; B = 32 x 16k
# is skipped where its KV cache does not fit). Writes OUT/{kernels,attention,e2e,e2e_modes,e2e_fine,e2e_fine_pdl0,e2e_fine_pdl1,e2e_heads25,e2e_fine_b1,e2e_heads50,e2e_heads_h200}.{json,md,png,log},
# OUT/fine_gemv{,_prefill,_batches,_sweep}.{json,md},
# OUT/read_floors.{json,md}, OUT/bounds.{json,md} and OUT/calib_8b.{json,md,log}. ~25 min on one H100: more than one device
# call allows (10 min), so run it in parts, e.g. ONLY=smoke, then ONLY=e2e_modes, then the rest.
#   OUT=bench/results bash bench/gpu_all.sh
# ONLY="kernels e2e" runs a subset. The device tool returns at most 8 files, so a device call
# writes elsewhere and packs them:  OUT=/tmp/r bash bench/gpu_all.sh; tar czf $OUT/gpu.tgz -C /tmp/r .
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
ONLY=${ONLY:-smoke kernels attention e2e e2e_modes fine_gemv e2e_fine fine_sweep e2e_pdl e2e_heads25 e2e_heads50 bounds calib_8b}
run() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
    tail -n 4 "$OUT/$name.log"
}
run smoke "${SMOKE_S:-540}" python3 scripts/gpu_smoke.py
run kernels "${KERNELS_S:-170}" python3 -m wide.benchmarks.kernels --out-dir "$OUT"
run attention "${ATTENTION_S:-170}" python3 -m wide.benchmarks.attention --out "$OUT"
run e2e "${E2E_S:-200}" python3 -m wide.benchmarks.e2e --out-dir "$OUT" --sparsities 0.5,0.75,0.25 \
    --prompt-lens 4096,1024,16384 --batches 1,8,32 --reps 3 --decode-steps 16 --budget-s 150 --profile
# The modes: fine and hybrid (thresholds set to the target rate on random tokens, no trained
# weights; the hybrid's routers and thresholds at 29 % each) beside coarse, every record with its mode
run e2e_modes "${E2E_MODES_S:-540}" python3 -m wide.benchmarks.e2e --out-dir "$OUT" --name e2e_modes \
    --modes coarse,fine,hybrid --sparsities 0.5 --prompt-lens 4096,16384 --decode-ctxs 4096,16384 \
    --batches 1,8,32 --reps 3 --decode-steps 16 --no-hf --budget-s 450
# The fine mode alone (issue 47): per-element GEMVs against cuBLAS, TEAL's kernel and the
# plain-read floor at 25/50/75 % in bf16 and fp16 (T = 1; T = 2, 4 at 50 %), then the engine at
# 50 %: TTFT 4k/16k, TPOT B = 1/2/4/8/32 at 4k and 16k, peak memory of the dense and fine engines
run fine_gemv "${FINE_GEMV_S:-330}" bash -c "python3 -m wide.benchmarks.fine_gemv --models llama-3.1-8b \
    --shapes up down qkv o --tokens 1 --kept 0.25 0.5 0.75 --dtypes bf16 fp16 --teal --acc-out --prefill-tokens 4096 16384 --out '$OUT/fine_gemv' \
    && python3 -m wide.benchmarks.fine_gemv --models llama-3.1-8b --shapes up down qkv o --tokens 2 4 \
    --kept 0.5 --out '$OUT/fine_gemv_batches'"
# (TTFT and TPOT in turns with the dense engine: ~1.3x the time of separate blocks; a device call
# of its own, ~7 min; fine_gemv with fine_sweep fits another)
run e2e_fine "${E2E_FINE_S:-560}" python3 -m wide.benchmarks.e2e --out-dir "$OUT" --name e2e_fine --modes fine --fine-sums fp32,rounded \
    --sparsities 0.5 --prompt-lens 4096,16384 --decode-ctxs 4096,16384 --batches 1,2,4,8,32 --reps 3 \
    --decode-steps 16 --no-hf --memory --budget-s 500
# The GEMV tiles one by one (T = 1, 50 %, bf16, each also adding into caller-held fp32 sums):
# the compacting tiles the autotuner kept on the H100 (2026-12-07) beside their twins whose weight
# loads wait on the list alone (-nomask) and those walked under the compiler's pipeline (-nopf-sN)
run fine_sweep "${FINE_SWEEP_S:-240}" python3 -m wide.benchmarks.fine_gemv --models llama-3.1-8b \
    --shapes o qkv up down --tokens 1 --kept 0.5 --sweep --acc-out --sweep-match nomask nopf-w1 \
    BN256-BR1-BU8-P16-pf-w1-s1-atomic-compact64 BN512-BR1-BU8-P8-pf-w1-s1-atomic-compact128 --out "$OUT/fine_gemv_sweep"
# Programmatic dependent launch (wide.kernels.pdl, off by default until this says): the fine and
# hybrid checks with it on (Llama, the default tile: no autotuning compiles), then fine decode at
# B = 1 and 2 with it off and on, each against the dense engine in the same process; a call of its own
run e2e_pdl "${E2E_PDL_S:-560}" bash -c "WIDE_AUTOTUNE=0 WIDE_PDL=1 timeout 200 python3 scripts/gpu_smoke.py --fine-only --models=llama \
    && for p in 0 1; do WIDE_PDL=\$p python3 -m wide.benchmarks.e2e --out-dir '$OUT' --name e2e_fine_pdl\$p --modes fine \
    --sparsities 0.5 --prompt-lens 4096 --decode-ctxs 4096,16384 --batches 1,2 --reps 3 --decode-steps 16 --no-hf \
    --budget-s 150; done"
# Issue 48: attention heads beside the thresholds (hybrid with attention-only skip_upto routers at
# 25 % / 50 % of each routed layer's groups, layer 0 dense, thresholds at 50 %: fine GEMVs at small
# batch, the routers alone above batch 4 or where measured faster, routed decode attention at every
# batch; peak memory beside the dense engine's), against the dense engine; a call each
# (e2e_heads25 also times the fine mode at batch 1 in the same call: issue 48 asks for B=1 >= fine's)
for R in 25 50; do
    run "e2e_heads$R" "${E2E_HEADS_S:-540}" bash -c "python3 -m wide.benchmarks.e2e --out-dir '$OUT' --name e2e_heads$R \
        --modes hybrid --heads 0.$R --sparsities 0.5 --prompt-lens 4096,16384 --decode-ctxs 4096,16384 \
        --batches 1,8,32 --reps 3 --decode-steps 16 --no-hf --memory --budget-s 420 \
        && if [ $R = 25 ]; then python3 -m wide.benchmarks.e2e --out-dir '$OUT' --name e2e_fine_b1 --modes fine \
        --sparsities 0.5 --prompt-lens 4096 --decode-ctxs 4096,16384 --batches 1 --reps 3 --decode-steps 16 --no-hf \
        --budget-s 90; fi"
done
# Issue 48's rows that need an H200's memory (not in the default ONLY: name it there): 50 % head groups at
# B = 32 x 16k and 64 x 8k (each engine's KV cache 69 GB; timed alone where the two do not fit together)
# and TTFT at a 32k prompt
run e2e_heads_h200 "${E2E_HEADS_S:-540}" python3 -m wide.benchmarks.e2e --out-dir "$OUT" --name e2e_heads_h200 \
    --modes hybrid --heads 0.5 --sparsities 0.5 --prompt-lens 32768 --decode-ctxs 8192,16384 --batches 32,64 \
    --reps 3 --decode-steps 16 --no-hf --budget-s 480
# Bounds from the e2e profiles above and plain-read floors measured now, on the same machine
run bounds "${BOUNDS_S:-150}" bash -c "python3 -m wide.benchmarks.read_floors --out '$OUT' \
    && python3 -m wide.benchmarks.bounds --results '$OUT'"
# Issue 48 at a user's scale: stage 1 of design (a) on a Llama-3.1-8B-shaped model (random bf16
# weights), learned thresholds then head routers on them frozen, kd, bf16 autocast: tokens/s, peak
# memory and trained parameters per phase beside `wide calibrate --dry-run`'s estimate, at 2k-token
# sequences, 1 to 4 a step (4 is past 80 GB by the estimate: the out-of-memory side; ~2 min)
run calib_8b "${CALIB_8B_S:-300}" python3 -m wide.benchmarks.train_speed --design heads --model llama-3.1-8b \
    --dtype bfloat16 --seq-len 2048 --batch-size 1 2 3 4 --steps 6 --warmup 2 --out "$OUT/calib_8b"
