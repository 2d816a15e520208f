"""One training loop for both stages: stage 1 trains the routers of a frozen backbone,
stage 2 (LoRA recovery) trains routers and adapters. Only the parameter set differs.

The task loss is the next-token cross-entropy (``loss="ce"``), the distillation loss
against the dense model (``"kd"``: KL(teacher || student) per token, with the same frozen
backbone run without routers, and in stage 2 without adapters, as the teacher), or a mix of
the two; the sparsity penalty is added to each (docs/method.md, "Self-distillation").

The data order is a pure function of (seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have seen; checkpoints hold the optimizer, scheduler,
temperature and RNG states. They are written with ``wide.io.serialization``'s crash-safe
protocol, and a resume first recovers the newest complete one, so a kill -9 at any moment
loses at most the steps since the last checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..base.cliargs import check_fields
from ..method.modeling import router_parameters, routing_disabled
from ..method.sparsity import forward_sparsity, sparsity_penalty, union_penalty
from ..method.state import get_state
from ..io.serialization import (atomic_write_text, config_differences, load, read_meta, recover_directory,
                            remove_directory, save_routers)

CHECKPOINT_DIR = "checkpoint"
FINAL_DIR = "routers"
TRAINER_STATE = "trainer_state.pt"
LOSSES = ("ce", "kd", "mix")
AMP_MODES = ("none", "bf16")
# Packed calibration ids up to this size move to the GPU once, so that no step waits on a
# host-to-device copy (the biggest corpora stay on the host, and their batches are pinned).
DEVICE_IDS_MAX_BYTES = 2 << 30


@dataclass
class TrainArgs:
    # The metadata is each field's command-line option (wide.base.cliargs).
    steps: int = field(default=300, metadata={"help": "optimizer steps", "min": 1})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch", "min": 1})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per step", "min": 1})
    # Measured on SmolLM2 (docs/method.md, "Steps, not tokens"): about 2e-3 x sqrt(sequences per
    # step / 4) serves larger batches (1.2e-2 at 128 beat 6e-3 and 2e-3).
    lr: float = field(default=2e-3, metadata={
        "help": "AdamW peak learning rate (for batches larger than the default 4 sequences, scale it by about "
                "sqrt(batch / 4): 1.2e-2 at 128 measured best)", "gt": 0})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay", "min": 0})
    warmup_frac: float = field(default=0.1, metadata={"help": "linear warm-up share of the steps", "min": 0, "max": 1})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm", "gt": 0})
    eval_every: int = field(default=50, metadata={"help": "held-out evaluation period in steps, 0 = never", "min": 0})
    eval_batches: int = field(default=8, metadata={"help": "held-out batches per periodic evaluation", "min": 1})
    save_every: int = field(default=50, metadata={
        "help": "checkpoint period in steps (0 = only at the end); a kill loses at most this many", "min": 0})
    # numpy's seed is an unsigned 32-bit integer.
    seed: int = field(default=0, metadata={
        "help": "seed for router initialisation, data order and Gumbel noise", "min": 0, "max": 2 ** 32 - 1})
    # The default stays "ce" until the H200 comparison of docs/method.md decides.
    loss: str = field(default="ce", metadata={
        "choices": LOSSES,
        "help": "task loss: next-token cross-entropy on the data (ce), KL divergence to the dense model's "
                "next-token distribution (kd: the same backbone without routers, and without LoRA in stage 2), "
                "or (1 - --mix-weight) x ce + --mix-weight x kd (mix); the sparsity penalty is added to each"})
    kd_temperature: float = field(default=1.0, metadata={
        "help": "softmax temperature T of both distributions in the KL; the KL is scaled by T^2", "gt": 0})
    mix_weight: float = field(default=0.5, metadata={"help": "share of kd in --loss mix", "min": 0, "max": 1})
    # 0.5 pairs with WideConfig's dense router start (stage 1). Stage 2 starts from trained
    # routers and keeps the full target: `wide recover` and compare's stage 2 default to 0.
    sparsity_warmup: float = field(default=0.5, metadata={
        "help": "share of the steps over which the sparsity target rises linearly from 0 to its value "
                "(0: the full target from the first step; for routers that start dense, stage 1)", "min": 0, "max": 1})
    amp: str = field(default="none", metadata={
        "choices": AMP_MODES,
        "help": "bf16: run the backbone's forward passes (student and teacher) under bf16 autocast; routers, "
                "losses and optimizer state stay float32"})

    def __post_init__(self):
        check_fields(self)  # ranges and choices

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * self.grad_accum


# Changing these mid-run would make a resumed run a different run (the others, evaluation
# and checkpoint periods, change what is recorded, not the routers).
RESUME_KEYS = ("steps", "batch_size", "grad_accum", "lr", "weight_decay", "warmup_frac", "max_grad_norm", "seed",
               "loss", "kd_temperature", "mix_weight", "amp", "sparsity_warmup")


# What wide did before each of these TrainArgs fields existed (see config.PREDATES).
PREDATES = {"loss": "ce", "kd_temperature": 1.0, "mix_weight": 0.5, "amp": "none", "sparsity_warmup": 0.0}


def with_defaults(saved: dict) -> dict:
    """Saved TrainArgs (a checkpoint's, a run's) with the fields an older version of wide did
    not have filled in with what that version did (``PREDATES``; other fields: the default)."""
    return {**{f.name: PREDATES.get(f.name, f.default) for f in fields(TrainArgs)}, **saved}


def target_config(cfg, args: TrainArgs, step: int):
    """The WideConfig whose targets the penalty of ``step`` aims at: during the first
    ``sparsity_warmup`` share of the steps, every target scaled by (step + 1) / warm-up steps, so
    that routers which start dense (WideConfig.router_init) are not pushed to the full target
    before they have learned which groups matter."""
    warm = int(round(args.sparsity_warmup * args.steps))
    if step >= warm:
        return cfg
    f = (step + 1) / warm
    return replace(cfg, target_sparsity=cfg.target_sparsity * f,
                   attn_target=None if cfg.attn_target is None else cfg.attn_target * f,
                   ffn_target=None if cfg.ffn_target is None else cfg.ffn_target * f)


def lr_lambda(args: TrainArgs) -> Callable[[int], float]:
    """Linear warm-up over warmup_frac of the steps, then cosine to zero."""
    warm = max(1, int(round(args.warmup_frac * args.steps)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, args.steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return f


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_sequences: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_sequences, generator=g)


def batch_indices(num_sequences: int, args: TrainArgs, step: int, micro: int) -> torch.Tensor:
    """Sequence indices of one micro-batch: epochs are seeded permutations, so the order
    depends only on (seed, step, micro)."""
    start = (step * args.grad_accum + micro) * args.batch_size
    idx = torch.arange(start, start + args.batch_size)
    epoch = idx // num_sequences
    out = torch.empty_like(idx)
    for e in epoch.unique().tolist():
        perm = _epoch_permutation(num_sequences, args.seed, e)
        sel = epoch == e
        out[sel] = perm[idx[sel] % num_sequences]
    return out


# ---------------------------------------------------------------- the loss


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions softened by ``temperature`` T,
    summed over the vocabulary, averaged over positions, times T^2 (so the gradient's scale
    does not depend on T). Logits [..., V] of the same positions; the KL is taken in float32."""
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # sum_v p_t (log p_t - log p_s)
    return kl.mean() * temperature ** 2


