"""Fault injection: a tiny calibration (random Llama, CPU) killed with SIGKILL again and again.
After each kill ``--resume`` must continue from the newest complete checkpoint, losing at most
one save interval, and the run, once finished, must leave no temporary folder and the very
routers an uninterrupted run with the same seed gives.

Most kills fall inside checkpoint writes at a point chosen by progress, not by the clock: the
child counts the pauses between the steps of a directory write (serialization._pause: after each
file, after each rename) and SIGKILLs itself at a randomly drawn one, so where it dies, and how
far the run has got, is the same on any machine, idle or loaded. The others are killed from
outside after a random delay (WIDE_TEST_SLOW_WRITE sleeps at every pause, so many of those land
inside writes too): random moments, checked by what must hold after any kill.

Children are forked from this process, which has imported everything, so each one costs a
model load and a few steps, not an interpreter start."""

import json
import multiprocessing
import os
import random
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_run
from safetensors.torch import load_file

from wide import data
from wide.io import serialization
from wide.training import train as train_module
from wide.cli import main

KILLS = 32  # of which 1 in 4 after a random delay, the others at a random pause
PAUSES = 12  # pauses in two checkpoint writes: a child dies at a pause in 1..PAUSES at the latest
PAUSE_S = 0.02  # per pause of a delay-killed child's directory writes
MAX_DELAY_S = 0.45  # a delay-killed child lives up to this long: startup and a few steps
# The pause-killed children commit 22 checkpoints in all (fixed by the seed), the others 2 at
# most each (a checkpoint write takes 6 pauses): 38 at most, so the run never finishes before
# the last kill.
STEPS = 48
SAVED = re.compile(r"^saved (\d+)$", re.M)
START = re.compile(r"^(?:resumed from \S+ at step (\d+)/\d+|no checkpoint in \S+: starting a new run)$", re.M)


def _own_progress_lock() -> None:
    """tqdm writes under a multiprocessing lock that forked children share with this process: a
    child killed inside a progress-bar write leaves it held for good, and every later bar, in
    the next child and in the test process (the tests after this one), waits on it forever
    (seen in CI). Each child takes a lock of its own instead."""
    import threading

    _set_progress_lock(threading.RLock())


def _set_progress_lock(lock) -> None:
    import tqdm.std

    classes = [tqdm.std.tqdm]
    while classes:  # tqdm.auto's class and others may hold one of their own
        cls = classes.pop()
        cls.set_lock(lock)
        classes += cls.__subclasses__()


def _child(argv: list, log: str, slow: bool, die_at_pause) -> None:
    """One ``wide calibrate`` in this forked process; logs each checkpoint once its save has
    returned, so the log is a lower bound of what is on disk. ``die_at_pause``: SIGKILL itself
    at that pause of its directory writes (counted from 1)."""
    _own_progress_lock()
    if slow:
        os.environ[serialization.SLOW_WRITE_ENV] = str(PAUSE_S)
    else:
        os.environ.pop(serialization.SLOW_WRITE_ENV, None)
    out = open(log, "a", buffering=1)
    sys.stdout = out
    sys.stderr = open(log + ".err", "a")  # the progress bar, apart from the lines parsed here
    save = train_module.save_routers

    def logged(model, path, **kw):
        result = save(model, path, **kw)
        if Path(path).name == train_module.CHECKPOINT_DIR:
            out.write(f"saved {kw['extra']['step']}\n")
        return result

    train_module.save_routers = logged
    if die_at_pause is not None:
        pause, seen = serialization._pause, [0]

        def counted():
            seen[0] += 1
            if seen[0] == die_at_pause:
                out.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            pause()

        serialization._pause = counted
    code = 1
    try:
        code = main(argv)
    finally:
        out.flush()
        os._exit(code)


def _run(ctx, argv, log, slow=True, kill_after=None, die_at_pause=None) -> bool:
    """Run one child, killing it after ``kill_after`` seconds if given (or letting it kill
    itself at pause ``die_at_pause``); True when it was killed, False when it finished
    (successfully)."""
    p = ctx.Process(target=_child, args=(argv, str(log), slow, die_at_pause))
    p.start()
    p.join(kill_after if kill_after is not None else 300)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert kill_after is not None, "a child did not finish in 300 s"
        return True
    if die_at_pause is not None and p.exitcode == -signal.SIGKILL:
        return True
    assert p.exitcode == 0, log.read_text() + Path(f"{log}.err").read_text()[-2000:]
    return False


def _routers(run: Path) -> dict:
    return load_file(str(run / "routers" / serialization.ROUTERS_FILE))


