#!/usr/bin/env bash
# Issue 48, design (a) at a GPU budget: attention head-group routers (SmolLM2-135M, 3 KV groups)
# trained beside the frozen shipped per-element thresholds smollm2-135m-fine-50, with the
# one-of-three rule (--skip-one: exactly one group skipped per token in layers 1-29), the oracle's
# group as an extra cross-entropy (--oracle-ce 3.0), an input-only choice (--input-choice) and
# lr 1e-2: the best CPU recipe (experiments/results/head_routers_query_cpu/README.md, "Control":
# 1.55x dense at 80 steps x 4 x 256 tokens, one seed). Here the same recipe at STEPS x BATCH x 256
# tokens (default 150 x 64 = 2.46M tokens, 30x the CPU's 82k; the decontaminated wiki calibration
# split holds 2,208 sequences, so ~4.3 passes over it), seeds 0, 1 and 2, each evaluated on
# the same 24 held-out windows of 256 tokens as the CPU trials (no zero-shot: bare --tasks), plus
# dense / thresholds alone and the per-token oracle on the same machine, so every ratio is one
# card's. Stages, in order of priority: dense+fine-50 eval, seed 0 (train + eval), oracle, seed 1,
# seed 2; each is skipped when its estimated time does not fit in what is left of BUDGET_S, and
# every python call runs under `timeout`. Every eval is two stages (evals): eval_NAME, the held-out
# windows alone (bare --tasks, RES/eval_NAME.json), then, with TASKS, tasks_NAME, the same eval with
# the tasks (RES/tasks_NAME.json), skipped where it does not fit: tasks cut at their limit (on the
# H100 a set's seven tasks overran the call that held its perplexity too, and nothing was written)
# leave the perplexity recorded. The summary takes ppl and sparsity from eval_NAME and the task
# columns from tasks_NAME where that finished ("-" where not).
#
# Stage 2 (STAGE2=1, issue 48's <= 1.2x dense with >= 65 % of the above-chance accuracy kept): for
# every seed of SEEDS whose library set RES/lib_sN/routers exists, LoRA on the backbone by `wide
# recover` (the frontier's stage-2 recipe, bench/results/frontier_runs: r 16 on every projection,
# lr 1e-3, 100 steps x 64 x 256 = 1.64M tokens, bf16 autocast, no target warm-up; here with --loss
# kd, the dense model as teacher, as stage 1 trained), the routers and thresholds frozen
# (--freeze-routers: they were trained with the oracle cross-entropy, which `wide recover` lacks,
# and the set's penalty counts attention groups only, so nothing would hold the thresholds), then
# the set re-set to its stage-1 rates on the same calibration batches (head_routers_fine_cpu.py
# --recalibrate: per-layer offsets onto the attention-core rate, one threshold shift onto the
# linear sparsity, offsets again; a set re-set after its conversion by heads_offsets_sample_cpu.py,
# as the shipped one is, goes back to that re-set's rates: linear 0.50, groups 0.26; the equivalent of
# `wide compare`'s learned_lora, whose thresholds are shifted back onto the target after LoRA),
# evaluated by `wide eval` (eval_lora_sN). `wide
# recover` runs with --offsets none: its default would shift the thresholds onto the routers'
# target_sparsity (0.26, an attention-group rate) as if it were a linear one. Frozen routers still
# draw Gumbel samples in training, and the set's group penalty (sparsity_coef x |sampled rate -
# 0.26| per layer) still reaches the adapters through the routers' inputs: `wide recover` has no
# switch for either; the re-set puts the rates back whatever they did. FROM=DIR runs stage 2
# alone on the library sets of an earlier call (DIR/lib_sN; RES is then DIR, kept) or of its
# archive (FROM=heads_gpu.tgz: unpacked into RES).
#
# Records (logs, run.json / history.json / routers of each seed, eval_* / tasks_* json/md,
# oracle log, summary.md) go to RES (default /tmp/heads_gpu, emptied first); after every stage they
# are packed into $OUT/heads_gpu/heads_gpu.tgz (checkpoints and the stage-2 sets' tensors left out:
# 20 MB of adapters a set; every tensor if the archive would pass 15 MiB) and stages.log /
# summary.md copied beside it, so a call cut at its limit still returns every stage that finished
# (the device tool returns at most 8 files of 16 MiB from $OUT, hence the archive). The summary's
# above-chance column (needs torch) is written at the call's end only.
#
# Rough time on one H100 (an estimate from the CPU's 62 tokens/s at ~0.8 GFLOP/token, i.e. teacher
# forward + student forward + backward to the activations, at fp32 without TF32; not measured):
# ~0.4-0.8 s/step at 64 x 256, so ~1-2 min of training per seed, ~20-30 s of start-up (imports,
# data packing, model load) per python call, ~10-20 s per 24-window eval: 3 seeds + dense + oracle
# ~6-10 min, so seed 2 may need a second call. The first seed's measured time (its training,
# evaluations and conversion) sets the budget check of the next ones. Measured since on the H100
# (experiments/results/head_routers_gpu_h100_25, stages.log): 136 s training (13 s of it start-up),
# 13 s per 24-window eval, 17 s per conversion, 31 s for dense + fine-50.
# Stage 2, estimated (not measured on this set): the frontier's stage 1 of learned thresholds on
# the H100 trained 100 steps of 64 x 256 at bf16 (ce) in ~40 s (its 66 s build less a 26 s threshold
# shift), ~0.4 s/step; kd adds a teacher forward (x1.47 per step at bf16, 64 x 256, in
# bench/results/quality_scaling/train_speed.md) and LoRA on the 210 projections ~10-20 %: ~0.7
# s/step, so ~70 s of training a seed, plus ~15-30 s start-up, ~20 s for the re-set, ~15 s for the
# perplexity and ~200 s for the tasks: measured on the H100, `wide eval` with the seven tasks at
# --limit 500 took ~110 s a model for dense and thresholds alone (225 s for dense + fine-50 in one
# call, start-up included; its estimate, then timed on the dense model only, said 74 s) and more
# than 140 s for a set of head routers + thresholds (killed at 140 s; its hooks and per-element
# masks are slower than dense: the 24-window evals of experiments/results/head_routers_gpu_h100*/
# ran ~22 batches/s dense, ~12/s fine-50, ~8-9/s a head-router set), not the 10-25 s a model of
# wide compare's runs assumed before. So ~350-400 s a seed with tasks (one seed a call of 550 s) and ~260 s for dense + fine-50
# with tasks: 3 seeds + dense ~23 min. The first seed's measured time sets the check of the next
# ones in a call, so a seed that does not fit is skipped and a later call finishes it. `wide eval`
# prints its estimate before it evaluates (in eval_* / tasks_*.log), timed on each model it
# evaluates: the figure to set TASKS_S from for another --limit or task list.
#
# Device call (the caller has unpacked the model/data cache and exported WIDE_CACHE_DIR, and runs
# from the repository root; python3 there is the one with torch):
#   export WIDE_CACHE_DIR=/root/wide_cache; STEPS=150 BATCH=64 BUDGET_S=540 bash experiments/head_routers_gpu.sh
#   # a second call for what did not fit, e.g. seed 2 alone:
#   SEEDS=2 DENSE=0 ORACLE=0 STEPS=150 BATCH=64 BUDGET_S=540 bash experiments/head_routers_gpu.sh
#   # at 25 % attention-core sparsity (one group for ~78 % of the tokens), each seed also as a library
#   # skip_upto set evaluated by `wide eval` alone (experiments/results/head_routers_share_cpu):
#   TARGET=0.26 LIBRARY=0.25 ORACLE=0 STEPS=150 BATCH=64 BUDGET_S=540 bash experiments/head_routers_gpu.sh
# Stage 1 + stage 2 of the three seeds, two back-to-back calls on one warm machine (the routers are
# not committed; the second call finds the first one's library sets in /tmp/heads_gpu; the first
# also unpacks the assets, carried in parts as experiments/results/head_routers_gpu_h100_25 says):
#   1. stage 1 + conversion, no dense and no as-trained eval (~3 x 166 s + the unpack):
#   python3 scripts/device_assets.py unpack --cache /root/wide_cache && export WIDE_CACHE_DIR=/root/wide_cache && \
#   TARGET=0.26 LIBRARY=0.25 ORACLE=0 DENSE=0 TRAINED_EVAL=0 STEPS=150 BATCH=64 START_S=40 STEP_S=0.85 \
#       EVAL_S=30 BUDGET_S=550 bash experiments/head_routers_gpu.sh
#   2. stage 2 on those sets with the seven tasks, one seed a call (~380 s each; RES = FROM, kept):
#   WIDE_CACHE_DIR=/root/wide_cache FROM=/tmp/heads_gpu SEEDS=0 DENSE=0 ORACLE=0 TASKS=all LIMIT=500 BUDGET_S=550 \
#       bash experiments/head_routers_gpu.sh      # then SEEDS=1, SEEDS=2
#   3. dense and fine-50 with the seven tasks (~270 s; records beside the sets'):
#   WIDE_CACHE_DIR=/root/wide_cache RES=/tmp/heads_gpu SEEDS= ORACLE=0 TASKS=all LIMIT=500 BUDGET_S=550 \
#       bash experiments/head_routers_gpu.sh
#   on a fresh machine, after the assets, FROM=the first call's heads_gpu.tgz copied into the working tree
#   instead of FROM=/tmp/heads_gpu (RES=... for the dense call then): nothing of stage 1 reruns.
# CPU dry run (tiny): DEVICE=cpu STEPS=2 BATCH=2 EVAL_SEQS=2 BUDGET_S=1500 OUT=/tmp/hgpu \
#   PY=/path/to/venv/bin/python bash experiments/head_routers_gpu.sh   (3.3 min on 1 thread; records in /tmp/heads_gpu)
# and of stage 1 + stage 2 in two calls (2.4 + 7.9 min on 1 thread, each eval with its tasks stage at
# --limit 2; bf16 autocast would take ~160 s a LoRA step there):
#   export DEVICE=cpu EVAL_SEQS=2 OFFSET_BATCHES=1 TASKS=all LIMIT=2 BUDGET_S=3000 OUT=/tmp/hgpu PY=...
#   SEEDS="0 1" TARGET=0.26 LIBRARY=0.25 ORACLE=0 DENSE=0 TRAINED_EVAL=0 STEPS=2 BATCH=2 \
#       bash experiments/head_routers_gpu.sh
#   FROM=/tmp/heads_gpu SEEDS="0 1" ORACLE=0 S2_STEPS=2 S2_BATCH=2 S2_AMP=none bash experiments/head_routers_gpu.sh
#
# Knobs (env): STEPS (150), BATCH (64 sequences per optimizer step), ACCUM (1: micro-batches per
# step, BATCH / ACCUM sequences each; doubled and the seed retried once on a CUDA out-of-memory),
# LR (1e-2), W (--oracle-ce, 3.0), SEEDS ("0 1 2"), DENSE / ORACLE (1: run those stages), EVAL_SEQS (24 held-out windows),
# TASKS ("": bare --tasks, no zero-shot task, as the CPU trials; "all": the seven tasks; or names;
# run in a tasks_* stage after each eval_* one),
# LIMIT (--limit for the tasks), AMP (none; bf16 autocasts the training forwards), DEVICE (cuda),
# THREADS (--threads, only on cpu by default: 1), SAVE_EVERY (50), BUDGET_S (540), TRAINED_EVAL (1;
# 0: no eval of the routers as trained, exactly one group per token: the library set's stays),
# OFFSET_BATCHES (batches of 4 calibration sequences for the conversion's offsets and the re-set: 128 on
# cuda, 8 on cpu),
# and the time estimates used to skip stages: EVAL_S (an eval on the held-out windows alone incl.
# start-up, also a conversion's: 30 s on cuda, measured 12-14 s a set, 31 s for dense + fine-50, 17 s
# a conversion), TASKS_S (a set's tasks stage incl. start-up: 200 s on cuda, for the seven tasks at
# --limit 500, where a head-router set ran over 140 s; a seed's need counts one with TASKS),
# DENSE_TASKS_S (dense + fine-50's tasks stage: 240 s on cuda, measured 225 s), ORACLE_S, START_S
# (training start-up: load, data packing), STEP_S (seconds per training step; seeds after the first
# use the first seed's measured time instead), STAGE_MAX_S (the limit of one conversion, re-set, eval or
# oracle stage: 600 s on cuda, BUDGET_S on cpu).
# Stage 2: STAGE2 (0; 1 with FROM), FROM (""), S2_STEPS (100), S2_BATCH (64), S2_ACCUM (1; doubled
# and the seed retried once on a CUDA out-of-memory), S2_LR (1e-3), S2_LOSS (kd), S2_AMP (bf16),
# S2_LORA_R (16), S2_FREEZE (1: --freeze-routers; 0 trains the routers and thresholds with the
# adapters, under `wide recover`'s loss), S2_SAVE_EVERY (0: a checkpoint at the end only), and the
# estimates S2_START_S, S2_STEP_S (later seeds: the first one's measured time), RESET_S.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-150}
BATCH=${BATCH:-64}
ACCUM=${ACCUM:-1}
LR=${LR:-1e-2}
W=${W:-3.0}
TARGET=${TARGET:-0.3333}  # per routed layer (--budget layer): 1/3 = one group for every token; 0.26 = ~78 %
LIBRARY=${LIBRARY:-}  # e.g. 0.25: each seed also converted (--to-library, skip_upto at that attention-core
                      # rate) and evaluated by `wide eval` alone (eval_lib_s*)
