"""Is the fp32 disagreement of the fine / hybrid kernels with the PyTorch path (scripts/gpu_smoke.py,
``fine_modes_ok``, H100) a precision effect of TF32 dots, or a kernel bug?

On an H100 in fp32 the engine's Triton kernels and its PyTorch path (``backend="torch"``) gave
decode logits 4-40 % apart after an identical 32-token prefill, and greedy tokens that agreed
1-12 of 16, while the coarse engine matched HF 16/16. The kernels' ``tl.dot`` ran fp32 inputs
in TF32 (10-bit mantissa), Triton's default (since ce6d6f0 they take tf32x3 through
kernels/fp32_dot.py; the variants below emulate the kernels as the H100 ran them); the
per-element thresholds are a hard ``|x| >= t`` on every projection input, so an element within
~1e-3 of its threshold can flip, and a flip changes a projection's output by ~t * |W[:, i]|,
much more than the rounding that caused it.

This runs the smoke's own tiny fp32 models (``build`` / ``with_thresholds`` of
scripts/gpu_smoke.py, on the CPU) through the PyTorch path twice: exactly, and with TF32
emulated (fp32 inputs rounded to 10 mantissa bits before the products, fp32 accumulation).
Variants (projections = the engine's q/k/v/o/gate/up/down matmuls; the routers and the LM head
stay exact, as on the GPU, where routers run tf32x3 / FMA and the head runs cuBLAS fp32):

    repeat      the exact run again (must be bit-equal: the differences below are the emulation's)
    A_all       every projection and every attention call in TF32
    B_attn      every attention call in TF32 (q.k and p.v), projections exact
    C_kernel    TF32 where the Triton backend runs a default-precision tl.dot: decode attention
                always; prefill attention where it is routed (coarse, hybrid; fine prefills with
                SDPA); the routed projections (q, o, gate/up, down) of steps of more than 4 rows
                in hybrid (prefill, and decode at batch 5: the GEMMs after the fine GEMVs'
                MAX_T) and of more than 1 row in coarse. Assumes the routed kernel wherever the
                engine may pick it over cuBLAS (ops.measured chooses by timing on the GPU)
    C_trunc     C_kernel with the low 13 bits dropped instead of rounded (what the MMA does to
                fp32 operands fed to it unconverted)
    D_fp64      every projection and attention accumulated in fp64, rounded to fp32 once: a
                correct fp32 kernel that sums in another order
    A_fixed     A_all with every keep decision and router mask forced to the exact run's
    C_fixed     C_kernel likewise: what a correct TF32 kernel differs by, flips excluded
    S0..S7      C_kernel with stochastic rounding to TF32 under 8 seeds: which elements flip
                depends on the exact roundings (the GPU's summation order is not the CPU's), so
                one run is one draw; these give the spread of the error sizes (greedy: the
                smoke's prompt only). ``--extra NAME --seeds N`` adds a longer spread to the
                result file

Measured as the smoke does: decode logits rel err ||emu - exact|| / ||exact|| after a 32-token
prefill at batch 2 and 5, and greedy agreement over 16 new tokens from a 16-token prompt; and
per decode step the per-element keep decisions that differ, with each flipped element's
distance to its threshold | |x| - t | / t (x of the exact run), and the router decisions that
differ (prefill and decode). Controls: fine and hybrid with every threshold keeping all (the
engine reads the threshold values, not ``wide_fine.enabled``; keep-all thresholds make it
TorchOps bit for bit).

``--interpreter`` adds the smoke's comparison itself with the kernels run by the Triton
interpreter (TRITON_INTERPRET=1), whose dots are fp32 whatever the input precision: the kernels'
logic against the PyTorch path with the TF32 taken out (fine and hybrid; ~20 min more on two
cores, the interpreter runs a program at a time). ``--table`` prints the README's tables from the
result file.

    PYTHONPATH=src .venv/bin/python experiments/fine_precision_cpu.py --interpreter \
        [--models llama,qwen2,qwen3] [--threads 2] \
        [--out experiments/results/fine_precision_cpu/results.json]
    PYTHONPATH=src .venv/bin/python experiments/fine_precision_cpu.py --extra seeds32 \
        --models llama,qwen2,qwen3 --modes fine,hybrid --seeds 32
    PYTHONPATH=src .venv/bin/python experiments/fine_precision_cpu.py --table
"""

