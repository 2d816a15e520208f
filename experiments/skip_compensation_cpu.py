"""Trial: add back what a skipped group adds on average (issue 19's plateau at 25 % and 50 %).

A routed module drops the skipped groups' contributions c_g = h_g W_g^T (h: the input of O or
down, W_g: the projection's columns of group g) to the residual stream entirely. Static
structured pruning has long replaced a removed channel by its mean instead (FLAP's bias
compensation): the output keeps the part of c_g that does not depend on the token. Here each
(module, group) gets one vector C_g [d_model], fitted on calibration text with the routers'
masks, and a token that skips g adds C_g: out = sum_{g run} c_g + sum_{g skipped} C_g. In the
kernels that is the routed projection plus a bias (sum_g C_g) minus m @ C, a [T, G] x [G, d]
product: for Llama-3.1-8B's down (112 groups) under 1 % of the projection's MACs.

    router       the shipped routers as they are
    comp         C_g = the mean of c_g over the calibration tokens that skip g (the conditional
                 mean: tokens that skip a group tend to be those where it adds little)
    comp-all     C_g = the mean of c_g over every calibration token

A ``:attn`` or ``:ffn`` suffix compensates that kind only. The first position of each window
(its outputs are often a hundred times the others', the attention sink) is left out of the
fit. Perplexity over the first ``--windows`` held-out windows (those of oracle_masks_cpu.py),
C fitted on ``--fit-windows`` windows of the calibration split, dense in the same run, paired
standard errors over windows against the routers.

    python experiments/skip_compensation_cpu.py --routers smollm2-135m-50 --modes router,comp,comp-all,comp:ffn,comp:attn \\
        --windows 64 --fit-windows 128 --threads 2 --out experiments/results/skip_compensation_cpu/smollm2-135m-50

Fitted after the fact, C shifts what every later router reads (they read the residual stream),
which routers trained with C = 0 never saw. So C can also be trained with the routers in stage 1:
a first argument that names a wide subcommand (``calibrate``, ``eval``, ``recover``, ...) runs it
with every layer's routers holding C (zeros at the start, saved and loaded with the routers,
trained by the same AdamW; ``bench/quality_routing.sh``'s part ``comp`` runs a variant so):

    python experiments/skip_compensation_cpu.py calibrate --steps 100 --batch-size 4 --eval-every 50 \\
        --eval-batches 8 --save-every 0 --threads 1 --ffn-group-size 16 --out /tmp/sc/trained
    python experiments/skip_compensation_cpu.py eval --routers /tmp/sc/trained/routers ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from oracle_masks_cpu import (add_ratios, calibration_windows, heldout_windows, perplexity, run_with_hooks,
                              vs_router_cell, write_results)
from wide.base import arch
from wide.base.arch import KINDS
from wide.method.modeling import routing_disabled
from wide.method.state import get_state

MODES = ("router", "comp", "comp-all")


def parse_mode(text: str) -> tuple:
    """'comp:ffn' -> ('comp', ('ffn',))."""
    name, _, kind = text.partition(":")
    if name not in MODES and name != "dense":
        raise SystemExit(f"unknown mode {text!r}; modes: dense, {', '.join(MODES)} (with :attn or :ffn)")
    if kind and kind not in KINDS:
        raise SystemExit(f"mode {text!r}: the suffix names a kind, one of {KINDS}")
    return name, ((kind,) if kind else KINDS)


def group_means(h_sum: torch.Tensor, count: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[G, out]: (h_sum_g / count_g) W_g^T, the mean contribution of group g over the counted
    tokens, from the summed inputs h_sum [G, cols] (a group never counted gets zeros)."""
    groups = h_sum.shape[0]
    mean_h = h_sum / count.clamp_min(1).unsqueeze(-1)
    w = weight.detach().float().view(weight.shape[0], groups, -1)
    return torch.einsum("gc,ogc->go", mean_h.double(), w.double()).float()


@torch.no_grad()
def fit(model, ids: torch.Tensor, batch_size: int = 8, conditional: bool = True, skip_first: bool = True) -> dict:
    """(layer, kind) -> C [G, out] (see the module docstring), from ``ids`` run with the routers."""
    state = get_state(model)
    spec = arch.spec_for(model)
    sums, hooks = {}, []
    for i, layer in enumerate(arch.decoder_layers(model)):
        for kind in KINDS:
            proj = arch.reduction_projection(layer, spec, kind)

            def add(mod, args, key=(i, kind)):
                mask = state.masks.get(key)
                if mask is None:
                    return
                h = args[0].float()
                groups = mask.shape[-1]
                counted = (1 - mask.float()) if conditional else torch.ones_like(mask, dtype=torch.float)
                if skip_first:
                    counted = counted.clone()
                    counted[:, 0] = 0
                hg = h.view(*h.shape[:-1], groups, -1)
                acc = sums.setdefault(key, [torch.zeros(groups, hg.shape[-1], dtype=torch.float64, device=h.device),
                                            torch.zeros(groups, dtype=torch.float64, device=h.device), mod.weight])
                acc[0] += torch.einsum("btg,btgc->gc", counted, hg).double()
                acc[1] += counted.sum((0, 1)).double()
            # prepend: before wide's own pre-hook multiplies h by the mask, so skipped groups' h is there
            hooks.append(proj.register_forward_pre_hook(add, prepend=True))
    run_with_hooks(model, ids, batch_size, hooks, "fit")
    return {key: group_means(h_sum, count, weight) for key, (h_sum, count, weight) in sums.items()}