SEEDS=${SEEDS-"0 1 2"}  # "" for none (e.g. DENSE=1 ORACLE=1 alone)
DENSE=${DENSE:-1}
ORACLE=${ORACLE:-1}
EVAL_SEQS=${EVAL_SEQS:-24}
TASKS=${TASKS:-}
LIMIT=${LIMIT:-}
AMP=${AMP:-none}
SAVE_EVERY=${SAVE_EVERY:-50}
BUDGET_S=${BUDGET_S:-540}
TRAINED_EVAL=${TRAINED_EVAL:-1}
FROM=${FROM:-}
STAGE2=${STAGE2:-$([ -n "$FROM" ] && echo 1 || echo 0)}
S2_STEPS=${S2_STEPS:-100}
S2_BATCH=${S2_BATCH:-64}
S2_ACCUM=${S2_ACCUM:-1}
S2_LR=${S2_LR:-1e-3}
S2_LOSS=${S2_LOSS:-kd}
S2_AMP=${S2_AMP:-bf16}
S2_LORA_R=${S2_LORA_R:-16}
S2_FREEZE=${S2_FREEZE:-1}
S2_SAVE_EVERY=${S2_SAVE_EVERY:-0}
if [ "$DEVICE" = cpu ]; then
    OFFSET_BATCHES=${OFFSET_BATCHES:-8}
    THREADS=${THREADS:-1}; EVAL_S=${EVAL_S:-150}; TASKS_S=${TASKS_S:-150}; DENSE_TASKS_S=${DENSE_TASKS_S:-300}
    ORACLE_S=${ORACLE_S:-150}; START_S=${START_S:-90}
    STEP_S=${STEP_S:-$(( 5 * BATCH ))}
    S2_START_S=${S2_START_S:-90}; S2_STEP_S=${S2_STEP_S:-$(( 6 * S2_BATCH ))}
    RESET_S=${RESET_S:-$(( 60 + 60 * OFFSET_BATCHES ))}
    # a stage's own limit: what the budget leaves (a CPU re-set of 8 offset batches beside another
    # job took over 600 s, the GPU's cap)
    STAGE_MAX_S=${STAGE_MAX_S:-$BUDGET_S}
