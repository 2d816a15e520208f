"""Trial: routers whose masks a decode batch can share (issue 20, "trainable if that helps").
Landed as ``wide calibrate --union-coef C --union-tokens K`` (the same loss term); this script
stays as the one that made experiments/results/union_penalty_{cpu,gpu} and for ``measure``.

Per-token routers at 50 % pick groups independently enough that the union over a batch of
unrelated tokens covers nearly every group (SmolLM2's routers: 93 % of FFN groups at 8 tokens,
99.5 % at 32), so batched decode reads every weight byte, and the batch-shared rule, which caps
the union, costs 2.0x the perplexity at batch 8 (bench/results/routing_quality). This trial adds
to stage 1's loss a smooth proxy of that union: for each module, with f_g the share of the
batch's tokens that run group g (the straight-through masks, so f_g carries gradients), the
expected union of k independent tokens, mean_g 1 - (1 - f_g)^k, times a coefficient. At a fixed
per-token rate it is lowest when groups are either common or rare; at its minimum every token
runs the same groups, which is static pruning. The question is where between the two the
perplexity cost stays small.

    python experiments/union_penalty_cpu.py COEF K calibrate --steps 100 --batch-size 4 --eval-every 50 \\
        --eval-batches 8 --save-every 0 --threads 1 --ffn-group-size 16 --out /tmp/gu/c1
    python experiments/union_penalty_cpu.py measure ROUTERS [ROUTERS ...]   # unions on held-out text

``measure`` reads 32 held-out windows of 256 tokens and reports, per router set, the FLOP-weighted
share of the routable weights that the union of k random tokens of those windows runs (k = 1,
8, 32; 200 draws each); k = 1 is the per-token rate.
"""

from __future__ import annotations

import json
import sys

import torch

import wide.training.train as train
from wide.base.arch import KINDS
from wide.method.sparsity import union_penalty
from wide.method.state import get_state


# Mean over routed modules of mean_g 1 - (1 - f_g)^k (f_g: share of tokens running g): the
# library's since the term landed as ``--union-coef``.
union_proxy = union_penalty


def union_share(masks: torch.Tensor, k: int, draws: int, gen: torch.Generator) -> torch.Tensor:
    """[G]: how often each group is in the union of k random rows of ``masks`` [N, G] (draws
    draws), i.e. what a decode batch of k unrelated tokens runs."""
    picks = torch.stack([torch.randperm(masks.shape[0], generator=gen)[:k] for _ in range(draws)])  # [draws, k]
    return masks[picks].any(1).float().mean(0)


def install(coef: float, k: int) -> None:
    forward_sparsity, penalty = train.forward_sparsity, train.sparsity_penalty
    seen = {}

    def sparsity(model):
        seen["model"] = model
        return forward_sparsity(model)

    def penalty_with_union(sp, config):
        # divided by the sparsity coefficient: train.py multiplies the penalty by it
        return penalty(sp, config) + coef / max(config.sparsity_coef, 1e-9) * union_proxy(seen["model"], k)

    train.forward_sparsity, train.sparsity_penalty = sparsity, penalty_with_union


@torch.no_grad()
def measure(routers: list, windows: int = 32, draws: int = 200) -> list:
    from transformers import AutoTokenizer

    import wide
    from wide.evaluation.analysis import collect_masks
    from wide.data import fetch_default_model, load_documents, pack_documents

    tok = AutoTokenizer.from_pretrained(fetch_default_model())
    ids = pack_documents(load_documents("wiki", split="heldout"), tok, 256)[:windows]
    out = []
    for path in routers:
        model = wide.from_pretrained(path)
        model.eval()
        masks = collect_masks(model, [ids[i:i + 8] for i in range(0, len(ids), 8)])
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        geo = get_state(model).geometry
        macs = {"attn": 2 * cfg.hidden_size * head_dim * cfg.num_attention_heads / geo.attn_groups,
                "ffn": 3 * cfg.hidden_size * cfg.intermediate_size / geo.ffn_groups}  # per group
        g = torch.Generator().manual_seed(0)
        row = {"routers": str(path)}
        for k in (1, 8, 32):
            used = total = 0.0
            by_kind = {kind: [0.0, 0.0] for kind in KINDS}
            for (layer, kind), m in masks.items():
                union = union_share(m, k, draws, g)
                used += float(union.sum()) * macs[kind]
                total += m.shape[1] * macs[kind]
                by_kind[kind][0] += float(union.sum())
                by_kind[kind][1] += m.shape[1]
            row[f"union{k}"] = used / total
            for kind, (u, t) in by_kind.items():
                row[f"union{k}_{kind}"] = u / t
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "measure":
        measure(sys.argv[2:])
        sys.exit(0)
    from wide.cli import main

    coef, k = float(sys.argv[1]), int(sys.argv[2])
    install(coef, k)
    del sys.argv[1:3]  # the records' command then reads as the wide command line it ran
    sys.exit(main(sys.argv[1:]))
