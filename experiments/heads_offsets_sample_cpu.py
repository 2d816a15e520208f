"""Issue 48: is the shipped head-router set's attention-core shortfall on held-out text a small
offset sample? ``smollm2-135m-heads25-fine-50``'s per-layer offsets were set to a 25 % group rate
(the share of (token, group) decisions that skip) on 8 batches of 4 calibration sequences (32 x 256
tokens); it ran 0.249 attention core (QK^T and PV, weighted by context) on the first 24 held-out
windows and 0.236 on every window. This measures the set's rate on the first 32, 128 and
N calibration sequences and on every held-out window, re-sets the offsets (the set's own
``to_library`` record: target, per-module mode) on N sequences, measures both again and saves that
set to ``--out``/routers for ``wide eval --routers``. Held-out text is only measured, never fitted.
``--target T`` sets the offsets to group rate T instead of the record's (e.g. 0.26, the rate the routers
were trained at); ``--after-only`` skips the measurements before the re-set and on held-out text
(``wide eval`` of the saved set measures that). ``--from DIR`` starts from a saved set instead of
the shipped one; ``--linear-target L`` first moves every threshold by one shift (the library's
``shift_to_target``, on the first ``--shift-sequences`` calibration sequences) so that all linear
MACs, the skipped groups' q rows and o columns counted, are skipped at rate L, then sets the offsets
(the thresholds change what later layers' routers read) unless ``--keep-offsets``;
``--threshold-shift S`` applies a shift found earlier instead of searching for it.

    PYTHONPATH=src python experiments/heads_offsets_sample_cpu.py --sequences 512 --out runs/heads_offsets512 --threads 1
    PYTHONPATH=src python experiments/heads_offsets_sample_cpu.py --sequences 512 --target 0.26 --after-only \
        --out runs/heads_offsets512_t26 --threads 1
    PYTHONPATH=src python experiments/heads_offsets_sample_cpu.py --from runs/heads_offsets512_t26/routers \
        --linear-target 0.5 --sequences 512 --target 0.26 --after-only --out runs/heads_lin050 --threads 1
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import wide

sys.path.insert(0, str(Path(__file__).resolve().parent))
import head_routers_fine_cpu as h  # noqa: E402  (the trials' own helpers)

from wide.commands import runs  # noqa: E402
from wide.io import pretrained  # noqa: E402
from wide.io.serialization import atomic_write_text, read_meta  # noqa: E402
from wide.training.recovery import load_recovered, save_recovered  # noqa: E402


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--target", type=float, default=None)
    p.add_argument("--after-only", action="store_true")
    p.add_argument("--from", dest="source", default=None)
    p.add_argument("--linear-target", type=float, default=None)
    p.add_argument("--shift-sequences", type=int, default=128)
    p.add_argument("--threshold-shift", type=float, default=None)
    p.add_argument("--keep-offsets", action="store_true")
    trial, rest = p.parse_known_args(argv)
    n = trial.sequences
    name = "smollm2-135m-heads25-fine-50"
    mine, args = h.parse(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rdir = Path(trial.source) if trial.source else pretrained.path(name)
    meta = read_meta(rdir)
    lib = h.set_rates(meta["run"])  # a re-set before this one: its rates are the set's
    prior = meta["run"].get("offsets_resample")
    tok, _ = runs.load_tokenizer(args)
    train_ids, _ = runs.calibration(args, tok, args.max_train_tokens)
    eval_ids, _, _ = runs.packed(args, tok, "heldout")
    model, tok, _ = runs.load_model(args, tok)
    model = load_recovered(model, rdir)
    bs = args.batch_size

    @torch.no_grad()
    def rate(ids) -> dict:
        # group rate (every token alike: what the offsets are set on) and attention-core rate
        # (QK^T and PV, weighted by each token's context: what the records report)
        with wide.track_sparsity(model) as tracker:
            for b in ids.split(bs):
                model(input_ids=b)
        sp = tracker.summary()
        return {"attn_group": float(sp.attn_rate), "attn_core": float(sp.attn_core_rate),
                "linear": float(sp.linear_rate)}

    target = lib["target"] if trial.target is None else trial.target
    rows = {}
    if not trial.after_only:
        for k in (32, 128, n):
            rows[f"calibration[:{k}]"] = rate(train_ids[:k])
        rows["heldout (all)"] = rate(eval_ids)
    shift = None
    if trial.linear_target is not None:
        from wide.method.fine import get_fine, shift_to_target

        rows[f"before shift, calibration[:{trial.shift_sequences}]"] = rate(train_ids[:trial.shift_sequences])
        if trial.threshold_shift is None:
            shift = shift_to_target(model, train_ids[:trial.shift_sequences].split(bs), trial.linear_target)
        else:
            fine = get_fine(model)
            finite = torch.isfinite(fine.log_threshold)
            fine.log_threshold.data[finite] += trial.threshold_shift
            shift = trial.threshold_shift
        print(f"thresholds shifted by {shift:+.4f}", flush=True)
        if not trial.keep_offsets:  # else the set is final here, and "after" measures it
            rows[f"after shift, calibration[:{trial.shift_sequences}]"] = rate(train_ids[:trial.shift_sequences])
    offsets = None if trial.keep_offsets else h.library_offsets(model, train_ids[:n].split(bs), target,
                                                                  lib["offsets_mode"])
    after = {f"calibration[:{n}]": rate(train_ids[:n])}
    if not trial.after_only:
        after["heldout (all)"] = rate(eval_ids)
    run = {"command": "python experiments/heads_offsets_sample_cpu.py " + " ".join(argv), "set": str(rdir),
           "linear_target": trial.linear_target, "threshold_shift": shift,
           "shift_sequences": trial.shift_sequences if shift is not None else None,
           "target": target, "offsets_mode": lib["offsets_mode"], "sequences": n,
           "calibration_sequences": int(train_ids.shape[0]), "heldout_windows": int(eval_ids.shape[0]),
           "before": rows, "after": after,
           "offsets": offsets,
           "offsets_kept_from": ({k: (prior or lib).get(k) for k in ("target", "sequences", "offsets_mode")}
                                 if trial.keep_offsets else None),
           "total_s": time.perf_counter() - t0, "machine": runs.machine(),
           "date": datetime.date.today().isoformat()}
    if prior:
        run["previous"] = prior  # the chain of re-sets stays in the set
    extra = {k: v for k, v in meta.items() if k not in h.SAVED_META}
    extra["run"] = {**(meta.get("run") or {}), "offsets_resample": run}
    save_recovered(model, Path(args.out) / h.FINAL_DIR, extra=extra)
    atomic_write_text(Path(args.out) / "offsets_resample.json", json.dumps(run, indent=2))
    for when in ("before", "after"):
        for k, v in run[when].items():
            print(f"{when:6s} {k}: attention groups {v['attn_group']:.4f}, attention core {v['attn_core']:.4f}, "
                  f"linear {v['linear']:.4f}")
    print(f"saved {Path(args.out) / h.FINAL_DIR} ({run['total_s']:.0f} s)", flush=True)
    return run


if __name__ == "__main__":
    main()