def _tuner_layers(model) -> list:
    """PEFT's adapter layers (LoRA ...) in ``model``: none in stage 1."""
    if not any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model):
    """PEFT adapters switched off for the block, as ``PeftModel.disable_adapter()`` does it
    (``enable_adapters(False)`` on every tuner layer), on a model whose adapters
    ``inject_adapter_in_model`` added in place (wide.training.recovery). PEFT's switch also changes the
    adapters' ``requires_grad``: that is put back as it was."""
    layers = _tuner_layers(model)
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    was_disabled = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m, off in zip(layers, was_disabled):
            m.enable_adapters(not off)
        for p, g in grads:
            p.requires_grad_(g)


@contextlib.contextmanager
def teacher_mode(model):
    """The distillation teacher: the same backbone with routing (learned or static masks) and
    adapters off, i.e. the dense model the routers were put on."""
    with routing_disabled(model), adapters_disabled(model):
        yield model


def autocast(args: TrainArgs, device: torch.device):
    """The backbone's forward context for ``args.amp``."""
    if args.amp == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batch_loss(model, x: torch.Tensor, args: TrainArgs) -> dict:
    """The task loss of one micro-batch ``x`` [B, L] (before the sparsity penalty): ``task``
    (what is minimised), ``ce`` and, for kd / mix, ``kd``. Both losses score the same B x (L-1)
    next-token positions. The teacher runs first, once, without gradients."""
    device = x.device
    teacher = None
    if args.loss != "ce":
        with torch.no_grad(), teacher_mode(model), autocast(args, device):
            teacher = model(input_ids=x).logits[:, :-1]
    with autocast(args, device):
        out = model(input_ids=x, labels=x)
    ce = out.loss.float()
    if teacher is None:
        return {"task": ce, "ce": ce, "kd": None}
    kd = distillation_loss(out.logits[:, :-1], teacher, args.kd_temperature)
    task = kd if args.loss == "kd" else (1.0 - args.mix_weight) * ce + args.mix_weight * kd
    return {"task": task, "ce": ce, "kd": kd}