from __future__ import annotations

import os
import sys

if "--interpreter" in sys.argv:  # before triton is imported (by wide.engine.ops, through gpu_smoke)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import contextlib
import datetime
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_smoke as smoke  # noqa: E402

import wide  # noqa: E402
import wide.engine.fine_engine as fine_engine  # noqa: E402
import wide.engine.ops as wide_ops  # noqa: E402
from wide.method.fine import KEEP_ALL  # noqa: E402
from wide.engine.fine_engine import MAX_T  # noqa: E402
from wide.method.geometry import PROJECTIONS  # noqa: E402

smoke.DEVICE = "cpu"  # build() and the generators read the module global
DEVICE = "cpu"
GPU_H100 = {  # scripts/gpu_smoke.py fine_modes_ok on the H100 (fp32, kernels vs PyTorch path), from the brief
    "llama": {"fine": (6.2e-2, 6.8e-2), "hybrid": (1.05e-1, 2.57e-1)},
    "qwen2": {"fine": (4.3e-2, 3.8e-2), "hybrid": (3.8e-1, 4.0e-1)},
    "qwen3": {"fine": (6.3e-2, 8.5e-2), "hybrid": (1.7e-1, 2.6e-1)},
}


# ---------------------------------------------------------------- TF32 rounding


def tf32_rna(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value (ties away from zero), still fp32. Adding half an ulp of
    the 10-bit mantissa to the bit pattern carries into the exponent exactly when rounding up
    should; sign-magnitude makes it symmetric."""
    return ((x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def tf32_trunc(x: torch.Tensor) -> torch.Tensor:
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def check_rounding() -> dict:
    """A few values by hand, and the worst relative error over random normals (bounds: 2^-11
    rounded, 2^-10 truncated)."""
    vals = torch.tensor([1.0, 1 + 2 ** -11, 1 + 2 ** -12, 1 + 2 ** -11 + 2 ** -20, -(1 + 2 ** -11),
                         math.pi, 2 - 2 ** -12, 1e-3], dtype=torch.float32)
    want = [1.0, 1 + 2 ** -10, 1.0, 1 + 2 ** -10, -(1 + 2 ** -10), 3.140625, 2.0, None]
    got = tf32_rna(vals).tolist()
    for g, w in zip(got, want):
        assert w is None or g == w, (got, want)
    r = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    out = {"values": vals.tolist(), "rna": got, "trunc": tf32_trunc(vals).tolist()}
    for name, fn, bound in (("rna", tf32_rna, 2 ** -11), ("trunc", tf32_trunc, 2 ** -10)):
        e = float(((fn(r) - r).abs() / r.abs()).max())
        assert e <= bound, (name, e)
        out[f"max_rel_err_{name}"] = e
    # products of two TF32 values fit fp32's 24 bits, so F.linear on rounded inputs is a TF32
    # MMA with fp32 accumulation (in another summation order)
    a, b = tf32_rna(torch.randn(4096)), tf32_rna(torch.randn(4096))
    assert torch.equal((a * b).double(), a.double() * b.double())
    return out


# ---------------------------------------------------------------- emulation of the kernels' dots


@dataclass(frozen=True)
class Variant:
    name: str
    linear: str | None = None  # None, "all", "routed"
    attention: str | None = None  # None, "all", "kernel"
    rounding: str = "rna"  # "rna", "trunc", "stoch" (stochastic rounding, seeded), "fp64"
    fixed: bool = False  # impose the exact run's keep decisions and router masks
    seed: int = 0


VARIANTS = [
    Variant("repeat"),
    Variant("A_all", "all", "all"),
    Variant("B_attn", None, "all"),
    Variant("C_kernel", "routed", "kernel"),
    Variant("C_trunc", "routed", "kernel", "trunc"),
    Variant("D_fp64", "all", "all", "fp64"),
    Variant("A_fixed", "all", "all", fixed=True),
    Variant("C_fixed", "routed", "kernel", fixed=True),
]
CONTROL_VARIANTS = ["repeat", "A_all", "B_attn", "C_kernel", "D_fp64"]
# Which elements sit near a threshold, and so which flip, depends on the exact rounding (the GPU's
# summation order is not the CPU's): C_kernel with stochastic rounding to TF32 under several
# seeds gives the spread of the error sizes one TF32 run can show.
SEEDS = 8
SPREAD = [Variant(f"S{k}", "routed", "kernel", "stoch", seed=k) for k in range(SEEDS)]


class Emu:
    """What the proxied F.linear / SDPA of wide.engine.ops and wide.engine.fine_engine do now."""

    variant: Variant | None = None
    routed: set = set()  # data_ptrs of the weights the routed kernels read
    min_rows: int = 0  # routed weights run on tl.dot in steps of more rows than this
    dense_prefill: bool = False  # inside an unrouted prefill attention (SDPA on the GPU too)
    wcache: dict = {}
    gen: torch.Generator | None = None


def tf32_stoch(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Round up with probability (dropped bits) / 2^13: unbiased, up to one TF32 ulp off."""
    r = torch.randint(0, 0x2000, x.shape, generator=gen, dtype=torch.int32)
    return ((x.contiguous().view(torch.int32) + r) & ~0x1FFF).view(torch.float32)


def _rnd(x: torch.Tensor) -> torch.Tensor:
    r = Emu.variant.rounding
    if r == "stoch":
        return tf32_stoch(x, Emu.gen)
    return tf32_trunc(x) if r == "trunc" else tf32_rna(x)


def _rnd_weight(w: torch.Tensor) -> torch.Tensor:
    # weights are rounded once per variant, not per call (a 1792 x 4864 weight per decode
    # step would dominate the run time)
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), Emu.variant.rounding)
    hit = Emu.wcache.get(key)
    if hit is None:
        hit = Emu.wcache[key] = w.double() if Emu.variant.rounding == "fp64" else _rnd(w)
    return hit


