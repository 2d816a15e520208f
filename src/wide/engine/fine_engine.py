"""Per-element sparse decode for the engine: ``wide.accelerate(model, mode="fine" | "hybrid")``.

The thresholds are the checkpoint's (``model.wide_fine``, :mod:`wide.fine`): input element k of
projection p in layer i counts iff ``|x_k| * scale_p[i, k] >= threshold[i, p]`` in fp32, the
rule of the HF hooks. Only decode steps apply it; prefill runs dense (``fine``) or routed
(``hybrid``): the kernels are decode GEMVs, and a prompt's tokens together keep nearly every
weight row, so a thresholded prefill would read what a dense one reads.

* ``fine``: every projection of a decode step reads only the weight rows its input keeps:
  q|k|v in one :func:`~wide.kernels.fine_gemv.fine_gemv` with a threshold per segment (TEAL's
  greedy allocation gives q, k and v different ones), o, gate|up in one (SiLU*mul after it), down.
  Routers, if the model has any, are not run.
* ``hybrid``: the routers run as in ``coarse`` and their decode masks bound what the thresholds
  may keep: o and down read no input column of a skipped head / FFN group (the kernel's
  ``group_mask`` over input columns), gate|up's products are zeroed in a skipped FFN group (its
  rows are still read: a fused gate|up kernel that skipped them failed to compile at T = 1 on an
  H100 and was removed),
  attention skips the skipped head groups, and inside
  the kept groups the thresholds drop elements. The result is the masked HF path with both
  kinds of sparsity on. q computes every head: ``fine_gemv`` has no output-group mask, so the
  rows of a skipped head group are read whenever the input keeps them (their values are never
  used: attention writes zeros there).

Where a projection's sharing partner keeps other elements under another scale (WINA's column
norms, learned per-channel scales), the fused launch is split into one per projection, writing
into the same output. Batches of more than :data:`~wide.kernels.fine_gemv.MAX_T` (4) tokens a
step that run the thresholds fall back to GEMMs on the thresholded inputs: cuBLAS in ``fine``,
the routed kernels (or cuBLAS, as measured) in ``hybrid``; they compute the same values but read
every weight row that any token needs, which at such batches is about all of them. So a ``fine``
engine on the kernels decodes such batches with the dense weights instead, and measures the
batches of up to 4 (:meth:`~wide.engine.inference.AcceleratedModel.decode_path`; ``fine_max_batch``
fixes the limit).

fp32 sums (``fine`` and ``hybrid`` on the kernels, ``fine_sums="fp32"``, the default since an H100 run timed it
end to end: TPOT at batch 1 1.62x the dense engine against 1.54x rounded, 4k context,
bench/results/h100/e2e_fine.md). A GEMV's split-K
programs add into fp32 sums; rounding them to the model's dtype takes a ticket per column slice
and a last program that reads, rounds, stores and clears, which the next norm then reads back.
In a ``fine`` or ``hybrid`` decode step of up to MAX_T tokens the q|k|v, o and down GEMVs instead
add into three engine-held fp32 buffers (``fine_gemv(acc_out=...)``), and their consumers round each
sum to the model's dtype before using it, as the epilogue did: the same values. o's and down's
consumer is the next fused norm (the FFN norm after o, the next layer's attention norm or the
final norm after down); q|k|v's is the RoPE + KV-cache launch, which also zeros each head once
read (``rope_decode(clear=True)``: each head is one program's). gate|up (one launch) adds into
a fourth buffer, and down computes silu(gate) * up from it where it loads each row, rounded as
silu_mul rounds it (``fine_gemv(glu_input=True)``). The other re-arming zeros ride on launches
that run anyway (``fine_gemv(clear=...)``): the layer's q|k|v clears the down sums (the attention
norm has read them), its o the gate|up sums (the previous layer's down has), its gate|up the o
sums (the FFN norm has). In ``hybrid`` the o and down launches take the routers' group masks as
the rounding ones do, and a gate|up whose FFN groups are routed rounds (silu_mul zeroes the
skipped groups) before a down that adds into sums. On an H100
(Llama-3.1-8B shapes, T = 1, 50 % kept, bf16; bench/results/h100/fine_gemv_sweep.md, 2026-12-07)
the sums-only launch ran o in 10.2 us against the best rounding launch's 11.6, down in 23.8
against 26.2 and q|k|v in 12.5 against 14.0 (read floors 7.3, 20.8 and 10.0). Deterministic
algorithms keep the ordered, rounding GEMVs (atomic adds have no fixed order); the
torch backend, batches above MAX_T, q|k|v launched per projection (scales that differ) and
``fine_sums="rounded"`` round in each GEMV as before.

The Triton backend reads the weights in the transposed layout of the kernels
(:func:`~wide.kernels.fine_gemv.fine_layout`), built when the first fine or hybrid engine of a
model is made and shared by every later one (:func:`layouts`). A ``fine`` engine keeps that
layout alone: the model's projection weights become views of it (:func:`_single_copy`), and its
prefill and dense steps run cuBLAS on those views. A ``hybrid`` engine's routed prefill reads
row-major weights, so it keeps both. The torch backend computes the same values with dense
matmuls on the thresholded inputs and needs no copy.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..base import arch
from ..method.fine import get_fine
from ..method.geometry import PROJECTIONS
from .ops import TorchOps, TritonOps, UnroutedOps, flat_mask

try:
    from ..kernels import rope_decode, silu_mul
    from ..kernels.silu_mul import silu_mul_reference
    from ..kernels.fine_gemv import MAX_T, fine_gemv, fine_layout, fine_segments
except Exception:  # pragma: no cover - depends on the install (the torch backend needs none of it)
    MAX_T = 4

__all__ = ["NO_THRESHOLDS", "FineLayer", "FineThresholds", "layouts", "make_decode_ops", "FineTorchOps",
           "FineTritonOps", "FineOnlyTorchOps", "FineOnlyTritonOps"]

Q, K, V, O, GATE, UP, DOWN = range(len(PROJECTIONS))
NO_THRESHOLDS = ("this checkpoint has no per-element thresholds (model.wide_fine) for mode {mode!r}: train "
                 "with `wide calibrate --hybrid` (or attach and calibrate wide.fine) or use mode coarse")


@dataclass
class FineLayer:
    """One layer's view of the engine's thresholds and scales, and its weights in the kernels'
    transposed layout (Triton backend only)."""

    index: int
    th: torch.Tensor  # [7] fp32, a row of FineThresholds.th: the kernels read it at every launch
    scale: list  # per projection: [in] fp32 (a row of FineThresholds.scale) or None
    # Host-side facts of the current thresholds, which pick how many launches a step takes:
    qkv_one_scale: bool = True  # q, k and v score with one scale: one launch, a threshold per segment
    gu_one_scale: bool = True
    kv_same: bool = True  # k and v keep the same elements (torch path: one GEMM for both)
    gu_same: bool = True  # gate and up keep the same elements (hybrid batches > 4: the routed ffn_up)
    wqkv_t: Optional[torch.Tensor] = None  # [H, (Hq + 2 Hkv) D]
    segs: list = field(default_factory=list)
    wo_t: Optional[torch.Tensor] = None
    wgu_t: Optional[torch.Tensor] = None  # [H, 2 I], gate then up
    wd_t: Optional[torch.Tensor] = None


# model -> {(layer, name): (source key, transposed weight)}: one copy per model, whichever
# engines use it; a source weight that changed (other storage, an in-place update) is laid out anew.
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _source_key(ws) -> tuple:
    return tuple((w.data_ptr(), w._version, tuple(w.shape), w.dtype, str(w.device)) for w in ws)


def layouts(model, i: int, weights: dict) -> dict:
    """name -> ``fine_layout`` of ``weights[name]`` (a tuple of [N, K] weights sharing an input),
    cached per model and layer."""
    store = _LAYOUTS.setdefault(model, {})
    out = {}
    for name, ws in weights.items():
        key = _source_key(ws)
        hit = store.get((i, name))
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, fine_layout(*(w.detach() for w in ws)))
            store[(i, name)] = hit
        out[name] = hit[1]
    return out


class FineThresholds:
    """The engine's fp32 copy of ``model.wide_fine`` on its device: ``th [L, 7]`` (thresholds,
    not logs) and per projection ``scale [L, in]`` or None. :meth:`refresh` rewrites them in
    place, so the kernels of captured CUDA graphs read the new values on their next replay."""

    def __init__(self, engine):
        fine = get_fine(engine.model)
        if fine is None:
            raise ValueError(NO_THRESHOLDS.format(mode=engine.mode))
        self.fine = fine
        L = len(engine.layers)
        if tuple(fine.log_threshold.shape) != (L, len(PROJECTIONS)):
            raise ValueError(f"model.wide_fine holds thresholds of shape {tuple(fine.log_threshold.shape)} for a "
                             f"model of {L} layers x {len(PROJECTIONS)} projections")
        dev = engine.device
        self.th = torch.zeros(L, len(PROJECTIONS), dtype=torch.float32, device=dev)
        self.scale = [torch.ones(L, fine.log_scale[p].shape[1], dtype=torch.float32, device=dev)
                      if p in fine.log_scale else None for p in PROJECTIONS]
        self.layers = [FineLayer(i, self.th[i], [None if s is None else s[i] for s in self.scale])
                       for i in range(L)]
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the model's current thresholds and scales; True if a layer's launch structure
        changed (the engine then drops its captured graphs)."""
        fine = self.fine
        for i in range(len(self.layers)):
            # One exp per element and row, as the hooks evaluate them (fine.threshold /
            # fine.scale): on the CPU a vectorised exp over the whole table may round another way.
            for j, p in enumerate(PROJECTIONS):
                self.th[i, j] = fine.threshold(i, p).to(self.th.device)
                if self.scale[j] is not None:
                    self.scale[j][i].copy_(fine.scale(i, p))
        th = self.th.tolist()
        changed = False
        for f in self.layers:
            t = th[f.index]

            def same_scale(a, b):
                sa, sb = f.scale[a], f.scale[b]
                return sa is None or torch.equal(sa, sb)

            flags = (same_scale(Q, K) and same_scale(Q, V), same_scale(GATE, UP),
                     t[K] == t[V] and same_scale(K, V), t[GATE] == t[UP] and same_scale(GATE, UP))
            changed |= flags != (f.qkv_one_scale, f.gu_one_scale, f.kv_same, f.gu_same)
            f.qkv_one_scale, f.gu_one_scale, f.kv_same, f.gu_same = flags
        return changed


