"""What the routers do: per-layer realised sparsity, how often each group fires, how varied
the tokens' masks are, and how much of a reduction-routed GEMM's work their masks let a
prefill tile skip (against independent masks of the same rates).

Collected with the state's ``mask_observers`` during inference-mode forwards, so it sees the
exact masks the model ran with (offsets, static masks and tied decisions included) and only
real tokens (padding excluded).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..base.arch import KINDS
from ..method.offsets import observed_pass
from ..method.sparsity import track_sparsity
from ..method.state import get_state


@torch.no_grad()
def collect_masks(model, batches: Iterable[torch.Tensor]) -> dict:
    """(layer, kind) -> bool [tokens, groups] execute masks of every valid token."""
    state = get_state(model)
    masks: dict = {}

    def observe(layer, kind, mask, valid):
        keep = valid.flatten().bool()
        masks.setdefault((layer, kind), []).append(mask.flatten(0, -2)[keep].bool().cpu())

    observed_pass(model, batches, state.mask_observers, observe)
    return {k: torch.cat(v) for k, v in masks.items()}


def _entropy_bits(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log2(c / n) for c in counts.values()) if n else 0.0


# Row-tile heights of the reduction-routed GEMM (gemm_k) in prefill.
TILE_ROWS = (64, 128)


def tile_skip(mask: torch.Tensor, block_m: int, order: str = "tokens") -> float:
    """Share of (tile of ``block_m`` tokens, group) blocks in which no token runs the group:
    the work a reduction-routed GEMM (O, down) can skip in prefill, where an output tile's
    rows are fixed for the whole reduction. ``order``: "tokens" (sequence order) or "sorted"
    (tokens sorted by mask pattern first, as gemm_k does for few groups). Whole tiles only."""
    T, G = mask.shape
    n = (T // block_m) * block_m
    if n == 0:
        return float("nan")
    m = mask.bool()
    if order == "sorted":
        import numpy as np

        keys = m.to(torch.uint8).numpy()
        m = m[torch.from_numpy(np.lexsort(keys.T[::-1].copy()))]
    elif order != "tokens":
        raise ValueError(f"order must be 'tokens' or 'sorted', got {order!r}")
    used = m[:n].view(n // block_m, block_m, G).any(1)
    return float(1.0 - used.float().mean())


def tile_skip_iid(mask: torch.Tensor, block_m: int) -> float:
    """:func:`tile_skip` expected if each group fired independently per token at its observed
    rate: the baseline that says whether the routers' masks are correlated across tokens."""
    p = mask.float().mean(0)
    return float(((1.0 - p) ** block_m).mean())


def summarize(model, masks: dict, top: int = 5) -> dict:
    """JSON-ready analysis of collected masks."""
    state = get_state(model)
    geo = state.geometry
    L = geo.dims.num_layers
    out: dict = {"num_layers": L, "groups": {k: geo.groups(k) for k in KINDS},
                 "tokens": None, "layers": {k: [None] * L for k in KINDS}}
    for kind in KINDS:
        for layer in range(L):
            m = masks.get((layer, kind))
            if m is None:
                continue
            out["tokens"] = int(m.shape[0])
            patterns = Counter("".join("1" if b else "0" for b in row) for row in m.tolist())
            out["layers"][kind][layer] = {
                "sparsity": float(1.0 - m.float().mean()),
                "fire_rate": m.float().mean(0).tolist(),  # share of tokens that run each group
                "distinct_masks": len(patterns),
                "possible_masks": 2 ** m.shape[1] if m.shape[1] <= 62 else None,
                "mask_entropy_bits": _entropy_bits(patterns),
                "top_masks": [{"mask": p, "share": c / m.shape[0]} for p, c in patterns.most_common(top)],
                "groups_run_hist": torch.bincount(m.sum(1), minlength=m.shape[1] + 1).tolist(),
                "tile_skip": {str(bm): {"tokens": tile_skip(m, bm), "sorted": tile_skip(m, bm, "sorted"),
                                        "iid": tile_skip_iid(m, bm)} for bm in TILE_ROWS},
            }
    # How many different whole-model routes tokens take (all layers and modules together).
    keys = sorted(masks)
    if keys:
        whole = torch.cat([masks[k] for k in keys], dim=1)
        out["distinct_model_masks"] = len({bytes(r) for r in whole.to(torch.uint8).numpy()})
    with_rates = [v["sparsity"] for k in KINDS for v in out["layers"][k] if v]
    out["mean_layer_sparsity"] = sum(with_rates) / len(with_rates) if with_rates else None
    # Mean over layers of the skippable (tile, group) share, per module and tile height.
    out["tile_skip"] = {
        k: {str(bm): {o: _mean([v["tile_skip"][str(bm)][o] for v in out["layers"][k] if v])
                      for o in ("tokens", "sorted", "iid")} for bm in TILE_ROWS}
        for k in KINDS if any(out["layers"][k])}
    return out