else
    THREADS=${THREADS:-}; EVAL_S=${EVAL_S:-30}; TASKS_S=${TASKS_S:-200}; DENSE_TASKS_S=${DENSE_TASKS_S:-240}
    ORACLE_S=${ORACLE_S:-60}; START_S=${START_S:-60}
    STEP_S=${STEP_S:-1.5}
    # 512 sequences: the shipped set's 32 (8 x 4) skipped 0.250 of the groups where 512 sequences
    # of the same text skip 0.242 (experiments/results/heads_offsets_sample_cpu)
    OFFSET_BATCHES=${OFFSET_BATCHES:-128}
    S2_START_S=${S2_START_S:-30}; S2_STEP_S=${S2_STEP_S:-0.8}; RESET_S=${RESET_S:-90}
    STAGE_MAX_S=${STAGE_MAX_S:-600}  # a device call's limit
fi
OUT=${OUT:-/tmp}
DEST=$OUT/heads_gpu
if [ -z "${RES:-}" ] && [ -d "$FROM" ]; then RES=$FROM; fi  # the new records beside the earlier call's
if [ -z "${RES:-}" ]; then RES=/tmp/heads_gpu; rm -rf "$RES"; fi
mkdir -p "$RES" "$DEST"
(( BATCH % ACCUM == 0 )) || { echo "BATCH ($BATCH) must be a multiple of ACCUM ($ACCUM)"; exit 2; }
(( S2_BATCH % S2_ACCUM == 0 )) || { echo "S2_BATCH ($S2_BATCH) must be a multiple of S2_ACCUM ($S2_ACCUM)"; exit 2; }
if [ -f "$FROM" ]; then
    tar xzf "$FROM" -C "$RES" || { echo "FROM=$FROM: not an archive of this script's records"; exit 2; }
