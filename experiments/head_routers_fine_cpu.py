"""Attention head-group routers trained beside frozen learned per-element thresholds (issue 48,
design (a), stage 1; CPU trial).

The shipped ``smollm2-135m-fine-50`` thresholds (50 % linear sparsity, per-channel scales) are
loaded and frozen; one attention router per layer (the FFN is not routed) chooses, per token,
which of SmolLM2's three GQA packs (3 query heads sharing one K/V head) run. Layer 0 stays
dense: its router's output weights are zeroed and its biases set so that every group runs with
a margin of 1e4, and it is not trained (offset calibration's global shift moves margins by a
few units, so it cannot flip it). The penalty holds the attention group rate, averaged over
all 30 layers (layer 0 included, at 0), at ``--target``; 29/30 x 1/3 = 0.3222 is the oracle's
rate (one group of three skipped for every token in layers 1-29). The task loss is the
distillation loss (``--loss kd``): the teacher is the dense model (routing_disabled switches
both the routers and the thresholds off). After training, one global router offset lands the
deterministic masks on the target on the calibration text (``wide.method.offsets.calibrate_offsets``,
not ``wide calibrate``'s path, which for learned thresholds shifts the thresholds instead).

Everything else is ``wide calibrate``'s: the same options (data, decontamination, seq-len,
router rank and input, dense router start, sparsity warm-up, Gumbel schedule, AdamW), the same
training loop (``wide.training.train.train`` with the attention routers of layers 1-29 as the only
parameters), and the saved directory (routers + the frozen thresholds + run record) is a router
directory that ``wide eval --routers DIR`` reads as any other.

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --out runs/heads --threads 1 \
        --steps 100 --batch-size 4 --target 0.3222 --loss kd
    PYTHONPATH=src python -m wide.cli eval --threads 1 --device cpu --dense \
        --routers smollm2-135m-fine-50 runs/heads/routers --max-eval-sequences 24 --tasks --out ...

``--skip-one`` (second trial) swaps the routers' independent per-group rule for the oracle's
structure: per token and routed layer, at most one group is skipped, the one with the smallest
margin (logit_exec - logit_skip). Training samples one of G + 1 outcomes (skip group g, score
-margin_g; skip nothing, score 0) with hard Gumbel-softmax straight-through, so the dense start
(margins 4: nothing skipped with probability 0.95) and the target's warm-up work as for the
independent rule, and ``--budget layer`` pulls each layer's rate to 1/G. Inference skips exactly
one group (the smallest margin) per token in every routed layer: the rate is 1/G there by
construction, so no offsets (``--offsets none``). The rule is a ``WideState.mask_fn`` that the
library does not save: evaluate such a directory with ``--eval`` (the rest of the command line is
``wide eval``'s), which installs the rule on every router set it loads.

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --out runs/one --threads 1 \
        --steps 40 --batch-size 4 --budget layer --target 0.3333 --offsets none
    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --eval --threads 1 --device cpu \
        --routers runs/one/routers --max-eval-sequences 24 --tasks --out ...

``--oracle-ce W`` (third trial, with ``--skip-one``) teaches the choice the oracle's: the
training forward computes every group (the mask zeroes o_proj's input after attention ran), so
a pre-hook on o_proj reads, per token and routed layer, the group of smallest contribution norm
||h_g W_o[:, g]^T|| after the thresholds, and W x the cross-entropy of the G skip scores
(-margins) toward it joins the kd loss. ``--input-choice`` makes the choice a function of the
token's input only: the per-group part of the margins' bias is projected out (only the shared
level, which sets how often nothing is skipped in training, trains) and the routers' down bias
stays at zero, so a per-group bias cannot settle into a static prune. ``--mask-stats`` reports
the match with the oracle's group before and after the thresholds.

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --oracle-ce 1.0 --input-choice \
        --out runs/one_ce --threads 1 --steps 40 --batch-size 4 --budget layer --target 0.3333 --offsets none

``--joint`` (trial 5: design (b), with ``--skip-one``) trains the thresholds beside the routers,
the split fixed: the thresholds start from ``--thresholds`` (the shipped set: the comparison
with design (a) is about joint training, not about training thresholds from scratch) and their
log thresholds and per-channel log scales (``FineSparsity.learnable()``) join the routers as
trained parameters, in the library's own second AdamW group (``--lr`` x the set's
``fine.lr_scale``, 1.0 for the shipped recipe, no weight decay; the surrogate's temperature
anneals ``fine.tau_start -> tau_end`` with the steps, as in ``wide calibrate --hybrid``). The
attention split is the ``--skip-one`` rule's (one group per token in layers 1.., the per-layer
group penalty as in design (a)); the linear sparsity is held at ``--linear-target`` (0.5) by the
library's threshold mechanism: ``coef x |target - linear rate|`` (``sparsity_penalty`` with
``loss_mode="linear"``, ``budget="global"``, no warm-up; the rate is all linear-layer MACs
skipped, the routed groups' q rows and o columns included, as the hybrid counts them; coef the
set's ``sparsity_coef``, 20, unless ``--linear-coef``) added to the task loss, and after training
one shift of every log threshold lands the inference rule (exactly one group skipped) on the
target on the ``--offset-batches`` calibration batches (``wide.method.fine.shift_to_target``, what
``wide calibrate`` does for learned thresholds; ``--no-threshold-shift`` skips it). The saved
directory holds the routers and the trained thresholds, and ``--skip-one --eval`` reads it.

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --joint --skip-one --oracle-ce 3.0 --input-choice \
        --out runs/joint --threads 1 --steps 80 --batch-size 4 --budget layer --target 0.3333 --offsets none

``--reshift DIR`` (with ``--skip-one``) is the matched-sparsity control: DIR's thresholds moved by
one shift so that the linear sparsity under the rule is ``--linear-target`` on the calibration
batches, saved to ``--out``/routers (e.g. design (a)'s set brought to design (b)'s 0.50).

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --input-choice --reshift runs/one_ce/routers \
        --linear-target 0.5 --out runs/one_ce_at050 --threads 1 --batch-size 4

``--recalibrate DIR`` (stage 2 of a ``--to-library`` set) re-sets a ``wide recover`` run's set (DIR:
its ``recovered/``, routers + thresholds + LoRA adapters) to the rates its stage-1 library set had
on the same calibration batches, as ``wide compare``'s learned_lora shifts its thresholds back onto
the target after LoRA: the per-layer offsets onto the library set's attention-core rate, one
shift of every log threshold onto its linear sparsity (the adapters move what the routers and
thresholds read), then the offsets once more (the shift moves the routers' inputs). The targets
are the stage-1 set's ``to_library`` record (``--stage1``, default the set ``wide recover``
started from); ``wide recover`` itself must run with ``--offsets none``: its default shifts the
thresholds onto the routers' ``target_sparsity`` (an attention-group rate here) as if it were a
linear one. Saved to ``--out``/routers with the adapters unmerged; ``wide eval --routers`` reads it.

    PYTHONPATH=src python -m wide.cli recover --routers runs/lib/routers --out runs/lora --freeze-routers \
        --offsets none --loss kd --steps 100 --batch-size 64 --lr 1e-3
    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --recalibrate runs/lora/recovered --out runs/lora_lib

``--router-input query`` (sixth trial, with ``--skip-one``) feeds each routed layer's attention
router the layer's query instead of the residual stream entering the layer: q_proj's output after
the thresholds (the q attention uses, before RoPE; SmolLM2: 9 heads x 64 = 576 features, each KV
group's three query heads 192 of them). The router is the library's (the same rank, dense start
and ``--input-choice`` handling; it needs heads x head_dim = hidden), its margins computed in a
forward hook on q_proj, which routes the layer there (masks, sparsity records; the mask is needed
only at o_proj, where it applies) while the norm's hook leaves the routed layers alone. The saved
directory records it (wide_config.json ``head_router_input``: ``query``), and ``--eval`` and
``--mask-stats`` install it from there (or name it: ``--router-input query``; a mismatch is an
error). Not with ``--per-sequence`` / ``--choice-stats``.

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --oracle-ce 3.0 --input-choice \
        --router-input query --out runs/one_q --threads 1 --steps 80 --batch-size 4 --budget layer \
        --target 0.3333 --offsets none
    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --input-choice --eval --threads 1 \
        --device cpu --routers runs/one_q/routers --max-eval-sequences 24 --tasks --out ...

``--oracle`` instead evaluates the issue's oracle on the held-out windows: the thresholds of
``--thresholds``, and per token and layer (layer 0 left dense) the KV group whose contribution to
the attention output (its heads' o_proj input times their o_proj columns) has the smallest L2
norm zeroed after the fact.

``--per-sequence P`` (fourth trial, issue 48 design (c); with ``--skip-one --eval``, or with
``--oracle --oracle-modes sequence``) evaluates a per-sequence choice of the skipped group: per
sequence and routed layer, tokens t < P (the prompt) skip their own smallest-margin group (the
per-token rule above), and tokens t >= P (the decode part) skip one group per sequence, the one of
smallest mean margin over tokens s < P, re-chosen every ``--refresh N`` tokens (at t = P + kN,
from the mean margin over all tokens s < P + kN; N = 0, the default, never re-chosen). Strictly
causal from P on: a decode token's group depends only on the margins of tokens before it
(:func:`sequence_choice`, cumulative sums over T). ``--sequence-score vote`` takes instead the
group that was the per-token choice most often among those tokens. The oracle's counterpart
(mode ``sequence``) does the same with the groups' contribution norms in place of the margins.
The rule reads the position of a token from its index in the forward, so it holds for
full-sequence forwards from position 0 (the held-out perplexity), not for decode steps on a KV
cache (it raises there). ``--score-from S [S ...]`` (``--eval`` and ``--oracle``; default: P)
also reports the perplexity over the predictions made at positions t >= S only (the decode part),
in the records as ``ppl_from`` (with S = 0, all predictions, from the same float64 per-position
sums; ``wide eval``'s ``--dense`` gets it too: the dense reference of that part).
``--choice-stats DIR`` (with ``--skip-one --per-sequence P``) reports, per layer over the tokens
t >= P, how often the per-sequence group is the token's own and the oracle's (:func:`choice_stats`).

    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --skip-one --input-choice --eval \
        --per-sequence 64 --refresh 32 --threads 1 --device cpu --routers runs/one_ce/routers \
        --max-eval-sequences 24 --tasks --out ...
    PYTHONPATH=src python experiments/head_routers_fine_cpu.py --oracle --oracle-modes smallest sequence \
        --per-sequence 64 --refresh 0 --threads 1 --device cpu --eval-sequences 24
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from wide import pretrained
from wide.base.cliargs import from_args
from wide.cli import build_parser, calibrate_config
from wide.commands import runs
from wide.io.serialization import CONFIG_FILE, atomic_write_text, load_thresholds, save_routers
from wide.method import modeling
from wide.method.head_choice import oracle_cross_entropy, oracle_pick
from wide.method.offsets import calibrate_offsets
from wide.training.train import FINAL_DIR, TrainArgs, train

LAYER0_MARGIN = 1e4


def parse(argv):
    # no abbreviations: `wide eval`'s --dense (left in the rest) must not read as --dense-layers
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--thresholds", default="smollm2-135m-fine-50",
                     help="shipped name or directory of the learned thresholds to freeze")
    own.add_argument("--dense-layers", type=int, nargs="*", default=[0], help="layers whose attention stays dense")
    own.add_argument("--oracle", action="store_true", help="evaluate the smallest-norm-group oracle instead")
    own.add_argument("--eval-sequences", type=int, default=24, help="held-out windows (--oracle)")
    own.add_argument("--oracle-modes", nargs="+", default=["smallest", "random"],
                     choices=["smallest", "random", "static", "sequence", "share"],
                     help="--oracle's choices: per token the smallest-norm group, a random one, or per layer one "
                          "fixed group (static: the group most often of smallest norm on --static-sequences "
                          "calibration sequences), or per sequence (sequence: --per-sequence's rule on the "
                          "groups' contribution norms)")
    own.add_argument("--oracle-share", type=float, default=0.78, metavar="S",
                     help="--oracle-modes share: per routed layer and batch, only the share S of tokens whose "
                          "smallest group contributes least (its norm over the norm of the whole attention "
                          "output) skip it; 0.78 x 29/30 x 1/3 = 0.25 attention-core sparsity")
    own.add_argument("--static-sequences", type=int, default=8, help="calibration sequences of --oracle-modes static")
    own.add_argument("--skip-one", action="store_true",
                     help="at most one attention group skipped per token and layer (exactly one at inference)")
    own.add_argument("--oracle-ce", type=float, default=0.0, metavar="W",
                     help="with --skip-one: add W x the cross-entropy of the routers' G skip scores (-margins) "
                          "toward the oracle's group (per token and routed layer, the smallest contribution norm "
                          "||h_g W_o[:, g]^T|| after the thresholds, read from the training forward, which computes "
                          "every group) to the task loss")
    own.add_argument("--input-choice", action="store_true",
                     help="with --skip-one: the choice of group depends on the token's input only: the per-group "
                          "part of the skip margins' bias is taken out (margins minus the bias differences' "
                          "deviation from their mean, so only a shared level trains) and the routers' down-"
                          "projection bias stays at zero")
    own.add_argument("--router-input", choices=["residual", "query"], default=None,
                     help="with --skip-one: what each routed layer's attention router reads: the residual stream "
                          "entering the layer (residual, the library's) or the layer's query projection output after "
                          "the thresholds (query: q_proj's output, before RoPE, the q attention uses). Training "
                          "default: residual; --eval / --mask-stats default: what the directory was trained with "
                          "(its wide_config.json's head_router_input)")
    own.add_argument("--mask-stats", metavar="DIR", default=None,
                     help="per layer, the share of held-out tokens that skip 0, 1, 2, ... attention groups under "
                          "DIR's routers (the first --eval-sequences windows; with --skip-one: under that rule)")
    own.add_argument("--joint", action="store_true",
                     help="with --skip-one: train --thresholds' thresholds (and per-channel scales) beside the "
                          "routers (design (b)), the linear sparsity held at --linear-target by the library's "
                          "linear penalty and a threshold shift after training")
    own.add_argument("--linear-target", type=float, default=0.5,
                     help="--joint: linear sparsity (all linear-layer MACs, routed groups included) the thresholds hold")
    own.add_argument("--linear-coef", type=float, default=None,
                     help="--joint: weight of |--linear-target - linear rate| (default: the thresholds set's "
                          "sparsity_coef)")
    own.add_argument("--no-threshold-shift", action="store_true",
                     help="--joint: do not shift the trained thresholds onto --linear-target after training")
    own.add_argument("--reshift", metavar="DIR", default=None,
                     help="with --skip-one: load DIR (routers + learned thresholds), shift every log threshold so the "
                          "linear sparsity under the rule is --linear-target on the --offset-batches calibration "
                          "batches (shift_to_target, as --joint ends), and save the set to --out/routers")
    own.add_argument("--to-library", metavar="DIR", default=None,
                     help="with --skip-one: convert DIR (routers trained by this script + their thresholds) into a "
                          "set the library runs alone (--library-rule, layers --dense-layers kept dense, the "
                          "--input-choice bias folded in), offsets calibrated to --library-target, saved to "
                          "--out/routers: `wide eval|generate --routers` and the engine read it, no --eval hook")
    own.add_argument("--recalibrate", metavar="DIR", default=None,
                     help="re-set a `wide recover` set of a --to-library set (DIR: its recovered/) to the stage-1 "
                          "set's attention-core rate and linear sparsity on the same calibration batches (offsets, "
                          "one threshold shift, offsets again), saved with its adapters to --out/routers")
    own.add_argument("--stage1", metavar="DIR", default=None,
                     help="--recalibrate: the --to-library set whose rates to restore (default: the set DIR's "
                          "`wide recover` started from)")
    own.add_argument("--library-rule", choices=["skip_upto", "skip_smallest"], default="skip_upto")
    own.add_argument("--library-target", type=float, default=0.25,
                     help="--to-library skip_upto: attention-core sparsity over all layers (dense ones at 0)")
    own.add_argument("--library-offsets", choices=["per_module", "global"], default="per_module",
                     help="--to-library skip_upto: one rate per routed layer (as --skip-share) or one shift for all")
    own.add_argument("--eval", action="store_true",
                     help="run `wide eval` with the rest of the command line (with --skip-one: under that rule)")
    own.add_argument("--per-sequence", type=int, default=None, metavar="P",
                     help="with --skip-one --eval (or --oracle-modes sequence): tokens t >= P skip one group per "
                          "sequence and layer, the one of smallest mean margin (oracle: contribution norm) over the "
                          "tokens before P; tokens t < P keep the per-token choice")
    own.add_argument("--refresh", type=int, default=0, metavar="N",
                     help="with --per-sequence: re-choose the sequence's group every N tokens from the mean over all "
                          "tokens so far (0: never)")
    own.add_argument("--sequence-score", choices=["mean", "vote"], default="mean",
                     help="with --per-sequence: the sequence's group is the smallest mean margin (oracle: norm) over "
                          "the tokens so far (mean), or the group most often the per-token choice among them (vote)")
    own.add_argument("--choice-stats", metavar="DIR", default=None,
                     help="with --skip-one --per-sequence P: on the first --eval-sequences held-out windows under "
                          "DIR's per-token rule, how the per-sequence choice relates to the per-token one and to the "
                          "oracle's over the tokens t >= P (see choice_stats)")
    own.add_argument("--skip-share", type=float, default=None, metavar="S",
                     help="with --skip-one --eval: only about S of the tokens skip their smallest-margin group, "
                          "per layer those whose smallest margin is under the S-quantile of --share-sequences "
                          "calibration sequences (0.78 x 29/30 x 1/3 = 0.25 attention-core sparsity)")
    own.add_argument("--share-sequences", type=int, default=16, help="calibration sequences of --skip-share")
    own.add_argument("--score-from", type=int, nargs="+", default=None, metavar="S",
                     help="with --eval or --oracle: also the perplexity over the predictions at positions t >= S "
                          "(default: --per-sequence's P)")
    mine, rest = own.parse_known_args(argv)
    if mine.per_sequence is not None:
        if mine.per_sequence < 1 or mine.refresh < 0:
            raise SystemExit("--per-sequence needs P >= 1 and --refresh N >= 0")
        if not ((mine.eval and mine.skip_one) or (mine.oracle and "sequence" in mine.oracle_modes)
                or (mine.choice_stats and mine.skip_one)):
            raise SystemExit("--per-sequence is a rule of --skip-one --eval (or --choice-stats) or of --oracle "
                             "--oracle-modes sequence")
    elif (mine.oracle and "sequence" in mine.oracle_modes) or mine.choice_stats:
        raise SystemExit("--oracle-modes sequence and --choice-stats need --per-sequence P")
    if mine.router_input == "query" and not mine.skip_one:
        raise SystemExit("--router-input query is an option of --skip-one")
    if mine.router_input == "query" and (mine.per_sequence is not None or mine.choice_stats):
        raise SystemExit("--router-input query has no per-sequence rule (--per-sequence, --choice-stats)")
    if mine.skip_share is not None and not (mine.eval and mine.skip_one and mine.per_sequence is None
                                            and 0.0 < mine.skip_share <= 1.0):
        raise SystemExit("--skip-share S (0 < S <= 1) is a rule of --skip-one --eval, per token")
    if mine.score_from is None and mine.per_sequence is not None:
        mine.score_from = [mine.per_sequence]
    if mine.eval:
        return mine, rest
    # the rest is `wide calibrate`'s command line; routing defaults for this trial
    base = ["calibrate", "--sparse-target", "attention", "--loss-mode", "groups", "--target", "0.3222",
            "--loss", "kd", "--offsets", "global"]
    if (mine.oracle or mine.mask_stats or mine.choice_stats) and "--out" not in rest:
        rest = rest + ["--out", "/dev/null"]
    args = build_parser().parse_args(base + rest)
    return mine, args


def frozen_thresholds(model, name: str) -> None:
    """Attach ``name``'s per-element thresholds to a wrapped model and freeze them."""
    runs.load_frozen_thresholds(model, pretrained.resolve(name))


