"""What the kernels and the engine read from the process once: the Triton interpreter switch,
whether to autotune, the SM count. No Triton import here, so the attention module's fp32
references still import on installs without Triton."""
from __future__ import annotations

import os

import torch

__all__ = ["interpret_mode", "autotune_enabled", "num_sms"]


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    return os.environ.get("WIDE_AUTOTUNE", "1") != "0" and not interpret_mode()


_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. Off CUDA (the interpreter) 8: grids sized
    from it stay small, and the interpreter pays per program."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
