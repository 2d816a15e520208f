"""Programmatic dependent launch (Hopper and later), for the launches of a decode step.

A CUDA-graph decode step at batch 1 is ~9 launches per layer of a few microseconds each, and each
pays the ramp-up of its first programs after the previous launch's last one retired
(bench/results/h100/bounds.md: ~2 us a launch). Launched with ``launch_pdl``, a kernel may start
while the one before it drains: its programs wait (``griddepcontrol.wait``) before touching
memory, so every read and write still sees the previous kernel's, and the previous kernel lets
them in once its own loads are issued (``griddepcontrol.launch_dependents``). A kernel launched
this way that did not wait would race, so only kernels that call :func:`wait` first take
:func:`launch_kwargs` (the fine GEMV, norm_route, RoPE and decode attention launches); kernels
launched the ordinary way (cuBLAS, PyTorch's) keep full order.

On by default where it can run: CUDA devices of compute capability 9 or more, outside the
interpreter, with a Triton that has the instructions; ``WIDE_PDL=0`` turns it off. Measured on an
H100 (bench/results/h100/e2e_fine_pdl{0,1}.md, one call, each against the dense engine in its own
process): fine decode TPOT at batch 1 from 4.17 to 3.96 ms (4k; 1.53x -> 1.61x the dense engine),
16k 4.78 -> 4.57 ms, batch 2 -0.8 to -1.1 %; the fine and hybrid graph/eager and PyTorch-path
checks of scripts/gpu_smoke.py held with it on (Llama).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .env import interpret_mode

__all__ = ["enabled", "launch_kwargs", "wait", "release"]

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra import cuda as _cuda

    # the instructions, and the launch option that lets a kernel start early
    _HAS_GDC = (hasattr(_cuda, "gdc_wait") and hasattr(_cuda, "gdc_launch_dependents")
                and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))
except ImportError:  # (a Triton without the NVIDIA backend or the CUDA extras)
    _HAS_GDC = False

_CAPABILITY: dict = {}


def enabled(device: torch.device) -> bool:
    if os.environ.get("WIDE_PDL", "1") == "0" or interpret_mode() or device.type != "cuda" or not _HAS_GDC:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)[0]
    return _CAPABILITY[idx] >= 9


def launch_kwargs(device: torch.device) -> dict:
    """The launch's extra arguments: the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``
    option together (one without the other either races or gains nothing), or none."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """First in a kernel that may be launched early: wait until the previous kernel's memory
    operations are done and visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait in :func:`wait` for this one to end)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
