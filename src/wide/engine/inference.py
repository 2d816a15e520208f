"""``wide.accelerate(model)``: run a routed model on the routed kernels, with a static KV cache.

The HF model stays as it is (its hooks give the masked PyTorch path, which is what training,
evaluation and ``model.generate()`` use). ``accelerate`` builds an :class:`AcceleratedModel`
beside it that shares its weights and has its own forward, in the gpt-fast style:

* a preallocated KV cache ``[B, max_len, Hkv, D]`` per layer, written in place, so the decode
  step has fixed shapes and is captured once per (batch, cache length) in a CUDA graph;
* batched prompts are right-padded and carry per-sequence lengths (``q_lens``/``k_lens`` in
  prefill, ``seq_lens`` in decode, one RoPE position per sequence), so each sequence sees
  exactly the keys and positions it would see alone;
* per layer and module the router runs once per step on the same input as in the HF path
  (residual or normed, per the config) and gives one bool mask ``[tokens, groups]``; one
  :class:`~wide.kernels.RouteIndex` of it serves Q (``gemm_mn``) and O (``gemm_k``), another
  gate/up (``ffn_up``) and down (``gemm_k``). K/V projections run dense on every token (every
  token's keys are needed by later tokens) and go to the cache; attention runs on
  ``prefill_attention`` / ``decode_attention``, which skip inactive head groups.

What runs each step is the engine's ops object (:mod:`wide.engine.ops`), chosen once at construction
from the backend and mode; the layer loops below call it unconditionally. ``"triton"`` (CUDA
with compute capability >= 8.0, or the CPU under ``TRITON_INTERPRET=1`` for tests) runs the
kernels of :mod:`wide.kernels`: besides the routed GEMMs and attention, fused residual + RMSNorm
+ router, a prefill router, RoPE + cache write (with Qwen2's q/k/v biases and Qwen3's q/k norms)
and SiLU*up, which cut decode's ~50 tiny launches per layer down and round where HF rounds.
``"torch"`` runs the same computation with dense matmuls and masks. ``mode="dense"`` runs the
same engine with no routing (fused QKV and gate/up matmuls, SDPA prefill, flash decoding): the
baseline the end-to-end benchmark divides by. Modes:

* ``"coarse"`` (``"routed"``, its earlier name, is kept as ``engine.mode``): the routers' groups
  in prefill and decode, as above.
* ``"fine"``: per-element activation sparsity (TEAL / WINA / learned thresholds, the
  checkpoint's ``model.wide_fine``) at decode, dense prefill; routers are not run.
* ``"hybrid"``: routed prefill exactly as ``"coarse"``, and decode steps that skip the routed
  groups and, inside the kept ones, the input elements under their thresholds.
* ``"dense"``: the baseline above.
* ``"auto"``: one of the above, chosen once at construction from what the model carries
  (:func:`auto_mode`): routers and per-element thresholds run hybrid, thresholds alone fine,
  routers alone coarse, neither dense; ``engine.mode`` is the chosen mode and
  ``engine.requested_mode`` ``"auto"``.

The fine and hybrid decode ops are :mod:`wide.engine.fine_engine`'s (which says how the router mask
and the thresholds compose, and what batches above 4 tokens a step run). The routing rule (per
token, tiles of positions for routers trained with ``route_tile``, or batch-shared decode) is a
:mod:`wide.engine.routing_rules` object, also chosen once, that turns the routers' decisions into the
masks the ops run.

Module paths, norms, biases and q/k norms come from the model's :class:`~wide.base.arch.ArchSpec`;
what the spec or the kernels cannot run is refused with a ``ValueError`` at construction (or,
for a sliding window shorter than the cache, at :meth:`AcceleratedModel.setup_cache`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..base import arch
from ..base.timing import replay_times_ms
from .fine_engine import MAX_T, NO_THRESHOLDS, make_decode_ops
from .graphs import GraphCapture
from .modes import ALIASES, AUTO, FINE_SUMS, MODES, auto_mode, carried_mode  # noqa: F401 (public here too)
from ..method.fine import get_fine
from ..method.geometry import Geometry
from ..method.state import get_state
from .ops import make_ops, pick_backend
from .routing_rules import make_rule
from .sampling import GenerationResult, check_sampling, cut_at_eos, eos_tensor, sample_logits

__all__ = ["AcceleratedModel", "accelerate", "generate", "GenerationResult", "sample_logits",
           "PREFILL_GRAPH_MAX_TOKENS", "prefill_graphs_enabled", "AUTO", "auto_mode", "carried_mode"]

# Prompts up to this many tokens (batch x length, rounded up to 128 per sequence) prefill by
# CUDA-graph replay; longer ones are GPU-bound and run eagerly (see AcceleratedModel.prefill).
PREFILL_GRAPH_MAX_TOKENS = 2048

BACKENDS = ("auto", "triton", "torch")
UNTHRESHOLDED = {"fine": "dense", "hybrid": "routed"}  # decode_path's other step: the mode's prefill ops
log = logging.getLogger(__name__)


def prefill_graphs_enabled() -> bool:
    """Short prefills replay CUDA graphs unless ``WIDE_PREFILL_GRAPHS=0``."""
    return os.environ.get("WIDE_PREFILL_GRAPHS", "1") != "0"


@dataclass
class _Layer:
    """One decoder layer's weights, shared with the HF model (the concatenations are copies)."""

    attn_norm: nn.Module
    ffn_norm: nn.Module
    wq: torch.Tensor
    wkv: torch.Tensor  # [2*Hkv*D, H], k rows then v rows
    wo: torch.Tensor
    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor
    wqkv: Optional[torch.Tensor] = None  # [wq; wk; wv]: dense engine, and routed decode
    wqkv_cublas: Optional[torch.Tensor] = None  # [wq; wk; wv] for cuBLAS alone: hybrid's view of its layout
    wgu: Optional[torch.Tensor] = None  # [wg; wu]: dense engine, and FFNs no router routes
    bq: Optional[torch.Tensor] = None  # q/k/v biases (Qwen2): bq, bkv views of bqkv
    bkv: Optional[torch.Tensor] = None
    bqkv: Optional[torch.Tensor] = None
    q_norm: Optional[nn.Module] = None  # per-head q/k RMSNorms before RoPE (Qwen3)
    k_norm: Optional[nn.Module] = None
    qk_norm: Optional[torch.Tensor] = None  # [q_norm.weight; k_norm.weight], for the kernels
    qk_eps: float = 0.0
    routers: dict = field(default_factory=dict)  # kind -> TokenRouter (or None)
    fine: Optional[object] = None  # wide.engine.fine_engine.FineLayer: thresholds, transposed weights (fine, hybrid)

    def norm(self, kind: str) -> nn.Module:
        return self.attn_norm if kind == "attn" else self.ffn_norm


