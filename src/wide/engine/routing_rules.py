"""How the engine (:mod:`wide.engine.inference`) turns the routers' per-token decisions into the masks
its kernels run: one rule object per engine, chosen at construction, whose methods the prefill
and decode loops call unconditionally (docs/routing_structure.md has the rules themselves).

* :class:`TokenRule`: every token its own mask (the paper's rule; ``route_tile = 1``).
* :class:`TileRule`: ``route_tile = N``; the tokens at positions ``[kN, (k+1)N)`` share the mask
  of position ``kN``. Prefill gathers it; decode keeps, per sequence and (layer, module), the
  mask of the sequence's current tile in a static buffer (so the step stays one CUDA graph) and
  takes the fresh decision only on a tile's first position; a step where no sequence starts a
  tile skips the routers altogether (its own graph, picked from the positions the host knows).
  In prefill the rows come in aligned runs of N that share a mask, which ``gemm_k`` turns into
  skipped (tile, group) blocks.
* :class:`PreviousTileRule`: ``route_tile = N`` with ``tile_source="previous"``: tile k runs the
  routers' decision on the mean of tile k-1's router inputs; decode keeps each tile's running
  sum of inputs beside its mask.
* :class:`SkipSmallestRule`: ``attn_rule="skip_smallest"`` (or ``"skip_upto"``: at most k, below 0); the attention router gives margins
  (prefill and decode) and every token skips the ``k`` groups of smallest margin
  (``wide.method.group_rules``' ``runs``); the FFN routes per token.
* :class:`SharedRule`: batch-shared decode; the router gives margins and one group set is chosen
  for the whole batch (:func:`wide.kernels.batch_shared.batch_shared_mask`), so a decode step
  reads the weights of that set only. Prefill routes per token.

The masked HF path implements the same rules in :mod:`wide.method.modeling` (``_tiled``, ``_shared``,
and :mod:`wide.method.group_rules`);
tests check that both give the same logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..method.group_rules import SkipSmallest, SkipUpTo


class TokenRule:
    name = "token"
    margins = False  # decode asks the router for margins instead of a mask
    defers = True  # batch-1 decode may leave the router to the GEMVs (the mask is used as is)

    def setup(self, engine, batch: int) -> None:
        pass

    def wants_margins(self, kind: str) -> bool:
        """Whether a decode step asks module ``kind``'s router for margins instead of a mask."""
        return self.margins

    def defers_router(self, kind: str) -> bool:
        """Whether batch-1 decode may leave module ``kind``'s router to the GEMVs."""
        return self.defers

    def prefill_runs(self) -> Optional[int]:
        """Aligned runs of rows sharing a mask in a prefill (a kernel hint), or None."""
        return None

    def decode_runs(self, batch: int) -> Optional[int]:
        return None

    def prefill(self, ops, i: int, kind: str, resid, normed, valid, lens, attn=None):
        """The mask [B, T, G] (or None: dense) module ``kind`` of layer ``i`` runs in a prefill of
        rows [B, T, H] (the residual and its normed copy; ``attn``: the layer's attention mask;
        ``valid`` [B, T] marks prompt tokens, None when every row is one)."""
        return ops.mask(i, kind, resid, normed, valid, attn=attn)

    def reuses(self, positions) -> bool:
        """Whether a decode step at host ``positions`` (one int per sequence) can run without
        the routers: every mask it needs is one this rule already holds."""
        return False

    def norm_routes(self, reuse: bool) -> bool:
        """Whether a decode step's norm evaluates the router on the token's own input."""
        return not reuse

    def norm_sums(self, i: int, kind: str):
        """Running sums of router inputs the decode step's norm updates (``ops.norm_route``), or None."""
        return None

    def begin_decode(self, pos, reuse: bool = False) -> None:
        pass

    def decode(self, ops, i: int, kind: str, mask, pos, resid, normed, attn=None):
        """The mask [B, G] a decode step runs, from what the norm's router gave (``mask``)."""
        return mask

    def step_state(self) -> list:
        """Buffers a decode step updates from their own values (so running it twice is not
        running it once): a graph capture's warm-up puts them back (``GraphCapture(keep=)``)."""
        return []


