"""Issue 39's alternative "routers for prefill, magnitude thresholds for decode": the prompt runs
through the shipped routers (coarse groups: what makes prefill fast), the continuation through
the shipped learned thresholds (per-element decode), one KV cache handed from the first to the
second. Free-text quality as the frontier measures it (wide.evaluation.evaluate.generation_quality: the
same 128 held-out prompts of 32 tokens, seed 0, 32 greedy tokens; KL(dense || model) on the
dense continuation teacher-forced, greedy agreement), beside each half alone:

* ``thresholds``: the learned thresholds for prompt and continuation (the frontier's
  ``learned`` row; this script must reproduce its gen_kl, which checks the set-up);
* ``routers``: the routers for both;
* ``routers_prefill_thresholds_decode``: routers over the prompt, thresholds after it.

    PYTHONPATH=src python experiments/prefill_routers_decode_thresholds_cpu.py [--prompts 128]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import wide
from wide import cli
from wide.commands import runs
from wide.evaluation.evaluate import cache_kwargs, distinct_n, greedy_continuations

PAIRS = {25: ("smollm2-135m-25", "smollm2-135m-fine-25"), 50: ("smollm2-135m-50", "smollm2-135m-fine-50")}


@torch.no_grad()
def split_logits(prefill_model, decode_model, P, cont, batch):
    """Logits predicting cont's tokens: the last prompt position from ``prefill_model``'s pass
    over P, the rest from ``decode_model`` over cont[:, :-1] on that pass's cache."""
    out = []
    for i in range(0, P.shape[0], batch):
        a = prefill_model(input_ids=P[i:i + batch], use_cache=True)
        b = decode_model(input_ids=cont[i:i + batch, :-1], use_cache=True, **cache_kwargs(decode_model, a))
        out.append(torch.cat([a.logits[:, -1:], b.logits], 1).float())
    return torch.cat(out)


@torch.no_grad()
def split_greedy(prefill_model, decode_model, P, new, batch):
    rows = []
    for i in range(0, P.shape[0], batch):
        out = prefill_model(input_ids=P[i:i + batch], use_cache=True)
        toks = [out.logits[:, -1].float().argmax(-1)]
        for _ in range(new - 1):
            out = decode_model(input_ids=toks[-1][:, None], use_cache=True, **cache_kwargs(decode_model, out))
            toks.append(out.logits[:, -1].float().argmax(-1))
        rows.append(torch.stack(toks, 1))
    return torch.cat(rows)


def scores(lp_dense, logits, mine, dense) -> dict:
    lq = F.log_softmax(logits, -1)
    kl = float((lp_dense.exp() * (lp_dense - lq)).sum(-1).mean())
    same = mine == dense
    prefix = torch.where(same.all(1), torch.full((same.shape[0],), same.shape[1]), (~same).float().argmax(1))
    return {"gen_kl": round(kl, 4), "gen_match": round(float(same.float().mean()), 4),
            "gen_prefix": round(float(prefix.float().mean()), 2), "gen_distinct2": round(distinct_n(mine), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path,
                    default=Path("experiments/results/prefill_routers_decode_thresholds_cpu/results.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    args = cli.build_parser().parse_args(["eval", "--device", "cpu"])
    tok, path = runs.load_tokenizer(args)
    ids, _ = runs.heldout(args, tok)
    # generation_quality's prompt choice (seed 0)
    pick = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))[:a.prompts]
    P = ids[pick, :a.prompt_len]
    dense, tok, _ = runs.load_model(args, tok)
    dense.eval()
    cont = greedy_continuations(dense, P, a.new_tokens, a.batch)
    full = torch.cat([P, cont], 1)
    sl = slice(a.prompt_len - 1, a.prompt_len + a.new_tokens - 1)
    with torch.no_grad():
        lp_dense = torch.cat([F.log_softmax(dense(input_ids=full[i:i + a.batch]).logits[:, sl].float(), -1)
                              for i in range(0, full.shape[0], a.batch)])
    out = {"prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "heldout_windows": int(ids.shape[0]), "rows": []}
    for target, (routers_name, fine_name) in PAIRS.items():
        routed = wide.from_pretrained(routers_name, runs.load_model(args, tok)[0]).eval()
        thresh = wide.from_pretrained(fine_name, runs.load_model(args, tok)[0]).eval()
        for name, (pm, dm) in (("thresholds", (thresh, thresh)), ("routers", (routed, routed)),
                               ("routers_prefill_thresholds_decode", (routed, thresh))):
            logits = split_logits(pm, dm, P, cont, a.batch)
            mine = split_greedy(pm, dm, P, a.new_tokens, a.batch)
            row = {"target": target, "variant": name, "prefill": routers_name if pm is routed else fine_name,
                   "decode": routers_name if dm is routed else fine_name,
                   **scores(lp_dense, logits, mine, cont)}
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
