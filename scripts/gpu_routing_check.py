"""GPU check of the engine's routing rules (wide.engine.routing_rules), before they are timed: a small
random Llama (scripts/gpu_smoke.py's) with routers at 50 %, rules tile16 (first token decides),
tile16prev (the previous tile's mean decides: decode sums kept inside the norm kernel) and
batch_shared:

* fp32 (TF32 dots in the kernels, named with ``TRITON_F32_DEFAULT``: their own default is
  tf32x3, ~fp32, since 2026-12-06): prefill logits and 16 decode steps at batch 4 against the
  masked HF path under the same rule (route_tile, wide.method.modeling.batch_shared_decode), with
  per-token routing beside them as the yardstick. The kernels' TF32 dots move a router margin by
  ~1e-3, enough to flip a decision that sits near its threshold, and one flipped decision moves
  the logits far more than rounding does (in batch-shared decode it swaps a group for the whole
  batch). So the decode checks also count the (step, layer, module, row, group) decisions on
  which the two paths differ: a logit error above the bound with no decision flipped is a bug,
  and flips far above per-token routing's count point at the rule rather than at rounding;
* bf16: CUDA-graph decode steps equal eager ones exactly, over 16 steps that cross tile starts
  (the tile rule's stored masks live in static buffers that the graph updates in place).

``--precision ieee`` runs the kernels' fp32 dots as plain fp32 FMAs (Triton's
``TRITON_F32_DEFAULT=ieee``, with a cache directory of its own so that no TF32 build is reused),
as HF's fp32 matmuls run: then no decision should flip and the fp32 checks hold to 1e-4, which
tells a TF32 flip from a bug in a rule. With the default ``tf32`` the fp32 checks fail only on an
error that no flipped decision explains (above 5e-3: TF32 keeps 10 mantissa bits, and 16 decode
steps with no flip measured 2.0e-3); the flips are reported.

Writes a JSON list of checks to the path given (default: stdout only); exit 1 on a failure.

    PYTHONPATH=src python3 scripts/gpu_routing_check.py [--precision ieee] OUT.json
"""
import argparse
import dataclasses
import json
import os
import sys
from typing import Optional

# Before Triton is imported: the default input precision of fp32 dots is read when a kernel is
# compiled, and compiled kernels are cached on disk under a key that may not include it.
_ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
_ap.add_argument("--precision", choices=("tf32", "ieee"), default="tf32")
_ap.add_argument("out", nargs="?")
ARGS = _ap.parse_args()
# Both named: the kernels' own fp32 default is tf32x3 (kernels/fp32_dot.py), which this check's
# TF32 mode is not meant to measure.
os.environ["TRITON_F32_DEFAULT"] = ARGS.precision
os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"wide_triton_{ARGS.precision}")

import torch  # noqa: E402

from wide.evaluation.evaluate import cache_kwargs  # noqa: E402
from wide.engine.inference import AcceleratedModel  # noqa: E402
from wide.method.modeling import batch_shared_decode  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_smoke import build, rel  # noqa: E402

B, P, STEPS = 4, 40, 16
TILE_RULES = {"tile16": dict(route_tile=16), "tile16prev": dict(route_tile=16, tile_source="previous")}


def hf_decode(model, ids, shared: bool, masks: Optional[list] = None):
    """Logits [B, STEPS, V] of the masked HF path decoding ids[:, P:P+STEPS] on its KV cache;
    ``masks`` gets each step's {(layer, kind): bool [B, groups]}."""
    outs = []
    state = model.wide_state
    with torch.no_grad(), (batch_shared_decode(model) if shared else torch.no_grad()):
        out = model(input_ids=ids[:, :P], use_cache=True)
        for t in range(P, P + STEPS):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(model, out))
            outs.append(out.logits[:, -1].float())
            if masks is not None:
                masks.append({k: v.reshape(B, -1) > 0.5 for k, v in state.masks.items() if k[1] in ("attn", "ffn")})
    return torch.stack(outs, 1)


def engine_decode(eng, ids, eager: bool, masks: Optional[list] = None):
    """The engine's logits [B, STEPS, V]; with ``eager`` each step runs without the graph and
    ``masks`` gets its {(layer, kind): bool [B, groups]}."""
    eng.setup_cache(B, 128)
    eng.prefill(ids[:, :P])
    outs = []
    for t in range(P, P + STEPS):
        pos = torch.full((B,), t, dtype=torch.long, device="cuda")
        record = [] if eager else None
        outs.append(eng.decode(ids[:, t], pos, record=record).float().clone())
        if masks is not None:
            # copies: the tile rule hands out the same buffer at every step
            masks.append({(i, k): m.reshape(B, -1).to(torch.bool, copy=True) for i, k, m in record if m is not None})
    eng.free_cache()
    return torch.stack(outs, 1)


