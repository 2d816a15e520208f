"""Offline Hopper compiles for the kernels' shared-memory budget: Triton's NVIDIA backend and
the ptxas in its wheel build a kernel for sm_90 on a machine without a GPU, and the compiled
kernel's metadata says the shared memory it asks for at launch. A config over the H100/H200
limit fails only there ("out of resource: shared memory", as fp32 prefill attention did in the
GPU smoke once its dots took tf32x3), so tests/test_kernels_smem_sm90.py checks every tl.dot
kernel's configs here.

Compiling needs the kernels as JIT functions, which the Triton interpreter (TRITON_INTERPRET=1,
the test suite's setting) replaces, so the sizes are measured in a child process without it:

    python tests/sm90.py      # prints {case: {config: bytes}} as JSON
    python tests/sm90.py --pdl    # the decode launches with programmatic dependent launch
"""
from __future__ import annotations

import importlib
import json
import os
import sys

# Per-block opt-in limit of sm_90 (H100 and H200), as the GPU reports it: 227 KB.
SM90_SMEM = 232448
_I32 = "*i32"


def ptxas_available() -> bool:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(ptxas)


def shared_bytes(fn, dtype: str, const: dict, num_warps: int, num_stages: int, ptr_types=(),
                 float_args=("qk_scale",)) -> int:
    """Shared memory (bytes) ``fn`` compiled for sm_90 asks for. Pointers named in
    ``ptr_types`` get that type, the others ``dtype``; scalar args are i32 unless in
    ``float_args``; ``const`` gives every constexpr without a default."""
    return int(compile_sm90(fn, dtype, const, num_warps, num_stages, ptr_types, float_args).metadata.shared)