def _keep(f: FineLayer, j: int, x: torch.Tensor) -> torch.Tensor:
    """Bool [rows, in]: the elements of ``x`` projection ``j`` reads (the hooks' rule, fp32)."""
    score = x.float().abs()
    s = f.scale[j]
    if s is not None:
        score = score * s
    return score >= f.th[j]


def _kept(f: FineLayer, j: int, x: torch.Tensor) -> torch.Tensor:
    return x * _keep(f, j, x).to(x.dtype)


class _FineDecode:
    """What the per-element decode ops of both backends share: the router is never left to the
    GEMVs (they do not finish it), and eager steps asked to record (``decode(record=...)``) get
    each projection's read shares."""

    record = None  # set per step by the engine: a list, or None

    def defer_router(self) -> bool:
        return False

    def _note(self, f: FineLayer, j: int, x, rows=None, cols=None, group: int = 1) -> None:
        """Append ``(layer, projection, [share of the weight some token reads, mean share one
        token needs])`` to the step's record. ``rows``: the routed group mask over the input
        columns (o, down); ``cols``: over the output channels (gate, up)."""
        if self.record is None:
            return
        keep = _keep(f, j, x)
        if rows is not None:
            keep = keep & rows.repeat_interleave(group, dim=-1)
        on = torch.ones(keep.shape[0], 1, device=keep.device) if cols is None else cols.float()
        union = keep.any(0).float().mean() * on.amax(0).mean()
        token = (keep.float().mean(1) * on.mean(1)).mean()
        self.record.append((f.index, PROJECTIONS[j], torch.stack([union, token])))

    # ------------------------------------------------ dense GEMMs on thresholded inputs

    def _masked_q(self, L, h, f: FineLayer, bias: bool):
        return F.linear(_kept(f, Q, h), L.wq, L.bq if bias else None)

    def _masked_kv(self, L, h, f: FineLayer, bias: bool):
        """k|v [rows, 2 Hkv D], each on its own thresholded input."""
        if f.kv_same:
            return F.linear(_kept(f, K, h), L.wkv, L.bkv if bias else None)
        n = L.wkv.shape[0] // 2
        bk, bv = (L.bkv[:n], L.bkv[n:]) if bias and L.bkv is not None else (None, None)
        return torch.cat([F.linear(_kept(f, K, h), L.wkv[:n], bk), F.linear(_kept(f, V, h), L.wkv[n:], bv)], dim=-1)


