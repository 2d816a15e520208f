"""Command-line plumbing that the unit tests of the library do not reach: options generated from
the settings dataclasses (wide.base.cliargs), and the commands end to end on a tiny local model."""

import argparse
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import write_tiny_run

from wide.base import cliargs
from wide import data
from wide.commands import runs
from wide.cli import build_parser, main
from wide.commands.compare import CompareArgs
from wide.method.config import WideConfig
from wide.commands.estimate import DryRunArgs
from wide.method.head_choice import HeadArgs
from wide.training.recovery import RECOVERY_DEFAULTS, RECOVERY_LR, LoraArgs
from wide.commands.sampling_data import SampleArgs
from wide.training.train import TrainArgs


# ------------------------------------------------------------------ options from dataclasses

# Commands that carry every option of these dataclasses, and the arguments they require.
FULL = {
    "calibrate": (["--out", "x"], (runs.ModelArgs, runs.DataArgs, WideConfig, TrainArgs, runs.RunArgs, DryRunArgs,
                                   HeadArgs)),
    "recover": (["--routers", "r", "--out", "x"], (runs.ModelArgs, runs.DataArgs, LoraArgs, TrainArgs, runs.RunArgs)),
    "eval": ([], (runs.ModelArgs, runs.DataArgs, runs.EvalArgs)),
    "generate": (["--prompt", "p"], (runs.ModelArgs,)),
}
# Commands that take some options of these dataclasses.
PARTIAL = {
    "compare": (runs.ModelArgs, runs.DataArgs, runs.EvalArgs, CompareArgs, TrainArgs, runs.RunArgs, WideConfig,
                LoraArgs),
    "sample-data": (runs.ModelArgs, SampleArgs, runs.DataArgs),
}
# Where a command's default differs from its dataclass's: the values users see, pinned here.
OVERRIDES = {("recover", "lr"): RECOVERY_LR, ("recover", "sparsity_warmup"): 0.0, ("compare", "steps"): 240,
             ("compare", "save_every"): 20}


def _subparsers() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_generated_flags_carry_the_dataclass_default_and_help():
    subs = _subparsers()
    used = set()
    for cmd, classes in {**{c: v[1] for c, v in FULL.items()}, **PARTIAL}.items():
        flags = set()
        for a in subs[cmd]._actions:
            candidates = [f for cls in classes for f in cliargs.options(cls) if cliargs.flag(f) in a.option_strings]
            if not candidates:
                continue
            # --batch-size is both TrainArgs' and EvalArgs': the help says which one this is.
            source = [f for f in candidates if f.metadata["help"] and a.help.startswith(f.metadata["help"])]
            assert len(source) == 1, (cmd, a.option_strings, a.help)
            f = source[0]
            flags.add(cliargs.flag(f))
            if (cmd, f.name) in OVERRIDES:
                used.add((cmd, f.name))
            assert a.dest == cliargs.dest(f)
            assert a.default == OVERRIDES.get((cmd, f.name), cliargs.default(f)), (cmd, f.name, a.default)
        if cmd in FULL:
            assert flags == {cliargs.flag(f) for cls in classes for f in cliargs.options(cls)}, cmd
    assert used == set(OVERRIDES)


@pytest.mark.parametrize("cmd", sorted(FULL))
def test_no_flags_build_the_default_dataclasses(cmd):
    required, classes = FULL[cmd]
    ns = build_parser().parse_args([cmd, *required])
    for cls in classes:
        expected = cls(**RECOVERY_DEFAULTS) if (cmd, cls) == ("recover", TrainArgs) else cls()
        assert cliargs.from_args(cls, ns) == expected, (cmd, cls.__name__)


