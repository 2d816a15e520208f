"""Mask reordering on the device: per-group compact token lists and per-tile group lists.

A routing mask is a bool tensor ``[T, n_groups]`` (True = the group runs for that token).
:class:`RouteIndex` wraps one mask and derives, lazily and without any host synchronisation
(so a whole layer can be captured in a CUDA graph), what the routed kernels need:

* ``idx [n_groups, T] int32`` and ``counts [n_groups] int32``: for each group the *stable*
  list of its active tokens, followed by its inactive tokens (also in order). Entries
  ``idx[g, :counts[g]]`` are the active tokens; ``idx[g]`` as a whole is a permutation of
  ``0..T-1``. Used by output-width routing (``gemm_mn``, ``ffn_up``): a tile of rows
  ``idx[g, m0:m0+BM]`` holds only active tokens (block-level skipping), except the one tile
  that straddles ``counts[g]``, whose inactive rows are masked (intra-block skipping). Tiles
  wholly past ``counts[g]`` only write zeros, so the output needs no memset.
* ``token_tiles(block_m)`` -> ``(perm, tile_groups, tile_counts)``: tokens reordered by mask
  pattern (when there are few groups), cut into tiles of ``block_m`` rows, and for each tile
  the list of groups with at least one active token. Used by reduction-width routing
  (``gemm_k``), whose output rows must stay fixed over the whole reduction.
* ``used_groups()`` -> ``(groups [n_groups] int32, count [1] int32)``: the groups active for
  at least one token, ascending, then the unused ones (a permutation of ``0..n_groups-1``);
  one single-program launch. The decode path of ``gemm_k`` loops over exactly this list, but
  derives it in its own prologue (in registers) to save the launch.

Share one ``RouteIndex`` between operators that use the same mask (FFN gate/up and down;
attention Q and O): each derived tensor is computed once and cached on the object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl


__all__ = ["RouteIndex", "RouterPartials", "build_route", "route_reference",
           "used_groups_reference", "group_runs"]

# Tokens at or below this count take the "direct" (decode) path: rows are the tokens
# themselves with a per-row mask, so no reordering launch is needed.
DIRECT_MAX_T = 16
# Sorting tokens by mask pattern only helps when the pattern has few bits (a tile of
# BM sorted tokens is homogeneous in the leading log2(T/BM) groups). Keys are int64.
SORT_MAX_GROUPS = 62
# Split-K factor of the batch-1 GEMV kernels under the interpreter: 1 keeps the many tiny
# decode steps of the CPU tests fast (each program costs milliseconds there); the kernel
# tests set 2 to run the split path.
INTERPRET_GEMV_SPLIT = 1


# Split-K tickets (and fp32 accumulators), per (kind, device, stream): zero between launches
# (the last program of a tile re-arms its counter, clears its sums), so one buffer serves every launch on a stream and graph replays. A
# grown buffer replaces the cached one, but every buffer stays alive: a captured graph keeps
# using the address it was captured with.
_TICKETS: Dict = {}
_TICKETS_KEEP: list = []


def _stream_buffer(kind: str, device: torch.device, n: int, dtype: torch.dtype) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (kind, str(device), stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(int(n), 4096), dtype=dtype, device=device)
        _TICKETS[key] = buf
        _TICKETS_KEEP.append((kind, buf))
    return buf


def raised_counters() -> int:
    """Sum of |value| over every ticket and atomic-sum buffer made so far: 0 between launches
    when every split-K reduction re-armed its counters and cleared its sums (a GPU check). The
    compacting GEMVs' row lists are scratch and hold row indices, so they are not counted."""
    return sum(int(b.abs().sum()) for kind, b in _TICKETS_KEEP if kind in ("tickets", "accumulator"))


def split_tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters for the split-K programs of one launch on the
    current stream (see ``_splitk_store`` in gemm_mn)."""
    return _stream_buffer("tickets", device, n, torch.int32)


def zeroed_accumulator(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` fp32 zeros that split-K programs add into atomically; the program that
    reads a slice's sum writes zeros back, so the buffer is zero again between launches, as
    the tickets are."""
    return _stream_buffer("accumulator", device, n, torch.float32)