class FineTorchOps(_FineDecode, TorchOps):
    """``hybrid`` decode on the torch backend (and the reference of the kernels): the HF path's
    arithmetic, thresholded inputs into dense matmuls, routed groups zeroed as TorchOps does.
    With thresholds that keep everything it is TorchOps itself, bit for bit."""

    def qkv(self, L, h, mask, route=None, router=None, fused: bool = False):
        f = L.fine
        for j in (Q, K, V):
            self._note(f, j, h)
        return self._masked_q(L, h, f, self.gemm_bias), self._masked_kv(L, h, f, self.gemm_bias)

    def o_proj(self, L, att, mask, route):
        f = L.fine
        rows = None if mask is None else flat_mask(mask)
        self._note(f, O, att, rows=rows, group=self.e.attn_gs * self.e.head_dim)
        return F.linear(_kept(f, O, att), L.wo)

    def ffn(self, L, h, mask, router=None):
        f = L.fine
        m = None if mask is None else flat_mask(mask)
        for j in (GATE, UP):
            self._note(f, j, h, cols=m)
        u = F.silu(F.linear(_kept(f, GATE, h), L.wg)) * F.linear(_kept(f, UP, h), L.wu)
        if m is not None:
            u = u * m.repeat_interleave(self.e.ffn_gs, dim=-1).to(u.dtype)
        self._note(f, DOWN, u, rows=m, group=self.e.ffn_gs)
        return F.linear(_kept(f, DOWN, u), L.wd)


