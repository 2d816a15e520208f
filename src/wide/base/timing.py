"""The one timing module: every GPU time wide reports or acts on comes from here.

The engine's measured choices (routed kernel or cuBLAS, decode-attention splits) and every
benchmark use these functions, so a number in a results file and a choice the engine made
were timed the same way.

- :func:`time_graph`: ms, one callable captured in a CUDA graph, replays timed by ``do_bench``
  (L2 flushed before each); the engine's per-shape choices.
- :func:`graph_time_us`: us per call, a CUDA graph of many calls rotating over a list of
  callables (distinct input sets, so L2 does not keep one call's bytes for the next), replays
  timed with CUDA events; the kernel benchmarks.
- :func:`do_bench_us`: us, ``triton.testing.do_bench`` median of eager calls (L2 flushed).
- :func:`step_time_s`: s, whole prefills or decode loops, one CUDA-event pair per run.
- :func:`wall_time_us`: us per call, host wall clock; dry runs on the CPU.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch


def time_graph(fn, rep: int = 30) -> float:
    """Cold-cache GPU time (ms, median) of ``fn`` captured in a CUDA graph.

    ``fn`` runs once eagerly first (compiles it, lets tile autotuners pick outside any capture),
    then is captured, and ``do_bench`` times graph replays: it flushes the L2 before each rep and
    a replay costs a few us of host time. Timing the eager call instead would mostly time the
    ~20-60 us of Python and launch overhead of a small kernel, which is not what it costs inside
    a captured decode step.
    """
    import triton.testing

    fn()
    # Warm up on the capture stream itself, so per-stream scratch (split-K tickets) is
    # allocated and zeroed outside the capture rather than recorded as a memset inside it.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    try:
        return triton.testing.do_bench(g.replay, warmup=5, rep=rep, return_mode="median")
    finally:
        del g


def _check_fns(fns) -> list:
    if callable(fns) or not isinstance(fns, (list, tuple)):
        raise TypeError(f"expected a list of callables, got {type(fns).__name__}")
    if not fns:
        raise ValueError("expected at least one callable")
    bad = [i for i, f in enumerate(fns) if not callable(f)]
    if bad:
        raise TypeError(f"fns[{bad[0]}] is not callable")
    return list(fns)


def _check_count(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device; dry runs on the CPU use wall_time_us")


def rotation(fns: Sequence[Callable], calls: int) -> list:
    """The ``calls`` calls of a rotating graph: fns[0], fns[1], ..., fns[-1], fns[0], ..."""
    fns = _check_fns(fns)
    _check_count("calls", calls, 0)
    return [fns[i % len(fns)] for i in range(calls)]


def rotating(fns: Sequence[Callable]) -> Callable[[], None]:
    """One callable that calls fns[0], fns[1], ... in turn, one per call."""
    fns = _check_fns(fns)
    state = {"i": 0}

    def run():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return run


def calls_per_graph(est_call_ms: float, n_fns: int, target_ms: float = 15.0, cap: int = 2000) -> int:
    """Calls in one graph so that a replay lasts about ``target_ms`` (at most ``cap``, at least
    one pass), rounded up to whole passes so every callable is called equally often.

    A replay of ~15 ms makes the ~us of launch and event overhead per replay negligible per
    call; ``est_call_ms`` is a host-timed eager call, an overestimate for small kernels, which
    only makes the graph shorter."""
    _check_count("n_fns", n_fns, 1)
    if not target_ms > 0:
        raise ValueError(f"target_ms must be > 0, got {target_ms!r}")
    calls = max(n_fns, min(cap, int(target_ms / max(est_call_ms, 1e-3))))
    return int(math.ceil(calls / n_fns) * n_fns)


def per_call_us(replay_ms: Sequence[float], calls: int, stat=statistics.median_high) -> float:
    """``stat`` of the replays' times (ms per graph of ``calls`` calls), in us per call."""
    _check_count("calls", calls, 1)
    if not replay_ms:
        raise ValueError("no replay times")
    return stat([t * 1e3 / calls for t in replay_ms])