elif [ -n "$FROM" ] && [ ! -d "$FROM" ]; then
    echo "FROM=$FROM: neither a directory nor an archive"; exit 2
elif [ -n "$FROM" ] && [ "$(cd "$FROM" && pwd -P)" != "$(cd "$RES" && pwd -P)" ]; then
    cp -rn "$FROM"/. "$RES"/
fi

T0=$SECONDS
left() { echo $(( BUDGET_S - (SECONDS - T0) )); }
dev=(--device "$DEVICE"); [ -n "$THREADS" ] && dev+=(--threads "$THREADS")
tasks=(); [ -n "$TASKS" ] && [ "$TASKS" != all ] && tasks=(--tasks $TASKS)  # the tasks stages' (TASKS set)
[ -n "$LIMIT" ] && tasks+=(--limit "$LIMIT")
TASK_NEED=0; [ -n "$TASKS" ] && TASK_NEED=$TASKS_S  # a model's tasks eval, where a seed's need counts one
EXP=experiments/head_routers_fine_cpu.py

note() { echo "$*" | tee -a "$RES/stages.log"; }

PACK_MAX=$(( 15 * 1024 * 1024 ))  # under the device tool's 16 MiB a file
pack() {  # pack [final]: the records so far -> $DEST (atomic: a cut leaves the last complete archive)
    local part=$DEST/heads_gpu.tgz.part
    # a stage-2 set's tensors are of no use without its 20 MB of adapters (it would load as a stage-1 set)
    local skip=(--exclude=checkpoint --exclude='lora_*.safetensors')
    summary "${1:-}" > "$RES/summary.md" 2>&1
    tar czf "$part" -C "$RES" "${skip[@]}" . || return
    if (( $(stat -c %s "$part") > PACK_MAX )); then
        note "pack: over $PACK_MAX bytes with the tensors: records only"
        tar czf "$part" -C "$RES" "${skip[@]}" --exclude='*.safetensors' . || return
    fi
    mv "$part" "$DEST/heads_gpu.tgz"
    cp "$RES/stages.log" "$RES/summary.md" "$DEST/" 2>/dev/null
}