class FineOnlyTorchOps(UnroutedOps, FineTorchOps):
    """``fine`` decode on the torch backend: no router runs, every mask is None."""


class FineTritonOps(_FineDecode, TritonOps):
    """``hybrid`` decode on the kernels: the per-element GEMVs with the router's group masks,
    for batches of up to MAX_T; larger batches run the routed GEMMs on thresholded inputs. With
    ``fine_sums="fp32"`` and deterministic algorithms off, the q|k|v, o and down GEMVs of a step
    of up to MAX_T tokens add into fp32 sums that the RoPE launch and the next norm read (module
    docstring, "fp32 sums"), the routers' group masks applied as in the rounding launches."""

    def __init__(self, engine):
        super().__init__(engine)
        # [MAX_T, H] each (128 KiB for H = 4096), zero from the start; a step of B tokens uses
        # rows [:B] (contiguous). Invariant between steps: o_sum all zero; down_sum[:B'] holds the
        # last fine step's last-layer sums, which the next fine step's layer-0 q|k|v clears
        # (whatever its batch) before any down GEMV adds. A CUDA-graph capture's warm-up runs
        # whole steps (GraphCapture), which keep this, so the buffers need no restoring there.
        self.o_sum = torch.zeros(MAX_T, engine.hidden, dtype=torch.float32, device=engine.device)
        self.down_sum = torch.zeros_like(self.o_sum)
        # q|k|v (one launch, where q, k and v score with one scale): read and cleared by the same
        # layer's RoPE launch, so zero between layers and steps
        width = (engine.num_heads + 2 * engine.num_kv) * engine.head_dim
        self.qkv_sum = torch.zeros(MAX_T, width, dtype=torch.float32, device=engine.device)
        # gate|up (one launch): read by the same layer's down GEMV (silu(gate) * up where it loads
        # each row), cleared by the next layer's o GEMV (or the next step's first), before the next
        # gate|up adds
        self.gu_sum = torch.zeros(MAX_T, 2 * engine.inter, dtype=torch.float32, device=engine.device)

    def index(self, mask):
        # The GEMVs take the group masks as they are; only the larger batches' routed GEMMs
        # need the token lists.
        return None if mask is None or mask.shape[0] <= MAX_T else super().index(mask)

    def _sums(self, B: int):
        """``(o sums, down sums, q|k|v sums, gate|up sums)``: fp32 ``[B, H]``, ``[B, H]``,
        ``[B, (Hq + 2 Hkv) D]`` and ``[B, 2 I]`` buffers that this step's GEMVs add into, for the
        next norm, the RoPE launch or the down GEMV to read, or None: each GEMV rounds its own
        output."""
        # Deterministic algorithms: the atomic adds into the sums have no fixed order, so the
        # ordered GEMVs round their own outputs as before.
        if self.e.fine_sums != "fp32" or B > MAX_T or torch.are_deterministic_algorithms_enabled():
            return None
        return self.o_sum[:B], self.down_sum[:B], self.qkv_sum[:B], self.gu_sum[:B]

    def qkv(self, L, h, mask, route=None, router=None, fused: bool = False):
        f = L.fine
        for j in (Q, K, V):
            self._note(f, j, h)
        if h.shape[0] > MAX_T:
            q = (self._masked_q(L, h, f, False) if mask is None
                 else self._q_proj(L, _kept(f, Q, h), flat_mask(mask), route))
            return q, self._masked_kv(L, h, f, False)
        sums = self._sums(h.shape[0])
        # This layer's attention norm, the down sums' reader, came before in stream order, and
        # this layer's down GEMV, their next writer, comes after: re-armed here, in a launch
        # that runs anyway.
        clear = None if sums is None else sums[1]
        if f.qkv_one_scale and sums is not None:
            # fp32 sums (zero: the previous layer's RoPE launch cleared them) that this layer's
            # RoPE launch rounds, reads and clears (rope_decode below)
            out = fine_gemv(h, f.wqkv_t, thresholds=f.th[Q:V + 1], segments=f.segs, scale=f.scale[Q],
                            clear=clear, acc_out=sums[2])
        elif f.qkv_one_scale:
            out = fine_gemv(h, f.wqkv_t, thresholds=f.th[Q:V + 1], segments=f.segs, scale=f.scale[Q])
        else:  # (column slices of one output are no contiguous fp32 sums: these launches round)
            out = torch.empty(h.shape[0], f.segs[-1], dtype=h.dtype, device=h.device)
            for j, (lo, hi) in zip((Q, K, V), zip(f.segs[:-1], f.segs[1:])):
                fine_gemv(h, f.wqkv_t[:, lo:hi], f.th[j:j + 1], scale=f.scale[j], out=out[:, lo:hi], clear=clear)
                clear = None  # zeroed once
        nq = f.segs[1]
        return out[:, :nq], out[:, nq:]

    def o_proj(self, L, att, mask, route):
        f = L.fine
        gs = self.e.attn_gs * self.e.head_dim
        m = None if mask is None else flat_mask(mask)
        self._note(f, O, att, rows=m, group=gs)
        if att.shape[0] > MAX_T:
            return super().o_proj(L, _kept(f, O, att), mask, route)
        sums = self._sums(att.shape[0])
        if sums is not None:  # zero here: the previous layer's gate|up cleared them
            # The gate|up sums' reader, the previous layer's down GEMV, came before, and their next
            # writer, this layer's gate|up, comes after: re-armed here.
            return fine_gemv(att, f.wo_t, f.th[O:O + 1], scale=f.scale[O], group_mask=m,
                             group_size=None if m is None else gs, acc_out=sums[0], clear=sums[3])
        return fine_gemv(att, f.wo_t, f.th[O:O + 1], scale=f.scale[O], group_mask=m,
                         group_size=None if m is None else gs)

    def ffn(self, L, h, mask, router=None):
        f = L.fine
        gs = self.e.ffn_gs
        m = None if mask is None else flat_mask(mask)
        for j in (GATE, UP):
            self._note(f, j, h, cols=m)
        large = h.shape[0] > MAX_T
        route = self.index(m) if large and m is not None else None
        sums = None if large else self._sums(h.shape[0])
        # this layer's ffn norm has read the o sums: re-armed for the next layer's o GEMV
        clear = None if sums is None else sums[0]
        if large:
            u = self._ffn_up_large(L, h, f, m, route)
        elif sums is not None and f.gu_one_scale and m is None:
            # gate|up adds into fp32 sums (zero: this layer's o GEMV cleared them) and down reads
            # silu(gate) * up from them, rounded as silu_mul rounds it, where it loads each row
            inter = f.wgu_t.shape[1] // 2
            gu = fine_gemv(h, f.wgu_t, thresholds=f.th[GATE:UP + 1], segments=[0, inter, 2 * inter],
                           scale=f.scale[GATE], acc_out=sums[3], clear=clear)
            if self.record is not None:
                self._note(f, DOWN, silu_mul_reference(gu[:, :inter].to(h.dtype), gu[:, inter:].to(h.dtype)))
            return fine_gemv(gu, f.wd_t, f.th[DOWN:DOWN + 1], scale=f.scale[DOWN], glu_input=True, acc_out=sums[1])
        else:
            inter = f.wgu_t.shape[1] // 2
            if f.gu_one_scale and m is None:
                # gate|up in one fine_gemv, silu(gate) * up written by the last program of each
                # column slice (the same bits as silu_mul after it, one launch fewer per layer)
                u = fine_gemv(h, f.wgu_t, thresholds=f.th[GATE:UP + 1], segments=[0, inter, 2 * inter],
                              scale=f.scale[GATE], glu=True, clear=clear)
            else:
                if f.gu_one_scale:
                    # gate|up in one fine_gemv (a threshold per segment). It reads the gate/up rows
                    # of skipped FFN groups too; silu_mul zeroes their products.
                    gu = fine_gemv(h, f.wgu_t, thresholds=f.th[GATE:UP + 1], segments=[0, inter, 2 * inter],
                                   scale=f.scale[GATE], clear=clear)
                else:
                    gu = torch.empty(h.shape[0], 2 * inter, dtype=h.dtype, device=h.device)
                    fine_gemv(h, f.wgu_t[:, :inter], f.th[GATE:GATE + 1], scale=f.scale[GATE], out=gu[:, :inter],
                              clear=clear)
                    fine_gemv(h, f.wgu_t[:, inter:], f.th[UP:UP + 1], scale=f.scale[UP], out=gu[:, inter:])
                u = silu_mul(gu[:, :inter], gu[:, inter:], m, gs)
        self._note(f, DOWN, u, rows=m, group=gs)
        if large:
            ud = _kept(f, DOWN, u)
            return F.linear(ud, L.wd) if m is None else self._reduce_k(ud, L.wd, m, gs, route)
        if sums is not None:  # zero here: this layer's q|k|v cleared them
            return fine_gemv(u, f.wd_t, f.th[DOWN:DOWN + 1], scale=f.scale[DOWN], group_mask=m,
                             group_size=None if m is None else gs, acc_out=sums[1])
        return fine_gemv(u, f.wd_t, f.th[DOWN:DOWN + 1], scale=f.scale[DOWN], group_mask=m,
                         group_size=None if m is None else gs)

    def _ffn_up_large(self, L, h, f: FineLayer, m, route):
        """silu(gate) * up of a batch > MAX_T on thresholded inputs, zeros in skipped groups."""
        gs = self.e.ffn_gs
        if m is not None and f.gu_same:  # one input for both: the routed kernel (or cuBLAS)
            return self._ffn_up(L, _kept(f, GATE, h), m, route)
        g, u = F.linear(_kept(f, GATE, h), L.wg), F.linear(_kept(f, UP, h), L.wu)
        return silu_mul(g, u, m, gs)

    def rope_decode(self, i, L, q, kv, pos):
        if q.data_ptr() != self.qkv_sum.data_ptr():  # rounded q|k|v: rotated in place
            return super().rope_decode(i, L, q, kv, pos)
        e = self.e
        # Each (token, head) program rounds its head of the sums, rotates it and zeros it: no
        # other program reads those elements, and the next writer is the next layer's q|k|v GEMV.
        q_out = torch.empty(q.shape, dtype=e.dtype, device=q.device)
        rope_decode(q, kv, kv[:, e.num_kv * e.head_dim:], e.cos, e.sin, pos, e.k_cache[i], e.v_cache[i],
                    bias=L.bqkv, qk_norm=L.qk_norm, eps=L.qk_eps, q_out=q_out, clear=True)
        return q_out.unflatten(-1, (e.num_heads, e.head_dim))


