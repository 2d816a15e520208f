"""End-to-end benchmark: TTFT and TPOT of the engine's modes against its dense mode, and HF generate.

    PYTHONPATH=src python3 -m wide.benchmarks.e2e --out-dir bench/results      # H200
    PYTHONPATH=src python3 -m wide.benchmarks.e2e --model llama-3.1-8b,qwen2.5-7b --out-dir /tmp/e2e
    python -m wide.benchmarks.e2e --tiny --out-dir /tmp/e2e                      # CPU smoke run
    python -m wide.benchmarks.e2e --modes coarse,fine,hybrid --sparsities 0.5 --decode-ctxs 4096,16384

Models: ``--model``, named shapes of ``wide.base.arch.PRESETS`` (default Llama-3.1-8B: default RoPE,
no llama3 frequency scaling, which the timing does not depend on), one after the other in one
run, with random bf16 weights built on the GPU; every record carries its ``"model"``. Routers: wide's
own random routers (kaiming init) with offsets calibrated per module on a random prompt so
each module skips the target fraction of its groups (``calibrate_offsets(mode="per_module")``);
the masks are therefore what real rank-16 routers produce from the residual stream, not
i.i.d. draws. Realised rates are measured and reported.

Engines, all in one process and run: ``dense`` = the same static-cache engine with no routing
(fused QKV and gate/up cuBLAS GEMMs, SDPA flash prefill, flash-decoding attention with all
heads, same fused norm and RoPE/cache kernels, same CUDA-graph decode); ``routed`` = the
routed kernels (mode ``coarse``); ``hf`` = plain ``transformers`` ``model.generate()`` on the
dense model (SDPA, its default dynamic cache, no routing). ``--modes`` adds ``fine`` (dense
prefill, per-element sparse decode GEMVs) and ``hybrid`` (routed prefill, per-element decode
inside the routed groups); every record carries its ``mode`` (dense, coarse, fine, hybrid; HF
generate's records are dense). Their thresholds need no trained weights: the model gets a
``wide_fine`` whose thresholds are the quantiles of the dense model's |x| on a few random-token
batches that drop the target share of every projection's input (TEAL's uniform allocation). A
hybrid at target s splits it between routers and thresholds so that the linear MACs kept are
1 - s: routers at ``1 - sqrt(1 - s)`` and thresholds dropping as much inside the kept groups, or
with ``--hybrid-router-sparsity R`` routers at R and thresholds at ``1 - (1 - s) / (1 - R)``; its
records carry ``router_sparsity`` and ``fine_sparsity``.
``--heads R`` (issue 48): the routers route attention only, under ``attn_rule="skip_upto"`` with
layer 0 dense, each routed layer skipping R of its groups, and ``hybrid`` runs them beside
thresholds at the target itself (fine GEMVs at small batch, routed decode attention everywhere).
``--fine-sums fp32,rounded`` times the fine engine's decode both ways (``wide.accelerate(fine_sums=...)``:
q|k|v, o and down adding into fp32 sums that RoPE and the next norm read, or each GEMV rounding its
own output), one TPOT record each with its ``fine_sums``.

The benchmark only times the engine's public API; its correctness is checked by the tests
(``tests/test_inference.py``, ``tests/test_engine_fine.py``, ``tests/test_kernels_*.py``, on the
CPU) and on a GPU by ``scripts/gpu_smoke.py`` (graph replay = eager, greedy tokens = the masked
HF path, the fused norm / router kernels against PyTorch, bf16 error against fp32, fine and
hybrid decode against their PyTorch path).

TTFT = prefill of one prompt to its first token's logits. TPOT = one CUDA-graph decode step
plus greedy sampling, averaged over ``--decode-steps`` steps after a ``--decode-ctx``-token
prompt (each of ``--decode-ctxs``, where given; a batch whose KV cache would not fit the GPU's
free memory is skipped and listed). Records are written after every measurement, so a run cut
short keeps what it did.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

NAME = "e2e"


def _now():
    return time.perf_counter()


# --tiny: every preset shrunk to a CPU-sized model of its family (Qwen2.5's 7 query heads per KV
# head kept, so a GQA pack is not a power of two there either).
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2, head_dim=64,
            max_position_embeddings=4096, tie_word_embeddings=False)
TINY_HEADS = {"qwen2": (7, 1)}  # model_type -> (query heads, KV heads); others 4 and 2


def build_model(name: str, tiny: bool, device, dtype):
    """A random-weight causal LM of preset ``name`` (``wide.base.arch.PRESETS``), shrunk by ``tiny``."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from wide.base import arch

    over = {}
    if tiny:
        heads, kv = TINY_HEADS.get(arch.hf_config(name).model_type, (4, 2))
        over = dict(TINY, num_attention_heads=heads, num_key_value_heads=kv)
    cfg = arch.hf_config(name, **over)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def weight_bytes(model) -> dict:
    cfg = model.config
    h, i, e = cfg.hidden_size, cfg.intermediate_size, model.lm_head.weight.element_size()
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * d * h * e
    kv = 2 * cfg.num_key_value_heads * d * h * e
    return {"q": q, "o": q, "kv": kv, "gate_up": 2 * i * h * e, "down": i * h * e,
            "lm_head": cfg.vocab_size * h * e, "layers": cfg.num_hidden_layers}


def bytes_fraction(model, records, B: int, shared: bool = False) -> dict:
    """Weight bytes a decode step reads, over dense, from the recorded masks of eager steps.

    ``union``: each routed matrix is read for the groups some sequence of the batch uses (what
    gemm_mn/ffn_up and the decode path of gemm_k read). ``kernel``: the same, except that
    gemm_k on more than 16 rows with many narrow groups (FFN down, flat loop) reads all of its
    weight: see wide/kernels/gemm_k.py; in a batch-shared step (``shared``) it loops over the
    shared groups instead (``row_runs``).
    """
    wb = weight_bytes(model)
    L = wb["layers"]
    dense = L * (wb["q"] + wb["o"] + wb["kv"] + wb["gate_up"] + wb["down"]) + wb["lm_head"]
    steps = {}
    for step, layer, kind, m in records:
        steps.setdefault(step, []).append((layer, kind, m))
    fr_u, fr_k, tok = [], [], []
    for items in steps.values():
        u = k = L * wb["kv"] + wb["lm_head"]
        seen = {"attn": set(), "ffn": set()}
        for layer, kind, m in items:
            seen[kind].add(layer)
            if m is None:
                continue
            frac = float(m.any(0).float().mean())
            tok.append(float(m.float().mean()))
            if kind == "attn":
                u += frac * (wb["q"] + wb["o"])
                k += frac * (wb["q"] + wb["o"])
            else:
                u += frac * (wb["gate_up"] + wb["down"])
                k += frac * wb["gate_up"] + (wb["down"] if B > 16 and not shared else frac * wb["down"])
        for kind, full in (("attn", wb["q"] + wb["o"]), ("ffn", wb["gate_up"] + wb["down"])):
            dense_layers = L - len([1 for la, kd, m in items if kd == kind and m is not None])
            u += dense_layers * full
            k += dense_layers * full
        fr_u.append(u / dense)
        fr_k.append(k / dense)
    return {"weight_bytes_frac_union": statistics.mean(fr_u), "weight_bytes_frac_kernel": statistics.mean(fr_k),
            "active_frac_per_token": statistics.mean(tok) if tok else 1.0, "dense_weight_bytes": dense}


