"""CUDA-graph capture for the engine's steps (decode per batch size, short prefills per length
bucket): what every capture must do before and around ``torch.cuda.graph``."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["GraphCapture", "warm_up"]


def warm_up(step: Callable[[], torch.Tensor], keep: Sequence[torch.Tensor] = (), runs: int = 2):
    """Run ``step`` ``runs`` times, then put the ``keep`` buffers back as they were (see
    :class:`GraphCapture`); returns the last run's output."""
    saved = [t.clone() for t in keep]
    out = None
    for _ in range(runs):
        out = step()
    for t, v in zip(keep, saved):
        t.copy_(v)
    return out


class GraphCapture:
    """Captures steps on one stream of ``device``. All captures share that stream: the caching
    allocator reuses a freed block only on the stream that allocated it, so graphs sharing a
    memory pool (the engine's prefill graphs) must be captured on one stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None

    def __call__(self, step: Callable[[], torch.Tensor], pool=None, keep: Sequence[torch.Tensor] = ()):
        """(CUDA graph of ``step()``, its output buffer). ``step`` reads only static buffers.
        ``keep``: buffers the step updates from their own values (running sums), which the
        warm-up's extra runs would otherwise advance; they are put back before the capture, so
        the first replay finds them as the caller left them. Every other buffer a step writes
        must come out the same when the step runs again (k/v at a position, a stored mask)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            from ..kernels.routing import fresh_split_tickets
        except ImportError:  # no Triton: the torch backend has no split-K counters
            pass
        else:
            fresh_split_tickets(self.device, stream)  # this graph's own split-K counters
        # Warm-up on the capture stream: autotuning, compilation, the measured kernel choices
        # and per-stream scratch buffers must exist before capture. A decode step writes k/v
        # at the current positions, which the replay then overwrites.
        with torch.cuda.stream(stream):
            warm_up(step, keep)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            out = step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, out