def emu_linear(x, w, b=None):
    v = Emu.variant
    if v is None or v.linear is None:
        return F.linear(x, w, b)
    if v.rounding == "fp64":
        return F.linear(x.double(), _rnd_weight(w), None if b is None else b.double()).to(x.dtype)
    rows = x.numel() // x.shape[-1]
    if v.linear == "all" or (w.data_ptr() in Emu.routed and rows > Emu.min_rows):
        # the kernels add biases in fp32 after the dot (in the RoPE kernel): b is not rounded
        return F.linear(_rnd(x), _rnd_weight(w), b)
    return F.linear(x, w, b)


def emu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    var = Emu.variant
    use = var is not None and (var.attention == "all" or (var.attention == "kernel" and not Emu.dense_prefill))
    if not use:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    f64 = var.rounding == "fp64"
    r = (lambda t: t.double()) if f64 else _rnd
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    s = (r(q) @ r(k).transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    T, S = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=s.device).tril(S - T), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    # as the kernels do: the unnormalised probabilities go into the p.v dot (rounded there),
    # the row sum divides after it
    return ((r(p) @ r(v)) / p.sum(-1, keepdim=True)).to(q.dtype)


class _ProxyF:
    """torch.nn.functional for the engine's ops modules only: the routers (nn.Linear modules)
    and the LM head keep the real F, as they keep fp32-exact arithmetic on the GPU."""

    def __getattr__(self, name):
        return getattr(F, name)

    linear = staticmethod(emu_linear)
    scaled_dot_product_attention = staticmethod(emu_sdpa)


# ---------------------------------------------------------------- recording decisions


class Rec:
    on = False
    fixed_keeps: list | None = None  # the exact run's keep masks, imposed in call order
    fixed_masks: list | None = None
    phase = ""
    keeps: list = []  # (layer, projection, score, threshold, keep, own keep when fixed)
    masks: list = []  # (phase, layer, kind, mask or None, margin or None, own mask when fixed)

    @classmethod
    def start(cls, fixed_keeps=None, fixed_masks=None):
        cls.on, cls.keeps, cls.masks = True, [], []
        cls.fixed_keeps, cls.fixed_masks = fixed_keeps, fixed_masks

    @classmethod
    def stop(cls):
        cls.on = False
        cls.fixed_keeps = cls.fixed_masks = None
        return cls.keeps, cls.masks