RC=0
stage() {  # stage NAME NEED_S LIMIT_S CMD...: run CMD under timeout LIMIT_S, unless NEED_S is more than what is left
    local name=$1 need=$2 limit=$3 t=$SECONDS l
    shift 3
    l=$(left)
    if (( l < need )); then
        note "stage $name: skipped ($l s left, needs ~$need s)"; RC=125; return
    fi
    (( limit > l - 5 )) && limit=$(( l - 5 ))
    (( limit < 1 )) && limit=1
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$RES/$name.log"
    RC=${PIPESTATUS[0]}
    note "stage $name: exit $RC, $(( SECONDS - t )) s$( [ "$RC" = 124 ] && echo " (timed out at $limit s)")"
    pack
}

summary() {  # summary [final]: one table of every record there is, ratios against this machine's dense
    "$PY" - "$RES" "${1:-}" <<'EOF'
import json, re, sys
from pathlib import Path
res, final = Path(sys.argv[1]), sys.argv[2] == "final"
rows, dense = [], None  # (name, record)
def task_fields(r):  # a record's zero-shot fields
    return {k: r[k] for k in [*(r.get("tasks_detail") or {}), "avg", "tasks_detail", "limit"] if k in r}
def evals(f):  # eval_X.json's records (perplexity, sparsity), each with the tasks of tasks_X.json's (where that ran)
    recs = json.loads(f.read_text())["records"]
    t = f.with_name("tasks_" + f.name[len("eval_"):])
    more = json.loads(t.read_text())["records"] if t.exists() else []
    return [{**r, **task_fields(m)} if m and m.get("method") == r.get("method") else r
            for r, m in zip(recs, more + [None] * (len(recs) - len(more)))]
f = res / "eval_dense_fine50.json"
if f.exists():
    for r in evals(f):
        if r.get("method") == "dense":
            dense = r
        rows.append(("dense" if r.get("method") == "dense" else "smollm2-135m-fine-50 (thresholds alone)", r))
log = res / "oracle.log"
if log.exists():
    for m in re.finditer(r"^oracle (\w+)\S*.*?: ppl ([0-9.]+)", log.read_text(), re.M):
        rows.append((f"fine-50 + oracle ({m[1]})", {"ppl": float(m[2])}))
def sets(prefix, name):  # the trained sets' records (eval_<prefix><seed>.json), each a row
    recs = []
    for f in sorted(res.glob(f"eval_{prefix}*.json")):
        seed = re.fullmatch(rf"eval_{prefix}(\d+)", f.stem)  # eval_s* holds eval_lora_s* too
        rec = seed and next((r for r in evals(f) if r.get("method") != "dense"), None)
        if rec:
            rows.append((name(seed[1], rec), rec))
            recs.append(rec)
    return recs
seeds = sets("s", lambda s, r: f"design (a), seed {s}")
lib = sets("lib_s", lambda s, r: f"seed {s} as a library set ({r.get('routing')})")
lora = sets("lora_s", lambda s, r: f"seed {s}, library set + LoRA, re-set (stage 2)")
d_ppl = dense and dense.get("ppl")
tasks, kept = any(r.get("avg") is not None for _, r in rows), None
if dense and dense.get("avg") is not None and final:  # imported at the call's end only: torch takes seconds to load, at every stage's pack
    from wide.evaluation.evaluate import above_chance
    kept = lambda r: above_chance(r, dense) if r.get("avg") is not None else None  # noqa: E731
fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
head = ["model", "ppl", "x dense", "linear sparsity", "attention-core sparsity"]
head += ["7-task avg"] if tasks else []
head += ["above-chance kept"] if kept else []
print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
for name, r in rows:
    ppl = r.get("ppl")
    cells = [name, fmt(ppl, 2), fmt(ppl / d_ppl if d_ppl and ppl else None, 2), fmt(r.get("linear_sparsity")),
             fmt(r.get("attn_core_sparsity"))]
    cells += [fmt(r.get("avg"))] if tasks else []
    cells += [pct(kept(r))] if kept else []
    print("| " + " | ".join(cells) + " |")
for lead, recs, what in (("\n", seeds, "seed(s)"), ("", lib, "library set(s)"), ("", lora, "library set(s) + LoRA")):
    if recs:
        ppls = [r["ppl"] for r in recs]
        mean = sum(ppls) / len(ppls)
        ks = [k for k in map(kept, recs) if k is not None] if kept else []
        print(f"{lead}{len(ppls)} {what}: mean ppl {mean:.2f}" + (f" = {mean / d_ppl:.3f}x dense" if d_ppl else "")
              + f", range {min(ppls):.2f}-{max(ppls):.2f}"
              + (f"; above-chance kept {100 * sum(ks) / len(ks):.0f}% ({', '.join(map(pct, ks))})" if ks else ""))
def records(pattern):  # (directory, its json record) of each match
    return [(f.parent.name, json.loads(f.read_text())) for f in sorted(res.glob(pattern))]
for name, r in records("s*/run.json"):
    print(f"{name}: {r['tokens']} tokens, training {r['wall_s']:.0f} s, {r['tokens_per_s']:.0f} tokens/s, "
          f"{r['machine'].get('gpu', 'cpu')}")
for name, r in records("lora_s*/run.json"):
    t = r["train_args"]
    print(f"{name}: LoRA on {r['stage2_tokens']} tokens ({t['loss']}, lr {t['lr']:g}, amp {t['amp']}), "
          f"training {r['wall_s']:.0f} s, {r['stage2_tokens'] / r['wall_s']:.0f} tokens/s, "
          f"{r['machine'].get('gpu', 'cpu')}")
for name, r in records("lora_lib_s*/recalibrate.json"):
    b = r["before"]
    print(f"{name}: after LoRA attention-core {b['attn_rate']:.4f}, linear {b['linear']:.4f} on calibration "
          f"text; re-set to {r['calibration_attn_rate']:.4f} (target {r['attn_target']}), "
          f"{r['calibration_linear']:.4f} (target {r['linear_target']:.4f}; thresholds {r['threshold_shift']:+.4f})")
EOF
}