def _plain(layer: nn.Module, spec: arch.ArchSpec, role: str, idx: int, contiguous: bool = False):
    """(weight, bias or None) of a projection; refuses what the fast path cannot run. The
    weight is an alias of the parameter's present storage, which an engine that later points
    the parameter elsewhere (:func:`~wide.base.arch.share_projection_weights`) leaves alone;
    ``contiguous``: a row-major copy where another engine left a view of its transposed layout."""
    mod = arch.projection(layer, spec, role)
    name = spec.projections[role][1]
    if not isinstance(mod, nn.Linear) or hasattr(mod, "lora_A") or hasattr(mod, "base_layer"):
        raise ValueError(f"layer {idx} {name} is a {type(mod).__name__}, not a plain nn.Linear: "
                         "merge LoRA adapters (wide.training.recovery) before wide.accelerate")
    if mod.bias is not None and role not in spec.bias_ok:
        allowed = ", ".join(spec.bias_ok) or "none"
        raise ValueError(f"layer {idx} {name} has a bias; wide.accelerate runs {spec.model_type} "
                         f"projections with biases only on q/k/v as the spec allows ({allowed})")
    w = mod.weight.detach()
    return (w.contiguous() if contiguous else w), mod.bias


def _sliding_window(cfg) -> Optional[int]:
    """The attention window a config applies (Mistral, or Qwen2/3 with use_sliding_window), or
    None when every layer attends to the whole causal prefix."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


class AcceleratedModel:
    """Static-cache inference engine over a wrapped (or, for ``mode="dense"``, any) HF model of
    a family whose :class:`~wide.base.arch.ArchSpec` has ``engine=True`` (Llama, Mistral, Qwen2,
    Qwen3). Shares the HF model's weights; see the module docstring."""

    def __init__(self, model, backend: str = "auto", mode: str = "coarse",
                 cuda_graphs: bool = True, batch_shared: bool = False, fine_max_batch: Optional[int] = None,
                 fine_sums: str = "fp32"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if mode != AUTO and mode not in MODES and mode not in ALIASES:
            raise ValueError(f"mode must be one of {', '.join((AUTO, *MODES))} (or routed, coarse's earlier name), "
                             f"got {mode!r}")
        self.requested_mode = mode
        if mode == AUTO:
            mode = auto_mode(model)
            log.info("mode auto: %s, from what the model carries", mode)
        mode = "routed" if ALIASES.get(mode, mode) == "coarse" else mode
        routes = mode in ("routed", "hybrid")
        if mode in ("fine", "hybrid") and get_fine(model) is None:
            raise ValueError(NO_THRESHOLDS.format(mode=mode))
        cfg = model.config
        spec = arch.spec_for(model)
        if not spec.engine:
            raise ValueError(f"wide.accelerate does not run {spec.model_type!r} models (ArchSpec.engine is "
                             "False), so `wide generate` cannot serve them; in Python, call generate() on the "
                             "wrapped model itself (wide.from_pretrained(...).generate(...))")
        act = getattr(cfg, "hidden_act", spec.activation)
        if spec.activation != "silu" or act != "silu":
            raise ValueError(f"wide.accelerate needs a SiLU-gated MLP, got hidden_act={act!r}")
        if spec.embed_scale is not None:
            raise ValueError(f"wide.accelerate does not scale embeddings ({spec.model_type} multiplies "
                             f"them by {spec.embed_scale})")
        self.model = model
        self.mode = mode
        self.state = get_state(model) if routes else getattr(model, "wide_state", None)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {self.dtype}: use float32, float16 or bfloat16")
        self.num_heads = cfg.num_attention_heads
        self.num_kv = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden = cfg.hidden_size
        self.inter = cfg.intermediate_size
        self.window = _sliding_window(cfg)
        if fine_max_batch is not None and (mode not in ("fine", "hybrid") or isinstance(fine_max_batch, bool)
                                           or not isinstance(fine_max_batch, int) or fine_max_batch < 0):
            raise ValueError(f"fine_max_batch is an int >= 0 for modes fine and hybrid (None: measured), got "
                             f"{fine_max_batch!r} with mode {mode}")
        self.fine_max_batch = fine_max_batch
        if fine_sums not in FINE_SUMS:
            raise ValueError(f"fine_sums must be one of {FINE_SUMS}, got {fine_sums!r}")
        self.fine_sums = fine_sums  # read by the fine decode ops at every eager step (and capture)
        if batch_shared and not routes:
            raise ValueError(f"batch_shared is a routed-engine option (modes coarse and hybrid), not mode {mode}")
        if self.state is not None and routes:
            geo: Geometry = self.state.geometry
            self.attn_gs = geo.attn_group_size
            self.ffn_gs = geo.ffn_group_size
            self.attn_groups, self.ffn_groups = geo.attn_groups, geo.ffn_groups
            self.cfg = self.state.config
        else:
            self.attn_gs = self.num_heads // self.num_kv
            self.attn_groups = self.num_kv
            self.ffn_gs, self.ffn_groups, self.cfg = self.inter, 1, None
        self.backend = pick_backend(backend, self.device, self.dtype, self.head_dim,
                                    self.ffn_gs if routes else None, self.inter)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.embed, self.final_norm, self.lm_head, self.rotary = (
            arch.require_path(model, path, spec) for path in (spec.embed, spec.final_norm, spec.lm_head, spec.rotary))
        self.layers = [self._layer(layer, spec, i) for i, layer in enumerate(arch.decoder_layers(model))]
        self.ops = make_ops(self)
        # Decode's ops: the same object except where decode applies per-element thresholds.
        self.fine = None  # wide.engine.fine_engine.FineThresholds of a fine or hybrid engine
        self.decode_ops = make_decode_ops(self) if mode in ("fine", "hybrid") else self.ops
        self._paths = {}  # batch size -> the thresholds or the prefill ops (UNTHRESHOLDED): decode_path
        if mode in ("fine", "hybrid") and self.backend == "torch" and self.device.type == "cpu":
            log.info("the Triton kernels need a CUDA GPU: this %s engine runs the PyTorch path", mode)
        # The routing rule (per token, tiles, batch-shared decode): chosen once, called always.
        self.rule = make_rule(self, batch_shared)
        self.routing = None if self.cfg is None else self.rule.name
        self._cache_key = None
        self._graphs = {}
        self._prefill_pool = None  # one memory pool for every prefill graph
        self._capture = GraphCapture(self.device)  # every capture on one stream (pool reuse)
        self._rope_len = 0

    # -------------------------------------------------------------- set-up and checks

    def _layer(self, layer: nn.Module, spec: arch.ArchSpec, i: int) -> _Layer:
        arch.check_layer(layer, spec, i)
        # the routed kernels read [N, K] rows; cuBLAS takes either orientation
        rows = self.mode in ("routed", "hybrid") and self.backend == "triton"
        (wq, bq), (wk, bk), (wv, bv) = (_plain(layer, spec, r, i, rows) for r in ("q", "k", "v"))
        wo, wg, wu, wd = (_plain(layer, spec, r, i, rows)[0] for r in ("o", "gate", "up", "down"))
        wqkv = None
        laid_out = self.mode in ("fine", "hybrid") and self.backend == "triton"
        if laid_out:
            wkv = None  # fine_engine lays q|k|v out as one weight and points these (hybrid: k|v) at it
        elif self.mode == "dense" or self._fuse_qkv():
            # One weight tensor for q/k/v, with wq and wkv as row views of it: the dense engine
            # runs one GEMM for them (as gpt-fast does), routed decode one gemm_mn launch of
            # routed Q with K/V as always-on groups (dense_tail).
            wqkv = torch.cat([wq, wk, wv]).detach()
            wq, wkv = wqkv[:wq.shape[0]], wqkv[wq.shape[0]:]
            if self.mode == "dense":  # one copy of the weights, as the fine engine keeps
                arch.share_projection_weights(layer, spec, {"q": wq, "k": wkv[:wk.shape[0]],
                                                            "v": wkv[wk.shape[0]:]})
        else:
            wkv = torch.cat([wk, wv]).detach()
        L = _Layer(arch.module_norm(layer, spec, "attn"), arch.module_norm(layer, spec, "ffn"),
                   wq, wkv, wo, wg, wu, wd, wqkv=wqkv)
        if any(b is not None for b in (bq, bk, bv)):
            parts = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in ((bq, wq), (bk, wk), (bv, wv))]
            L.bqkv = torch.cat(parts).detach()
            L.bq, L.bkv = L.bqkv[:wq.shape[0]], L.bqkv[wq.shape[0]:]
        if spec.q_norm:
            attn = getattr(layer, spec.attn)
            L.q_norm, L.k_norm = getattr(attn, spec.q_norm), getattr(attn, spec.k_norm)
            L.qk_norm = torch.cat([L.q_norm.weight, L.k_norm.weight]).detach()
            L.qk_eps = L.q_norm.variance_epsilon
        if self.mode == "dense" or (self.cfg is not None and not self.cfg.routes_ffn and not laid_out):
            # one gate|up GEMM on one copy where nothing routes the FFN (laid out: fine_engine's views)
            L.wgu = torch.cat([wg, wu]).detach()
            L.wg, L.wu = L.wgu[:wg.shape[0]], L.wgu[wg.shape[0]:]
            arch.share_projection_weights(layer, spec, {"gate": L.wg, "up": L.wu})
        if self.cfg is not None:
            lr = self.model.wide_routers[i]
            L.routers = {"attn": lr.router("attn"), "ffn": lr.router("ffn")}
        return L

    def _fuse_qkv(self) -> bool:
        """Whether routed decode can append K/V to Q as whole always-on groups (not when a GQA
        pack's columns do not divide K/V's, e.g. Qwen2.5-7B: 896 and 1024)."""
        if self.mode != "routed" or self.backend != "triton" or self.state is None:
            return False
        gcols = self.attn_gs * self.head_dim
        return (2 * self.num_kv * self.head_dim) % gcols == 0

    def _ensure_rope(self, n: int) -> None:
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        pos = torch.arange(n, device=self.device)[None]
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [n, D]
        self._rope_len = n

    @property
    def mode_name(self) -> str:
        """The mode as ``wide.accelerate`` and the records name it (``coarse`` for ``routed``)."""
        return ALIASES.get(self.mode, self.mode)

    def refresh_thresholds(self) -> None:
        """Read ``model.wide_fine`` again (fine and hybrid modes; :meth:`setup_cache` and so
        :meth:`generate` call it): the kernels of captured graphs see the new values."""
        if self.fine is None:
            return
        before = self.fine.th.clone()
        if self.fine.refresh():
            self._graphs.clear()  # a layer's launches changed (scales or thresholds now differ)
        if not torch.equal(before, self.fine.th):
            self._paths.clear()  # new thresholds, new speed: measure the paths again

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate the static KV cache (a no-op if one of this size exists)."""
        self.refresh_thresholds()
        key = (batch, max_len)
        if self._cache_key == key:
            return
        if self.window is not None and max_len > self.window:
            raise ValueError(f"this model attends within a sliding window of {self.window} tokens and "
                             f"the engine's kernels attend to the whole prefix: a cache of {max_len} "
                             f"positions would give other tokens than the model; keep prompt + new "
                             f"tokens within {self.window} or use the HF model's generate()")
        self._graphs.clear()
        self._prefill_pool = None
        self.k_cache = self.v_cache = None
        shape = (batch, max_len, self.num_kv, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self._cache_key = key
        self._ensure_rope(max_len)
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.rule.setup(self, batch)

    def free_cache(self) -> None:
        self._graphs.clear()
        self._prefill_pool = None
        self.k_cache = self.v_cache = None
        self._cache_key = None

    # -------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lens: Optional[torch.Tensor] = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run right-padded prompts ``ids [B, T]`` with lengths ``lens [B]`` through the model,
        writing their keys/values to cache positions 0..len-1. Returns logits at each
        sequence's last prompt token [B, V] (or [B, T, V] with ``all_logits``).

        Short prompts (B x T <= PREFILL_GRAPH_MAX_TOKENS) replay a CUDA graph from the second
        prefill of a (B, T rounded up to 128) bucket on (the first runs eagerly, so a one-off
        prompt pays no capture): there the ~20 launches per layer cost more host time than the
        GPU needs, as in decode (a 1k-token routed prefill on an H200: 29-54 ms of wall time
        eagerly, 21.9 ms replayed). The returned logits are then a graph buffer, overwritten by
        the next prefill of any length (clone them to keep them); positions T..bucket-1 of the
        cache get padding keys, which no sequence reads (they lie past its length).
        ``WIDE_PREFILL_GRAPHS=0`` turns it off."""
        B, T = ids.shape
        if self._cache_key is None or self._cache_key[0] != B or self._cache_key[1] < T:
            raise ValueError(f"call setup_cache(batch={B}, max_len>={T}) first")
        Tb = -(-T // 128) * 128
        key = ("prefill", B, Tb)
        if (self.cuda_graphs and not all_logits and B * Tb <= PREFILL_GRAPH_MAX_TOKENS
                and Tb <= self._cache_key[1] and getattr(self.state, "mask_fn", None) is None
                and prefill_graphs_enabled()):
            if key in self._graphs:
                return self._prefill_graphed(ids, lens, key)
            self._graphs[key] = None  # seen once: capture on the next prefill of this bucket
        return self._prefill_eager(ids, lens, all_logits)

    def _prefill_graphed(self, ids: torch.Tensor, lens: Optional[torch.Tensor], key: tuple):
        _, B, Tb = key
        T = ids.shape[1]
        g = self._graphs[key]
        if g is None:  # static inputs, filled below before the capture's warm-up reads them
            ids_buf = torch.empty(B, Tb, dtype=torch.long, device=self.device)
            lens_buf = torch.empty(B, dtype=torch.long, device=self.device)
        else:
            graph, out, ids_buf, lens_buf = g
        ids_buf[:, :T].copy_(ids)
        ids_buf[:, T:].zero_()
        if lens is None:
            lens_buf.fill_(T)
        else:
            lens_buf.copy_(lens)
        if g is None:
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph, out = self._capture(lambda: self._prefill_eager(ids_buf, lens_buf),
                                       pool=self._prefill_pool)
            self._graphs[key] = (graph, out, ids_buf, lens_buf)
        graph.replay()
        return out

    @torch.no_grad()
    def _prefill_eager(self, ids: torch.Tensor, lens: Optional[torch.Tensor] = None,
                       all_logits: bool = False) -> torch.Tensor:
        ops = self.ops
        B, T = ids.shape
        # Without lens every row is a prompt token: valid is None and the rules skip their
        # masking ops, which an eager long prefill issues one launch at a time per module.
        valid = None
        if lens is None:
            lens = torch.full((B,), T, dtype=torch.long, device=self.device)
        else:
            lens = lens.to(self.device)
            valid = torch.arange(T, device=self.device)[None, :] < lens[:, None]
        lens32 = lens.to(torch.int32)
        rule = self.rule
        ops.row_runs = rule.prefill_runs()
        x = self.embed(ids)
        delta = None  # the previous layer's FFN output, added to x inside the next norm
        for i, L in enumerate(self.layers):
            x, h = ops.norm(L.attn_norm, x, delta)
            ma = rule.prefill(ops, i, "attn", x, h, valid, lens)  # [B, T, groups] or None: runs dense
            h = h.reshape(B * T, -1)
            route = ops.index(ma)
            q, kv = ops.qkv(L, h, ma, route)
            q, k, v = ops.rope_prefill(i, L, q, kv, B, T)
            o = ops.o_proj(L, ops.attend_prefill(q, k, v, ma, lens32), ma, route)
            x, h = ops.norm(L.ffn_norm, x, o.view(B, T, -1))
            mf = rule.prefill(ops, i, "ffn", x, h, valid, lens, attn=ma)
            delta = ops.ffn(L, h.reshape(B * T, -1), mf).view(B, T, -1)
        if not all_logits:  # only the last prompt token's row goes on
            rows = (torch.arange(B, device=self.device), lens - 1)
            x, delta = x[rows], None if delta is None else delta[rows]
        if delta is not None:
            x = x + delta
        return self.lm_head(self.final_norm.forward(x)).float()

    # -------------------------------------------------------------- decode

    def decode_path(self, B: int) -> str:
        """What a decode step of ``B`` sequences runs: ``"fine"`` (the thresholds; hybrid's
        routers too), ``"dense"`` (a fine engine's dense weights) or ``"routed"`` (a hybrid
        engine's routers alone, as its prefill runs them), ``"main"`` for the other modes. On
        the kernels the thresholds run up to ``fine_max_batch`` sequences or, with None, where
        measured faster (each batch of up to 4, the GEMVs' limit, times both captured steps on
        its first decode); larger batches run the other path: a batch's kept inputs cover about
        every weight row (README; hybrid on thresholded GEMMs ran 0.72-0.84x dense at B = 8, 32)."""
        if self.fine is None:
            return "main"
        if self.backend != "triton":
            return "fine"
        other = UNTHRESHOLDED[self.mode]
        if self.fine_max_batch is not None:
            return "fine" if B <= self.fine_max_batch else other
        if self.device.type != "cuda":
            return "fine"
        return other if B > MAX_T else self._paths.get(B, "fine")

    def _decode_eager(self, tok: torch.Tensor, pos: torch.Tensor, record: Optional[list] = None,
                      reuse: bool = False):
        """One new token per sequence at cache position ``pos`` [B]; returns logits [B, V].
        ``reuse``: the rule holds every mask of this step (``rule.reuses``): no router runs."""
        ops = self.decode_ops if self.decode_path(tok.shape[0]) in ("fine", "main") else self.ops
        ops.record = record
        x = self.embed(tok)
        delta = None
        seq_lens = (pos + 1).to(torch.int32)
        rule = self.rule
        rule.begin_decode(pos, reuse)  # first: what the rule asks of the router may depend on the batch
        # Batch 1 on the kernels: the q and gate/up GEMVs finish the router and write the masks
        # (per module, not where the rule changes the mask after the router).
        defer = ops.defer_router()
        defer_attn, defer_ffn = (defer and rule.defers_router(k) for k in ("attn", "ffn"))
        margins_attn, margins_ffn = (rule.wants_margins(k) for k in ("attn", "ffn"))
        ops.row_runs = rule.decode_runs(x.shape[0])
        route = rule.norm_routes(reuse)
        for i, L in enumerate(self.layers):
            x, h, ma, router = ops.norm_route(i, "attn", x, delta, defer=defer_attn, margins=margins_attn,
                                              route=route, sums=rule.norm_sums(i, "attn"))
            ma = rule.decode(ops, i, "attn", ma, pos, x, h)
            index = ops.index(ma)
            q, kv = ops.qkv(L, h, ma, index, router, fused=True)
            q = ops.rope_decode(i, L, q, kv, pos)
            o = ops.o_proj(L, ops.attend_decode(i, q, ma, seq_lens), ma, index)
            x, h, mf, router = ops.norm_route(i, "ffn", x, o, attn=ma, defer=defer_ffn, margins=margins_ffn,
                                              route=route, sums=rule.norm_sums(i, "ffn"))
            mf = rule.decode(ops, i, "ffn", mf, pos, x, h, attn=ma)
            delta = ops.ffn(L, h, mf, router)
            if record is not None:
                record += [(i, "attn", ma), (i, "ffn", mf)]
        return self.lm_head(ops.final_norm(x, delta)).float()

    @torch.no_grad()
    def decode(self, tok: torch.Tensor, pos: Optional[torch.Tensor] = None,
               record: Optional[list] = None, positions: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Logits [B, V] for new tokens ``tok [B]`` at positions ``pos`` (default: the
        engine's position buffer, advanced by :meth:`generate`). CUDA-graph replay on GPU.
        ``record`` (a list): the step runs eagerly and appends ``(layer, kind, mask or None)``
        for every module, the masks the kernels used (bool ``[B, groups]``). ``positions``: the
        same positions as host ints, if the caller knows them; a rule that already holds every
        mask there (tiles, inside a tile) then skips the routers."""
        if self._cache_key is None:
            raise ValueError("call setup_cache first")
        if pos is not None:
            self.pos.copy_(pos)
        self.tok.copy_(tok)
        reuse = positions is not None and self.rule.reuses(positions)
        if (record is not None or not self.cuda_graphs
                or getattr(self.state, "mask_fn", None) is not None):  # (a Python mask_fn is not captured)
            return self._decode_eager(self.tok, self.pos, record, reuse)
        B = tok.shape[0]
        if (self.fine is not None and self.backend == "triton" and self.fine_max_batch is None
                and B <= MAX_T and B not in self._paths):
            self._measure_paths(B, reuse)
        g = self._graphs.get((B, reuse, self.decode_path(B)))
        if g is None:
            g = self._capture_decode(B, reuse)
        graph, out = g
        graph.replay()
        return out

    def _capture_decode(self, B: int, reuse: bool):
        g = self._capture(lambda: self._decode_eager(self.tok, self.pos, reuse=reuse),
                          keep=self.rule.step_state())
        self._graphs[(B, reuse, self.decode_path(B))] = g
        return g

    def _measure_paths(self, B: int, reuse: bool, replays: int = 20) -> None:
        """Capture the thresholded step of ``B`` sequences and the other one (dense weights in
        fine, routers alone in hybrid) and keep the faster (median of ``replays`` replays each,
        after two). Both write this step's k/v at the same positions; the step that follows
        rewrites them with the kept path's."""
        times = {}
        for path in ("fine", UNTHRESHOLDED[self.mode]):
            self._paths[B] = path
            graph, _ = self._capture_decode(B, reuse)
            times[path] = statistics.median(replay_times_ms(graph, replays))
        self._paths[B] = min(times, key=times.get)
        log.info("%s engine, decode batch %d: %s: runs %s", self.mode, B,
                 ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()), self._paths[B])

    # -------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id=None, seed: Optional[int] = None,
                 pad_to: Optional[int] = None) -> GenerationResult:
        """Generate for a batch of prompts (lists of token ids, any lengths)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        check_sampling(temperature, top_k, top_p)
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        T = int(lens.max())
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and T + max_new_tokens > positions:
            raise ValueError(f"a prompt of {T} tokens plus {max_new_tokens} new ones exceeds the model's "
                             f"{positions} positions: shorten the prompt or max_new_tokens")
        max_len = max(pad_to or 0, T + max_new_tokens)
        max_len = -(-max_len // 128) * 128  # fewer distinct cache sizes, fewer graph captures
        if self.window is not None and max(pad_to or 0, T + max_new_tokens) <= self.window < max_len:
            max_len = self.window  # the rounding alone must not cross the window
        self.setup_cache(B, max_len)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        same = bool((lens == T).all())  # on the host: no padding, so prefill needs no lengths
        ids, lens = ids.to(self.device), lens.to(self.device)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = eos_tensor(eos_token_id, self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.prefill(ids, None if same else lens)
        tok = sample_logits(logits, temperature, top_k, top_p, gen)
        sync()
        t1 = time.perf_counter()
        out = [tok]
        self.pos.copy_(lens)
        host_pos = [len(p) for p in prompts]  # what self.pos holds, known without a sync
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        if eos is not None:
            done |= torch.isin(tok, eos)
        steps = 0
        for _ in range(max_new_tokens - 1):
            if eos is not None and bool(done.all()):
                break
            logits = self.decode(tok, positions=host_pos)
            self.pos += 1
            host_pos = [p + 1 for p in host_pos]
            tok = sample_logits(logits, temperature, top_k, top_p, gen)
            out.append(tok)
            steps += 1
            if eos is not None:
                done |= torch.isin(tok, eos)
        sync()
        t2 = time.perf_counter()
        seqs = cut_at_eos(torch.stack(out, dim=1).tolist(), eos)
        return GenerationResult(tokens=seqs, ttft_s=t1 - t0, tpot_s=(t2 - t1) / max(steps, 1))

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [B, T, V] of unpadded prompts (for checks against the HF path)."""
        B, T = ids.shape
        if self._cache_key is None or self._cache_key[0] != B or self._cache_key[1] < T:
            self.setup_cache(B, -(-T // 128) * 128)
        return self.prefill(ids.to(self.device), all_logits=True)


def accelerate(model, backend: str = "auto", mode: str = "coarse",
               cuda_graphs: bool = True, batch_shared: bool = False,
               fine_max_batch: Optional[int] = None, fine_sums: str = "fp32") -> AcceleratedModel:
    """Build the static-cache engine for a wrapped model (see the module docstring).

    ``mode``: ``"coarse"`` (``"routed"``), ``"fine"``, ``"hybrid"``, ``"dense"`` or ``"auto"``
    (the one that runs what the model carries: :func:`auto_mode`). Fine and
    hybrid decode with the model's per-element thresholds (``model.wide_fine``: a router
    checkpoint's thresholds.safetensors, or :mod:`wide.fine`); a model without them is refused.
    Their thresholds are read at construction and by every :meth:`AcceleratedModel.setup_cache`
    (``refresh_thresholds``). On the Triton backend the decode GEMVs read the weights
    transposed (:func:`~wide.kernels.fine_gemv.fine_layout`): a ``fine`` engine keeps that
    layout alone, pointing the model's projection weights at it (same values; the prefill and
    dense steps run cuBLAS on it), so it holds one copy of the weights, as the dense engine
    does; ``hybrid`` keeps row-major copies beside it where its routers route (attention only:
    the FFN has one copy).
    ``fine_max_batch``: decode batches of up to this many sequences run the thresholds, larger
    ones the dense weights (fine) or the routers alone (hybrid) (None: measured per batch size
    on CUDA, thresholds everywhere elsewhere; :meth:`AcceleratedModel.decode_path`); more than 4
    that run the thresholds run GEMMs on the thresholded inputs. ``fine_sums`` (``fine`` and
    ``hybrid`` on the Triton backend): ``"fp32"`` (default) lets the q|k|v, o and down GEMVs of
    a thresholded step add into fp32 sums that the RoPE launch and the next norm round and read
    (the same values, no rounding epilogues; not under deterministic algorithms); ``"rounded"``:
    each GEMV rounds its own output (TPOT at batch 1, Llama-3.1-8B shapes, 50 %, one H100: 1.62x
    the dense engine with fp32 sums, 1.54x rounded; bench/results/h100/e2e_fine.md).

    ``batch_shared``: every decode step runs one group set per layer and module for the whole
    batch (:mod:`wide.engine.routing_rules`), so it reads only those groups' weights; a sequence's
    output then depends on the sequences batched with it. Routers trained with ``route_tile``
    share masks over tiles of positions, in prefill and decode alike.

    The HF model is not modified: ``model(...)`` and ``model.generate(...)`` keep running the
    masked PyTorch path. The engine is also kept as ``model.wide_engine`` for
    :func:`generate`.
    """
    engine = AcceleratedModel(model, backend=backend, mode=mode, cuda_graphs=cuda_graphs,
                              batch_shared=batch_shared, fine_max_batch=fine_max_batch, fine_sums=fine_sums)
    if engine.mode == "routed":
        model.wide_engine = engine
    return engine


def generate(model, tokenizer_or_ids, prompts=None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id=None, seed: Optional[int] = None) -> GenerationResult:
    """Generate with the accelerated engine.

    ``model``: a wrapped HF model (accelerated on first use) or an :class:`AcceleratedModel`.
    ``tokenizer_or_ids``: a tokenizer (then ``prompts`` is a string or list of strings and the
    result carries ``texts``), or the prompts as token ids: a 1-D/2-D tensor, a list of ints or
    a list of lists of ints (any lengths).
    """
    engine = model if isinstance(model, AcceleratedModel) else (
        getattr(model, "wide_engine", None) or accelerate(model))
    tokenizer = None
    if hasattr(tokenizer_or_ids, "encode") and not isinstance(tokenizer_or_ids, torch.Tensor):
        tokenizer = tokenizer_or_ids
        if prompts is None:
            raise ValueError("give the prompts (a string or list of strings) with the tokenizer")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [tokenizer.encode(t) for t in texts]
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    else:
        ids = _as_id_lists(tokenizer_or_ids)
    res = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, eos_token_id=eos_token_id, seed=seed)
    if tokenizer is not None:
        res.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
    return res


def _as_id_lists(x) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() == 1:
            return [x.tolist()]
        if x.dim() == 2:
            return x.tolist()
        raise ValueError(f"token id tensor must be 1-D or 2-D, got {x.dim()}-D")
    x = list(x)
    if x and all(isinstance(t, int) for t in x):
        return [x]
    if x and all(isinstance(p, (list, tuple, torch.Tensor)) for p in x):
        return [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in x]
    raise ValueError("prompts must be token ids (tensor, list of ints or list of lists) or come "
                     "with a tokenizer")
