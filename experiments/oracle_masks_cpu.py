"""Trial: how good can a mask of this granularity and budget be? (issue 19's plateau, issue 20's tile cost)

The routers decide from a module's input, before it runs. An oracle decides after: it sees the
reduction projection's input h (attention: the group's heads' outputs before O; FFN:
act(gate) * up before down) and knows what each group would add to the residual stream,
c_g = h_g W_g^T (W_g: the projection's columns of group g). Keeping the groups of largest
||c_g|| is the greedy, per-layer best choice for one token at a given count. It is not a
bound on what training could reach (a router trained end to end might pick for the loss and
not for the norm, and a later layer's choice can make up for an earlier one), but it is what a
router of this budget would do if it predicted the groups perfectly, so the distance between
the shipped routers and it splits their perplexity cost into the choice (router vs oracle) and
the budget and granularity themselves (oracle vs dense).

Every mode keeps the shipped routers' budget: the same number of groups per (token, module)
as the routers chose on that token, unless the mode says otherwise.

    router          the shipped routers as they are
    random          the routers' count per (token, module), groups drawn at random
    oracle          the routers' count, the groups of largest ||c_g||
    oracle-act      the routers' count, the groups of largest ||h_g|| (ignores W: a cheaper proxy)
    oracle-kl       the routers' count, the groups that bring the output distribution closest
                    to dense's to first order: largest -c_g . dKL/d(out), KL(dense || routed)
                    summed over the window, its gradient taken in a first pass with the
                    routers' masks. It reads no label, and dense's distribution at a position
                    depends on no later token, so a router that ran the dense model could in
                    principle compute it
    oracle-ce       as oracle-kl with the held-out loss itself (the labels): it steers each token
                    toward its own answer, so it is a leak to show, not a reference for a router
    oracle-flat     every token of a module the module's mean count (rounded): does the
                    routers' per-token count matter?
    oracle-pool     the module's whole count over the batch, given to the (token, group) pairs of
                    largest ||c_g||: counts free to move between tokens
    oracle-tileN    one mask per tile of N consecutive positions: the groups of largest
                    sum over the tile of ||c_g||^2, as many as the tile's mean count (rounded).
                    It sees the whole tile, later tokens included, so it is what no causal tile
                    rule can beat at this count (issue 20's tile quality)

    probeR          the routers' count, the groups of largest predicted log ||c_g||^2, predicted
                    by a linear map of rank R (a number; ``probe`` alone: full rank) from the
                    module's router input, fitted by least squares on ``--probe-windows``
                    windows of the calibration text with the routers' masks. The routers
                    themselves are linear maps of rank 16 (wide.method.routers), so probe16 is in their
                    function class: if it gets near the oracle, a router could too
    gate            FFN only: the routers' count, the groups of largest ||SiLU(gate)_g||. Realisable
                    without an oracle: run gate_proj densely first, then up and down on the
                    chosen groups only (gated-activation sparsity, as CATS does with a threshold)
    gate-flops      as gate, with as many groups skipped as spends the routers' FLOPs although
                    gate runs in full: a skipped group then saves 2 of its 3 projections, so
                    1.5x the routers' skipped groups per token (FLOP sparsity counts it so)
    mlpR            as probeR with Linear(H, R) -> SiLU -> Linear(R, G) trained by Adam on the same
                    data: a router of rank R with a nonlinearity between its two linears
    lowrankR        FFN only: the routers' count, the groups of largest ||c_g|| computed from a
                    rank-R copy of the module (truncated SVD of gate_proj and up_proj, down_proj
                    exact): SiLU(x G_R) * (x U_R) in place of h. "A router that sees more of the
                    module": no fitting, and its 2R(H + F) multiply-adds per token (H hidden, F
                    FFN width) count against the FLOP sparsity as the groups they would buy
                    (scoring the groups from the copy, ~1 % more, is not counted)

The ``agree`` column is the share of the kept groups that the oracle would also keep at that
count (per token, per module, in the same forward); ``energy`` is, averaged over (token, module)
pairs that run any group, the sum of ||c_g||^2 over the kept groups over that sum over the
oracle's (1.0 for the oracle, by construction). Per token, because a few tokens (the first of a
window, among others) carry FFN outputs a hundred times the others' and would outweigh the rest.

A ``:attn`` or ``:ffn`` suffix applies the mode to that kind only; the other keeps the
routers' masks (``oracle:ffn`` says how much of the gap is the FFN routers'); ``@FIRST-LAST``
after that applies it to those decoder layers only (``oracle:ffn@0-9``).

    python experiments/oracle_masks_cpu.py --routers smollm2-135m-50 \\
        --modes router,random,oracle,oracle-act,oracle-flat,oracle-pool,oracle:attn,oracle:ffn,oracle-tile16 \\
        --windows 64 --threads 2 --out experiments/results/oracle_masks_cpu/smollm2-135m-50
    python experiments/oracle_masks_cpu.py --routers smollm2-135m-25 --modes router,oracle:ffn,probe16:ffn,mlp16:ffn \\
        --windows 64 --probe-windows 128 --out experiments/results/oracle_masks_cpu/probes-25

Perplexity over the first ``--windows`` held-out windows of 256 tokens (wide eval's held-out
text), dense in the same run; the FLOP-weighted sparsity each mode realised is in the table.
Every mode reads the same windows, so "vs routers" carries a paired standard error over
windows (the JSON keeps each window's summed loss).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from wide.base import arch
from wide.base.arch import KINDS
from wide.method.modeling import routing_disabled
from wide.method.state import get_state

MODES = ("router", "random", "oracle", "oracle-act", "oracle-kl", "oracle-ce", "oracle-flat", "oracle-pool",
         "gate", "gate-flops")
GATED = ("gate", "gate-flops")  # FFN only: what the module's gate projection says, after it ran
FIRST_ORDER = ("oracle-kl", "oracle-ce")
PROBES = ("probe", "mlp")
LOWRANK = "lowrank"


def split_layers(text: str) -> tuple:
    """'oracle:ffn@10-19' -> ('oracle:ffn', range(10, 20)); without '@', (text, None)."""
    core, at, span = text.partition("@")
    if not at:
        return text, None
    lo, dash, hi = span.partition("-")
    if not (lo.isdigit() and dash and hi.isdigit()) or int(hi) < int(lo):
        raise SystemExit(f"mode {text!r}: '@FIRST-LAST' names a layer range, e.g. @0-9")
    return core, range(int(lo), int(hi) + 1)


def parse_mode(text: str) -> tuple:
    """'oracle-tile16:ffn' -> ('oracle-tile', 16, ('ffn',)); checks the name."""
    name, _, kind = text.partition(":")
    kinds = (kind,) if kind else KINDS
    if kind and kind not in KINDS:
        raise SystemExit(f"mode {text!r}: the suffix names a kind, one of {KINDS}")
    tile = 0
    if name.startswith("probe"):
        digits = name[len("probe"):]
        if digits and (not digits.isdigit() or int(digits) < 1):
            raise SystemExit(f"mode {text!r}: probeR needs a rank R >= 1 (or none: full rank)")
        return "probe", int(digits or 0), kinds
    if name.startswith(LOWRANK):
        digits = name[len(LOWRANK):]
        if not digits.isdigit() or int(digits) < 1:
            raise SystemExit(f"mode {text!r}: lowrankR needs a rank R >= 1")
        if kind == "attn":
            raise SystemExit(f"mode {text!r}: lowrankR chooses FFN groups only")
        return LOWRANK, int(digits), ("ffn",)
    if name.startswith("mlp"):
        digits = name[len("mlp"):]
        if not digits.isdigit() or int(digits) < 1:
            raise SystemExit(f"mode {text!r}: mlpR needs a width R >= 1")
        return "mlp", int(digits), kinds
    if name.startswith("oracle-tile"):
        digits = name[len("oracle-tile"):]
        if not digits.isdigit() or int(digits) < 1:
            raise SystemExit(f"mode {text!r}: oracle-tileN needs a tile size N >= 1")
        name, tile = "oracle-tile", int(digits)
    elif name in GATED:
        if kind == "attn":
            raise SystemExit(f"mode {text!r}: the gate modes choose FFN groups only")
        kinds = ("ffn",)
    elif name not in MODES and name != "dense":
        raise SystemExit(f"unknown mode {text!r}; modes: dense, {', '.join(MODES)}, oracle-tileN, probeR, mlpR, "
                         "lowrankR")
    return name, tile, kinds


def top_by_count(score: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Bool mask [..., G]: each row's ``count`` groups of largest score (ties to the lower index)."""
    order = score.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)
    return rank < count.unsqueeze(-1)