class TileRule(TokenRule):
    defers = False

    def __init__(self, tile: int):
        self.tile = int(tile)
        self.name = f"tile{self.tile}"
        self.store: dict = {}
        self._start = None
        self._reuse = False
        self._lead: dict = {}  # prefill length -> each position's tile lead

    def setup(self, engine, batch: int) -> None:
        groups = {"attn": engine.attn_groups, "ffn": engine.ffn_groups}
        # a module without a router (not routed, or a layer kept dense) has no mask to keep
        self.store = {(i, kind): torch.zeros(batch, groups[kind], dtype=torch.bool, device=engine.device)
                      for i, L in enumerate(engine.layers) for kind in ("attn", "ffn")
                      if engine.ops.routed(kind) and (L.routers.get(kind) is not None or engine.cfg.tie_modules)}

    def prefill_runs(self) -> Optional[int]:
        return self.tile

    def prefill(self, ops, i, kind, resid, normed, valid, lens, attn=None):
        mask = ops.mask(i, kind, resid, normed, valid, attn=attn)
        if mask is None:
            return None
        B, T, _ = mask.shape
        lead = self._lead.get((T, mask.device))
        if lead is None:
            lead = torch.div(torch.arange(T, device=mask.device), self.tile, rounding_mode="floor") * self.tile
            self._lead[(T, mask.device)] = lead
        tiled = mask.index_select(1, lead)
        # each sequence's current tile, for the decode steps that continue it
        if valid is None:
            self.store[(i, kind)].copy_(tiled[:, T - 1])
            return tiled
        tiled = tiled & valid[..., None]
        last = (lens - 1).clamp_min(0)
        self.store[(i, kind)].copy_(tiled[torch.arange(B, device=mask.device), last])
        return tiled

    def reuses(self, positions) -> bool:
        # No sequence starts a tile: the step runs on the stored masks and skips the routers
        # (at batch 1 that is N - 1 steps of N; at batch B about (1 - 1/N)^B of them).
        return all(int(p) % self.tile for p in positions)

    def begin_decode(self, pos, reuse: bool = False) -> None:
        self._reuse = reuse
        self._start = None if reuse else (pos % self.tile == 0)[:, None]

    def decode(self, ops, i, kind, mask, pos, resid, normed, attn=None):
        if self._reuse:
            return self.store.get((i, kind))
        if mask is None:
            return None
        store = self.store[(i, kind)]
        torch.where(self._start, mask, store, out=store)
        return store


