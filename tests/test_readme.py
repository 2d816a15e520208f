"""The README's examples match the code: every `wide ...` line of its command blocks (and of
docs/cli.md, where the full list moved) parses with the CLI's parser, and its Python example runs
as written (two calibration steps instead of 100 on 64-token sequences, outputs under a temporary
folder; slow: it needs the real default model and Wikipedia text, and skips when they are not
cached)."""
import re
import shlex
from pathlib import Path

import pytest
import torch

from wide import data
from wide.cli import build_parser
from wide.method.routers import TokenRouter

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS_CLI = README.parent / "docs" / "cli.md"


def block(section: str, lang: str) -> str:
    m = re.search(rf"## {section}\n\n```{lang}\n(.*?)```", README.read_text(), re.S)
    assert m, f"README.md has no ```{lang} block under '## {section}'"
    return m.group(1)


def python_api_block() -> str:
    return block("Python API", "python")


def cli_lines(text: str = None) -> list:
    """The block's commands as argument lists after the program name (continuations joined,
    comments dropped; `torchrun ... -m wide.cli ARGS` counts as `wide ARGS`)."""
    out = []
    for line in (block("Command line", "bash") if text is None else text).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "wide":
            out.append(words[1:])
        elif "wide.cli" in words:
            out.append(words[words.index("wide.cli") + 1:])
    return out


def test_readme_command_lines_parse():
    lines = cli_lines()
    assert len(lines) >= 10
    parser = build_parser()
    for argv in lines:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README command does not parse: wide {' '.join(argv)}")


def test_every_command_the_readme_and_docs_cli_show_parses():
    """Beside the block above: the recommended path's commands, and the full list that moved to
    docs/cli.md (issue 49)."""
    parser = build_parser()
    blocks = {path: re.findall(r"```bash\n(.*?)```", path.read_text(), re.S) for path in (README, DOCS_CLI)}
    lines = {path: [argv for b in bs for argv in cli_lines(b)] for path, bs in blocks.items()}
    assert len(lines[README]) >= 15 and len(lines[DOCS_CLI]) >= 25
    for path, argvs in lines.items():
        for argv in argvs:
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{path.name} command does not parse: wide {' '.join(argv)}")


def test_readme_block_is_found_and_names_the_calls_it_shows():
    code = python_api_block()
    for call in ("wide.wrap(", "train(", "wide.calibrate_offsets(", "wide.save_routers(",
                 "wide.from_pretrained(", "wide.fine.attach(", "wide.fine.calibrate(",
                 "wide.fine.shift_to_target(", "wide.accelerate(", "wide.generate("):
        assert call in code


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path, capsys, default_model_dir):
    # (default_model_dir fetches the model the example loads by name, if it is missing)
    code = python_api_block()
    # sequences of 64 tokens, not 256: a quarter of the training, calibration and TEAL
    # passes on the real model, which is what this test spends its time on; the thresholds'
    # shift (15 forward passes) on half the sequences; the engine on its PyTorch path, which a
    # CPU without the interpreter runs anyway (under TRITON_INTERPRET=1 the auto backend would
    # interpret every kernel of the 135M model: over 10 min on 2 cores)
    for old, new in (("TrainArgs(steps=100)", "TrainArgs(steps=2)"), ("seq_len=256", "seq_len=64"),
                     ('"runs/mine', f'"{tmp_path}/mine'), ("ids[:8].split(8), 0.5", "ids[:4].split(4), 0.5"),
                     ('mode="fine")', 'mode="fine", backend="torch")')):
        assert old in code, f"README example changed: {old!r} no longer in it; update this test"
        code = code.replace(old, new)
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    printed = capsys.readouterr().out
    assert "'flop_rate'" in printed and "'per_layer'" in printed
    # the learned thresholds: shifted onto their target, saved, run by the engine
    rates = [float(line) for line in printed.splitlines() if re.fullmatch(r"0\.\d+", line.strip())]
    assert len(rates) == 1 and abs(rates[0] - 0.5) < 0.01  # shifted onto 50 % on the 4 sequences it measures
    assert re.search(r"^\[(['\"]).+\1\]$", printed, re.M)  # the engine's continuation: a list of one text
    assert (tmp_path / "mine" / "fine50" / "thresholds.safetensors").is_file()
    assert (tmp_path / "mine" / "routers" / "routers.safetensors").is_file()
    reloaded = ns["model"]  # the example's last line rebinds model to the one loaded back
    n_routers = sum(isinstance(m, TokenRouter) for m in reloaded.modules())
    assert n_routers == 2 * reloaded.config.num_hidden_layers  # attention + FFN, every layer


def test_readme_names_the_default_model_as_it_is():
    # issue 41, defect 11: the README called it "SmolLM2-135M"; it is the instruct model, a Q4_1
    # GGUF dequantised (docs/data.md)
    text = README.read_text()
    start = text.split("## Python API")[0]
    assert data.MODEL_NAME == "SmolLM2-135M-Instruct" and data.MODEL_NAME in start and "Q4_1 GGUF" in start
    assert not re.findall(r"SmolLM2-135M(?!-Instruct)", text)


def test_readme_stays_a_users_page():
    # issue 49, item 1: at most 200 lines, the recommended path before the other ways, and what a
    # user needs to choose and run a mode; histories, trials and caveats live in docs/
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.index("## The recommended path") < text.index("## The modes") < text.index("## Python API")
    for must in ("smollm2-135m-fine-50", "wide generate --mode fine", "wide.accelerate(", "wide seal",
                 "wide compare --axis linear", "B=2", "docs/results.md", "docs/cli.md", "docs/layout.md"):
        assert must in text, must