def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


@torch.no_grad()
def evaluate_heldout(model, ids: torch.Tensor, batch_size: int, max_batches: Optional[int] = None) -> dict:
    """Mean next-token cross-entropy and realised sparsity with inference-time routing."""
    from ..method.sparsity import track_sparsity

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    n = ids.shape[0] if max_batches is None else min(ids.shape[0], max_batches * batch_size)
    try:
        with track_sparsity(model) as tracker:
            for i in range(0, n, batch_size):
                x = ids[i:i + batch_size].to(device)
                logits = model(input_ids=x).logits.float()
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
                nll += float(loss)
                count += x[:, 1:].numel()
    finally:
        model.train(was_training)
    sp = tracker.summary()
    return {"ce": nll / max(count, 1), "ppl": math.exp(nll / max(count, 1)),
            "flop_sparsity": float(sp.flop_rate), "group_sparsity": float(sp.group_rate),
            "linear_sparsity": None if sp.linear_rate is None else float(sp.linear_rate)}


def optimiser_step_overflow(opt: torch.optim.Optimizer) -> Optional[float]:
    """The step size the optimiser's next step would cast to float32, if it does not fit (else
    None): for Adam-family groups ``lr / (1 - beta1^t)``, AdamW's ``lr * weight_decay`` too. A
    learning rate finite in float32 can still overflow there (1e38 at step 1 gives 1e39)."""
    f32 = torch.finfo(torch.float32).max
    over = []
    for g in opt.param_groups:
        lr = float(g["lr"])
        t = 1 + next((int(opt.state[p]["step"]) for p in g["params"] if "step" in opt.state.get(p, {})), 0)
        beta1 = (g.get("betas") or (0.0,))[0]
        size = lr / (1.0 - beta1 ** t) if beta1 < 1 else lr
        over += [v for v in (size, lr * float(g.get("weight_decay", 0.0))) if not abs(v) <= f32]  # NaN too
    return max(over, key=abs) if over else None


def _param_groups(model, params: list, args: TrainArgs) -> list:
    """One AdamW group, or two where the model learns per-element thresholds: those move in log
    units at ``FineConfig.lr_scale`` times the rate, with no weight decay (a log threshold has no
    natural zero to decay to)."""
    fine = model._modules.get("wide_fine")
    ids = {id(p) for p in fine.learnable()} if fine is not None else set()
    mine = [p for p in params if id(p) in ids]
    if not mine:
        return [{"params": params}]
    rest = [p for p in params if id(p) not in ids]
    return ([{"params": rest}] if rest else []) + [
        {"params": mine, "lr": args.lr * fine.config.lr_scale, "weight_decay": 0.0}]


