"""Stage-1 training throughput: tokens per second of ``wide.training.train.train`` steps (routers only,
frozen backbone, 50% FLOP target) for each loss (ce, kd: one extra teacher forward per
micro-batch), autocast mode and batch size, with the peak GPU memory.

    python -m wide.benchmarks.train_speed --batch-size 16 64 128 --out $OUT/train_speed.json
    (or: wide bench train_speed ...)

``--model`` is ``default`` (SmolLM2-135M, the real weights), a preset of ``wide.base.arch.PRESETS``
(random weights of that shape) or a local HF directory. A step is timed by the wall clock
between consecutive steps of the real loop (each step ends with one host sync, so a step's time
covers its GPU work); the number is the median over ``--steps`` steps after ``--warmup``. The
data are random token ids: the speed does not depend on them. ``--tiny`` is a CPU smoke test on
a two-layer model (CI).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

TINY = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


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

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size * (steps + warmup), seq_len), generator=g)
    args = TrainArgs(steps=steps + warmup, batch_size=batch_size, eval_every=0, save_every=0, seed=seed,
                     loss=loss, amp=amp)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wide-train-speed-") as out:
        hist = train(model, ids, args, out, progress=False)["history"]
    timed = [h["tokens_per_s"] for h in hist[warmup:]]
    tps = statistics.median(timed)
    rec = {"loss": loss, "amp": amp, "batch_size": batch_size, "seq_len": seq_len, "tokens_per_step":
           batch_size * seq_len, "steps_timed": len(timed), "tokens_per_s": tps, "step_s": batch_size * seq_len / tps,
           "tokens_per_s_min": min(timed), "tokens_per_s_max": max(timed), "wall_s": time.perf_counter() - t0}
    if device.type == "cuda":
        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return rec


def table(records: list) -> str:
    lines = ["| loss | amp | batch x seq | tokens/s | step (ms) | peak GiB |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['loss']} | {r['amp']} | {r['batch_size']} x {r['seq_len']} | {r['error']} | - | - |")
            continue
        mem = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        lines.append(f"| {r['loss']} | {r['amp']} | {r['batch_size']} x {r['seq_len']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_s'] * 1e3:.1f} | {mem} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a preset name or a HF model directory")
    ap.add_argument("--tiny", action="store_true", help="a two-layer random model on the CPU (smoke test)")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--loss", nargs="+", default=["ce", "kd"], choices=["ce", "kd", "mix"])
    ap.add_argument("--amp", nargs="+", default=None, choices=["none", "bf16"],
                    help="autocast modes (default: none and bf16 on a GPU, none on the CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="backbone weights")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="JSON results file (a .md table is written beside it)")
    a = ap.parse_args(argv)

    from wide.method import modeling
    from wide.method.config import WideConfig

    device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    amps = a.amp or (["none", "bf16"] if device.startswith("cuda") else ["none"])
    model = load_model(a.model, a.tiny, getattr(torch, a.dtype), device)
    # The random start of the committed speed runs; the start does not change a step's work.
    wcfg = WideConfig(target_sparsity=a.target, ffn_group_size=32 if a.tiny else 128, router_init="random")
    modeling.wrap(model, wcfg, seed=0)
    modeling.freeze_backbone(model)
    records = []
    for loss in a.loss:
        for amp in amps:
            for bs in a.batch_size:
                try:
                    rec = measure(model, loss=loss, amp=amp, batch_size=bs, seq_len=a.seq_len, steps=a.steps,
                                  warmup=a.warmup)
                except torch.cuda.OutOfMemoryError:
                    rec = {"loss": loss, "amp": amp, "batch_size": bs, "seq_len": a.seq_len, "error": "out of memory"}
                    torch.cuda.empty_cache()
                records.append(rec)
                print(table([rec]).splitlines()[-1], flush=True)
    doc = {"benchmark": "train_speed", "model": "tiny" if a.tiny else a.model, "dtype": a.dtype, "device": device,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
           "torch": torch.__version__, "target": a.target, "records": records}
    print(table(records))
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
        out.with_suffix(".md").write_text(f"# Stage-1 training throughput\n\n{doc['model']} ({doc['dtype']} weights) "
                                          f"on {doc['gpu']}, torch {doc['torch']}, target {a.target}\n\n"
                                          f"{table(records)}\n")
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