_orig_kept = fine_engine._kept
_orig_mask = wide_ops.TorchOps.mask
_orig_attend_prefill = wide_ops.TorchOps.attend_prefill


def rec_kept(f, j, x):
    if not Rec.on:
        return _orig_kept(f, j, x)
    keep = fine_engine._keep(f, j, x)
    score = x.float().abs() if f.scale[j] is None else x.float().abs() * f.scale[j]
    own = None
    if Rec.fixed_keeps is not None:
        n = len(Rec.keeps)
        layer, proj, _, _, exact, _ = Rec.fixed_keeps[n]
        assert (layer, proj) == (f.index, j) and exact.shape == keep.shape, "decode calls out of step"
        own, keep = keep, exact
    Rec.keeps.append((f.index, j, score, float(f.th[j]), keep, own))
    return x * keep.to(x.dtype)


def rec_mask(self, i, kind, resid, normed, valid=None, attn=None):
    m = _orig_mask(self, i, kind, resid, normed, valid, attn=attn)
    if not Rec.on:
        return m
    margin = None
    if m is not None:
        margin = self.margins(i, kind, resid, normed)
    own = None
    if Rec.fixed_masks is not None:
        phase, li, k, exact, _, _ = Rec.fixed_masks[len(Rec.masks)]
        assert (phase, li, k) == (Rec.phase, i, kind), "router calls out of step"
        own, m = m, exact
    Rec.masks.append((Rec.phase, i, kind, m, margin, own))
    return m


def flagged_attend_prefill(self, q, k, v, mask, lens):
    Emu.dense_prefill = mask is None
    try:
        return _orig_attend_prefill(self, q, k, v, mask, lens)
    finally:
        Emu.dense_prefill = False


@contextlib.contextmanager
def patched():
    proxy = _ProxyF()
    saved = (wide_ops.F, fine_engine.F)
    wide_ops.F = fine_engine.F = proxy
    fine_engine._kept = rec_kept
    wide_ops.TorchOps.mask = rec_mask
    wide_ops.TorchOps.attend_prefill = flagged_attend_prefill
    try:
        yield
    finally:
        wide_ops.F, fine_engine.F = saved
        fine_engine._kept = _orig_kept
        wide_ops.TorchOps.mask = _orig_mask
        wide_ops.TorchOps.attend_prefill = _orig_attend_prefill


@contextlib.contextmanager
def emulating(engine, variant: Variant | None):
    Emu.variant = variant
    Emu.wcache = {}
    Emu.gen = torch.Generator().manual_seed(variant.seed) if variant is not None else None
    routes = engine.mode in ("routed", "hybrid")
    Emu.routed = {w.data_ptr() for L in engine.layers for w in (L.wq, L.wo, L.wg, L.wu, L.wd)} if routes else set()
    Emu.min_rows = 1 if engine.mode == "routed" else MAX_T
    try:
        yield
    finally:
        Emu.variant, Emu.wcache = None, {}


@contextlib.contextmanager
def thresholds_off(model):
    fine = model.wide_fine
    saved = fine.log_threshold.detach().clone()
    with torch.no_grad():
        fine.log_threshold.fill_(KEEP_ALL)
    try:
        yield
    finally:
        with torch.no_grad():
            fine.log_threshold.copy_(saved)


# ---------------------------------------------------------------- measurements


def rel(a, b) -> float:
    return smoke.rel(a, b)


def decode_step(engine, ids, B: int, fixed=None):
    """The smoke's step: prefill ids[:B, :32], decode ids[:B, 32] at position 32 (eager,
    record=[]); returns (logits, keep records, router records)."""
    Rec.start(*(fixed or (None, None)))
    try:
        engine.setup_cache(B, 128)
        Rec.phase = "prefill"
        engine.prefill(ids[:B, :32])
        Rec.phase = "decode"
        out = engine.decode(ids[:B, 32], torch.full((B,), 32, dtype=torch.long, device=DEVICE), record=[]).clone()
    finally:
        keeps, masks = Rec.stop()
    return out, keeps, masks


