"""A plain read of a buffer, each byte once: not a routed op, the floor against which the routed
GEMVs are judged (a kernel that must read N bytes cannot beat a read of N bytes; ramp-up and
drain included). Timed by ``wide.benchmarks.read_floors``; ``wide.benchmarks.bounds`` turns
those times into the TPOT bound."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(w_ptr, out_ptr, CH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = w_ptr + pid.to(tl.int64) * CH
    for i in range(0, CH, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    # the sum is stored so the compiler cannot drop the loads
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def plain_read(w: torch.Tensor, out: torch.Tensor, chunk: int, block: int = 2048,
               num_warps: int = 4) -> torch.Tensor:
    """``out[i] = sum(w[i * chunk:(i + 1) * chunk])`` in fp32: one program per whole ``chunk``
    of the 1-D contiguous ``w`` (a remainder shorter than a chunk is not read), each reading
    ``block`` elements per step."""
    if w.dim() != 1 or not w.is_contiguous():
        raise ValueError("w must be a contiguous 1-D tensor")
    if block <= 0 or chunk <= 0 or chunk % block:
        raise ValueError(f"chunk={chunk} must be a positive multiple of block={block}")
    n = w.numel() // chunk
    if out.dtype != torch.float32 or out.numel() != n or out.device != w.device:
        raise ValueError(f"out must be {n} float32 elements on {w.device}")
    _read_kernel[(n,)](w, out, CH=chunk, BLOCK=block, num_warps=num_warps)
    return out