def trainable_thresholds(model, name: str) -> dict:
    """--joint: attach ``name``'s per-element thresholds to a wrapped model as they were trained
    (their FineConfig: allocation learned, per-channel scales, lr scale, surrogate temperatures),
    trainable; returns the set's saved metadata."""
    path = pretrained.resolve(name)
    meta = json.loads((Path(path) / CONFIG_FILE).read_text())
    if (meta.get("fine") or {}).get("allocation") != "learned":
        raise SystemExit(f"--joint trains learned thresholds: {name} has {(meta.get('fine') or {}).get('allocation')}")
    load_thresholds(model, path, meta["fine"])
    fine = model.wide_fine
    learn = {id(p) for p in fine.learnable()}
    for p in fine.parameters():
        p.requires_grad_(id(p) in learn)
    return meta


def dense_layers(model, layers) -> None:
    """Routers of ``layers`` run every attention group, whatever the token, and do not train."""
    for i in layers:
        r = model.wide_routers[i].attn
        with torch.no_grad():
            r.up.weight.zero_()
            r.up.bias.view(r.num_groups, 2).copy_(torch.tensor([LAYER0_MARGIN / 2, -LAYER0_MARGIN / 2]))
        for p in r.parameters():
            p.requires_grad_(False)


def choice_margin(router, x: torch.Tensor, input_only: bool = False) -> torch.Tensor:
    """The router's margins [..., G]; with ``input_only`` less the deviation of each group's bias
    difference (b_exec - b_skip) from the groups' mean, so that which group is smallest depends on
    the input alone (the shared level, which sets how likely skipping nothing is in training, stays;
    the gradient reaches the biases only through it, equally for every group)."""
    margin = router.margin(x)
    return margin - bias_spread(router) if input_only else margin