def greedy(engine, ids, row: int = 0) -> list:
    return engine.generate([ids[row, :16].tolist()], max_new_tokens=16).tokens[0]


def agreement(toks: list, ref: list) -> dict:
    return {"agree": sum(a == b for a, b in zip(toks, ref)), "of": len(ref),
            "first_diff": next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)}


def _stats(d: torch.Tensor) -> dict:
    if d.numel() == 0:
        return {"max": None, "median": None}
    return {"max": float(d.max()), "median": float(d.median())}


def keep_flips(exact: list, other: list, own: bool = False) -> dict:
    """Per-element decisions that differ between the exact run's keeps and ``other``'s (its own
    decisions when ``own``: a fixed run's would-be flips), with | |x| - t | / t of the exact
    run's x; by layer, and the first layer that flips (its flips have no flip upstream in
    this step)."""
    assert len(exact) == len(other)
    total, dists, per_layer, near, first = 0, [], {}, 0, None
    for (li, j, score, t, ke, _), (lo, jo, _, _, ko, oo) in zip(exact, other):
        assert (li, j) == (lo, jo)
        k = oo if own else ko
        total += ke.numel()
        if t <= 0:
            continue
        d_all = (score - t).abs() / t
        near += int((d_all < 1e-3).sum())
        flip = ke != k
        n = int(flip.sum())
        if n:
            d = d_all[flip]
            dists.append(d)
            if first is None:  # no flip upstream of it in this step: the precision flips themselves
                first = {"layer": li, "projection": PROJECTIONS[j], "flips": n, "distance": _stats(d)}
            pl = per_layer.setdefault(li, {"flips": 0, "by_projection": {}, "d": []})
            pl["flips"] += n
            pl["by_projection"][PROJECTIONS[j]] = pl["by_projection"].get(PROJECTIONS[j], 0) + n
            pl["d"].append(d)
    d = torch.cat(dists) if dists else torch.zeros(0)
    out = {"decisions": total, "flips": int(d.numel()), "distance": _stats(d),
           "within_1e-2": int((d < 1e-2).sum()), "within_1e-3": int((d < 1e-3).sum()),
           "exact_within_1e-3_of_threshold": near, "per_layer": {}}
    for li in sorted(per_layer):
        pl = per_layer[li]
        out["per_layer"][str(li)] = {"flips": pl["flips"], "by_projection": pl["by_projection"],
                                     "distance": _stats(torch.cat(pl["d"]))}
    out["first_layer"] = min(per_layer) if per_layer else None
    out["first_call"] = first
    return out


def router_flips(exact: list, other: list, own: bool = False) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        total, flips, fm, allm = 0, 0, [], []
        for (ph, li, kind, me, mg, _), (po, lo, ko_, mo, _, oo) in zip(exact, other):
            assert (ph, li, kind) == (po, lo, ko_)
            if ph != phase or me is None:
                continue
            m = oo if own else mo
            total += me.numel()
            f = me != m
            flips += int(f.sum())
            allm.append(mg.abs().flatten())
            fm.append(mg.abs()[f])
        if total:
            allm = torch.cat(allm)
            fm = torch.cat(fm)
            out[phase] = {"decisions": total, "flips": flips, "flipped_abs_margin": _stats(fm),
                          "median_abs_margin": float(allm.median())}
    return out


