"""One training loop for both stages: stage 1 trains the routers of a frozen backbone,
stage 2 (LoRA recovery) trains routers and adapters. Only the parameter set differs.

The data order is a pure function of (seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have seen; checkpoints hold the optimizer, scheduler,
temperature and RNG states. They are written with ``wide.serialization``'s crash-safe
protocol, and a resume first recovers the newest complete one, so a kill -9 at any moment
loses at most the steps since the last checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from .cliargs import check_fields
from .modeling import forward_sparsity, get_state, sparsity_penalty
from .serialization import (atomic_write_text, config_differences, load, read_meta, recover_directory,
                            remove_directory, save_routers)

CHECKPOINT_DIR = "checkpoint"
FINAL_DIR = "routers"
TRAINER_STATE = "trainer_state.pt"


@dataclass
class TrainArgs:
    # The metadata is each field's command-line option (wide.cliargs).
    steps: int = field(default=300, metadata={"help": "optimizer steps", "min": 1})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch", "min": 1})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per step", "min": 1})
    lr: float = field(default=2e-3, metadata={"help": "AdamW peak learning rate", "gt": 0})
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

    def __post_init__(self):
        check_fields(self)

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * self.grad_accum


# Changing these mid-run would make a resumed run a different run (the others, evaluation
# and checkpoint periods, change what is recorded, not the routers).
RESUME_KEYS = ("steps", "batch_size", "grad_accum", "lr", "weight_decay", "warmup_frac", "max_grad_norm", "seed")


def lr_lambda(args: TrainArgs) -> Callable[[int], float]:
    """Linear warm-up over warmup_frac of the steps, then cosine to zero."""
    warm = max(1, int(round(args.warmup_frac * args.steps)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, args.steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return f


def batch_indices(num_sequences: int, args: TrainArgs, step: int, micro: int) -> torch.Tensor:
    """Sequence indices of one micro-batch: epochs are seeded permutations, so the order
    depends only on (seed, step, micro)."""
    start = (step * args.grad_accum + micro) * args.batch_size
    idx = torch.arange(start, start + args.batch_size)
    epoch = idx // num_sequences
    out = torch.empty_like(idx)
    for e in epoch.unique().tolist():
        g = torch.Generator().manual_seed(args.seed * 100_003 + e)
        perm = torch.randperm(num_sequences, generator=g)
        sel = epoch == e
        out[sel] = perm[idx[sel] % num_sequences]
    return out


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
    from .modeling import track_sparsity

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
            "flop_sparsity": float(sp.flop_rate), "group_sparsity": float(sp.group_rate)}


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
) -> dict:
    """Train ``parameters`` (default: the routers) of a wrapped model on packed sequences.

    ``train_ids``: LongTensor [N, L]. Writes ``out_dir/checkpoint`` every ``save_every``
    steps and ``out_dir/routers`` at the end; returns the history. ``save_extra`` /
    ``load_extra`` let stage 2 put its adapters in the same checkpoint. ``stop_at`` ends
    this invocation after that step (with a checkpoint), for time-boxed jobs; a later
    ``resume=True`` call continues the same run.

    ``dist`` (a ``wide.distributed.DistContext``) runs this loop as one rank of a data-parallel
    run: ``batch_size`` is then the global micro-batch, the sparsity loss is that of the global
    batch, and checkpoints are DCP checkpoints that resume on any number of processes. The loop
    only calls the session ``dist.session(model, seed)`` gives it, so this module does not
    depend on ``wide.distributed``.
    """
    session = dist.session(model, args.seed) if dist is not None else None
    try:
        return _train(model, train_ids, args, out_dir, eval_ids, parameters, resume, progress, save_extra,
                      load_extra, stop_at, session)
    finally:
        if session is not None:
            session.close()


def _check_resumable(ckpt: Path, saved_args: dict, args: TrainArgs, cfg) -> None:
    changed = {k: (saved_args.get(k), getattr(args, k)) for k in RESUME_KEYS if saved_args.get(k) != getattr(args, k)}
    changed.update(config_differences(read_meta(ckpt)["wide_config"], cfg))
    if changed:
        desc = "; ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"cannot resume {ckpt}: {desc}. Resume with the saved values, or start the run over "
                         "(resume=False)")


def _train(model, train_ids, args, out_dir, eval_ids, parameters, resume, progress, save_extra, load_extra,
           stop_at, session) -> dict:
    state = get_state(model)
    cfg = state.config
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
        parameters = list(model.wide_routers.parameters())
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires grad (call wide.freeze_backbone(model)?)")

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    history: list = []
    start_step = 0
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
        if progress:
            print(f"resumed from {ckpt} (written by {ts.get('world_size', 1)} processes) at step {start_step}/{args.steps}")
    elif resume and ckpt.exists():
        ts = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=False)
        if "optimizer" not in ts:  # the optimizer state is in the checkpoint's DCP files
            raise ValueError(f"{ckpt} was written by a distributed run: resume it with dist=DistContext() "
                             "(wide calibrate --fsdp, or under torchrun)")
        _check_resumable(ckpt, ts["args"], args, cfg)
        load(model, ckpt)
        if load_extra is not None:
            load_extra(ckpt)
        opt.load_state_dict(ts["optimizer"])
        sched.load_state_dict(ts["scheduler"])
        _set_rng_state(ts["rng"])
        start_step = ts["step"]
        history = ts["history"]
        if progress:
            print(f"resumed from {ckpt} at step {start_step}/{args.steps}")
    elif resume and progress:
        print(f"no checkpoint in {ckpt}: starting a new run")

    def checkpoint(step: int) -> None:
        trainer_state = {"step": step, "scheduler": sched.state_dict(), "args": asdict(args), "history": history,
                         "tau": cfg.temperature(step, args.steps)}
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
    bar = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps,
               disable=not progress, desc="calibrate", dynamic_ncols=True)
    t_last = time.perf_counter()
    for step in bar:
        state.tau = cfg.temperature(step, args.steps)
        opt.zero_grad(set_to_none=True)
        if session is not None:
            session.seed_step(args.seed, step)
        ce_sum, pen_sum, flop_sum, grp_sum = 0.0, 0.0, 0.0, 0.0
        for micro in range(args.grad_accum):
            idx = batch_indices(train_ids.shape[0], args, step, micro)
            if session is not None:
                idx = session.local_indices(idx, step, micro)
            x = train_ids[idx].to(device)
            out = model(input_ids=x, labels=x)
            sp = forward_sparsity(model) if session is None else session.sparsity()
            pen = sparsity_penalty(sp, cfg)
            scale = 1.0 if session is None else session.penalty_scale
            loss = (out.loss + cfg.sparsity_coef * scale * pen) / args.grad_accum
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at step {step} (ce={float(out.loss)}): "
                                         "lower the learning rate or check the data")
            loss.backward()
            ce_sum += float(out.loss.detach()) if session is None else session.mean(out.loss)
            pen_sum += float(pen.detach())
            flop_sum += float(sp.flop_rate.detach())
            grp_sum += float(sp.group_rate.detach())
        if session is not None:
            session.reduce_gradients(params)
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        sched.step()
        now = time.perf_counter()
        rec = {"step": step + 1, "ce": ce_sum / args.grad_accum,
               "loss": (ce_sum + cfg.sparsity_coef * pen_sum) / args.grad_accum,
               "flop_sparsity": flop_sum / args.grad_accum, "group_sparsity": grp_sum / args.grad_accum,
               "lr": sched.get_last_lr()[0], "tau": state.tau, "grad_norm": float(gnorm),
               "tokens_per_s": tokens_per_step / (now - t_last)}
        t_last = now
        bar.set_postfix(loss=f"{rec['loss']:.3f}", ce=f"{rec['ce']:.3f}", sp=f"{rec['flop_sparsity']:.2f}",
                        grp=f"{rec['group_sparsity']:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}")
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
            return {"history": history, "final_dir": None, "stopped_at": done}
    state.tau = None
    model.eval()
    if main:
        save_routers(model, out_dir / FINAL_DIR, extra={"step": args.steps})
        atomic_write_text(out_dir / "history.json", json.dumps(history, indent=1))
    if session is not None:
        session.barrier()
    return {"history": history, "final_dir": str(out_dir / FINAL_DIR)}


def trainer_step(out_dir) -> int:
    """Step of the last checkpoint in ``out_dir`` (0 if none)."""
    ckpt = Path(out_dir) / CHECKPOINT_DIR
    if not ckpt.exists():
        return 0
    return int(read_meta(ckpt).get("step", 0))


__all__ = ["TrainArgs", "RESUME_KEYS", "train", "evaluate_heldout", "batch_indices", "lr_lambda", "trainer_step"]
