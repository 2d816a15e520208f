"""Trial: batched decode speed of per-token masks whose batch union is small, as routers trained
with ``--union-coef`` make them (experiments/results/union_penalty_gpu), on the e2e benchmark's
shapes and random routers.

The e2e benchmark's random routers choose groups independently per token, so a decode batch of 8
or 32 runs nearly every group and reads every weight. Trained union routers instead make some groups
common and others rare. This gives each router the same kind of spread: group g of a module
(in a random order per module) gets ``strength x z_g`` added to its gap (z_g evenly spaced from
+1 to -1; the router's exec/skip biases). The e2e benchmark then calibrates the offsets per
module to the target, so each token still runs the target share of groups. ``strength`` is found
per kind (attention, FFN) by bisection: the mean over modules of the union of 32 random tokens
of a random prompt must hit ``--union-attn`` / ``--union-ffn`` (union_penalty_gpu's coef-2
routers: 0.62 / 0.83). Every e2e record then reports the weight bytes its decode read, and
the timings against the dense engine of the same run.

    python experiments/union_speed.py --union-attn 0.62 --union-ffn 0.83 -- --sparsities 0.5 \\
        --prompt-lens 1024 --batches 1,8,32 --no-hf --reps 3 --decode-steps 16 --name e2e_union --out-dir OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import wide
from wide.base.arch import KINDS
from wide.benchmarks import e2e
from wide.method.modeling import recording_masks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from union_penalty_cpu import union_share  # noqa: E402  (the trial's measure draws unions the same way)


def _routers(model, kind):
    return [lr.router(kind) for lr in model.wide_routers if lr.router(kind) is not None]


def union_of(model, ids: torch.Tensor, k: int = 32, draws: int = 64) -> dict:
    """kind -> mean over modules of the share of groups that k random tokens of ``ids`` run
    together (the deterministic inference masks)."""
    with torch.no_grad(), recording_masks(model) as seen:
        model(input_ids=ids)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for kind in KINDS:
        shares = []
        for (_, kd), masks in seen.items():
            if kd != kind:
                continue
            m = torch.cat([x.flatten(0, -2) for x in masks]).cpu()
            shares.append(union_share(m, k, draws, gen).mean())
        if shares:
            out[kind] = float(torch.stack(shares).mean())
    return out


def spread(model, strength: dict, base: dict, order: dict) -> None:
    """Set each router's exec/skip biases to ``base`` plus ``strength[kind] x z_g / 2`` each way."""
    with torch.no_grad():
        for kind, s in strength.items():
            for i, r in enumerate(_routers(model, kind)):
                z = torch.linspace(1.0, -1.0, r.num_groups, device=r.up.bias.device)[order[kind][i]]
                b = base[kind][i].clone().view(r.num_groups, 2)
                b[:, 0] += s * z / 2
                b[:, 1] -= s * z / 2
                r.up.bias.copy_(b.flatten())


def install(targets: dict, k: int = 32, steps: int = 12) -> dict:
    """Wrap the e2e benchmark's offset calibration: first find the spread that gives ``targets``
    (kind -> union of k tokens), then calibrate as before. Returns what was found, filled in
    as the benchmark runs."""
    real = wide.calibrate_offsets
    found: dict = {}

    def calibrate(model, batches, target=None, mode="global", rounds=2):
        batches = list(batches)
        kinds = [kd for kd in targets if _routers(model, kd)]
        gen = torch.Generator().manual_seed(1)
        base = {kd: [r.up.bias.detach().clone() for r in _routers(model, kd)] for kd in kinds}
        order = {kd: [torch.randperm(r.num_groups, generator=gen) for r in _routers(model, kd)] for kd in kinds}
        scale = _gap_std(model, batches[0], kinds)  # strength in units of each kind's gap spread
        lo = {kd: 0.0 for kd in kinds}
        hi = {kd: 16.0 for kd in kinds}
        for _ in range(steps):
            mid = {kd: (lo[kd] + hi[kd]) / 2 for kd in kinds}
            spread(model, {kd: mid[kd] * scale[kd] for kd in kinds}, base, order)
            real(model, batches, target=target, mode=mode, rounds=rounds)
            got = union_of(model, batches[0], k)
            for kd in kinds:
                if got[kd] > targets[kd]:
                    lo[kd] = mid[kd]
                else:
                    hi[kd] = mid[kd]
        spread(model, {kd: hi[kd] * scale[kd] for kd in kinds}, base, order)
        out = real(model, batches, target=target, mode=mode, rounds=rounds)
        found[target] = {"strength_in_gap_std": hi, "union": union_of(model, batches[0], k), "targets": targets}
        print(f"[union_speed] target {target}: {found[target]}", flush=True)
        return out

    wide.calibrate_offsets = calibrate
    return found


def _gap_std(model, ids, kinds) -> dict:
    """kind -> the mean over modules of the std of the routers' gaps on ``ids``."""
    state = wide.method.state.get_state(model)
    stds: dict = {kd: [] for kd in kinds}

    def observe(layer, kind, x):
        r = model.wide_routers[layer].router(kind)
        if r is not None and kind in stds:
            stds[kind].append(float(r.gap(x).float().std()))

    wide.method.offsets.observed_pass(model, [ids], state.input_observers, observe)
    return {kd: sum(v) / len(v) for kd, v in stds.items()}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--union-attn", type=float, default=0.62)
    ap.add_argument("--union-ffn", type=float, default=0.83)
    ap.add_argument("--tokens", type=int, default=32, help="the union of this many random tokens")
    ap.add_argument("--record", default=None, help="write the spreads found and their unions to this JSON file")
    a = ap.parse_args(own)
    found = install({"attn": a.union_attn, "ffn": a.union_ffn}, k=a.tokens)
    rc = e2e.main(rest)
    if a.record:
        import json

        Path(a.record).write_text(json.dumps({"command": "python experiments/union_speed.py " + " ".join(argv),
                                              "found": {str(k): v for k, v in found.items()}}, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