def run_config(model, ids, mode: str, variants: list, label: str) -> list:
    engine = wide.accelerate(model, mode=mode, backend="torch")
    rows = []
    rows_ = range(ids.shape[0])  # the smoke's prompt is row 0; the others show the spread
    with emulating(engine, None):
        ref_tokens = [greedy(engine, ids, r) for r in rows_]
        ref = {B: decode_step(engine, ids, B) for B in (2, 5)}
    for v in variants:
        t0 = time.time()
        row = {"mode": engine.mode_name, "thresholds": label, "variant": v.name, "logits_rel_err": {},
               "keep_flips": {}, "router_flips": {}}
        for B in (2, 5):
            fixed = (ref[B][1], ref[B][2]) if v.fixed else None
            with emulating(engine, v):
                out, keeps, masks = decode_step(engine, ids, B, fixed)
            row["logits_rel_err"][str(B)] = rel(out, ref[B][0])
            row["keep_flips"][str(B)] = keep_flips(ref[B][1], keeps, own=v.fixed) if keeps else None
            if v.rounding == "stoch" and keeps:  # the seeds are for the spread of sizes: totals only
                row["keep_flips"][str(B)].pop("per_layer")
            row["router_flips"][str(B)] = router_flips(ref[B][2], masks, own=v.fixed)
        if not v.fixed:  # fixed decisions belong to one step's inputs; a free generation leaves them
            with emulating(engine, v):
                # the spread's seeds generate from the smoke's prompt only
                toks = [greedy(engine, ids, r) for r in (rows_ if v.rounding != "stoch" else rows_[:1])]
            row["greedy"] = {**agreement(toks[0], ref_tokens[0]), "tokens": toks[0], "exact_tokens": ref_tokens[0],
                             "other_prompts": [agreement(t, rt)["agree"] for t, rt in zip(toks[1:], ref_tokens[1:])]}
        row["seconds"] = round(time.time() - t0, 1)
        kf = row["keep_flips"]["5"]
        print(f"  {row['mode']:>6} {label:>14} {v.name:>8}: rel err B=2 {row['logits_rel_err']['2']:.2e} "
              f"B=5 {row['logits_rel_err']['5']:.2e}"
              + (f", greedy {row['greedy']['agree']}/16 (rows 1-4: {row['greedy']['other_prompts']})"
                 if "greedy" in row else "")
              + (f", B=5 flips {kf['flips']}/{kf['decisions']} (d max {kf['distance']['max']})" if kf else "")
              + f"  [{row['seconds']} s]", flush=True)
        rows.append(row)
    engine.free_cache()
    return rows


def interpreter_check(model, ids, mode: str) -> dict:
    """The smoke's fp32 comparison itself, the kernels run by the Triton interpreter, whose
    tl.dot is an fp32 numpy matmul whatever input_precision says: what the kernels compute
    when their dots are fp32-accurate (ieee / tf32x3). Logits only: the interpreter's batch-1
    GEMVs take minutes per greedy run."""
    kern = wide.accelerate(model, mode=mode, backend="triton")
    ref = wide.accelerate(model, mode=mode, backend="torch")
    out = {}
    for B in (2, 5):
        t0 = time.time()
        outs = []
        for e in (kern, ref):
            e.setup_cache(B, 128)
            e.prefill(ids[:B, :32])
            outs.append(e.decode(ids[:B, 32], torch.full((B,), 32, dtype=torch.long, device=DEVICE), record=[]))
        out[str(B)] = rel(outs[0], outs[1])
        print(f"  {mode:>6} interpreter kernels vs torch, B={B}: rel err {out[str(B)]:.2e} "
              f"[{time.time() - t0:.1f} s]", flush=True)
    kern.free_cache()
    ref.free_cache()
    return out