class FineOnlyTritonOps(UnroutedOps, FineTritonOps):
    """``fine`` decode on the kernels: no router runs, every mask is None."""


def _single_copy(model, L, f: FineLayer, layer, spec, w: dict, parts=("qkv", "o", "gu", "down")) -> None:
    """The transposed layout alone for ``parts``: the layer's weights in the engine (``L``: the
    prefill's and large batches' dense GEMMs, which cuBLAS runs on the transposed views as fast,
    bench/results/h100/fine_gemv.md's dense^T column) and in the HF model become views of it,
    and the original storage is freed. ``fine`` on the kernels shares every projection; a
    ``hybrid`` engine whose FFN no router routes shares gate, up and down (81 % of a
    Llama-3.1-8B layer), which its prefill runs as dense GEMMs, and keeps row-major attention
    weights for its routed kernels. The layout cache's keys follow the parameters, so a later
    engine of the model finds the same layout."""
    nq, nk, inter = w["q"].shape[0], w["k"].shape[0], w["gate"].shape[0]
    views = {}
    if "qkv" in parts:
        L.wqkv = f.wqkv_t.t()
        L.wq, L.wkv = L.wqkv[:nq], L.wqkv[nq:]
        views.update(q=L.wq, k=L.wkv[:nk], v=L.wkv[nk:])
    if "o" in parts:
        L.wo = views["o"] = f.wo_t.t()
    if "gu" in parts:
        L.wgu = gu = f.wgu_t.t()
        L.wg, L.wu = views["gate"], views["up"] = gu[:inter], gu[inter:]
    if "down" in parts:
        L.wd = views["down"] = f.wd_t.t()
    arch.share_projection_weights(layer, spec, views)
    store = _LAYOUTS[model]
    for name, roles in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gu", ("gate", "up")), ("down", ("down",))):
        if name in parts:
            key, t = store[(f.index, name)]
            store[(f.index, name)] = (_source_key([w[r] for r in roles]), t)