def test_flags_reach_the_dataclasses():
    ns = build_parser().parse_args(["calibrate", "--out", "x", "--target", "0.3", "--attn-group-size", "2",
                                    "--loss-mode", "groups", "--lr", "1e-3", "--steps", "7"])
    assert cliargs.from_args(WideConfig, ns) == WideConfig(target_sparsity=0.3, attn_group_size=2, loss_mode="groups")
    assert cliargs.from_args(TrainArgs, ns) == TrainArgs(lr=1e-3, steps=7)
    ns = build_parser().parse_args(["recover", "--routers", "r", "--out", "x", "--lora-r", "4",
                                    "--lora-dropout", "0"])
    assert cliargs.from_args(LoraArgs, ns) == LoraArgs(r=4, dropout=0.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--out", "x", "--router-input", "sideways"])


def _flat(text: str) -> str:
    return re.sub(r"\s+", "", text)  # argparse wraps help lines, at hyphens too


def test_calibrate_help_lists_every_wideconfig_option(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = _flat(capsys.readouterr().out)
    for f in cliargs.options(WideConfig):
        assert cliargs.flag(f) in out
        assert _flat(f.metadata["help"]) in out
    assert "(default:0.5)" in out and "{attention,ffn,all,none}" in out
    # The two fields that are not options: the baselines' switch and free-form metadata.
    names = {f.name for f in dataclasses.fields(WideConfig)} - {f.name for f in cliargs.options(WideConfig)}
    assert names == {"tie_modules", "extra"}


@dataclass
class Planted:
    rate: float = field(default=0.5, metadata={"flag": "--r8", "help": "a rate"})
    size: Optional[int] = field(default=None, metadata={"help": "a size"})
    mode: str = field(default="a", metadata={"choices": ("a", "b"), "help": "a mode"})
    names: list = field(default_factory=lambda: ["x"], metadata={"nargs": "*", "help": "names"})
    on: bool = field(default=False, metadata={"help": "a switch"})
    hidden: int = 3


def _planted_parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cliargs.add_fields(p, Planted, **kw)
    return p


def test_cliargs_round_trip():
    p = _planted_parser()
    assert cliargs.from_args(Planted, p.parse_args([])) == Planted()
    ns = p.parse_args(["--r8", "0.25", "--size", "4", "--mode", "b", "--names", "p", "q", "--on"])
    assert ns.r8 == 0.25 and ns.size == 4  # dest follows the flag
    assert cliargs.from_args(Planted, ns) == Planted(rate=0.25, size=4, mode="b", names=["p", "q"], on=True)
    assert cliargs.from_args(Planted, ns, size=9, hidden=1) == Planted(0.25, 9, "b", ["p", "q"], True, 1)
    for bad in (["--mode", "c"], ["--hidden", "1"], ["--rate", "1"], ["--size", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    text = p.format_help()
    assert "a rate (default: 0.5)" in text and "a size\n" in text and "a switch\n" in text


def test_cliargs_selection_and_overrides():
    p = _planted_parser(only=("rate", "size", "on"), skip=("size",), defaults={"rate": 0.1})
    assert {a.dest for a in p._actions} == {"help", "r8", "on"}
    assert cliargs.from_args(Planted, p.parse_args([])) == Planted(rate=0.1)  # the others keep their defaults
    assert "(default: 0.1)" in p.format_help()
    with pytest.raises(ValueError, match="hidden"):
        _planted_parser(only=("hidden",))
    with pytest.raises(ValueError, match="nope"):
        _planted_parser(defaults={"nope": 1})


# ------------------------------------------------------------------ the commands end to end

@pytest.fixture
def tiny_run(tmp_path, monkeypatch):
    """A tiny Llama directory with a word-level tokenizer, and 24 short JSONL documents."""
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")  # the token cache
    return tmp_path, write_tiny_run(tmp_path)


def test_calibrate_eval_recover_compare_end_to_end(tiny_run):
    tmp, common = tiny_run
    train = ["--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "1"]
    assert main(["calibrate", *common, *train, "--target", "0.4", "--ffn-group-size", "32",
                 "--out", str(tmp / "s1")]) == 0
    run = json.loads((tmp / "s1" / "run.json").read_text())
    assert run["wide_config"] == WideConfig(target_sparsity=0.4, ffn_group_size=32).to_dict()
    assert run["train_args"] == dataclasses.asdict(TrainArgs(steps=2, batch_size=2, eval_every=0))
    assert run["command"].startswith("wide ") and "torch" in run["machine"]

    assert main(["eval", *common, "--routers", str(tmp / "s1" / "routers"), "--dense", "--tasks",
                 "--out", str(tmp / "res")]) == 0
    doc = json.loads((tmp / "res.json").read_text())
    dense, routed = doc["records"]
    assert (dense["method"], dense["stage"], routed["method"], routed["stage"]) == ("dense", 0, "wide", 1)
    assert (dense["loss"], dense["tokens"], dense["seed"]) == (None, 0, None)
    assert (routed["loss"], routed["tokens"], routed["seed"]) == ("ce", 2 * 2 * 16, 0)
    assert (dense["routing"], routed["routing"]) == (None, "token")  # issue 20's field, beside e2e's
    # the tiny model: 4 heads in 2 GQA packs, intermediate 96 cut into groups of 32
    assert "groups" not in dense and routed["groups"] == {"attn": 2, "attn_group_size": 2, "ffn": 3, "ffn_group_size": 32}
    assert run["decontamination"]["mode"] == "heldout" and run["data"]["decontaminate"] == "heldout"
    assert dense["model"] == routed["model"] == "model" and routed["training"]["steps"] == 2
    assert dense["sparsity"] == 0.0 < routed["sparsity"] and routed["ppl"] > 0 and "avg" not in routed
    assert (tmp / "res.md").is_file()

    assert main(["recover", *common, *train, "--routers", str(tmp / "s1" / "routers"), "--lora-r", "4",
                 "--out", str(tmp / "s2")]) == 0
    run2 = json.loads((tmp / "s2" / "run.json").read_text())
    assert run2["train_args"]["lr"] == RECOVERY_LR
    assert run2["train_args"]["sparsity_warmup"] == 0.0  # trained routers: the full target from step 1
    assert run2["lora"] == dataclasses.asdict(LoraArgs(r=4))
    assert (tmp / "s2" / "recovered" / "adapter_model.safetensors").is_file()
    assert main(["eval", *common, "--routers", str(tmp / "s2" / "recovered"), "--tasks", "--out", str(tmp / "r2")]) == 0
    rec2 = json.loads((tmp / "r2.json").read_text())["records"][0]
    assert (rec2["stage"], rec2["loss"], rec2["tokens"], rec2["seed"]) == (2, "ce", 2 * 64, 0)
    assert rec2["stage1"] == {"loss": "ce", "tokens": 64, "seed": 0}

    assert main(["compare", *common, "--methods", "dense", "wide", "--targets", "0.5", "--steps", "2",
                 "--batch-size", "2", "--tasks", "--offset-batches", "1", "--ffn-group-size", "32", "--quiet",
                 "--runs", str(tmp / "cmp"), "--out", str(tmp / "cmp_out")]) == 0
    cmp = json.loads((tmp / "cmp_out.json").read_text())
    assert [r["name"] for r in cmp["records"]] == ["dense", "wide"]
    assert [(r["loss"], r["tokens"], r["seed"]) for r in cmp["records"]] == [(None, 0, None), ("ce", 64, 0)]
    assert cmp["records"][1]["groups"]["ffn_group_size"] == 32
    assert cmp["decontamination"]["mode"] == "heldout"
    assert cmp["settings"]["lr"] == TrainArgs().lr and cmp["settings"]["recovery_lr"] == RECOVERY_LR
    assert cmp["settings"]["ffn_group_size"] == 32 and cmp["settings"]["lora_r"] == LoraArgs().r  # seeds compare them
    meta = json.loads((tmp / "cmp" / "wide-50" / "stage1" / "final" / "wide_config.json").read_text())
    assert meta["compare_settings"]["train"] == dataclasses.asdict(
        TrainArgs(steps=2, batch_size=2, eval_every=0, save_every=20))



def test_missing_model_directory_is_a_user_error(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nothing"), "--tasks"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_fsdp_on_one_process_and_its_resume(tiny_run, capsys):
    from wide.training import distributed

    tmp, common = tiny_run
    argv = ["calibrate", *common, "--steps", "3", "--batch-size", "2", "--eval-every", "0", "--offsets", "none",
            "--ffn-group-size", "32", "--out", str(tmp / "f")]
    try:
        assert main([*argv, "--fsdp", "--stop-at", "2"]) == 0  # no torchrun: a one-process group
        assert (tmp / "f" / "checkpoint" / distributed.DCP_DIR).is_dir()
        assert main([*argv, "--resume"]) == 2
        assert "written by a distributed run" in capsys.readouterr().err
        assert main([*argv, "--fsdp", "--resume"]) == 0
    finally:
        distributed.shutdown()
    assert json.loads((tmp / "f" / "run.json").read_text())["world_size"] == 1
    assert [h["step"] for h in json.loads((tmp / "f" / "history.json").read_text())] == [1, 2, 3]


TRAIN = ["--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "1", "--ffn-group-size", "32"]


def _saved_routers(run):
    from safetensors.torch import load_file

    return load_file(str(run / "routers" / "routers.safetensors"))


def test_same_command_twice_gives_the_same_routers(tiny_run):
    tmp, common = tiny_run
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        assert main(["calibrate", *common, *TRAIN, "--seed", seed, "--out", str(tmp / name)]) == 0
    a, b, c = (_saved_routers(tmp / n) for n in "abc")
    # The first run moved torch's global RNG: only --seed can make the second start where it did.
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_overwrite_starts_the_run_over_and_resume_of_a_finished_run_changes_nothing(tiny_run, capsys):
    tmp, common = tiny_run
    argv = ["calibrate", *common, *TRAIN, "--out", str(tmp / "r")]
    assert main([*argv, "--stop-at", "1"]) == 0
    assert main([*argv, "--target", "0.3", "--overwrite"]) == 0
    assert "resumed" not in capsys.readouterr().out
    assert json.loads((tmp / "r" / "settings.json").read_text())["target"] == 0.3
    first = _saved_routers(tmp / "r")
    recorded = json.loads((tmp / "r" / "run.json").read_text())
    assert main([*argv, "--target", "0.3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "at step 2/2" in out
    # issue 41, defect 9: the resumed process trained nothing, so the wall time is the one recorded
    # when the run finished, not this process's (the demo said "0.0 min on this machine")
    run = json.loads((tmp / "r" / "run.json").read_text())
    assert (run["wall_s"], run["tokens_per_s"], run["date"]) == (recorded["wall_s"], recorded["tokens_per_s"],
                                                                 recorded["date"])
    assert run["recorded_earlier"] is True and "recorded_earlier" not in recorded
    assert f"({recorded['wall_s'] / 60:.1f} min, recorded when the run finished" in out
    again = _saved_routers(tmp / "r")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not [p.name for p in (tmp / "r").iterdir() if p.name.startswith(".")]


def test_a_resumed_run_records_the_time_of_every_invocation_and_its_first_command(tiny_run, monkeypatch, capsys):
    # issue 49, defect 4: after a kill and --resume, wall_s counted the last invocation only (0.3 s
    # against 96 s uninterrupted) and kept it on later resumes, and resuming a finished run
    # recorded the --resume line as the run's command
    import time

    from wide.training import train as train_module

    tmp, common = tiny_run
    argv = ["calibrate", *common, *TRAIN, "--steps", "4", "--out", str(tmp / "r")]
    step = train_module.micro_batch_loss

    def slow(*a, **k):
        time.sleep(0.4)
        return step(*a, **k)

    def run(*extra):
        monkeypatch.setattr("sys.argv", ["wide", *argv, *extra])
        assert main([*argv, *extra]) == 0

    monkeypatch.setattr(train_module, "micro_batch_loss", slow)
    run("--stop-at", "2")  # as a kill after step 2's checkpoint leaves the run
    monkeypatch.setattr(train_module, "micro_batch_loss", step)
    run("--resume")
    record = json.loads((tmp / "r" / "run.json").read_text())
    assert record["wall_s"] >= 0.8  # the two slow steps of the first invocation
    assert record["command"] == "wide " + " ".join([*argv, "--stop-at", "2"])
    assert record["resumed"] == ["wide " + " ".join([*argv, "--resume"])]
    rates = [h["tokens_per_s"] for h in json.loads((tmp / "r" / "history.json").read_text())]
    assert len(rates) == 4 and record["tokens_per_s"] == pytest.approx(sum(rates) / 4)  # every step's, both runs
    capsys.readouterr()
    run("--resume")  # a finished run: nothing trains, and nothing recorded changes but the list of resumes
    again = json.loads((tmp / "r" / "run.json").read_text())
    assert (again["wall_s"], again["tokens_per_s"], again["command"]) == (
        record["wall_s"], record["tokens_per_s"], record["command"])
    assert again["resumed"] == record["resumed"] * 2
    assert f"({record['wall_s'] / 60:.1f} min, recorded when the run finished" in capsys.readouterr().out


def test_seal_vouches_for_a_router_directory_without_its_manifest(tiny_run, capsys):
    # issue 49, defect 3: without its manifest a router directory is refused by every command,
    # until `wide seal` records its files as they are
    tmp, common = tiny_run
    assert main(["calibrate", *common, *TRAIN, "--out", str(tmp / "r")]) == 0
    routers = tmp / "r" / "routers"
    (routers / "wide_manifest.json").unlink()
    evaluate = ["eval", *common, "--routers", str(routers), "--tasks", "--max-eval-sequences", "2"]
    capsys.readouterr()
    assert main(evaluate) == 2
    out, err = capsys.readouterr()
    assert f"error: --routers: {routers} has no wide_manifest.json" in err and f"wide seal {routers}" in err
    assert "loaded " not in out
    assert main(["seal", str(routers)]) == 0
    assert f"sealed {routers}" in capsys.readouterr().out
    assert main(evaluate) == 0
    assert main(["seal", str(routers)]) == 2
    assert "has a wide_manifest.json already (its files match it)" in capsys.readouterr().err


def test_generate_truncates_a_long_prompt_on_request_and_shows_its_start_only(tiny_run, capsys):
    _, common = tiny_run
    prompt = " ".join(["the cat sat on a mat"] * 30)  # 180 tokens; the model has 128 positions
    assert main(["generate", *common[:2], "--prompt", prompt, "--max-new-tokens", "8", "--backend", "torch",
                 "--truncate-prompt"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "prompt" in line] == [
        "warning: prompt 1 truncated to its last 120 of 180 tokens (--truncate-prompt)"]
    shown = next(line for line in out.splitlines() if line.startswith("--- "))
    assert shown.endswith("...'") and len(shown) <= 90 and prompt not in out


def test_generate_batch_shared_needs_routers_and_runs_with_them(tiny_run, capsys):
    tmp, common = tiny_run
    assert main(["generate", *common[:2], "--prompt", "the cat", "--batch-shared"]) == 2
    assert "--batch-shared routes the decode batch: give --routers" in capsys.readouterr().err
    assert main(["calibrate", *common, *TRAIN, "--out", str(tmp / "r")]) == 0
    assert main(["generate", *common[:2], "--routers", str(tmp / "r" / "routers"), "--prompt", "the cat sat",
                 "--prompt", "a mat", "--max-new-tokens", "4", "--backend", "torch", "--batch-shared"]) == 0
    out = capsys.readouterr().out
    # --mode auto, the default: a set of routers alone runs coarse
    assert out.count("--- ") == 2 and "[auto -> coarse, batch_shared, backend torch]" in out


def test_eval_prints_the_decode_mode_perplexity_it_computes(tiny_run, capsys):
    # issue 41, defect 8: --decode-batches computed decode-mode perplexity and printed nothing of it
    import wide
    from transformers import AutoModelForCausalLM

    tmp, common = tiny_run
    model = AutoModelForCausalLM.from_pretrained(common[1], dtype=torch.float32)
    wide.save_routers(wide.wrap(model, WideConfig(ffn_group_size=32, router_init="random"), seed=0), tmp / "r")
    capsys.readouterr()
    assert main(["eval", *common, "--routers", str(tmp / "r"), "--dense", "--tasks", "--max-eval-sequences", "4",
                 "--decode-batches", "2", "--decode-windows", "4"]) == 0
    table = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ")]
    head, dense, routed = (dict(zip(table[0], row)) for row in table)
    assert "decode ppl" in head and "decode ppl, shared B=2" in head, table[0]
    assert float(dense["decode ppl"]) > 1 and dense["decode ppl, shared B=2"] == "-"  # nothing to share
    assert float(routed["decode ppl"]) > 1 and float(routed["decode ppl, shared B=2"]) > 1


def test_eval_prints_its_time_estimate_before_it_evaluates(tiny_run, capsys, monkeypatch):
    # issue 49, defect 6: `wide eval --limit 50 --generation 16` on a CPU takes over 20 min and
    # said nothing of it before it started
    import wide
    from transformers import AutoModelForCausalLM

    tmp, common = tiny_run
    model = AutoModelForCausalLM.from_pretrained(common[1], dtype=torch.float32)
    wide.save_routers(wide.wrap(model, WideConfig(ffn_group_size=32, router_init="random"), seed=0), tmp / "r")
    before_first = []
    evaluate_one = runs.evaluate_one

    def first(*a, **k):
        before_first.append(capsys.readouterr().out)
        return evaluate_one(*a, **k)

    monkeypatch.setattr(runs, "evaluate_one", first)
    capsys.readouterr()
    assert main(["eval", *common, "--routers", str(tmp / "r"), "--dense", "--tasks", "--max-eval-sequences", "4",
                 "--batch-size", "2", "--generation", "2", "--generation-prompt", "4", "--generation-tokens", "4"]) == 0
    line = next((x for x in before_first[0].splitlines() if x.startswith("estimate: ")), None)
    assert line is not None, before_first[0]
    assert re.fullmatch(r"estimate: about \d+ s for 2 models on cpu \(perplexity \d+ s, generation \d+ s; timed on the "
                        r"dense model and the routed set\); --limit, --max-eval-sequences, --tasks and --generation set "
                        r"how much is evaluated", line), line
    # what it counts: 4 windows of 16 tokens; 2 prompts of 4 tokens continued for 4 (the dense
    # reference's text too for the routed model), and both models reading the 8 tokens for the KL
    heldout = torch.zeros(4, 16, dtype=torch.long)
    args = build_parser().parse_args(["eval", "--tasks", "--batch-size", "2", "--generation", "2",
                                      "--generation-prompt", "4", "--generation-tokens", "4"])
    assert runs.eval_work(args, None, heldout, routed=False) == {"perplexity": (64, 0), "generation": (8 + 32, 3)}
    assert runs.eval_work(args, None, heldout, routed=True) == {"perplexity": (64, 0), "generation": (16 + 32, 6)}
    work = [runs.eval_work(args, None, heldout, routed=r) for r in (False, True)]
    assert runs.describe_estimate(work, (0.5, 10.0), "cpu").startswith(
        "estimate: about 3 min for 2 models on cpu (perplexity 64 s, generation 2 min;")  # 2 x 32 s; 50 + 84 s
    # one speed per model: the routed model's own (here 4x dense's per token, 2x per decode step)
    assert runs.describe_estimate(work, [(0.5, 10.0), (2.0, 20.0)], "cpu", timed_on="the dense model and the routed "
                                  "set").startswith("estimate: about 7 min for 2 models on cpu (perplexity 3 min, "
                                                    "generation 4 min; timed on the dense model and the routed set)")
    # 32 + 128 s; 50 + 216 s
    with pytest.raises(ValueError, match="2 models to estimate but 1 speeds"):
        runs.describe_estimate(work, [(0.5, 10.0)], "cpu")


class _Stop(Exception):
    pass


def test_eval_estimate_times_each_routed_set_on_its_own_model(tiny_run, capsys, monkeypatch):
    # a set of head routers + per-element thresholds ran the seven tasks ~3x slower than the dense
    # model its estimate was timed on (an H100: estimated 74 s for dense + fine-50, took 225 s):
    # a routed model whose forward is slower must raise the estimate, and each set is loaded once
    # for it, the first one kept for its evaluation
    import wide
    from transformers import AutoModelForCausalLM
    from wide.training import recovery

    tmp, common = tiny_run
    for name, seed in (("r", 0), ("r2", 1)):
        model = AutoModelForCausalLM.from_pretrained(common[1], dtype=torch.float32)
        wide.save_routers(wide.wrap(model, WideConfig(ffn_group_size=32, router_init="random"), seed=seed), tmp / name)
    loads, slow = [], []
    load = recovery.load_recovered

    def loaded(base, path, **k):  # every routed model, made slower by 0.5 s a forward while ``slow`` is set
        loads.append(Path(path).name)
        model = load(base, path, **k)
        model.register_forward_pre_hook(lambda *_: time.sleep(0.5) if slow else None)
        return model

    monkeypatch.setattr(recovery, "load_recovered", loaded)
    evaluated = []

    def stop(model, *a, **k):  # the estimate is what is under test: nothing is evaluated
        evaluated.append(model)
        raise _Stop

    monkeypatch.setattr(runs, "evaluate_one", stop)
    argv = ["eval", *common, "--tasks", "--max-eval-sequences", "8", "--batch-size", "2"]

    def estimate(*flags) -> tuple:
        capsys.readouterr()
        with pytest.raises(_Stop):
            main([*argv, *flags])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("estimate: "))
        return line, float(re.match(r"estimate: about (\d+) s", line)[1])

    _, fast = estimate("--routers", str(tmp / "r"))
    slow.append(1)
    line, slowed = estimate("--routers", str(tmp / "r"))
    # 8 windows of 16 tokens at 0.5 s a forward of 2 x 16: >= 2 s (0 s when timed on the dense model)
    assert fast < 1 <= 2 <= slowed and "; timed on the routed set)" in line, line
    assert loads == ["r", "r"] and hasattr(evaluated[-1], "wide_state")  # timed, then evaluated: one load
    slow.clear()
    loads.clear()
    line, _ = estimate("--dense", "--routers", str(tmp / "r"), str(tmp / "r2"), str(tmp / "r2"))
    assert "for 4 models on cpu" in line and "timed on the dense model and each of the 3 routed sets)" in line, line
    assert loads == ["r2", "r"] and not hasattr(evaluated[-1], "wide_state")  # r2 once, the first set last


def test_compare_keeps_teal_greedy_paths_across_runs(tiny_run, monkeypatch):
    """A comparison cut by a device call's time limit resumes in a new process: TEAL's greedy
    search (minutes on a GPU) runs once per run directory, not once per process."""
    from wide.method import fine

    tmp, common = tiny_run
    calls = []
    search = fine.greedy_tables

    def counted(*a, **k):
        calls.append(a[3])
        return search(*a, **k)

    monkeypatch.setattr(fine, "greedy_tables", counted)
    argv = ["compare", *common, "--methods", "teal_greedy", "--batch-size", "2", "--tasks", "--quiet",
            "--fine-calib-sequences", "2", "--greedy-step", "0.5", "--runs", str(tmp / "g")]
    assert main([*argv, "--targets", "0.5", "--out", str(tmp / "g1")]) == 0
    stored = json.loads((tmp / "g" / "greedy_paths_magnitude.json").read_text())
    assert calls == [0.5] and stored["up_to"] == 0.5
    assert main([*argv, "--targets", "0.25", "--out", str(tmp / "g2")]) == 0  # a smaller target: the same walk
    assert calls == [0.5]
    first = json.loads((tmp / "g1.json").read_text())["records"][0]
    assert first["method"] == "teal_greedy" and first["linear_sparsity"] > 0
    assert main([*argv, "--targets", "0.6", "--out", str(tmp / "g3")]) == 0  # further than stored: searched again
    assert calls == [0.5, 0.6]
    assert json.loads((tmp / "g" / "greedy_paths_magnitude.json").read_text())["up_to"] == 0.6