def fine_bytes_fraction(model, records, B: int, mode: str) -> dict:
    """Weight bytes a fine or hybrid decode step reads, over dense, from the read shares of its
    eager steps (``decode(record=...)`` adds ``(layer, projection, [union, per token])``).
    ``union``: the weight rows (and, for gate/up, output channels) some sequence keeps: what the
    GEMVs read up to 4 sequences a step. ``kernel``: what this batch's kernels read: the union up
    to 4 sequences, above that the GEMMs on thresholded inputs (every weight in fine; the routed
    kernels' reads, from the step's group masks, in hybrid). ``active_frac_per_token``: the
    MAC-weighted share of the layers' weights one token needs."""
    from wide.engine.fine_engine import MAX_T
    from wide.method.geometry import PROJECTIONS

    wb = weight_bytes(model)
    L = wb["layers"]
    per = {"q": wb["q"], "k": wb["kv"] / 2, "v": wb["kv"] / 2, "o": wb["o"], "gate": wb["gate_up"] / 2,
           "up": wb["gate_up"] / 2, "down": wb["down"]}
    layers = L * sum(per.values())
    dense = layers + wb["lm_head"]
    steps: dict = {}
    for step, layer, kind, m in records:
        if kind in PROJECTIONS:
            steps.setdefault(step, []).append((kind, m))
    union, token = [], []
    for items in steps.values():
        union.append((wb["lm_head"] + sum(float(m[0]) * per[k] for k, m in items)) / dense)
        token.append(sum(float(m[1]) * per[k] for k, m in items) / layers)
    out = {"weight_bytes_frac_union": statistics.mean(union), "active_frac_per_token": statistics.mean(token),
           "dense_weight_bytes": dense}
    if B <= MAX_T:
        out["weight_bytes_frac_kernel"] = out["weight_bytes_frac_union"]
    elif mode == "fine":
        out["weight_bytes_frac_kernel"] = 1.0
    else:
        masks = [r for r in records if r[2] in ("attn", "ffn")]
        out["weight_bytes_frac_kernel"] = bytes_fraction(model, masks, B)["weight_bytes_frac_kernel"]
    return out


def hybrid_split(target: float, router_sparsity=None) -> tuple:
    """(router sparsity, threshold share) of a hybrid at ``target``: kept linear MACs
    (1 - r)(1 - f) = 1 - target, with r even with f unless given."""
    if router_sparsity is None:
        r = 1 - math.sqrt(1 - target)
        return r, r
    if not 0 <= router_sparsity <= target:
        raise ValueError(f"--hybrid-router-sparsity {router_sparsity} must lie in [0, {target}] (the target)")
    return router_sparsity, 1 - (1 - target) / (1 - router_sparsity)


def _split(target: float, args) -> tuple:
    """(router sparsity, threshold share) of the hybrid: :func:`hybrid_split`, or with ``--heads R``
    attention routers at R and the thresholds at the target itself."""
    heads = getattr(args, "heads", None)
    return (heads, target) if heads is not None else hybrid_split(target, args.hybrid_router_sparsity)


def _wide_config(model, args):
    """The benchmark's routers: random (a dense start's masks do not depend on the input until
    trained, so no offset could spread them); with ``--heads``, :func:`heads_config`'s."""
    import wide

    kw = dict(ffn_group_size=_ffn_group_size(args), attn_group_size=args.attn_group_size, router_init="random")
    if getattr(args, "heads", None) is None:
        return wide.WideConfig(**kw)
    return heads_config(model.config, args.heads, **kw)


def heads_config(hf_config, rate: float, **kw):
    """Issue 48's head routers at ``rate`` of each routed layer's groups: attention only under
    skip_upto, layer 0 dense, up to 1.5 ``rate`` of a layer's groups per token, so that offsets
    (or the training target) set the rate below that cap. ``kw``: the other WideConfig fields."""
    import wide

    c = hf_config
    per_group = kw.get("attn_group_size") or c.num_attention_heads // (getattr(c, "num_key_value_heads", None)
                                                                       or c.num_attention_heads)
    groups = c.num_attention_heads // per_group
    k = max(1, min(groups - 1, math.ceil(1.5 * rate * groups)))
    return wide.WideConfig(**kw, sparse_target="attention", attn_rule="skip_upto", attn_skip=k, attn_dense_layers=[0])


def fine_thresholds(model, batches, shares) -> dict:
    """share -> log thresholds [L, 7] that drop that share of every projection's input scores
    (TEAL's uniform allocation) on ``batches``, scored on the dense model (routers off). The
    model keeps a ``wide_fine`` with its hooks off (``enabled = False``): the engines read the
    thresholds, and the HF baseline and router offsets stay what they were."""
    from wide.method import fine as wf
    from wide.method.state import get_state

    fine = wf.get_fine(model) or wf.attach(model, wf.FineConfig())
    state = model.wide_state
    state.mask_fn = lambda *a: None
    try:
        scores = wf.collect_scores(model, batches, per_key=1 << 16)
    finally:
        state.mask_fn = None
    out = {}
    for share in shares:
        wf.set_thresholds(model, scores, wf.uniform_sparsity(get_state(model).geometry.dims, share))
        out[share] = fine.log_threshold.detach().clone()
    fine.enabled = False
    return out