def train(
    model,
    train_ids: torch.Tensor,
    args: TrainArgs,
    out_dir,
    *,
    eval_ids: Optional[torch.Tensor] = None,
    parameters: Optional[Iterable[torch.nn.Parameter]] = None,
    resume: bool = False,
    progress: bool = True,
    save_extra: Optional[Callable[[Path], None]] = None,
    load_extra: Optional[Callable[[Path], None]] = None,
    stop_at: Optional[int] = None,
    dist=None,
    aux_loss: Optional[Callable[[], torch.Tensor]] = None,
) -> dict:
    """Train ``parameters`` (default: the routers) of a wrapped model on packed sequences.

    ``train_ids``: LongTensor [N, L]. Writes ``out_dir/checkpoint`` every ``save_every``
    steps and ``out_dir/routers`` at the end; returns the history and ``wall_s``, the run's time
    summed over the invocations that made it (``wall_s_partial`` where a checkpoint it resumed
    from predates that record). ``save_extra`` /
    ``load_extra`` let stage 2 put its adapters in the same checkpoint. ``stop_at`` ends
    this invocation after that step (with a checkpoint), for time-boxed jobs; a later
    ``resume=True`` call continues the same run. ``aux_loss()``, called after each micro-batch's
    forwards, is added to its loss and recorded as ``aux`` (wide.method.head_choice's oracle label).

    ``dist`` (a ``wide.training.distributed.DistContext``) runs this loop as one rank of a data-parallel
    run: ``batch_size`` is then the global micro-batch, the sparsity loss is that of the global
    batch, and checkpoints are DCP checkpoints that resume on any number of processes. The loop
    only calls the session ``dist.session(model, seed)`` gives it, so this module does not
    depend on ``wide.training.distributed``.
    """
    session = dist.session(model, args.seed) if dist is not None else None
    try:
        return _train(model, train_ids, args, out_dir, eval_ids, parameters, resume, progress, save_extra,
                      load_extra, stop_at, session, aux_loss)
    finally:
        if session is not None:
            session.close()


def _check_resumable(ckpt: Path, saved_args: dict, args: TrainArgs, cfg) -> None:
    saved_args = with_defaults(saved_args)
    changed = {k: (saved_args.get(k), getattr(args, k)) for k in RESUME_KEYS if saved_args.get(k) != getattr(args, k)}
    changed.update(config_differences(read_meta(ckpt)["wide_config"], cfg))
    if changed:
        desc = "; ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"cannot resume {ckpt}: {desc}. Resume with the saved values, or start the run over "
                         "(resume=False)")