def row_lists(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 scratch slots where each program of a compacting GEMV lists the rows
    it reads; written before read within one program, so nothing needs clearing."""
    return _stream_buffer("rows", device, n, torch.int32)


def fresh_split_tickets(device: torch.device, stream) -> None:
    """Let the next split-K launch on ``stream`` allocate its own ticket buffer (and
    accumulator). Call it before the warm-up that precedes a capture: a graph replays on
    whatever stream its caller uses, so two graphs captured on one (pooled) stream must not
    share counters; a ticket left raised by a race would stop that tile from ever being
    reduced again."""
    for kind in ("tickets", "accumulator", "rows"):
        _TICKETS.pop((kind, str(device), stream.cuda_stream), None)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def check_group_size(dim: int, group_size, what: str) -> int:
    """Validate ``group_size`` against a routed dimension and return the number of groups."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0 or group_size % 16 != 0:
        raise ValueError(f"group_size must be a positive multiple of 16, got {group_size}")
    if dim % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide {what}={dim}")
    return dim // group_size


def check_mask(mask, num_tokens: int, num_groups: int, device=None) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if tuple(mask.shape) != (num_tokens, num_groups):
        raise ValueError(
            f"mask must have shape [T, n_groups] = [{num_tokens}, {num_groups}], got {list(mask.shape)}")
    if device is not None and mask.device != torch.device(device):
        raise ValueError(f"mask is on {mask.device}, expected {device}")
    return mask


@triton.jit
def group_runs(logit_exec, logit_skip, offset):
    # The inference rule of every router, for the kernels that decide (norm_route, router_mask,
    # gemm_mn's batch-1 GEMV): a group runs iff logit_exec - logit_skip + offset >= 0. The same
    # expression, in the same order, is TokenRouter.margin + wide.method.routers.group_runs; keep
    # the two identical, or kernel and module decisions drift apart at the threshold.
    return (logit_exec - logit_skip + offset) >= 0


@triton.jit
def _route_kernel(mask_ptr, idx_ptr, counts_ptr, T, stride_mt, BLOCK_T: tl.constexpr):
    # One program per group. Two passes over the (small) mask column: the first counts the
    # active tokens so the second can place inactive tokens right after them.
    g = tl.program_id(0)
    cnt = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = tl.load(mask_ptr + t * stride_mt + g, mask=t < T, other=0).to(tl.int32)
        cnt += tl.sum(m, axis=0)
    n_act = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        valid = t < T
        m = tl.load(mask_ptr + t * stride_mt + g, mask=valid, other=0).to(tl.int32)
        c = tl.cumsum(m, axis=0)  # inclusive count of actives within the chunk
        pos = tl.where(m != 0, n_act + c - 1, cnt + t - (n_act + c))
        tl.store(idx_ptr + g * T + pos, t, mask=valid)
        n_act += tl.sum(m, axis=0)
    tl.store(counts_ptr + g, cnt)


@triton.jit
def _tile_groups_kernel(mask_ptr, perm_ptr, tg_ptr, tc_ptr, T, NG, stride_mt,
                        BM: tl.constexpr, RB: tl.constexpr, NG_PAD: tl.constexpr,
                        HAS_PERM: tl.constexpr):
    pid = tl.program_id(0)
    gs = tl.arange(0, NG_PAD)
    g_ok = gs < NG
    flags = tl.zeros([NG_PAD], dtype=tl.int32)
    for r0 in range(0, BM, RB):
        r = pid * BM + r0 + tl.arange(0, RB)
        r_ok = r < T
        if HAS_PERM:
            tok = tl.load(perm_ptr + r, mask=r_ok, other=0)
        else:
            tok = r
        m = tl.load(mask_ptr + tok[:, None] * stride_mt + gs[None, :],
                    mask=r_ok[:, None] & g_ok[None, :], other=0).to(tl.int32)
        flags = tl.maximum(flags, tl.max(m, axis=0))
    c = tl.cumsum(flags, axis=0)
    tl.store(tg_ptr + pid * NG + c - 1, gs, mask=flags > 0)
    tl.store(tc_ptr + pid, tl.sum(flags, axis=0))


@triton.jit
def _used_groups_kernel(mask_ptr, ug_ptr, uc_ptr, T, NG, stride_mt,
                        RB: tl.constexpr, NG_PAD: tl.constexpr):
    # One program: OR the mask over the tokens, then place the used groups first (ascending)
    # and the unused ones after them, so the list is a permutation and fully written.
    gs = tl.arange(0, NG_PAD)
    g_ok = gs < NG
    flags = tl.zeros([NG_PAD], dtype=tl.int32)
    for r0 in range(0, T, RB):
        r = r0 + tl.arange(0, RB)
        r_ok = r < T
        m = tl.load(mask_ptr + r[:, None] * stride_mt + gs[None, :],
                    mask=r_ok[:, None] & g_ok[None, :], other=0).to(tl.int32)
        flags = tl.maximum(flags, tl.max(m, axis=0))
    c = tl.cumsum(flags, axis=0)  # inclusive count of used groups up to g
    cnt = tl.sum(flags, axis=0)
    pos = tl.where(flags > 0, c - 1, cnt + gs - c)
    tl.store(ug_ptr + pos, gs, mask=g_ok)
    tl.store(uc_ptr, cnt)


@dataclass
class RouteIndex:
    """Device-side reordering of one routing mask ``[T, n_groups]`` (bool, True = active).

    Everything is computed lazily on first use, on the mask's device, with no host sync.

    Attributes / methods:
      ``mask``: the bool mask ``[T, n_groups]`` (contiguous).
      ``idx`` ``[n_groups, T] int32``: per group, active tokens (ascending) then inactive ones.
      ``counts`` ``[n_groups] int32``: active tokens per group.
      ``token_tiles(block_m)``: ``(perm [T] int32 or None, tile_groups [n_tiles, n_groups]
      int32, tile_counts [n_tiles] int32)``; ``perm`` orders tokens by mask pattern (None =
      identity); ``tile_groups[i, :tile_counts[i]]`` are the groups active for any token of
      tile ``i`` (rows ``perm[i*block_m : (i+1)*block_m]``), ascending.
      ``used_groups()``: ``(groups [n_groups] int32, count [1] int32)``; ``groups[:count]``
      are the groups active for any token, ascending, followed by the unused groups.
    """

    mask: torch.Tensor
    _cache: Dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not isinstance(self.mask, torch.Tensor) or self.mask.dim() != 2:
            raise ValueError("RouteIndex needs a 2-D bool mask [T, n_groups]")
        if self.mask.dtype != torch.bool:
            raise ValueError(f"mask must have dtype torch.bool, got {self.mask.dtype}")
        self.mask = self.mask.contiguous()

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[0]

    @property
    def num_groups(self) -> int:
        return self.mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.mask.device

    def _mask_u8(self) -> torch.Tensor:
        return self.mask.view(torch.uint8)

    def _build_idx(self):
        T, G = self.mask.shape
        idx = torch.empty((G, T), dtype=torch.int32, device=self.device)
        counts = torch.empty((G,), dtype=torch.int32, device=self.device)
        if T > 0 and G > 0:
            block_t = min(1024, max(16, next_pow2(T)))
            _route_kernel[(G,)](self._mask_u8(), idx, counts, T, G, BLOCK_T=block_t)
        elif G > 0:
            counts.zero_()
        self._cache["idx"] = (idx, counts)

    @property
    def idx(self) -> torch.Tensor:
        if "idx" not in self._cache:
            self._build_idx()
        return self._cache["idx"][0]

    @property
    def counts(self) -> torch.Tensor:
        if "idx" not in self._cache:
            self._build_idx()
        return self._cache["idx"][1]

    def token_perm(self, block_m: int) -> Optional[torch.Tensor]:
        """Tokens sorted (stably) by mask pattern, group 0 as the most significant bit.

        None (identity) when one tile holds all tokens or the pattern is too wide to help.
        """
        T, G = self.mask.shape
        if T <= block_m or G > SORT_MAX_GROUPS or G <= 1:
            return None
        key = ("perm",)
        if key not in self._cache:
            weights = torch.pow(2, torch.arange(G - 1, -1, -1, device=self.device, dtype=torch.int64))
            pattern = (self.mask.to(torch.int64) * weights).sum(dim=1)
            self._cache[key] = torch.argsort(pattern, stable=True).to(torch.int32)
        return self._cache[key]

    def token_tiles(self, block_m: int) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        key = ("tiles", int(block_m))
        if key not in self._cache:
            T, G = self.mask.shape
            perm = self.token_perm(block_m)
            n_tiles = triton.cdiv(T, block_m)
            tg = torch.empty((n_tiles, G), dtype=torch.int32, device=self.device)
            tc = torch.empty((n_tiles,), dtype=torch.int32, device=self.device)
            if n_tiles > 0 and G > 0:
                _tile_groups_kernel[(n_tiles,)](
                    self._mask_u8(), perm if perm is not None else tc, tg, tc, T, G, G,
                    BM=block_m, RB=min(block_m, 16), NG_PAD=max(16, next_pow2(G)),
                    HAS_PERM=perm is not None)
            elif n_tiles > 0:
                tc.zero_()
            self._cache[key] = (perm, tg, tc)
        return self._cache[key]

    def used_groups(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(groups [n_groups] int32, count [1] int32)``: used groups ascending, then unused."""
        if "used" not in self._cache:
            T, G = self.mask.shape
            ug = torch.empty((G,), dtype=torch.int32, device=self.device)
            uc = torch.zeros((1,), dtype=torch.int32, device=self.device)
            if G > 0:
                ng_pad = max(16, next_pow2(G))
                rb = max(2, min(16, 8192 // ng_pad))  # keep the [RB, NG_PAD] tile ~8K elements
                _used_groups_kernel[(1,)](self._mask_u8(), ug, uc, T, G, G, RB=rb, NG_PAD=ng_pad)
            self._cache["used"] = (ug, uc)
        return self._cache["used"]


def build_route(mask: torch.Tensor) -> RouteIndex:
    """Wrap a bool mask ``[T, n_groups]``; derived index tensors are built on first use."""
    return RouteIndex(mask)


@dataclass
class RouterPartials:
    """One token's router, half evaluated, for batch-1 decode: ``partials [n_chunks, R]`` fp32
    sums of the router's first linear over column chunks of its input (the decode norm kernel
    writes them), and the rest of the :class:`~wide.method.routers.TokenRouter` (``down_bias [R]``,
    ``up_weight [2G, R]``, ``up_bias [2G]``, ``offset []``, all fp32). Given to ``gemm_mn`` /
    ``ffn_up``, the kernel finishes the router itself (the group's decision is needed there
    first) and writes the mask for the operators after it. The engine's ``partials`` is a view
    of scratch that the next norm launch overwrites: consume it (in stream order) before that."""
    partials: torch.Tensor
    down_bias: torch.Tensor
    up_weight: torch.Tensor
    up_bias: torch.Tensor
    offset: torch.Tensor

    def check(self, num_groups: int, device) -> None:
        p = self.partials
        if p.dim() != 2 or not p.is_contiguous():
            raise ValueError("router partials must be a contiguous [n_chunks, R] tensor")
        R = p.shape[1]
        if R & (R - 1) or R < 1:
            raise ValueError(f"router rank {R} must be a power of two for the fused decision")
        want = {"partials": (p, tuple(p.shape)), "down_bias": (self.down_bias, (R,)),
                "up_weight": (self.up_weight, (2 * num_groups, R)),
                "up_bias": (self.up_bias, (2 * num_groups,)), "offset": (self.offset, ())}
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device \
                    or not t.is_contiguous():
                raise ValueError(f"router {name} must be a contiguous float32 tensor of shape "
                                 f"{list(shape)} on {device}, got {t.dtype} {list(t.shape)} on {t.device}")


def route_reference(mask: torch.Tensor):
    """PyTorch reference for ``RouteIndex.idx`` / ``.counts`` (stable active-first order)."""
    m = mask.t().to(torch.int8)
    order = torch.argsort(1 - m, dim=1, stable=True)
    return order.to(torch.int32), m.sum(dim=1).to(torch.int32)


def used_groups_reference(mask: torch.Tensor):
    """PyTorch reference for ``RouteIndex.used_groups()`` (used groups ascending, then unused)."""
    used = mask.any(dim=0).to(torch.int8)
    groups = torch.argsort(1 - used, stable=True)
    return groups.to(torch.int32), used.sum().reshape(1).to(torch.int32)