def compile_sm90(fn, dtype: str, const: dict, num_warps: int, num_stages: int, ptr_types=(),
                 float_args=("qk_scale",), **options):
    """``fn`` compiled for sm_90 (see :func:`shared_bytes`); ``options`` join the compile options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while not isinstance(fn, triton.runtime.JITFunction):  # through autotune / heuristics
        fn = fn.fn
    ptr_types = dict(ptr_types)
    sig = {}
    for p in fn.params:
        n = p.name
        if p.is_constexpr:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]
        elif n.endswith("_ptr"):
            sig[n] = "*" + dtype
        else:
            sig[n] = "fp32" if n in float_args else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in const and not p.has_default]
    if missing:
        raise ValueError(f"constexprs without a value: {missing}")
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def pdl_cases() -> dict:
    """The decode launches that take programmatic dependent launch (wide.kernels.pdl), compiled
    for sm_90 with PDL on: {kernel: [the PTX waits, the PTX lets dependents in, launch_pdl set]}."""
    fg = importlib.import_module("wide.kernels.fine_gemv")
    nr = importlib.import_module("wide.kernels.norm_route")
    rope = importlib.import_module("wide.kernels.rope")
    att = importlib.import_module("wide.kernels.attention")
    c = fg._default_config()
    aptrs = {"mask_ptr": "*u8", "lens_ptr": _I32, "table_ptr": _I32, "po_ptr": "*fp32", "plse_ptr": "*fp32"}
    cases = {
        "decode_attention_split": (att._decode_split_kernel, aptrs,
                                   dict(NUM_SPLITS=8, HEADS_PER_KV=4, HEADS_PER_G=4, PAGED=False, HEAD_DIM=128,
                                        BLOCK_H=16, BLOCK_N=64), ("qk_scale",), 4),
        "decode_attention_combine": (att._decode_combine_kernel, aptrs,
                                     dict(NUM_SPLITS=8, HEADS_PER_G=4, HEAD_DIM=128, BLOCK_D=64, BLOCK_S=8), (), 4),
        "fine_gemv": (fg._fine_gemv_kernel, {"gm_ptr": "*u8", "th_ptr": "*fp32", "ws_ptr": "*fp32", "acc_ptr": "*fp32",
                                             "cnt_ptr": _I32, "idx_ptr": _I32, "scale_ptr": "*fp32", "clr_ptr": "*fp32"},
                      dict(T=1, NSEG=1, HAS_SCALE=False, HAS_GM=False, TH_PTR=False, GLU=False, RS=fg._rs(c.kwargs["BN"]),
                           ACC_ONLY=True, CLEAR=True, CLR_BLOCK=fg.CLEAR_BLOCK, GLU_IN=False, **c.kwargs),
                      ("th0", "th1", "th2", "th3"), c.num_warps),
        "norm_route": (nr._norm_route_kernel, {"cnt_ptr": _I32, "m_ptr": "*u8", "hp_ptr": "*fp32", "acc_ptr": "*fp32",
                                               "done_ptr": "*fp32", "st_ptr": "*u8", "rdw_ptr": "*fp32",
                                               "rdb_ptr": "*fp32", "ruw_ptr": "*fp32", "rub_ptr": "*fp32",
                                               "off_ptr": "*fp32", "d_ptr": "*fp32"},
                       dict(HAS_DELTA=True, ROUTE=False, NORMED_IN=False, R=16, BLOCK=4096, CHUNK=1024, NC_PAD=4,
                            G_PAD=16, FINAL=True, MARGIN=False, ACC=False), ("eps",), 8),
        "rope_decode": (rope._rope_cache_kernel, {"pos_ptr": "*i64", "q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32",
                                                  "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
                        dict(HALF=64, HAS_BIAS=False, QK_NORM=False, CLEAR=True), ("eps",), 4),
    }
    out = {}
    for name, (fn, ptrs, const, floats, warps) in cases.items():
        k = compile_sm90(fn, "bf16", {**const, "PDL": True}, warps, 1, ptrs, floats, launch_pdl=True)
        ptx = k.asm["ptx"]
        # (the combine lets the next launch in when it ends, as a kernel without the call does)
        out[name] = ["griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx or name.endswith("combine"),
                     bool(getattr(k.metadata, "launch_pdl", False))]
    return out


def _sizes(fn, dtype, const, configs, ptrs, first_fit=False, **kw) -> dict:
    """{config: bytes}; ``const`` a dict, or a function of the config for constexprs that
    depend on it."""
    out = {}
    for c in configs:
        base = const(c) if callable(const) else const
        b = shared_bytes(fn, dtype, {**base, **c.kwargs}, c.num_warps, c.num_stages, ptrs, **kw)
        out[str(sorted(c.kwargs.items())) + f" w{c.num_warps} s{c.num_stages}"] = b
        if first_fit and b <= SM90_SMEM:
            break
    return out


def cases() -> dict:
    """{case: {"need": "any" | "all", "sizes": {config: bytes}}}: "any" where an autotuner picks
    among the configs (one must fit), "all" for the configs a prune keeps or a heuristic picks."""
    import torch

    attention = importlib.import_module("wide.kernels.attention")
    gemm_k = importlib.import_module("wide.kernels.gemm_k")
    gemm_mn = importlib.import_module("wide.kernels.gemm_mn")
    out = {}
    # bf16 stands for fp16 (same bytes), head dim 128 for 64 (the same tiles, half the bytes)
    for dt in ("fp32", "bf16"):
        for hd in (128,):
            const = dict(HEADS_PER_KV=4, HEADS_PER_G=2, CAUSAL=True, HEAD_DIM=hd, HAS_QLEN=True,
                         HAS_KLEN=True, LEFT=False)
            ptrs = {n: _I32 for n in ("perm_ptr", "count_ptr", "qlen_ptr", "klen_ptr")}
            out[f"prefill_attention-{dt}-d{hd}"] = dict(need="any", sizes=_sizes(
                attention._prefill_kernel, dt, const, attention._PREFILL_CONFIGS, ptrs, first_fit=True))
            for paged in (False, True):
                const = dict(NUM_SPLITS=4, HEADS_PER_KV=4, HEADS_PER_G=2, PAGED=paged, HEAD_DIM=hd, BLOCK_H=16)
                ptrs = {"mask_ptr": "*u8", "lens_ptr": _I32, "table_ptr": _I32, "po_ptr": "*fp32",
                        "plse_ptr": "*fp32"}
                out[f"decode_attention-{dt}-d{hd}-paged{int(paged)}"] = dict(need="any", sizes=_sizes(
                    attention._decode_split_kernel, dt, const, attention._DECODE_CONFIGS, ptrs, first_fit=True))
    # GEMMs in fp32 only: the bf16 tiles have run on H100s and H200s since the kernels landed
    x = torch.empty(0, dtype=torch.float32)
    for bm in (16, 64, 128):
        decode, gs = bm == 16, 128
        const = dict(BM=bm, HAS_PERM=False, GROUP_M=8, NESTED=False, DECODE=decode, SPLIT=decode,
                     NG_PAD=32 if decode else 16)
        ptrs = {"mask_ptr": "*u8", "perm_ptr": "*u8", "tg_ptr": "*u8", "tc_ptr": "*u8",
                "ws_ptr": "*fp32", "cnt_ptr": _I32}
        T = 1 if decode else 4 * bm
        kept = gemm_k._prune(gemm_k._DECODE_CFGS + gemm_k._PREFILL_CFGS, {"GS": gs, "T": T, "x_ptr": x}, BM=bm)
        heur = gemm_k._heuristic(T, gs, bm, fp32=True)
        out[f"gemm_k-fp32-bm{bm}"] = dict(need="all", sizes=_sizes(gemm_k._gemm_k_kernel, "fp32", const,
                                                                   kept + [heur], ptrs))
    for tokens in (1, 128, 4096):
        for fused in (False, True):
            gs, decode = 256, tokens <= gemm_mn.DIRECT_MAX_T
            const = dict(EVEN_K=True, DIRECT=decode, FUSED=fused, SPLIT=decode)
            ptrs = {"mask_ptr": "*u8", "idx_ptr": _I32, "counts_ptr": _I32, "ws_ptr": "*fp32", "cnt_ptr": _I32}
            base = gemm_mn._DECODE_CFGS + (gemm_mn._FUSED_PREFILL_CFGS if fused else gemm_mn._PREFILL_CFGS)
            kept = gemm_mn._prune(base, {"T_BUCKET": tokens, "GS": gs, "x_ptr": x})
            heur = gemm_mn._heuristic(tokens, gs, fused, fp32=True)
            out[f"gemm_mn-fp32-T{tokens}-fused{int(fused)}"] = dict(need="all", sizes=_sizes(
                gemm_mn._gemm_mn_kernel, "fp32", const, kept + [heur], ptrs))
    # fine_gemv (no tl.dot): every config of the autotuner's list must compile for sm_90
    # (fine_ffn_up once failed to compile there) and fit
    fg = importlib.import_module("wide.kernels.fine_gemv")
    ptrs = {"gm_ptr": "*u8", "th_ptr": "*fp32", "ws_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": _I32, "idx_ptr": _I32,
            "scale_ptr": "*fp32", "clr_ptr": "*fp32"}
    for T in (1, 4):
        # T = 1: gate|up with silu(gate) * up in the epilogue, clearing a sum buffer (the fine
        # engine's launch); T = 4: q|k|v
        const = lambda c, T=T: dict(T=T, NSEG=2 if T == 1 else 3, HAS_SCALE=True, HAS_GM=T > 1,  # noqa: E731
                                    TH_PTR=True, GLU=T == 1, RS=fg._rs(c.kwargs["BN"]), ACC_ONLY=False,
                                    CLEAR=T == 1, CLR_BLOCK=fg.CLEAR_BLOCK, GLU_IN=False)
        out[f"fine_gemv-bf16-T{T}"] = dict(need="all", sizes=_sizes(
            fg._fine_gemv_kernel, "bf16", const, fg._CONFIGS, ptrs, float_args=("th0", "th1", "th2", "th3")))
    # the fp32-sums down launch: silu(gate) * up from fp32 gate|up sums, adding into fp32 sums
    const = lambda c: dict(T=1, NSEG=1, HAS_SCALE=True, HAS_GM=False, TH_PTR=True, GLU=False,  # noqa: E731
                           RS=fg._rs(c.kwargs["BN"]), ACC_ONLY=True, CLEAR=False, CLR_BLOCK=fg.CLEAR_BLOCK,
                           GLU_IN=True)
    out["fine_gemv-bf16-glu-in"] = dict(need="all", sizes=_sizes(
        fg._fine_gemv_kernel, "bf16", const, fg._ATOMIC + fg._COMPACT, {**ptrs, "x_ptr": "*fp32"},
        float_args=("th0", "th1", "th2", "th3")))
    return out


def _no_cubins_over_the_limit() -> None:
    """A config that asks for more shared memory than sm_90 has can never launch there: only its
    size matters, which Triton knows once the kernel is lowered to LLVM IR (metadata.shared, set
    before the PTX stage). ptxas, the slowest stage of these compiles (72 of 174 CPU-s, measured
    per stage), is skipped for it: an empty cubin. Every config within the limit still builds to
    a cubin. The compiles go to a cache folder of their own, so that no GPU launch ever finds
    such an empty cubin under its key."""
    from triton.backends.nvidia.compiler import CUDABackend

    make = getattr(CUDABackend, "make_cubin", None)
    if make is None:
        return

    def make_cubin(self, src, metadata, *args, **kwargs):
        shared = metadata.get("shared") if isinstance(metadata, dict) else None
        if shared is not None and shared > SM90_SMEM:
            return b""
        return make(self, src, metadata, *args, **kwargs)

    CUDABackend.make_cubin = make_cubin


def _probe() -> None:
    """Compile a trivial kernel: a Triton whose offline-compile API differs from the one this
    file speaks (ASTSource's signature / constexpr keys moved between 3.x releases) says so here."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i))

    shared_bytes(_copy, "fp32", {"BLOCK": 128}, 4, 1)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels' JIT functions")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    try:
        from triton import knobs

        os.environ["TRITON_CACHE_DIR"] = os.path.join(knobs.cache.dir, "wide-sm90-sizes")
        _probe()
    except Exception as e:  # noqa: BLE001 - any failure here is the API's, not a kernel's
        json.dump({"unsupported": f"{type(e).__name__}: {e}"[:500]}, sys.stdout)
        sys.exit(0)
    _no_cubins_over_the_limit()
    json.dump(pdl_cases() if "--pdl" in sys.argv[1:] else cases(), sys.stdout, indent=1)