def _mean(xs):
    xs = [x for x in xs if x == x]  # drop NaN (fewer tokens than a tile)
    return sum(xs) / len(xs) if xs else None


def analyze(model, batches: Iterable[torch.Tensor], out_stem=None, *, title: Optional[str] = None) -> dict:
    """Run ``batches`` through the model, summarise the routing, and if ``out_stem`` is given
    write ``OUT.json`` and a heat map ``OUT.png``."""
    batches = list(batches)
    with track_sparsity(model) as tracker:
        masks = collect_masks(model, batches)
    res = summarize(model, masks)
    sp = tracker.summary()
    res["flop_sparsity"] = float(sp.flop_rate)
    res["group_sparsity"] = float(sp.group_rate)
    if out_stem is not None:
        out_stem = Path(out_stem)
        out_stem.parent.mkdir(parents=True, exist_ok=True)
        # the stem as given: with_suffix would write run.json for the stem run.v1_analysis
        json_file, png_file = (out_stem.parent / f"{out_stem.name}{ext}" for ext in (".json", ".png"))
        json_file.write_text(json.dumps(res, indent=1))
        plot(res, png_file, title=title)
        res["files"] = [str(json_file), str(png_file)]
    return res


def plot(res: dict, path, title: Optional[str] = None) -> None:
    """Heat maps of group fire rates (layer x group) per module, per-layer sparsity, and
    distinct masks per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    L = res["num_layers"]
    kinds = [k for k in KINDS if any(res["layers"][k])]
    fig, axes = plt.subplots(1, len(kinds) + 2, figsize=(4 * len(kinds) + 9, max(4, 0.22 * L + 2)),
                             gridspec_kw={"width_ratios": [max(2, res["groups"][k]) ** 0.5 for k in kinds] + [1.6, 1.6]})
    layers = np.arange(L)
    for ax, kind in zip(axes, kinds):
        grid = np.full((L, res["groups"][kind]), np.nan)
        for i, v in enumerate(res["layers"][kind]):
            if v:
                grid[i] = v["fire_rate"]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{kind}: share of tokens running each group")
        ax.set_xlabel("group")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.05)
    ax = axes[len(kinds)]
    for kind in kinds:
        ax.plot([v["sparsity"] if v else np.nan for v in res["layers"][kind]], layers, marker="o", ms=3, label=kind)
    ax.invert_yaxis()
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("realised sparsity")
    ax.set_title("per-layer sparsity")
    ax.legend()
    ax = axes[len(kinds) + 1]
    for kind in kinds:
        ax.plot([v["distinct_masks"] if v else np.nan for v in res["layers"][kind]], layers, marker="o", ms=3,
                label=kind)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("distinct masks over tokens")
    ax.set_title("mask diversity")
    ax.legend()
    fig.suptitle(title or f"routing over {res['tokens']} tokens: FLOP sparsity {res['flop_sparsity']:.3f}, "
                          f"group sparsity {res['group_sparsity']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["collect_masks", "summarize", "analyze", "plot", "tile_skip", "tile_skip_iid"]
