"""wide.base.timing without a GPU: the wall-clock and CPU step timers (on a fake clock), the rotation
of callables, the graph timer's call count and median, and the argument checks the GPU timers
make before they touch CUDA."""
import statistics

import pytest
import torch

from wide.base import timing

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


class FakeClock:
    """time.perf_counter stand-in: callables advance it by what they 'cost'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def cost(self, seconds, log=None, name=None):
        def f():
            self.now += seconds() if callable(seconds) else seconds
            if log is not None:
                log.append(name)
        return f


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", c)
    return c


def test_rotation_wraps_around_the_callables():
    a, b, c = (lambda: None), (lambda: None), (lambda: None)
    assert timing.rotation([a, b, c], 7) == [a, b, c, a, b, c, a]
    assert timing.rotation([a], 0) == []


def test_rotating_callable_calls_each_in_turn():
    log = []
    run = timing.rotating([lambda i=i: log.append(i) for i in range(3)])
    for _ in range(5):
        run()
    assert log == [0, 1, 2, 0, 1]


def test_calls_per_graph_fills_the_target_in_whole_passes():
    assert timing.calls_per_graph(0.01, 3) == 1500  # 15 ms / 10 us, already whole passes
    assert timing.calls_per_graph(0.011, 4) == 1364  # int(1363.6) = 1363, up to 341 passes
    assert timing.calls_per_graph(1e-6, 3) == 2001  # capped at 2000, then up to a whole pass
    assert timing.calls_per_graph(50.0, 8) == 8  # a call longer than the target: one pass
    assert timing.calls_per_graph(0.1, 1, target_ms=5.0) == 50


def test_per_call_us_takes_one_replay_not_an_average_of_two():
    replay_ms = [4.0, 1.0, 3.0, 2.0]  # four replays of a graph of 1000 calls
    assert timing.per_call_us(replay_ms, 1000) == 3.0  # median_high: the replay of 3 ms
    assert timing.per_call_us(replay_ms, 1000, stat=statistics.median) == 2.5
    assert timing.per_call_us([5.0, 1.0, 9.0], 10) == 500.0


def test_wall_time_is_the_median_pass_per_call(clock):
    log = []
    costs = iter([10.0, 1.0, 2.0])  # the first call is slow (compilation, say)
    fns = [clock.cost(lambda: next(costs), log, "slow"), clock.cost(0.0, log, "free")]
    # passes cost 10 s, 1 s and 2 s for two calls each: 5, 0.5, 1 s per call
    assert timing.wall_time_us(fns, passes=3) == pytest.approx(1e6)
    assert log == ["slow", "free"] * 3


def test_step_time_on_the_cpu_skips_the_warm_up_and_takes_the_median(clock):
    costs = iter([100.0, 100.0, 3.0, 1.0, 2.0])
    calls = []
    fn = clock.cost(lambda: next(costs), calls, "step")
    assert timing.step_time_s(fn, reps=3, warmup=2, device="cpu") == 2.0
    assert len(calls) == 5


@pytest.mark.parametrize("fns, kw, err, match", [
    ([], {}, ValueError, "at least one"),
    (lambda: None, {}, TypeError, "list of callables"),
    ([lambda: None, 3], {}, TypeError, r"fns\[1\]"),
    ([lambda: None] * 3, {"calls": 4}, ValueError, "whole number of passes"),
    ([lambda: None], {"calls": 0}, ValueError, "calls"),
    ([lambda: None], {"replays": 0}, ValueError, "replays"),
    ([lambda: None], {"warmup_replays": -1}, ValueError, "warmup_replays"),
    ([lambda: None], {"warmup_calls": 1.5}, ValueError, "warmup_calls"),
    ([lambda: None], {"target_ms": 0}, ValueError, "target_ms"),
])
def test_graph_timer_checks_its_arguments_first(fns, kw, err, match):
    called = []
    if isinstance(fns, list):
        fns = [(lambda f=f: called.append(1) or f()) if callable(f) else f for f in fns]
    with pytest.raises(err, match=match):
        timing.graph_time_us(fns, **kw)
    assert not called  # refused before any warm-up


@needs_no_cuda
def test_gpu_timers_refuse_without_cuda_before_calling_anything():
    called = []
    fns = [lambda: called.append(1)] * 2
    with pytest.raises(RuntimeError, match="wall_time_us"):
        timing.graph_time_us(fns, calls=4)
    with pytest.raises(RuntimeError, match="CUDA"):
        timing.do_bench_us(fns)
    with pytest.raises(RuntimeError, match="CUDA"):
        timing.step_time_s(fns[0], reps=1, device="cuda")
    assert not called


def test_cpu_timers_check_their_arguments():
    with pytest.raises(ValueError, match="passes"):
        timing.wall_time_us([lambda: None], passes=0)
    with pytest.raises(ValueError, match="reps"):
        timing.step_time_s(lambda: None, reps=0, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        timing.step_time_s([lambda: None], reps=1, device="cpu")
    with pytest.raises(ValueError, match="rep"):
        timing.do_bench_us(lambda: None, rep=0)


class FakeCuda:
    """Just enough of torch.cuda for graph_time_us on the CPU: callables log where they ran
    (eagerly, on the side stream, or into the graph being captured), a replay runs the captured
    calls on a fake GPU clock that events read."""

    def __init__(self, replay_ms):
        self.log, self.captured, self.replays = [], None, 0
        self.replay_ms = iter(replay_ms)
        self.gpu_ms = 0.0
        self.on_side_stream = False
        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                fake.replays += 1
                fake.gpu_ms += next(fake.replay_ms)

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                self.t = fake.gpu_ms

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        class Ctx:
            def __init__(self, enter, leave):
                self.enter, self.leave = enter, leave

            def __enter__(self):
                self.enter()

            def __exit__(self, *exc):
                self.leave()

        def side(on):
            fake.on_side_stream = on

        def capture(g, stream=None):
            assert stream is not None, "capture on the warm-up stream"
            return Ctx(lambda: setattr(fake, "captured", []), lambda: None)

        self.attrs = dict(is_available=lambda: True, synchronize=lambda: None, Stream=Stream,
                          current_stream=lambda: Stream(), CUDAGraph=Graph, Event=Event,
                          stream=lambda s: Ctx(lambda: side(True), lambda: side(False)), graph=capture)

    def fn(self, name):
        def f():
            if self.captured is not None and self.on_side_stream:
                self.captured.append(name)
            else:
                self.log.append((name, "side" if self.on_side_stream else "eager"))
        return f


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(replay_ms):
        fake = FakeCuda(replay_ms)
        for k, v in fake.attrs.items():
            monkeypatch.setattr(timing.torch.cuda, k, v)
        return fake
    return make


def test_graph_timer_given_calls_warms_on_the_side_stream_captures_and_replays(fake_cuda):
    # the attention benchmark's settings: one pass per graph, two warm-up passes, mean median
    fake = fake_cuda([9.0, 9.0, 9.0, 2.0, 4.0, 1.0, 3.0])
    us = timing.graph_time_us([fake.fn("a"), fake.fn("b")], calls=2, replays=4, warmup_replays=3,
                              warmup_calls=4, stat=statistics.median)
    assert fake.log == [("a", "side"), ("b", "side")] * 2  # nothing eager
    assert fake.captured == ["a", "b"]
    assert fake.replays == 7
    assert us == pytest.approx(2.5e3 / 2)  # median of 2, 4, 1, 3 ms over 2 calls per graph


def test_graph_timer_sizes_the_graph_from_an_eager_estimate(fake_cuda, clock):
    # the kernel benchmark's settings (the defaults): each callable once, three eager passes
    # timed on the host, one warm-up call on the side stream, a graph of ~15 ms
    fake = fake_cuda([0.0] + [float(t) for t in range(1, 11)])
    fns = []
    for name in "abc":
        f = fake.fn(name)
        fns.append(lambda f=f: (f(), setattr(clock, "now", clock.now + 1e-5)))  # 10 us a call
    us = timing.graph_time_us(fns)
    assert fake.log == [(n, "eager") for n in "abc" * 4] + [("a", "side")]
    assert fake.captured == list("abc" * 500)  # 15 ms / 10 us = 1500 calls
    assert fake.replays == 11
    assert us == pytest.approx(6.0e3 / 1500)  # median_high of 1..10 ms: 6 ms, per call
