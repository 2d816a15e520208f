"""Every bad input ends the same way: exit code 2, one line on stderr naming the problem (the
flag, where there is one), no traceback, and no model loaded or data packed before it."""

import json
import shutil

import pytest
from conftest import write_tiny_run

from transformers import AutoModelForCausalLM

import wide
from wide import data
from wide.commands import runs
from wide.cli import build_parser, main

TRAIN = ["--steps", "2", "--batch-size", "2", "--eval-every", "0", "--offset-batches", "1", "--ffn-group-size", "32"]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """Paths the cases point at: a tiny model and data, a finished run, broken inputs."""
    root = tmp_path_factory.mktemp("cli_errors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "CACHE_DIR", root / "cache")
        common = write_tiny_run(root)
        assert main(["calibrate", *common, *TRAIN, "--out", str(root / "done")]) == 0
        shutil.copytree(root / "done", root / "no_checkpoint")
        shutil.rmtree(root / "no_checkpoint" / "checkpoint")
        (root / "afile").write_text("not a directory\n")
        (root / "empty_dir").mkdir()
        (root / "other.jsonl").write_text(json.dumps({"body": "the cat sat"}) + "\n")
        (root / "latin1.txt").write_bytes("the cat sat on the café mat".encode("latin-1"))
        (root / "latin1.jsonl").write_bytes(b'{"text": "the cat"}\n\n{"text": "a mat"}\n' +
                                            '{"text": "the café"}\n'.encode("latin-1"))
        (root / "garbage.bin").write_bytes(bytes(range(256)))
        (root / "gpt2").mkdir()
        (root / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        shutil.copytree(root / "model", root / "truncated")
        with open(root / "truncated" / "model.safetensors", "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        for name, text in (("empty_meta", "{}"), ("bad_json", "{not json")):
            shutil.copytree(root / "done" / "routers", root / name)
            (root / name / "wide_config.json").write_text(text)
        # per-element thresholds and no router, as the shipped fine sets hold them
        fine_only = AutoModelForCausalLM.from_pretrained(root / "model")
        wide.wrap(fine_only, wide.WideConfig(sparse_target="none", target_sparsity=0.5, loss_mode="linear"))
        wide.fine.attach(fine_only, wide.FineConfig(target=0.5))
        wide.save_routers(fine_only, root / "fine_only")
        # issue 49, defect 3: a copy whose manifest is gone, its weights then damaged in place
        shutil.copytree(root / "done" / "routers", root / "unsealed")
        (root / "unsealed" / "wide_manifest.json").unlink()
        with open(root / "unsealed" / "routers.safetensors", "r+b") as f:
            f.seek(-16, 2)
            f.write(bytes(16))
        w = type("W", (), {})()
        w.root, w.common = root, common
        w.calibrate = ["calibrate", *common, *TRAIN]
        w.model = common[:2]
        yield w


def _long_prompt() -> str:
    return " ".join(["the cat sat on a mat"] * 30)  # 180 tokens; the tiny model has 128 positions


# (id, argv from the fixture, what the line must say)
CASES = [
    ("batch-size-0", lambda w: [*w.calibrate, "--batch-size", "0", "--out", f"{w.root}/x"],
     "argument --batch-size: must be >= 1, got 0"),
    ("eval-batch-size-0", lambda w: ["eval", *w.model, "--batch-size", "0"], "--batch-size: must be >= 1"),
    ("steps-0", lambda w: [*w.calibrate, "--steps", "0", "--out", f"{w.root}/x"], "--steps: must be >= 1"),
    ("target-above-1", lambda w: [*w.calibrate, "--target", "1.5", "--out", f"{w.root}/x"],
     "--target: must lie in [0.0, 1.0), got 1.5"),
    # a router set that skips every group is not a model (issue 41, defect 4)
    ("target-1", lambda w: [*w.calibrate, "--target", "1", "--out", f"{w.root}/x"],
     "--target: must lie in [0.0, 1.0), got 1"),
    ("attn-target-1", lambda w: [*w.calibrate, "--attn-target", "1", "--ffn-target", "0.5", "--out", f"{w.root}/x"],
     "--attn-target: must lie in [0.0, 1.0), got 1"),
    ("ffn-target-1", lambda w: [*w.calibrate, "--attn-target", "0.5", "--ffn-target", "1.0", "--out", f"{w.root}/x"],
     "--ffn-target: must lie in [0.0, 1.0), got 1.0"),
    ("target-negative", lambda w: [*w.calibrate, "--ffn-target", "-0.1", "--out", f"{w.root}/x"],
     "--ffn-target: must lie in [0.0, 1.0)"),
    ("attn-target-alone", lambda w: [*w.calibrate, "--attn-target", "0.3", "--out", f"{w.root}/x"],
     "set both --attn-target and --ffn-target"),
    ("lora-r-0", lambda w: ["recover", *w.model, "--routers", f"{w.root}/done/routers", "--lora-r", "0",
                            "--out", f"{w.root}/x"], "--lora-r: must be >= 1, got 0"),
    ("lora-dropout-1", lambda w: ["recover", *w.model, "--routers", f"{w.root}/done/routers", "--lora-dropout",
                                  "1", "--out", f"{w.root}/x"], "--lora-dropout: must lie in [0, 1)"),
    ("compare-target-1", lambda w: ["compare", *w.model, "--targets", "0.5", "1"], "--targets: must lie in (0, 1)"),
    ("dry-run-mfu-0", lambda w: ["calibrate", "--dry-run", "--model", "llama-3.1-8b", "--mfu", "0", "--out", "x"],
     "--mfu: must lie in (0, 1]"),
    ("lr-inf", lambda w: [*w.calibrate, "--lr", "inf", "--out", f"{w.root}/x"],
     "--lr: must be a finite number, got inf"),
    ("lr-nan", lambda w: [*w.calibrate, "--lr", "nan", "--out", f"{w.root}/x"], "--lr: must be a finite number"),
    # finite for Python, not for the float32 optimiser: overflowed inside AdamW with a traceback
    ("lr-1e300", lambda w: [*w.calibrate, "--lr", "1e300", "--out", f"{w.root}/x"],
     "--lr: must lie within float32's range (|x| <= 3.4e38), got 1e300"),
    ("seq-len-1", lambda w: [*w.calibrate, "--seq-len", "1", "--out", f"{w.root}/x"], "--seq-len: must be >= 2"),
    ("heldout-fraction-1", lambda w: [*w.calibrate, "--heldout-fraction", "1", "--out", f"{w.root}/x"],
     "--heldout-fraction: must lie in [0.0, 1.0)"),
    ("threads-0", lambda w: ["eval", *w.model, "--threads", "0"], "--threads: must be >= 1"),
    ("unknown-task", lambda w: ["eval", *w.model, "--tasks", "arc_medium"], "--tasks: invalid choice: 'arc_medium'"),
    ("seed-negative", lambda w: [*w.calibrate, "--seed", "-1", "--out", f"{w.root}/x"], "--seed: must lie in"),
    ("out-is-a-file", lambda w: [*w.calibrate, "--out", f"{w.root}/afile"], "is a file: give a directory"),
    ("out-under-a-file", lambda w: [*w.calibrate, "--out", f"{w.root}/afile/run"], "afile is a file"),
    ("eval-out-under-a-file", lambda w: ["eval", *w.common, "--tasks", "--out", f"{w.root}/afile/res"],
     "afile is a file"),
    ("finished-run-without-resume", lambda w: [*w.calibrate, "--out", f"{w.root}/done"],
     "already holds a run: continue it with --resume, or start over with --overwrite"),
    ("resume-and-overwrite", lambda w: [*w.calibrate, "--out", f"{w.root}/done", "--resume", "--overwrite"],
     "give one of them"),
    ("resume-changed-seq-len", lambda w: [*w.calibrate, "--seq-len", "8", "--out", f"{w.root}/done", "--resume"],
     "--seq-len was 16, now 8. Resume with the saved values, or start over with --overwrite"),
    ("resume-changed-target", lambda w: [*w.calibrate, "--target", "0.3", "--out", f"{w.root}/done", "--resume"],
     "--target was 0.5, now 0.3"),
    ("resume-changed-seed", lambda w: [*w.calibrate, "--seed", "1", "--out", f"{w.root}/done", "--resume"],
     "--seed was 0, now 1"),
    ("resume-changed-data", lambda w: [*w.calibrate, "--data", f"{w.root}/other.jsonl", "--text-field", "body",
                                       "--out", f"{w.root}/done", "--resume"], "--data was"),
    ("resume-without-checkpoint", lambda w: [*w.calibrate, "--out", f"{w.root}/no_checkpoint", "--resume"],
     "no checkpoint to resume from: start over with --overwrite"),
    ("demo-out-is-a-file", lambda w: ["demo", "--out", f"{w.root}/afile"], "--out"),
    ("model-is-a-file", lambda w: ["eval", "--model", f"{w.root}/afile"], "is a file, not a model directory"),
    ("model-missing", lambda w: ["eval", "--model", f"{w.root}/nowhere"], "--model"),
    ("model-without-config", lambda w: ["eval", "--model", f"{w.root}/empty_dir"], "has no config.json"),
    ("data-missing", lambda w: [*w.calibrate, "--data", f"{w.root}/nowhere.txt", "--out", f"{w.root}/x"],
     "--data"),
    ("jsonl-without-the-field", lambda w: [*w.calibrate, "--data", f"{w.root}/other.jsonl", "--out", f"{w.root}/x"],
     "no field 'text' (has ['body']; name the text field with --text-field"),
    ("routers-config-empty", lambda w: ["eval", *w.common, "--routers", f"{w.root}/empty_meta"],
     "--routers: "),
    ("routers-config-not-json", lambda w: ["recover", *w.common, "--routers", f"{w.root}/bad_json",
                                           "--out", f"{w.root}/s2"], "is not valid JSON"),
    ("routers-missing", lambda w: ["generate", *w.model, "--routers", f"{w.root}/nowhere", "--prompt", "a"],
     "does not exist"),
    ("temperature-negative", lambda w: ["generate", *w.model, "--prompt", "a", "--temperature", "-1"],
     "--temperature: must be >= 0.0, got -1"),
    ("top-p-zero", lambda w: ["generate", *w.model, "--prompt", "a", "--top-p", "0"], "--top-p: must lie in (0.0, 1.0]"),
    ("top-p-above-1", lambda w: ["generate", *w.model, "--prompt", "a", "--top-p", "1.5"], "--top-p: must lie in"),
    ("top-k-negative", lambda w: ["generate", *w.model, "--prompt", "a", "--top-k", "-1"], "--top-k: must be >= 0"),
    ("max-new-tokens-0", lambda w: ["generate", *w.model, "--prompt", "a", "--max-new-tokens", "0"],
     "--max-new-tokens: must be >= 1"),
    ("prompt-too-long", lambda w: ["generate", *w.model, "--prompt", _long_prompt(), "--max-new-tokens", "8"],
     "prompt 1 has 180 tokens but the model's 128 positions leave 120 beside --max-new-tokens 8"),
    ("no-room-for-a-prompt", lambda w: ["generate", *w.model, "--prompt", "a", "--max-new-tokens", "128"],
     "--max-new-tokens 128 leaves no room for a prompt"),
    ("loss-unknown", lambda w: [*w.calibrate, "--loss", "kl", "--out", f"{w.root}/x"],
     "--loss: invalid choice: 'kl'"),
    ("kd-temperature-0", lambda w: [*w.calibrate, "--kd-temperature", "0", "--out", f"{w.root}/x"],
     "--kd-temperature: must be > 0, got 0"),
    ("mix-weight-above-1", lambda w: [*w.calibrate, "--mix-weight", "1.5", "--out", f"{w.root}/x"],
     "--mix-weight: must lie in [0, 1], got 1.5"),
    ("amp-unknown", lambda w: [*w.calibrate, "--amp", "fp8", "--out", f"{w.root}/x"], "--amp: invalid choice"),
    ("resume-changed-loss", lambda w: [*w.calibrate, "--loss", "mix", "--out", f"{w.root}/done", "--resume"],
     "--loss was 'ce', now 'mix'"),
    ("resume-changed-decontamination", lambda w: [*w.calibrate, "--decontaminate", "none", "--out", f"{w.root}/done",
                                                  "--resume"], "--decontaminate was 'heldout', now 'none'"),
    ("decontaminate-unknown", lambda w: [*w.calibrate, "--decontaminate", "some", "--out", f"{w.root}/x"],
     "--decontaminate: invalid choice"),
    ("eval-data-missing", lambda w: [*w.calibrate, "--eval-data", f"{w.root}/nowhere.jsonl", "--out", f"{w.root}/x"],
     "--eval-data"),
    # checked from the model's config.json before any load, naming the flag (issue 41, defect 5)
    ("ffn-group-size-not-dividing", lambda w: [*w.calibrate, "--ffn-group-size", "64", "--out", f"{w.root}/x"],
     "--ffn-group-size=64 does not divide intermediate_size=96; sizes that divide it and suit the GPU kernels "
     "(multiples of 16): [16, 32, 48, 96]"),
    ("ffn-group-size-24", lambda w: [*w.calibrate, "--ffn-group-size", "24", "--out", f"{w.root}/x"],
     "--ffn-group-size 24 is not a multiple of 16"),
    ("compare-ffn-group-size-24", lambda w: ["compare", *w.common, "--ffn-group-size", "24", "--methods", "wide",
                                             "--targets", "0.5", "--steps", "1", "--tasks", "--quiet",
                                             "--runs", f"{w.root}/cr", "--out", f"{w.root}/c"],
     "--ffn-group-size 24 is not a multiple of 16"),
    # compare's heads rows: a given thresholds set is one target's, and must hold thresholds
    ("compare-heads-thresholds-two-targets", lambda w: ["compare", *w.common, "--methods", "heads", "--heads-thresholds",
                                                        f"{w.root}/fine_only", "--targets", "0.25", "0.5", "--tasks",
                                                        "--runs", f"{w.root}/cr", "--out", f"{w.root}/c"],
     "--heads-thresholds fixes the thresholds"),
    ("compare-heads-thresholds-routers-only", lambda w: ["compare", *w.common, "--methods", "heads",
                                                         "--heads-thresholds", f"{w.root}/done/routers", "--targets",
                                                         "0.5", "--tasks", "--runs", f"{w.root}/cr", "--out",
                                                         f"{w.root}/c"],
     "holds no per-element thresholds (routers only)"),
    ("attn-group-size-3", lambda w: [*w.calibrate, "--attn-group-size", "3", "--out", f"{w.root}/x"],
     "--attn-group-size=3 does not divide the model's 4 query heads; valid sizes: [1, 2, 4]"),
    ("unsupported-architecture", lambda w: [*w.calibrate, "--model", f"{w.root}/gpt2", "--out", f"{w.root}/x"],
     f"this model is 'gpt2'"),
    ("generate-unsupported-architecture", lambda w: ["generate", "--model", f"{w.root}/gpt2", "--prompt", "a"],
     "this model is 'gpt2'"),
    ("truncated-safetensors", lambda w: [*w.calibrate, "--model", f"{w.root}/truncated", "--out", f"{w.root}/x"],
     "/truncated/model.safetensors is cut short"),
    ("eval-truncated-safetensors", lambda w: ["eval", *w.common, "--model", f"{w.root}/truncated"],
     "/truncated/model.safetensors is cut short"),
    ("empty-prompt", lambda w: ["generate", *w.model, "--prompt", "the cat", "--prompt", ""],
     "argument --prompt: must not be empty"),
    ("routers-for-another-shape", lambda w: ["eval", *w.common, "--routers", "smollm2-135m-50"],
     "trained for a different model"),
    # issue 49, defects 2 and 5: what --mode needs, checked from the checkpoint's files before the
    # model loads (a fine set ran --mode coarse as the dense model labelled "routed"; --mode fine on
    # a router set failed after the load, naming model.wide_fine)
    ("generate-coarse-without-routers", lambda w: ["generate", *w.model, "--routers", f"{w.root}/fine_only",
                                                   "--mode", "coarse", "--prompt", "a"],
     "--mode coarse runs the routers, and --routers"),
    ("generate-hybrid-without-routers", lambda w: ["generate", *w.model, "--routers", f"{w.root}/fine_only",
                                                   "--mode", "hybrid", "--prompt", "a"],
     "--mode hybrid runs the routers, and --routers"),
    ("generate-fine-without-thresholds", lambda w: ["generate", *w.model, "--routers", f"{w.root}/done/routers",
                                                    "--mode", "fine", "--prompt", "a"],
     "--mode fine decodes with per-element thresholds, and --routers"),
    ("generate-hybrid-without-thresholds", lambda w: ["generate", *w.model, "--routers", f"{w.root}/done/routers",
                                                      "--mode", "hybrid", "--prompt", "a"],
     "--mode hybrid decodes with per-element thresholds, and --routers"),
    ("generate-mode-unknown", lambda w: ["generate", *w.model, "--mode", "teal", "--prompt", "a"],
     "--mode: invalid choice: 'teal'"),
    ("generate-fine-without-a-checkpoint", lambda w: ["generate", *w.model, "--mode", "fine", "--prompt", "a"],
     "--mode fine decodes with per-element thresholds: give --routers"),
    ("generate-shipped-fine-set-coarse", lambda w: ["generate", "--routers", "smollm2-135m-fine-50", "--mode", "coarse",
                                                    "--prompt", "Hi"],
     "--mode coarse runs the routers, and --routers smollm2-135m-fine-50 has none"),
    ("generate-shipped-router-set-fine", lambda w: ["generate", "--routers", "smollm2-135m-50", "--mode", "fine",
                                                    "--prompt", "Hi"],
     "--mode fine decodes with per-element thresholds, and --routers smollm2-135m-50 has none"),
    # issue 49, defect 3: without its manifest nothing says the weights are the ones written
    ("routers-without-manifest", lambda w: ["eval", *w.common, "--routers", f"{w.root}/unsealed"],
     "has no wide_manifest.json"),
    ("generate-routers-without-manifest", lambda w: ["generate", *w.model, "--routers", f"{w.root}/unsealed",
                                                     "--prompt", "a"], "has no wide_manifest.json"),
    # one line naming the flag, the file and the byte (issue 41, defect 6)
    ("data-not-utf8", lambda w: [*w.calibrate, "--data", f"{w.root}/latin1.txt", "--out", f"{w.root}/x"],
     "/latin1.txt is not UTF-8 text: byte 22 (line 1)"),
    ("data-not-utf8-on-a-later-line", lambda w: [*w.calibrate, "--data", f"{w.root}/latin1.jsonl",
                                                 "--out", f"{w.root}/x"],
     "/latin1.jsonl is not UTF-8 text: byte 56 (line 4)"),
    ("eval-data-not-utf8", lambda w: ["eval", *w.common, "--eval-data", f"{w.root}/latin1.txt"],
     "--eval-data "),
    ("data-garbage", lambda w: [*w.calibrate, "--data", f"{w.root}/garbage.bin", "--out", f"{w.root}/x"],
     "/garbage.bin: not a text source: give 'wiki' or 'sotu', a .txt or .jsonl file"),
    ("sample-tokens-0", lambda w: ["sample-data", *w.model, "--tokens", "0", "--out", f"{w.root}/x"],
     "--tokens: must be >= 1, got 0"),
    ("sample-temperature-0", lambda w: ["sample-data", *w.model, "--temperature", "0", "--out", f"{w.root}/x"],
     "--temperature: must be > 0"),
    ("sample-out-is-a-file", lambda w: ["sample-data", *w.model, "--out", f"{w.root}/afile"],
     "is a file: give a directory"),
    ("sample-prompts-unknown", lambda w: ["sample-data", *w.model, "--prompt-source", "eval", "--out", f"{w.root}/x"],
     "--prompt-source: invalid choice"),
]
# Beyond the flag, what the one line must also say.
ALSO = {"routers-config-empty": "lacks 'wide_config', 'model'", "model-missing": "does not exist",
        "ffn-group-size-24": "[16, 32, 48, 96]", "compare-ffn-group-size-24": "[16, 32, 48, 96]",
        "unsupported-architecture": "--model", "generate-unsupported-architecture": "--model",
        "truncated-safetensors": "--model", "eval-truncated-safetensors": "--model",
        "routers-for-another-shape": "--routers",
        "generate-coarse-without-routers": "use --mode fine", "generate-fine-without-thresholds": "--mode coarse",
        "generate-shipped-fine-set-coarse": "use --mode fine", "routers-without-manifest": "wide seal",
        "generate-mode-unknown": "auto",
        "generate-routers-without-manifest": "--routers",
        "data-not-utf8": "--data ", "data-not-utf8-on-a-later-line": "--data ", "data-garbage": "--data ",
        "eval-data-not-utf8": "latin1.txt is not UTF-8 text: byte 22",
        "data-missing": "does not exist", "prompt-too-long": "--truncate-prompt", "eval-data-missing": "does not exist"}


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(w, argv, expected, capsys, request):
    try:
        rc = main(argv(w))
    except SystemExit as e:  # argparse's own checks (ranges, choices) exit from the parser
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and expected in err, err
    assert ALSO.get(request.node.callspec.id, "") in err
    assert "loaded " not in out and "calibration:" not in out, out  # nothing loaded first


def test_an_unexpected_error_keeps_its_traceback(w, monkeypatch):
    from wide.commands import runs

    def bug(*a, **k):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(runs, "check_model", bug)
    with pytest.raises(KeyError):
        main(["eval", *w.model])


def _float_options(parser):
    """(command, flag) of every option that converts its value to a float, on every command."""
    import argparse

    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        for command, p in sub.choices.items():
            for action in p._actions:
                if action.option_strings and getattr(action.type, "__name__", None) == "float":
                    yield command, action.option_strings[0]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_option_refuses_a_non_finite_value(value, capsys):
    # issue 41, defect 2: a NaN passes no range check but reaches the ones that have none, and inf
    # passes every lower bound (--lr inf trained to a FloatingPointError at step 1)
    parser = build_parser()
    options = list(_float_options(parser))
    assert ("calibrate", "--lr") in options and ("compare", "--targets") in options and len(options) > 20
    for command, flag in options:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, f"{flag}={value}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, (command, flag, err)
        assert f"argument {flag}: must be a finite number, got {value}" in err, (command, flag, err)


def test_eval_takes_its_results_stem_literally_and_replaces_results_only_with_overwrite(w, capsys):
    # issue 41, defect 3: --out run.v1 and --out run.v2 both wrote run.json / run.md, and an
    # existing result was replaced without a word
    res = w.root / "results"
    argv = ["eval", *w.common, "--tasks", "--max-eval-sequences", "2"]
    for stem in ("run.v1", "run.v2"):
        assert main([*argv, "--out", str(res / stem)]) == 0
    assert sorted(p.name for p in res.iterdir()) == ["run.v1.json", "run.v1.md", "run.v2.json", "run.v2.md"]
    assert (res / "run.v1.md").read_text().startswith("# run.v1\n")
    before = (res / "run.v1.json").read_text()
    capsys.readouterr()
    assert main([*argv, "--out", str(res / "run.v1")]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"--out {res / 'run.v1'}: {res / 'run.v1.json'} already exists" in err, err
    assert "--overwrite" in err and "loaded " not in out  # refused before the model loads
    assert (res / "run.v1.json").read_text() == before
    (res / "run.v1.json").write_text("stale")
    assert main([*argv, "--out", str(res / "run.v1"), "--overwrite"]) == 0
    assert json.loads((res / "run.v1.json").read_text())["records"]
