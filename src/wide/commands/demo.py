"""What `wide demo` shows besides its own short calibration: the routers shipped with the
package (wide.pretrained) next to dense and the demo's routers, a few greedy continuations
from each, and what a short calibration can and cannot reach."""

from __future__ import annotations

from pathlib import Path

import torch

from ..io import pretrained

SHIPPED = ("smollm2-135m-50", "smollm2-135m-25", "smollm2-135m-fine-50", "smollm2-135m-fine-25")
PROMPTS = (
    "The capital of France is",
    "To make a cup of tea, first",
    "The three primary colours are",
)


def router_sets(own: str, default_model: bool = True) -> list:
    """Router directories the demo evaluates: the shipped ones (made for the default model
    only), then its own."""
    shipped = [str(pretrained.resolve(n)) for n in SHIPPED if n in pretrained.names()] if default_model else []
    return shipped + [own]


@torch.no_grad()
def continuations(model, tok, prompts=PROMPTS, max_new_tokens: int = 20) -> list:
    """Greedy continuations of ``prompts`` (one at a time: no padding to reason about)."""
    device = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip().replace("\n", " "))
    return out


def samples(model_path, tok, routers: list, labels: list, device: str, dtype: torch.dtype,
            max_new_tokens: int = 20) -> str:
    """A markdown section: each prompt continued by dense and by each router set."""
    from transformers import AutoModelForCausalLM

    from ..training.recovery import load_recovered

    texts = {}
    for label, rdir in [("dense", None), *zip(labels, routers)]:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        if rdir is not None:
            model = load_recovered(model, rdir)
        texts[label] = continuations(model, tok, max_new_tokens=max_new_tokens)
    lines = ["## Greedy continuations", ""]
    for i, p in enumerate(PROMPTS):
        lines.append(f"**{p}** ...")
        lines += [f"- {label}: {texts[label][i]}" for label in texts]
        lines.append("")
    return "\n".join(lines)


def explanation(records: list, run: dict) -> str:
    """What the table means for a newcomer: the shipped routers against the demo's, and why."""
    dense = next((r for r in records if r.get("method") == "dense"), None)
    shipped = [r for r in records if r.get("routers") in pretrained.names()]
    own = next((r for r in records if r.get("routers") and r not in shipped), None)
    lines = ["## What this shows", ""]
    if dense is None or own is None:
        return ""
    for r in shipped:
        name = r["routers"]
        prov = pretrained.provenance(name)
        ev = prov["evaluation"]
        machine = prov.get("machine") or {}
        # wide calibrate records its machine as a dict, wide compare's results as the card's name
        machine = (machine.get("gpu") or "a GPU") if isinstance(machine, dict) else machine
        tail = (f"on 500 documents per task its seven-task average was {ev['routers']['avg']:.3f} against dense's "
                f"{ev['dense']['avg']:.3f}. Load it with wide.from_pretrained(\"{name}\").")
        if prov.get("method") == "learned":  # per-element thresholds: no group skipped, so the FLOP rate is 0
            lines.append(f"- shipped `{name}`: perplexity {r['ppl']:.1f} here ({r['ppl'] / dense['ppl']:.2f}x dense) "
                         f"with {r.get('linear_sparsity') or 0:.0%} of the linear-layer MACs skipped, element by "
                         f"element (thresholds learned on {prov['tokens'] / 1e6:.1f}M tokens, {prov['steps']} steps, "
                         f"on {machine}; no routers); {tail}")
            continue
        lines.append(f"- shipped `{name}`: perplexity {r['ppl']:.1f} here ({r['ppl'] / dense['ppl']:.1f}x dense) at "
                     f"{r['sparsity']:.0%} FLOP sparsity, calibrated on {prov['tokens'] / 1e6:.1f}M tokens "
                     f"({prov['steps']} steps, --loss {prov['loss']}) on {machine}; {tail}")
    # a demo run again resumes its finished run, whose time is the one recorded when it trained
    when = ", recorded when this run finished earlier" if run.get("recorded_earlier") else " on this machine"
    lines.append(f"- this demo's routers: perplexity {own['ppl']:.1f} ({own['ppl'] / dense['ppl']:.0f}x dense) after "
                 f"{run['steps']} steps ({run['tokens'] / 1e3:.0f}k tokens, {run['wall_s'] / 60:.1f} min{when}).")
    lines += [
        "",
        "The demo's routers start dense and its target rises over the first half of the steps "
        "(wide's defaults, --router-init dense --sparsity-warmup 0.5); started from random decisions, which break the model "
        "(training cross-entropy near 14 nats at the first step, against about 3.1 for dense), the same 30 steps "
        "left held-out perplexity at 4745 instead of 261 (docs/method.md; both with the 12 FFN groups of 128 "
        "channels this model had before its default became 96 groups of 16, the line above). Either way "
        "a few CPU minutes show the loss falling, not a finished model: at 50%, held-out perplexity was 703, 111 "
        "and 61 after 1.6M, 6.6M and 26M tokens of random-start calibration on an H200, and 49 and 43 after 6.6M "
        "and 26M tokens with a dense start, lr 1.2e-2 and 96 FFN groups (the 26M run is the shipped 50% "
        "routers; bench/results/quality_scaling and "
        "routing_quality in the repository), minutes on a GPU and days on a laptop CPU. Use the shipped "
        "routers, or `wide calibrate --device cuda` with millions of tokens.",
    ]
    return "\n".join(lines)