def adds_skipped(state, key: tuple, c: torch.Tensor):
    """A forward hook for the projection of ``key`` that adds (1 - m) @ ``c`` [G, out] to its output."""
    def add(mod, args, out):
        mask = state.masks.get(key)
        if mask is None:  # a dense forward
            return out
        return out + ((1 - mask.float()) @ c.to(mask.device)).to(out.dtype)
    return add


def install_trainable() -> None:
    """Makes wide.method.modeling.install_hooks give each layer's routers a trainable C per kind
    (``routers.comp[kind]``, [G, out], zeros) and hook it onto the reduction projections."""
    import wide.method.modeling as modeling

    original = modeling.install_hooks

    def install_hooks(model) -> None:
        original(model)
        state = model.wide_state
        spec = arch.spec_for(model)
        for i, layer in enumerate(arch.decoder_layers(model)):
            routers = model.wide_routers[i]
            projs = {kind: arch.reduction_projection(layer, spec, kind) for kind in KINDS}
            if not hasattr(routers, "comp"):
                device = next(routers.parameters()).device
                routers.comp = torch.nn.ParameterDict({
                    kind: torch.nn.Parameter(torch.zeros(state.geometry.groups(kind), proj.weight.shape[0], device=device))
                    for kind, proj in projs.items()})
            for kind, proj in projs.items():
                # in state.handles: removed and added again with wide's own hooks
                state.handles.append(proj.register_forward_hook(adds_skipped(state, (i, kind), routers.comp[kind])))

    modeling.install_hooks = install_hooks


class Compensation:
    """Forward hooks that add (1 - m) @ C to each compensated projection's output."""

    def __init__(self, model, means: dict, kinds=KINDS):
        state = get_state(model)
        spec = arch.spec_for(model)
        self.handles = []
        for i, layer in enumerate(arch.decoder_layers(model)):
            for kind in kinds:
                if (i, kind) not in means:
                    continue
                proj = arch.reduction_projection(layer, spec, kind)
                self.handles.append(proj.register_forward_hook(adds_skipped(state, (i, kind), means[(i, kind)])))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def run(routers: str, modes: list, windows: int, fit_windows: int, batch_size: int = 8, device: str = "cpu") -> list:
    from transformers import AutoTokenizer

    import wide
    from wide.data import fetch_default_model

    tok = AutoTokenizer.from_pretrained(fetch_default_model())
    ids = heldout_windows(tok, windows).to(device)
    model = wide.from_pretrained(routers).to(device)
    model.eval()
    fitted = {name for name, _ in map(parse_mode, modes)} & {"comp", "comp-all"}
    fit_ids = calibration_windows(tok, fit_windows).to(device) if fitted else None
    means = {name: fit(model, fit_ids, batch_size, conditional=name == "comp") for name in sorted(fitted)}
    rows = []
    for text in ["dense"] + [m for m in modes if m != "dense"]:
        name, kinds = parse_mode(text)
        t0 = time.perf_counter()
        if name == "dense":
            with routing_disabled(model):
                res = perplexity(model, ids, batch_size)
        else:
            comp = Compensation(model, means[name], kinds) if name in means else None
            try:
                res = perplexity(model, ids, batch_size)
            finally:
                if comp is not None:
                    comp.remove()
        row = {"routers": routers, "mode": text, "ppl": res["ppl"], "window_nll": res["window_nll"],
               "tokens": res["tokens"], "windows": int(ids.shape[0]), "fit_windows": fit_windows,
               "wall_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "window_nll"}), flush=True)
    return add_ratios(rows, ids.shape[1] - 1)


def markdown(rows: list, command: str) -> str:
    lines = [f"Routers `{rows[0]['routers']}`, {rows[0]['windows']} held-out windows of 256 tokens "
             f"({rows[0]['tokens']} predicted), C fitted on {rows[0]['fit_windows']} calibration windows.", "",
             f"Command: `{command}`", "",
             "| mode | ppl | vs dense | vs routers (± SE) |", "|---|---|---|---|"]
    for r in rows:
        vr = vs_router_cell(r, 3)
        lines.append(f"| {r['mode']} | {r['ppl']:.2f} | {r['vs_dense']:.2f}x | {vr} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):  # a wide subcommand: calibrate, eval, recover, ...
        from wide.cli import main as wide_main

        install_trainable()
        return wide_main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", required=True, help="a shipped name or a router directory")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; see the module docstring")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--fit-windows", type=int, default=128, help="calibration windows C is fitted on")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="stem: writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        parse_mode(m)  # refuse a typo before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.routers, modes, args.windows, args.fit_windows, args.batch_size, args.device)
    write_results(args.out, argv, "skip_compensation_cpu.py", rows, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
