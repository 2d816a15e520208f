"""lm-evaluation-harness on routed models (wide.harness, the extra wide[harness]), offline: three
local tasks (tests/fixtures/harness: multiple choice, rolling loglikelihood, greedy generation)
on the tiny Llama of tests/conftest.py with its word-level tokenizer. Routers that keep every
group must score exactly as the dense model does, and routers that skip groups must not."""

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import wide
from conftest import write_tiny_run
from wide import data
from wide.cli import main

if os.environ.get("CI"):
    import lm_eval  # CI installs wide[harness] (scripts/setup.sh): there a missing lm-eval fails, never skips
else:
    lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval: pip install 'wide[harness]'")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "harness"
TASKS = ["wide_tiny_mc", "wide_tiny_ppl", "wide_tiny_gen"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Everything here is local; a task, tokenizer or model that asked a hub would fail at once."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model directory and three router sets on it, each as ``wide calibrate`` leaves
    one (RUN/routers): ``kept`` (every group runs), ``half`` (offsets at 50 % sparsity) and
    ``hybrid`` (``half`` plus per-element thresholds)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("harness")
    opts = write_tiny_run(root)
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    wide.wrap(model, wide.WideConfig(router_init="random", ffn_group_size=32), seed=0)
    calib = torch.randint(2, 27, (2, 24), generator=torch.Generator().manual_seed(1))  # the tokenizer's words
    wide.calibrate_offsets(model, [calib], target=0.5)
    wide.save_routers(model, root / "half" / "routers")
    offsets = [(r.attn.offset.clone(), r.ffn.offset.clone()) for r in model.wide_routers]
    for r in model.wide_routers:
        r.attn.offset.fill_(1e9)
        r.ffn.offset.fill_(1e9)
    wide.save_routers(model, root / "kept" / "routers")
    for r, (a, f) in zip(model.wide_routers, offsets):
        r.attn.offset.copy_(a)
        r.ffn.offset.copy_(f)
    wide.fine.attach(model, wide.FineConfig(target=0.4))
    wide.fine.calibrate(model, [calib], progress=False)
    wide.save_routers(model, root / "hybrid" / "routers")
    return root, {name: str(root / name / "routers") for name in ("kept", "half", "hybrid")}, opts


@pytest.fixture
def fixtures_only(monkeypatch):
    """lm-eval's own ~15,000 task files take ~9 s to index, and these tests need only the
    fixtures: wide's task index leaves lm-eval's out."""
    from wide import harness

    full = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda include=None, defaults=True: full(include, False))


_RUNS = {}


def _run(model_args: dict, tasks=TASKS):
    """lm_eval.simple_evaluate of the registered model "wide" on the fixtures, in batches of 3
    (right-padded loglikelihood batches, left-padded generation), once per arguments."""
    import wide.harness  # noqa: F401  (registers the model name "wide")

    key = (json.dumps(model_args, sort_keys=True), tuple(tasks))
    if key not in _RUNS:
        _RUNS[key] = lm_eval.simple_evaluate(model="wide", model_args=model_args, tasks=list(tasks), batch_size=3,
                                             task_manager=wide.harness.task_manager(str(FIXTURES), defaults=False),
                                             log_samples=True)
    return _RUNS[key]


