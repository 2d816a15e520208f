"""Stage-1 calibration steps of a Llama-3.1-8B-shaped model (random bf16 weights) under
FSDP2 on one GPU, with the measured peak memory (torch.cuda.max_memory_allocated) and step
time set against ``wide calibrate --dry-run``'s estimate for each configuration.

    python -m wide.benchmarks.fsdp --out $OUT        (or: wide bench fsdp --out $OUT)

Writes OUT/fsdp_h200.json and OUT/fsdp_h200.md. Runs as one process (world size 1) unless
started by torchrun. ``--model smollm2-135m --layers 2 --seq 64`` is a CPU smoke test (gloo).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from wide.base import arch
from wide.training import distributed
from wide.method import modeling
from wide.commands.estimate import estimate
from wide.method.config import WideConfig
from wide.training.train import TrainArgs, train

CONFIGS = [  # (sequence length, global micro-batch, activation checkpointing)
    (4096, 1, False),
    (4096, 1, True),
    (2048, 2, False),
    (4096, 4, True),
    (8192, 1, True),
    (8192, 2, False),  # the estimate says this does not fit in 139 GiB: checks the other side
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (smoke tests)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="run one configuration at this length (smoke tests)")
    ap.add_argument("--mfu", type=float, default=0.4)
    a = ap.parse_args(argv)
    ctx = distributed.init()  # one process (no rendezvous) unless torchrun started it
    cfg = arch.hf_config(a.model)
    if a.layers:
        cfg.num_hidden_layers = a.layers
    cuda = ctx.device.type == "cuda"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(ctx.device):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    # Paper defaults (50% FLOP target, GQA-pack attention groups, 128-channel FFN groups) with the
    # random start of the committed fsdp_h200 runs; the start does not change a step's work.
    wcfg = WideConfig(router_init="random")
    modeling.wrap(model, wcfg)
    modeling.freeze_backbone(model)
    distributed.shard_model(model, ctx)
    build_s = time.perf_counter() - t0
    resident = torch.cuda.memory_allocated() / 2 ** 30 if cuda else None
    configs = [(a.seq, 1, False), (a.seq, 1, True)] if a.seq else CONFIGS
    rows = []
    for seq, batch, ac in configs:
        est = estimate(cfg, wcfg, world_size=ctx.world_size, seq_len=seq, batch_size=batch,
                       activation_checkpointing=ac, param_bytes=2 if cuda else 4, mfu=a.mfu, steps=a.steps)
        if ac:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.config.use_cache = False
        ids = torch.randint(0, cfg.vocab_size, (a.steps * batch, seq), generator=torch.Generator().manual_seed(1))
        args = TrainArgs(steps=a.steps, batch_size=batch, grad_accum=1, eval_every=0, save_every=0, seed=0)
        row = {"seq_len": seq, "batch": batch, "activation_checkpointing": ac, "world_size": ctx.world_size,
               "estimate_gib": round(est.peak_gib, 2), "estimate_rows": [[n, round(g, 3)] for n, g, _ in est.rows],
               "estimate_step_s": round(est.step_s, 3)}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            t = time.perf_counter()
            res = train(model, ids, args, Path("/tmp/wide_fsdp_bench") / f"{seq}_{batch}_{int(ac)}",
                        progress=False, dist=ctx)
            wall = time.perf_counter() - t
            hist = res["history"]
            timed = hist[1:] or hist  # the first step pays for kernel selection and allocator growth
            step_s = sum(seq * batch / h["tokens_per_s"] for h in timed) / len(timed)
            row.update(status="ok", wall_s=round(wall, 2), step_s=round(step_s, 3),
                       tokens_per_s=round(seq * batch / step_s, 1),
                       achieved_mfu=round(a.mfu * est.step_s / step_s, 3),
                       loss=[round(h["loss"], 4) for h in hist], ce=[round(h["ce"], 4) for h in hist],
                       flop_sparsity=[round(h["flop_sparsity"], 4) for h in hist])
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).split("\n")[0][:200])
        except Exception as e:  # keep the other configurations' figures if one fails
            import traceback

            row.update(status="error", error=f"{type(e).__name__}: {e}"[:500],
                       traceback=traceback.format_exc()[-3000:])
        if cuda:
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
            row.update(measured_peak_gib=round(peak, 2),
                       estimate_over_measured=round(est.peak_gib / peak, 3) if row["status"] == "ok" else None)
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("estimate_rows", "traceback")}), flush=True)
        write(a.out, doc_for(a, cfg, cuda, build_s, resident, wcfg, rows))
    distributed.shutdown()
    # an out-of-memory row is a result (the estimate's other side), an exception is not
    return 1 if any(r["status"] == "error" for r in rows) else 0


def doc_for(a, cfg, cuda, build_s, resident, wcfg, rows) -> dict:
    return {"model": a.model, "layers": cfg.num_hidden_layers, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "gpu_capacity_gib": round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1) if cuda else None,
           "torch": torch.__version__, "python": platform.python_version(), "build_s": round(build_s, 1),
           "resident_after_shard_gib": resident, "steps": a.steps, "assumed_mfu": a.mfu, "wide_config": wcfg.to_dict(),
           "date": time.strftime("%Y-%m-%d"), "rows": rows,
           "command": "python -m wide.benchmarks.fsdp --out $OUT"}


def write(out, doc: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_h200.json").write_text(json.dumps(doc, indent=1))
    (out / "fsdp_h200.md").write_text(markdown(doc))


def markdown(doc: dict) -> str:
    lines = [f"# FSDP2 stage-1 steps: {doc['model']} ({doc['layers']} layers, random bf16 weights) on {doc['device']}",
             "", f"Command: `{doc['command']}`; torch {doc['torch']}; {doc['date']}; world size 1; "
             f"{doc['steps']} optimizer steps per row (the first untimed).", "",
             "| seq | batch | act. ckpt | estimate GiB | measured peak GiB | est/meas | step s | est. step s "
             f"@ {doc['assumed_mfu']:.0%} MFU | tokens/s | achieved MFU | status |",
             "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for r in doc["rows"]:
        g = r.get
        lines.append(f"| {r['seq_len']} | {r['batch']} | {'yes' if r['activation_checkpointing'] else 'no'} | "
                     f"{r['estimate_gib']} | {g('measured_peak_gib', '-')} | {g('estimate_over_measured') or '-'} | "
                     f"{g('step_s', '-')} | {r['estimate_step_s']} | {g('tokens_per_s', '-')} | "
                     f"{g('achieved_mfu', '-')} | {r['status']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
