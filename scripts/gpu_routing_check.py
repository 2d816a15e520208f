"""GPU check of the engine's routing rules (wide.routing_rules), before they are timed: a small
random Llama (scripts/gpu_smoke.py's) with routers at 50 %, rules tile16 and batch_shared:

* fp32 (TF32 dots in the kernels): prefill logits and 16 decode steps at batch 4 against the
  masked HF path under the same rule (route_tile, wide.modeling.batch_shared_decode);
* bf16: CUDA-graph decode steps equal eager ones exactly, over 16 steps that cross tile starts
  (the tile rule's stored masks live in static buffers that the graph updates in place).

Writes a JSON list of checks to the path given (default: stdout only); exit 1 on a failure.

    PYTHONPATH=src python3 scripts/gpu_routing_check.py OUT.json
"""
import dataclasses
import json
import sys

import torch

from wide.evaluate import cache_kwargs
from wide.inference import AcceleratedModel
from wide.modeling import batch_shared_decode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_smoke import build, rel  # noqa: E402

B, P, STEPS = 4, 40, 16


def hf_decode(model, ids, shared: bool):
    """Logits [B, STEPS, V] of the masked HF path decoding ids[:, P:P+STEPS] on its KV cache."""
    outs = []
    with torch.no_grad(), (batch_shared_decode(model) if shared else torch.no_grad()):
        out = model(input_ids=ids[:, :P], use_cache=True)
        for t in range(P, P + STEPS):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(model, out))
            outs.append(out.logits[:, -1].float())
    return torch.stack(outs, 1)


def engine_decode(eng, ids, eager: bool):
    eng.setup_cache(B, 128)
    eng.prefill(ids[:, :P])
    outs = []
    for t in range(P, P + STEPS):
        pos = torch.full((B,), t, dtype=torch.long, device="cuda")
        outs.append(eng.decode(ids[:, t], pos, record=[] if eager else None).float().clone())
    eng.free_cache()
    return torch.stack(outs, 1)


def main() -> int:
    checks = []
    for dtype in (torch.bfloat16, torch.float32):
        model, ids = build("llama", dtype)
        ids = torch.randint(0, 512, (B, P + STEPS), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        base = model.wide_state.config
        for rule in ("tile16", "batch_shared"):
            shared = rule == "batch_shared"
            model.wide_state.config = base if shared else dataclasses.replace(base, route_tile=16)
            eng = AcceleratedModel(model, batch_shared=shared)
            if dtype == torch.float32:
                with torch.no_grad():
                    ref = model(input_ids=ids).logits.float()
                err = rel(eng.logits(ids), ref)
                checks.append({"rule": rule, "check": "prefill logits vs masked HF path (fp32, TF32 dots)",
                               "rel_err": err, "ok": err < 2e-3})
                err = rel(engine_decode(eng, ids, eager=False), hf_decode(model, ids, shared))
                checks.append({"rule": rule, "check": f"{STEPS} CUDA-graph decode steps at batch {B} vs masked HF path "
                                                      "(fp32, TF32 dots)", "rel_err": err, "ok": err < 2e-3})
            else:
                err = rel(engine_decode(eng, ids, eager=False), engine_decode(eng, ids, eager=True))
                checks.append({"rule": rule, "check": f"{STEPS} CUDA-graph decode steps = eager (bf16, batch {B})",
                               "rel_err": err, "ok": err == 0.0})
            print(checks[-2:] if dtype == torch.float32 else checks[-1], flush=True)
            if len(sys.argv) > 1:
                with open(sys.argv[1], "w") as f:
                    json.dump(checks, f, indent=1)
        model.wide_state.config = base
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