stage1="$STEPS steps x $BATCH (x$ACCUM accum) x 256 tokens, lr $LR, W $W, amp $AMP"
[ -n "$FROM" ] && stage1="stage 1's library sets from $FROM"
stage2=
[ "$STAGE2" = 1 ] && stage2="; stage 2: $S2_STEPS steps x $S2_BATCH (x$S2_ACCUM) x 256 tokens, lr $S2_LR, loss $S2_LOSS,\
 amp $S2_AMP, LoRA r $S2_LORA_R, routers and thresholds $([ "$S2_FREEZE" = 1 ] && echo frozen || echo trained)"
note "head_routers_gpu: device $DEVICE, $stage1, seeds '$SEEDS', $EVAL_SEQS eval windows, tasks '${TASKS:-none}'${LIMIT:+ (--limit $LIMIT)}," \
     "budget $BUDGET_S s; records in $RES$stage2"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1 | tee -a "$RES/stages.log"

evals() {  # evals NAME TASKS_NEED_S CMD...: CMD (an eval, less its tasks and --out) on the held-out windows alone
    # (bare --tasks) as stage eval_NAME (RES/eval_NAME.json), then, with TASKS, again with the tasks as stage
    # tasks_NAME (RES/tasks_NAME.json; needs TASKS_NEED_S): tasks cut at their limit or skipped leave the
    # perplexity recorded (an earlier call's tasks of NAME go once its perplexity is rerun: the summary would join
    # them). RC: the perplexity stage's, unless the tasks stage ran
    local name=$1 need=$2
    shift 2
    stage "eval_$name" "$EVAL_S" "$STAGE_MAX_S" "$@" --tasks --out "$RES/eval_$name" --overwrite
    [ "$RC" != 125 ] && rm -f "$RES/tasks_$name.json" "$RES/tasks_$name.md"
    [ "$RC" = 0 ] && [ -n "$TASKS" ] || return 0
    stage "tasks_$name" "$need" "$STAGE_MAX_S" "$@" "${tasks[@]}" --out "$RES/tasks_$name" --overwrite
}