def run_model(model_type: str, interpreter: bool = False, modes=("coarse", "fine", "hybrid"), full: bool = True,
              spread: list = SPREAD) -> dict:
    """``full``: every variant and the controls; else the spread's seeds only."""
    t0 = time.time()
    model, ids = smoke.build(model_type, torch.float32, target=smoke.HYBRID_SHARE, batch=5)
    smoke.with_thresholds(model, ids)
    built = round(time.time() - t0, 1)
    print(f"{model_type}: built in {built} s", flush=True)
    by_name = {v.name: v for v in VARIANTS}
    rows = []
    base = VARIANTS if full else []
    if "coarse" in modes:
        rows += run_config(model, ids, "coarse", [v for v in base if v.name != "C_trunc"] + spread, "none (routers)")
    for mode in ("fine", "hybrid"):
        if mode in modes:
            rows += run_config(model, ids, mode, base + spread, "on")
    for mode in ("fine", "hybrid"):
        if full and mode in modes:
            with thresholds_off(model):
                rows += run_config(model, ids, mode, [by_name[n] for n in CONTROL_VARIANTS], "off (control)")
    checks = {}
    if interpreter:
        for mode in ("fine", "hybrid"):  # (coarse matched HF on the H100; its routed prefill is the slow part here)
            checks[mode] = interpreter_check(model, ids, mode)
    cfg = model.config
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "vocab_size")
    return {"interpreter_kernels_vs_torch": checks, "config": {k: getattr(cfg, k) for k in keys},
            "thresholds": [[math.exp(x) if x > -1e30 else 0.0 for x in row]
                           for row in model.wide_fine.log_threshold.tolist()],
            "build_seconds": built, "seconds": round(time.time() - t0, 1), "runs": rows}