def _responses(out) -> dict:
    """task -> each document's raw responses (loglikelihoods, rolling sums, generated text)."""
    return {t: [(s["doc_id"], s["resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for t, samples in out["samples"].items()}


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, (list, tuple)) else [x]


def _close(a: dict, b: dict, rel=1e-5) -> bool:
    """The same responses, loglikelihoods within ``rel`` (texts and greedy flags exactly)."""
    fa, fb = _flat(list(a.values())), _flat(list(b.values()))
    return len(fa) == len(fb) and all(x == pytest.approx(y, rel=rel) if isinstance(x, float) else x == y
                                      for x, y in zip(fa, fb))


def test_kept_routers_score_as_dense_and_routers_that_skip_do_not(tiny):
    root, routers, _ = tiny
    model = {"pretrained": str(root / "model"), "device": "cpu"}
    dense = _run(model)
    kept = _run({**model, "routers": routers["kept"]})
    half = _run({**model, "routers": routers["half"]})
    assert _responses(kept) == _responses(dense)  # bit for bit: every loglikelihood and every generated text
    assert kept["results"] == dense["results"]
    assert _responses(half)["wide_tiny_mc"] != _responses(dense)["wide_tiny_mc"]
    ppl = "word_perplexity,none"
    assert half["results"]["wide_tiny_ppl"][ppl] != pytest.approx(dense["results"]["wide_tiny_ppl"][ppl], rel=1e-3)
    assert dense["results"]["wide_tiny_mc"]["acc,none"] in {i / 6 for i in range(7)}  # six documents scored
    cfg = half["config"]
    assert (cfg["wide_routers"], cfg["wide_mode"], cfg["wide_engine"]) == (routers["half"], "hf", None)
    # lm_eval's command line hands the model its arguments as one string
    from lm_eval.api.registry import get_model

    lm = get_model("wide").create_from_arg_string(f"pretrained={root / 'model'},routers={routers['half']},mode=coarse",
                                                  {"device": "cpu", "batch_size": 2})
    assert (lm.routers, lm.mode, lm.batch_size, lm.engine.mode_name) == (routers["half"], "coarse", 2, "coarse")


def test_engine_modes(tiny, caplog):
    """Mode coarse runs loglikelihoods as one engine prefill (right-padded batches) and
    generate_until on the engine's decode: the same scores and texts as the hooks; fine and
    hybrid apply their thresholds at decode only, as the engine does."""
    root, routers, _ = tiny
    args = {"pretrained": str(root / "model"), "device": "cpu"}
    hf = _run({**args, "routers": routers["half"]})
    with caplog.at_level(logging.WARNING, logger="wide.harness"):
        coarse = _run({**args, "routers": routers["half"], "mode": "coarse"})
    assert "the Triton kernels need a CUDA GPU" in caplog.text and "PyTorch path" in caplog.text
    assert coarse["config"]["wide_engine"] == {"mode": "coarse", "backend": "torch"}
    assert _close(_responses(coarse), _responses(hf))
    assert _responses(coarse)["wide_tiny_gen"] == _responses(hf)["wide_tiny_gen"]
    dense = _run({**args, "mode": "dense", "routers": routers["half"]})  # the routers are not run
    assert _close(_responses(dense), _responses(_run(args)))

    ll = ["wide_tiny_mc", "wide_tiny_ppl"]
    fine = _responses(_run({**args, "routers": routers["hybrid"], "mode": "fine"}, tasks=ll))
    hybrid = _responses(_run({**args, "routers": routers["hybrid"], "mode": "hybrid"}, tasks=ll))
    hooks = _responses(_run({**args, "routers": routers["hybrid"]}, tasks=ll))
    assert _close(fine, {t: _responses(dense)[t] for t in ll})  # fine's prefill is dense
    assert _close(hybrid, {t: _responses(coarse)[t] for t in ll})  # hybrid's prefill: the routers alone
    assert not _close(hooks, hybrid)  # the hooks threshold every token

    from wide.harness import WideLM

    with pytest.raises(ValueError, match="no per-element thresholds"):
        WideLM(pretrained=str(root / "model"), routers=routers["half"], mode="fine", device="cpu")
    with pytest.raises(ValueError, match="mode must be one of"):
        WideLM(pretrained=str(root / "model"), mode="fast", device="cpu")
    with pytest.raises(ValueError, match="does not take peft"):
        WideLM(pretrained=str(root / "model"), peft="adapter", device="cpu")


def test_wide_eval_harness_writes_every_record_and_the_table(tiny, fixtures_only, tmp_path, monkeypatch, capsys):
    root, routers, opts = tiny
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    out = tmp_path / "res"
    assert main(["eval", *opts, "--routers", routers["kept"], routers["half"], "--dense", "--tasks",
                 "--max-eval-sequences", "2", "--harness", "wide_tiny_mc,wide_tiny_ppl", "wide_tiny_gen",
                 "--harness-include", str(FIXTURES), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    dense, kept, half = json.loads(out.with_suffix(".json").read_text())["records"]
    assert dense["harness"]["tasks"] == TASKS and dense["harness"]["mode"] == "hf"
    assert dense["harness"]["lm_eval"] == lm_eval.__version__
    assert kept["harness"]["results"] == dense["harness"]["results"]
    ppl = "word_perplexity,none"
    assert half["harness"]["results"]["wide_tiny_ppl"][ppl] != dense["harness"]["results"]["wide_tiny_ppl"][ppl]
    md = out.with_suffix(".md").read_text()
    for text in (md, printed):
        assert "lm-evaluation-harness" in text and "| wide_tiny_ppl | word_perplexity |" in text
        assert "| task | metric | dense | wide (kept) | wide (half) |" in text


def test_harness_errors_are_one_line_before_anything_loads(tiny, fixtures_only, tmp_path, monkeypatch, capsys):
    root, routers, opts = tiny
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")

    def error(*argv):
        assert main(list(argv)) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1
        return lines[0]

    base = ["eval", *opts, "--tasks"]
    assert "does not exist" in error(*base, "--harness", "x", "--harness-include", str(tmp_path / "none"))
    msg = error(*base, "--harness", "wide_tiny_mcq", "--harness-include", str(FIXTURES))
    assert "no task, group or tag named 'wide_tiny_mcq'" in msg and "nearest: wide_tiny_mc" in msg
    assert "has none" in error(*base, "--routers", routers["half"], "--harness", "wide_tiny_mc",
                               "--harness-mode", "fine")
    # lm-eval not installed: the command says how to install it, for --harness and for `wide lm-eval`
    monkeypatch.delitem(sys.modules, "wide.harness", raising=False)
    monkeypatch.delattr(wide, "harness", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", None)
    assert "pip install 'wide[harness]'" in error(*base, "--harness", "wide_tiny_mc")
    assert "pip install 'wide[harness]'" in error("lm-eval", "--model", "wide")


def test_wide_lm_eval_is_lm_evals_command_line_with_the_model_registered(tiny, tmp_path, monkeypatch):
    import lm_eval.tasks

    root, routers, _ = tiny
    # the command builds its own TaskManager: index the fixtures only (see fixtures_only)
    full = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, metadata=None:
                        full(include_path=include_path, metadata=metadata, include_defaults=False))
    out = tmp_path / "lm_eval_out"
    assert main(["lm-eval", "run", "--model", "wide", "--model_args",
                 f"pretrained={root / 'model'},routers={routers['half']},mode=coarse",  # its --device: cuda:0
                 "--tasks", "wide_tiny_mc", "--include_path", str(FIXTURES), "--output_path", str(out)]) == 0
    written = json.loads(next(out.rglob("results_*.json")).read_text())
    assert written["config"]["wide_mode"] == "coarse" and "acc,none" in written["results"]["wide_tiny_mc"]