def _train(model, train_ids, args, out_dir, eval_ids, parameters, resume, progress, save_extra, load_extra,
           stop_at, session, aux_loss=None) -> dict:
    t_start = time.perf_counter()
    state = get_state(model)
    cfg = state.config
    fine = model._modules.get("wide_fine")
    main = session is None or session.is_main
    progress = progress and main
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if train_ids.dim() != 2 or train_ids.shape[0] == 0:
        raise ValueError(f"train_ids must be a non-empty [N, L] tensor, got shape {tuple(train_ids.shape)}")
    if args.steps < 1:
        raise ValueError("steps must be >= 1")
    device = next(model.parameters()).device
    if parameters is None:
        parameters = router_parameters(model)
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires grad (call wide.freeze_backbone(model)?)")

    opt = torch.optim.AdamW(_param_groups(model, params, args), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    history: list = []
    start_step = 0
    # The run's time over every invocation: what the checkpoint resumed from had taken, plus this
    # process's (the time a kill lost after the last checkpoint is not counted: its steps are redone).
    earlier_s, partial = 0.0, False
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)

    ckpt = out_dir / CHECKPOINT_DIR
    if main:
        # A resume continues from the newest complete checkpoint, wherever a kill left it; a
        # new run must not be mistaken later for the old one whose files it replaces.
        if resume:
            recover_directory(ckpt)
        else:
            remove_directory(ckpt)
    if session is not None:
        session.barrier()
    if resume and ckpt.exists() and session is not None and session.is_checkpoint(ckpt):
        ts = session.load_checkpoint(opt, ckpt)
        _check_resumable(ckpt, ts["args"], args, cfg)
        if load_extra is not None:
            load_extra(ckpt)
        sched.load_state_dict(ts["scheduler"])
        start_step = ts["step"]
        history = ts["history"]
        earlier_s, partial = _resumed_clock(ts)
        if progress:
            print(f"resumed from {ckpt} (written by {ts.get('world_size', 1)} processes) at step {start_step}/{args.steps}")
    elif resume and ckpt.exists():
        ts = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=False)
        if "optimizer" not in ts:  # the optimizer state is in the checkpoint's DCP files
            raise ValueError(f"{ckpt} was written by a distributed run: resume it with dist=DistContext() "
                             "(wide calibrate --fsdp, or under torchrun)")
        _check_resumable(ckpt, ts["args"], args, cfg)
        # recover_directory chose it: a sealed checkpoint matched its manifest, and one written
        # before manifests has none and still resumes
        load(model, ckpt, require_manifest=False)
        if load_extra is not None:
            load_extra(ckpt)
        opt.load_state_dict(ts["optimizer"])
        sched.load_state_dict(ts["scheduler"])
        _set_rng_state(ts["rng"])
        start_step = ts["step"]
        history = ts["history"]
        earlier_s, partial = _resumed_clock(ts)
        if progress:
            print(f"resumed from {ckpt} at step {start_step}/{args.steps}")
    elif resume and progress:
        print(f"no checkpoint in {ckpt}: starting a new run")

    def elapsed() -> dict:
        out = {"wall_s": earlier_s + time.perf_counter() - t_start}
        return {**out, "wall_s_partial": True} if partial else out

    def checkpoint(step: int) -> None:
        trainer_state = {"step": step, "scheduler": sched.state_dict(), "args": asdict(args), "history": history,
                         "tau": cfg.temperature(step, args.steps), **elapsed()}
        if session is not None:
            session.save_checkpoint(opt, ckpt, step=step, trainer_state=trainer_state, write_more=save_extra)
            return

        def write(tmp: Path) -> None:
            torch.save({**trainer_state, "optimizer": opt.state_dict(), "rng": _rng_state()}, tmp / TRAINER_STATE)
            if save_extra is not None:
                save_extra(tmp)

        save_routers(model, ckpt, extra={"step": step}, write_more=write)

    model.train()
    tokens_per_step = args.sequences_per_step * train_ids.shape[1]
    ids_on_device = device.type == "cuda" and session is None and \
        train_ids.numel() * train_ids.element_size() <= DEVICE_IDS_MAX_BYTES
    if ids_on_device:
        train_ids = train_ids.to(device)
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps,
               disable=not progress, desc="calibrate", dynamic_ncols=True)
    t_last = time.perf_counter()
    for step in bar:
        state.tau = cfg.temperature(step, args.steps)
        if fine is not None:  # the learned thresholds' surrogate anneals with the same clock
            fine.progress = step / max(1, args.steps - 1)
        opt.zero_grad(set_to_none=True)
        if session is not None:
            session.seed_step(args.seed, step)
        # Sums stay on the device until the step ends: one host sync per step, not per micro-batch.
        sums = {"task": 0.0, "ce": 0.0, "kd": 0.0, "pen": 0.0, "union": 0.0, "flop": 0.0, "grp": 0.0, "lin": 0.0,
                "aux": 0.0}
        for micro in range(args.grad_accum):
            idx = batch_indices(train_ids.shape[0], args, step, micro)
            if session is not None:
                idx = session.local_indices(idx, step, micro)
            if ids_on_device:
                x = train_ids[idx.pin_memory().to(device, non_blocking=True)]
            elif device.type == "cuda":
                x = train_ids[idx].pin_memory().to(device, non_blocking=True)
            else:
                x = train_ids[idx].to(device)
            losses = micro_batch_loss(model, x, args)
            sp = forward_sparsity(model) if session is None else session.sparsity()
            pen = sparsity_penalty(sp, target_config(cfg, args, step))
            scale = 1.0 if session is None else session.penalty_scale
            loss = losses["task"] + cfg.sparsity_coef * scale * pen
            if cfg.union_coef > 0:
                # Each rank's own micro-batch shares: the mean of local unions, not the global batch's
                # (a union over tokens a decode batch would never hold together anyway).
                union = union_penalty(model, cfg.union_tokens)
                loss = loss + cfg.union_coef * union
                sums["union"] += union.detach()
            if aux_loss is not None:
                aux = aux_loss()
                loss = loss + aux
                sums["aux"] += aux.detach()
            (loss / args.grad_accum).backward()
            seen = {}  # the task loss is the ce tensor itself with --loss ce: reduce it once
            for k in ("ce", "kd", "task"):
                t = losses[k]
                if t is not None:
                    if id(t) not in seen:  # a copy: the reduction is in place
                        seen[id(t)] = t.detach() if session is None else session.mean(t.detach().clone())
                    sums[k] += seen[id(t)]
            sums["pen"] += pen.detach()
            sums["flop"] += sp.flop_rate.detach()
            if sp.linear_rate is not None:
                sums["lin"] += sp.linear_rate.detach()
            sums["grp"] += sp.group_rate.detach()
        if session is not None:
            session.reduce_gradients(params)
        mean = {k: float(v) / args.grad_accum for k, v in sums.items()}
        if not math.isfinite(mean["task"] + mean["pen"]):
            raise FloatingPointError(f"non-finite loss at step {step} (ce={mean['ce']}, {args.loss}="
                                     f"{mean['task']}): lower the learning rate or check the data")
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        # AdamW's step is lr / (1 - beta1^t) in the parameters' float32: a learning rate that
        # overflows it (1e38 at step 1) would fail inside the step, before any loss turns non-finite
        overflow_msg = (f"the optimiser step overflowed float32 at step {step + 1} (lr {args.lr:g}): "
                        "lower the learning rate")
        if optimiser_step_overflow(opt) is not None:
            raise FloatingPointError(overflow_msg)
        try:
            opt.step()
        except RuntimeError as e:  # an overflow the check above does not model (another optimiser)
            if "overflow" not in str(e):
                raise
            raise FloatingPointError(overflow_msg) from e
        sched.step()
        rec = {"step": step + 1, "ce": mean["ce"]}
        if args.loss != "ce":
            rec["kd"] = mean["kd"]
        rec.update({"loss": mean["task"] + cfg.sparsity_coef * mean["pen"] + cfg.union_coef * mean["union"]
                    + mean["aux"],
                    "flop_sparsity": mean["flop"], "group_sparsity": mean["grp"], "linear_sparsity": mean["lin"],
                    "lr": sched.get_last_lr()[0], "tau": state.tau, "grad_norm": float(gnorm)})
        if cfg.union_coef > 0:
            rec["union"] = mean["union"]
        if aux_loss is not None:
            rec["aux"] = mean["aux"]
        now = time.perf_counter()
        rec["tokens_per_s"] = tokens_per_step / (now - t_last)
        t_last = now
        shown = {"loss": f"{rec['loss']:.3f}", "ce": f"{rec['ce']:.3f}"}
        if "kd" in rec:
            shown["kd"] = f"{rec['kd']:.3f}"
        bar.set_postfix(**shown, sp=f"{rec['flop_sparsity']:.2f}", grp=f"{rec['group_sparsity']:.2f}",
                        lin=f"{rec['linear_sparsity']:.2f}",
                        tok_s=f"{rec['tokens_per_s']:.0f}")
        done = step + 1
        if eval_ids is not None and args.eval_every and (done % args.eval_every == 0 or done == args.steps):
            rec["eval"] = evaluate_heldout(model, eval_ids, args.batch_size, args.eval_batches)
            bar.write(f"step {done}: held-out ce {rec['eval']['ce']:.3f} ppl {rec['eval']['ppl']:.2f} "
                      f"flop-sparsity {rec['eval']['flop_sparsity']:.3f} group {rec['eval']['group_sparsity']:.3f}")
        history.append(rec)
        if (args.save_every and done % args.save_every == 0) or done == args.steps or done == stop_at:
            checkpoint(done)
        if done == stop_at:
            bar.close()
            state.tau = None
            return {"history": history, "final_dir": None, "stopped_at": done, **elapsed()}
    state.tau = None
    model.eval()
    if main:
        save_routers(model, out_dir / FINAL_DIR, extra={"step": args.steps})
        atomic_write_text(out_dir / "history.json", json.dumps(history, indent=1))
    if session is not None:
        session.barrier()
    return {"history": history, "final_dir": str(out_dir / FINAL_DIR), **elapsed()}


def _resumed_clock(trainer_state: dict) -> tuple:
    """(seconds the run had taken up to a checkpoint, whether that is a lower bound only): a
    checkpoint written before checkpoints recorded their time gives (0, True)."""
    if "wall_s" not in trainer_state:
        return 0.0, True
    return float(trainer_state["wall_s"]), bool(trainer_state.get("wall_s_partial"))


def trainer_step(out_dir) -> int:
    """Step of the last checkpoint in ``out_dir`` (0 if none)."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    if not ckpt.exists():
        return 0
    return int(read_meta(ckpt).get("step", 0))


__all__ = ["TrainArgs", "RESUME_KEYS", "LOSSES", "AMP_MODES", "train", "evaluate_heldout", "batch_indices",
           "optimiser_step_overflow",
           "lr_lambda", "trainer_step", "with_defaults", "distillation_loss", "micro_batch_loss", "teacher_mode",
           "adapters_disabled", "autocast"]