def bias_spread(router) -> torch.Tensor:
    """[G]: each group's exec-skip bias difference less the groups' mean (what --input-choice
    takes out of the choice)."""
    b = router.up.bias.view(router.num_groups, 2)
    d = b[:, 0] - b[:, 1]
    return d - d.mean()


class SkipOne:
    """``WideState.mask_fn``: in the attention of every layer but ``dense``, at most one group per
    token is skipped. Training (router in training mode, ``state.tau`` set): one hard Gumbel-softmax
    sample over G + 1 outcomes, scores [-margin_0 .. -margin_{G-1}, 0] (skip group g, or skip
    nothing), straight-through; the mask is 1 minus the sample's first G entries, so the soft
    sample's gradient reaches every group's margin and the sparsity penalty moves the chance of
    skipping nothing. Inference: exactly one group skipped, the smallest margin's (the oracle's
    structure; the offset, one scalar per router, does not change the choice).

    ``input_only``: margins through :func:`choice_margin` (no per-group bias in the choice).
    ``collect``: in training forwards, keep each routed layer's skip scores (-margins, with their
    graph) in ``scores`` and, from a pre-hook on o_proj (:meth:`hook_labels`), the oracle's group
    in ``labels``; :meth:`oracle_loss` is their cross-entropy.

    ``query`` (``--router-input query``): the routers of the routed layers read the layer's query
    instead of the residual stream: :meth:`install_query` puts a forward hook on every routed
    layer's q_proj (its output after the thresholds' pre-hook on its input: the q attention uses,
    before RoPE), which routes the layer's attention there (the library's ``_route``: masks,
    sparsity records and observers as from the norm's hook, and the mask is in place before
    o_proj, where it applies); the norm's own call returns None for those layers."""

    def __init__(self, model, dense=(0,), input_only: bool = False, collect: bool = False, query: bool = False):
        self.model = model
        self.dense = set(dense)
        self.input_only = input_only
        self.collect = collect
        self.query = query
        self.in_query = False  # set while the q_proj hook routes
        self.scores, self.labels = {}, {}
        self.mins = None  # layer -> [smallest margins per token], while calibrate_share collects
        self.cut = None  # layer -> the smallest margin at or below which a token skips (--skip-share)
        if query:
            self.install_query()

    def install_query(self) -> None:
        """Route the attention of every layer but the dense ones from its q_proj's output (a
        ``state.installers`` entry, so that ``install_hooks`` re-runs keep it; one per model)."""
        model, state = self.model, modeling.get_state(self.model)
        from wide.base import arch

        spec = arch.spec_for(model)
        for i, layer in enumerate(arch.decoder_layers(model)):
            r, q = model.wide_routers[i].attn, arch.projection(layer, spec, "q")
            if r is not None and i not in self.dense and q.out_features != r.down.in_features:
                raise ValueError(f"layer {i}: the query has {q.out_features} features, the router reads "
                                 f"{r.down.in_features}: --router-input query needs heads x head_dim = hidden")
        state.installers[:] = [f for f in state.installers if not getattr(f, "query_router", False)]

        def install(model):
            for i, layer in enumerate(arch.decoder_layers(model)):
                if i in self.dense or model.wide_routers[i].attn is None:
                    continue

                def hook(mod, args, out, i=i):
                    self.in_query = True
                    try:
                        modeling._route(state, model.wide_routers[i], i, "attn", out)
                    finally:
                        self.in_query = False

                state.handles.append(arch.projection(layer, spec, "q").register_forward_hook(hook))

        install.query_router = True
        state.installers.append(install)
        modeling.install_hooks(model)

    def __call__(self, layer: int, kind: str, x: torch.Tensor):
        router = self.model.wide_routers[layer].router(kind)
        if router is None:
            return None
        tau = self.model.wide_state.tau
        if kind != "attn":
            return router.decide(x, tau if router.training else None)
        G = router.num_groups
        if layer in self.dense:
            return torch.ones(*x.shape[:-1], G, device=x.device)
        if self.query and not self.in_query:
            return None  # the norm's call: this layer routes from its q_proj's hook
        margin = choice_margin(router, x, self.input_only)
        if tau is None or not router.training:
            mask = 1.0 - torch.nn.functional.one_hot(margin.argmin(-1), G).float()
            low = margin.amin(-1)
            if self.mins is not None:
                self.mins.setdefault(layer, []).append(low.detach().flatten().float().cpu())
            if self.cut is not None:  # --skip-share: only tokens whose smallest margin is low enough skip
                mask = torch.where((low <= self.cut[layer]).unsqueeze(-1), mask, torch.ones_like(mask))
            return mask
        if self.collect and torch.is_grad_enabled():
            self.scores[layer] = -margin
        scores = torch.cat([-margin, torch.zeros_like(margin[..., :1])], -1)
        sample = torch.nn.functional.gumbel_softmax(scores, tau=tau, hard=True, dim=-1)
        return 1.0 - sample[..., :G]

    def hook_labels(self) -> list:
        """Pre-hooks (prepended: before the routing mask and the thresholds) on every routed
        layer's o_proj that store, in a routed training forward with gradients, the oracle's
        group per token: the smallest contribution norm of o's input after the thresholds (the
        thresholds' keep rule applied here; the routing mask would zero the skipped group)."""
        from wide.base import arch
        from wide.method.fine import get_fine

        model, state = self.model, modeling.get_state(self.model)
        spec, cols = arch.spec_for(model), state.geometry.columns("attn")
        fine = get_fine(model)
        handles = []
        for i, layer in enumerate(arch.decoder_layers(model)):
            if i in self.dense:
                continue

            def hook(mod, a, i=i):
                if not (self.collect and state.routing and torch.is_grad_enabled()):
                    return None
                with torch.no_grad():
                    x = a[0]
                    if fine is not None and fine.enabled:
                        x = x * fine.keep(i, "o", x).to(x.dtype)
                    self.labels[i] = oracle_pick(x, mod.weight, cols)
                return None

            handles.append(arch.projection(layer, spec, "o").register_forward_pre_hook(hook, prepend=True))
        return handles

    def oracle_loss(self) -> tuple:
        """(mean over routed layers of the cross-entropy of the skip scores toward the oracle's
        group, share of tokens whose smallest margin is the oracle's group) of the last training
        forward; clears what it read."""
        return oracle_cross_entropy(self.scores, self.labels)


