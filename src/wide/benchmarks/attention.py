"""Benchmark: routed prefill/decode attention vs PyTorch SDPA (flash backend) on one GPU.

Llama-3.1-8B heads (32 q / 8 kv, D=128, G=8 groups of 4 query heads = one GQA pack each).
Prefill masks are i.i.d. per (token, group); decode masks are balanced: every sequence has
exactly round(sparsity * G) inactive groups, chosen at random per sequence, so the realised
sparsity equals the nominal one (at B=1 an i.i.d. draw of 8 groups varies from 37.5% to 75%).
Every case is checked against the fp32 reference before it is timed.

    PYTHONPATH=src python -m wide.benchmarks.attention [--quick] [--out bench/results]

Prefill: do_bench medians (L2 flushed between runs), eager; the routed time includes the
routing (compaction) kernel. Decode: CUDA-graph replay medians, each graph running the op over
several distinct KV caches in turn (>= ~4x the L2 in total) so no replay reads from L2;
eager do_bench medians are recorded too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

from wide.base.timing import do_bench_us, graph_time_us, wall_time_us

HQ, HKV, D, G = 32, 8, 128, 8
# --dry-run: exercise the whole script on the CPU (Triton interpreter, wall-clock timing,
# math SDPA) so that a broken script never costs GPU time.
_DRY = False
DEV = "cuda"
DTYPE = torch.bfloat16


def _flash():
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return nullcontext() if _DRY else sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _versions():
    import triton

    return {
        "device": torch.cuda.get_device_name() if (torch.cuda.is_available() and not _DRY) else "cpu (dry run)",
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _rel(out, ref):
    if torch.isnan(out).any():
        return float("nan")
    den = ref.float().norm().item()
    return (out.float() - ref.float()).norm().item() / max(den, 1e-30)


def _median_graph_us(fns, reps=30):
    """Median time of one call, from graph replays of one pass over ``fns`` (3 warm-up replays
    after two eager passes on the capture stream)."""
    if _DRY:
        return wall_time_us(fns)
    return graph_time_us(fns, calls=len(fns), replays=reps, warmup_replays=3,
                         warmup_calls=2 * len(fns), stat=statistics.median)


def _do_bench_us(fn):
    return wall_time_us([fn]) if _DRY else do_bench_us(fn)


# ------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------


def triton_next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _sdpa_prefill(q, k, v):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    variants = {}

    def gqa():
        with _flash():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    variants["flash+enable_gqa"] = gqa
    try:
        gqa()
    except Exception as e:  # older builds refuse GQA on the flash path
        print("  flash+enable_gqa refused:", str(e).splitlines()[0][:120])
        variants.pop("flash+enable_gqa")
        kr = kt.repeat_interleave(HQ // HKV, dim=1)
        vr = vt.repeat_interleave(HQ // HKV, dim=1)

        def rep():
            with _flash():
                return torch.nn.functional.scaled_dot_product_attention(qt, kr, vr, is_causal=True)

        variants["flash+repeated_kv"] = rep
    return variants


def bench_prefill(T, sparsity, gen, log):
    from wide.kernels.attention import prefill_attention, prefill_attention_reference

    dev = DEV
    q = torch.randn(1, T, HQ, D, device=dev, generator=gen, dtype=DTYPE)
    k = torch.randn(1, T, HKV, D, device=dev, generator=gen, dtype=DTYPE)
    v = torch.randn(1, T, HKV, D, device=dev, generator=gen, dtype=DTYPE)
    mask = torch.rand(1, T, G, device=dev, generator=gen) >= sparsity

    out = prefill_attention(q, k, v, mask)
    if DEV == "cuda":
        torch.cuda.synchronize()
    # fp32 reference: all heads up to 4k; two groups (8 heads, 2 KV heads) beyond.
    groups = list(range(G)) if T <= 4096 else [0, G - 3]
    hpg = HQ // G
    rels = []
    zeros_ok = True
    for g in groups if T > 4096 else [None]:
        if g is None:
            ref = prefill_attention_reference(q, k, v, mask)
            o = out
        else:
            hs = slice(g * hpg, (g + 1) * hpg)
            kv = slice(g * HKV // G, g * HKV // G + 1)
            ref = prefill_attention_reference(q[:, :, hs], k[:, :, kv], v[:, :, kv], mask[:, :, g:g + 1])
            o = out[:, :, hs]
        rels.append(_rel(o, ref))
        zeros_ok &= bool((o.float()[ref == 0] == 0).all())
        del ref
    rel = max(rels) if not any(math.isnan(r) for r in rels) else float("nan")
    ok = rel < 1e-2 and zeros_ok

    variants = _sdpa_prefill(q, k, v)
    dense = {name: _do_bench_us(f) for name, f in variants.items()}
    dense_name = min(dense, key=dense.get)
    dense_us = dense[dense_name]
    try:
        default_us = _do_bench_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True))
    except Exception:
        default_us = None
    routed_us = _do_bench_us(lambda: prefill_attention(q, k, v, mask))
    # Graph replays: the GPU time alone, without Python launch overhead (it dominates at 1k).
    routed_graph_us = _median_graph_us([lambda: prefill_attention(q, k, v, mask)], reps=20)
    dense_graph_us = _median_graph_us([variants[dense_name]], reps=20)
    best_cfg = None
    if not _DRY:
        from wide.kernels import attention as A

        cache = getattr(A._prefill_kernel_tuned, "cache", {}) or {}
        best_cfg = "; ".join(str(c) for c in cache.values()) if len(cache) == 1 else None
        for key_, cfg in cache.items():
            if min(triton_next_pow2(T), 16384) in key_:
                best_cfg = str(cfg)

    # Useful FLOPs: 4*D per (query row, head, visible key), causal.
    n_keys = torch.arange(1, T + 1, device=dev, dtype=torch.float64)
    head_on = mask[0].repeat_interleave(hpg, dim=1).double()  # [T, Hq]
    routed_flops = 4 * D * (head_on * n_keys[:, None]).sum().item()
    dense_flops = 4 * D * HQ * n_keys.sum().item()
    rec = {
        "op": "prefill_attention", "B": 1, "T": T, "Tk": T, "Hq": HQ, "Hkv": HKV, "D": D, "G": G,
        "causal": True, "sparsity": sparsity,
        "realised_sparsity": round(1 - mask.float().mean().item(), 4),
        "dense_us": round(dense_us, 2), "routed_us": round(routed_us, 2),
        "speedup": round(dense_us / routed_us, 3), "rel_err": rel, "check_ok": ok,
        "tflops": round(routed_flops / routed_us / 1e6, 1),
        "dense_tflops": round(dense_flops / dense_us / 1e6, 1),
        "dense_impl": f"sdpa {dense_name}",
        "dense_all_us": {k_: round(v_, 2) for k_, v_ in dense.items()},
        "sdpa_default_us": round(default_us, 2) if default_us else None,
        "routed_graph_us": round(routed_graph_us, 2), "dense_graph_us": round(dense_graph_us, 2),
        "speedup_graph": round(dense_graph_us / routed_graph_us, 3),
        "prefill_config": best_cfg,
        "ref_scope": "all heads" if T <= 4096 else f"groups {groups} (8 heads)",
        "timing": "do_bench median, eager, L2 flushed",
    }
    log(f"prefill T={T:6d} s={sparsity:.2f}  dense {dense_us:9.1f} us ({dense_name})  "
        f"routed {routed_us:9.1f} us  x{dense_us / routed_us:5.2f}  rel {rel:.2e}  "
        f"{rec['tflops']} TF/s (dense {rec['dense_tflops']})  default-sdpa {rec['sdpa_default_us']}  "
        f"graph {dense_graph_us:.1f}/{routed_graph_us:.1f} x{rec['speedup_graph']:.2f}  cfg {best_cfg}")
    del q, k, v, out
    return rec


# ------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------


def _paginate(k, v, block_size, gen):
    B, Tk, Hkv, d = k.shape
    nblk = Tk // block_size
    perm = torch.randperm(B * nblk, device=k.device, generator=gen).view(B, nblk)
    kp = torch.empty(B * nblk, block_size, Hkv, d, dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    kp[perm.reshape(-1)] = k.reshape(B * nblk, block_size, Hkv, d)
    vp[perm.reshape(-1)] = v.reshape(B * nblk, block_size, Hkv, d)
    return kp, vp, perm.to(torch.int32)


def balanced_mask(B, groups, sparsity, gen, device):
    """[B, groups] bool with exactly round(sparsity * groups) False per row, at random places."""
    n_off = int(round(sparsity * groups))
    order = torch.rand(B, groups, device=device, generator=gen).argsort(dim=1)
    return order >= n_off  # the n_off groups drawn first in each row are inactive


def bench_decode(B, Tk, sparsity, gen, log, paged_block=0, l2_bytes=60e6, split_kw=None):
    from wide.kernels.attention import decode_attention, decode_attention_reference, decode_split_plan

    split_kw = split_kw or {}
    dev = DEV
    kv_bytes = 2 * B * Tk * HKV * D * 2
    copies = max(1, min(2 if _DRY else 16, math.ceil(4 * l2_bytes / kv_bytes)))
    sets = []
    for _ in range(copies):
        q = torch.randn(B, HQ, D, device=dev, generator=gen, dtype=DTYPE)
        k = torch.randn(B, Tk, HKV, D, device=dev, generator=gen, dtype=DTYPE)
        v = torch.randn(B, Tk, HKV, D, device=dev, generator=gen, dtype=DTYPE)
        mask = balanced_mask(B, G, sparsity, gen, dev)
        lens = torch.full((B,), Tk, dtype=torch.int32, device=dev)
        table = None
        if paged_block:
            kc, vc, table = _paginate(k, v, paged_block, gen)
        else:
            kc, vc = k, v
        sets.append((q, k, v, kc, vc, mask, lens, table))

    q, k, v, kc, vc, mask, lens, table = sets[0]
    # The first call autotunes the split count for this shape (CUDA, no num_splits given);
    # every later call, graph captures included, reuses it.
    out = decode_attention(q, kc, vc, mask, lens, block_table=table, **split_kw)
    num_splits, chunk = decode_split_plan(q, kc, table, split_kw.get("num_splits"))
    ref = decode_attention_reference(q, k, v, mask, lens)
    rel = _rel(out, ref)
    head_on = mask.repeat_interleave(HQ // G, dim=1)
    zeros_ok = bool((out[~head_on] == 0).all())
    ok = rel < 1e-2 and zeros_ok
    del ref

    def routed(s):
        q_, _, _, kc_, vc_, m_, l_, t_ = s
        return lambda: decode_attention(q_, kc_, vc_, m_, l_, block_table=t_, **split_kw)

    def sdpa_gqa(s):
        q_, k_, v_ = s[0], s[1], s[2]
        q4, k4, v4 = q_[:, :, None, :], k_.transpose(1, 2), v_.transpose(1, 2)

        def f():
            with _flash():
                return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)

        return f

    dense = {}
    dense_eager = {}
    try:
        fns = [sdpa_gqa(s) for s in sets]
        dense["flash+enable_gqa"] = _median_graph_us(fns)
        dense_eager["flash+enable_gqa"] = _do_bench_us(fns[0])
    except Exception as e:
        log(f"  flash+enable_gqa failed: {str(e).splitlines()[0][:160]}")
    if B * Tk <= 32 * 4096:  # repeated K/V is 4x the bytes; only materialise it when small
        reps = []
        for s in sets:
            q_, k_, v_ = s[0], s[1], s[2]
            kr = k_.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
            vr = v_.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
            reps.append((q_[:, :, None, :], kr, vr))

        def sdpa_rep(r):
            def f():
                with _flash():
                    return torch.nn.functional.scaled_dot_product_attention(*r)

            return f

        try:
            fns = [sdpa_rep(r) for r in reps]
            dense["flash+repeated_kv"] = _median_graph_us(fns)
            dense_eager["flash+repeated_kv"] = _do_bench_us(fns[0])
        except Exception as e:
            log(f"  flash+repeated_kv failed: {str(e).splitlines()[0][:160]}")
        del reps
    dense_name = min(dense, key=dense.get)
    dense_us = dense[dense_name]
    routed_fns = [routed(s) for s in sets]
    routed_us = _median_graph_us(routed_fns)
    routed_eager = _do_bench_us(routed_fns[0])

    active_kv = mask.float().mean().item() * B * HKV  # G == HKV: one group per KV head
    bytes_read = active_kv * Tk * D * 2 * 2 + B * HQ * D * 2 * 2
    rec = {
        "op": "decode_attention", "B": B, "T": 1, "Tk": Tk, "Hq": HQ, "Hkv": HKV, "D": D, "G": G,
        "cache": f"paged(block={paged_block})" if paged_block else "contiguous",
        "sparsity": sparsity, "realised_sparsity": round(1 - mask.float().mean().item(), 4),
        "dense_us": round(dense_us, 2), "routed_us": round(routed_us, 2),
        "speedup": round(dense_us / routed_us, 3), "rel_err": rel, "check_ok": ok,
        "gbps": round(bytes_read / routed_us / 1e3, 1),
        "dense_gbps": round((B * HKV * Tk * D * 4 + B * HQ * D * 4) / dense_us / 1e3, 1),
        "dense_impl": f"sdpa {dense_name}",
        "dense_all_us": {k_: round(v_, 2) for k_, v_ in dense.items()},
        "dense_eager_us": {k_: round(v_, 2) for k_, v_ in dense_eager.items()},
        "routed_eager_us": round(routed_eager, 2),
        "rotating_kv_sets": copies,
        "num_splits": num_splits, "split_keys": chunk,
        "timing": "CUDA-graph replay median over rotating KV sets",
    }
    if split_kw:
        rec["split_kw"] = split_kw
    log(f"decode  B={B:2d} Tk={Tk:6d} s={sparsity:.2f} {rec['cache']:>18s}  dense {dense_us:8.1f} us "
        f"({dense_name})  routed {routed_us:8.1f} us  x{dense_us / routed_us:5.2f}  rel {rel:.2e}  "
        f"{rec['gbps']} GB/s (dense {rec['dense_gbps']})  splits {num_splits}x{chunk}  eager {routed_eager:.1f} vs {dense_eager}")
    del sets
    return rec


# ------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------


def write_markdown(path, meta, records):
    lines = [
        "# Routed attention vs PyTorch SDPA (flash backend)",
        "",
        f"- device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}; {meta['date']}",
        f"- command: `{meta['command']}`",
        "- Llama-3.1-8B heads: 32 q / 8 kv, D=128, G=8 groups (one GQA pack each), bf16; "
        "`speedup` = dense / routed in the same run.",
        "- masks: prefill i.i.d. per (token, group); decode balanced: every sequence has exactly "
        "round(sparsity * 8) inactive groups, chosen at random per sequence, so the realised "
        "sparsity equals the nominal one in every row.",
        "- prefill: causal, B=1, `do_bench` medians (eager, L2 flushed), routed time includes "
        "the routing kernel; decode: CUDA-graph replay medians over rotating KV caches, "
        "contiguous cache unless noted, all sequences Tk long; `splits` = KV splits x keys per "
        "split (autotuned per shape unless pinned).",
        "",
        "## Prefill",
        "",
        "| T | sparsity | dense us | routed us | speedup | target | rel err | routed TF/s (useful) | dense TF/s | graph: dense / routed us (speedup) | SDPA default backend us | dense impl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["op"] != "prefill_attention":
            continue
        tgt = ">= 1.8x" if (r["sparsity"] == 0.5 and r["T"] >= 4096) else "-"
        lines.append(f"| {r['T']} | {r['sparsity']} | {r['dense_us']} | {r['routed_us']} | "
                     f"{r['speedup']:.2f}x | {tgt} | {r['rel_err']:.1e} | {r['tflops']} | "
                     f"{r['dense_tflops']} | {r['dense_graph_us']} / {r['routed_graph_us']} "
                     f"({r['speedup_graph']:.2f}x) | {r['sdpa_default_us']} | {r['dense_impl']} |")
    lines += [
        "",
        "## Decode",
        "",
        "| B | Tk | cache | sparsity | dense us | routed us | speedup | target | rel err | routed GB/s | dense GB/s | splits | dense impl | eager routed / dense us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["op"] != "decode_attention":
            continue
        tgt = ">= 1.8x" if (r["sparsity"] == 0.5 and r["cache"] == "contiguous") else "-"
        de = min(r["dense_eager_us"].values()) if r["dense_eager_us"] else float("nan")
        lines.append(f"| {r['B']} | {r['Tk']} | {r['cache']} | {r['sparsity']} | {r['dense_us']} | "
                     f"{r['routed_us']} | {r['speedup']:.2f}x | {tgt} | {r['rel_err']:.1e} | "
                     f"{r['gbps']} | {r['dense_gbps']} | {r.get('num_splits', '-')}x{r.get('split_keys', '-')} | "
                     f"{r['dense_impl']} | "
                     f"{r['routed_eager_us']} / {de:.1f} |")
    misses = [r for r in records if r["sparsity"] == 0.5 and r["speedup"] < 1.8 and (
        (r["op"] == "prefill_attention" and r["T"] >= 4096)
        or (r["op"] == "decode_attention" and r["cache"] == "contiguous"))]
    bad = [r for r in records if not r["check_ok"]]
    lines += ["", "## Target check (50% sparsity)", ""]
    lines.append(f"- correctness: {len(records) - len(bad)}/{len(records)} cases pass "
                 "(bf16 rel err < 1e-2 vs fp32 reference, exact zeros on inactive outputs)")
    if misses:
        for r in misses:
            lines.append(f"- MISS {r['op']} B={r['B']} T={r['T']} Tk={r['Tk']}: {r['speedup']:.2f}x")
    else:
        lines.append("- all targeted cases meet >= 1.8x")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover
        print("no plot:", e)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    pre = [r for r in records if r["op"] == "prefill_attention"]
    for s in sorted({r["sparsity"] for r in pre}):
        rs = sorted([r for r in pre if r["sparsity"] == s], key=lambda r: r["T"])
        axes[0].plot([r["T"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"sparsity {s}")
    axes[0].set_xscale("log", base=2)
    axes[0].axhline(1.8, color="k", ls="--", lw=0.8)
    axes[0].axhline(1.0, color="gray", ls=":", lw=0.8)
    axes[0].set_xlabel("T (causal, B=1)")
    axes[0].set_ylabel("speedup vs SDPA flash")
    axes[0].set_title("prefill")
    axes[0].legend()
    dec = [r for r in records if r["op"] == "decode_attention" and r["cache"] == "contiguous"]
    cases = sorted({(r["B"], r["Tk"]) for r in dec})
    width = 0.8 / max(1, len({r["sparsity"] for r in dec}))
    for i, s in enumerate(sorted({r["sparsity"] for r in dec})):
        ys = []
        for c in cases:
            m = [r["speedup"] for r in dec if (r["B"], r["Tk"]) == c and r["sparsity"] == s]
            ys.append(m[0] if m else 0)
        axes[1].bar([j + i * width for j in range(len(cases))], ys, width, label=f"sparsity {s}")
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    axes[1].set_xticklabels([f"B{b}\nTk{t // 1024}k" for b, t in cases])
    axes[1].axhline(1.8, color="k", ls="--", lw=0.8)
    axes[1].axhline(1.0, color="gray", ls=":", lw=0.8)
    axes[1].set_title("decode (contiguous cache, CUDA graphs)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="50%% sparsity, T in {1k,4k}, decode B in {1,32} x Tk 4k")
    p.add_argument("--out", default="bench/results", help="folder for attention.json/.md/.png")
    p.add_argument("--name", default="attention")
    p.add_argument("--prefill-T", type=int, nargs="*", default=None)
    p.add_argument("--decode-B", type=int, nargs="*", default=None)
    p.add_argument("--decode-Tk", type=int, nargs="*", default=None)
    p.add_argument("--sparsity", type=float, nargs="*", default=None)
    p.add_argument("--paged-block", type=int, default=16,
                   help="also time a paged cache of this block size at 50%% (0: skip)")
    p.add_argument("--tune-decode", action="store_true",
                   help="also time decode at 2x and 1/2 the heuristic split count at 50%% "
                        "(informational; the default rows use the autotuned count, see num_splits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test of this script (tiny shapes)")
    args = p.parse_args(argv)
    global _DRY, DEV, DTYPE
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        _DRY, DEV, DTYPE = True, "cpu", torch.float16  # interpreter dots on bf16 are wrong
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 1
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    if args.dry_run:
        Ts, Bs, Tks, sps = [64], [1, 2], [384], [0.5]
    elif args.quick:
        Ts, Bs, Tks, sps = [1024, 4096], [1, 32], [4096], [0.5]
    else:
        Ts, Bs, Tks, sps = [1024, 4096, 16384, 32768], [1, 8, 32], [4096, 32768], [0.25, 0.5, 0.75]
    Ts = args.prefill_T if args.prefill_T is not None else Ts
    Bs = args.decode_B if args.decode_B is not None else Bs
    Tks = args.decode_Tk if args.decode_Tk is not None else Tks
    sps = args.sparsity if args.sparsity is not None else sps
    os.makedirs(args.out, exist_ok=True)
    meta = _versions()
    meta["command"] = "python -m wide.benchmarks.attention " + " ".join(sys.argv[1:] if argv is None else argv)
    logf = open(os.path.join(args.out, f"{args.name}.log"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    log(f"{meta}")
    gen = torch.Generator(device=DEV).manual_seed(args.seed)
    records = []
    t0 = time.time()
    for T in Ts:
        for s in sps:
            records.append(bench_prefill(T, s, gen, log))
            if DEV == "cuda":
                torch.cuda.empty_cache()
    log(f"prefill done in {time.time() - t0:.0f}s")
    for B in Bs:
        for Tk in Tks:
            for s in sps:
                records.append(bench_decode(B, Tk, s, gen, log))
            if args.paged_block and 0.5 in sps:
                records.append(bench_decode(B, Tk, 0.5, gen, log, paged_block=args.paged_block))
            if DEV == "cuda":
                torch.cuda.empty_cache()
    log(f"decode done in {time.time() - t0:.0f}s")
    if args.tune_decode:
        from wide.kernels.attention import decode_splits

        tune_cases = [(1, 32768), (8, 32768)] if not _DRY else [(1, Tks[0])]
        for B, Tk in tune_cases:
            n_def = decode_splits(B, HKV, Tk, torch.device(DEV))[0]
            for kw in [dict(num_splits=2 * n_def), dict(num_splits=max(1, n_def // 2))]:
                try:
                    r = bench_decode(B, Tk, 0.5, gen, log, split_kw=kw)
                    r["tuning"] = True
                    records.append(r)
                except Exception as e:
                    log(f"  tune {B} {Tk} {kw} failed: {e}")
        log(f"tuning done in {time.time() - t0:.0f}s")
    main_records = [r for r in records if not r.get("tuning")]
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({**meta, "records": records}, f, indent=1)
    write_markdown(os.path.join(args.out, f"{args.name}.md"), meta, main_records)
    plot(main_records, os.path.join(args.out, f"{args.name}.png"))
    logf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
