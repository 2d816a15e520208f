"""Next-token sampling and the result of ``wide.generate``: greedy, temperature, top-k, top-p,
and the end-of-sequence bookkeeping. Runs eagerly on the engine's logits, outside any graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["GenerationResult", "sample_logits", "check_sampling", "eos_tensor", "cut_at_eos"]


@dataclass
class GenerationResult:
    """``tokens[i]``: the new token ids of prompt i (up to and including EOS);
    ``texts`` when a tokenizer was given; prefill and per-token decode times in seconds."""

    tokens: list
    texts: Optional[list] = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0


def check_sampling(temperature, top_k, top_p) -> None:
    """Refuse sampling settings that would otherwise fall back silently (a negative temperature
    to greedy, a top-p outside (0, 1] to no filtering)."""
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def sample_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: greedy at temperature 0, else temperature, then
    top-k, then nucleus (top-p) filtering and one multinomial draw per row."""
    if temperature is None or temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_l, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_l, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_l)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def eos_tensor(eos_token_id, device) -> Optional[torch.Tensor]:
    """The end-of-sequence ids (an int or a list of ints) as a tensor on ``device``; None if none."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def cut_at_eos(seqs: list, eos: Optional[torch.Tensor]) -> list:
    """Each token list up to and including its first end-of-sequence id."""
    if eos is None:
        return seqs
    eset = set(eos.tolist())
    return [s[:next((j + 1 for j, t in enumerate(s) if t in eset), len(s))] for s in seqs]
