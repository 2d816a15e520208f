"""Trial: which module's tiles cost the quality (issue 20's tile rule, quality only, on the CPU).

With ``--route-tile 16`` both attention and FFN share one mask per tile of 16 positions, and
that costs about 1.6x the per-token perplexity (CPU, 100 steps, 96 FFN groups). This trial tiles
one kind of module only and lets the other route per token, to see which one the cost comes
from. The kernels care about both (O and down skip (tile, group) blocks in prefill), but FFN
carries 84 % of an 8B model's routable projection MACs, so tiling only the FFN would keep most
of the prefill speed the tiles buy. Measured (experiments/results/tile_modules_cpu): tiles on
attention only cost 1.21x the per-token perplexity, on the FFN only 1.34x, on both 1.59x.

The first argument names the kind that keeps its tiles (``ffn`` or ``attn``); the rest is the
``wide`` command line. The other kind's decisions are neither gathered over the tile nor
weighted by it in offset calibration. Full-sequence forwards only (calibrate, held-out
perplexity).

    python experiments/tile_modules_cpu.py ffn calibrate --steps 100 --batch-size 4 --eval-every 50 \\
        --eval-batches 8 --save-every 0 --threads 1 --ffn-group-size 16 --route-tile 16 --out /tmp/gt/t16ffn
    python experiments/tile_modules_cpu.py ffn eval --routers /tmp/gt/t16ffn/routers --tasks \\
        --max-eval-sequences 32 --threads 2 --out /tmp/gt/eval_t16ffn
"""

from __future__ import annotations

import sys

import wide.method.modeling as modeling
from wide.method.state import _valid_tokens

KINDS = ("attn", "ffn")


def install(tiled_kind: str) -> None:
    if tiled_kind not in KINDS:
        raise SystemExit(f"first argument: the kind that keeps its tiles, one of {KINDS}; got {tiled_kind!r}")
    route, tiled, weights = modeling._route_fp32, modeling._tiled, modeling._decision_weights
    current = {"kind": None}

    def route_fp32(state, routers, layer, kind, x):
        current["kind"] = kind  # the input observers (offset calibration) run inside
        try:
            route(state, routers, layer, kind, x)
        finally:
            current["kind"] = None

    def tiled_one_kind(state, layer, kind, what, values):
        if kind != tiled_kind:
            return values
        if state.past_length:
            raise RuntimeError("the tile-module trial runs full-sequence forwards only (no KV-cache decode)")
        return tiled(state, layer, kind, what, values)

    def weights_one_kind(state, x):
        if current["kind"] is not None and current["kind"] != tiled_kind:
            return _valid_tokens(state, x)
        return weights(state, x)

    modeling._route_fp32, modeling._tiled, modeling._decision_weights = route_fp32, tiled_one_kind, weights_one_kind


if __name__ == "__main__":
    from wide.cli import main

    install(sys.argv[1] if len(sys.argv) > 1 else "")
    del sys.argv[1]  # the records' command then reads as the wide command line it ran
    sys.exit(main(sys.argv[1:]))