def sequence_choice(scores: torch.Tensor, prompt: int, refresh: int = 0, vote: bool = False) -> torch.Tensor:
    """The group each token skips [B, T] from per-token scores [B, T, G] (the smallest is skipped)
    under the per-sequence rule: tokens t < ``prompt`` take their own argmin; tokens t >= ``prompt``
    the argmin of the mean score over tokens s < r(t), with r(t) = prompt + floor((t - prompt) /
    refresh) x refresh (``refresh`` 0: r(t) = prompt, the prompt's choice kept to the end). Token
    t's group depends only on the scores of tokens before it (t >= prompt) or its own (t < prompt).
    ``vote``: the group that was the per-token argmin most often over those tokens instead (the
    mean of minus the one-hot argmins; ties to the lowest index)."""
    B, T, G = scores.shape
    if prompt < 1 or refresh < 0:
        raise ValueError(f"prompt must be >= 1 and refresh >= 0, got {prompt}, {refresh}")
    pick = scores.argmin(-1)
    if prompt >= T:
        return pick
    t = torch.arange(prompt, T, device=scores.device)
    r = prompt + (t - prompt) // refresh * refresh if refresh else torch.full_like(t, prompt)
    if vote:
        scores = -torch.nn.functional.one_hot(pick, G)
    sums = scores.double().cumsum(1)  # sums[:, s] = sum over tokens 0..s
    mean = sums[:, r - 1] / r.view(1, -1, 1).double()
    return torch.cat([pick[:, :prompt], mean.argmin(-1)], 1)


class PerSequence(SkipOne):
    """``WideState.mask_fn``: :class:`SkipOne` at inference with the group of every routed layer
    chosen by :func:`sequence_choice` from the margins (per token in the prompt, per sequence from
    ``prompt`` on, re-chosen every ``refresh`` tokens). Inference only (a training forward, router
    in training mode with ``state.tau`` set, routes as SkipOne) and full-sequence forwards only: the
    position of a token is its index in the forward (a forward given a non-empty KV cache raises)."""

    def __init__(self, model, dense=(0,), input_only: bool = False, prompt: int = 64, refresh: int = 0,
                 vote: bool = False):
        super().__init__(model, dense, input_only)
        self.prompt, self.refresh, self.vote = prompt, refresh, vote
        self.past = 0  # tokens in the KV cache the current forward was given (read by a pre-hook)
        self.handle = model.register_forward_pre_hook(self._watch, with_kwargs=True)

    def _watch(self, mod, args, kwargs):
        cache = kwargs.get("cache")  # transformers 5 calls it cache, 4 past_key_values
        if cache is None:
            cache = kwargs.get("past_key_values")
        self.past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0

    def __call__(self, layer: int, kind: str, x: torch.Tensor):
        router = self.model.wide_routers[layer].router(kind)
        state = modeling.get_state(self.model)
        if router is None or kind != "attn" or layer in self.dense or (router.training and state.tau is not None):
            return super().__call__(layer, kind, x)
        if self.past:
            raise NotImplementedError("the per-sequence rule reads positions from full forwards, not from decode "
                                      "steps on a KV cache")
        margin = choice_margin(router, x, self.input_only)
        if margin.dim() != 3:
            raise ValueError(f"the per-sequence rule needs margins [B, T, G], got {list(margin.shape)}")
        pick = sequence_choice(margin, self.prompt, self.refresh, self.vote)
        return 1.0 - torch.nn.functional.one_hot(pick, router.num_groups).float()


def calibrate_share(rule: SkipOne, model, ids: torch.Tensor, share: float, batch_size: int) -> dict:
    """``--skip-share S``: per routed layer, the cut at the S-quantile of the tokens' smallest
    margins on calibration text ``ids``, so that at inference about S of the tokens skip their
    smallest-margin group and the rest skip nothing (the rule the training sampler's "skip
    nothing" outcome allows; one scalar per layer, as an offset would be)."""
    rule.cut, rule.mins = None, {}
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in ids.split(batch_size):
                model(input_ids=batch.to(device))
        rule.cut = {i: torch.quantile(torch.cat(v), share).item() for i, v in rule.mins.items()}
    finally:
        rule.mins = None
    return rule.cut


def install_skip_one(model, dense, input_only: bool = False, collect: bool = False,
                     prompt=None, refresh: int = 0, vote: bool = False, query: bool = False) -> SkipOne:
    """Install :class:`SkipOne` (``query``: routing from the layers' queries), or with ``prompt``
    :class:`PerSequence`, as the model's mask_fn."""
    if query and prompt is not None:
        raise ValueError("the per-sequence rule reads the residual stream's margins: no query input")
    rule = (SkipOne(model, dense, input_only, collect, query) if prompt is None
            else PerSequence(model, dense, input_only, prompt, refresh, vote))
    modeling.get_state(model).mask_fn = rule
    return rule


class PositionNLL:
    """While installed (a forward hook on the model), the next-token NLL of every forward with
    ``input_ids`` [B, T], summed over the windows per position [T - 1] (position t predicts token
    t + 1): the perplexity over the predictions at t >= S (:meth:`ppl_from`) beside the whole."""

    def __init__(self, model):
        self.sum, self.windows = None, 0
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, mod, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = out.logits if hasattr(out, "logits") else out[0]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        nll = nll.sum(0).double()
        if self.sum is not None and self.sum.shape != nll.shape:
            raise ValueError("PositionNLL: forwards of different lengths")
        self.sum = nll if self.sum is None else self.sum + nll
        self.windows += ids.shape[0]

    def nll_from(self, start: int) -> float:
        return float(self.sum[start:].sum()) / (self.windows * (self.sum.shape[0] - start))

    def ppl_from(self, starts) -> dict:
        import math
        return {str(s): math.exp(self.nll_from(s)) for s in starts}

    def remove(self) -> None:
        self.handle.remove()


def scoring_from(starts, extra=None):
    """(original, stand-in) for ``wide.commands.runs.evaluate_one``: the same record plus
    ``ppl_from`` (perplexity over the predictions at positions >= 0 and >= each of ``starts``, from
    the held-out perplexity's own forwards) and ``extra``."""
    original = runs.evaluate_one

    def evaluate_one(model, tok, args, heldout_ids, *a, **kw):
        import wide.evaluation.evaluate as ev

        plain, counted = ev.perplexity, {}

        def perplexity(model, ids, **pkw):
            nll = PositionNLL(model)
            try:
                res = plain(model, ids, **pkw)
            finally:
                nll.remove()
            whole = nll.nll_from(0)
            # perplexity() sums each batch's NLL in float32 (relative error ~1e-5..1e-4 at 2,040
            # tokens); the per-position sums are float64 over windows and positions
            if abs(whole - res["nll"]) > 1e-3 * max(1.0, abs(res["nll"])):
                raise RuntimeError(f"per-position NLL {whole} does not add up to perplexity's {res['nll']}")
            counted.update(nll.ppl_from([0, *starts]))
            return res

        ev.perplexity = perplexity
        try:
            rec = original(model, tok, args, heldout_ids, *a, **kw)
        finally:
            ev.perplexity = plain
        rec["ppl_from"] = counted
        if extra and rec.get("method") != "dense":
            rec.update(extra)
        print(f"{rec.get('method')}: ppl {rec['ppl']:.3f}; over predictions at t >= S: "
              + " ".join(f"S={k} {v:.3f}" for k, v in counted.items()), flush=True)
        return rec

    return original, evaluate_one


QUERY_KEY = "head_router_input"  # the saved set's wide_config.json: "query" for --router-input query


