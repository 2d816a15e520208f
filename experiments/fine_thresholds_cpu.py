"""CPU trial: per-element input thresholds on SmolLM2-135M, training-free (TEAL, WINA, uniform
allocation) and learned in stage 1 (with and without per-channel scales, with and without
routers), on the same 48 held-out windows of 256 tokens (every 4th window of the wiki held-out
split).

    python experiments/fine_thresholds_cpu.py free --criterion magnitude      # TEAL at 25/40/50/60 %
    python experiments/fine_thresholds_cpu.py free --criterion wina
    python experiments/fine_thresholds_cpu.py learn --name L2 --per-channel --lr 2e-3 --lr-scale 5
    python experiments/fine_thresholds_cpu.py learn --name H2 --routers all --lr 2e-3 --lr-scale 5
    python experiments/fine_thresholds_cpu.py drop       # what 1.8 % random group drops cost
    python experiments/fine_thresholds_cpu.py learn --name K25 --target 0.25 --per-channel --loss kd --gen 48

Thresholds of the learned runs start at TEAL's uniform 50 % (quantiles of the dense model's
|x| on 32 calibration sequences); `learn` trains them (and the routers) for --steps steps of
--bs x 256 tokens under one linear-MAC budget (WideConfig loss_mode "linear"). Results:
experiments/results/fine_thresholds_cpu/README.md.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import wide  # noqa: E402
from wide.method import fine, geometry, modeling, sparsity  # noqa: E402
from wide.data import fetch_default_model, load_documents, pack_documents  # noqa: E402
from wide.evaluation.evaluate import perplexity  # noqa: E402
from wide.training.train import TrainArgs, train  # noqa: E402


def setup(threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    path = fetch_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    cal = pack_documents(load_documents("wiki", split="train"), tok, 256)
    held = pack_documents(load_documents("wiki", split="heldout"), tok, 256)
    windows = held[:: max(1, held.shape[0] // 48)][:48]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, cal, windows


def free(a) -> dict:
    model, cal, H = setup(a.threads)
    out = {"dense": perplexity(model, H, batch_size=8, progress=False)["ppl"]}
    modeling.wrap(model, wide.WideConfig(sparse_target="none"))
    fine.attach(model, fine.FineConfig(criterion=a.criterion))
    scores = fine.collect_scores(model, cal[:32].split(8))
    for s in (0.25, 0.4, 0.5, 0.6):
        fine.set_thresholds(model, scores, fine.uniform_sparsity(model.wide_state.geometry.dims, s))
        r = perplexity(model, H, batch_size=8, progress=False)
        out[str(s)] = {"ppl": r["ppl"], "linear_sparsity": r["sparsity"]["linear_rate"]}
        print(a.criterion, s, out[str(s)], flush=True)
    return out


def learn(a) -> dict:
    model, cal, H = setup(a.threads)
    cfg = wide.WideConfig(sparse_target=a.routers, target_sparsity=a.target, loss_mode="linear")
    modeling.wrap(model, cfg, seed=0)
    fn = fine.attach(model, fine.FineConfig(criterion=a.criterion, allocation="learned", per_channel=a.per_channel,
                                            target=a.target, lr_scale=a.lr_scale))
    fine.calibrate(model, cal[:32].split(8))
    modeling.freeze_backbone(model)
    start = perplexity(model, H, batch_size=8, progress=False)
    gen = {}
    if a.gen:  # free text against the dense model (wide.evaluation.evaluate.generation_quality), one prompt per window
        from transformers import AutoModelForCausalLM

        from wide.evaluation.evaluate import generation_quality
        ref = AutoModelForCausalLM.from_pretrained(fetch_default_model(), dtype=torch.float32).eval()
        n = min(a.gen, H.shape[0])
        gen["start_gen"] = generation_quality(model, ref, H, prompts=n, progress=False)
    t0 = time.time()
    train(model, cal[64:], TrainArgs(steps=a.steps, batch_size=a.bs, lr=a.lr, sparsity_warmup=0.0, save_every=0,
                                     eval_every=0, loss=a.loss), f"runs/fine_thresholds_cpu/{a.name}", progress=True)
    train_s = time.time() - t0
    model.eval()
    r = perplexity(model, H, batch_size=8, progress=False)
    if a.gen:
        gen["gen"] = generation_quality(model, ref, H, prompts=n, progress=False)
    th = fn.log_threshold.detach()
    return {"start_ppl": start["ppl"], "start_linear": start["sparsity"]["linear_rate"], "ppl": r["ppl"],
            "linear_sparsity": r["sparsity"]["linear_rate"], "flop_sparsity": r["flop_sparsity"],
            "per_projection": r["sparsity"]["linear"], "train_s": train_s,
            "mean_log_threshold": {p: float(th[:, j].mean()) for j, p in enumerate(geometry.PROJECTIONS)}, **gen}


def drop(a) -> dict:
    """The cost of routers that drop groups at random, as a hard Gumbel sample of routers started
    dense does (sigmoid(4): 1.8 % of the groups per token): cross-entropy of 4 calibration windows
    in train mode with and without routers, TEAL thresholds at 50 % on and off."""
    model, cal, _ = setup(a.threads)
    x = cal[100:104]
    out = {}
    for routers in ("none", "all"):
        modeling.unwrap(model)
        modeling.wrap(model, wide.WideConfig(sparse_target=routers, target_sparsity=0.5, loss_mode="linear"), seed=0)
        fn = fine.attach(model, fine.FineConfig(allocation="learned", target=0.5))
        fine.calibrate(model, cal[:8].split(4))
        modeling.freeze_backbone(model)
        model.train()
        model.wide_state.tau = 5.0
        torch.manual_seed(0)
        with torch.no_grad():
            for on in (True, False):
                fn.enabled = on
                ce = float(model(input_ids=x, labels=x).loss)
                out[f"routers_{routers}_thresholds_{'on' if on else 'off'}"] = {
                    "ce": ce, "group_sparsity": float(sparsity.forward_sparsity(model).group_rate)}
        model.wide_state.tau = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["free", "learn", "drop"])
    ap.add_argument("--name", default="run")
    ap.add_argument("--criterion", default="magnitude", choices=fine.CRITERIA)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--routers", default="none", choices=["none", "all"])
    ap.add_argument("--per-channel", action="store_true")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-scale", type=float, default=5.0)
    ap.add_argument("--loss", default="ce")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=0, help="learn: free-text quality on this many held-out prompts "
                    "(32 + 32 tokens; at most the 48 windows) before and after training")
    a = ap.parse_args()
    res = {"args": vars(a), **{"free": free, "learn": learn, "drop": drop}[a.what](a)}
    print(json.dumps(res, indent=1))
    out = Path("experiments/results/fine_thresholds_cpu")
    out.mkdir(parents=True, exist_ok=True)
    name = {"learn": a.name, "free": a.criterion, "drop": "gumbel"}[a.what]
    (out / f"{a.what}_{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
