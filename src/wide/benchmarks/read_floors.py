"""Plain-read floors: the GPU time of reading 16.8 / 33.5 / 58.7 MB, the bytes the batch-1 o,
q+k/v and down GEMVs of Llama-3.1-8B read at 50 % (``wide.kernels.plain_read``, a few chunk
sizes and warp counts each). A routed GEMV that must read those bytes cannot beat them;
``wide.benchmarks.bounds`` turns them into the TPOT bound.

    python -m wide.benchmarks.read_floors --out bench/results      # read_floors.{json,md}
    python -m wide.benchmarks.read_floors --dry-run --out /tmp/rf    # CPU smoke run

Timing as in the kernel benchmark (``wide.base.timing.graph_time_us``): one CUDA graph of
back-to-back reads rotating over 8 copies of the buffer, so L2 never holds the next read's
bytes. Every read is first checked against a float32 sum of the same chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from wide.base.timing import graph_time_us, wall_time_us

SIZES_MB = (16.8, 33.5, 58.7)
CHUNKS = (16384, 32768, 65536)
WARPS = (4, 8)
COPIES = 8
BLOCK = 2048


def recorder(rows: list, widths=(8, 10, 14)):
    """``record(shape, impl, cfg, us, rel_err, nbytes)``: appends a row of this file's schema
    (the one ``bounds`` reads) to ``rows`` and prints it in columns of ``widths``."""
    ws, wi, wc = widths

    def record(shape, impl, cfg, us, err, nbytes):
        r = dict(shape=shape, impl=impl, cfg=cfg, us=round(us, 2), rel_err=err,
                 tbps=round(nbytes / us / 1e6, 3))
        rows.append(r)
        print(f"{shape:{ws}s} {impl:{wi}s} {cfg:{wc}s} {us:8.2f} us {r['tbps']:5.2f} TB/s err {err:.1e}",
              flush=True)
    return record


def measure(record, device, timer=graph_time_us, sizes_mb=SIZES_MB, chunks=CHUNKS, warps=WARPS,
            copies=COPIES, block=BLOCK) -> None:
    """``record(shape, impl, cfg, us, rel_err, nbytes)`` for every (size, chunk, warps)."""
    from wide.kernels.plain_read import plain_read

    for mb in sizes_mb:
        n = int(mb * 1e6 / 2) // 8192 * 8192
        bufs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        for ch in chunks:
            out = torch.empty(n // ch, device=device, dtype=torch.float32)
            ref = bufs[0][: n // ch * ch].float().view(-1, ch).sum(1)
            for nw in warps:
                plain_read(bufs[0], out, ch, block, nw)
                err = ((out - ref).norm() / ref.norm().clamp_min(1e-20)).item()
                calls = [lambda i=i, ch=ch, nw=nw: plain_read(bufs[i], out, ch, block, nw)
                         for i in range(copies)]
                record(f"read{mb}", "read_floor", f"CH={ch} w={nw}", timer(calls), err, n * 2)
        del bufs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for read_floors.json/.md")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run (Triton interpreter, tiny buffers, wall-clock times)")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, timer = torch.device("cpu"), wall_time_us
        sizes = dict(sizes_mb=(0.0328,), chunks=(4096, 8192), warps=(4,), copies=2, block=1024)
    elif torch.cuda.is_available():
        device, timer, sizes = torch.device("cuda"), graph_time_us, {}
    else:
        print("needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    rows = []
    measure(recorder(rows), device, timer, **sizes)
    bad = [r for r in rows if not r["rel_err"] < 1e-3]
    env = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
               torch=torch.__version__, triton=triton.__version__,
               command="python -m wide.benchmarks.read_floors " + " ".join(
                   sys.argv[1:] if argv is None else argv))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_floors.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# Plain-read floors ({env['gpu']})", "",
             f"torch {env['torch']}, triton {env['triton']}. Command: `{env['command']}`", "",
             "Per-read time of back-to-back reads in one CUDA graph over 8 copies of the buffer.", "",
             "| bytes | cfg | us | TB/s | rel err |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['cfg']} | {r['us']} | {r['tbps']} | {r['rel_err']:.1e} |" for r in rows]
    (out / "read_floors.md").write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