def saved_router_input(rdir, wanted=None) -> str:
    """What the routers of ``rdir`` read (its wide_config.json's ``head_router_input``; residual if
    absent); ``wanted`` (the command line's --router-input) must agree with it."""
    try:
        meta = json.loads((Path(pretrained.resolve(rdir)) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    saved = meta.get(QUERY_KEY, "residual")
    if wanted is not None and wanted != saved:
        raise SystemExit(f"{rdir} was trained with --router-input {saved}, not {wanted}")
    return saved


def share_ids() -> torch.Tensor:
    """Calibration sequences (the calibration split of ``wide calibrate``'s defaults, the trials'
    data and sequence length, decontaminated) for ``--skip-share``, loaded once."""
    if not hasattr(share_ids, "ids"):
        cal = build_parser().parse_args(["calibrate", "--out", "/dev/null"])
        tok, _ = runs.load_tokenizer(cal)
        share_ids.ids, _ = runs.calibration(cal, tok)
    return share_ids.ids


def run_eval(mine, rest) -> int:
    """``wide eval`` with ``rest``; with ``--skip-one`` every router set it loads routes by
    :class:`SkipOne` (installed right after ``load_recovered``, which ``cmd_eval`` looks up at
    each call)."""
    import wide.training.recovery as recovery
    from wide import cli

    if mine.skip_one:
        original = recovery.load_recovered

        def load(model, rdir, *a, **kw):
            model = original(model, rdir, *a, **kw)
            query = saved_router_input(rdir, mine.router_input) == "query"
            rule = install_skip_one(model, mine.dense_layers, mine.input_choice, prompt=mine.per_sequence,
                                    refresh=mine.refresh, vote=mine.sequence_score == "vote", query=query)
            if mine.skip_share is not None:
                cut = calibrate_share(rule, model, share_ids()[:mine.share_sequences], mine.skip_share, 4)
                print(f"--skip-share {mine.skip_share}: cuts on the smallest margin per layer "
                      + " ".join(f"{cut[i]:.2f}" for i in sorted(cut)), flush=True)
            print(f"{rdir}: at most one attention group skipped per token (exactly one at inference), "
                  f"dense layers {mine.dense_layers}" + (", choice from the input only" if mine.input_choice else "")
                  + (", routers reading the layer's query (q_proj's output)" if query else "")
                  + ("" if mine.per_sequence is None else
                     f"; per sequence from token {mine.per_sequence} on (chosen by {mine.sequence_score} over the "
                     f"tokens before it, " + (f"re-chosen every {mine.refresh} tokens)" if mine.refresh else
                                             "never re-chosen)")),
                  flush=True)
            return model

        recovery.load_recovered = load
    scoring = None
    if mine.score_from:
        extra = None if mine.per_sequence is None else {
            "per_sequence": {"prompt": mine.per_sequence, "refresh": mine.refresh, "score": mine.sequence_score}}
        scoring, runs.evaluate_one = scoring_from(mine.score_from, extra)
    try:
        return cli.main(["eval"] + rest)
    finally:
        if mine.skip_one:
            recovery.load_recovered = original
        if scoring is not None:
            runs.evaluate_one = scoring


def trained_parameters(model, joint: bool = False) -> list:
    """The attention routers' trainable parameters; with ``joint`` the learned thresholds' and
    per-channel scales too (``wide.training.train`` puts those in their own AdamW group)."""
    out = [p for lr in model.wide_routers for p in (lr.attn.parameters() if lr.attn is not None else [])
           if p.requires_grad]
    if joint:
        out += [p for p in model.wide_fine.learnable() if p.requires_grad]
    return out


def linear_config(cfg, target: float):
    """The thresholds' penalty config: the library's linear-MAC budget over the whole model."""
    from dataclasses import replace

    return replace(cfg, loss_mode="linear", budget="global", target_sparsity=target, attn_target=None, ffn_target=None)


def with_linear_penalty(lcfg, coef: float, log: list):
    """--joint: a stand-in for ``wide.training.train.micro_batch_loss`` (whatever is installed,
    e.g. :func:`with_oracle_ce`'s) that adds ``coef`` x ``sparsity_penalty(forward_sparsity(model),
    lcfg)`` (|target - linear rate| of the student forward) to the task loss, no warm-up, and
    appends (linear rate, penalty) to ``log`` per micro-batch."""
    from wide.method.sparsity import forward_sparsity, sparsity_penalty

    trainmod = sys.modules["wide.training.train"]
    original = trainmod.micro_batch_loss

    def micro_batch_loss(model, x, args):
        out = original(model, x, args)
        sp = forward_sparsity(model)
        pen = sparsity_penalty(sp, lcfg)
        log.append({"linear_rate": float(sp.linear_rate.detach()), "linear_pen": float(pen.detach())})
        return dict(out, task=out["task"] + coef * pen)

    return original, micro_batch_loss


def per_step(log: list, steps: int) -> list:
    """Per-micro-batch records averaged per optimizer step."""
    if not log:
        return []
    per = max(1, len(log) // max(1, steps))
    chunks = [log[k:k + per] for k in range(0, len(log), per)]
    return [{"step": n + 1, **{k: sum(r[k] for r in rs) / len(rs) for k in rs[0]}} for n, rs in enumerate(chunks)]


def input_only_routers(model) -> None:
    """--input-choice: the attention routers' down-projection bias stays at zero (through it,
    up's weight would make a per-group constant in the margins)."""
    for lr in model.wide_routers:
        if lr.attn is not None:
            with torch.no_grad():
                lr.attn.down.bias.zero_()
            lr.attn.down.bias.requires_grad_(False)


def with_oracle_ce(rule: SkipOne, weight: float, log: list):
    """A stand-in for ``wide.training.train.micro_batch_loss`` that adds ``weight`` x the rule's
    oracle cross-entropy of the student forward to the task loss and appends (ce, match share)
    to ``log`` per micro-batch (the kd and ce the loop records stay the plain ones)."""
    original = sys.modules["wide.training.train"].micro_batch_loss

    def micro_batch_loss(model, x, args):
        rule.scores.clear()
        rule.labels.clear()
        out = original(model, x, args)
        ce, hit = rule.oracle_loss()
        log.append({"oracle_ce": float(ce.detach()), "oracle_match": hit})
        return dict(out, task=out["task"] + weight * ce)

    return original, micro_batch_loss


def main(argv=None) -> dict:
    mine, args = parse(sys.argv[1:] if argv is None else argv)
    if mine.eval:
        return run_eval(mine, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if mine.oracle:
        return oracle(mine, args)
    if mine.mask_stats:
        return mask_stats(mine, args)
    if mine.choice_stats:
        return choice_stats(mine, args)
    if mine.reshift:
        return reshift(mine, args)
    if mine.to_library:
        return to_library(mine, args)
    if mine.recalibrate:
        return recalibrate(mine, args)
    t0 = time.perf_counter()
    tok, model_path = runs.load_tokenizer(args)
    train_ids, decontamination = runs.calibration(args, tok, args.max_train_tokens)
    eval_ids, _, _ = runs.packed(args, tok, "heldout")
    print(f"calibration: {train_ids.shape[0]} sequences x {train_ids.shape[1]} tokens; "
          f"held-out: {eval_ids.shape[0]} sequences", flush=True)
    model, tok, _ = runs.load_model(args, tok)
    cfg = calibrate_config(args)
    targs = from_args(TrainArgs, args)
    modeling.wrap(model, cfg, seed=targs.seed)
    modeling.freeze_backbone(model)
    if mine.joint and not mine.skip_one:
        raise SystemExit("--joint is an option of --skip-one")
    if mine.joint:
        tmeta = trainable_thresholds(model, mine.thresholds)
        start = {k: v.detach().clone() for k, v in model.wide_fine.state_dict().items()}
        lcoef = mine.linear_coef if mine.linear_coef is not None else float(tmeta["wide_config"]["sparsity_coef"])
    else:
        frozen_thresholds(model, mine.thresholds)
    dense_layers(model, mine.dense_layers)
    rule = None
    if mine.skip_one:
        if args.offsets != "none":
            raise SystemExit("--skip-one skips exactly one group per token at inference: use --offsets none")
        if mine.input_choice:
            input_only_routers(model)
        rule = install_skip_one(model, mine.dense_layers, mine.input_choice, collect=mine.oracle_ce > 0,
                                query=mine.router_input == "query")
    elif mine.oracle_ce or mine.input_choice:
        raise SystemExit("--oracle-ce and --input-choice are options of --skip-one")
    params = trained_parameters(model, mine.joint)
    n_thr = sum(p.numel() for p in model.wide_fine.learnable()) if mine.joint else 0
    if mine.joint:
        print(f"training {sum(p.numel() for p in params) - n_thr} router parameters and {n_thr} threshold/scale "
              f"parameters of {mine.thresholds} (lr x {model.wide_fine.config.lr_scale:g}, surrogate tau "
              f"{model.wide_fine.config.tau_start:g} -> {model.wide_fine.config.tau_end:g}); linear sparsity held at "
              f"{mine.linear_target:g} by {lcoef:g} x |target - linear rate|; dense attention in layers "
              f"{mine.dense_layers}", flush=True)
    else:
        print(f"training {sum(p.numel() for p in params)} router parameters; thresholds of {mine.thresholds} frozen; "
              f"dense attention in layers {mine.dense_layers}"
              + ("; attention routers reading the layer's query" if mine.router_input == "query" else ""), flush=True)
    oracle_log, linear_log, handles, patched = [], [], [], []
    trainmod = sys.modules["wide.training.train"]
    try:
        if mine.skip_one and mine.oracle_ce > 0:
            handles = rule.hook_labels()
            original, trainmod.micro_batch_loss = with_oracle_ce(rule, mine.oracle_ce, oracle_log)
            patched.append(original)
            print(f"oracle cross-entropy x {mine.oracle_ce} beside {args.loss}", flush=True)
        if mine.joint:
            original, trainmod.micro_batch_loss = with_linear_penalty(linear_config(cfg, mine.linear_target), lcoef,
                                                                      linear_log)
            patched.append(original)
        result = train(model, train_ids, targs, args.out, eval_ids=eval_ids, parameters=params,
                       resume=args.resume, stop_at=args.stop_at)
    finally:
        if patched:
            trainmod.micro_batch_loss = patched[0]
        for h in handles:
            h.remove()
        if rule is not None:
            rule.collect = False
    oracle_log, linear_log = per_step(oracle_log, targs.steps), per_step(linear_log, targs.steps)
    if oracle_log:
        print("oracle ce / match per step: " + " ".join(f"{r['oracle_ce']:.3f}/{r['oracle_match']:.2f}"
                                                         for r in oracle_log), flush=True)
    if linear_log:
        print("linear rate per step: " + " ".join(f"{r['linear_rate']:.3f}" for r in linear_log), flush=True)
    if result.get("stopped_at"):
        return result
    joint = None
    if mine.joint:
        from wide.method.fine import measured_linear_sparsity, shift_to_target

        fine = model.wide_fine
        moved = {k: float((v.detach() - start[k]).abs()[torch.isfinite(start[k])].mean())
                 for k, v in fine.state_dict().items() if k != "sparsity"}
        batches = train_ids[:args.offset_batches * args.batch_size].split(args.batch_size)
        t1 = time.perf_counter()
        before = measured_linear_sparsity(model, batches)
        shift = None
        if not mine.no_threshold_shift:
            shift = shift_to_target(model, batches, mine.linear_target)
        after = measured_linear_sparsity(model, batches)
        print("thresholds: mean |change| in log units " + " ".join(f"{k} {v:.4f}" for k, v in moved.items())
              + f"; linear sparsity on {sum(len(b) for b in batches)} calibration sequences {before:.4f}"
              + (f", shifted by {shift:+.4f} to {after:.4f}" if shift is not None else "")
              + f" ({time.perf_counter() - t1:.1f}s)", flush=True)
        joint = {"linear_target": mine.linear_target, "linear_coef": lcoef, "threshold_lr_scale": fine.config.lr_scale,
                 "threshold_parameters": n_thr, "mean_abs_change": moved, "linear_before_shift": before,
                 "threshold_shift": shift, "linear_after_shift": after, "linear_log": linear_log}
    offsets = None
    if args.offsets != "none":
        t1 = time.perf_counter()
        batches = train_ids[:args.offset_batches * args.batch_size].split(args.batch_size)
        offsets = calibrate_offsets(model, batches, mode=args.offsets)
        # per_module leaves the dense layers at offset 0: their margins are all exactly
        # LAYER0_MARGIN, which no quantile splits (offsets._mid_gap keeps every group running)
        for i in mine.dense_layers:
            if abs(offsets[f"{i}.attn"]) >= LAYER0_MARGIN / 2:
                raise RuntimeError(f"offset calibration made dense layer {i} skip: {offsets[f'{i}.attn']}")
        print(f"offsets ({args.offsets}) calibrated in {time.perf_counter() - t1:.1f}s: "
              + " ".join(f"{k} {v:+.3f}" for k, v in offsets.items()), flush=True)
    hist = result["history"]
    run = {
        "command": "python experiments/head_routers_fine_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "design": "(b) head routers and learned thresholds trained jointly, the split fixed" if mine.joint
        else "(a) head routers on frozen learned thresholds", "thresholds": mine.thresholds, "joint": joint,
        "rule": "skip-one (at most one group per token in training, exactly one at inference; evaluate with "
                "--skip-one --eval)" if mine.skip_one else "independent groups (the library's)",
        "oracle_ce": mine.oracle_ce, "input_choice": mine.input_choice, "oracle_log": oracle_log or None,
        "router_input": mine.router_input or "residual",
        "dense_layers": mine.dense_layers, "model": model_path, "wide_config": cfg.to_dict(),
        "train_args": vars(targs), "steps": targs.steps,
        "tokens": targs.steps * targs.sequences_per_step * train_ids.shape[1],
        "wall_s": result["wall_s"], "total_s": time.perf_counter() - t0,
        "tokens_per_s": float(sum(h["tokens_per_s"] for h in hist) / len(hist)),
        "machine": runs.machine(),
        "offsets": offsets and (next(iter(offsets.values())) if args.offsets == "global" else offsets),
        "date": datetime.date.today().isoformat(), "decontamination": decontamination,
    }
    method = ("heads1of3+learned-joint" if mine.joint else "heads1of3+learned") if mine.skip_one else "heads+learned"
    extra = {"step": targs.steps, "run": run, "method": method}
    if mine.router_input == "query":
        extra[QUERY_KEY] = "query"
    save_routers(model, Path(args.out) / FINAL_DIR, extra=extra)
    atomic_write_text(Path(args.out) / "run.json", json.dumps(run, indent=2))
    print(f"saved {Path(args.out) / FINAL_DIR} after {run['total_s'] / 60:.1f} min "
          f"({run['tokens']} calibration tokens, {run['tokens_per_s']:.0f} tokens/s)", flush=True)
    return run


def saved_set(args, rdir, merge_adapters: bool = True):
    """(the model with the routers and thresholds of ``rdir``, tokenizer, the offset-calibration
    batches): what --reshift, --to-library and --recalibrate start from (the last with its LoRA
    adapters unmerged, so that it saves them again)."""
    from wide.training.recovery import load_recovered

    tok, _ = runs.load_tokenizer(args)
    train_ids, _ = runs.calibration(args, tok, args.max_train_tokens)
    model, tok, _ = runs.load_model(args, tok)
    batches = train_ids[:args.offset_batches * args.batch_size].split(args.batch_size)
    return load_recovered(model, rdir, merge_adapters=merge_adapters), tok, batches


def save_derived(model, args, rdir, key: str, run: dict) -> None:
    """Save a set derived from ``rdir`` to --out/routers, ``run`` under its run record's ``key``
    and in --out/<key>.json."""
    meta = json.loads((Path(rdir) / CONFIG_FILE).read_text())
    save_routers(model, Path(args.out) / FINAL_DIR,
                 extra={"run": {**(meta.get("run") or {}), key: run}, "method": meta.get("method", "wide")})
    atomic_write_text(Path(args.out) / f"{key}.json", json.dumps(run, indent=2))


def reshift(mine, args) -> dict:
    """--reshift: a saved set's thresholds moved by one shift onto --linear-target under the
    --skip-one rule (a control: the same linear sparsity for sets trained at different ones)."""
    from wide.method.fine import measured_linear_sparsity, shift_to_target

    if not mine.skip_one:
        raise SystemExit("--reshift measures the linear sparsity under the --skip-one rule: add --skip-one")
    t0 = time.perf_counter()
    model, _, batches = saved_set(args, mine.reshift)
    install_skip_one(model, mine.dense_layers, mine.input_choice)
    before = measured_linear_sparsity(model, batches)
    shift = shift_to_target(model, batches, mine.linear_target)
    after = measured_linear_sparsity(model, batches)
    run = {"command": "python experiments/head_routers_fine_cpu.py " + " ".join(sys.argv[1:]), "source": mine.reshift,
           "linear_target": mine.linear_target, "linear_before_shift": before, "threshold_shift": shift,
           "linear_after_shift": after, "sequences": sum(len(b) for b in batches),
           "total_s": time.perf_counter() - t0, "machine": runs.machine(), "date": datetime.date.today().isoformat()}
    save_derived(model, args, mine.reshift, "reshift", run)
    print(f"{mine.reshift}: linear sparsity {before:.4f}, thresholds shifted by {shift:+.4f} to {after:.4f}; saved "
          f"{Path(args.out) / FINAL_DIR} ({run['total_s']:.0f}s)", flush=True)
    return run


@torch.no_grad()
def fold_input_choice(router) -> None:
    """Each group's exec-skip bias difference set to the groups' mean: the router's plain margin is
    then :func:`choice_margin` with ``input_only`` (what the routers were trained and evaluated with)."""
    router.up.bias.view(router.num_groups, 2)[:, 0] -= bias_spread(router)


@torch.no_grad()
def to_library(mine, args) -> dict:
    """--to-library: the same routers and thresholds as a library set (``WideConfig.attn_rule``,
    ``attn_dense_layers``): layer 0's zeroed router dropped, the input-only choice folded into the
    biases (each group's exec-skip bias difference set to the groups' mean: the plain margin is
    then the choice margin :func:`choice_margin` used), the offsets calibrated for skip_upto."""
    import dataclasses

    if not mine.skip_one:
        raise SystemExit("--to-library converts --skip-one routers: add --skip-one")
    t0 = time.perf_counter()
    src, tok, batches = saved_set(args, mine.to_library)
    old = modeling.get_state(src).config
    cfg = dataclasses.replace(old, attn_rule=mine.library_rule, attn_skip=1,
                              attn_dense_layers=sorted(set(mine.dense_layers)))
    model, tok, _ = runs.load_model(args, tok)
    modeling.wrap(model, cfg)
    frozen_thresholds(model, mine.to_library)
    for a, b in zip(src.wide_routers, model.wide_routers):
        if b.attn is None:
            continue
        b.attn.load_state_dict(a.attn.state_dict())
        if mine.input_choice:
            fold_input_choice(b.attn)
        b.attn.offset.zero_()
    del src
    offsets = {}
    if mine.library_rule == "skip_upto":
        offsets = library_offsets(model, batches, mine.library_target, mine.library_offsets)
    attn, linear = calibration_rates(model, batches)
    run = {"command": "python experiments/head_routers_fine_cpu.py " + " ".join(sys.argv[1:]),
           "source": mine.to_library, "rule": mine.library_rule, "dense_layers": cfg.attn_dense_layers,
           "input_choice_folded": bool(mine.input_choice), "target": mine.library_target,
           "offsets_mode": mine.library_offsets, "offsets": offsets,
           "calibration_attn_rate": attn, "calibration_linear": linear,
           "sequences": sum(len(b) for b in batches), "total_s": time.perf_counter() - t0,
           "machine": runs.machine(), "date": datetime.date.today().isoformat()}
    save_derived(model, args, mine.to_library, "to_library", run)
    print(f"{mine.to_library} -> {Path(args.out) / FINAL_DIR}: attn_rule={mine.library_rule}, dense layers "
          f"{cfg.attn_dense_layers}, attention rate on calibration text {attn:.4f} "
          f"({run['total_s']:.0f}s)", flush=True)
    return run


def set_rates(run: dict):
    """A library set's rates as its run record holds them (``to_library``: target, offsets_mode,
    calibration_linear, ...), those of a later re-set (heads_offsets_sample_cpu.py,
    ``offsets_resample``) in their place; None without a conversion record."""
    lib, resample = run.get("to_library"), run.get("offsets_resample")
    if not lib or not resample:
        return lib
    rates = dict(lib, target=resample["target"], offsets_mode=resample["offsets_mode"])
    if resample.get("linear_target") is not None:
        rates["calibration_linear"] = resample["linear_target"]
    return rates


def library_offsets(model, batches, target: float, mode: str) -> dict:
    """A skip_upto set's offsets onto the attention-core rate ``target`` over all layers (the dense
    ones at 0): per_module, every routed layer at the same share; global, one shift for all."""
    import wide

    cfg = modeling.get_state(model).config
    n = len(model.wide_routers)
    routed = n - len(cfg.attn_dense_layers)
    return wide.calibrate_offsets(model, batches, target=target * n / routed if mode == "per_module" else target,
                                  mode=mode)


@torch.no_grad()
def calibration_rates(model, batches) -> tuple:
    """(attention-core rate, linear sparsity or None) of ``model``'s inference masks on ``batches``."""
    import wide

    with wide.track_sparsity(model) as tracker:
        for b in batches:
            model(input_ids=b.to(next(model.parameters()).device))
    sp = tracker.summary()
    return float(sp.attn_rate), None if sp.linear_rate is None else float(sp.linear_rate)


# what save_routers writes of a set's wide_config.json itself (the rest is the caller's extra)
SAVED_META = ("format_version", "wide_config", "model", "base_model", "fine")


@torch.no_grad()
def recalibrate(mine, args) -> dict:
    """--recalibrate: a `wide recover` run's set back on its stage-1 library set's rates (see the
    module docstring), adapters kept."""
    from wide.io.serialization import read_meta
    from wide.method.fine import shift_to_target
    from wide.training.recovery import has_lora, save_recovered

    t0 = time.perf_counter()
    meta = read_meta(mine.recalibrate)
    stage1 = mine.stage1 or meta.get("stage1_dir")
    lib = set_rates((read_meta(stage1).get("run") or {}) if stage1 else {})
    if not lib or lib.get("rule") != "skip_upto" or lib.get("calibration_linear") is None:
        raise SystemExit(f"--recalibrate restores a --to-library skip_upto set's rates: {stage1 or mine.recalibrate} "
                         "has no such record (run.to_library); name the set with --stage1")
    model, _, batches = saved_set(args, mine.recalibrate, merge_adapters=False)
    if not has_lora(model):
        raise SystemExit(f"{mine.recalibrate} holds no LoRA adapters: --recalibrate re-sets a `wide recover` set")
    before = calibration_rates(model, batches)
    library_offsets(model, batches, lib["target"], lib["offsets_mode"])
    moved = calibration_rates(model, batches)
    shift = shift_to_target(model, batches, lib["calibration_linear"])
    offsets = library_offsets(model, batches, lib["target"], lib["offsets_mode"])
    attn, linear = calibration_rates(model, batches)
    run = {"command": "python experiments/head_routers_fine_cpu.py " + " ".join(sys.argv[1:]),
           "source": str(mine.recalibrate), "stage1": str(stage1), "attn_target": lib["target"],
           "linear_target": lib["calibration_linear"], "offsets_mode": lib["offsets_mode"],
           "before": {"attn_rate": before[0], "linear": before[1]},
           "offsets_first": {"attn_rate": moved[0], "linear": moved[1]}, "threshold_shift": shift,
           "offsets": offsets, "calibration_attn_rate": attn, "calibration_linear": linear,
           "sequences": sum(len(b) for b in batches), "total_s": time.perf_counter() - t0,
           "machine": runs.machine(), "date": datetime.date.today().isoformat()}
    extra = {k: v for k, v in meta.items() if k not in SAVED_META}
    extra["run"] = {**(meta.get("run") or {}), "recalibrate": run}
    save_recovered(model, Path(args.out) / FINAL_DIR, extra=extra)
    atomic_write_text(Path(args.out) / "recalibrate.json", json.dumps(run, indent=2))
    print(f"{mine.recalibrate} -> {Path(args.out) / FINAL_DIR}: after LoRA attention rate {before[0]:.4f}, linear "
          f"{before[1]:.4f}; offsets, thresholds shifted by {shift:+.4f}, offsets again: {attn:.4f} (target "
          f"{lib['target']}), linear {linear:.4f} (target {lib['calibration_linear']:.4f}) on {run['sequences']} "
          f"calibration sequences ({run['total_s']:.0f}s)", flush=True)
    return run


@torch.no_grad()
def mask_stats(mine, args) -> dict:
    """How a router set spends its attention budget on held-out text: per layer, the share of
    tokens that skip k groups, k = 0 .. G (the oracle skips exactly one everywhere but layer 0)."""
    from wide.evaluation.evaluate import perplexity
    from wide.training.recovery import load_recovered

    tok, _ = runs.load_tokenizer(args)
    args.exact_bpb, args.max_eval_sequences = False, mine.eval_sequences
    heldout, bpt = runs.heldout(args, tok)
    model, tok, _ = runs.load_model(args, tok)
    model = load_recovered(model, mine.mask_stats)
    if mine.skip_one:
        query = saved_router_input(mine.mask_stats, mine.router_input) == "query"
        install_skip_one(model, mine.dense_layers, mine.input_choice, query=query)
        print(f"routers of {mine.mask_stats} read the " + ("layer's query" if query else "residual stream"),
              flush=True)
    picks, picks_after, handles = {}, {}, []
    if mine.skip_one:  # which group the oracle would skip at each routed layer, on the model's own states
        from wide.base import arch
        from wide.method.fine import get_fine

        spec, cols = arch.spec_for(model), modeling.get_state(model).geometry.columns("attn")
        fine = get_fine(model)
        for i, layer in enumerate(arch.decoder_layers(model)):
            o = arch.projection(layer, spec, "o")

            def hook(mod, a, i=i):
                # prepended: o's input before the routing mask and the thresholds; the training
                # label (--oracle-ce) and --oracle read it after the thresholds (their keep rule
                # applied here, since the routing mask zeroes the skipped group before them)
                x = a[0]
                picks.setdefault(i, []).append(oracle_pick(x, mod.weight, cols))
                if fine is not None:
                    x = x * fine.keep(i, "o", x).to(x.dtype)
                picks_after.setdefault(i, []).append(oracle_pick(x, mod.weight, cols))

            handles.append(o.register_forward_pre_hook(hook, prepend=True))
    try:
        with modeling.recording_masks(model) as seen:
            res = perplexity(model, heldout, batch_size=args.batch_size, bytes_per_token=bpt)
    finally:
        for h in handles:
            h.remove()
    agreement = {}
    if picks:
        for name, source in [("before the thresholds", picks), ("after the thresholds", picks_after)]:
            agree, spread = [], []
            for (layer, kind), masks in sorted(seen.items()):
                if kind == "attn" and layer not in mine.dense_layers:
                    mine_ = torch.cat([(~m).int().argmax(-1).flatten() for m in masks])
                    theirs = torch.cat([p.flatten() for p in source[layer]])
                    agree.append(float((mine_ == theirs).float().mean()))
                    G = masks[0].shape[-1]
                    spread.append((torch.bincount(mine_, minlength=G) / mine_.numel(),
                                   torch.bincount(theirs, minlength=G) / theirs.numel()))
            print(f"per layer, the share of tokens skipping group 0, 1, ...: routers | smallest norm ({name})")
            for layer, (a, b) in zip([k for k in range(len(spread) + len(mine.dense_layers))
                                      if k not in mine.dense_layers], spread):
                print(f"  {layer:2d} " + " ".join(f"{v:.2f}" for v in a) + " | " + " ".join(f"{v:.2f}" for v in b))
            print(f"share of tokens whose skipped group is the one of smallest contribution norm (o's input {name}; "
                  f"chance {1 / masks[0].shape[-1]:.3f}), layers 1..: "
                  + " ".join(f"{a:.2f}" for a in agree) + f"; mean {sum(agree) / len(agree):.3f}", flush=True)
            agreement[name] = agree
    table = {}
    for (layer, kind), masks in sorted(seen.items()):
        skipped = torch.cat([(~m).sum(-1).flatten() for m in masks])
        G = masks[0].shape[-1]
        table.setdefault(kind, []).append([float((skipped == k).float().mean()) for k in range(G + 1)])
    for kind, rows in table.items():
        print(f"{kind}: share of tokens skipping 0..G groups, per layer (ppl {res['ppl']:.2f})")
        for i, row in enumerate(rows):
            print(f"  {i:2d} " + " ".join(f"{v:.3f}" for v in row))
        mean = [sum(r[k] for r in rows[1:]) / max(1, len(rows) - 1) for k in range(len(rows[0]))]
        print("  mean over layers 1.. " + " ".join(f"{v:.3f}" for v in mean))
    return {"ppl": res["ppl"], "tokens_skipping_k": table, "oracle_agreement": agreement or None}


@torch.no_grad()
def choice_stats(mine, args) -> dict:
    """Why a per-sequence choice costs what it costs: the held-out windows run once under DIR's
    per-token rule (the states are the per-token rule's), and per routed layer, over the tokens
    t >= P (the decode part), the shares of (sequence, token) pairs where

    * ``seq=tok``: the per-sequence group (:func:`sequence_choice` of the margins, P and N) is the
      token's own per-token group (the share of decode tokens the per-sequence rule leaves as is);
    * ``tok=oracle``, ``seq=oracle``: the per-token / per-sequence router group is the oracle's
      (smallest contribution norm after the thresholds, per token);
    * ``oseq=oracle``: the per-sequence oracle's group (:func:`sequence_choice` of the norms) is;
    * ``best seq``: the best one fixed group per sequence and layer chosen in hindsight (the most
      frequent oracle group over the sequence's tokens t >= P) is: the ceiling of any per-sequence
      choice's match; ``best static``: one group per layer for all sequences (the same, over all);

    and ``1 group``: the share of sequences whose per-sequence router group at t = P is the layer's
    most common one (1.0: in effect a static prune of that layer)."""
    from wide.base import arch
    from wide.evaluation.evaluate import perplexity
    from wide.method.fine import get_fine
    from wide.training.recovery import load_recovered

    P, N, vote = mine.per_sequence, mine.refresh, mine.sequence_score == "vote"
    tok, _ = runs.load_tokenizer(args)
    args.exact_bpb, args.max_eval_sequences = False, mine.eval_sequences
    heldout, bpt = runs.heldout(args, tok)
    model, tok, _ = runs.load_model(args, tok)
    model = load_recovered(model, mine.choice_stats)
    install_skip_one(model, mine.dense_layers, mine.input_choice)
    state = modeling.get_state(model)
    spec, cols = arch.spec_for(model), state.geometry.columns("attn")
    fine = get_fine(model)
    margins, norms, handles = {}, {}, []

    def observe(layer, kind, x):
        if kind == "attn" and layer not in mine.dense_layers:
            margins.setdefault(layer, []).append(choice_margin(model.wide_routers[layer].attn, x, mine.input_choice))

    state.input_observers.append(observe)
    for i, layer in enumerate(arch.decoder_layers(model)):
        if i in mine.dense_layers:
            continue

        def hook(mod, a, i=i):  # prepended: o's input before the routing mask; the thresholds' keep rule applied
            x = a[0]
            if fine is not None:
                x = x * fine.keep(i, "o", x).to(x.dtype)
            xs = x.reshape(*x.shape[:-1], -1, cols).float()
            w = mod.weight.float().view(mod.weight.shape[0], -1, cols)
            norms.setdefault(i, []).append(torch.einsum("...gc,hgc->...gh", xs, w).norm(dim=-1))

        handles.append(arch.projection(layer, spec, "o").register_forward_pre_hook(hook, prepend=True))
    try:
        res = perplexity(model, heldout, batch_size=args.batch_size, bytes_per_token=bpt)
    finally:
        for h in handles:
            h.remove()
        state.input_observers.remove(observe)
    keys = ["seq=tok", "tok=oracle", "seq=oracle", "oseq=oracle", "best seq", "best static", "1 group"]
    rows = {}
    for i in sorted(margins):
        m, n = torch.cat(margins[i]), torch.cat(norms[i])
        G = m.shape[-1]
        tok_pick, seq_pick = m.argmin(-1)[:, P:], sequence_choice(m, P, N, vote)[:, P:]
        oracle_pick_, oseq_pick = n.argmin(-1)[:, P:], sequence_choice(n, P, N, vote)[:, P:]
        counts = torch.nn.functional.one_hot(oracle_pick_, G).sum(1).float()  # [B, G]
        first = seq_pick[:, 0]
        rows[i] = [float((seq_pick == tok_pick).float().mean()), float((tok_pick == oracle_pick_).float().mean()),
                   float((seq_pick == oracle_pick_).float().mean()), float((oseq_pick == oracle_pick_).float().mean()),
                   float(counts.max(-1).values.sum() / oracle_pick_.numel()),
                   float(counts.sum(0).max() / oracle_pick_.numel()),
                   float(torch.bincount(first, minlength=G).max() / first.numel())]
    print(f"per layer over tokens t >= {P} (per sequence by {mine.sequence_score}, refreshed every {N or 'never'}), "
          f"held-out ppl under the per-token rule {res['ppl']:.3f} on {heldout.shape[0]} windows")
    print("  layer " + " | ".join(keys))
    for i, r in rows.items():
        print(f"  {i:5d} " + " | ".join(f"{v:.3f}" for v in r))
    mean = [sum(r[k] for r in rows.values()) / len(rows) for k in range(len(keys))]
    print("  mean  " + " | ".join(f"{v:.3f}" for v in mean), flush=True)
    return {"per_layer": rows, "mean": dict(zip(keys, mean)), "ppl": res["ppl"]}


def oracle(mine, args) -> dict:
    """The issue's oracle on the held-out windows: thresholds on, and in every layer but the dense
    ones the GQA pack of smallest contribution norm ||h_g W_o[:, g]^T|| zeroed per token (and, for
    reference, a random pack instead; or one fixed pack per layer; or, mode ``sequence``, the pack of
    :func:`sequence_choice` on the norms: per token before ``--per-sequence``, per sequence after).
    With ``--score-from``, also the perplexity over the predictions at positions >= each S."""
    from wide.base import arch
    from wide.evaluation.evaluate import perplexity

    tok, _ = runs.load_tokenizer(args)
    args.exact_bpb, args.max_eval_sequences = False, mine.eval_sequences
    heldout, bpt = runs.heldout(args, tok)
    model, tok, _ = runs.load_model(args, tok)
    modeling.wrap(model, modeling.WideConfig(sparse_target="none", ffn_group_size=16))
    frozen_thresholds(model, mine.thresholds)
    state = modeling.get_state(model)
    geo = state.geometry
    spec = arch.spec_for(model)
    cols = geo.columns("attn")
    out = {}
    gen = torch.Generator().manual_seed(0)
    static = None
    if "static" in mine.oracle_modes:  # per layer, the group most often of smallest norm on calibration text
        train_ids, _ = runs.calibration(args, tok, args.max_train_tokens)
        counts, handles = {}, []
        for i, layer in enumerate(arch.decoder_layers(model)):
            def count(mod, a, i=i):
                xs = a[0].view(*a[0].shape[:-1], -1, cols)
                w = mod.weight.view(mod.weight.shape[0], -1, cols)
                pick = torch.einsum("btgc,hgc->btgh", xs, w).norm(dim=-1).argmin(-1)
                counts[i] = counts.get(i, 0) + torch.bincount(pick.flatten(), minlength=xs.shape[-2])

            handles.append(arch.projection(layer, spec, "o").register_forward_pre_hook(count))
        try:
            with torch.no_grad():
                device = next(model.parameters()).device
                for ids in train_ids[:mine.static_sequences].split(args.batch_size):
                    model(input_ids=ids.to(device))
        finally:
            for h in handles:
                h.remove()
        static = {i: int(c.argmax()) for i, c in counts.items()}
        print("static oracle's group per layer: " + " ".join(str(static[i]) for i in sorted(static)), flush=True)
        out["static_groups"] = [static[i] for i in sorted(static)]
    for mode in mine.oracle_modes:
        handles = []
        for i, layer in enumerate(arch.decoder_layers(model)):
            if i in mine.dense_layers:
                continue
            o = arch.projection(layer, spec, "o")

            def hook(mod, a, i=i, o=o):
                x = a[0]  # after the thresholds' own hook: the o input the model reads
                w = o.weight  # [hidden, heads * head_dim]
                xs = x.view(*x.shape[:-1], -1, cols)
                contrib = torch.einsum("btgc,hgc->btgh", xs, w.view(w.shape[0], -1, cols))
                norms = contrib.norm(dim=-1)
                if mode in ("smallest", "share"):
                    pick = norms.argmin(-1)
                elif mode == "static":
                    pick = torch.full(norms.shape[:-1], static[i], dtype=torch.long, device=x.device)
                elif mode == "sequence":  # per token in the prompt, per sequence from --per-sequence on
                    pick = sequence_choice(norms, mine.per_sequence, mine.refresh, mine.sequence_score == "vote")
                else:
                    # drawn on the host (the same groups on every device), used where x is
                    pick = torch.randint(0, norms.shape[-1], norms.shape[:-1], generator=gen).to(x.device)
                keep = 1.0 - torch.nn.functional.one_hot(pick, xs.shape[-2]).to(x.dtype)
                if mode == "share":  # the skips that cost least, relative to the token's whole output
                    rel = norms.amin(-1) / contrib.sum(-2).norm(dim=-1).clamp_min(1e-12)
                    cut = torch.quantile(rel.flatten().float(), mine.oracle_share)
                    keep = torch.where((rel <= cut).unsqueeze(-1), keep, torch.ones_like(keep))
                return ((xs * keep.unsqueeze(-1)).view_as(x),) + tuple(a[1:])

            handles.append(o.register_forward_pre_hook(hook))
        nll = PositionNLL(model) if mine.score_from else None
        try:
            res = perplexity(model, heldout, batch_size=args.batch_size, bytes_per_token=bpt)
        finally:
            for h in handles:
                h.remove()
            if nll is not None:
                nll.remove()
        out[mode] = {"ppl": res["ppl"], "linear_sparsity": res.get("linear_sparsity")}
        label = mode
        if mode == "share":
            out[mode]["share"] = mine.oracle_share
            n = len(arch.decoder_layers(model))
            core = mine.oracle_share * (n - len(set(mine.dense_layers))) / n / geo.attn_groups
            out[mode]["attn_core_sparsity"] = core
            label += f" (S {mine.oracle_share}: attention-core sparsity {core:.4f})"
        if mode == "sequence":
            out[mode]["per_sequence"] = {"prompt": mine.per_sequence, "refresh": mine.refresh,
                                         "score": mine.sequence_score}
            label += f" (P {mine.per_sequence}, refresh {mine.refresh or 'never'}, by {mine.sequence_score})"
        if nll is not None:
            out[mode]["ppl_from"] = nll.ppl_from([0, *mine.score_from])
            label += "; over predictions at t >= S: " + " ".join(f"S={k} {v:.3f}"
                                                                for k, v in out[mode]["ppl_from"].items())
        print(f"oracle {label}: ppl {res['ppl']:.3f} (linear sparsity of the thresholds "
              f"{res.get('linear_sparsity')})", flush=True)
    return out


if __name__ == "__main__":
    main()
