"""The one timing module: every GPU time wide reports or acts on comes from here.

The engine's measured choices (routed kernel or cuBLAS, decode-attention splits) and every
benchmark use these functions, so a number in a results file and a choice the engine made
were timed the same way.
"""

from __future__ import annotations

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
