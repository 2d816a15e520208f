# trial 6 diagnostic: PYTHONPATH=src python experiments/results/head_routers_query_cpu/input_scale.py ROUTERS_DIR (from the repository root)
# RMS per element of what the routers read, layers 1-29, first 4 held-out windows (trial 6's set)
import sys, torch
sys.path.insert(0, "experiments")  # run from the repository root
import head_routers_fine_cpu as t
from wide.base import arch
from wide.commands import runs
from wide.training.recovery import load_recovered
mine, args = t.parse(["--skip-one", "--input-choice", "--mask-stats", sys.argv[1], "--eval-sequences", "4",
                      "--threads", "1", "--device", "cpu"])
torch.set_num_threads(1)
tok, _ = runs.load_tokenizer(args); args.exact_bpb, args.max_eval_sequences = False, 4
ids, _ = runs.heldout(args, tok)
model, tok, _ = runs.load_model(args, tok)
model = load_recovered(model, sys.argv[1])
t.install_skip_one(model, [0], True, query=True)
spec, res, q = arch.spec_for(model), {}, {}
for i, layer in enumerate(arch.decoder_layers(model)):
    if i == 0: continue
    arch.module_norm(layer, spec, "attn").register_forward_pre_hook(lambda m, a, i=i: res.__setitem__(i, a[0].float()))
    arch.projection(layer, spec, "q").register_forward_hook(lambda m, a, o, i=i: q.__setitem__(i, o.float()))
with torch.no_grad():
    model(input_ids=ids[:4])
for name, d in (("residual", res), ("query", q)):
    rms = [d[i].pow(2).mean().sqrt().item() for i in sorted(d)]  # over all tokens and elements
    tok = [d[i].pow(2).mean(-1).sqrt().median().item() for i in sorted(d)]  # median token's RMS
    print(f"{name:8s} RMS over all, layers 1..29:      " + " ".join(f"{v:.2f}" for v in rms))
    print(f"{name:8s} median token's RMS, layers 1..29: " + " ".join(f"{v:.2f}" for v in tok))