def flipped(a: list, b: list) -> tuple:
    """(decisions that differ, decisions compared) between two runs' per-step masks."""
    diff = total = 0
    for sa, sb in zip(a, b):
        for k in sa.keys() & sb.keys():
            diff += int((sa[k] != sb[k]).sum())
            total += sa[k].numel()
    return diff, total


def fp32_ok(err: float, flips: Optional[int] = None) -> bool:
    """ieee dots: no flip and rounding-level error; TF32 dots (decode, where flips are counted):
    any error a flip explains, else at most what TF32 rounding gave without one."""
    if ARGS.precision == "ieee":
        return err < 1e-4 and not flips
    return err < 5e-3 or bool(flips)


def dots_are_ieee() -> dict:
    """Whether the kernels' fp32 dots run in fp32: a 64-row gemm_k (its tl.dot path) against
    PyTorch's fp32 matmul. TF32 rounds the inputs to 10 mantissa bits (~1e-4 relative error
    here), fp32 FMAs leave ~1e-7; so the ieee checks below only mean something if this holds."""
    from wide.kernels import gemm_k

    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(64, 512, device="cuda", generator=gen)
    w = torch.randn(256, 512, device="cuda", generator=gen)
    err = rel(gemm_k(x, w, torch.ones(64, 4, dtype=torch.bool, device="cuda"), 128), x @ w.T)
    return {"rule": "-", "check": "the kernels' fp32 dots run in fp32 (TRITON_F32_DEFAULT=ieee)",
            "rel_err": err, "ok": err < 1e-5}


def main() -> int:
    checks = [dots_are_ieee()] if ARGS.precision == "ieee" else []
    if checks:
        print(checks[-1], flush=True)
    dots = "fp32 dots" if ARGS.precision == "ieee" else "TF32 dots"
    # bf16 dots ignore the fp32 precision: the bf16 checks run in the default mode only
    for dtype in (torch.bfloat16, torch.float32) if ARGS.precision == "tf32" else (torch.float32,):
        model, ids = build("llama", dtype)
        ids = torch.randint(0, 512, (B, P + STEPS), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        base = model.wide_state.config
        rules = ("tile16", "tile16prev", "batch_shared")
        for rule in ("token",) + rules if dtype == torch.float32 else rules:
            shared = rule == "batch_shared"
            model.wide_state.config = dataclasses.replace(base, **TILE_RULES.get(rule, {}))
            eng = AcceleratedModel(model, batch_shared=shared)
            if dtype == torch.float32:
                with torch.no_grad():
                    ref = model(input_ids=ids).logits.float()
                err = rel(eng.logits(ids), ref)
                checks.append({"rule": rule, "check": f"prefill logits vs masked HF path (fp32, {dots})",
                               # TF32: prefill flips are not counted, so no verdict there
                               "rel_err": err, "ok": fp32_ok(err) if ARGS.precision == "ieee" else None})
                mine, theirs = [], []
                err = rel(engine_decode(eng, ids, eager=True, masks=mine), hf_decode(model, ids, shared, theirs))
                diff, total = flipped(mine, theirs)
                checks.append({"rule": rule, "check": f"{STEPS} eager decode steps at batch {B} vs masked HF path "
                                                      f"(fp32, {dots})", "rel_err": err,
                               "decisions_flipped": diff, "decisions": total, "ok": fp32_ok(err, diff)})
                err = rel(engine_decode(eng, ids, eager=False), engine_decode(eng, ids, eager=True))
                checks.append({"rule": rule, "check": f"{STEPS} CUDA-graph decode steps = eager (fp32, batch {B})",
                               "rel_err": err, "ok": err == 0.0})
                print(checks[-3:], flush=True)
            else:
                err = rel(engine_decode(eng, ids, eager=False), engine_decode(eng, ids, eager=True))
                checks.append({"rule": rule, "check": f"{STEPS} CUDA-graph decode steps = eager (bf16, batch {B})",
                               "rel_err": err, "ok": err == 0.0})
                print(checks[-1], flush=True)
            if ARGS.out:
                with open(ARGS.out, "w") as f:
                    json.dump([{**c, "precision": ARGS.precision} for c in checks], f, indent=1)
        model.wide_state.config = base
    return 0 if all(c["ok"] is not False for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