if [ "$DENSE" = 1 ]; then
    evals dense_fine50 "$DENSE_TASKS_S" "$PY" -m wide.cli eval "${dev[@]}" --dense --routers smollm2-135m-fine-50 \
        --max-eval-sequences "$EVAL_SEQS"
fi

halve_on_oom() {  # halve_on_oom NAME BATCH VAR: stage NAME ran out of GPU memory: the same BATCH sequences per
    # step in twice the micro-batches (VAR, doubled for the rest of the call too), NAME's log kept
    # aside, true; false when it did not (125: skipped, its log an earlier call's) or BATCH cannot split
    local name=$1 batch=$2 var=$3
    [ "$RC" != 0 ] && [ "$RC" != 125 ] && grep -q "out of memory" "$RES/$name.log" \
        && (( batch % (2 * ${!var}) == 0 )) || return 1
    printf -v "$var" %d $(( 2 * ${!var} ))
    note "$name: out of memory, again with $var=${!var}"
    mv "$RES/$name.log" "$RES/$name.oom.log"
}

SEED_S=  # the first seed's measured stage-1 time (training, evaluations, conversion): what a later seed needs
train_run() {  # train_run SEED NEED_S: the CPU recipe at STEPS x BATCH (BATCH / ACCUM per micro-batch)
    stage "train_s$1" "$2" $(( $(left) - EVAL_S )) "$PY" $EXP --skip-one --oracle-ce "$W" --input-choice --lr "$LR" \
        --out "$RES/s$1" --overwrite "${dev[@]}" --steps "$STEPS" --batch-size $(( BATCH / ACCUM )) --grad-accum "$ACCUM" \
        --amp "$AMP" --eval-every 0 --save-every "$SAVE_EVERY" --seed "$1" --budget layer --target "$TARGET" --offsets none
}
eval_set() {  # eval_set NAME ROUTERS: `wide eval` of a library set on the held-out windows, then TASKS (evals)
    evals "$1" "$TASKS_S" "$PY" -m wide.cli eval "${dev[@]}" --routers "$2" --max-eval-sequences "$EVAL_SEQS"
}
train_seed() {
    local s=$1 t=$SECONDS need
    need=${SEED_S:-$(awk -v a="$START_S" -v n="$STEPS" -v b="$STEP_S" -v e=$(( EVAL_S + TASK_NEED )) \
        'BEGIN { printf "%d", a + n * b + e }')}
    train_run "$s" "$need"
    halve_on_oom "train_s$s" "$BATCH" ACCUM && train_run "$s" "$need"
    [ "$RC" = 0 ] && [ -f "$RES/s$s/routers/wide_config.json" ] || return
    if [ "$TRAINED_EVAL" = 1 ]; then
        evals "s$s" "$TASKS_S" "$PY" $EXP --skip-one --input-choice --eval "${dev[@]}" --routers "$RES/s$s/routers" \
            --max-eval-sequences "$EVAL_SEQS"
    fi
    if [ -n "$LIBRARY" ]; then
        stage "lib_s$s" "$EVAL_S" "$STAGE_MAX_S" "$PY" $EXP --skip-one --input-choice --to-library "$RES/s$s/routers" \
            --library-target "$LIBRARY" --offset-batches "$OFFSET_BATCHES" --out "$RES/lib_s$s" --overwrite "${dev[@]}"
        [ "$RC" = 0 ] && eval_set "lib_s$s" "$RES/lib_s$s/routers"
    fi
    [ -z "$SEED_S" ] && SEED_S=$(( (SECONDS - t) * 21 / 20 + 10 ))
}