def compact(obj, keep=("tf32_check",)):
    """Floats to 4 significant digits (the file stays a few hundred kB), except under ``keep``,
    whose values are exact by design."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: (v if k in keep else compact(v, keep)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [compact(v, keep) for v in obj]
    return obj


# ---------------------------------------------------------------- the README's tables


def _e(x) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.1e}")


def _pair(r) -> str:
    return f"{_e(r['logits_rel_err']['2'])} / {_e(r['logits_rel_err']['5'])}"


def _greedy(r) -> str:
    g = r.get("greedy")
    if g is None:
        return "-"
    return f"{g['agree']}" + (f" ({', '.join(map(str, g['other_prompts']))})" if g["other_prompts"] else "")


def _router(r) -> str:
    rf = r["router_flips"]["5"]
    if not rf:
        return "-"
    parts = []
    for ph in ("prefill", "decode"):
        v = rf[ph]
        m = v["flipped_abs_margin"]["max"]
        parts.append(f"{v['flips']}/{v['decisions']}" + (f" (<= {m:.1e})" if m is not None else ""))
    return "; ".join(parts)


def tables(res: dict) -> str:
    """Markdown: the GPU against the emulation (with the longest spread of seeds stored), the
    interpreter's check, then every run."""
    out = ["| model | mode | H100 kernels vs torch: B=2 / B=5 | C_kernel: B=2 / B=5 (greedy) | C_trunc: B=2 / B=5 "
           "(greedy) | seeds | seeds: B=2 min / median / max | seeds: B=5 min / median / max | seeds: greedy "
           "min / median / max | C_fixed: B=2 / B=5 | D_fp64: B=2 / B=5 |", "|---" * 11 + "|"]
    extra = res.get("extra", {})

    def spread(m, mode, main_runs):
        best = [r for r in main_runs if r["variant"].startswith("S")]
        for ext in extra.values():
            runs = [r for r in ext["models"].get(m, {}).get("runs", []) if r["mode"] == mode]
            if len(runs) > len(best):
                best = runs
        return best

    def mmm(v):
        v = sorted(v)
        n = len(v)
        med = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
        return v[0], med, v[-1]

    for m, md in res["models"].items():
        for mode in ("coarse", "fine", "hybrid"):
            sel = [r for r in md["runs"] if r["mode"] == mode and r["thresholds"] != "off (control)"]
            by = {r["variant"]: r for r in sel}
            seeds = spread(m, mode, sel)
            gpu = res["gpu_h100"].get(m, {}).get(mode)
            e2, e5 = (mmm(r["logits_rel_err"][B] for r in seeds) for B in ("2", "5"))
            gr = mmm(r["greedy"]["agree"] for r in seeds)
            tr = by.get("C_trunc")
            out.append(f"| {m} | {mode} | {f'{gpu[0]:.3g} / {gpu[1]:.3g}' if gpu else '- (greedy 16/16 vs HF)'} "
                       f"| {_pair(by['C_kernel'])} ({by['C_kernel']['greedy']['agree']}) "
                       f"| {_pair(tr) + ' (' + str(tr['greedy']['agree']) + ')' if tr else '-'} | {len(seeds)} "
                       f"| {' / '.join(map(_e, e2))} | {' / '.join(map(_e, e5))} | {gr[0]} / {gr[1]:g} / {gr[2]} "
                       f"| {_pair(by['C_fixed'])} | {_pair(by['D_fp64'])} |")
    if any(md.get("interpreter_kernels_vs_torch") for md in res["models"].values()):
        out += ["", "| model | fine: B=2 / B=5 | hybrid: B=2 / B=5 |", "|---|---|---|"]
        for m, md in res["models"].items():
            c = md.get("interpreter_kernels_vs_torch") or {}
            out.append(f"| {m} | " + " | ".join(f"{_e(c[k]['2'])} / {_e(c[k]['5'])}" if k in c else "-"
                                                 for k in ("fine", "hybrid")) + " |")
    out += ["", "| model | mode | thresholds | variant | rel err B=2 / B=5 | greedy /16 (prompts 1-4) | keep flips B=5 "
            "| flip distance max / median | within 1e-2 | first flipped call: flips, max distance "
            "| router flips B=5: prefill; decode (max abs margin) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, md in res["models"].items():
        for r in md["runs"]:
            if r["variant"].startswith("S"):
                continue
            kf = r["keep_flips"]["5"]
            if kf and kf["flips"]:
                fc = kf["first_call"]
                dist = kf["distance"]
                kcols = (f"{kf['flips']}/{kf['decisions']} | {_e(dist['max'])} / {_e(dist['median'])} "
                         f"| {kf['within_1e-2']} | L{fc['layer']}.{fc['projection']}: {fc['flips']}, "
                         f"{_e(fc['distance']['max'])}")
            else:
                kcols = ("0" if kf else "-") + " | - | - | -"
            out.append(f"| {m} | {r['mode']} | {r['thresholds']} | {r['variant']} | {_pair(r)} | {_greedy(r)} "
                       f"| {kcols} | {_router(r)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,qwen2,qwen3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "experiments/results/fine_precision_cpu/results.json"))
    ap.add_argument("--table", action="store_true", help="print the README's tables from --out and exit")
    ap.add_argument("--extra", metavar="NAME",
                    help="a longer spread: only the S seeds (--seeds, --modes) of --models, stored under "
                         "extra[NAME] of the existing --out")
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--modes", default="coarse,fine,hybrid")
    ap.add_argument("--interpreter", action="store_true",
                    help="also run the kernels under TRITON_INTERPRET=1 (fp32 dots) against the torch path")
    args = ap.parse_args()
    if args.table:
        print(tables(json.loads(Path(args.out).read_text())))
        return
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.extra:
        spread = [Variant(f"S{k}", "routed", "kernel", "stoch", seed=k) for k in range(args.seeds)]
        res = json.loads(Path(args.out).read_text())
        ext = {"command": "PYTHONPATH=src .venv/bin/python " + " ".join(sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "models": {}}
        with patched():
            for m in args.models.split(","):
                ext["models"][m] = run_model(m, modes=args.modes.split(","), full=False, spread=spread)
        ext["seconds"] = round(time.time() - t0, 1)
        res.setdefault("extra", {})[args.extra] = ext
        Path(args.out).write_text(json.dumps(compact(res), indent=1))
        print(f"wrote extra[{args.extra}] into {args.out} ({ext['seconds']} s)")
        return
    import transformers

    out = {"command": "PYTHONPATH=src .venv/bin/python " + " ".join(sys.argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "threads": args.threads,
           "settings": {"share": smoke.HYBRID_SHARE, "prefill_tokens": 32, "decode_batches": [2, 5],
                        "greedy_prompt": 16, "greedy_new": 16, "max_t": MAX_T,
                        "variants": [v.__dict__ for v in VARIANTS + SPREAD], "control_variants": CONTROL_VARIANTS},
           "tf32_check": check_rounding(), "gpu_h100": GPU_H100, "models": {}}
    with patched():
        for m in args.models.split(","):
            out["models"][m] = run_model(m, args.interpreter)
    out["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(compact(out), indent=1))
    print(f"wrote {args.out} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
