"""Trial: which input decides a tile's mask (issue 20's tile rule, quality only, on the CPU).

The library's tile rule (``--route-tile N``) gives every token of a tile of N positions the
mask its first token's routers pick, so 15 of 16 tokens run groups chosen for another token,
and tile16 costs 1.6x (CPU, 100 steps) to 2.5x (H200, 6.55M tokens) the per-token perplexity.
This trial decides tile k from the mean of tile k-1's router inputs instead (tile 0 keeps its
first token): still causal, since no token's mask depends on its own tile or a later one, and
an average of the recent context might suit the next 16 tokens better than one token does.

The rule is in the library since: ``--tile-source previous`` (``WideConfig.tile_source``), in the
HF path and the engine, prefill and decode; ``tests/test_experiments.py`` checks that it routes
full sequences exactly as this script does, so the results stay reproducible either way.

It runs the ``wide`` command line with the routers' input replaced, for every routed module of a
model with ``route_tile > 1``, by each token's tile source (a function of earlier tokens only);
the library's gather then hands every token of a tile the same decision, and offset
calibration sees the sources, so the realised sparsity lands on the target. Full-sequence
forwards only (calibrate, held-out perplexity): the engine and KV-cache decode do not know the
rule, and a decode step here stops with an error.

    python experiments/tile_source_cpu.py calibrate --steps 100 --batch-size 4 --eval-every 50 \\
        --eval-batches 8 --save-every 0 --threads 1 --ffn-group-size 16 --route-tile 16 --out /tmp/gt/t16f16prev
    python experiments/tile_source_cpu.py eval --routers /tmp/gt/t16f16prev/routers --dense --tasks \\
        --max-eval-sequences 32 --threads 2 --out /tmp/gt/eval_prev
"""

from __future__ import annotations

import sys

import torch

import wide.method.modeling as modeling


def previous_tile_source(x: torch.Tensor, tile: int) -> torch.Tensor:
    """[B, T, H] -> [B, T, H]: each token's router input under the trial's rule, the mean of the
    previous tile's inputs (tile 0: its first token's input)."""
    b, t, h = x.shape
    k = -(-t // tile)
    padded = torch.nn.functional.pad(x, (0, 0, 0, k * tile - t)).view(b, k, tile, h)
    counts = torch.full((k,), float(tile), device=x.device, dtype=x.dtype)
    counts[-1] = t - (k - 1) * tile
    means = padded.sum(2) / counts.view(1, k, 1)
    source = torch.cat([x[:, :1], means[:, :-1]], dim=1)
    return source.repeat_interleave(tile, dim=1)[:, :t]


def install() -> None:
    route = modeling._route_fp32

    def tile_source_route(state, routers, layer, kind, x):
        if state.config.route_tile > 1:
            if state.past_length:
                raise RuntimeError("the tile-source trial runs full-sequence forwards only (no KV-cache decode)")
            x = previous_tile_source(x, state.config.route_tile)
        return route(state, routers, layer, kind, x)

    modeling._route_fp32 = tile_source_route


if __name__ == "__main__":
    from wide.cli import main

    install()
    sys.exit(main(sys.argv[1:]))