S2_SEED_S=  # the first stage-2 seed's measured time (LoRA, re-set, eval): what a later one needs
lora_run() {  # lora_run SEED NEED_S: `wide recover` of the seed's library set at S2_STEPS x S2_BATCH
    local freeze=()
    [ "$S2_FREEZE" = 1 ] && freeze=(--freeze-routers)
    stage "lora_s$1" "$2" $(( $(left) - RESET_S - EVAL_S )) "$PY" -m wide.cli recover "${dev[@]}" \
        --routers "$RES/lib_s$1/routers" --out "$RES/lora_s$1" --overwrite --steps "$S2_STEPS" \
        --batch-size $(( S2_BATCH / S2_ACCUM )) --grad-accum "$S2_ACCUM" --lr "$S2_LR" --loss "$S2_LOSS" --amp "$S2_AMP" \
        --lora-r "$S2_LORA_R" --seed "$1" --eval-every 0 --save-every "$S2_SAVE_EVERY" --offsets none "${freeze[@]}"
}
stage2_seed() {
    local s=$1 t=$SECONDS need
    if [ ! -f "$RES/lib_s$s/routers/routers.safetensors" ]; then
        note "stage 2, seed $s: no library set in $RES/lib_s$s/routers"; return
    fi
    need=${S2_SEED_S:-$(awk -v a="$S2_START_S" -v n="$S2_STEPS" -v b="$S2_STEP_S" -v r="$RESET_S" -v e=$(( EVAL_S + TASK_NEED )) \
        'BEGIN { printf "%d", a + n * b + r + e }')}
    lora_run "$s" "$need"
    halve_on_oom "lora_s$s" "$S2_BATCH" S2_ACCUM && lora_run "$s" "$need"
    [ "$RC" = 0 ] && [ -f "$RES/lora_s$s/recovered/wide_config.json" ] || return
    stage "lora_lib_s$s" "$RESET_S" "$STAGE_MAX_S" "$PY" $EXP --recalibrate "$RES/lora_s$s/recovered" \
        --offset-batches "$OFFSET_BATCHES" --out "$RES/lora_lib_s$s" --overwrite "${dev[@]}"
    [ "$RC" = 0 ] || return
    eval_set "lora_s$s" "$RES/lora_lib_s$s/routers"
    [ "$RC" = 0 ] && [ -z "$S2_SEED_S" ] && S2_SEED_S=$(( (SECONDS - t) * 21 / 20 + 10 ))
}

first=1
for s in $SEEDS; do
    if [ -z "$FROM" ]; then
        train_seed "$s"
        if [ $first = 1 ] && [ "$ORACLE" = 1 ]; then  # the oracle after the first seed
            stage oracle "$ORACLE_S" "$STAGE_MAX_S" "$PY" $EXP --oracle "${dev[@]}" --eval-sequences "$EVAL_SEQS"
        fi
    fi
    [ "$STAGE2" = 1 ] && stage2_seed "$s"
    first=0
done
if { [ -z "$SEEDS" ] || [ -n "$FROM" ]; } && [ "$ORACLE" = 1 ]; then
    stage oracle "$ORACLE_S" "$STAGE_MAX_S" "$PY" $EXP --oracle "${dev[@]}" --eval-sequences "$EVAL_SEQS"
fi
pack final
note "head_routers_gpu: done in $(( SECONDS - T0 )) s"
cat "$RES/summary.md"
