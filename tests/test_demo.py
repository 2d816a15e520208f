"""The demo (`bash scripts/demo.sh`, wide/commands/demo.py) calibrates the recommended method with the
README's options and, run again, reuses what is finished: the calibration is not started again
(not even its threshold shift), and no evaluation or continuation whose set and settings are
unchanged is computed again (issue 49, item 2)."""
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

import wide
from conftest import tiny_model, write_tiny_run
from wide.commands import demo
from wide.cli import build_parser
from wide.io.serialization import save_routers

README = Path(__file__).resolve().parents[1] / "README.md"


def _args(**kw):
    return demo.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_the_demo_calibrates_learned_thresholds_with_the_readmes_recommended_options():
    parsed = build_parser().parse_args(["calibrate", "--out", "x", *demo.calibrate_options(_args())])
    assert parsed.hybrid and parsed.sparse_target == "none" and parsed.fine_per_channel
    assert parsed.target == 0.5 and parsed.sparsity_warmup == 0 and parsed.device == "cpu"
    # the README's recommended command (its step 2) names the same method options
    text = README.read_text().split("## The recommended path")[1].split("## The modes")[0]
    cmd = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "wide calibrate" in b)
    words = shlex.split(cmd.replace("\\\n", " "), comments=True)
    method = ("--hybrid", "--sparse-target", "none", "--fine-per-channel", "--sparsity-warmup", "0")
    for w in method:
        assert w in words and w in demo.calibrate_options(_args())


def _finish(run_dir: Path) -> None:
    """What a finished `wide calibrate` leaves: run.json and a sealed routers directory."""
    save_routers(wide.wrap(tiny_model("llama"), wide.WideConfig(ffn_group_size=16)), run_dir / "routers")
    (run_dir / "run.json").write_text(json.dumps({"wall_s": 1.0}))


def test_a_calibration_runs_once_resumable_and_is_then_reused(tmp_path, monkeypatch):
    calls = []

    def fake_call(argv):
        calls.append(argv)
        _finish(Path(argv[argv.index("--out") + 1]))
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    args = _args(steps=7)
    routers, wall, ran = demo.calibrate(args, tmp_path)
    assert ran and len(calls) == 1 and calls[0][1:4] == ["-m", "wide.cli", "calibrate"]
    assert "--resume" in calls[0]  # a run a kill left half done continues from its checkpoint
    assert routers.parent.name.startswith("learned-50-") and (routers.parent / demo.WALL_FILE).is_file()
    again = demo.calibrate(args, tmp_path)
    assert len(calls) == 1 and again == (routers, wall, False)  # finished: not started again
    demo.calibrate(_args(steps=8), tmp_path)  # other settings: another directory, run
    assert len(calls) == 2 and calls[1][calls[1].index("--out") + 1] != str(routers.parent)


def test_a_failed_calibration_stops_the_demo(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "call", lambda argv: 2)
    with pytest.raises(SystemExit, match="exit code 2"):
        demo.calibrate(_args(), tmp_path)


def _thresholds(tmp_path, model_dir, target: float) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wide.wrap(model, wide.WideConfig(sparse_target="none", target_sparsity=target, loss_mode="linear"))
    wide.fine.attach(model, wide.FineConfig(criterion="magnitude", target=target))
    wide.fine.calibrate(model, [torch.randint(2, 20, (4, 16), generator=torch.Generator().manual_seed(0))])
    return save_routers(model, tmp_path / "teal")


def test_evaluations_and_continuations_are_reused_by_content(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_run(tmp_path)
    model_dir = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = _args(eval_sequences=2, sample_tokens=3)
    heldout = lambda: torch.randint(2, 20, (2, 16), generator=torch.Generator().manual_seed(1))  # noqa: E731
    teal = _thresholds(tmp_path, model_dir, 0.5)
    sets = [("dense", None), ("teal", teal)]
    rows = demo.measure(sets, args, model_dir, tok, demo.Results(tmp_path / "r.json"), heldout=heldout)
    assert [r["mode"] for r in rows] == ["dense", "fine"]
    assert rows[0]["linear_sparsity"] == 0 and 0.3 < rows[1]["linear_sparsity"] < 0.7
    assert all(len(r["texts"]) == len(demo.PROMPTS) for r in rows)

    def refuse(*a, **k):
        raise AssertionError("recomputed a result the cache holds")

    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    assert demo.measure(sets, args, model_dir, tok, demo.Results(tmp_path / "r.json"), heldout=refuse) == rows
    # other thresholds in the same directory are another set: measured again
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", real)
    _thresholds(tmp_path, model_dir, 0.3)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(AssertionError, match="recomputed"):
        demo.measure(sets, args, model_dir, tok, demo.Results(tmp_path / "r.json"), heldout=heldout)
    # and more held-out windows are another evaluation
    with pytest.raises(AssertionError, match="recomputed"):
        demo.measure(sets[:1], _args(eval_sequences=3, sample_tokens=3), model_dir, tok,
                     demo.Results(tmp_path / "r.json"), heldout=heldout)


def test_default_threads_leave_busy_cores_alone(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for load, want in ((0.4, 2), (1.3, 1), (7.9, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert demo.default_threads() == want


def test_demo_script_and_wide_demo_run_this_demo(monkeypatch):
    script = (Path(__file__).resolve().parents[1] / "scripts" / "demo.sh").read_text()
    assert "wide demo" in script and "scripts/setup.sh" in script
    # `wide demo` is this demo with the same options (it once calibrated routers: issue 49)
    argv = ["--steps", "7", "--target", "0.25", "--out", "x"]
    args = build_parser().parse_args(["demo", *argv])
    assert {k: v for k, v in vars(args).items() if k not in ("command", "func", "check")} == vars(_args(
        steps=7, target=0.25, out="x"))
    ran = []
    monkeypatch.setattr(demo, "run", lambda a: ran.append(a) or 0)
    from wide.cli import main

    assert main(["demo", *argv]) == 0 and ran and ran[0].steps == 7
