"""The engine's operations per backend, and the routed-kernel-or-cuBLAS choice.

:class:`~wide.engine.inference.AcceleratedModel` picks one ops object at construction
(:func:`make_ops`) and its prefill and decode loops call its methods unconditionally:

* :class:`TorchOps`: dense matmuls and masks with HF's own modules (norms, RoPE formula), on
  any device; also what the kernel backend is tested against.
* :class:`TritonOps`: the routed kernels (``wide.kernels``) and the fused norm / router / RoPE
  kernels. Each routed projection runs the routed kernel or cuBLAS, whichever was measured
  faster for its shape (:func:`measured`, cached in :data:`K_CHOICES`): with many tokens in a
  step the union of their groups is ~every group, and skipping saves no bytes.
* :class:`DenseTorchOps`, :class:`DenseTritonOps` (``mode="dense"``): no routing, fused QKV
  and gate/up GEMMs as in gpt-fast; the baseline the end-to-end benchmark divides by.
* :class:`UnroutedTorchOps`, :class:`UnroutedTritonOps`: the prefill of ``mode="fine"``, dense
  on the model's own weights (cuBLAS, SDPA) with no router run and no concatenated copy; its
  decode ops (per-element thresholds, and ``mode="hybrid"``'s) are in :mod:`wide.engine.fine_engine`.

Masks are bool ``[..., groups]`` (``[B, T, G]`` in prefill, ``[B, G]`` in decode; None = the
module runs dense). A method given a mask of None runs the dense computation.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..kernels.env import autotune_enabled, interpret_mode
from ..kernels.reference import apply_rope
from ..method.routers import batch_shared_runs
from ..base.timing import time_graph

try:
    import triton

    from ..kernels import (batch_shared_mask, build_route, decode_attention, ffn_up, gemm_k, gemm_mn,
                          norm_route, prefill_attention, rope_decode, rope_prefill, router_mask, silu_mul,
                          skip_rule)
    from ..kernels.routing import next_pow2

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False

__all__ = ["K_CHOICES", "choose_fastest", "measured", "pick_backend", "make_ops", "flat_mask", "TorchOps",
           "TritonOps", "DenseTorchOps", "DenseTritonOps", "UnroutedOps", "UnroutedTorchOps", "UnroutedTritonOps"]

# Which implementation (routed kernel or cuBLAS) runs each routed projection, per (op, weight
# shape, group, T bucket, dtype), measured on first use. Filled only on CUDA with autotuning
# on; see measured().
K_CHOICES: dict = {}


def choose_fastest(key, candidates: dict, choices: dict, timer: Callable, default: str) -> str:
    """The name of the fastest of ``candidates`` (name -> zero-argument callable) by ``timer``,
    cached in ``choices[key]``. While a CUDA graph is being captured nothing may be timed, so an
    unmeasured key gets ``default`` (uncached)."""
    if key in choices:
        return choices[key]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return default
    times = {name: timer(fn) for name, fn in candidates.items()}
    choices[key] = min(times, key=times.get)
    return choices[key]


def measured(op: str, x, w, group_size: int, routed: Callable, dense: Callable,
             routed_only: bool = False, routing=None, others: Optional[dict] = None, key: Optional[tuple] = None,
             dense_name: str = "cublas"):
    """``routed()`` or ``dense()`` (cuBLAS, or what ``dense_name`` says; the same values wherever
    they are used), or one of ``others`` (name -> callable, more ways to the same values),
    whichever was measured fastest for this op, weight shape, group size and T bucket (or
    ``key``, laid out alike): once, on CUDA with
    autotuning on (K_CHOICES), else (or ``routed_only``) the routed kernel. Timed as CUDA-graph
    replays: eager timing of a ~20 us decode kernel measures mostly its Python launch cost,
    which made cuBLAS (one launch) win every T bucket."""
    if routed_only:
        return routed()
    # The routing rule is part of the key: tile-coherent or batch-shared masks let the routed
    # kernel skip what per-token masks of the same shape cannot.
    if key is None:
        key = (op, tuple(w.shape), group_size, next_pow2(x.shape[0]), x.dtype, routing)
    if key not in K_CHOICES and (x.device.type != "cuda" or not autotune_enabled()):
        return routed()
    candidates = {"routed": routed, dense_name: dense, **(others or {})}
    return candidates[choose_fastest(key, candidates, K_CHOICES, time_graph, default="routed")]()


def kernel_shape_error(head_dim: int, ffn_group_size: Optional[int], intermediate: int) -> Optional[str]:
    """Why the kernels cannot run these shapes (None: they can). ``ffn_group_size`` None: the
    FFN is not routed (dense mode)."""
    if head_dim not in (64, 128):
        return f"the attention kernels need head_dim 64 or 128, this model has {head_dim}"
    if ffn_group_size is not None and ffn_group_size % 16:
        good = [d for d in range(16, intermediate + 1, 16) if intermediate % d == 0][:6]
        return (f"the routed GEMM kernels need ffn_group_size to be a multiple of 16, got {ffn_group_size}; "
                f"re-wrap with e.g. {good}")
    return None


def pick_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                 ffn_group_size: Optional[int], intermediate: int) -> str:
    """``backend`` checked against the device and shapes, or for "auto" the kernels where they
    run (the torch backend elsewhere)."""
    kernels_ok = HAS_TRITON and (
        (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8)
        or (device.type == "cpu" and interpret_mode()))
    shape_error = kernel_shape_error(head_dim, ffn_group_size, intermediate)
    if backend == "auto":
        return "triton" if kernels_ok and shape_error is None else "torch"
    if backend == "triton":
        if shape_error is not None:
            raise ValueError(f"{shape_error}; use backend='torch'")
        if not HAS_TRITON:
            raise ValueError("backend='triton' needs Triton installed")
        if device.type == "cpu" and not interpret_mode():
            raise ValueError("backend='triton' on the CPU runs only under TRITON_INTERPRET=1 "
                             "(tests); use backend='torch' or a CUDA GPU")
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
            raise ValueError(f"backend='triton' needs compute capability >= 8.0, this GPU has "
                             f"{torch.cuda.get_device_capability(device)}; use backend='torch'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' does not run on {device.type}")
        if device.type == "cpu" and dtype == torch.bfloat16:
            raise ValueError("bfloat16 matmuls are wrong in the Triton interpreter: test in "
                             "float32 or float16")
    return backend


def flat_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A mask as the GEMMs take it: rows = tokens, ``[B*T, G]`` (a view)."""
    return mask if mask is None or mask.dim() == 2 else mask.reshape(-1, mask.shape[-1])