def engine_memory(model, mode: str, ids, device, steps: int = 8) -> dict:
    """Peak GPU memory of one engine built alone on ``model`` (the model's own weights
    included): construction, a cache for ``ids`` plus ``steps`` tokens, prefill and ``steps``
    graph-replayed decode steps. Also the unique bytes of the weights the model then holds
    (an engine may point the model's weights at its own copy)."""
    import gc

    from wide.engine.inference import AcceleratedModel

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    eng = AcceleratedModel(model, mode={"coarse": "routed"}.get(mode, mode))
    B, T = ids.shape
    eng.setup_cache(B, -(-(T + steps + 1) // 128) * 128)
    tok = eng.prefill(ids).argmax(-1)
    eng.pos.fill_(T)
    for _ in range(steps):
        tok = eng.decode(tok).argmax(-1)
        eng.pos += 1
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    storages = {}
    for p in list(model.parameters()) + [t for L in eng.layers for t in vars(L).values() if torch.is_tensor(t)] + \
            [t for L in eng.layers if L.fine is not None for t in vars(L.fine).values() if torch.is_tensor(t)]:
        st = p.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    rec = {"op": "e2e_memory", "engine": eng.mode, "mode": eng.mode_name, "B": B, "prompt_len": T,
           "peak_gib": peak / 2**30, "weights_gib": sum(storages.values()) / 2**30,
           "cache_gib": kv_cache_bytes(model, B, eng._cache_key[1]) / 2**30}
    eng.free_cache()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def kv_cache_bytes(model, batch: int, length: int) -> int:
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = model.lm_head.weight.element_size()
    return 2 * cfg.num_hidden_layers * batch * length * cfg.num_key_value_heads * d * elem


MODES = ("coarse", "fine", "hybrid")
# The kernels of a decode step that are attention (the engine's split-K decode and its combine,
# SDPA's flash / cuDNN / efficient kernels): where KV reads rival weight reads, head routing pays.
ATTENTION_KERNELS = re.compile(r"attn|attention|flash|fmha|sdpa|cudnn|_decode_split|_decode_combine", re.I)


def tile_routing(name: str):
    """(route_tile, tile_source) of a routing named tile<N> or tile<N>prev (N > 1), else None."""
    m = re.fullmatch(r"tile(\d+)(prev)?", name)
    if m is None or int(m[1]) < 2:
        return None
    return int(m[1]), "previous" if m[2] else "first"


def set_offsets(model, offsets: dict) -> None:
    for key, val in offsets.items():
        layer, kind = key.split(".")
        model.wide_routers[int(layer)].router(kind).offset.fill_(val)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="wide bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b",
                    help="comma-separated presets of wide.base.arch.PRESETS, benchmarked one after the other "
                         "(default: %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (smoke test)")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--sparsities", default="0.5,0.25,0.75")
    ap.add_argument("--prompt-lens", default="4096,1024,16384")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--routings", default="token",
                    help="routing rules of the routed engine, comma-separated: token, tile<N> (routers with "
                         "route_tile N: TTFT at every prompt length), tile<N>prev (the same with tile_source previous), "
                         "batch_shared (one group set per decode batch); "
                         "TPOT of each at every batch; default: %(default)s")
    ap.add_argument("--ffn-group-size", type=int, default=None,
                    help="FFN channels per group (default: 128, 32 with --tiny); finer groups route better "
                         "(experiments/results/group_size_cpu) at a kernel cost this measures")
    ap.add_argument("--attn-group-size", type=int, default=None,
                    help="query heads per attention group (default: one GQA pack)")
    ap.add_argument("--modes", default="coarse",
                    help="engine modes timed against the dense engine, comma-separated: coarse (the routers' groups), "
                         "fine (per-element sparse decode, dense prefill), hybrid (routed prefill, per-element decode "
                         "inside the routed groups); default: %(default)s")
    ap.add_argument("--hybrid-router-sparsity", type=float, default=None,
                    help="the hybrid's routers at this group sparsity and its thresholds at what reaches the target "
                         "(default: the two even, 1 - sqrt(1 - target) each)")
    ap.add_argument("--heads", type=float, default=None, metavar="R",
                    help="issue 48's heads beside thresholds: the routers route attention only, under "
                         "attn_rule skip_upto (layer 0 dense), each routed layer skipping R of its groups; hybrid "
                         "then runs them with thresholds at the target itself (fine decode, routed attention)")
    ap.add_argument("--fine-sums", default="fp32",
                    help="the fine engine's q|k|v, o and down sums, comma-separated: fp32 (added into fp32 sums "
                         "that RoPE and the next norm read) and/or rounded (each GEMV rounds its own output); "
                         "with both, TPOT of each as records of their own (fine_sums in the record); "
                         "default: %(default)s")
    ap.add_argument("--decode-ctx", type=int, default=512)
    ap.add_argument("--decode-ctxs", default=None,
                    help="prompt lengths before the timed decode steps, comma-separated (TPOT at each with every "
                         "batch; default: --decode-ctx)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate() baseline")
    ap.add_argument("--memory", action="store_true",
                    help="first, the peak GPU memory of the dense engine and of each of --modes built alone on "
                         "the model, with a cache for the first prompt length at batch 1 (e2e_memory records)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile an eager B=1 decode step and a 4k prefill per kernel, dense vs routed "
                         "(first sparsity)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new measurement after this many seconds")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="prompts up to this many tokens prefill by CUDA-graph replay, both engines "
                         "(default: wide.engine.inference.PREFILL_GRAPH_MAX_TOKENS)")
    args = ap.parse_args(argv)

    import wide.engine.inference as inference
    from wide.base.arch import PRESETS

    models = [m.strip().lower() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if not models or unknown:
        ap.error(f"--model takes presets of wide.base.arch.PRESETS ({', '.join(PRESETS)}), got {args.model!r}")

    if args.prefill_graph_max_tokens is not None:
        if args.prefill_graph_max_tokens < 0:
            ap.error("--prefill-graph-max-tokens must be >= 0")
        inference.PREFILL_GRAPH_MAX_TOKENS = args.prefill_graph_max_tokens

    t_start = _now()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and device.type != "cuda":
        print("wide bench e2e needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sparsities = [float(s) for s in args.sparsities.split(",") if s]
    routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    bad = [r for r in routings if not (r in ("token", "batch_shared") or tile_routing(r))]
    if bad or not routings:
        ap.error(f"--routings takes token, tile<N>, tile<N>prev (N > 1) and batch_shared, got {args.routings!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)} (dense is always timed), got {args.modes!r}")
    if args.heads is not None and not (0 < args.heads < 1 and args.hybrid_router_sparsity is None):
        ap.error("--heads R takes 0 < R < 1, without --hybrid-router-sparsity (the thresholds sit at the target)")
    if "hybrid" in modes and args.heads is None:
        for s in sparsities:
            try:
                hybrid_split(s, args.hybrid_router_sparsity)
            except ValueError as e:
                ap.error(str(e))
    from wide.engine.inference import FINE_SUMS

    args.fine_sums = list(dict.fromkeys(v.strip() for v in args.fine_sums.split(",") if v.strip()))
    if not args.fine_sums or any(v not in FINE_SUMS for v in args.fine_sums):
        ap.error(f"--fine-sums takes {', '.join(FINE_SUMS)}, comma-separated, got {args.fine_sums!r}")
    prompt_lens = [int(s) for s in args.prompt_lens.split(",") if s]
    batches = [int(s) for s in args.batches.split(",") if s]
    decode_ctxs = ([int(s) for s in args.decode_ctxs.split(",") if s] if args.decode_ctxs
                   else [args.decode_ctx])
    if args.tiny:
        prompt_lens = list(dict.fromkeys(min(p, 48) for p in prompt_lens))[:1]
        sparsities = sparsities[:2]
        args.decode_ctx = min(args.decode_ctx, 32)
        decode_ctxs = list(dict.fromkeys(min(c, 32) for c in decode_ctxs))
        args.decode_steps = min(args.decode_steps, 4)
        args.reps = min(args.reps, 2)
        batches = list(dict.fromkeys(min(b, 4) for b in batches))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    from wide.kernels import pdl

    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m wide.benchmarks.e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
            "prefill_graph_max_tokens": inference.PREFILL_GRAPH_MAX_TOKENS if device.type == "cuda" else None,
            "model": _describe(models, args.tiny), "models": models,
            "routers": "random rank-16 routers, offsets calibrated per module (calibrate_offsets per_module)"
                       + _groups_note(args),
            "ffn_group_size": _ffn_group_size(args), "attn_group_size": args.attn_group_size,
            "modes": ["dense"] + modes, "decode_ctxs": decode_ctxs, "records": [], "errors": [],
            # the decode launches that take it start early (wide.kernels.pdl): part of what is timed
            "pdl": pdl.enabled(device)}
    if set(modes) & {"fine", "hybrid"}:
        meta["thresholds"] = ("per-element thresholds at quantiles of the dense model's |x| on 2 random-token "
                              "batches, the same share of every projection's input (TEAL uniform)")
    if "fine" in modes:
        meta["fine_sums"] = args.fine_sums
    if "hybrid" in modes:
        meta["hybrid_split"] = {str(s): dict(zip(("router_sparsity", "fine_sparsity"), _split(s, args)))
                                for s in sparsities}
    if args.heads is not None:
        meta["heads"] = {"rate_per_routed_layer": args.heads, "attn_rule": "skip_upto", "attn_dense_layers": [0]}

    def save():
        (out_dir / f"{args.name}.json").write_text(json.dumps(meta, indent=1))
        (out_dir / f"{args.name}.md").write_text(markdown(meta))

    def over_budget():
        return args.budget_s is not None and _now() - t_start > args.budget_s

    def guarded(what, fn):
        try:
            return fn()
        except Exception as exc:  # keep measuring the rest; the error goes in the results
            tb = traceback.format_exc()
            print(f"[e2e] {what} FAILED: {exc}\n{tb}", flush=True)
            meta["errors"].append({"what": what, "error": repr(exc), "traceback": tb[-2000:]})
            save()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return None

    for i, name in enumerate(models):
        guarded(f"model {name}", lambda: _bench_model(name, i == 0, args, device, dtype, sparsities,
                                                      prompt_lens, batches, meta, save, over_budget,
                                                      guarded, t_start, routings, modes, decode_ctxs))
        gc.collect()  # the engines reference the model (model.wide_engine): free both now
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta["wall_s"] = _now() - t_start
    from wide.engine.ops import K_CHOICES

    # Which implementation the engine measured fastest per projection, shape and T bucket.
    meta["k_choices"] = [{"op": k[0], "N": k[1][0], "K": k[1][1], "group": k[2], "T_bucket": k[3],
                          "routing": k[5] if len(k) > 5 else None, "impl": v} for k, v in K_CHOICES.items()]
    save()
    guarded("plot", lambda: plot(meta, out_dir / f"{args.name}.png"))
    print(markdown(meta), flush=True)
    return 0


def _describe(models: list, tiny: bool) -> str:
    if models == ["llama-3.1-8b"]:
        return "Llama-3.1-8B config, random weights" if not tiny else "tiny random Llama"
    return ("tiny random models of " if tiny else "random weights, configs of ") + ", ".join(models)


def _ffn_group_size(args) -> int:
    return args.ffn_group_size or (32 if args.tiny else 128)


def _groups_note(args) -> str:
    """The group sizes where they are not the defaults (the markdown's routers line)."""
    parts = ([f"FFN groups of {args.ffn_group_size} channels"] if args.ffn_group_size else []) + \
            ([f"attention groups of {args.attn_group_size} head{'s' * (args.attn_group_size != 1)}"]
             if args.attn_group_size else [])
    return "; " + ", ".join(parts) if parts else ""


def _bench_model(model_name: str, first: bool, args, device, dtype, sparsities, prompt_lens, batches,
                 meta, save, over_budget, guarded, t_start, routings=("token",), modes=("coarse",),
                 decode_ctxs=None) -> None:
    """Calibration and measurements of one preset, appended to ``meta`` (the ``first`` model's
    profiles and realised rates keep the keys of a single-model run)."""
    import wide
    from wide.engine.inference import AcceleratedModel, accelerate

    records = meta["records"]
    model = build_model(model_name, args.tiny, device, dtype)
    print(f"[e2e] {model_name} built in {_now() - t_start:.1f}s", flush=True)
    model = wide.wrap(model, _wide_config(model, args))
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand_ids(b, t):
        return torch.randint(0, vocab, (b, t), generator=gen).to(device)

    calib = rand_ids(1, 512 if not args.tiny else 48)
    offsets, realised = {}, {}
    for s in sparsities:  # (--heads: the routers sit at R whatever the target; the thresholds carry it)
        offsets[s] = wide.calibrate_offsets(model, [calib], target=s if args.heads is None else args.heads,
                                            mode="per_module", rounds=2)
        with torch.no_grad(), wide.track_sparsity(model) as tr:
            model(input_ids=rand_ids(1, calib.shape[1]))
        realised[s] = tr.summary().as_dict()
        realised[s].pop("per_layer")
    realised = {str(k): v for k, v in realised.items()}
    # The hybrid's routers at their share of each target, and the thresholds of fine and hybrid.
    split = {s: _split(s, args) for s in sparsities} if "hybrid" in modes else {}
    for r, _ in split.values():
        if r not in offsets:
            offsets[r] = wide.calibrate_offsets(model, [calib], target=r, mode="per_module", rounds=2)
    shares = ([s for s in sparsities if "fine" in modes] + [f for _, f in split.values()])
    thresholds = {}
    if shares:
        thresholds = fine_thresholds(model, [rand_ids(1, calib.shape[1]) for _ in range(2)], sorted(set(shares)))
    meta.setdefault("realised_sparsity_by_model", {})[model_name] = realised
    if first:
        meta["realised_sparsity"] = realised
    print(f"[e2e] calibrated {sparsities} in {_now() - t_start:.1f}s: "
          f"{ {k: round(v['group_rate'], 3) for k, v in realised.items()} }", flush=True)

    if getattr(args, "memory", False) and device.type == "cuda":
        for m in ("dense",) + tuple(modes):
            set_offsets(model, offsets[sparsities[0]])
            if m in ("fine", "hybrid"):
                r, f = split[sparsities[0]] if m == "hybrid" else (sparsities[0], sparsities[0])
                set_offsets(model, offsets[r])
                model.wide_fine.log_threshold.data.copy_(thresholds[f])
            rec = guarded(f"memory {m}", lambda: engine_memory(model, m, rand_ids(1, prompt_lens[0]), device))
            if rec is not None:
                rec.update(model=model_name, sparsity=None if m == "dense" else sparsities[0])
                records.append(rec)
                print(f"[e2e] memory {m}: peak {rec['peak_gib']:.2f} GiB ({rec['weights_gib']:.2f} GiB of weights)",
                      flush=True)
                save()
    routed = accelerate(model)
    dense = AcceleratedModel(model, mode="dense")
    engines = {"token": routed}
    by_mode = {"dense": dense, "routed": routed}
    fine_sums = getattr(args, "fine_sums", ["fp32"])
    for m in ("fine", "hybrid"):
        if m in modes:  # (the Triton backend's transposed weights: laid out once, shared by all)
            by_mode[m] = AcceleratedModel(model, mode=m, **({"fine_sums": fine_sums[0]} if m == "fine" else {}))
    if "fine" in modes:  # the other sums: an engine of their own, named fine:<sums> until recorded
        for v in fine_sums[1:]:
            by_mode[f"fine:{v}"] = AcceleratedModel(model, mode="fine", fine_sums=v)
    for r in routings:
        if r == "batch_shared":
            engines[r] = AcceleratedModel(model, batch_shared=True)
        elif r != "token":
            # The same routers under the tile rule (as if trained with route_tile N): the speed
            # depends on the masks' structure, not on what the routers learned.
            import dataclasses

            state = model.wide_state
            kept = state.config
            tile, source = tile_routing(r)
            state.config = dataclasses.replace(kept, route_tile=tile, tile_source=source)
            try:
                engines[r] = AcceleratedModel(model)
            finally:
                state.config = kept
    print(f"[e2e] backend {routed.backend}, graphs {routed.cuda_graphs}", flush=True)
    from functools import partial

    from wide.base.timing import step_time_s

    timer = partial(step_time_s, device=device)
    state = model.wide_state

    def in_turns(pair, fn, reps: int, warmup: int) -> list:
        """Median seconds of ``fn(i)`` for each engine ``i`` of ``pair``, the engines timed in
        turns (one run each, ``reps`` rounds; ``warmup`` untimed runs before each engine's first)."""
        times = [[] for _ in pair]
        for r in range(reps):
            for i, t in enumerate(times):
                t.append(timer(lambda: fn(i), reps=1, warmup=warmup if r == 0 else 0))
        return [statistics.median(t) for t in times]

    # ---------------------------------------------------------------- TTFT
    def ttft(engine, T, engine_name, s):
        """Prefill time of ``engine``; beside the dense engine's, the two are timed in turns on
        one prompt (dense, engine, dense, ...), so that clock and power drift over the run,
        which moved a 4k prefill by 3-5 % between back-to-back blocks on an H100
        (experiments/results/fine_prefill_gaps_h100/), falls on both alike."""
        engine_name, routing = engine_name.split("/") if "/" in engine_name else (engine_name, None)
        ids = rand_ids(1, T)
        length = -(-T // 128) * 128 + 128
        pair = [engine] if engine is dense else [dense, engine]
        for e in pair:
            e.setup_cache(1, length)
        reps = max(args.reps, 5) if T <= 4096 else max(2, args.reps // 2)
        sec = in_turns(pair, lambda i: pair[i].prefill(ids), reps, warmup=2)
        for e in pair:
            e.free_cache()
        rec = {"op": "e2e_ttft", "B": 1, "prompt_len": T, "engine": engine_name, "sparsity": s,
               "ms": sec[-1] * 1e3, "routing": routing}
        if len(pair) == 2:
            rec["paired_dense_ms"] = sec[0] * 1e3
        return rec

    def tpot(engine, B, ctx, engine_name, s, record_masks: bool):
        """Decode time per token of ``engine``; beside the dense engine's, the two decode loops
        are timed in turns (as in ``ttft``) wherever both caches fit."""
        engine_name, routing = engine_name.split("/") if "/" in engine_name else (engine_name, None)
        n = args.decode_steps
        max_len = -(-(ctx + n + 8) // 128) * 128
        pair = [engine] if engine is dense else [dense, engine]
        if device.type == "cuda":
            need, free = kv_cache_bytes(model, B, max_len), torch.cuda.mem_get_info(device)[0]
            if need > 0.85 * free:
                meta["errors"].append({"what": f"tpot B={B} ctx={ctx} {engine_name} {s}",
                                       "error": f"skipped: a KV cache of {need / 2**30:.1f} GiB, "
                                                f"{free / 2**30:.1f} GiB free"})
                return None
            if len(pair) * need > 0.85 * free:  # the dense engine's block of the run is the reference
                pair = [engine]
        ids = rand_ids(B, ctx)
        start = torch.full((B,), ctx, dtype=torch.long, device=device)
        firsts = []
        for e in pair:
            e.setup_cache(B, max_len)
            firsts.append(e.prefill(ids).argmax(-1))
        first = firsts[-1]

        def loop(e, tok):
            # As generate() does: the host's positions let a tile step skip the routers. (Every
            # sequence here sits at the same position, so a batch's tiles start together: at
            # B > 1 that skips more steps than unrelated prompts would.)
            e.pos.copy_(start)
            for step in range(n):
                logits = e.decode(tok, positions=[ctx + step] * B)
                e.pos += 1
                tok = logits.argmax(-1)

        sec = in_turns(pair, lambda i: loop(pair[i], firsts[i]), max(2, args.reps // 2), warmup=1)
        if len(pair) == 2:
            dense.free_cache()
        rec = {"op": "e2e_tpot", "B": B, "prompt_len": ctx, "engine": engine_name, "sparsity": s,
               "ms": sec[-1] / n * 1e3, "cuda_graph": engine.cuda_graphs, "decode_steps": n,
               "routing": routing, "decode_path": engine.decode_path(B)}
        if len(pair) == 2:
            rec["paired_dense_ms"] = sec[0] / n * 1e3
        if rec["decode_path"] == "dense":  # a fine engine that measured its dense step faster
            rec.update(weight_bytes_frac_kernel=1.0, weight_bytes_frac_union=1.0, active_frac_per_token=1.0)
        elif record_masks:
            masks = []
            engine.pos.copy_(start)
            tok = first
            with torch.no_grad():
                for step in range(min(4, n)):
                    rec_list = []
                    tok = engine.decode(tok, record=rec_list).argmax(-1)  # eager, masks recorded
                    engine.pos += 1
                    masks += [(step, layer, kind, m) for layer, kind, m in rec_list]
            if engine.fine is not None and rec["decode_path"] == "fine":
                rec.update(fine_bytes_fraction(model, masks, B, engine.mode))
            else:
                rec.update(bytes_fraction(model, masks, B, shared=routing == "batch_shared"))
        if device.type == "cuda" and (B > 1 or ctx > 4096):  # the long-context batched regime
            rec.update(guarded(f"attention share B={B} ctx={ctx} {engine_name}",
                               lambda: attention_share(engine, first, start)) or {})
        engine.free_cache()
        return rec

    def hf_times(B, T, n):
        state.mask_fn = lambda *a: None  # hooks stay, routing off: the plain dense model
        try:
            ids = rand_ids(B, T)
            am = torch.ones_like(ids)
            kw = dict(attention_mask=am, do_sample=False, pad_token_id=0, eos_token_id=None)

            def run(k):
                return lambda: model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)

            t1 = timer(run(1), reps=2, warmup=1)
            tn = timer(run(n + 1), reps=2, warmup=0)
        finally:
            state.mask_fn = None
        return t1, (tn - t1) / n

    def add(rec, base_key=None):
        rec["model"] = model_name
        if rec["engine"].split(":")[0] == "fine":
            rec["engine"], _, sums = rec["engine"].partition(":")
            rec["fine_sums"] = sums or fine_sums[0]
        # The routing rule the record measures (docs/routing_structure.md); None: no routing.
        rec["routing"] = None if rec["engine"] not in ("routed", "hybrid") else (
            rec.get("routing") or getattr(by_mode.get(rec["engine"]), "routing", None) or "token")
        rec["mode"] = {"routed": "coarse", "hf_generate": "dense"}.get(rec["engine"], rec["engine"])
        if rec["engine"] in ("fine", "hybrid"):
            r, f = split[rec["sparsity"]] if rec["engine"] == "hybrid" else (0.0, rec["sparsity"])
            rec.update(router_sparsity=r, fine_sparsity=f)
        # speedup = dense engine time over this engine's, same run, model and shape
        if rec["engine"] != "dense":
            if "paired_dense_ms" in rec:  # timed in turns with the dense engine (ttft, tpot)
                rec["dense_ms"] = rec["paired_dense_ms"]
            else:  # the dense engine's own block of the run
                for r in records:
                    if r["op"] == rec["op"] and r["engine"] == "dense" and r["B"] == rec["B"] \
                            and r["prompt_len"] == rec["prompt_len"] and r.get("model") == model_name:
                        rec["dense_ms"] = r["ms"]
            if "dense_ms" in rec:
                rec["speedup"] = rec["dense_ms"] / rec["ms"]
            rec.update(attention_bound(rec, records, (meta.get("realised_sparsity_by_model") or {}).get(model_name)
                                       or meta.get("realised_sparsity") or {}))
        records.append(rec)
        print(f"[e2e] {model_name} {rec['op']} B={rec['B']} T={rec['prompt_len']} {rec['engine']} "
              f"s={rec.get('sparsity')}: {rec['ms']:.3f} ms"
              + (f" {rec['routing']}" if rec.get("routing") else "")
              + (f"  speedup {rec['speedup']:.2f}x" if 'speedup' in rec else "")
              + (f"  bytes {rec['weight_bytes_frac_kernel']:.3f}" if 'weight_bytes_frac_kernel' in rec else ""),
              flush=True)
        save()

    # Order: what the targets need first (4k TTFT and B=1 TPOT at 50 %), then the rest.
    s0 = sparsities[0]
    ctxs = decode_ctxs or [args.decode_ctx]
    timed = [{"coarse": "routed"}.get(m, m) for m in modes]

    def each_mode(kind, x):
        # a fine engine's other sums change its decode alone (its prefill is the dense one's)
        names = [n for m in timed for n in ([m] + [f"fine:{v}" for v in fine_sums[1:]]
                                            if m == "fine" and kind == "tpot" else [m])]
        return [(kind, x, "dense", None)] + [(kind, x, m, s) for m in names for s in sparsities]

    plan = []
    for j, T in enumerate(prompt_lens):
        plan += each_mode("ttft", T)
        if j == 0:
            for B in batches[:1]:
                plan += each_mode("tpot", (B, ctxs[0]))
            if not args.no_hf:
                plan += [("hf", batches[0], "hf", None), ("hf_ttft", T, "hf", None)]
    for ctx in ctxs:
        for B in batches:
            if (B, ctx) != (batches[0], ctxs[0]):
                plan += each_mode("tpot", (B, ctx))
    if not args.no_hf:
        plan += [("hf_ttft", T, "hf", None) for T in prompt_lens[1:2]]
        plan += [("hf", B, "hf", None) for B in batches[1:]]
    # Structured routing at the first sparsity: decode at every batch; tiles in prefill too. (A
    # batch's sequences sit at unrelated tile positions, so their stored tile masks are as
    # unrelated as per-token ones: tiles are timed at B > 1 to show that, not to expect a gain.)
    for r in routings:
        if r == "token":
            continue
        if r != "batch_shared":
            plan += [("ttft", T, "routed/" + r, s0) for T in prompt_lens]
        plan += [("tpot", (B, ctxs[0]), "routed/" + r, s0) for B in batches]
    fine = getattr(model, "wide_fine", None)
    for kind, x, eng_name, s in plan:
        if over_budget():
            meta["errors"].append({"what": f"{kind} {x} {eng_name} {s}", "error": "skipped: time budget"})
            continue
        if s is not None:
            r, f = split[s] if eng_name == "hybrid" else (s, s)
            set_offsets(model, offsets[r])
            if eng_name.split(":")[0] in ("fine", "hybrid"):  # read by the engine's next setup_cache
                fine.log_threshold.data.copy_(thresholds[f])
        eng = engines[eng_name.split("/")[1]] if "/" in eng_name else by_mode[eng_name] if eng_name in by_mode else None
        if kind == "ttft":
            rec = guarded(f"ttft {x} {eng_name} {s}", lambda: ttft(eng, x, eng_name, s))
        elif kind == "tpot":
            rec = guarded(f"tpot {x} {eng_name} {s}", lambda: tpot(eng, x[0], x[1], eng_name, s, True))
        elif kind == "hf":
            r = guarded(f"hf B={x}", lambda: hf_times(x, ctxs[0], min(args.decode_steps, 16)))
            rec = None
            if r is not None:
                add({"op": "e2e_tpot", "B": x, "prompt_len": ctxs[0], "engine": "hf_generate",
                     "sparsity": None, "ms": r[1] * 1e3})
        else:
            r = guarded(f"hf ttft {x}", lambda: hf_times(1, x, 1))
            rec = None
            if r is not None:
                add({"op": "e2e_ttft", "B": 1, "prompt_len": x, "engine": "hf_generate",
                     "sparsity": None, "ms": r[0] * 1e3})
        if rec is not None:
            add(rec)
    if args.profile and device.type == "cuda":
        set_offsets(model, offsets[s0])
        profiles = meta.setdefault("profile", {})
        T_p = 4096 if not args.tiny else 32
        pre = "" if first else f"{model_name}: "  # (the bounds script reads the first model's)
        for m in ("fine", "hybrid"):  # at the first target's thresholds (and the hybrid's routers)
            if m in by_mode:
                r, f = split[s0] if m == "hybrid" else (s0, s0)
                set_offsets(model, offsets[r])
                fine.log_threshold.data.copy_(thresholds[f])
                profiles[pre + m] = guarded(f"profile {m}", lambda: profile_decode(by_mode[m], rand_ids(1, ctxs[0])))
                # the prefill is dense in these modes, so its kernels should time as the dense
                # engine's; and at 1 < B <= 4 the engine picks a fine or dense step by measurement
                profiles[f"{pre}{m} prefill {T_p}"] = guarded(
                    f"profile prefill {m}", lambda: profile_prefill(by_mode[m], rand_ids(1, T_p)))
                for Bp in (b for b in batches if 1 < b <= 4):
                    for name, eng in (("dense", dense), (m, by_mode[m])):
                        if f"{pre}{name} decode B={Bp}" not in profiles:  # (dense: once for both modes)
                            profiles[f"{pre}{name} decode B={Bp}"] = guarded(
                                f"profile {name} B={Bp}", lambda: profile_decode(eng, rand_ids(Bp, ctxs[0])))
        set_offsets(model, offsets[s0])
        for name, eng in (("dense", dense), ("routed", routed)):
            profiles[pre + name] = guarded(f"profile {name}", lambda: profile_decode(eng, rand_ids(1, ctxs[0])))
            profiles[f"{pre}{name} prefill {T_p}"] = guarded(
                f"profile prefill {name}", lambda: profile_prefill(eng, rand_ids(1, T_p)))
        for name, eng in engines.items():  # a tile prefill is where (tile, group) blocks may be skipped
            if name.startswith("tile"):
                profiles[f"{pre}routed {name} prefill {T_p}"] = guarded(
                    f"profile prefill {name}", lambda: profile_prefill(eng, rand_ids(1, T_p)))
        if "batch_shared" in engines:  # where a batched step's time goes, per routing
            Bp = batches[-1]
            for name, eng in (("dense", dense), ("routed", routed), ("routed batch_shared", engines["batch_shared"])):
                profiles[f"{pre}{name} decode B={Bp}"] = guarded(
                    f"profile {name} B={Bp}", lambda: profile_decode(eng, rand_ids(Bp, ctxs[0])))
        save()


def _kernel_table(prof, steps: int, top: int) -> dict:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            rows.append({"kernel": e.key[:90], "us_per_step": t / steps, "launches_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"total_us_per_step": sum(r["us_per_step"] for r in rows),
            "attention_us_per_step": sum(r["us_per_step"] for r in rows if ATTENTION_KERNELS.search(r["kernel"])),
            "launches_per_step": sum(r["launches_per_step"] for r in rows), "top": rows[:top]}


def attention_share(engine, tok, start, steps: int = 3) -> dict:
    """The share of an eager decode step's GPU time spent in attention kernels, at positions
    ``start`` on the engine's current cache: the long-context batched regime's question."""
    engine.pos.copy_(start)  # (the TPOT loop and the mask recording moved it on)
    t = _profile_eager_steps(engine, tok, start, steps, top=0)
    return {"attn_share": t["attention_us_per_step"] / t["total_us_per_step"] if t["total_us_per_step"] else None,
            "eager_step_us": t["total_us_per_step"]}


@torch.no_grad()
def profile_prefill(engine, ids, reps: int = 2, top: int = 20) -> dict:
    """GPU time per kernel name of one prefill (B=1) of ``ids``: where TTFT goes."""
    from torch.profiler import ProfilerActivity, profile

    B, T = ids.shape
    engine.setup_cache(B, -(-T // 128) * 128)
    engine.prefill(ids)  # warm-up: autotuning and implementation choices happen here
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            engine.prefill(ids)
        torch.cuda.synchronize()
    engine.free_cache()
    return _kernel_table(prof, reps, top)


@torch.no_grad()
def profile_decode(engine, ids, steps: int = 3, top: int = 20) -> dict:
    """GPU time per kernel name for one eager decode step (B=1), summed over the step: where
    the time of a step goes, beyond the CUDA-graph total the TPOT rows give."""
    B, ctx = ids.shape
    engine.setup_cache(B, -(-(ctx + steps + 8) // 128) * 128)
    tok = engine.prefill(ids).argmax(-1)
    table = _profile_eager_steps(engine, tok, torch.full((B,), ctx, dtype=torch.long, device=ids.device), steps, top)
    engine.free_cache()
    return table


@torch.no_grad()
def _profile_eager_steps(engine, tok, pos, steps: int, top: int) -> dict:
    """``_kernel_table`` of ``steps`` eager decode steps at positions ``pos`` on the engine's
    current cache, after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    # decode(record=...) runs the step eagerly (no graph replay): one launch per kernel to see.
    engine.decode(tok, pos, record=[])  # warm-up: autotuning and implementation choices happen here
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = engine.decode(tok, pos, record=[]).argmax(-1)
        torch.cuda.synchronize()
    return _kernel_table(prof, steps, top)


def attention_bound(rec: dict, records: list, realised: dict) -> dict:
    """Issue 48's bound for a decode step that skips head groups: the dense engine's step with
    its attention kernels' share (``attn_share``, same B and context) shortened by the measured
    attention-core skip and the rest at the dense engine's time; the record's speedup over it."""
    core = (realised.get(str(rec.get("sparsity"))) or {}).get("attn_core_rate")
    if rec["op"] != "e2e_tpot" or not str(rec.get("routing") or "").startswith("skip") or not core:
        return {}
    share = next((r.get("attn_share") for r in records if r["op"] == "e2e_tpot" and r["engine"] == "dense"
                  and r["B"] == rec["B"] and r["prompt_len"] == rec["prompt_len"]
                  and r.get("model") == rec.get("model")), None)
    if share is None:
        return {}
    bound = 1.0 / (1.0 - share * core)
    return {"attn_bound": bound, **({"of_attn_bound": rec["speedup"] / bound} if "speedup" in rec else {})}


def markdown(meta: dict) -> str:
    lines = [f"# End-to-end TTFT / TPOT ({meta['device']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. {meta['model']}; "
             f"{meta['routers']}.", "", f"Command: `{meta['command']}`", ""]
    if meta.get("pdl"):
        lines += ["Programmatic dependent launch on (wide.kernels.pdl; WIDE_PDL=0 turns it off): the norm, RoPE, decode "
                  "attention and fine GEMV launches start while the launch before them drains.", ""]
    elif "pdl" in meta:
        lines += ["Programmatic dependent launch off (WIDE_PDL=0, or a GPU or Triton without it).", ""]
    if meta.get("thresholds"):
        split = meta.get("hybrid_split", {})
        lines += [f"Modes {', '.join(meta.get('modes', []))}; {meta['thresholds']}."
                  + "".join(f" Hybrid at {t}: routers at {v['router_sparsity']:.3f}, thresholds dropping "
                            f"{v['fine_sparsity']:.3f} inside the kept groups." for t, v in split.items()), ""]
    if meta.get("prefill_graph_max_tokens") is not None:
        lines += [f"Prefills of up to {meta['prefill_graph_max_tokens']} tokens (batch x length "
                  "rounded up to 128) replay a CUDA graph in both engines; longer ones run eagerly.", ""]
    by_model = meta.get("realised_sparsity_by_model") or {}
    multi = len(by_model) > 1
    if meta.get("realised_sparsity"):
        lines += ["Realised sparsity on a fresh random prompt (group rate; attention / FFN):", ""]
        for name, rates in (by_model.items() if multi else [(None, meta["realised_sparsity"])]):
            for s, v in rates.items():
                f3 = {k: "-" if v.get(k) is None else f"{v[k]:.3f}" for k in ("attn_rate", "ffn_rate", "flop_rate")}
                lines.append(f"- {name + ', ' if name else ''}target {s}: attn {f3['attn_rate']}, "
                             f"ffn {f3['ffn_rate']}, FLOP-weighted {f3['flop_rate']}"
                             + ("" if v.get("attn_core_rate") is None else
                                f", attention core {v['attn_core_rate']:.3f}"))
        lines.append("")
    recs = meta["records"]
    order = {m: i for i, m in enumerate(by_model)}
    for op, title, key in (("e2e_ttft", "Time to first token (batch 1; each engine timed in turns with the dense "
                                        "engine on one prompt, the dense engine ms column from those turns)",
                            "prompt_len"),
                           ("e2e_tpot", "Time per output token (CUDA-graph decode; each engine timed in turns "
                                        "with the dense engine where both KV caches fit, the dense engine ms "
                                        "column from those turns)", "B")):
        rows = [r for r in recs if r["op"] == op]
        if not rows:
            continue
        lines += [f"## {title}", "",
                  ("| model " if multi else "")
                  + "| B | prompt | engine | sparsity | ms | dense engine ms | speedup vs dense engine |"
                  + (" weight bytes read (union / kernels) | active per token | attention share of the step |"
                     if op == "e2e_tpot" else ""),
                  ("|---" if multi else "") + "|---|---|---|---|---|---|---|"
                  + ("---|---|---|" if op == "e2e_tpot" else "")]
        for r in sorted(rows, key=lambda r: (order.get(r.get("model"), 0), r[key], r["engine"],
                                             r.get("sparsity") or 0, r.get("routing") or "", r.get("fine_sums") or "")):
            sp = "-" if r.get("sparsity") is None else f"{r['sparsity']:.2f}"
            if r.get("routing") not in (None, "token"):
                r = dict(r, engine=f"{r['engine']} ({r['routing']})")
            if r.get("fine_sums") and len(meta.get("fine_sums") or ()) > 1:
                r = dict(r, engine=f"{r['engine']} ({r['fine_sums']} sums)")
            line = (f"| {r['B']} | {r['prompt_len']} | {r['engine']} | {sp} | {r['ms']:.3f} | "
                    f"{r.get('dense_ms', r['ms'] if r['engine'] == 'dense' else float('nan')):.3f} | "
                    f"{r['speedup']:.2f}x |" if "speedup" in r else
                    f"| {r['B']} | {r['prompt_len']} | {r['engine']} | {sp} | {r['ms']:.3f} | - | - |")
            if multi:
                line = f"| {r.get('model')} " + line
            if op == "e2e_tpot":
                if "weight_bytes_frac_union" in r:
                    line += (f" {r['weight_bytes_frac_union']:.3f} / {r['weight_bytes_frac_kernel']:.3f} |"
                             f" {r['active_frac_per_token']:.3f} |")
                else:
                    line += " - | - |"
                line += f" {r['attn_share']:.0%} |" if r.get("attn_share") is not None else " - |"
            lines.append(line)
        lines.append("")
    bounded = [r for r in recs if "attn_bound" in r]
    if bounded:
        lines += ["## Head-group skip against its bound", "",
                  "Bound: the dense engine's step with its attention share (same B and context) shortened by the "
                  "realised attention-core skip, the rest at the dense engine's time.", "",
                  "| B | prompt | engine | speedup | bound | of the bound |", "|---|---|---|---|---|---|"]
        for r in sorted(bounded, key=lambda r: (r["B"], r["prompt_len"], r["engine"])):
            sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            of = f"{r['of_attn_bound']:.0%}" if "of_attn_bound" in r else "-"
            lines.append(f"| {r['B']} | {r['prompt_len']} | {r['engine']} ({r['routing']}) | {sp} | "
                         f"{r['attn_bound']:.2f}x | {of} |")
        lines.append("")
    mem = [r for r in recs if r["op"] == "e2e_memory"]
    if mem:
        lines += ["## Peak GPU memory, each engine built alone on the model", "",
                  "The model's weights included; cache for one prompt at batch 1. Weights: the unique bytes of "
                  "the weights the model and engine then hold.", "",
                  "| engine | B | prompt | peak GiB | weights GiB | cache GiB | peak over dense |", "|---|---|---|---|---|---|---|"]
        base = next((r["peak_gib"] for r in mem if r["engine"] == "dense"), None)
        for r in mem:
            rel = f"{r['peak_gib'] / base:.3f}" if base else "-"
            lines.append(f"| {r['mode']} | {r['B']} | {r['prompt_len']} | {r['peak_gib']:.2f} | {r['weights_gib']:.2f} | "
                         f"{r['cache_gib']:.2f} | {rel} |")
        lines.append("")
    if any(r.get("decode_path") == "dense" for r in recs if r.get("engine") == "fine"):
        lines += ["Fine rows whose weight bytes read 1.000 decoded dense: the engine measured its dense step faster "
                  "at that batch size, or the batch exceeds the GEMVs' 4 tokens (AcceleratedModel.decode_path).", ""]
    if any(r.get("decode_path") == "routed" for r in recs):
        lines += ["Hybrid rows at batches past the GEMVs' 4 tokens (or where it measured faster) decoded with the "
                  "routers alone, the thresholds off: routed attention and the routers' GEMMs "
                  "(AcceleratedModel.decode_path).", ""]
    for key, pr in (meta.get("profile") or {}).items():
        if not pr:
            continue
        model, _, name = key.rpartition(": ")  # a later model's profiles carry its name
        if "prefill" in name:
            what = f"B=1 prefill of {name.split()[-1]} tokens, {' '.join(name.split()[:-2])} engine"
        elif " decode B=" in name:
            eng_name, _, b = name.partition(" decode B=")
            what = f"Eager B={b} decode step, {eng_name} engine"
        else:
            what = f"Eager B=1 decode step, {name} engine"
        what += f", {model}" if model else ""
        lines += [f"{what}: {pr['total_us_per_step']:.0f} us of GPU time in "
                  f"{pr['launches_per_step']:.0f} kernel launches; largest:", "",
                  "| kernel | us / step | launches / step |", "|---|---|---|"]
        lines += [f"| `{r['kernel']}` | {r['us_per_step']:.1f} | {r['launches_per_step']:.0f} |" for r in pr["top"][:14]]
        lines.append("")
    if any(r.get("attn_share") is not None for r in recs):
        lines += ["Attention share: GPU time of the attention kernels over all kernels of three eager decode "
                  "steps (no graph: launch gaps left out) at B > 1 or contexts past 4k, where KV reads rival weight "
                  "reads and skipped query heads save attention work at any batch size.", ""]
    if meta.get("k_choices"):
        # Each routing's engine measures its own choices; one line per routing keeps them apart.
        by_routing: dict = {}
        for c in meta["k_choices"]:
            by_routing.setdefault(c.get("routing") or "token", []).append(
                f"{c.get('op', 'gemm_k')} {c['N']}x{c['K']} T<={c['T_bucket']}: {c['impl']}")
        lines += ["Routed kernel or cuBLAS, chosen by measurement per projection (CUDA-graph replays, first "
                  "use of each shape and T bucket; batch-1 q and gate/up always routed; q_kv / qkv_dense: "
                  "`whole` is q|k|v in one GEMM; attend_prefill BxHq*D: the routed kernel or SDPA):", ""]
        lines += [(f"- {r}: " if len(by_routing) > 1 else "") + "; ".join(cs) for r, cs in by_routing.items()]
        lines.append("")
    if meta.get("errors"):
        lines += ["Errors / skipped:", ""] + [f"- {e['what']}: {e['error']}" for e in meta["errors"]] + [""]
    return "\n".join(lines)


def plot(meta: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = meta["records"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op, key, title in ((axes[0], "e2e_ttft", "prompt_len", "TTFT speedup over dense engine"),
                               (axes[1], "e2e_tpot", "B", "TPOT speedup over dense engine")):
        models = list(dict.fromkeys(r.get("model") for r in recs))
        # one line per engine (routed: mode coarse), target and routing rule; TPOT at the first
        # decode context (the others are in the table)
        ctx0 = next((r["prompt_len"] for r in recs if r["op"] == op), None)
        lines = sorted({(r["engine"], r["sparsity"], r.get("routing") or "token") for r in recs
                        if r["op"] == op and r["engine"] in ("routed", "fine", "hybrid")})
        for m in models:
            for eng, s, routing in lines:
                rows = sorted((r for r in recs if r["op"] == op and r["engine"] == eng and r.get("model") == m
                               and r["sparsity"] == s and (r.get("routing") or "token") == routing
                               and "speedup" in r and (op == "e2e_ttft" or r["prompt_len"] == ctx0)),
                              key=lambda r: r[key])
                if rows:
                    ax.plot([str(r[key]) for r in rows], [r["speedup"] for r in rows],
                            {"routed": "o-", "fine": "s-", "hybrid": "D-"}[eng] if routing == "token" else "^--",
                            label=(f"{m} " if len(models) > 1 else "") + f"{eng} {s:.0%}"
                            + ("" if routing == "token" else f" {routing}"))
        rows = sorted((r for r in recs if r["op"] == op and r["engine"] == "hf_generate"
                       and r.get("model") == models[0]), key=lambda r: r[key])
        dense = {r[key]: r["ms"] for r in recs if r["op"] == op and r["engine"] == "dense"
                 and r.get("model") == models[0]}
        rows = [r for r in rows if r[key] in dense]
        if rows:
            ax.plot([str(r[key]) for r in rows], [dense[r[key]] / r["ms"] for r in rows], "s--",
                    label="HF generate (dense)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("prompt tokens" if key == "prompt_len" else "batch")
        ax.set_ylabel("x dense engine")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"wide end to end, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