def graph_time_us(fns: Sequence[Callable], calls: int = None, replays: int = 10,
                  warmup_replays: int = 1, warmup_calls: int = 1, target_ms: float = 15.0,
                  stat=statistics.median_high) -> float:
    """GPU time per call (us) of one CUDA graph of ``calls`` calls rotating over ``fns``.

    ``calls=None``: every callable runs once eagerly (compiles, lets autotuners pick outside
    the capture), three eager passes estimate a call's time, and ``calls`` is what makes a
    replay last ``target_ms`` (:func:`calls_per_graph`). Given ``calls``, nothing runs eagerly:
    ``warmup_calls`` (rotating) on the capture stream are the whole warm-up. Either way those
    warm-up calls run on the capture stream, so per-stream scratch (split-K tickets) exists
    before the capture. Then ``warmup_replays`` untimed replays and ``replays`` replays between
    CUDA events; the result is ``stat`` of their times per call (:func:`per_call_us`). The
    default ``median_high`` is one replay's time, not an average of two.
    """
    fns = _check_fns(fns)
    if calls is not None:
        _check_count("calls", calls, 1)
        if calls % len(fns):
            raise ValueError(f"calls={calls} is not a whole number of passes over {len(fns)} callables")
    _check_count("replays", replays, 1)
    _check_count("warmup_replays", warmup_replays, 0)
    _check_count("warmup_calls", warmup_calls, 0)
    if not target_ms > 0:
        raise ValueError(f"target_ms must be > 0, got {target_ms!r}")
    _require_cuda("graph_time_us")
    if calls is None:
        for f in fns:
            f()
        torch.cuda.synchronize()
        passes = rotation(fns, 3 * len(fns))
        t0 = time.perf_counter()
        for f in passes:
            f()
        torch.cuda.synchronize()
        calls = calls_per_graph((time.perf_counter() - t0) * 1e3 / (3 * len(fns)), len(fns), target_ms)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        for f in rotation(fns, warmup_calls):
            f()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for f in rotation(fns, calls):
                f()
    torch.cuda.synchronize()
    try:
        times = replay_times_ms(g, replays, warmup_replays)
    finally:
        del g
    return per_call_us(times, calls, stat)


def replay_times_ms(graph, replays: int, warmup: int = 2) -> list:
    """GPU time (ms) of each of ``replays`` replays of a captured CUDA graph, after ``warmup``."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def do_bench_us(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median eager time (us) from ``triton.testing.do_bench`` (L2 flushed before each call).
    ``fn``: one callable, called as is, or a list of callables, called in turn."""
    if not callable(fn):
        fn = rotating(fn)
    _check_count("warmup", warmup, 0)
    _check_count("rep", rep, 1)
    _require_cuda("do_bench_us")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def step_time_s(fn: Callable, reps: int, warmup: int = 1, device="cuda") -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones: whole
    prefills and decode loops, which synchronise or launch graphs themselves. On a CUDA
    ``device`` each run sits between two CUDA events (the GPU's time from the first launch to
    the last kernel's end); elsewhere the host wall clock."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _check_count("reps", reps, 1)
    _check_count("warmup", warmup, 0)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        _require_cuda("step_time_s on a CUDA device")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall_time_us(fns: Sequence[Callable], passes: int = 2) -> float:
    """Host wall-clock time per call (us), median over ``passes`` passes over ``fns``: the
    stand-in for the GPU timers in dry runs on the CPU, where only that the code runs counts."""
    fns = _check_fns(fns)
    _check_count("passes", passes, 1)
    ts = []
    for _ in range(passes):
        t = time.perf_counter()
        for f in fns:
            f()
        ts.append((time.perf_counter() - t) * 1e6 / len(fns))
    return statistics.median(ts)