def contribution_gram(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """[G, cols, cols] Gram matrices W_g^T W_g of a projection's input column groups, so that
    ||h_g W_g^T||^2 = h_g Gram_g h_g^T without forming the [.., G, out] contributions."""
    w = weight.detach().float().view(weight.shape[0], groups, -1)
    return torch.einsum("ogc,ogd->gcd", w, w)


def contribution_sq(h: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """[..., G] squared norms of what each group adds to the projection's output."""
    hg = h.float().view(*h.shape[:-1], gram.shape[0], gram.shape[1])
    return torch.einsum("...gc,gcd,...gd->...g", hg, gram, hg).clamp_min(0)


def low_rank(weight: torch.Tensor, rank: int) -> tuple:
    """(A [out, R], B [R, in]) with A @ B the best rank-R approximation of ``weight`` (truncated
    SVD, float32), so that x @ weight.T ~ (x @ B.T) @ A.T at R (in + out) multiply-adds."""
    u, s, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
    r = min(rank, s.numel())
    return u[:, :r] * s[:r], vh[:r]


def choose(mode: str, tile: int, h: torch.Tensor, score: torch.Tensor, routed: torch.Tensor,
           gen: torch.Generator) -> torch.Tensor:
    """The mode's bool mask [B, T, G] from the projection input ``h`` [B, T, G*cols], its
    groups' :func:`contribution_sq` ``score`` [B, T, G] and the routers' mask ``routed``
    [B, T, G] (whose per-token counts are the budget)."""
    count = routed.bool().sum(-1)
    if mode == "router":
        return routed.bool()
    if mode == "random":
        return top_by_count(torch.rand(routed.shape, generator=gen).to(h.device), count)
    if mode == "oracle-act":
        hg = h.float().view(*h.shape[:-1], routed.shape[-1], -1)
        return top_by_count(hg.square().sum(-1), count)
    if mode == "oracle":
        return top_by_count(score, count)
    if mode == "oracle-flat":
        return top_by_count(score, torch.full_like(count, int(round(float(count.float().mean())))))
    if mode == "oracle-pool":
        flat = score.flatten()
        keep = int(count.sum())
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if keep:
            mask[flat.topk(keep).indices] = True
        return mask.view_as(score)
    if mode == "oracle-tile":
        b, t, g = score.shape
        n = -(-t // tile)
        pad = n * tile - t
        s = F.pad(score, (0, 0, 0, pad)).view(b, n, tile, g).sum(2)
        c = F.pad(count.float(), (0, pad)).view(b, n, tile).sum(2)
        sizes = torch.full((n,), float(tile))
        sizes[-1] = tile - pad
        k = (c / sizes.to(c.device)).round().long()
        return top_by_count(s, k).repeat_interleave(tile, dim=1)[:, :t]
    raise ValueError(f"unknown mode {mode!r}")


class MaskPolicy:
    """Pre-hooks on every reduction projection, run before wide's own (which multiplies by
    ``state.masks``), that replace the routers' mask by the mode's and count what it keeps."""

    def __init__(self, model, mode: str, tile: int = 0, kinds=KINDS, seed: int = 0, probes=None,
                 normed: bool = False, layers=None):
        self.model = model
        self.layers = layers  # None: every layer
        self.probes = probes  # probe modes: (layer, kind) -> predictor of scores [.., G] from the router input
        self.inputs = {}  # probe mode: this forward's router inputs
        self.gates = {}  # gate modes: layer -> SiLU(gate_proj(x)) of this forward
        self.ffn_inputs = {}  # lowrank mode: layer -> the FFN's input (gate_proj's) of this forward
        self.low_rank = {}  # lowrank mode: layer -> ((A, B) of gate_proj, (A, B) of up_proj)
        self.predictor_macs = 0.0  # lowrank mode: multiply-adds its predictions cost, over all tokens
        self.state = get_state(model)
        self.mode, self.tile, self.kinds = mode, tile, tuple(kinds)
        self.gen = torch.Generator().manual_seed(seed)
        self.kept = {kind: 0.0 for kind in KINDS}
        self.slots = {kind: 0.0 for kind in KINDS}
        self.agreed = 0.0  # kept groups the oracle keeps too, over the modes' kinds
        self.counted = 0.0
        self.energy = 0.0  # per (token, module): ||c_g||^2 summed over the kept groups / over the oracle's
        self.energy_rows = 0
        self.handles = []
        self.projs = {}
        self.capture = None  # (layer, kind) -> (projection input, routers' counts) in prepare()
        self.first_order = {}  # (layer, kind) -> (scores, counts) of the FIRST_ORDER modes
        geo = self.state.geometry
        spec = arch.spec_for(model)
        for i, layer in enumerate(arch.decoder_layers(model)):
            for kind in KINDS:
                proj = self.projs[(i, kind)] = arch.reduction_projection(layer, spec, kind)
                gram = contribution_gram(proj.weight, geo.groups(kind)) if kind in self.kinds else None
                self.handles.append(proj.register_forward_pre_hook(
                    lambda mod, args, i=i, kind=kind, gram=gram: self._hook(i, kind, gram, args[0]), prepend=True))
                if mode in GATED and kind == "ffn":
                    gate = arch.projection(layer, spec, "gate")
                    self.handles.append(gate.register_forward_hook(
                        lambda mod, args, out, i=i: self.gates.__setitem__(i, F.silu(out.float()))))
                if mode == LOWRANK and kind == "ffn" and (layers is None or i in layers):
                    gate, up = arch.projection(layer, spec, "gate"), arch.projection(layer, spec, "up")
                    self.low_rank[i] = (low_rank(gate.weight, tile), low_rank(up.weight, tile))
                    self.handles.append(gate.register_forward_pre_hook(
                        lambda mod, args, i=i: self.ffn_inputs.__setitem__(i, args[0])))
                if mode in PROBES and kind in self.kinds:
                    self.handles.append(router_input_hook(arch.module_norm(layer, spec, kind), normed,
                                                          lambda x, key=(i, kind): self.inputs.__setitem__(key, x)))

    def _hook(self, layer: int, kind: str, gram, h: torch.Tensor) -> None:
        routed = self.state.masks.get((layer, kind))
        if routed is None:
            return
        if self.capture is not None:  # the first pass of FIRST_ORDER modes runs the routers' masks
            self.capture[(layer, kind)] = (h.detach(), routed.bool().sum(-1))
            return
        mask = routed.bool()
        if kind in self.kinds and (self.layers is None or layer in self.layers):
            sq = contribution_sq(h, gram)  # the oracle's scores: chosen by, or compared with
            if self.mode in FIRST_ORDER:
                score, count = self.first_order[(layer, kind)]
                mask = top_by_count(score, count)
            elif self.mode in GATED:
                count = routed.bool().sum(-1)
                groups = routed.shape[-1]
                if self.mode == "gate-flops":
                    count = (groups - ((groups - count) * 3 + 1) // 2).clamp_min(0)
                g = self.gates.pop(layer)
                mask = top_by_count(g.view(*g.shape[:-1], groups, -1).square().sum(-1), count)
            elif self.mode == LOWRANK:
                (ga, gb), (ua, ub) = self.low_rank[layer]
                x = self.ffn_inputs.pop(layer).float()
                h_approx = F.silu(x @ gb.T @ ga.T) * (x @ ub.T @ ua.T)
                mask = top_by_count(contribution_sq(h_approx, gram), routed.bool().sum(-1))
                self.predictor_macs += x[..., 0].numel() * (ga.numel() + gb.numel() + ua.numel() + ub.numel())
            elif self.mode in PROBES:
                predict = self.probes[(layer, kind)]
                mask = top_by_count(predict(self.inputs.pop((layer, kind))), routed.bool().sum(-1))
            else:
                mask = choose(self.mode, self.tile, h, sq, routed, self.gen)
            self.state.masks[(layer, kind)] = mask.to(routed.dtype)
            best = top_by_count(sq, mask.sum(-1))
            self.agreed += float((best & mask).sum())
            self.counted += float(mask.sum())
            runs = mask.sum(-1) > 0
            share = (sq * mask).sum(-1) / (sq * best).sum(-1).clamp_min(1e-30)
            self.energy += float(share[runs].sum())
            self.energy_rows += int(runs.sum())
        kept = float(mask.sum())
        if self.mode in GATED and kind == "ffn":  # gate_proj ran for every group: 1 of 3 projections
            kept += (mask.numel() - kept) / 3
        self.kept[kind] += kept
        self.slots[kind] += mask.numel()

    def prepare(self, ids: torch.Tensor) -> None:
        """FIRST_ORDER modes: a pass of ``ids`` with the routers' masks, and for every group
        -c_g . dloss/d(out) (the first-order gain of running c_g); the loss is KL(dense ||
        routed) or, for oracle-ce, the next-token loss, summed over the windows."""
        if self.mode not in FIRST_ORDER:
            return
        outs = {}
        hooks = [proj.register_forward_hook(lambda m, a, o, key=key: outs.__setitem__(key, o))
                 for key, proj in self.projs.items() if key[1] in self.kinds]
        # Frozen weights: the graph starts at the embeddings, so only activations get gradients.
        hooks.append(self.model.get_input_embeddings().register_forward_hook(lambda m, a, o: o.requires_grad_(True)))
        if self.mode == "oracle-kl":
            with routing_disabled(self.model):
                dense = F.log_softmax(self.model(input_ids=ids).logits.float(), -1)
        self.capture = {}
        try:
            with torch.enable_grad():
                logits = self.model(input_ids=ids).logits.float()
                if self.mode == "oracle-kl":
                    loss = F.kl_div(F.log_softmax(logits, -1), dense, log_target=True, reduction="sum")
                else:
                    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
                keys = [k for k in outs if k in self.capture]
                grads = torch.autograd.grad(loss, [outs[k] for k in keys])
        finally:
            for h in hooks:
                h.remove()
            captured, self.capture = self.capture, None
        self.first_order = {}
        for key, g in zip(keys, grads):
            h, count = captured[key]
            groups = self.state.geometry.groups(key[1])
            gw = g.float() @ self.projs[key].weight.detach().float()  # [B, T, in]
            gain = -(h.float() * gw).view(*h.shape[:-1], groups, -1).sum(-1)
            self.first_order[key] = (gain, count)

    def flop_sparsity(self) -> float:
        geo = self.state.geometry
        macs = {kind: geo.group_macs(kind) for kind in KINDS}
        skipped = sum((self.slots[k] - self.kept[k]) * macs[k] for k in KINDS) - self.predictor_macs
        total = sum(self.slots[k] * macs[k] for k in KINDS)
        return skipped / total if total else 0.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def router_input_hook(norm, normed: bool, keep):
    """Hands ``keep`` what a module's router reads: the norm's input (the residual stream,
    WideConfig.router_input="residual") or its output ("normed")."""
    def after(mod, args, out):
        keep(out)

    def before(mod, args):
        keep(args[0])

    return norm.register_forward_hook(after) if normed else norm.register_forward_pre_hook(before)


def accumulate(stats: list, x: torch.Tensor, y: torch.Tensor) -> None:
    """Adds rows x [N, H], y [N, G] to ``stats`` = [n, sum x, sum y, x^T x, x^T y] (float64)."""
    x, y = x.double(), y.double()
    stats[0] += x.shape[0]
    stats[1] += x.sum(0)
    stats[2] += y.sum(0)
    stats[3] += x.T @ x
    stats[4] += x.T @ y


def solve(stats: list, ranks) -> dict:
    """rank -> (weight [H, G], bias [G]) of the least-squares fit of y on x (a small ridge),
    the weight reduced to each rank (0: full) along the fitted predictions' principal axes,
    the bias kept at full rank as a router's is."""
    n, sx, sy, xtx, xty = stats
    mx, my = sx / n, sy / n
    cxx = xtx - n * torch.outer(mx, mx)
    cxy = xty - n * torch.outer(mx, my)
    ridge = 1e-6 * cxx.diagonal().mean()
    w = torch.linalg.solve(cxx + ridge * torch.eye(cxx.shape[0], dtype=cxx.dtype), cxy)
    _, vecs = torch.linalg.eigh(w.T @ cxx @ w)  # ascending
    out = {}
    for r in ranks:
        wr = w if r == 0 or r >= w.shape[1] else w @ vecs[:, -r:] @ vecs[:, -r:].T
        out[r] = (wr.float(), (my - mx @ wr).float())
    return out


@torch.no_grad()
def capture_pairs(model, ids: torch.Tensor, sink, normed: bool = False, batch_size: int = 8, kinds=KINDS) -> None:
    """Runs ``ids`` with the routers' masks and hands ``sink(key, x, y)`` every routed module's
    router inputs x [N, H] and targets y [N, G]: log ||c_g||^2, each row less its mean (only the
    order within a row picks groups, so a per-token constant need not be predicted)."""
    state = get_state(model)
    spec = arch.spec_for(model)
    current, hooks = {}, []
    for i, layer in enumerate(arch.decoder_layers(model)):
        for kind in kinds:
            key = (i, kind)
            hooks.append(router_input_hook(arch.module_norm(layer, spec, kind), normed,
                                           lambda x, key=key: current.__setitem__(key, x)))
            proj = arch.reduction_projection(layer, spec, kind)
            gram = contribution_gram(proj.weight, state.geometry.groups(kind))

            def add(mod, args, key=key, gram=gram):
                if key not in current:  # a dense forward (no router ran)
                    return
                y = contribution_sq(args[0], gram).flatten(0, -2).double()
                y = (y + 1e-6 * y.mean(-1, keepdim=True) + 1e-30).log()
                sink(key, current.pop(key).flatten(0, -2), y - y.mean(-1, keepdim=True))
            hooks.append(proj.register_forward_pre_hook(add, prepend=True))
    run_with_hooks(model, ids, batch_size, hooks, "probe data")


@torch.no_grad()
def run_with_hooks(model, ids: torch.Tensor, batch_size: int, hooks: list, desc: str) -> None:
    """Runs ``ids`` through the model in batches (eval mode) for what ``hooks`` collect, then removes them."""
    model.eval()
    try:
        for i in tqdm(range(0, ids.shape[0], batch_size), desc=desc, leave=False):
            model(input_ids=ids[i:i + batch_size])
    finally:
        for h in hooks:
            h.remove()


def linear_predictor(w: torch.Tensor, b: torch.Tensor):
    return lambda x: x.float() @ w + b


def fit_probes(model, ids: torch.Tensor, ranks, normed: bool = False, batch_size: int = 8,
               kinds=KINDS) -> dict:
    """rank -> {(layer, kind): predictor}: :func:`solve`'s linear maps of the router input to
    :func:`capture_pairs`' targets."""
    stats = {}
    capture_pairs(model, ids, lambda key, x, y: accumulate(stats.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0]), x, y),
                  normed, batch_size, kinds)
    probes = {r: {} for r in ranks}
    for key, st in stats.items():
        for r, (w, b) in solve(st, ranks).items():
            probes[r][key] = linear_predictor(w, b)
    return probes


def fit_mlp_probes(model, ids: torch.Tensor, widths, normed: bool = False, batch_size: int = 8, kinds=KINDS,
                   steps: int = 600, lr: float = 3e-3, seed: int = 0) -> dict:
    """width -> {(layer, kind): predictor}: Linear(H, width) -> SiLU -> Linear(width, G) on the
    standardised router input, trained with Adam (minibatches of 1024, mean squared error) on
    :func:`capture_pairs`' targets. A router of rank ``width`` with a nonlinearity in the
    middle costs what the linear one of that rank does."""
    data = {}
    capture_pairs(model, ids, lambda key, x, y: data.setdefault(key, []).append((x.float(), y.float())),
                  normed, batch_size, kinds)
    gen = torch.Generator().manual_seed(seed)
    probes = {w: {} for w in widths}
    for key, parts in tqdm(list(data.items()), desc="mlp probes", leave=False):
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)  # on the model's device, as the net below
        xs = (x - mean) / std
        for width in widths:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
                net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], width), torch.nn.SiLU(),
                                          torch.nn.Linear(width, y.shape[1])).to(x.device)
            opt = torch.optim.Adam(net.parameters(), lr=lr)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
            with torch.enable_grad():
                for _ in range(steps):
                    idx = torch.randint(0, x.shape[0], (min(1024, x.shape[0]),), generator=gen).to(x.device)
                    loss = (net(xs[idx]) - y[idx]).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()
            net.eval()
            probes[width][key] = (lambda x, net=net, mean=mean, std=std: net((x.float() - mean) / std))
    return probes


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch_size: int, policy=None) -> dict:
    """wide.evaluation.evaluate.perplexity's count (the first token of a window is context only), with
    the policy's first pass before each batch."""
    per_window = []
    for i in tqdm(range(0, ids.shape[0], batch_size), desc="perplexity", leave=False):
        x = ids[i:i + batch_size]
        if policy is not None:
            policy.prepare(x)
        logits = model(input_ids=x).logits.float()
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        per_window += nll.double().sum(1).tolist()
    count = ids[:, 1:].numel()
    return {"ppl": math.exp(sum(per_window) / count), "tokens": count, "window_nll": per_window}


