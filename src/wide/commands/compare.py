"""``wide compare``: dense, WIDE (stage 1 and 2) and the baselines at the same FLOP budgets,
the same token budget and the same seed, evaluated on held-out perplexity and the seven
zero-shot tasks.

Every trained method gets a run directory ``RUNS/<method>-<pct>/stage{1,2}`` that is resumed
on a rerun; a finished method leaves ``final/`` (routers, adapters or static masks, loadable
with ``wide.training.recovery.load_recovered``). Evaluations are cached in ``RUNS/evals.json`` under a
key that includes every setting that changes the numbers, so an interrupted comparison picks
up where it stopped and a finished one only rewrites the outputs.

Token budget: every routed method trains ``--steps`` x ``--batch-size`` x ``--seq-len``
tokens in stage 1 (same data order, same seed); stage 2 adds ``--recovery-steps`` on the same
data. Static width pruning uses no gradient steps: it scores channels on
``--static-calib-sequences`` of the calibration text; its optional LoRA stage gets the same
stage-2 budget as WIDE's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from . import runs
from ..method.baselines import NORMALIZE
from ..base.cliargs import add_fields, from_args
from ..method.config import WideConfig, routing_name as config_routing_name
from ..base.fileio import atomic_write_text
from ..method.fine import FineConfig
from ..training.recovery import RECOVERY_DEFAULTS, RECOVERY_LR, LoraArgs
from ..training.train import LOSSES, TrainArgs, with_defaults

METHOD_ROWS = {
    # name: (family, stage, label)
    "dense": (None, 0, "Dense"),
    "wide": ("wide", 1, "WIDE (calibration)"),
    "wide_lora": ("wide", 2, "WIDE + LoRA"),
    "dynamic_depth": ("dynamic_depth", 1, "Dynamic depth (token)"),
    "dynamic_depth_lora": ("dynamic_depth", 2, "Dynamic depth + LoRA"),
    "module_skip": ("module_skip", 1, "Module skipping"),
    "module_skip_lora": ("module_skip", 2, "Module skipping + LoRA"),
    "static_width": ("static_width", 1, "Static width (Wanda-sp)"),
    "static_width_lora": ("static_width", 2, "Static width + LoRA"),
    # per-element activation sparsity (wide.fine): training-free in stage 1, LoRA in stage 2
    "teal": ("teal", 1, "TEAL (uniform)"),
    "teal_lora": ("teal", 2, "TEAL (uniform) + LoRA"),
    "teal_greedy": ("teal_greedy", 1, "TEAL (greedy)"),
    "teal_greedy_lora": ("teal_greedy", 2, "TEAL (greedy) + LoRA"),
    "wina": ("wina", 1, "WINA (uniform)"),
    "wina_lora": ("wina", 2, "WINA (uniform) + LoRA"),
    "wina_greedy": ("wina_greedy", 1, "WINA (greedy)"),
    "wina_greedy_lora": ("wina_greedy", 2, "WINA (greedy) + LoRA"),
    # routers and learned per-element thresholds under one linear-MAC budget
    "hybrid": ("hybrid", 1, "Hybrid (routers + learned thresholds)"),
    "hybrid_lora": ("hybrid", 2, "Hybrid + LoRA"),
    # the hybrid without routers: what the routers add to learned thresholds
    "learned": ("learned", 1, "Learned thresholds (no routers)"),
    "learned_lora": ("learned", 2, "Learned thresholds + LoRA"),
    # issue 48's design (a): attention head-group routers beside a set of frozen learned thresholds
    "heads": ("heads", 1, "Head routers + frozen learned thresholds"),
    "heads_lora": ("heads", 2, "Head routers + frozen thresholds + LoRA"),
}
LEARNED_FAMILIES = ("hybrid", "learned")
# The heads family's routing and training aids: the kept design's (`wide calibrate --thresholds`,
# docs/routing_structure.md): each token skips at most one attention group, layer 0 dense, every
# routed layer held to its rate; the routers' penalty counts groups, as the thresholds keep their own
# linear sparsity. The other router options are the comparison's shared ones.
HEADS_ROUTING = {"sparse_target": "attention", "attn_rule": "skip_upto", "attn_skip": 1, "attn_dense_layers": [0],
                 "budget": "layer", "loss_mode": "groups"}
HEADS_CHOICE = {"oracle_ce": 3.0, "input_choice": True}
# family -> (criterion, allocation) of the training-free per-element methods
FINE_FAMILIES = {"teal": ("magnitude", "uniform"), "teal_greedy": ("magnitude", "greedy"),
                 "wina": ("wina", "uniform"), "wina_greedy": ("wina", "greedy")}
AXES = ("flops", "linear")
# axis -> (record key, table column, plot label, what the column counts): the table and the plot
# show the run's own axis; on the FLOP axis every per-element method sits at 0 (it skips no group)
AXIS_VIEW = {
    "flops": ("sparsity", "FLOP sparsity", "realised FLOP-weighted sparsity",
              "FLOP-weighted: share of the routable q+o and gate+up+down MACs skipped"),
    "linear": ("linear_sparsity", "linear sparsity", "realised share of the linear-layer MACs skipped",
               "linear: share of all linear-layer MACs skipped, q, k, v, o, gate, up and down, routed groups and "
               "per-element inputs together"),
}
DEFAULT_METHODS = ("dense", "wide", "wide_lora", "dynamic_depth", "module_skip", "static_width")
REFERENCE = "dynamic_depth"


@dataclass
class CompareArgs:
    """The options of ``wide compare`` beyond the shared model, data, evaluation and training
    ones (wide.base.cliargs metadata)."""

    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS), metadata={
        "nargs": "+", "choices": list(METHOD_ROWS), "help": "methods to run"})
    targets: list[float] = field(default_factory=lambda: [0.25, 0.5], metadata={
        "nargs": "+", "help": "FLOP-weighted sparsity targets", "gt": 0, "lt": 1})
    runs: str = field(default="runs/compare", metadata={"help": "run directory root, reused on a rerun"})
    # not a committed results file: a bare `wide compare` must not overwrite the headline
    out: str = field(default="results/compare", metadata={
        "help": "results stem: OUT.json, OUT.md, OUT.png"})
    quiet: bool = field(default=False, metadata={"help": "no per-step progress bars"})
    recovery_steps: Optional[int] = field(default=None, metadata={"help": "stage-2 steps (default: --steps)", "min": 1})
    recovery_lr: float = field(default=RECOVERY_LR, metadata={"help": "stage-2 learning rate", "gt": 0})
    static_calib_sequences: int = field(default=32, metadata={
        "help": "calibration sequences for channel importance", "min": 1})
    static_normalize: str = field(default="layer", metadata={
        "choices": NORMALIZE, "help": "how attention and FFN scores are made comparable"})
    freeze_routers: bool = field(default=False, metadata={"help": "stage 2 trains adapters only"})
    # TEAL calibrates on 64 sequences (of 2048 tokens in its paper; ours are --seq-len long).
    fine_calib_sequences: int = field(default=64, metadata={
        "help": "calibration sequences for TEAL / WINA thresholds and the hybrid's starting thresholds", "min": 1})
    axis: str = field(default="flops", metadata={
        "choices": AXES,
        "help": "what --targets mean for routed methods: the FLOP-weighted routable share (flops) or the share of "
                "all linear-layer MACs (linear; the axis per-element methods are always on, and the frontier's)"})
    heads_thresholds: Optional[str] = field(default=None, metadata={
        "help": "heads, heads_lora: the frozen thresholds' set (a shipped name such as smollm2-135m-fine-50, or a "
                "directory wide wrote with thresholds), for one --targets value, the set's; default: the "
                "comparison's own learned row at the same target (stage 1, trained first if the run lacks it)"})
    heads_core_target: float = field(default=0.25, metadata={
        "help": "heads, heads_lora: attention-core sparsity (share of QK^T and PV MACs skipped over all layers, "
                "layer 0 dense) the router offsets hit on calibration text", "gt": 0.0, "lt": 1.0})
    heads_target: Optional[float] = field(default=None, metadata={
        "help": "heads, heads_lora: the routed layers' attention group rate the routers train toward (default: "
                "--heads-core-target; the kept design trained at 0.26 for 0.25)", "gt": 0.0, "lt": 1.0})
    heads_loss: str = field(default="kd", metadata={
        "choices": LOSSES,
        "help": "heads, heads_lora: their task loss in both stages (the others' is --loss), with --kd-temperature "
                "and --mix-weight"})


def _pct(target: float) -> str:
    return f"{round(target * 100):02d}"


class Comparison:
    def __init__(self, args):
        self.args = args
        self.root = Path(args.runs)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache_path = self.root / "evals.json"
        self.cache = json.loads(self.cache_path.read_text()) if self.cache_path.is_file() else {}
        self.model_path = None
        self.tok = None
        self._fine_cache: dict = {}  # (criterion, allocation) -> (dense scores, greedy paths)

    # ------------------------------------------------------------ setup

    def load_data(self):
        import torch
        from transformers import AutoTokenizer

        a = self.args
        self.model_path, self.device = runs.resolve(a)
        self.dtype = getattr(torch, a.dtype)
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        self.train_ids, self.decontamination = runs.calibration(a, self.tok, a.max_train_tokens)
        self.heldout, self.bpt = runs.heldout(a, self.tok)
        need = a.steps * a.batch_size * a.grad_accum
        print(f"compare: {self.train_ids.shape[0]} calibration sequences x {self.train_ids.shape[1]} tokens "
              f"({need} sequences per stage, {'repeating' if need > self.train_ids.shape[0] else 'no repeat'}), "
              f"{self.heldout.shape[0]} held-out sequences, device {self.device}, dtype {a.dtype}", flush=True)

    def fresh(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()

    def train_args(self, stage: int, family: Optional[str] = None) -> TrainArgs:
        a = self.args
        own = {"loss": a.heads_loss} if family == "heads" else {}
        if stage == 1:
            return from_args(TrainArgs, a, eval_every=0, **own)
        return from_args(TrainArgs, a, **{**RECOVERY_DEFAULTS, "lr": a.recovery_lr, **own}, eval_every=0,
                         steps=a.recovery_steps)

    # ------------------------------------------------------------ building methods

    def _check_final(self, final: Path, settings: dict) -> bool:
        from ..io.serialization import read_meta

        if not final.is_dir():
            return False
        saved = read_meta(final).get("compare_settings")
        if isinstance(saved, dict) and isinstance(saved.get("train"), dict):
            saved = {**saved, "train": with_defaults(saved["train"])}  # built before a TrainArgs field existed
        if saved != settings:
            raise ValueError(f"{final} was built with other settings ({saved}) than this run ({settings}): "
                             "use another --runs directory or delete it")
        return True

    def run_dir(self, family: str, target: float) -> Path:
        # one run directory holds the head routers of several core targets beside one learned row
        core = f"{_pct(self.args.heads_core_target)}" if family == "heads" else ""
        return self.root / f"{family}{core}-{_pct(target)}"

    def settings(self, family: str, stage: int, target: float) -> dict:
        """What a method's final directory was built with (checked on reuse)."""
        a = self.args
        out = {"train": asdict(self.train_args(stage, family)), "wide": wide_overrides(a), "target": target,
               "offsets": a.offsets, "static_calib_sequences": a.static_calib_sequences,
               "static_normalize": a.static_normalize, "dtype": a.dtype}
        out.update(fine_settings(a, family))
        out.update(heads_settings(a, family))
        if family == "heads" and not a.heads_thresholds:
            out["thresholds_from"] = self.settings("learned", 1, target)
        if stage == 2:
            out["lora"] = {"r": a.lora_r, "alpha": a.lora_alpha, "dropout": a.lora_dropout,
                           "freeze_routers": a.freeze_routers}
        return out

    def build(self, family: str, stage: int, target: float) -> Path:
        """Train (or reuse) one method; returns its final directory."""
        from ..method import baselines, modeling
        from ..training.recovery import load_recovered, recover, save_recovered
        from ..training.train import train

        run = self.run_dir(family, target)
        final = run / f"stage{stage}" / "final"
        targs = self.train_args(stage, family)
        settings = self.settings(family, stage, target)
        if self._check_final(final, settings):
            return final
        extra = {"method": family, "stage": stage, "target": target, "compare_settings": settings}
        if stage == 2:
            base = self.build(family, 1, target)
            model = load_recovered(self.fresh(), base)
            static = baselines.apply_static_file(model, base)
            lora = from_args(LoraArgs, self.args)
            print(f"  stage 2 (LoRA) for {family} at {target:.0%}: {targs.steps} steps", flush=True)
            recover(model, self.train_ids, targs, run / "stage2", lora=lora,
                    freeze_routers=self.args.freeze_routers or static is not None,
                    freeze_thresholds=family == "heads", resume=True, progress=not self.args.quiet, extra=extra)
            model.eval()
            if family in FINE_FAMILIES:  # the same shares of the adapted model's own inputs
                from ..method import fine

                fine.set_thresholds(model, fine.collect_scores(model, self.fine_batches()), model.wide_fine.sparsity)
            elif family == "heads":
                runs.head_offsets(model, self.args, self.args.heads_core_target, self.train_ids)
            elif static is None:
                runs.calibrate_offsets(model, self.args, self.train_ids)
            save_recovered(model, final, extra=extra,
                           write_more=(lambda d: static.save(d)) if static is not None else None)
            return final
        if family == "heads":
            return self._build_heads(target, final, extra)
        model = self.fresh()
        if family in FINE_FAMILIES:
            return self._build_fine(model, family, target, final, extra)
        if family == "static_width":
            n = self.args.static_calib_sequences
            batches = self.train_ids[:n].split(self.args.batch_size)
            cfg = baselines.method_config("static_width", model.config, target, **wide_overrides(self.args))
            modeling.wrap(model, cfg)
            pruning = baselines.static_width(model, batches, target, normalize=self.args.static_normalize)
            r = pruning.rates(modeling.get_state(model).geometry)
            print(f"  static width at {target:.0%}: removes {r['flop_rate']:.3f} of routable MACs "
                  f"(attention {r['attn_rate']:.3f}, FFN {r['ffn_rate']:.3f})", flush=True)
            save_recovered(model, final, extra={**extra, "static_rates": r}, write_more=pruning.save)
            return final
        if family in LEARNED_FAMILIES:
            cfg = WideConfig(target_sparsity=target, **{**wide_overrides(self.args), "loss_mode": "linear"},
                             sparse_target="all" if family == "hybrid" else "none")
        else:
            cfg = baselines.method_config(family, model.config, target, **wide_overrides(self.args))
        modeling.wrap(model, cfg, seed=self.args.seed)  # --seed covers router initialisation too
        if family in LEARNED_FAMILIES:
            from ..method import fine

            fine.attach(model, from_args(FineConfig, self.args, target=target, allocation="learned"))
            fine.calibrate(model, self.fine_batches(), progress=not self.args.quiet)
        modeling.freeze_backbone(model)
        print(f"  stage 1 for {family} at {target:.0%}: {targs.steps} steps", flush=True)
        train(model, self.train_ids, targs, run / "stage1", resume=True, progress=not self.args.quiet)
        model.eval()
        runs.calibrate_offsets(model, self.args, self.train_ids)
        save_recovered(model, final, extra=extra)
        return final

    def _build_heads(self, target: float, final: Path, extra: dict) -> Path:
        """Design (a)'s stage 1, as `wide calibrate --thresholds` trains it: head routers beside
        the thresholds of --heads-thresholds or of the learned row at ``target``, which stay frozen
        (bit for bit the set's), offsets to --heads-core-target."""
        from ..method import modeling
        from ..method.head_choice import HeadChoice
        from ..training.recovery import save_recovered
        from ..training.train import train

        a = self.args
        source = Path(a.heads_thresholds) if a.heads_thresholds else self.build("learned", 1, target)
        model = self.fresh()
        modeling.wrap(model, heads_config(a), seed=a.seed)
        modeling.freeze_backbone(model)
        runs.load_frozen_thresholds(model, source)
        choice = HeadChoice(model, **HEADS_CHOICE)
        print(f"  stage 1 for heads beside the thresholds of {source}: {a.steps} steps", flush=True)
        try:
            train(model, self.train_ids, self.train_args(1, "heads"), final.parent.parent / "stage1", resume=True,
                  progress=not a.quiet, aux_loss=choice.aux_loss)
        finally:
            choice.remove()
        model.eval()
        offsets = runs.head_offsets(model, a, a.heads_core_target, self.train_ids)
        save_recovered(model, final, extra={**extra, "thresholds_from": str(source), "oracle_log": choice.summary(),
                                            "head_offsets": offsets})
        return final

    def fine_batches(self) -> list:
        a = self.args
        return list(self.train_ids[:a.fine_calib_sequences].split(a.batch_size))

    def _build_fine(self, model, family: str, target: float, final: Path, extra: dict) -> Path:
        """TEAL / WINA: thresholds from the dense model's activations on calibration text, no
        gradient step. Wrapped without routers, so they save, load and recover like the others."""
        from ..method import fine, modeling
        from ..training.recovery import save_recovered

        criterion, allocation = FINE_FAMILIES[family]
        modeling.wrap(model, WideConfig(sparse_target="none", target_sparsity=target, loss_mode="linear"))
        fine.attach(model, from_args(FineConfig, self.args, criterion=criterion, allocation=allocation,
                                     target=target, per_channel=False))
        t0 = time.perf_counter()
        # The dense model's scores and TEAL's greedy paths do not depend on the target: one
        # search up to the largest target serves them all (the path is the same walk).
        scores, tables = self._fine_cache.get((criterion, allocation), (None, None))
        if scores is None:
            scores = fine.collect_scores(model, self.fine_batches())
            if allocation == "greedy":
                tables = self._greedy_tables(model, family, criterion, scores)
            self._fine_cache[(criterion, allocation)] = (scores, tables)
        dims = modeling.get_state(model).geometry.dims
        share = fine.greedy_sparsity(tables, target) if tables else fine.uniform_sparsity(dims, target)
        fine.set_thresholds(model, scores, share)
        print(f"  {family} thresholds at {target:.0%} from {self.args.fine_calib_sequences} sequences in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
        save_recovered(model, final, extra=extra)
        return final

    def _greedy_tables(self, model, family: str, criterion: str, scores: dict) -> list:
        """TEAL's greedy paths, kept in RUNS beside the evaluation cache: the search is the
        slow part of a greedy method (about 3 min of an H100 for SmolLM2 up to 60 %), and a
        comparison cut by a device call's time limit must not redo it on the next call. A
        stored path up to a larger target serves a smaller one (it is the same walk)."""
        from ..method import fine

        a = self.args
        up_to = max(a.targets)
        sig = {"key": self.eval_key(family, None).split("|")[1], "criterion": criterion}
        path = self.root / f"greedy_paths_{criterion}.json"
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
                if stored.get("sig") == sig and stored.get("up_to", 0) >= up_to - 1e-9:
                    print(f"  {family}: greedy paths up to {stored['up_to']:.0%} from {path.name}", flush=True)
                    return [[(e, list(sh)) for e, sh in layer] for layer in stored["tables"]]
            except (ValueError, KeyError, TypeError):
                pass  # unreadable or from other settings: searched again and rewritten below
        tables = fine.greedy_tables(model, self.fine_batches(), scores, up_to, progress=not a.quiet)
        atomic_write_text(path, json.dumps({"sig": sig, "up_to": up_to, "tables": tables}))
        return tables

    # ------------------------------------------------------------ evaluation

    def eval_key(self, name: str, target) -> str:
        a = self.args
        sig = {"tasks": list(a.tasks), "limit": a.limit, "max_eval_sequences": a.max_eval_sequences,
               "seq_len": a.seq_len, "data": a.data, "dtype": a.dtype, "model": self.model_path,
               "steps": a.steps, "recovery_steps": a.recovery_steps, "seed": a.seed, "lr": a.lr,
               "recovery_lr": a.recovery_lr, "batch_size": a.batch_size, "grad_accum": a.grad_accum,
               "wide": wide_overrides(self.args), "offsets": a.offsets, "heldout_fraction": a.heldout_fraction,
               "static": [a.static_calib_sequences, a.static_normalize],
               "lora": [a.lora_r, a.lora_alpha, a.lora_dropout, a.freeze_routers],
               "loss": [a.loss, a.kd_temperature, a.mix_weight], "amp": a.amp, "sparsity_warmup": a.sparsity_warmup,
               "eval_data": runs.eval_source(a), "decontaminate": a.decontaminate,
               "text_field": a.text_field, "max_train_tokens": a.max_train_tokens,
               **fine_settings(a, METHOD_ROWS[name][0]), **heads_settings(a, METHOD_ROWS[name][0]),
               # only when asked, so that earlier caches keep their keys
               **({"generation": [a.generation, a.generation_tokens, a.generation_prompt]}
                  if getattr(a, "generation", 0) else {})}
        h = hashlib.sha1(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:12]
        return f"{name}@{target}|{h}"

    def evaluate(self, name: str, target) -> dict:
        from ..training.recovery import load_recovered

        key = self.eval_key(name, target)
        if key in self.cache:
            print(f"  cached evaluation of {name} at {target}", flush=True)
            return self.cache[key]
        family, stage, label = METHOD_ROWS[name]
        t0 = time.perf_counter()
        if family is None:
            model = self.fresh()
        else:
            final = self.build(family, stage, target)
            model = load_recovered(self.fresh(), final)
        t_build = time.perf_counter() - t0
        print(f"  evaluating {label} at {target if target is not None else 0:.0%}", flush=True)
        reference = self.fresh() if getattr(self.args, "generation", 0) and family is not None else None
        rec = runs.evaluate_one(model, self.tok, self.args, self.heldout, self.bpt, family or "dense", stage,
                                reference=reference)
        rec["model"] = Path(self.model_path).name
        rec.update(name=name, label=label, target=target, build_s=t_build,
                   eval_s=time.perf_counter() - t0 - t_build)
        if stage == 2:
            rec["merge_check"] = self.merge_check(final)
        a = self.args
        if family is not None:
            steps = a.steps if family not in ("static_width", *FINE_FAMILIES) else 0
            rec["train_tokens"] = (steps + (a.recovery_steps if stage == 2 else 0)) * a.batch_size * a.grad_accum * a.seq_len
        # loss, tokens, seed: what trained it (no gradient step: no loss; dense: nothing)
        trained = family is not None and (family not in ("static_width", *FINE_FAMILIES) or stage == 2)
        rec.update(loss=(a.heads_loss if family == "heads" else a.loss) if trained else None,
                   tokens=rec.get("train_tokens", 0), seed=a.seed if trained else None,
                   routing=None if family in (None, "static_width", "learned", *FINE_FAMILIES) else "token")
        if family == "heads":
            rec.update(routing=config_routing_name(attn_rule=HEADS_ROUTING["attn_rule"],
                                                   attn_skip=HEADS_ROUTING["attn_skip"]),
                       attn_core_target=a.heads_core_target,
                       thresholds_from=a.heads_thresholds or f"learned@{target}")
        self.cache[key] = rec
        atomic_write_text(self.cache_path, json.dumps(self.cache, indent=1))
        del model
        return rec

    def merge_check(self, final: Path) -> dict:
        """Merged adapters (what is evaluated and served) against the unmerged PEFT layers, on
        held-out text. The merge error is put beside the size of what stage 2 changed (the
        unmerged model against its stage-1 starting point), so a tiny error cannot pass only
        because the adapters did nothing. With per-element thresholds the merge error is taken
        with them switched off: a hard threshold turns the merge's rounding (W x + B A x against
        (W + B A) x) into flipped input elements that compound over the layers (1e-6 weight noise
        in one layer moves SmolLM2's thresholded logits by ~8 %), which says nothing about the
        merge; the thresholded error and argmax agreement are reported beside it."""
        import torch

        from ..method.fine import get_fine
        from ..training.recovery import has_lora, load_recovered

        ids = self.heldout[:4].to(self.device)
        unmerged = load_recovered(self.fresh(), final, merge_adapters=False)
        if not has_lora(unmerged):
            return {}
        merged = load_recovered(self.fresh(), final)
        start = load_recovered(self.fresh(), final.parent.parent / "stage1" / "final")
        models = (unmerged, merged, start)
        thresholded = get_fine(unmerged) is not None

        def logits(enabled: bool):
            for m in models:
                if get_fine(m) is not None:
                    get_fine(m).enabled = enabled
            return [m(input_ids=ids).logits.float() for m in models]

        with torch.no_grad():
            a, b, c = logits(not thresholded)
            res = {"logits_rel_err": float((b - a).norm() / a.norm()),
                   "stage2_change_rel": float((c - a).norm() / a.norm()),
                   "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                   "tokens": int(ids.numel())}
            if thresholded:
                a, b, _ = logits(True)
                res.update(thresholds_off=True, logits_rel_err_thresholded=float((b - a).norm() / a.norm()),
                           argmax_agreement_thresholded=float((a.argmax(-1) == b.argmax(-1)).float().mean()))
        del models, unmerged, merged, start
        print(f"  merged vs unmerged{' (thresholds off)' if thresholded else ''}: logits rel err "
              f"{res['logits_rel_err']:.2e} (stage 2 changed them by {res['stage2_change_rel']:.2e}), argmax agreement "
              f"{res['argmax_agreement']:.4f}" + (f"; thresholded: rel err {res['logits_rel_err_thresholded']:.2e}, "
                                                  f"argmax agreement {res['argmax_agreement_thresholded']:.4f}"
                                                  if thresholded else ""), flush=True)
        return res

    # ------------------------------------------------------------ the whole run

    def run(self) -> list:
        a = self.args
        self.load_data()
        jobs = [("dense", None)] if "dense" in a.methods else []
        jobs += [(m, t) for t in a.targets for m in a.methods if m != "dense"]
        records = []
        t0 = time.perf_counter()
        for i, (name, target) in enumerate(jobs, 1):
            tgt = "" if target is None else f" at {target:.0%}"
            print(f"[{i}/{len(jobs)}] {METHOD_ROWS[name][2]}{tgt} ({(time.perf_counter() - t0) / 60:.1f} min so far)",
                  flush=True)
            records.append(self.evaluate(name, target))
            write_outputs(records, a.out, a, command=runs.command(), extra={"decontamination": self.decontamination})
        return records


# ---------------------------------------------------------------- outputs


def relative_to_reference(records: list) -> None:
    """Adds rel_avg_vs_depth / rel_ppl_vs_depth (percent) against dynamic depth pruning at the
    same target and stage 1 (the paper's calibration-only reference)."""
    ref = {r["target"]: r for r in records if r.get("name") == REFERENCE}
    for r in records:
        base = ref.get(r.get("target"))
        if base is None or r is base:
            continue
        if r.get("avg") is not None and base.get("avg"):
            r["rel_avg_vs_depth"] = 100.0 * (r["avg"] - base["avg"]) / base["avg"]
        if r.get("ppl") and base.get("ppl"):
            r["rel_ppl_vs_depth"] = 100.0 * (r["ppl"] - base["ppl"]) / base["ppl"]


def table(records: list, tasks, axis: str = "flops") -> str:
    key, column = AXIS_VIEW[axis][:2]
    head = ["method", "stage", "target", column, "group sparsity", "ppl", "bpb", *tasks, "avg",
            "avg vs depth", "ppl vs depth"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, p=3):
        return "-" if v is None else f"{v:.{p}f}"

    def rel(v):
        return "-" if v is None else f"{v:+.1f}%"

    for r in records:
        cells = [r.get("label", r.get("method")), str(r.get("stage")),
                 "-" if r.get("target") is None else f"{r['target']:.0%}",
                 f(r.get(key)), f(r.get("group_sparsity")), f(r.get("ppl"), 2), f(r.get("bpb"))]
        cells += [f(r.get(t)) for t in tasks] + [f(r.get("avg")), rel(r.get("rel_avg_vs_depth")),
                                                 rel(r.get("rel_ppl_vs_depth"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list, path, axis: str = "flops") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    dense = next((r for r in records if r.get("name") == "dense"), None)
    names = [n for n in METHOD_ROWS if n != "dense" and any(r.get("name") == n for r in records)]
    key, _, label, _ = AXIS_VIEW[axis]

    def x(r):  # a record without the key (written before linear_sparsity was) at 0, as evaluate_one writes it
        return r.get(key) or 0.0

    for n in names:
        rows = sorted((r for r in records if r.get("name") == n), key=x)
        xs = [x(r) for r in rows]
        style = "-" if METHOD_ROWS[n][1] == 1 else "--"
        if any(r.get("avg") is not None for r in rows):
            ax1.plot(xs, [r.get("avg") for r in rows], style, marker="o", label=METHOD_ROWS[n][2])
        ax2.plot(xs, [r["ppl"] for r in rows], style, marker="o", label=METHOD_ROWS[n][2])
    if dense is not None:
        if dense.get("avg") is not None:
            ax1.axhline(dense["avg"], color="k", lw=0.8, ls=":", label="Dense")
        ax2.axhline(dense["ppl"], color="k", lw=0.8, ls=":", label="Dense")
    ax1.set_xlabel(label)
    ax1.set_ylabel("average zero-shot accuracy")
    ax2.set_xlabel(label)
    ax2.set_ylabel("held-out perplexity")
    ax2.set_yscale("log")
    xmax = max([x(r) for r in records] + [0.5])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xlim(-0.02, xmax + 0.05)  # one target alone would otherwise zoom into rounding noise
    ax1.legend(fontsize=8)
    model = records[0].get("model", "") if records else ""
    fig.suptitle(f"{model}: quality against sparsity (same token budget and seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fine_settings(a, family) -> dict:
    """What else changes the numbers of per-element and hybrid methods, and of any method on the
    linear axis; empty for the rest, so that earlier caches and runs keep their keys."""
    out = {}
    if getattr(a, "axis", "flops") != "flops":
        out["axis"] = a.axis
    if family in FINE_FAMILIES or family in LEARNED_FAMILIES:
        out["fine"] = [a.fine_calib_sequences, a.fine_criterion, a.fine_per_channel, a.fine_tau_start,
                       a.fine_tau_end, a.fine_lr_scale, a.greedy_step, a.greedy_last_fraction]
    return out


def heads_settings(a, family) -> dict:
    """What else changes the heads family's numbers; empty for the rest, so that earlier caches
    and runs keep their keys. From the learned row, its thresholds follow the per-element options."""
    if family != "heads":
        return {}
    out = {"heads": [a.heads_thresholds, a.heads_core_target, a.heads_target, a.heads_loss, HEADS_ROUTING,
                     HEADS_CHOICE]}
    if not a.heads_thresholds:
        out.update(fine_settings(a, "learned"))
    return out


def heads_config(a) -> WideConfig:
    """The heads family's routers: the comparison's shared router options under HEADS_ROUTING."""
    return WideConfig(target_sparsity=a.heads_target if a.heads_target is not None else a.heads_core_target,
                      **{**wide_overrides(a), **HEADS_ROUTING})


def wide_overrides(a) -> dict:
    """The WideConfig fields a comparison sets for every method from its arguments."""
    return dict(router_rank=a.router_rank, router_input=a.router_input, router_init=a.router_init,
                loss_mode=getattr(a, "axis", "flops"),
                tau_start=a.tau_start, tau_end=a.tau_end, sparsity_coef=a.sparsity_coef,
                ffn_group_size=a.ffn_group_size, budget=a.budget)


def write_outputs(records: list, out_stem, args, command: str, extra: Optional[dict] = None) -> None:
    import platform

    import torch

    relative_to_reference(records)
    out = Path(out_stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and "cuda" in str(args.device or "cuda") \
        else (platform.processor() or "cpu")
    doc = {"device": device, "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": command,
           "settings": {"steps": args.steps, "recovery_steps": args.recovery_steps, "batch_size": args.batch_size,
                        "grad_accum": args.grad_accum, "seq_len": args.seq_len, "seed": args.seed,
                        "lr": args.lr, "recovery_lr": args.recovery_lr, "limit": args.limit,
                        "max_eval_sequences": args.max_eval_sequences, "targets": list(args.targets),
                        "dtype": args.dtype, "loss": args.loss, "kd_temperature": args.kd_temperature,
                        "mix_weight": args.mix_weight, "amp": args.amp, "sparsity_warmup": args.sparsity_warmup,
                        # what else changes a number (the methods' WideConfig, stage 2, offsets): seeds of
                        # one comparison must agree on it (bench/seeds_summary.py checks)
                        **wide_overrides(args), "axis": getattr(args, "axis", "flops"), "lora_r": args.lora_r,
                        "offsets": args.offsets,
                        "data": args.data,
                        "eval_data": runs.eval_source(args), "decontaminate": args.decontaminate,
                        **({"heads": dict(zip(("thresholds", "core_target", "target", "loss", "routing", "choice"),
                                              heads_settings(args, "heads")["heads"]))}
                           if any(METHOD_ROWS[m][0] == "heads" for m in getattr(args, "methods", ())) else {})},
           **(extra or {}), "records": records}
    json_file, md_file = runs.results_files(out)  # the stem taken literally: run.v1 -> run.v1.json
    json_file.write_text(json.dumps(doc, indent=2))
    tasks = list(args.tasks)
    axis = getattr(args, "axis", "flops")
    lines = [f"# {out.stem}", "", f"Command: `{command}`", "",
             f"Date: {doc['date']}; torch {doc['torch']}; device {device}", "",
             table(records, tasks, axis), "",
             f"Sparsity is realised on the held-out text ({AXIS_VIEW[axis][3]}; group: the paper's unweighted "
             "mean of the routed module rates). Task columns are "
             "acc_norm where lm-eval reports it, else acc. 'vs depth' is the relative change against token-level "
             "dynamic depth pruning (calibration only) at the same target.", ""]
    if args.limit:
        lines.append(f"Zero-shot scores use the first {args.limit} validation documents of each task.")
    for r in records:
        mc = r.get("merge_check")
        if mc:
            lines.append(f"- {r.get('label')} at {r['target']:.0%}: merged vs unmerged adapters, logits rel err "
                         f"{mc['logits_rel_err']:.2e} (stage 2 moved the logits by {mc['stage2_change_rel']:.2e}), "
                         f"greedy-token agreement {mc['argmax_agreement']:.4f} over {mc['tokens']} held-out tokens")
    md_file.write_text("\n".join(lines) + "\n")
    try:
        plot(records, out.parent / f"{out.name}.png", axis)
    except Exception as e:  # a missing plot must not lose the table of a long run
        print(f"warning: plot failed: {e}", file=sys.stderr)


def add_arguments(p) -> None:
    """Every option of ``wide compare``, on parser ``p``."""
    add_fields(p, runs.ModelArgs)
    add_fields(p, runs.DataArgs)
    # One --batch-size serves training and evaluation: the training one, with its default.
    add_fields(p, runs.EvalArgs, skip=("batch_size",))
    add_fields(p.add_argument_group("comparison"), CompareArgs, only=("methods", "targets", "runs", "out", "quiet"))
    t = p.add_argument_group("shared training budget")
    # Every method trains at every target, so stage 1 is shorter than `wide calibrate`'s and
    # checkpoints more often.
    add_fields(t, TrainArgs, only=("steps", "batch_size", "grad_accum", "lr", "save_every", "seed", "loss",
                                   "kd_temperature", "mix_weight", "amp", "sparsity_warmup"),
               defaults={"steps": 240, "save_every": 20})
    add_fields(t, CompareArgs, only=("recovery_steps", "recovery_lr"))
    add_fields(t, runs.RunArgs, skip=("stop_at",))
    add_fields(p.add_argument_group("routers (shared by WIDE, dynamic depth and module skipping)"), WideConfig,
               only=("router_rank", "router_input", "router_init", "ffn_group_size", "budget", "sparsity_coef",
                     "tau_start", "tau_end"))
    f = p.add_argument_group("per-element sparsity (TEAL, WINA, hybrid) and the sparsity axis")
    add_fields(f, CompareArgs, only=("axis", "fine_calib_sequences"))
    add_fields(f, FineConfig, only=("criterion", "per_channel", "tau_start", "tau_end", "lr_scale", "greedy_step",
                                    "greedy_last_fraction"))
    add_fields(p.add_argument_group(
        "head routers beside frozen thresholds (heads, heads_lora: issue 48's design (a), wide calibrate --thresholds; "
        f"routing {HEADS_ROUTING['attn_rule']} {HEADS_ROUTING['attn_skip']}, layer 0 dense, --oracle-ce "
        f"{HEADS_CHOICE['oracle_ce']:g}, --input-choice)"), CompareArgs,
        only=("heads_thresholds", "heads_core_target", "heads_target", "heads_loss"))
    s = p.add_argument_group("static width pruning and LoRA")
    add_fields(s, CompareArgs, only=("static_calib_sequences", "static_normalize"))
    add_fields(s, LoraArgs)
    add_fields(s, CompareArgs, only=("freeze_routers",))


def run(args) -> list:
    if args.recovery_steps is None:
        args.recovery_steps = args.steps
    for t in args.targets:
        if not 0.0 < t < 1.0:
            raise ValueError(f"targets must lie in (0, 1), got {t}")
    records = Comparison(args).run()
    print(table(records, list(args.tasks), args.axis))
    print(f"wrote {runs.results_files(args.out)[1]}, .json and .png")
    return records


__all__ = ["METHOD_ROWS", "DEFAULT_METHODS", "CompareArgs", "Comparison", "table", "plot", "write_outputs", "add_arguments", "run"]
