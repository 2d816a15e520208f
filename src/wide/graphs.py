"""CUDA-graph capture for the engine's steps (decode per batch size, short prefills per length
bucket): what every capture must do before and around ``torch.cuda.graph``."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["GraphCapture"]


class GraphCapture:
    """Captures steps on one stream of ``device``. All captures share that stream: the caching
    allocator reuses a freed block only on the stream that allocated it, so graphs sharing a
    memory pool (the engine's prefill graphs) must be captured on one stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None

    def __call__(self, step: Callable[[], torch.Tensor], pool=None):
        """(CUDA graph of ``step()``, its output buffer). ``step`` reads only static buffers."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            from .kernels.routing import fresh_split_tickets
        except ImportError:  # no Triton: the torch backend has no split-K counters
            pass
        else:
            fresh_split_tickets(self.device, stream)  # this graph's own split-K counters
        # Warm-up on the capture stream: autotuning, compilation, the measured kernel choices
        # and per-stream scratch buffers must exist before capture. A decode step writes k/v
        # at the current positions, which the replay then overwrites.
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            out = step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph, out