def paired_se(nll: list, base: list, tokens_per_window: int) -> float:
    """Standard error of log(ppl / base ppl) over windows (the same windows in both): the
    spread of the per-window differences of mean next-token loss."""
    d = torch.tensor(nll, dtype=torch.float64) - torch.tensor(base, dtype=torch.float64)
    return float(d.std() / tokens_per_window / math.sqrt(len(d))) if len(d) > 1 else float("nan")


def heldout_windows(tok, windows: int) -> torch.Tensor:
    from wide.data import load_documents, pack_documents

    return pack_documents(load_documents("wiki", split="heldout"), tok, 256)[:windows]


def calibration_windows(tok, windows: int) -> torch.Tensor:
    from wide.data import load_documents, pack_documents

    return pack_documents(load_documents("wiki", split="train"), tok, 256)[:windows]


@torch.no_grad()
def run(routers: str, modes: list, windows: int, batch_size: int = 8, seed: int = 0,
        probe_windows: int = 64, normed: bool = False, device: str = "cpu") -> list:
    from transformers import AutoTokenizer

    import wide
    from wide.data import fetch_default_model

    tok = AutoTokenizer.from_pretrained(fetch_default_model())
    ids = heldout_windows(tok, windows).to(device)
    model = wide.from_pretrained(routers).to(device)
    model.eval()
    parsed = [parse_mode(split_layers(m)[0]) for m in modes]
    ranks = sorted({tile for mode, tile, _ in parsed if mode == "probe"})
    widths = sorted({tile for mode, tile, _ in parsed if mode == "mlp"})
    fit_ids = calibration_windows(tok, probe_windows).to(device) if ranks or widths else None
    fit_kinds = tuple(k for k in KINDS if any(k in kinds for mode, _, kinds in parsed if mode in PROBES))
    probes = {"probe": fit_probes(model, fit_ids, ranks, normed, batch_size, fit_kinds) if ranks else {},
              "mlp": fit_mlp_probes(model, fit_ids, widths, normed, batch_size, fit_kinds, seed=seed) if widths else {}}
    rows = []
    for text in ["dense"] + [m for m in modes if m != "dense"]:
        core, layers = split_layers(text)
        mode, tile, kinds = parse_mode(core)
        t0 = time.perf_counter()
        if mode == "dense":
            with routing_disabled(model):
                res = perplexity(model, ids, batch_size)
            sparsity = 0.0
            agree = energy = None
        else:
            policy = MaskPolicy(model, mode, tile, kinds, seed, probes.get(mode, {}).get(tile), normed, layers)
            try:
                res = perplexity(model, ids, batch_size, policy)
            finally:
                policy.remove()
            sparsity = policy.flop_sparsity()
            agree = policy.agreed / policy.counted if policy.counted else None
            energy = policy.energy / policy.energy_rows if policy.energy_rows else None
        row = {"routers": routers, "mode": text, "ppl": res["ppl"], "window_nll": res["window_nll"],
               "flop_sparsity": sparsity,
               "agree_with_oracle": agree, "energy_vs_oracle": energy,
               "tokens": res["tokens"], "windows": int(ids.shape[0]), "seed": seed,
               "wall_s": round(time.perf_counter() - t0, 1)}
        if mode in PROBES:
            row.update(probe_windows=probe_windows, probe_input="normed" if normed else "residual")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "window_nll"}), flush=True)
    return add_ratios(rows, ids.shape[1] - 1)


