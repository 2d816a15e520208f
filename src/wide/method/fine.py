"""Per-element activation sparsity on the inputs of the seven linear projections, beside the
routers: an input element whose score falls below its projection's threshold is zeroed, so
its weight column is never read.

* **TEAL** (Liu et al., ICLR 2025): score ``|x_k|``; thresholds are quantiles of the dense
  model's scores on calibration text. Allocations: ``uniform`` (every projection zeroes the
  same share; q/k/v read one input and get one threshold, gate/up likewise) and ``greedy``
  (TEAL's block-wise search: per layer, grow the sparsity of whichever of the seven
  projections raises the layer's output error least, one equal-parameter step at a time).
* **WINA** (Chen et al., 2025): score ``|x_k| * ||W[:, k]||_2``, the column norm of the
  projection's own weight, so q, k and v (and gate, up) keep different elements of one input.
* **Learned** (the hybrid, with the routers): the log thresholds, and optionally a per-channel
  scale, are parameters trained end to end in stage 1. The forward pass keeps exactly what the
  inference rule keeps; the backward pass sees a sigmoid of the log-score margin
  (straight-through), so the thresholds move with the language-model loss and the linear-MAC
  budget (``WideConfig.loss_mode="linear"``) decides how much of the sparsity comes from them
  and how much from routed groups.

The keep rule is ``|x_k| * scale_k >= threshold`` in fp32, the same expression the decode
kernels evaluate. A model carries this as ``model.wide_fine``; it needs a wrapped model
(``wide.wrap``, ``sparse_target="none"`` when there is no router) because the routing state
is where the hooks read the routers' masks and leave the kept-input counts that
``wide.method.sparsity.linear_macs`` turns into the exact linear sparsity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Optional

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ..base import arch
from ..base.cliargs import check_fields
from .geometry import PROJECTIONS, ModelDims, projection_shapes
from .modeling import install_hooks
from .state import get_state
from .routers import Float32Module

CRITERIA = ("magnitude", "wina")
ALLOCATIONS = ("uniform", "greedy", "learned")
# Projections that read one input: with the magnitude criterion and a uniform allocation they
# keep the same elements (one mask, one threshold).
INPUTS = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "o_in", "gate": "mlp_in", "up": "mlp_in",
          "down": "down_in"}
KEEP_ALL = float("-inf")  # a log threshold that keeps every element
# Scores below this count as zero in the log-domain surrogate (log 0 would give NaN gradients).
_TINY = 1e-30


@dataclass
class FineConfig:
    """How per-element sparsity chooses what to keep. The metadata is each field's option."""

    criterion: str = field(default="magnitude", metadata={
        "flag": "--fine-criterion", "choices": CRITERIA,
        "help": "per-element score: |x| (TEAL) or |x| times the weight column's L2 norm (WINA)"})
    allocation: str = field(default="uniform", metadata={
        "flag": "--fine-allocation", "choices": ALLOCATIONS,
        "help": "how thresholds are set: one share for every projection (uniform), TEAL's block-wise greedy "
                "search, or learned end to end in stage 1 (learned)"})
    # not an option: the method's target (--target, --targets) sets it
    target: float = field(default=0.5, metadata={"min": 0.0, "lt": 1.0})
    per_channel: bool = field(default=False, metadata={
        "flag": "--fine-per-channel", "help": "learn a per-input-channel scale of the score as well (allocation learned)"})
    # In log-score units: at 1.0 an element e times above or below its threshold gets 0.73 of
    # the gradient of one on the threshold.
    tau_start: float = field(default=1.0, metadata={
        "flag": "--fine-tau-start", "help": "temperature of the learned thresholds' surrogate gradient at step 0 (log-score units)", "gt": 0})
    tau_end: float = field(default=0.2, metadata={
        "flag": "--fine-tau-end", "help": "the surrogate's temperature at the last step", "gt": 0})
    # Routers' rate (2e-3 at 4 sequences a step) is too slow for thresholds in log units, and
    # theirs too fast for routers: on SmolLM2 at batch 4, 1e-2 moved thresholds well (35.8 -> 30.5 in
    # 80 steps) but drove routers sharing it to a cross-entropy of 6.8.
    lr_scale: float = field(default=5.0, metadata={
        "flag": "--fine-lr-scale", "help": "learned thresholds' learning rate as a multiple of --lr", "gt": 0})
    greedy_step: float = field(default=0.05, metadata={
        "help": "TEAL greedy: sparsity step of a projection the size of q (larger ones step less)", "gt": 0, "max": 1})
    greedy_last_fraction: float = field(default=0.25, metadata={
        "help": "TEAL greedy: share of each sequence's last positions the layer-output error is measured on",
        "gt": 0, "max": 1})

    def __post_init__(self):
        check_fields(self)
        if self.per_channel and self.allocation != "learned":
            raise ValueError("per_channel scales are learned: they need allocation='learned'")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FineConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown FineConfig fields {sorted(unknown)}: written by a newer version of wide?")
        return cls(**d)


