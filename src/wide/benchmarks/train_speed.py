"""Stage-1 training throughput: tokens per second of ``wide.training.train.train`` steps (frozen
backbone) for each loss (ce, kd: one extra teacher forward per micro-batch), autocast mode and
batch size, with the peak GPU memory, the trained parameter count and ``wide calibrate
--dry-run``'s estimate of the same run (``wide.commands.estimate.estimate``) beside them.

    python -m wide.benchmarks.train_speed --batch-size 16 64 128 --out $OUT/train_speed.json
    (or: wide bench train_speed ...)

``--design`` picks what trains:

* ``routers`` (default): routers of both modules at the 50% FLOP target (random start), one phase.
* ``heads``: stage 1 of issue 48's kept design (a), in its two phases on one model. ``thresholds``:
  learned per-element thresholds with per-channel scales, no router, the target over all
  linear MACs (``wide calibrate --hybrid --sparse-target none --fine-per-channel``, the recipe of
  the shipped ``smollm2-135m-fine-50``), started from TEAL's uniform quantiles on random tokens.
  ``heads``: attention-only head-group routers under ``skip_upto`` with layer 0 dense
  (``wide.benchmarks.e2e.heads_config`` at ``--heads``) trained on the phase's thresholds, frozen
  (experiments/head_routers_fine_cpu.py's design (a)). Loss kd and, on a GPU, bf16 autocast
  unless given.

    python -m wide.benchmarks.train_speed --design heads --model llama-3.1-8b --dtype bfloat16 \\
        --seq-len 2048 --batch-size 1 2 3 4 --out $OUT/calib_8b

``--model`` is ``default`` (SmolLM2-135M, the real weights), a preset of ``wide.base.arch.PRESETS``
(random weights of that shape) or a local HF directory. A step is timed by the wall clock
between consecutive steps of the real loop (each step ends with one host sync, so a step's time
covers its GPU work; it is the rate ``wide calibrate`` reports); the number is the median over
``--steps`` steps after ``--warmup``. The data are random token ids: the speed does not depend
on them. A configuration that runs out of GPU memory is recorded as such (with the peak it
reached), and larger batches of the same phase, loss and autocast mode are then not tried. The
estimate is given where activations are bf16 (bf16 weights or autocast), which it assumes.
``--tiny`` is a CPU smoke test on a two-layer model (CI).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

TINY = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
DESIGNS = {"routers": ("routers",), "heads": ("thresholds", "heads")}
OOM = "out of memory"


def load_model(name: str, tiny: bool, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from wide.base import arch
    from wide.data import fetch_default_model

    if tiny:
        cfg = AutoConfig.for_model(**TINY)
    elif name == "default":
        return AutoModelForCausalLM.from_pretrained(fetch_default_model(), dtype=dtype).to(device)
    else:
        if name.lower() not in arch.PRESETS:
            return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
        cfg = arch.hf_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def measure(model, *, loss: str, amp: str, batch_size: int, seq_len: int, steps: int, warmup: int,
            seed: int = 0) -> dict:
    """Median tokens/s of ``steps`` training steps after ``warmup`` ones, on random ids."""
    from wide.training.train import TrainArgs, train

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size * (steps + warmup), seq_len), generator=g)
    args = TrainArgs(steps=steps + warmup, batch_size=batch_size, eval_every=0, save_every=0, seed=seed,
                     loss=loss, amp=amp)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wide-train-speed-") as out:
        hist = train(model, ids, args, out, progress=False)["history"]
    timed = [h["tokens_per_s"] for h in hist[warmup:]]
    tps = statistics.median(timed)
    return {"tokens_per_step": batch_size * seq_len, "steps_timed": len(timed), "tokens_per_s": tps,
            "step_s": batch_size * seq_len / tps, "tokens_per_s_min": min(timed), "tokens_per_s_max": max(timed),
            "wall_s": time.perf_counter() - t0}


def phase_configs(phase: str, hf_config, a) -> tuple:
    """(WideConfig, FineConfig or None, whether the thresholds train) of ``phase`` on a model of
    ``hf_config`` under the options ``a`` (target, heads, tiny)."""
    from wide.method.config import WideConfig
    from wide.method.fine import FineConfig

    if phase == "routers":
        # The random start of the committed speed runs; the start does not change a step's work.
        return WideConfig(target_sparsity=a.target, ffn_group_size=32 if a.tiny else 128, router_init="random"), \
            None, False
    # cmd_calibrate --hybrid with no router (the budget over all linear MACs), the shipped recipe
    fcfg = FineConfig(allocation="learned", per_channel=True, target=a.target, lr_scale=1.0)
    if phase == "thresholds":
        return WideConfig(target_sparsity=a.target, sparse_target="none", loss_mode="linear"), fcfg, True
    from wide.benchmarks.e2e import heads_config

    return heads_config(hf_config, a.heads, target_sparsity=a.heads), fcfg, False


def setup_phase(model, phase: str, a, calib: torch.Tensor) -> tuple:
    """Wrap ``model`` for ``phase`` and freeze its backbone; returns :func:`phase_configs`'s
    triple. ``calib``: the token ids that start learned thresholds at TEAL's uniform quantiles;
    the heads phase keeps the thresholds the model carries (the previous phase's), frozen."""
    from wide.method import fine, modeling

    wcfg, fcfg, fine_trained = phase_configs(phase, model.config, a)
    held = None
    if phase == "heads":
        old = fine.get_fine(model)
        if old is None or old.config != fcfg:
            raise ValueError("the heads phase trains on the thresholds phase's thresholds: run that first")
        held = {k: v.detach().clone() for k, v in old.state_dict().items()}
        modeling.unwrap(model)
    modeling.wrap(model, wcfg, seed=0)
    if fcfg is not None:
        fine.attach(model, fcfg)
        if held is not None:
            model.wide_fine.load_state_dict(held)
        else:
            fine.calibrate(model, calib.split(max(1, len(calib) // 2)), progress=False)
    modeling.freeze_backbone(model)
    if not fine_trained and fcfg is not None:
        for p in model.wide_fine.parameters():
            p.requires_grad_(False)
    return wcfg, fcfg, fine_trained


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the GPU running out of memory: torch's own error, or a library's
    allocation failing under it (cuBLAS asks for its workspace outside the caching allocator)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower() \
        or "CUBLAS_STATUS_ALLOC_FAILED" in str(e)


def trained_parameters(model) -> int:
    from wide.method.modeling import router_parameters

    return sum(p.numel() for p in router_parameters(model) if p.requires_grad)


def gpu_key(device: str) -> str:
    """The estimator's GPU (``GPU_PEAK``) this device is, else its default."""
    from wide.commands.estimate import GPU_PEAK, DryRunArgs

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device).lower()
        return next((k for k in GPU_PEAK if k in name), DryRunArgs.gpu)
    return DryRunArgs.gpu


def predicted(hf_config, wcfg, fcfg, fine_trained: bool, *, loss: str, batch_size: int, seq_len: int,
              dtype: str, gpu: str) -> dict:
    """``wide calibrate --dry-run``'s figures for one configuration on one GPU."""
    from wide.commands.estimate import estimate

    est = estimate(hf_config, wcfg, seq_len=seq_len, batch_size=batch_size, steps=1,
                   param_bytes=4 if dtype == "float32" else 2, gpu=gpu, loss=loss, fine=fcfg,
                   fine_trained=fine_trained)
    return {"peak_gib": est.peak_gib, "step_s": est.step_s, "tokens_per_s": est.tokens_per_s_per_rank,
            "trainable_params": est.detail["trainable_params"], "gpu": gpu, "mfu": est.detail["mfu"],
            "rows": [[name, gib] for name, gib, _ in est.rows]}


def dry_run_command(a, phase: str, loss: str, batch_size: int, gpu: str):
    """The ``wide calibrate --dry-run`` line that prints a phase's estimate, where one does (the
    dry run does not count the frozen thresholds of ``wide calibrate --thresholds``, the heads
    phase's path, and --tiny's model is no preset)."""
    if a.tiny:
        return None
    base = (f"wide calibrate --dry-run --model {a.model} --dtype {a.dtype} --loss {loss} --seq-len {a.seq_len} "
            f"--batch-size {batch_size} --gpu {gpu} --out unused")
    if phase == "routers":
        return f"{base} --target {a.target} --router-init random --ffn-group-size 128"
    if phase == "thresholds":
        return f"{base} --target {a.target} --hybrid --sparse-target none --fine-per-channel --fine-lr-scale 1"
    return None


def _gib(rec: dict, key: str) -> str:
    v = rec.get(key)
    return f"{v:.2f}" if v is not None else "-"


def table(records: list) -> str:
    lines = ["| phase | loss | amp | batch x seq | tokens/s | step (ms) | peak GiB | est. peak GiB | est. step (ms) "
             "| trained params | est. trained |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        est = r.get("estimate") or {}
        est_cols = (f"{est['peak_gib']:.2f} | {est['step_s'] * 1e3:.1f} | " if est else "- | - | ")
        head = f"| {r['phase']} | {r['loss']} | {r['amp']} | {r['batch_size']} x {r['seq_len']} | "
        tail = f"{r['trainable_params']:,} | " + (f"{est['trainable_params']:,} |" if est else "- |")
        if r.get("error"):
            lines.append(f"{head}{r['error']} | - | {_gib(r, 'peak_memory_gib')} | {est_cols}{tail}")
            continue
        lines.append(f"{head}{r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | {_gib(r, 'peak_memory_gib')} | "
                     f"{est_cols}{tail}")
    return "\n".join(lines)


def metadata(a, device: str, argv) -> dict:
    import transformers
    import triton

    from wide.commands.runs import machine

    return {"benchmark": "train_speed", "design": a.design, "model": "tiny" if a.tiny else a.model, "dtype": a.dtype,
            "device": device, "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m wide.benchmarks.train_speed " + " ".join(sys.argv[1:] if argv is None else argv),
            "target": a.target, "heads": a.heads if a.design == "heads" else None, "steps": a.steps,
            "warmup": a.warmup}


def markdown(doc: dict) -> str:
    est = next((r["estimate"] for r in doc["records"] if r.get("estimate")), None)
    title = "Stage-1 training throughput" + (" of design (a): thresholds, then head routers" if doc["design"] == "heads"
                                             else "")
    lines = [f"# {title}", "", f"{doc['model']} ({doc['dtype']} weights) on {doc['gpu']}; torch {doc['torch']}, "
             f"triton {doc['triton']}, transformers {doc['transformers']}; {doc['date']}.", "",
             f"Command: `{doc['command']}`", "",
             f"Median of {doc['steps']} steps after {doc['warmup']}; peak = torch.cuda.max_memory_allocated; "
             "est. = `wide calibrate --dry-run`'s estimate (wide.commands.estimate) for the same run"
             + (f", its step time at {est['mfu']:.0%} MFU of an {est['gpu']}" if est else "") + ".", ""]
    for phase in doc["phases"]:
        p = doc["phases"][phase]
        first = next((r["dry_run"] for r in doc["records"] if r["phase"] == phase and r.get("dry_run")), None)
        how = (f"; its first row's estimate is `{first}`" if first else
               "; no `wide calibrate` runs it yet: the estimate is `estimate(..., fine=..., fine_trained=False)`"
               if phase == "heads" else "")
        lines.append(f"- **{phase}**: {p['what']}; {p['trainable_params']:,} trained parameters; "
                     f"set up in {p['setup_s']:.1f} s{how}")
    return "\n".join(lines + ["", table(doc["records"]), ""])


PHASE_NOTES = {
    "routers": "routers of attention and FFN groups, 50% FLOP target, random start",
    "thresholds": "learned per-element thresholds and per-channel scales, no router, linear-MAC target",
    "heads": "attention head-group routers (skip_upto, layer 0 dense) on the frozen thresholds",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a preset name or a HF model directory")
    ap.add_argument("--tiny", action="store_true", help="a two-layer random model on the CPU (smoke test)")
    ap.add_argument("--design", default="routers", choices=sorted(DESIGNS),
                    help="routers: routers of both modules; heads: design (a)'s thresholds, then head routers on them")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--loss", nargs="+", default=None, choices=["ce", "kd", "mix"],
                    help="task losses (default: ce and kd; kd with --design heads)")
    ap.add_argument("--amp", nargs="+", default=None, choices=["none", "bf16"],
                    help="autocast modes (default: none and bf16 on a GPU, bf16 alone with --design heads; none on "
                         "the CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="backbone weights")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--target", type=float, default=0.5,
                    help="routers' FLOP target (routers) or the thresholds' linear-MAC target (heads)")
    ap.add_argument("--heads", type=float, default=0.25, metavar="R",
                    help="--design heads: the head routers' target, a share of each routed layer's groups")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="JSON results file (a .md table is written beside it)")
    a = ap.parse_args(argv)
    if not 0 < a.heads < 1:
        ap.error(f"--heads takes 0 < R < 1, got {a.heads}")

    device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    cuda = device.startswith("cuda")
    losses = a.loss or (["kd"] if a.design == "heads" else ["ce", "kd"])
    amps = a.amp or (["none"] if not cuda else ["bf16"] if a.design == "heads" else ["none", "bf16"])
    gpu = gpu_key(device)
    doc = {**metadata(a, device, argv), "phases": {}, "records": []}
    t_start = time.perf_counter()
    model = load_model(a.model, a.tiny, getattr(torch, a.dtype), device)
    doc["load_s"] = time.perf_counter() - t_start
    doc["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    calib = torch.randint(0, model.config.vocab_size, (2 * min(a.batch_size), a.seq_len),
                          generator=torch.Generator().manual_seed(1)).to(device)

    out = Path(a.out) if a.out else None
    files = (out.with_suffix(".json"), out.with_suffix(".md")) if out else ()

    def save():
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            files[0].write_text(json.dumps(doc, indent=2))
            files[1].write_text(markdown(doc))

    for phase in DESIGNS[a.design]:
        t0 = time.perf_counter()
        wcfg, fcfg, fine_trained = setup_phase(model, phase, a, calib)
        trained = trained_parameters(model)
        doc["phases"][phase] = {"what": PHASE_NOTES[phase], "wide_config": wcfg.to_dict(),
                                "fine_config": fcfg.to_dict() if fcfg is not None else None,
                                "thresholds_trained": fine_trained, "trainable_params": trained,
                                "setup_s": time.perf_counter() - t0}
        for loss in losses:
            for amp in amps:
                ran_out = False
                for bs in a.batch_size:
                    rec = {"phase": phase, "loss": loss, "amp": amp, "batch_size": bs, "seq_len": a.seq_len,
                           "trainable_params": trained, "dry_run": dry_run_command(a, phase, loss, bs, gpu)}
                    if amp == "bf16" or a.dtype == "bfloat16":
                        rec["estimate"] = predicted(model.config, wcfg, fcfg, fine_trained, loss=loss, batch_size=bs,
                                                    seq_len=a.seq_len, dtype=a.dtype, gpu=gpu)
                    if ran_out:
                        rec["error"] = "not run (a smaller batch ran out of memory)"
                        doc["records"].append(rec)
                        continue
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    try:
                        rec.update(measure(model, loss=loss, amp=amp, batch_size=bs, seq_len=a.seq_len,
                                           steps=a.steps, warmup=a.warmup))
                    except RuntimeError as e:
                        if not out_of_memory(e):
                            raise
                        rec["error"], ran_out = OOM, True
                    if cuda:
                        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
                    # an out-of-memory step's tensors die with its frames: give their blocks back
                    # before the next configuration measures its own peak
                    gc.collect()
                    if cuda:
                        torch.cuda.empty_cache()
                    doc["records"].append(rec)
                    print(table([rec]).splitlines()[-1], flush=True)
                    save()
    doc["wall_s"] = time.perf_counter() - t_start
    print(table(doc["records"]))
    save()
    if out:
        print(f"wrote {files[0]} and {files[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