def test_sigkill_at_random_moments_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    argv = ["calibrate", *write_tiny_run(tmp_path), "--steps", str(STEPS), "--batch-size", "2", "--eval-every", "0",
            "--save-every", "1", "--offset-batches", "1", "--ffn-group-size", "32", "--threads", "1", "--seed", "7"]
    ctx = multiprocessing.get_context("fork")
    # The uninterrupted reference first: it also fills the token cache the others read.
    _run(ctx, [*argv, "--out", str(tmp_path / "whole")], tmp_path / "whole.log", slow=False)

    out = tmp_path / "killed"
    argv = [*argv, "--out", str(out), "--resume"]
    rng = random.Random(0)
    newest, kills, mid_write, resumed = 0, 0, 0, 0
    for kills in range(KILLS):
        log = tmp_path / f"child{kills}.log"
        if kills % 4 != 3:
            killed = _run(ctx, argv, log, slow=False, die_at_pause=rng.randint(1, PAUSES))
        else:  # a random moment (startup, a step, a write), at pause PAUSES at the latest
            killed = _run(ctx, argv, log, kill_after=rng.uniform(0.0, MAX_DELAY_S), die_at_pause=PAUSES)
        assert killed, "the run finished before its last kill"
        text = log.read_text()
        start = START.search(text)
        if start is not None:
            step = int(start.group(1) or 0)
            # Never behind the newest checkpoint a save returned from; at most the one
            # checkpoint a kill between its commit and its log line hides from the log.
            assert newest <= step <= newest + 1, (kills, newest, step, text)
            resumed += step > 0
            newest = step  # what the disk held, logged or not
        newest = max([newest, *map(int, SAVED.findall(text))])
        mid_write += bool(serialization.leftovers(out / train_module.CHECKPOINT_DIR))
    # The kills hit the windows the test is about, and the run made progress through them.
    # Fixed by the seed and the pauses a checkpoint write takes, on a slow machine as on a fast
    # one: (32, 23, 22) measured for (mid_write, resumed, newest); the delay kills can only add
    # progress, and leftovers are left by nearly every pause kill.
    assert mid_write >= 16, mid_write
    assert resumed >= 16 and newest >= 16, (resumed, newest)

    _run(ctx, argv, tmp_path / "last.log", slow=False)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert (out / train_module.CHECKPOINT_DIR / serialization.MANIFEST_FILE).is_file()
    whole, killed = _routers(tmp_path / "whole"), _routers(out)
    assert whole.keys() == killed.keys()
    for k in whole:
        assert torch.equal(whole[k], killed[k]), k


def _hold_progress_lock_and_die(own: bool) -> None:
    from tqdm import tqdm

    if own:
        _own_progress_lock()
    tqdm.get_lock().acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_killed_inside_a_progress_bar_write_leaves_no_lock_behind():
    from tqdm.std import TqdmDefaultWriteLock, tqdm

    ctx = multiprocessing.get_context("fork")
    try:
        for own in (True, False):
            tqdm.get_lock()  # the shared lock exists before the fork, as after any bar here
            p = ctx.Process(target=_hold_progress_lock_and_die, args=(own,))
            p.start()
            p.join()
            shared = TqdmDefaultWriteLock.mp_lock
            got = shared.acquire(timeout=2)
            if got:
                shared.release()
            # With its own lock the child's death leaves ours free; sharing tqdm's, it would
            # hang every later bar: the test checks that it can tell.
            assert got == own, own
    finally:  # a fresh shared lock for the tests after this one
        TqdmDefaultWriteLock.mp_lock = multiprocessing.RLock()
        _set_progress_lock(TqdmDefaultWriteLock())


def test_a_run_that_fails_before_its_first_checkpoint_does_not_block_the_corrected_one(tmp_path, monkeypatch,
                                                                                       capsys):
    # issue 41, defect 2: a learning rate that turns the loss non-finite at step 1 ended in a
    # traceback and left settings.json behind, so the corrected command needed --overwrite. A run
    # directory with settings but no checkpoint holds nothing trained: nothing to resume or lose.
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    out = tmp_path / "run"
    argv = ["calibrate", *write_tiny_run(tmp_path), "--steps", "3", "--batch-size", "1", "--eval-every", "0",
            "--offset-batches", "1", "--ffn-group-size", "32", "--out", str(out)]
    capsys.readouterr()
    assert main([*argv, "--lr", "1e30"]) == 1
    err = capsys.readouterr().err  # (the progress bar above the error line)
    assert "Traceback" not in err and err.endswith("\n") and err.splitlines()[-1].startswith(
        "error: non-finite loss at step 1 ") and "lower the learning rate" in err, err
    assert not (out / train_module.CHECKPOINT_DIR).exists()
    for extra in ([], ["--resume"]):  # the corrected command, as typed again or as a resume
        assert main([*argv, "--lr", "1e-3", *extra]) == 0, capsys.readouterr().err
        assert json.loads((out / "settings.json").read_text())["lr"] == 1e-3  # the settings of the run made
        assert main([*argv, "--lr", "1e30", "--overwrite"]) == 1
    # a learning rate inside float32's range whose AdamW step is not: one line, exit 1, as above
    assert main([*argv, "--lr", "1e38", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: the optimiser step overflowed float32 at step 1" in err, err
    # a run with a checkpoint is still one: without --resume it is refused, with it continued
    assert main([*argv, "--lr", "1e-3", "--stop-at", "1"]) == 0
    capsys.readouterr()
    assert main([*argv, "--lr", "1e-3"]) == 2 and "already holds a run" in capsys.readouterr().err
    assert main([*argv, "--lr", "1e-2", "--resume"]) == 2 and "--lr was 0.001" in capsys.readouterr().err


def test_optimiser_step_overflow_is_found_before_the_step():
    from wide.training.train import optimiser_step_overflow

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=1e38, betas=(0.9, 0.999), weight_decay=0.0)
    # lr fits float32 (max 3.4e38), its first Adam step lr / (1 - 0.9) = 1e39 does not
    assert optimiser_step_overflow(opt) == pytest.approx(1e39)
    opt.param_groups[0]["lr"] = 1e-3
    assert optimiser_step_overflow(opt) is None
    p.grad = torch.ones(3)
    for _ in range(60):  # bias correction -> 1: the same 1e38 fits once t is large
        opt.step()
    opt.param_groups[0]["lr"] = 1e38
    assert optimiser_step_overflow(opt) is None
    opt.param_groups[0]["weight_decay"] = 10.0  # AdamW's decoupled decay multiplies lr by it
    assert optimiser_step_overflow(opt) == pytest.approx(1e39)
    sgd = torch.optim.SGD([p], lr=float("inf"))
    assert optimiser_step_overflow(sgd) == float("inf")