class PreviousTileRule(TileRule):
    """``tile_source="previous"``: tile k's mask is the routers' decision on the mean of tile
    k-1's router inputs (tile 0: its first token's). Prefill routes one source row per tile;
    decode keeps, per sequence and (layer, module), the running sum of the current tile's inputs
    in a static buffer, and a step that starts a tile routes the finished tile's mean. The norm
    updates the sum in its own launch (every step, also those that reuse the stored masks: a
    separate add per module would cost ~2 us x 64 launches of a ~3 ms step) and never runs the
    router itself."""

    def __init__(self, tile: int):
        super().__init__(tile)
        self.name = f"tile{self.tile}prev"
        self.sums: dict = {}  # (layer, kind) -> the current tile's input sum [B, H] (fp32)
        self.done: dict = {}  # (layer, kind) -> the sum before this step: a finished tile's where one starts

    def setup(self, engine, batch: int) -> None:
        super().setup(engine, batch)
        shape = (batch, engine.hidden)
        self.sums = {key: torch.zeros(shape, dtype=torch.float32, device=engine.device) for key in self.store}
        self.done = {key: torch.zeros_like(acc) for key, acc in self.sums.items()}

    def prefill(self, ops, i, kind, resid, normed, valid, lens, attn=None):
        key = (i, kind)
        if key not in self.store:
            return ops.mask(i, kind, resid, normed, valid, attn=attn)  # not routed: None
        x = ops.router_input(resid, normed)
        B, T, H = x.shape
        n = self.tile
        k = -(-T // n)
        pad = k * n - T
        # Masking by 0/1 is exact in x's dtype and the tile sums accumulate in fp32 as they read,
        # so no fp32 copy of the [B, T, H] rows is made. Without padding (valid None) every op
        # that only handles padding is left out: an eager 4k prefill issues them one launch at a
        # time for each of its 64 routed modules (on the H200 it took 100 ms for 74 ms of kernels).
        xs = x if valid is None else x * valid[..., None].to(x.dtype)
        if pad:
            xs = torch.nn.functional.pad(xs, (0, 0, 0, pad))
        xs = xs.view(B, k, n, H).sum(2, dtype=torch.float32)
        if valid is None:  # every tile before the last is full
            means = xs[:, :-1] / n
        else:
            counts = torch.nn.functional.pad(valid.float(), (0, pad)).view(B, k, n).sum(2)
            means = xs[:, :-1] / counts[:, :-1].clamp_min(1)[..., None]
        source = torch.cat([x[:, :1].float(), means], dim=1)
        tied = None if attn is None else attn[:, ::n]
        mask = ops.mask(i, kind, source, source, attn=tied)  # [B, K, G]: one decision per tile
        if mask is None:
            return None
        tiled = mask.repeat_interleave(n, dim=1)[:, :T]
        if valid is None:  # every sequence's current tile is the last one
            self.store[key].copy_(mask[:, -1])
            self.sums[key].copy_(xs[:, -1])  # the current tile's inputs so far
            return tiled
        tiled = tiled & valid[..., None]
        rows = torch.arange(B, device=x.device)
        last = torch.div((lens - 1).clamp_min(0), n, rounding_mode="floor")
        self.store[key].copy_(mask[rows, last])
        self.sums[key].copy_(xs[rows, last])
        return tiled

    def norm_routes(self, reuse: bool) -> bool:
        return False

    def step_state(self) -> list:
        # sums grow by the step's row; done, the stored masks and k/v are rewritten the same
        return list(self.sums.values())

    def begin_decode(self, pos, reuse: bool = False) -> None:
        self._reuse = reuse
        self._start = (pos % self.tile == 0)[:, None]  # the norm's sums need it on every step

    def norm_sums(self, i, kind):
        key = (i, kind)
        return (self.sums[key], self.done[key], self._start) if key in self.sums else None

    def decode(self, ops, i, kind, mask, pos, resid, normed, attn=None):
        store = self.store.get((i, kind))
        if store is None or self._reuse:
            return store
        # A step that starts a tile follows a full one (decode continues from position >= 1).
        source = self.done[(i, kind)] / self.tile
        fresh = ops.mask(i, kind, source, source, attn=attn)
        if fresh is not None:
            torch.where(self._start, fresh, store, out=store)
        return store


class SharedRule(TokenRule):
    name = "batch_shared"

    def __init__(self):
        self.margins, self.defers = True, False

    def begin_decode(self, pos, reuse: bool = False) -> None:
        # A batch of one's shared set is exactly its own mask (batch_shared_runs), which the
        # per-token path gives without the choice's launch and with the router deferred to the
        # GEMVs (batch 1 ran 1.29x against per-token's 1.38x, bench/results/routing).
        own = pos.shape[0] == 1
        self.margins, self.defers = not own, own

    def decode_runs(self, batch: int) -> Optional[int]:
        return batch if batch > 1 else None

    def decode(self, ops, i, kind, margin, pos, resid, normed, attn=None):
        return ops.shared_mask(margin) if self.margins and margin is not None else margin


class SkipSmallestRule(TokenRule):
    """``attn_rule="skip_smallest"``: attention skips, per token, the ``k`` groups of smallest
    margin (``"skip_upto"``: those of them below 0; the margins carry the offsets, as the masked
    path's do); the FFN keeps the per-token rule. The router's margins come from the same launches
    that give masks (the fused norm in decode, as for batch-shared decode), and the choice is one
    launch on the kernels (:func:`wide.kernels.skip_rule`; ~10 elementwise ops in PyTorch), captured
    with the step. At batch 1 only the FFN's router is left to the
    GEMVs: they threshold each margin at 0 (the independent rule), which attention does not run."""

    margins = False
    defers = False

    def __init__(self, k: int, upto: bool = False):
        self.k = int(k)
        self.rule = (SkipUpTo if upto else SkipSmallest)(self.k)
        self.name = f"{self.rule.name}{self.k}"

    def wants_margins(self, kind: str) -> bool:
        return kind == "attn"

    def defers_router(self, kind: str) -> bool:
        return kind == "ffn"

    def prefill(self, ops, i, kind, resid, normed, valid, lens, attn=None):
        if kind != "attn":
            return ops.mask(i, kind, resid, normed, valid, attn=attn)
        margin = ops.margins(i, kind, resid, normed)
        if margin is None:  # a layer kept dense
            return None
        mask = ops.skip_mask(self.rule, margin)
        return mask if valid is None else mask & valid[..., None]

    def decode(self, ops, i, kind, mask, pos, resid, normed, attn=None):
        if kind != "attn" or mask is None:
            return mask
        return ops.skip_mask(self.rule, mask)  # mask holds the margins here (wants_margins)


def make_rule(engine, batch_shared: bool) -> TokenRule:
    """The rule of an engine (the dense and fine engines' masks are None, which every rule passes on)."""
    tile = engine.cfg.route_tile if engine.cfg is not None else 1  # cfg: None unless the engine routes
    if engine.cfg is not None and engine.cfg.attn_rule in ("skip_smallest", "skip_upto"):
        if batch_shared or tile != 1:
            raise ValueError(
                f"the engine runs attn_rule={engine.cfg.attn_rule!r} with per-token routing only; these routers also "
                "ask for " + ("batch-shared decode" if batch_shared else f"one mask per tile of {tile} tokens")
                + " (the masked HF path runs the rule with tiles)")
        return SkipSmallestRule(engine.cfg.attn_skip, upto=engine.cfg.attn_rule == "skip_upto")
    if batch_shared:
        if tile != 1:
            raise ValueError(f"the engine runs batch-shared decode for per-token routers only; these share one mask "
                             f"per tile of {tile} tokens (the masked HF path runs both: "
                             "wide.method.modeling.batch_shared_decode)")
        if engine.cfg.tie_modules:
            raise ValueError("batch-shared decode needs routers with margins per module; tied (dynamic-depth) "
                             "decisions have none")
        return SharedRule()
    if tile == 1:
        return TokenRule()
    return PreviousTileRule(tile) if engine.cfg.tile_source == "previous" else TileRule(tile)


__all__ = ["TokenRule", "TileRule", "PreviousTileRule", "SkipSmallestRule", "SharedRule", "make_rule"]