def make_decode_ops(engine):
    """The decode ops of a fine or hybrid engine, with each layer's ``FineLayer`` attached to
    its ``_Layer`` (``L.fine``) and, on the Triton backend, the transposed weights."""
    th = FineThresholds(engine)
    triton = engine.backend == "triton"
    spec = arch.spec_for(engine.model)
    for L, f, layer in zip(engine.layers, th.layers, arch.decoder_layers(engine.model)):
        if triton:
            # The HF modules' own weights (the engine's concatenations are per engine): the
            # layouts are then shared by every engine of the model.
            w = {r: arch.projection(layer, spec, r).weight for r in ("q", "k", "v", "o", "gate", "up", "down")}
            lay = layouts(engine.model, f.index, {"qkv": (w["q"], w["k"], w["v"]), "o": (w["o"],),
                                                  "gu": (w["gate"], w["up"]), "down": (w["down"],)})
            f.wqkv_t, f.wo_t, f.wgu_t, f.wd_t = lay["qkv"], lay["o"], lay["gu"], lay["down"]
            f.segs = fine_segments(w["q"], w["k"], w["v"])
            if engine.mode == "fine":
                _single_copy(engine.model, L, f, layer, spec, w)
            else:
                # k|v run as one dense GEMM in hybrid (cuBLAS takes the transposed view): no
                # concatenated copy of their rows beside the layout
                L.wkv = f.wqkv_t[:, f.segs[1]:].t()
                L.wqkv_cublas = f.wqkv_t.t()
                if engine.cfg is not None and not engine.cfg.routes_ffn:
                    _single_copy(engine.model, L, f, layer, spec, w, parts=("gu", "down"))
        L.fine = f
    engine.fine = th
    only = engine.mode == "fine"
    if triton:
        return (FineOnlyTritonOps if only else FineTritonOps)(engine)
    return (FineOnlyTorchOps if only else FineTorchOps)(engine)