_flat = flat_mask


class TorchOps:
    """Dense matmuls and masks, with HF's own norm modules and RoPE formula: runs anywhere."""

    backend = "torch"
    gemm_bias = True  # q/k/v biases go into the projections (the kernels add them in RoPE)
    record = None  # an eager decode step's record list (decode(record=...)), for ops that add to it

    def __init__(self, engine):
        self.e = engine
        # Set by the engine per phase from its routing rule: rows come in aligned runs of this
        # many sharing one mask (a kernel hint that changes no value), or None.
        self.row_runs = None

    # ---------------------------------------------------------------- routing

    def routed(self, kind: str) -> bool:
        cfg = self.e.cfg
        return cfg.routes_attention if kind == "attn" else cfg.routes_ffn

    def router_input(self, resid, normed):
        """What the routers read, as in the HF hooks: the residual or the normed rows."""
        return normed if self.e.cfg.router_input == "normed" else resid

    def mask(self, i: int, kind: str, resid, normed, valid=None, attn=None):
        """Bool mask [..., groups] of module ``kind`` in layer ``i`` on the router's input
        (the residual or the normed rows, as in the HF hooks), None if it runs dense.
        ``valid`` [B, T] (prefill padding) is and-ed in; ``attn`` is the layer's attention
        mask, which tied (dynamic-depth) routing extends to the FFN."""
        e = self.e
        if not self.routed(kind):
            return None
        cfg, st = e.cfg, e.state
        x = self.router_input(resid, normed)
        if cfg.tie_modules and kind == "ffn":
            if attn is None:
                return None
            m = attn[..., :1].expand(*attn.shape[:-1], e.ffn_groups)
        elif st.mask_fn is not None:
            x3 = x if x.dim() == 3 else x[:, None]
            m = st.mask_fn(i, kind, x3)
            if m is None:
                return None
            m = m.reshape(x3.shape[0], x3.shape[1], -1) != 0
            m = m if x.dim() == 3 else m[:, 0]
        else:
            router = e.layers[i].routers.get(kind)
            if router is None:  # a layer the config keeps dense (attn_dense_layers)
                return None
            m = self.router_mask(router, x)
        if cfg.tie_modules and kind == "attn":
            m = m[..., :1].expand(*m.shape[:-1], e.attn_groups)
        return m if valid is None else m & valid[..., None]

    def router_mask(self, router, x):
        return router.runs(x)

    def margins(self, i: int, kind: str, resid, normed):
        """The router's fp32 margins [B, groups] of module ``kind`` (a group runs iff >= 0)."""
        e = self.e
        if not self.routed(kind):
            return None
        if e.state.mask_fn is not None:
            raise ValueError(f"the {e.rule.name} rule chooses groups from router margins; a mask_fn gives none")
        router = e.layers[i].routers.get(kind)
        if router is None:  # a layer the config keeps dense
            return None
        return router.margin(self.router_input(resid, normed).float())

    def skip_mask(self, rule, margin):
        """The mask of a skip_smallest / skip_upto ``rule`` (wide.method.group_rules) from margins."""
        return rule.runs(margin)

    def shared_mask(self, margin):
        """One group set for the batch from margins [B, groups], as a [B, groups] mask."""
        return batch_shared_runs(margin, torch.ones(margin.shape[0], dtype=torch.bool, device=margin.device)
                                 ).unsqueeze(0).expand(margin.shape[0], -1)

    def defer_router(self) -> bool:
        """Whether batch-1 decode leaves the router to the q and gate/up GEMVs."""
        return False

    def index(self, mask):
        """What the routed kernels of a mask share (a RouteIndex), or None."""
        return None

    # ---------------------------------------------------------------- norms

    def norm(self, norm, x, delta):
        """Prefill: (x + delta, RMSNorm of it), rows [B, T, H]."""
        x = x if delta is None else x + delta
        # forward, not __call__: the norms carry wide's routing hooks, which would evaluate
        # the routers a second time and record masks for the HF path.
        return x, norm.forward(x)

    def norm_route(self, i: int, kind: str, x, delta, attn=None, defer: bool = False, margins: bool = False,
                   route: bool = True, sums=None):
        """Decode: (x + delta, its RMSNorm, the module's mask or None, RouterPartials or None);
        ``margins``: the router's fp32 margins in place of the mask; ``route=False``: no router
        runs (the mask is None). ``sums`` ``(acc, done, start)``: the previous-tile rule's running
        sums of router inputs, updated as :func:`wide.kernels.norm_route` does."""
        resid, normed = self.norm(self.e.layers[i].norm(kind), x, delta)
        if sums is not None:
            acc, done, start = sums
            row = self.router_input(resid, normed)
            done.copy_(acc)
            torch.where(start, row, acc + row, out=acc)
        if not route:
            return resid, normed, None, None
        if margins:
            return resid, normed, self.margins(i, kind, resid, normed), None
        return resid, normed, self.mask(i, kind, resid, normed, attn=attn), None

    def final_norm(self, x, delta):
        return self.norm(self.e.final_norm, x, delta)[1]

    # ---------------------------------------------------------------- projections

    def qkv(self, L, h, mask, route=None, router=None, fused: bool = False):
        """(q [rows, Hq*D], kv [rows, 2*Hkv*D]). ``fused`` (decode): q and k/v in one routed
        launch where the weights allow it."""
        kv = F.linear(h, L.wkv, L.bkv)
        return F.linear(h, L.wq, L.bq), kv

    def o_proj(self, L, att, mask, route):
        return F.linear(att, L.wo)

    def ffn(self, L, h, mask, router=None):
        if L.wgu is not None:  # one gate|up GEMM: the dense engine, and FFNs no router routes
            gu = F.linear(h, L.wgu)
            inter = gu.shape[1] // 2
            u = self.act(gu[:, :inter], gu[:, inter:])
        else:
            u = self.act(F.linear(h, L.wg), F.linear(h, L.wu))
        if mask is not None:
            u = u * _flat(mask).repeat_interleave(self.e.ffn_gs, dim=-1).to(u.dtype)
        return F.linear(u, L.wd)

    def act(self, g, u):
        return F.silu(g) * u

    # ---------------------------------------------------------------- attention

    def rope_prefill(self, i: int, L, q, kv, B: int, T: int):
        """RoPE (after q/k norms) at positions 0..T-1, k/v written to the cache: (q, k, v)."""
        e = self.e
        Hq, Hkv, D = e.num_heads, e.num_kv, e.head_dim
        cos, sin = e.cos[:T][None, :, None, :], e.sin[:T][None, :, None, :]
        q, k = q.reshape(B, T, Hq, D), kv[:, :Hkv * D].reshape(B, T, Hkv, D)
        if L.q_norm is not None:
            q, k = L.q_norm.forward(q), L.k_norm.forward(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = kv[:, Hkv * D:].reshape(B, T, Hkv, D)
        e.k_cache[i][:, :T] = k
        e.v_cache[i][:, :T] = v
        return q, k, v

    def attend_prefill(self, q, k, v, mask, lens):
        """Causal attention of right-padded prompts, [B*T, Hq*D], zeros for inactive heads."""
        B, T, Hq, D = q.shape
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=Hq != k.shape[2]).transpose(1, 2)
        if mask is not None:
            att = att * mask.repeat_interleave(Hq // self.e.attn_groups, dim=-1)[..., None].to(att.dtype)
        return att.reshape(B * T, Hq * D)

    def rope_decode(self, i: int, L, q, kv, pos):
        """RoPE at each sequence's position ``pos`` [B], k/v written there: q [B, Hq, D]."""
        e = self.e
        B, Hkv, D = q.shape[0], e.num_kv, e.head_dim
        c, s = e.cos[pos][:, None, :], e.sin[pos][:, None, :]
        q, k = q.unflatten(-1, (e.num_heads, D)), kv[:, :Hkv * D].reshape(B, Hkv, D)
        if L.q_norm is not None:
            q, k = L.q_norm.forward(q), L.k_norm.forward(k)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        bi = torch.arange(B, device=e.device)
        e.k_cache[i][bi, pos] = k
        e.v_cache[i][bi, pos] = kv[:, Hkv * D:].reshape(B, Hkv, D)
        return q

    def attend_decode(self, i: int, q, mask, seq_lens):
        """One query per sequence over its ``seq_lens`` cached keys: [B, Hq*D]."""
        e = self.e
        kc, vc = e.k_cache[i], e.v_cache[i]
        B, Hq, D = q.shape
        keymask = torch.arange(kc.shape[1], device=e.device)[None, :] < seq_lens[:, None]
        att = F.scaled_dot_product_attention(
            q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
            attn_mask=keymask[:, None, None, :], enable_gqa=Hq != kc.shape[2])[:, :, 0]
        if mask is not None:
            att = att * mask.repeat_interleave(Hq // e.attn_groups, dim=-1)[..., None].to(att.dtype)
        return att.reshape(B, Hq * D)


class TritonOps(TorchOps):
    """The kernels: fused norm + router, prefill router, RoPE + cache write, routed GEMMs
    (or cuBLAS where measured faster) and routed attention. Where a mask is None (a module
    not routed, a ``mask_fn`` that returned None) the projections are the dense ones."""

    backend = "triton"
    gemm_bias = False

    def __init__(self, engine):
        super().__init__(engine)
        self._scratch = {}  # the norm kernel's router partials and tickets, per shape
        self._ones = None  # decode attention's all-heads mask of unrouted layers

    def router_mask(self, router, x):
        return router_mask(router, x)

    def defer_router(self) -> bool:
        # Read when a step runs eagerly, so a captured graph keeps the setting it was captured
        # with (WIDE_DEFER_ROUTER=0: the norm kernel finishes the router, for A/B runs).
        return os.environ.get("WIDE_DEFER_ROUTER", "1") != "0"

    def index(self, mask):
        return None if mask is None else build_route(_flat(mask))

    def norm(self, norm, x, delta):
        # One program per row: every program of the decode layout reads its whole row.
        B, T, H = x.shape
        resid, normed, _, _ = norm_route(
            x.reshape(B * T, H), None if delta is None else delta.reshape(B * T, H), norm.weight,
            norm.variance_epsilon, chunk=triton.next_power_of_2(H))
        return resid.view(B, T, H), normed.view(B, T, H)

    def norm_route(self, i, kind, x, delta, attn=None, defer=False, margins=False, route=True, sums=None):
        e = self.e
        norm = e.layers[i].norm(kind)
        normed_input = e.cfg is not None and e.cfg.router_input == "normed"
        if not route:
            resid, normed, _, _ = norm_route(x, delta, norm.weight, norm.variance_epsilon, scratch=self._scratch,
                                             normed_input=normed_input, tile_sums=sums)
            return resid, normed, None, None
        # Tied (dynamic-depth) decisions and custom mask_fns are evaluated in PyTorch.
        fused = self.routed(kind) and e.state.mask_fn is None and not e.cfg.tie_modules
        router = e.layers[i].routers.get(kind) if fused else None
        resid, normed, mask, rp = norm_route(
            x, delta, norm.weight, norm.variance_epsilon, router,
            normed_input=normed_input, defer=defer and x.shape[0] == 1, scratch=self._scratch,
            margins=margins and router is not None, tile_sums=sums)
        if router is None and self.routed(kind):
            mask = (self.margins(i, kind, resid, normed) if margins
                    else self.mask(i, kind, resid, normed, attn=attn))
        return resid, normed, mask, rp

    def shared_mask(self, margin):
        return batch_shared_mask(margin)

    def skip_mask(self, rule, margin):
        return skip_rule(margin, rule.k, upto=rule.name == "skip_upto")

    def final_norm(self, x, delta):
        fn = self.e.final_norm
        return norm_route(x, delta, fn.weight, fn.variance_epsilon)[1]

    def qkv(self, L, h, mask, route=None, router=None, fused=False):
        if mask is not None and fused and L.wqkv is not None:
            qkv = self._q_proj(L, h, mask, route, router, fused_kv=True)
            return qkv[:, :L.wq.shape[0]], qkv[:, L.wq.shape[0]:]
        nq, whole = L.wq.shape[0], L.wqkv if L.wqkv is not None else L.wqkv_cublas

        def apart():
            return F.linear(h, L.wq), F.linear(h, L.wkv)

        # q|k|v in one cuBLAS GEMM, one launch fewer, where the weights lie as one tensor; on
        # hybrid's transposed layout cuBLAS ran 0.98-1.12x its row-major time
        # (bench/results/h100/fine_gemv_prefill.md), so each way is timed per T bucket
        others = {} if whole is None else {"whole": lambda: F.linear(h, whole).split([nq, whole.shape[0] - nq], 1)}
        gs = self.e.attn_gs * self.e.head_dim
        if mask is None:
            return apart() if whole is None else measured("qkv_dense", h, L.wq, gs, apart, apart, others=others)
        mask = _flat(mask)
        return measured("q_kv", h, L.wq, gs,
                        lambda: (gemm_mn(h, L.wq, mask, gs, route=route, router=router), F.linear(h, L.wkv)),
                        apart, routed_only=router is not None, routing=self.e.routing, others=others)

    def o_proj(self, L, att, mask, route):
        if mask is None:
            return F.linear(att, L.wo)
        return self._reduce_k(att, L.wo, _flat(mask), self.e.attn_gs * self.e.head_dim, route)

    def ffn(self, L, h, mask, router=None):
        if mask is None:
            return super().ffn(L, h, None)
        mask = _flat(mask)
        route = self.index(mask)
        return self._reduce_k(self._ffn_up(L, h, mask, route, router), L.wd, mask, self.e.ffn_gs, route)

    def act(self, g, u):
        return silu_mul(g, u)

    def rope_prefill(self, i, L, q, kv, B, T):
        e = self.e
        kc, vc = e.k_cache[i], e.v_cache[i]
        rope_prefill(q, kv, kv[:, e.num_kv * e.head_dim:], e.cos, e.sin, kc, vc, B,
                     bias=L.bqkv, qk_norm=L.qk_norm, eps=L.qk_eps)
        return q.view(B, T, e.num_heads, e.head_dim), kc[:, :T], vc[:, :T]

    def attend_prefill(self, q, k, v, mask, lens):
        if mask is None:
            return super().attend_prefill(q, k, v, None, lens)
        B, T, Hq, D = q.shape

        def routed():
            return prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask,
                                     q_lens=lens, k_lens=lens, padding_side="right").reshape(B * T, Hq * D)

        # SDPA (the dense engine's attention) with the skipped heads zeroed after, where it
        # measures faster: at 25 % skipped the routed kernel ran 0.5x SDPA's default backend at
        # 1k tokens, 1.0x at 4k, 1.1x at 16k (bench/results/attention.md, H200)
        return measured("attend_prefill", q, q, self.e.attn_groups, routed,
                        lambda: TorchOps.attend_prefill(self, q, k, v, mask, lens), dense_name="sdpa",
                        key=("attend_prefill", (B, Hq * D), self.e.attn_groups, next_pow2(T), q.dtype, self.e.routing))

    def rope_decode(self, i, L, q, kv, pos):
        e = self.e
        rope_decode(q, kv, kv[:, e.num_kv * e.head_dim:], e.cos, e.sin, pos, e.k_cache[i],
                    e.v_cache[i], bias=L.bqkv, qk_norm=L.qk_norm, eps=L.qk_eps)
        return q.unflatten(-1, (e.num_heads, e.head_dim))

    def attend_decode(self, i, q, mask, seq_lens):
        e = self.e
        B = q.shape[0]
        if mask is None:
            if self._ones is None or self._ones.shape[0] != B:
                self._ones = torch.ones(B, e.attn_groups, dtype=torch.bool, device=e.device)
            mask = self._ones
        att = decode_attention(q, e.k_cache[i], e.v_cache[i], mask, seq_lens)
        return att.reshape(B, e.num_heads * e.head_dim)

    # ------------------------------------------------- routed kernel or cuBLAS, per projection

    def _reduce_k(self, x, w, mask, group_size: int, route):
        """O and down. Their inputs are exact zeros in inactive groups (the attention and ffn_up
        kernels write zeros there), so cuBLAS on the same input computes the same sum; gemm_k
        wins only where skipping saves more than it costs. With i.i.d. masks over many groups a
        prefill tile almost never has an empty group (bench/results/kernels.md: gemm_k 0.6-0.8x
        of cuBLAS at T >= 64), while decode reads only the used groups' weights."""
        return measured("gemm_k", x, w, group_size,
                        lambda: gemm_k(x, w, mask, group_size, route=route, row_runs=self.row_runs),
                        lambda: F.linear(x, w), routing=self.e.routing)

    def _ffn_up(self, L, h, mask, route, router=None):
        """silu(h wg^T) * (h wu^T) on the active groups, zeros elsewhere. A batch-1 deferred
        ``router`` needs the routed GEMV, which writes the mask."""
        gs = self.e.ffn_gs
        return measured("ffn_up", h, L.wg, gs,
                        lambda: ffn_up(h, L.wg, L.wu, mask, gs, route=route, router=router),
                        lambda: silu_mul(F.linear(h, L.wg), F.linear(h, L.wu), mask, gs),
                        routed_only=router is not None, routing=self.e.routing)

    def _q_proj(self, L, h, mask, route, router=None, fused_kv: bool = False):
        """Routed q (or q and the dense k/v tail, ``fused_kv``) vs cuBLAS. cuBLAS's q of inactive
        heads is not zeroed: attention skips those heads and writes zeros, so nothing reads it."""
        w = L.wqkv if fused_kv else L.wq
        tail = L.wkv.shape[0] if fused_kv else 0
        gs = self.e.attn_gs * self.e.head_dim
        return measured("qkv" if fused_kv else "q", h, w, gs,
                        lambda: gemm_mn(h, w, mask, gs, route=route, dense_tail=tail, router=router),
                        lambda: F.linear(h, w), routed_only=router is not None, routing=self.e.routing)


class _DenseOps:
    """``mode="dense"``: no routing; q/k/v and gate/up (:meth:`TorchOps.ffn`) each in one GEMM
    (as gpt-fast does)."""

    def routed(self, kind: str) -> bool:
        return False

    def qkv(self, L, h, mask, route=None, router=None, fused=False):
        qkv = F.linear(h, L.wqkv, L.bqkv if self.gemm_bias else None)
        return qkv[:, :L.wq.shape[0]], qkv[:, L.wq.shape[0]:]


class DenseTorchOps(_DenseOps, TorchOps):
    pass


class DenseTritonOps(_DenseOps, TritonOps):
    pass


class UnroutedOps:
    """No module is routed (every mask None): the projections run dense on the layer's own
    weights. ``mode="fine"`` ignores the routers a model may have."""

    def routed(self, kind: str) -> bool:
        return False


class UnroutedTorchOps(UnroutedOps, TorchOps):
    pass


class UnroutedTritonOps(UnroutedOps, TritonOps):
    pass


def make_ops(engine) -> TorchOps:
    """The ops object of an engine's backend and mode (its prefill ops, and its decode ops
    except in the fine and hybrid modes: :func:`wide.engine.fine_engine.make_decode_ops`)."""
    triton = engine.backend == "triton"
    if engine.mode == "dense":
        return DenseTritonOps(engine) if triton else DenseTorchOps(engine)
    if engine.mode == "fine":
        # on the kernels: the dense engine's fused GEMMs, on the decode GEMVs' transposed copy
        # (wide.engine.fine_engine keeps that copy alone); the torch backend keeps the model's weights
        return DenseTritonOps(engine) if triton else UnroutedTorchOps(engine)
    return TritonOps(engine) if triton else TorchOps(engine)