def add_ratios(rows: list, tokens_per_window: int) -> list:
    """Each row's perplexity over the first row's (dense) and over the ``router`` row's, the
    latter with its paired standard error over windows."""
    dense = rows[0]
    routed = next((r for r in rows if r["mode"] == "router"), None)
    for r in rows:
        r["vs_dense"] = r["ppl"] / dense["ppl"]
        r["vs_router"] = r["ppl"] / routed["ppl"] if routed else None
        r["vs_router_se"] = paired_se(r["window_nll"], routed["window_nll"], tokens_per_window) if routed else None
    return rows


def vs_router_cell(r: dict, digits: int = 2) -> str:
    """'1.13x ± 0.02' (the SE of log(ratio) is the ratio's relative SE); '-' without routers."""
    if not r["vs_router"]:
        return "-"
    se = f" ± {r['vs_router'] * r['vs_router_se']:.{digits}f}" if r["mode"] != "router" else ""
    return f"{r['vs_router']:.{digits}f}x{se}"


def write_results(out: str, argv: list, script: str, rows: list, markdown) -> None:
    """OUT.json (the command and every row) and OUT.md (``markdown(rows, command)``), printed too."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = f"python experiments/{script} " + " ".join(argv)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))


def markdown(rows: list, command: str) -> str:
    lines = [f"Routers `{rows[0]['routers']}`, {rows[0]['windows']} held-out windows of 256 tokens "
             f"({rows[0]['tokens']} predicted), CPU, fp32.", "", f"Command: `{command}`", "",
             "| mode | ppl | vs dense | vs routers (± SE) | FLOP sparsity | agree | energy |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        vr = vs_router_cell(r)
        agree, energy = (f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("agree_with_oracle", "energy_vs_oracle"))
        lines.append(f"| {r['mode']} | {r['ppl']:.2f} | {r['vs_dense']:.2f}x | {vr} | {r['flop_sparsity']:.3f} "
                     f"| {agree} | {energy} |")
    return "\n".join(lines) + "\n"


def plot_tiles(out: str, results: list) -> None:
    """Perplexity of the tile oracle over the per-token oracle's, against the tile size, one
    line per results file (``plot OUT.png A.json [B.json ...]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path in results:
        rows = {r["mode"]: r for r in json.loads(Path(path).read_text())["rows"]}
        base = rows["oracle"]["ppl"]
        sizes = [1] + sorted(int(m[len("oracle-tile"):]) for m in rows
                             if m.startswith("oracle-tile") and ":" not in m)
        ratios = [1.0] + [rows[f"oracle-tile{n}"]["ppl"] / base for n in sizes[1:]]
        ax.plot(sizes, ratios, "o-", label=f"{rows['oracle']['routers']} (per-token oracle {base:.1f})")
    ax.axhline(1.10, color="gray", ls="--", label="issue 20's allowance (1.10x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tile size (positions sharing one mask)")
    ax.set_ylabel("perplexity / per-token oracle's")
    ax.set_title("Tile oracle (sees the whole tile) vs per-token oracle")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) < 3:
            raise SystemExit("usage: oracle_masks_cpu.py plot OUT.png RESULTS.json [RESULTS.json ...]")
        plot_tiles(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", required=True, help="a shipped name or a router directory")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; see the module docstring")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="the random mode's draws")
    p.add_argument("--probe-windows", type=int, default=64, help="calibration windows the probes are fitted on")
    p.add_argument("--probe-input", choices=("residual", "normed"), default="residual",
                   help="what the probes read (the shipped routers read the residual stream)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="e.g. cuda: the whole held-out text takes seconds there")
    p.add_argument("--out", required=True, help="stem: writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        parse_mode(split_layers(m)[0])  # refuse a typo before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.routers, modes, args.windows, args.batch_size, args.seed, args.probe_windows,
               args.probe_input == "normed", args.device)
    write_results(args.out, argv, "oracle_masks_cpu.py", rows, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