class FineSparsity(Float32Module):
    """Per-layer, per-projection log thresholds [L, 7] (columns in ``PROJECTIONS`` order), the
    share of each projection's input they were set to zero (``sparsity``, for the record and for
    recalibration), and per-channel log scales of the score where the criterion has them."""

    def __init__(self, dims: ModelDims, config: FineConfig):
        super().__init__()
        self.config = config
        L = dims.num_layers
        learned = config.allocation == "learned"
        self.log_threshold = nn.Parameter(torch.full((L, len(PROJECTIONS)), KEEP_ALL), requires_grad=learned)
        self.register_buffer("sparsity", torch.zeros(L, len(PROJECTIONS)))
        shapes = projection_shapes(dims)
        self.log_scale = nn.ParameterDict()
        if config.criterion == "wina" or config.per_channel:
            for p in PROJECTIONS:
                self.log_scale[p] = nn.Parameter(torch.zeros(L, shapes[p][1]), requires_grad=config.per_channel)
        self.enabled = True
        self.progress = 0.0  # share of training done (the surrogate's temperature), set by wide.training.train

    def learnable(self) -> list:
        """The parameters training moves: learned thresholds, and per-channel scales."""
        out = [self.log_threshold] if self.config.allocation == "learned" else []
        return out + (list(self.log_scale.values()) if self.config.per_channel else [])

    @property
    def tau(self) -> float:
        c = self.config
        return c.tau_start + (c.tau_end - c.tau_start) * min(max(self.progress, 0.0), 1.0)

    def threshold(self, layer: int, proj: str) -> torch.Tensor:
        return self.log_threshold[layer, PROJECTIONS.index(proj)].exp()

    def scale(self, layer: int, proj: str) -> Optional[torch.Tensor]:
        return self.log_scale[proj][layer].exp() if proj in self.log_scale else None

    def score(self, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        """fp32 per-element score |x| (* scale)."""
        a = x.float().abs()
        s = self.scale(layer, proj)
        return a if s is None else a * s

    def keep(self, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        """Bool keep mask of ``x`` [..., in]: the inference rule."""
        return self.score(layer, proj, x) >= self.threshold(layer, proj)

    def apply(self, layer: int, proj: str, x: torch.Tensor, routed: Optional[torch.Tensor] = None,
              columns: int = 1, surrogate: bool = False) -> tuple:
        """(x with the dropped elements zeroed, [...] count of the elements kept). ``routed``
        [..., G] (float 0/1, the routers' mask of this projection's input groups of ``columns``
        elements) removes the columns a skipped group drops from the count. With ``surrogate``
        (training) the backward pass is that of x * sigmoid((log score - log threshold) / tau)
        for the thresholds and scales, straight through for x and the routers' mask."""
        j = PROJECTIONS.index(proj)
        log_s = self.log_scale[proj][layer] if proj in self.log_scale else None
        return _SparseInput.apply(x, self.log_threshold[layer, j], log_s, routed, columns,
                                  self.tau if surrogate else None)

    def check(self, dims: ModelDims, where: str = "thresholds") -> None:
        """One clear error for thresholds that do not fit ``dims`` or hold NaN."""
        L = dims.num_layers
        if tuple(self.log_threshold.shape) != (L, len(PROJECTIONS)):
            raise ValueError(f"{where}: {tuple(self.log_threshold.shape)} thresholds for a model of {L} layers x "
                             f"{len(PROJECTIONS)} projections")
        shapes = projection_shapes(dims)
        for p, t in self.log_scale.items():
            if tuple(t.shape) != (L, shapes[p][1]):
                raise ValueError(f"{where}: scale of {p} has shape {tuple(t.shape)}, the model needs {(L, shapes[p][1])}")
        for name, t in [("thresholds", self.log_threshold), ("sparsity", self.sparsity), *self.log_scale.items()]:
            if torch.isnan(t).any():
                raise ValueError(f"{where}: {name} hold NaN")


class _SparseInput(torch.autograd.Function):
    """x * keep and the kept count in one op that saves only its inputs: the straight-through
    surrogate's masks are recomputed in the backward pass, so training holds one activation per
    projection input instead of the mask, the sigmoid and their intermediates (at 32k tokens a
    step that is the difference between fitting a GPU and not)."""

    @staticmethod
    def forward(ctx, x, log_t, log_s, routed, columns, tau):
        score = x.float().abs()
        if log_s is not None:
            score = score * log_s.exp()
        hard = score >= log_t.exp()
        y = x * hard.to(x.dtype)
        if routed is None:
            count = hard.float().sum(-1)
        else:
            count = (hard.view(*hard.shape[:-1], -1, columns).float() * routed.unsqueeze(-1)).sum((-1, -2))
        ctx.tau, ctx.columns = tau, columns
        ctx.has_s, ctx.has_r = log_s is not None, routed is not None
        ctx.save_for_backward(x, log_t, log_s if log_s is not None else log_t, routed if routed is not None else log_t)
        return y, count

    @staticmethod
    def backward(ctx, gy, gcount):
        x, log_t, log_s, routed = ctx.saved_tensors
        log_s = log_s if ctx.has_s else None
        routed = routed if ctx.has_r else None
        xf = x.float()
        score = xf.abs() if log_s is None else xf.abs() * log_s.exp()
        hard = (score >= log_t.exp()).float()
        gx = g_t = g_s = g_r = None
        r = None if routed is None else routed.float().repeat_interleave(ctx.columns, dim=-1)
        if ctx.tau is None:  # inference rule only: no gradient to the thresholds
            d = torch.zeros_like(xf)
        else:
            z = xf.abs().clamp_min(_TINY).log() - log_t.float()
            if log_s is not None:
                z = z + log_s.float()
            sig = torch.sigmoid(z / ctx.tau)
            d = sig * (1 - sig) / ctx.tau  # d soft / d z
        gyf = gy.float() if gy is not None else torch.zeros_like(xf)
        gc = gcount.float().unsqueeze(-1) if gcount is not None else torch.zeros_like(xf[..., :1])
        if ctx.needs_input_grad[0]:
            # d(x * soft)/dx = soft + x * soft' / x: the hard mask forward, plus the surrogate's slope
            gx = (gyf * (hard + d)).to(x.dtype)
        # d(x * soft)/d log_t = -x * soft'; d(count)/d log_t = -sum soft' (over counted columns)
        per = gyf * xf * d + gc * d * (r if r is not None else 1.0)
        if ctx.needs_input_grad[1]:
            g_t = -per.sum().reshape(log_t.shape).to(log_t.dtype)
        if log_s is not None and ctx.needs_input_grad[2]:
            g_s = per.flatten(0, -2).sum(0).to(log_s.dtype)
        if routed is not None and ctx.needs_input_grad[3]:
            g_r = (gc * hard).view(*hard.shape[:-1], -1, ctx.columns).sum(-1).to(routed.dtype)
        return gx, g_t, g_s, g_r, None, None


def get_fine(model) -> Optional[FineSparsity]:
    return getattr(model, "wide_fine", None)


def _reduction_kind(proj: str) -> Optional[str]:
    return {"o": "attn", "down": "ffn"}.get(proj)


def _install(model) -> None:
    """Pre-hooks on the seven projections of every layer (re-run by install_hooks after PEFT
    replaces them, so that LoRA's branch reads the sparse input too, as the merged weights do)."""
    state = get_state(model)
    fine = get_fine(model)
    if fine is None:
        return
    spec = arch.spec_for(model)
    geo = state.geometry
    for i, layer in enumerate(arch.decoder_layers(model)):
        for p in PROJECTIONS:
            def hook(mod, args, i=i, p=p):
                if not (state.routing and fine.enabled):
                    return None
                kind = _reduction_kind(p)
                # columns a skipped group drops are not counted twice
                routed = state.masks.get((i, kind)) if kind else None
                y, count = fine.apply(i, p, args[0], routed, geo.columns(kind) if kind else 1,
                                      surrogate=state.tau is not None and fine.training)
                state.kept_inputs[(i, p)] = count
                return (y,) + tuple(args[1:])
            state.handles.append(arch.projection(layer, spec, p).register_forward_pre_hook(hook))


def attach(model, config: Optional[FineConfig] = None) -> FineSparsity:
    """Give a wrapped model per-element input sparsity (thresholds keep everything until
    :func:`calibrate` or training sets them); returns the module (``model.wide_fine``)."""
    state = get_state(model)
    if get_fine(model) is not None:
        raise ValueError("model already has per-element sparsity (model.wide_fine)")
    config = config or FineConfig()
    device = next(model.parameters()).device
    model.wide_fine = FineSparsity(state.geometry.dims, config).to(device)
    if config.criterion == "wina":
        set_wina_scales(model)
    state.installers.append(_install)
    install_hooks(model)
    return model.wide_fine


def set_wina_scales(model) -> None:
    """WINA's score weights: the L2 norm of each input column of the projection's own weight."""
    fine = get_fine(model)
    spec = arch.spec_for(model)
    with torch.no_grad():
        for i, layer in enumerate(arch.decoder_layers(model)):
            for p in PROJECTIONS:
                mod = arch.projection(layer, spec, p)
                w = getattr(mod, "get_base_layer", lambda m=mod: m)().weight
                fine.log_scale[p][i].copy_(w.float().norm(dim=0).clamp_min(_TINY).log())


def parameters(model) -> list:
    """The trainable parameters of per-element sparsity (none unless thresholds are learned)."""
    fine = get_fine(model)
    return [] if fine is None else [p for p in fine.parameters() if p.requires_grad]


# ---------------------------------------------------------------- calibration


class _Scores:
    """Per (layer, projection), a bounded random sample of the dense model's scores, sorted:
    enough for quantiles to a fraction of a percent without holding every activation."""

    def __init__(self, per_key: int, seed: int = 0):
        self.per_key = per_key
        self.parts: dict = {}
        self.seed = seed
        self.gens: dict = {}  # device -> generator: sampling where the activations are

    def add(self, key, values: torch.Tensor, share: int) -> None:
        v = values.flatten()
        if v.numel() > share:
            g = self.gens.get(v.device)
            if g is None:
                g = self.gens[v.device] = torch.Generator(device=v.device).manual_seed(self.seed)
            v = v[torch.randint(0, v.numel(), (share,), generator=g, device=v.device)]
        self.parts.setdefault(key, []).append(v.float())

    def sorted(self) -> dict:
        return {k: torch.cat(v).sort().values for k, v in self.parts.items()}


def quantile(sorted_values: torch.Tensor, share: float) -> float:
    """The score at ``share`` of the sorted sample, interpolated as torch.quantile does; 0 for
    share 0 (keep everything), +inf for share 1."""
    if share <= 0:
        return 0.0
    if share >= 1:
        return float("inf")
    n = sorted_values.numel()
    rank = share * (n - 1)
    i, j = int(math.floor(rank)), min(int(math.ceil(rank)), n - 1)
    return float(torch.lerp(sorted_values[i], sorted_values[j], torch.tensor(rank - i, dtype=sorted_values.dtype,
                                                                            device=sorted_values.device)))


@torch.no_grad()
def collect_scores(model, batches: Iterable[torch.Tensor], per_key: int = 1 << 20, seed: int = 0) -> dict:
    """(layer, projection) -> sorted sample of the scores each projection's input gets on
    ``batches`` with per-element sparsity off (TEAL and WINA calibrate on the dense model's
    activations; routers, if any, stay on). Projections that share an input and a score (q/k/v
    and gate/up under the magnitude criterion) share one sample."""
    fine = get_fine(model)
    state = get_state(model)
    spec = arch.spec_for(model)
    batches = list(batches)
    if not batches:
        raise ValueError("threshold calibration needs at least one batch of calibration text")
    share = max(1, -(-per_key // len(batches)))
    scores = _Scores(per_key, seed)
    shared = fine.config.criterion == "magnitude"
    handles = []
    for i, layer in enumerate(arch.decoder_layers(model)):
        for p in PROJECTIONS:
            if shared and p in ("k", "v", "up"):
                continue

            def hook(mod, args, i=i, p=p):
                x = args[0]
                valid = _valid_rows(state, x)
                scores.add((i, p), fine.score(i, p, x)[valid], share)
            handles.append(arch.projection(layer, spec, p).register_forward_pre_hook(hook))
    was_training, enabled = model.training, fine.enabled
    model.eval()
    fine.enabled = False
    device = next(model.parameters()).device
    try:
        for ids in batches:
            model(input_ids=ids.to(device))
    finally:
        for h in handles:
            h.remove()
        fine.enabled = enabled
        model.train(was_training)
    out = scores.sorted()
    if shared:
        for i in range(len(arch.decoder_layers(model))):
            out[(i, "k")] = out[(i, "v")] = out[(i, "q")]
            out[(i, "up")] = out[(i, "gate")]
    return out


def _valid_rows(state, x: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the tokens that are not padding."""
    am = state.attention_mask
    if am is not None and am.dim() == 2 and am.shape[0] == x.shape[0] and am.shape[1] >= x.shape[1]:
        return am[:, -x.shape[1]:].bool().to(x.device)
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


@torch.no_grad()
def set_thresholds(model, scores: dict, sparsity: torch.Tensor) -> None:
    """Thresholds that zero ``sparsity[layer, projection]`` of each projection's input scores
    (quantiles of ``scores``)."""
    fine = get_fine(model)
    if tuple(sparsity.shape) != tuple(fine.log_threshold.shape):
        raise ValueError(f"sparsity of shape {tuple(sparsity.shape)} for thresholds {tuple(fine.log_threshold.shape)}")
    for i in range(sparsity.shape[0]):
        for j, p in enumerate(PROJECTIONS):
            t = quantile(scores[(i, p)], float(sparsity[i, j]))
            fine.log_threshold[i, j] = math.log(t) if t > 0 else KEEP_ALL
    fine.sparsity.copy_(sparsity.clamp(0, 1))


def projection_weights(dims: ModelDims) -> torch.Tensor:
    """[7] each projection's share of a layer's linear MACs (TEAL's weights, normalised)."""
    shapes = projection_shapes(dims)
    w = torch.tensor([float(shapes[p][0] * shapes[p][1]) for p in PROJECTIONS], dtype=torch.float64)
    return w / w.sum()


def uniform_sparsity(dims: ModelDims, target: float) -> torch.Tensor:
    return torch.full((dims.num_layers, len(PROJECTIONS)), float(target))


def calibrate(model, batches: Iterable[torch.Tensor], *, scores: Optional[dict] = None,
              progress: bool = True) -> dict:
    """Set the thresholds of ``model.wide_fine`` for its config's target on calibration
    ``batches``: quantiles of the dense scores, at the same share everywhere (uniform) or at
    TEAL's greedy per-layer allocation (greedy). Learned thresholds start from the uniform ones.
    Returns the scores (reusable for another target)."""
    fine = get_fine(model)
    if fine is None:
        raise ValueError("model has no per-element sparsity: call wide.fine.attach(model, config) first")
    batches = list(batches)
    dims = get_state(model).geometry.dims
    if scores is None:
        scores = collect_scores(model, batches)
    cfg = fine.config
    if cfg.allocation == "greedy":
        table = greedy_tables(model, batches, scores, cfg.target, progress=progress)
        sparsity = greedy_sparsity(table, cfg.target)
    else:
        sparsity = uniform_sparsity(dims, cfg.target)
    set_thresholds(model, scores, sparsity)
    return scores


# ---------------------------------------------------------------- TEAL's greedy allocation


class _LayerInputs:
    """The dense model's inputs to every decoder layer on calibration batches (positional and
    keyword arguments as the model passed them), so a layer can be run again on its own."""

    def __init__(self, model, batches):
        self.calls: dict = {}
        layers = arch.decoder_layers(model)
        handles = []
        for i, layer in enumerate(layers):
            def grab(mod, args, kwargs, i=i):
                self.calls.setdefault(i, []).append((tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                           for a in args), dict(kwargs)))
            handles.append(layer.register_forward_pre_hook(grab, with_kwargs=True))
        fine = get_fine(model)
        enabled = fine.enabled
        fine.enabled = False
        device = next(model.parameters()).device
        try:
            with torch.no_grad():
                for ids in batches:
                    model(input_ids=ids.to(device), use_cache=False)
        finally:
            fine.enabled = enabled
            for h in handles:
                h.remove()


def _layer_out(layer, args, kwargs) -> torch.Tensor:
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def greedy_tables(model, batches, scores: dict, up_to: float, *, progress: bool = True) -> list:
    """TEAL's block-wise greedy search (Algorithm 1 of the paper, as its code runs it): for each
    layer, from zero sparsity, try raising each projection's share by ``greedy_step`` / its
    relative size (so every step zeroes the same number of weights) and keep the one whose
    layer output, on the dense model's inputs to that layer, moves least from the dense output
    (mean L2 over the last ``greedy_last_fraction`` of positions), until the layer's
    MAC-weighted sparsity reaches ``up_to``. Returns per layer the path: a list of
    (effective sparsity, [7] shares)."""
    fine = get_fine(model)
    cfg = fine.config
    state = get_state(model)
    dims = state.geometry.dims
    weights = projection_weights(dims)
    rel = weights / weights[0]
    steps = [cfg.greedy_step / float(r) for r in rel]
    inputs = _LayerInputs(model, batches)
    layers = arch.decoder_layers(model)
    saved = fine.log_threshold.detach().clone(), fine.sparsity.clone()
    was_training = model.training
    model.eval()
    tables = []
    try:
        for i in tqdm(range(len(layers)), disable=not progress, desc="TEAL greedy", leave=False):
            calls = inputs.calls[i]
            fine.enabled = False
            target = [_layer_out(layers[i], a, k) for a, k in calls]
            fine.enabled = True
            share = [0.0] * len(PROJECTIONS)
            path = [(0.0, list(share))]

            def error(trial) -> float:
                for j, p in enumerate(PROJECTIONS):
                    t = quantile(scores[(i, p)], trial[j])
                    fine.log_threshold[i, j] = math.log(t) if t > 0 else KEEP_ALL
                total = 0.0
                for (a, k), y in zip(calls, target):
                    out = _layer_out(layers[i], a, k)
                    start = int(out.shape[1] * (1 - cfg.greedy_last_fraction))
                    total += float((out[:, start:] - y[:, start:]).float().norm(dim=-1).mean())
                return total / len(calls)

            effective = 0.0
            while effective < up_to - 1e-9:
                best = None
                for j in range(len(PROJECTIONS)):
                    if share[j] >= 1.0:
                        continue
                    trial = list(share)
                    trial[j] = min(1.0, trial[j] + steps[j])
                    e = error(trial)
                    if best is None or e < best[0]:
                        best = (e, j, trial)
                if best is None:
                    break
                share = best[2]
                effective = float(sum(weights[j] * share[j] for j in range(len(PROJECTIONS))))
                path.append((effective, list(share)))
            tables.append(path)
    finally:
        fine.log_threshold.data.copy_(saved[0])
        fine.sparsity.copy_(saved[1])
        fine.enabled = True
        model.train(was_training)
    return tables


def greedy_sparsity(tables: list, target: float) -> torch.Tensor:
    """[L, 7] the shares of each layer's path whose effective sparsity is closest to ``target``
    (every layer at the same block sparsity, as TEAL evaluates it)."""
    rows = []
    for path in tables:
        eff, share = min(path, key=lambda r: abs(r[0] - target))
        rows.append(share)
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- hitting a target after training


@torch.no_grad()
def measured_linear_sparsity(model, batches) -> float:
    from .sparsity import track_sparsity

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with track_sparsity(model) as t:
            for ids in batches:
                model(input_ids=ids.to(device))
    finally:
        model.train(was_training)
    return float(t.summary().linear_rate)


@torch.no_grad()
def shift_to_target(model, batches, target: float, iterations: int = 14) -> float:
    """Move every log threshold by one shift (bisection, realised linear sparsity measured on
    ``batches``) until the model skips ``target`` of its linear MACs: learned thresholds keep
    their allocation and land on the budget exactly, as router offsets do. Returns the shift."""
    fine = get_fine(model)
    base = fine.log_threshold.detach().clone()
    finite = torch.isfinite(base)
    batches = list(batches)
    lo, hi = -8.0, 8.0

    def at(shift: float) -> float:
        fine.log_threshold.data.copy_(torch.where(finite, base + shift, base))
        return measured_linear_sparsity(model, batches)

    for _ in range(iterations):
        mid = (lo + hi) / 2
        if at(mid) > target:
            hi = mid
        else:
            lo = mid
    shift = (lo + hi) / 2
    at(shift)
    return shift


__all__ = ["CRITERIA", "ALLOCATIONS", "FineConfig", "FineSparsity", "attach", "get_fine", "calibrate",
           "collect_scores", "set_thresholds", "quantile", "greedy_tables", "greedy_sparsity", "uniform_sparsity",
           "projection_weights", "set_wina_scales", "parameters", "measured_linear_sparsity", "shift_to_target",
           "KEEP_ALL"]
