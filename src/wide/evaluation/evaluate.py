"""Perplexity, bits per byte and lm-evaluation-harness-style zero-shot scoring.

Zero-shot tasks are scored as lm-eval scores them: every choice is a continuation of the
task's prompt, its log-likelihood is summed over the continuation tokens, ``acc`` takes the
highest sum and ``acc_norm`` the highest sum per character of the choice. Prompts follow
lm-eval's task definitions (arc_easy, arc_challenge, boolq, winogrande, piqa, openbookqa,
hellaswag). Realised sparsity is tracked over every scored token (padding excluded).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..method.modeling import batch_shared_decode
from ..method.sparsity import track_sparsity

TASKS = ("arc_easy", "arc_challenge", "boolq", "winogrande", "piqa", "openbookqa", "hellaswag")
# Tasks lm-eval reports acc_norm for; the headline metric for the others is acc.
NORM_TASKS = ("arc_easy", "arc_challenge", "piqa", "openbookqa", "hellaswag")


@dataclass
class Request:
    doc: int  # index of the document
    context: str
    continuation: str  # with its leading delimiter
    choice_len: int  # characters of the choice, for acc_norm


def _hellaswag_pre(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def build_requests(task: str, docs: list[dict]) -> tuple[list[Request], list[int]]:
    """lm-eval prompts for one task: returns the requests and each document's gold index."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    reqs: list[Request] = []
    gold: list[int] = []

    def add(i, ctx, choices, answer, delim=" "):
        for c in choices:
            reqs.append(Request(i, ctx, delim + c, len(c)))
        gold.append(answer)

    for i, d in enumerate(docs):
        if task in ("arc_easy", "arc_challenge"):
            labels = list(d["choices"]["label"])
            add(i, f"Question: {d['question']}\nAnswer:", list(d["choices"]["text"]), labels.index(d["answerKey"]))
        elif task == "openbookqa":
            labels = list(d["choices"]["label"])
            add(i, d["question_stem"], list(d["choices"]["text"]), labels.index(d["answerKey"].strip()))
        elif task == "boolq":
            add(i, f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", ["no", "yes"], int(bool(d["answer"])))
        elif task == "piqa":
            add(i, f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(d["label"]))
        elif task == "hellaswag":
            ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
            query = _hellaswag_pre(d["activity_label"] + ": " + ctx)
            add(i, query, [_hellaswag_pre(e) for e in d["endings"]], int(d["label"]))
        elif task == "winogrande":
            # Partial evaluation: the option fills the blank in the context, and the shared
            # rest of the sentence is the continuation that gets scored.
            s = d["sentence"]
            blank = s.index("_")
            target = s[blank + 1:].strip()
            for opt in (d["option1"], d["option2"]):
                reqs.append(Request(i, s[:blank] + opt, " " + target, len(target)))
            gold.append(int(d["answer"]) - 1)
    return reqs, gold


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # As lm-eval: trailing context spaces move to the continuation, and the continuation's
    # tokens are those of the whole string past the context's tokens.
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(model, tokenizer, requests: list[Request], *, batch_size: int = 16,
                   max_length: int = 2048, progress: bool = True, desc: str = "scoring") -> list[float]:
    """Summed log-probability of each request's continuation given its context."""
    device = next(model.parameters()).device
    encoded = []  # (tokens, n_cont): the model reads tokens[:-1] and predicts tokens[-n_cont:]
    for r in requests:
        ctx, cont = _encode_pair(tokenizer, r.context, r.continuation)
        if not ctx:  # lm-eval conditions an empty context on the end-of-text token
            ctx = [tokenizer.eos_token_id]
        encoded.append(((ctx + cont)[-(max_length + 1):], len(cont)))
    # Longest first: padding stays small and an out-of-memory error shows up at once.
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = [0.0] * len(encoded)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc=desc, leave=False):
        idx = order[start:start + batch_size]
        width = max(len(encoded[i][0]) - 1 for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        am = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            tokens = encoded[i][0]
            ids[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            am[row, :len(tokens) - 1] = 1
        logp = F.log_softmax(model(input_ids=ids.to(device), attention_mask=am.to(device)).logits.float(), -1)
        for row, i in enumerate(idx):
            tokens, n_cont = encoded[i]
            n_in = len(tokens) - 1
            target = torch.tensor(tokens[-n_cont:], device=logp.device)
            out[i] = float(logp[row, n_in - n_cont:n_in].gather(-1, target[:, None]).sum())
    return out


def score(task: str, requests: list[Request], gold: list[int], lls: list[float]) -> dict:
    by_doc: dict[int, list] = {}
    for r, ll in zip(requests, lls):
        by_doc.setdefault(r.doc, []).append((ll, r.choice_len))
    hits, hits_norm = [], []
    for d in sorted(by_doc):
        scores = by_doc[d]
        lls_d = [s[0] for s in scores]
        norm = [s[0] / max(s[1], 1) for s in scores]
        hits.append(int(max(range(len(lls_d)), key=lls_d.__getitem__) == gold[d]))
        hits_norm.append(int(max(range(len(norm)), key=norm.__getitem__) == gold[d]))
    n = len(by_doc)
    # What a uniform guess scores on these documents: the floor that "above chance" starts from.
    res = {"acc": sum(hits) / n, "n": n, "chance": sum(1 / len(scores) for scores in by_doc.values()) / n}
    if task in NORM_TASKS:
        res["acc_norm"] = sum(hits_norm) / n
    res["metric"] = res.get("acc_norm", res["acc"])  # the number tables report
    # The headline metric per document, in document order: two records scored on the same
    # documents can then be compared pair by pair (above_chance_se), far more tightly than apart.
    res["correct"] = "".join(map(str, hits_norm if task in NORM_TASKS else hits))
    return res


def zero_shot(model, tokenizer, tasks=TASKS, *, limit: Optional[int] = None, batch_size: int = 16,
              progress: bool = True, cache_dir=None) -> dict:
    """Score each task (first ``limit`` validation documents). For a wrapped model each task
    also reports its realised sparsity; ``avg`` is the mean headline metric."""
    from ..data import load_zero_shot

    results = {}
    wrapped = hasattr(model, "wide_state")
    for task in tasks:
        docs = load_zero_shot(task, cache_dir=cache_dir)
        if limit is not None:
            docs = docs[:limit]
        reqs, gold = build_requests(task, docs)
        if wrapped:
            with track_sparsity(model) as tracker:
                lls = loglikelihoods(model, tokenizer, reqs, batch_size=batch_size, progress=progress, desc=task)
            sp = tracker.summary()
        else:
            lls = loglikelihoods(model, tokenizer, reqs, batch_size=batch_size, progress=progress, desc=task)
            sp = None
        res = score(task, reqs, gold, lls)
        if sp is not None:
            res["flop_sparsity"] = float(sp.flop_rate)
            res["group_sparsity"] = float(sp.group_rate)
            res["linear_sparsity"] = None if sp.linear_rate is None else float(sp.linear_rate)
        results[task] = res
    results["avg"] = sum(results[t]["metric"] for t in tasks) / max(len(tasks), 1)
    return results


# BoolQ is left out of the above-chance summary: dense SmolLM2 scores below its majority rate
# there, so the task measures a yes/no bias rather than what pruning keeps.
ABOVE_CHANCE_TASKS = ("arc_easy", "arc_challenge", "winogrande", "piqa", "openbookqa", "hellaswag")


def chance_level(task: str, limit: Optional[int] = None, cache_dir=None) -> float:
    """The accuracy of a uniform guess on the first ``limit`` documents of ``task`` (what
    ``score`` records as ``chance``), for records written before it did."""
    from ..data import load_zero_shot

    docs = load_zero_shot(task, cache_dir=cache_dir)
    reqs, gold = build_requests(task, docs[:limit] if limit is not None else docs)
    return score(task, reqs, gold, [0.0] * len(reqs))["chance"]


def chance_levels(records: list, tasks=None) -> dict:
    """task -> uniform-guess accuracy on the documents ``records`` scored: from a record's
    ``tasks_detail`` where ``score`` kept it, else recomputed for the records' ``limit``."""
    levels = {}
    for t in tasks or ABOVE_CHANCE_TASKS:
        kept = [(r.get("tasks_detail") or {}).get(t, {}).get("chance") for r in records]
        kept = [c for c in kept if c is not None]
        if kept:
            levels[t] = kept[0]
            continue
        limits = {r.get("limit") for r in records if r.get(t) is not None}
        levels[t] = chance_level(t, limits.pop() if len(limits) == 1 else None)
    return levels


def above_chance(record: dict, dense: dict, tasks=ABOVE_CHANCE_TASKS, chance: Optional[dict] = None) -> Optional[float]:
    """Share of the dense model's above-chance accuracy that ``record`` keeps, over ``tasks``
    together: (mean metric - mean chance) / (dense's mean metric - mean chance). Pooled rather
    than a mean of per-task ratios, which a task where dense is barely above chance (WinoGrande)
    would dominate. ``chance`` maps task -> level (default: :func:`chance_levels` of the two
    records). None if a task is missing or dense is not above chance."""
    if any(r.get(t) is None for r in (record, dense) for t in tasks):
        return None
    levels = chance or chance_levels([dense, record], tasks)
    c, m, d = (sum(v[t] for t in tasks) / len(tasks) for v in (levels, record, dense))
    return None if d <= c else (m - c) / (d - c)


def _per_document(record: dict, task: str) -> Optional[list]:
    bits = ((record.get("tasks_detail") or {}).get(task) or {}).get("correct")
    return None if bits is None else [int(b) for b in bits]


def above_chance_se(record: dict, dense: dict, tasks=ABOVE_CHANCE_TASKS, chance: Optional[dict] = None) -> Optional[float]:
    """Standard error of :func:`above_chance` from the sampling of documents alone (how much it
    would move on other documents of the same tasks; seeds add their own spread), by the delta
    method. Where both records carry each task's per-document scores (``tasks_detail[t]
    ["correct"]``, written since 2026-12-05) on the same documents, the pairs are used: the kept
    share r = (M - c) / (D - c) then has variance sum_t var_i(x_ti - r y_ti) / n_t / (T (D - c))^2,
    which counts how the two models' scores move together. Otherwise each task's metric is taken
    as a mean of n independent 0/1 scores (``tasks_detail``'s n, else the record's ``limit``),
    variance p(1 - p)/n, the two models apart: an upper estimate. None where :func:`above_chance`
    is None or a task's n is unknown."""
    if any(r.get(t) is None for r in (record, dense) for t in tasks):
        return None
    levels = chance or chance_levels([dense, record], tasks)
    kept = above_chance(record, dense, tasks, levels)
    if kept is None:
        return None
    margin = sum(dense[t] - levels[t] for t in tasks) / len(tasks)
    pairs = [(_per_document(record, t), _per_document(dense, t)) for t in tasks]
    if all(x is not None and y is not None and len(x) == len(y) > 1 for x, y in pairs):
        total = 0.0
        for x, y in pairs:
            z = torch.tensor(x, dtype=torch.float64) - kept * torch.tensor(y, dtype=torch.float64)
            total += float(z.var(unbiased=False)) / len(x)
        return math.sqrt(total) / len(tasks) / margin

    def mean_var(r: dict) -> Optional[float]:
        total = 0.0
        for t in tasks:
            n = (r.get("tasks_detail") or {}).get(t, {}).get("n") or r.get("limit")
            if not n:
                return None
            total += r[t] * (1 - r[t]) / n
        return total / len(tasks) ** 2

    vm, vd = mean_var(record), mean_var(dense)
    if vm is None or vd is None:
        return None
    return math.sqrt(vm + kept ** 2 * vd) / margin


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, *, batch_size: int = 8, bytes_per_token: Optional[float] = None,
               progress: bool = True) -> dict:
    """Next-token perplexity over packed windows ``ids`` [N, L] (the first token of each
    window is context only). Bits per byte uses the corpus's bytes per token, so it is
    comparable across tokenizers."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    wrapped = hasattr(model, "wide_state")
    ctx = track_sparsity(model) if wrapped else _null()
    try:
        with ctx as tracker:
            for i in tqdm(range(0, ids.shape[0], batch_size), disable=not progress, desc="perplexity", leave=False):
                x = ids[i:i + batch_size].to(device)
                logits = model(input_ids=x).logits.float()
                nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
                count += x[:, 1:].numel()
    finally:
        model.train(was_training)
    res = {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}
    if bytes_per_token:
        res["bpb"] = nll / count / math.log(2) / bytes_per_token
    if wrapped:
        sp = tracker.summary()
        res["flop_sparsity"] = float(sp.flop_rate)
        res["group_sparsity"] = float(sp.group_rate)
        res["linear_sparsity"] = None if sp.linear_rate is None else float(sp.linear_rate)
        res["sparsity"] = sp.as_dict()
    return res


@torch.no_grad()
def decode_perplexity(model, ids: torch.Tensor, *, batch_sizes=(8, 32), prompt_len: Optional[int] = None,
                      progress: bool = True) -> dict:
    """Perplexity of the second half of each window of ``ids`` [N, L] predicted in decode mode:
    the first ``prompt_len`` tokens (default L // 2) are one prefill, then one token per step on
    the KV cache, teacher-forced, as a server decodes. Only the decoded steps' predictions are
    scored (L - prompt_len - 1 per window).

    A wrapped model is scored with its own routing (per sequence: ``"own"``, batch size
    irrelevant, run at the largest batch) and, for each batch size B, with
    :func:`~wide.method.modeling.batch_shared_decode` over batches of B windows (``"batch_shared"``),
    whose routing depends on the batch: this is its quality cost. Windows are dealt to batches
    with a stride (window i goes to batch i mod n_batches), so one batch holds windows from far
    apart in the held-out text, i.e. unrelated documents, not neighbouring chunks of one article.
    Returns ``{"prompt_len", "windows", "tokens", "own": ppl, "batch_shared": {B: ppl}}`` (a
    dense model: ``own`` only)."""
    if ids.dim() != 2 or ids.shape[1] < 3:
        raise ValueError(f"decode perplexity needs windows [N, L >= 3], got {list(ids.shape)}")
    N, L = ids.shape
    P = L // 2 if prompt_len is None else int(prompt_len)
    if not 1 <= P <= L - 2:
        raise ValueError(f"prompt_len must be in [1, {L - 2}] for windows of {L} tokens, got {P}")
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    def run(B: int, desc: str) -> float:
        n_batches = -(-N // B)
        nll, count = 0.0, 0
        for j in tqdm(range(n_batches), disable=not progress, desc=desc, leave=False):
            x = ids[j::n_batches].to(device)
            out = model(input_ids=x[:, :P], use_cache=True)
            for t in range(P, L - 1):
                out = model(input_ids=x[:, t:t + 1], use_cache=True, **cache_kwargs(model, out))
                nll += float(F.cross_entropy(out.logits[:, -1].float(), x[:, t + 1], reduction="sum"))
                count += x.shape[0]
        return nll / count, count

    try:
        nll, count = run(sizes[-1], "decode perplexity")
        res = {"prompt_len": P, "windows": N, "tokens": count, "own": math.exp(nll)}
        if hasattr(model, "wide_state"):
            res["batch_shared"] = {}
            with batch_shared_decode(model):
                for B in sizes:
                    res["batch_shared"][str(B)] = math.exp(run(B, f"decode perplexity, batch-shared B={B}")[0])
    finally:
        model.train(was_training)
    return res


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int = 8) -> torch.Tensor:
    """[N, new_tokens] greedy tokens after each equal-length prompt [N, P], one token per step on
    the KV cache (the model's own decode path: per-token routing and per-element thresholds as a
    server runs them). No end-of-text stop, so every row has the same length to compare."""
    device = next(model.parameters()).device
    out_rows = []
    for i in range(0, prompts.shape[0], batch_size):
        x = prompts[i:i + batch_size].to(device)
        out = model(input_ids=x, use_cache=True)
        toks = [out.logits[:, -1].float().argmax(-1)]
        for _ in range(new_tokens - 1):
            out = model(input_ids=toks[-1][:, None], use_cache=True, **cache_kwargs(model, out))
            toks.append(out.logits[:, -1].float().argmax(-1))
        out_rows.append(torch.stack(toks, 1).cpu())
    return torch.cat(out_rows)


def distinct_n(rows: torch.Tensor, n: int = 2) -> float:
    """Mean over rows of (distinct n-grams / n-grams): 1.0 never repeats, low values loop."""
    vals = []
    for r in rows.tolist():
        grams = [tuple(r[j:j + n]) for j in range(len(r) - n + 1)]
        if grams:
            vals.append(len(set(grams)) / len(grams))
    return sum(vals) / len(vals) if vals else float("nan")


@torch.no_grad()
def generation_quality(model, reference, ids: torch.Tensor, *, prompts: int, prompt_len: int = 32,
                       new_tokens: int = 32, seed: int = 0, batch_size: int = 8, progress: bool = True) -> dict:
    """How free text degrades, which multiple-choice accuracy hides: ``prompts`` held-out windows
    of ``ids`` (chosen with ``seed``) cut to ``prompt_len`` tokens, continued greedily for
    ``new_tokens`` by the dense ``reference`` and by ``model``.

    * ``gen_kl``: KL(dense || model) of the next-token distributions at every step of the dense
      model's own continuation, teacher-forced, mean over steps and prompts (nats);
    * ``gen_match``: share of positions where the two greedy continuations agree;
    * ``gen_prefix``: mean number of leading tokens that agree (the point where the texts part);
    * ``gen_distinct2`` (and ``gen_distinct2_dense``): distinct bigrams / bigrams of each text,
      which falls when a pruned model loops.
    Deterministic for a seed (greedy decoding, fixed prompts)."""
    if ids.dim() != 2 or ids.shape[1] < prompt_len + new_tokens:
        raise ValueError(f"generation needs held-out windows of at least {prompt_len + new_tokens} tokens "
                         f"(prompt + continuation), got {list(ids.shape)}")
    if prompts < 1 or new_tokens < 2 or prompt_len < 1:
        raise ValueError("generation needs at least one prompt, one prompt token and two new tokens")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(ids.shape[0], generator=g)[:prompts]
    P = ids[pick, :prompt_len]
    was = model.training, reference.training
    model.eval()
    reference.eval()
    try:
        dense = greedy_continuations(reference, P, new_tokens, batch_size)
        mine = dense if model is reference else greedy_continuations(model, P, new_tokens, batch_size)
        full = torch.cat([P, dense], 1)
        kl_sum, steps = 0.0, 0
        for i in tqdm(range(0, full.shape[0], batch_size), disable=not progress, desc="generation KL", leave=False):
            x = full[i:i + batch_size]
            # the logits that predict the continuation's tokens: positions P-1 .. P+new-2
            sl = slice(prompt_len - 1, prompt_len + new_tokens - 1)
            lp = F.log_softmax(reference(input_ids=x.to(next(reference.parameters()).device)).logits[:, sl].float(), -1)
            lq = F.log_softmax(model(input_ids=x.to(next(model.parameters()).device)).logits[:, sl].float(), -1)
            kl_sum += float((lp.exp() * (lp - lq.to(lp.device))).sum())
            steps += x.shape[0] * new_tokens
    finally:
        model.train(was[0])
        reference.train(was[1])
    same = mine == dense
    prefix = torch.where(same.all(1), torch.full((same.shape[0],), new_tokens),
                         (~same).float().argmax(1))
    return {"gen_kl": kl_sum / steps, "gen_match": float(same.float().mean()), "gen_prefix": float(prefix.float().mean()),
            "gen_distinct2": distinct_n(mine), "gen_distinct2_dense": distinct_n(dense),
            "gen_settings": {"prompts": int(P.shape[0]), "prompt_len": prompt_len, "new_tokens": new_tokens,
                             "seed": seed}}


def cache_kwargs(model, out) -> dict:
    """The keyword that hands forward output ``out``'s KV cache to the next ``model`` call:
    transformers 5.x renamed ``past_key_values`` to ``cache`` (in 5.2x); both are accepted."""
    cache = out.get("cache")
    cache = cache if cache is not None else out.get("past_key_values")
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {arg: cache}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def markdown_table(rows: list[dict], tasks=TASKS) -> str:
    """One row per method: sparsity (FLOP-weighted, group, linear), perplexity, bpb, each task's
    headline metric, average; and where a record has them, the decode-mode perplexities (``wide
    eval --decode-batches``: the routers' own masks and batch-shared over each batch size,
    :func:`decode_perplexity`) and the generation measures (``--generation``)."""
    shared = sorted({b for r in rows for b in (r.get("decode") or {}).get("batch_shared", {})}, key=int)
    decode = (["decode ppl", *(f"decode ppl, shared B={b}" for b in shared)] if any(r.get("decode") for r in rows)
              else [])
    gen = [k for k in ("gen_kl", "gen_match", "gen_prefix", "gen_distinct2") if any(r.get(k) is not None for r in rows)]
    head = ["method", "FLOP sparsity", "group sparsity", "linear sparsity", "ppl", "bpb", *decode, *tasks, "avg", *gen]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, p=3: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in rows:
        cells = [r.get("label") or r.get("method", "?"), fmt(r.get("sparsity")), fmt(r.get("group_sparsity")),
                 fmt(r.get("linear_sparsity")), fmt(r.get("ppl"), 2), fmt(r.get("bpb"))]
        if decode:
            d = r.get("decode") or {}
            cells += [fmt(d.get("own"), 2), *(fmt(d.get("batch_shared", {}).get(b), 2) for b in shared)]
        cells += [fmt(r.get(t)) for t in tasks] + [fmt(r.get("avg"))] + [fmt(r.get(k)) for k in gen]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def harness_table(rows: list[dict]) -> str:
    """The lm-evaluation-harness scores of the records that have them (``wide eval --harness``,
    :func:`wide.harness.evaluate`): a row per task (or group) and metric, as lm-eval names them
    ("exact_match (strict-match)" where a filter is not "none"), a column per record, each cell
    value +- standard error; "" where a record lacks that score."""
    cols = [r for r in rows if r.get("harness")]
    keys = []  # (task, metric key), in the order lm-eval reported them
    for r in cols:
        for task, metrics in (r["harness"].get("results") or {}).items():
            # lm-eval names a score "metric,filter"; "alias", "name" and "sample_len" describe the task
            keys += [(task, k) for k in metrics if "," in k and "_stderr," not in k and (task, k) not in keys]
    head = ["task", "metric", *(r.get("label") or r.get("method", "?") for r in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(metrics: dict, key: str) -> str:
        v = metrics.get(key)
        if not isinstance(v, (int, float)):
            return "" if v is None else str(v)
        se = metrics.get(key.replace(",", "_stderr,", 1))
        return f"{v:.4g}" + (f" +- {se:.2g}" if isinstance(se, (int, float)) else "")

    for task, key in keys:
        name, _, filt = key.partition(",")
        alias = ((cols[0]["harness"].get("results") or {}).get(task) or {}).get("alias", task)
        cells = [cell((r["harness"].get("results") or {}).get(task) or {}, key) for r in cols]
        lines.append("| " + " | ".join([alias.strip() or task, name if filt in ("", "none") else f"{name} ({filt})",
                                        *cells]) + " |")
    return "\n".join(lines)
