"""The code layout the README promises: every module in a layer, and no import from a layer above
it or from a sibling package of its own layer; no import cycles among wide's modules (imports inside
functions count too, and importlib.import_module of a wide name); every Triton kernel under
wide/kernels/, and an engine module that holds none; the old paths that stay (wide.fine,
wide.pretrained) and those that do not."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules(root: Path = SRC, pkg: str = "wide") -> dict:
    """Dotted name -> (path, is_package)."""
    mods = {}
    for f in (root / pkg).rglob("*.py"):
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        is_pkg = name.endswith(".__init__")
        mods[name[: -len(".__init__")] if is_pkg else name] = (f, is_pkg)
    return mods


def import_graph(mods: dict) -> dict:
    """Module -> the wide modules it imports. Package __init__ files only re-export, so an import
    of a package's name counts as an import of the submodule named, not of the package."""
    pkgs = {m for m, (_, p) in mods.items() if p}
    graph = {}
    for m, (f, is_pkg) in mods.items():
        if is_pkg:
            continue
        edges = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".")[:-1]
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                for a in node.names:
                    cand = f"{full}.{a.name}"
                    edges.add(cand if cand in mods else full)
        graph[m] = {t for t in edges if t in mods and t not in pkgs and t != m}
    return graph


def find_cycles(graph: dict) -> list:
    cycles, color = [], {}

    def dfs(u, stack):
        color[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if color.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not color.get(v):
                dfs(v, stack)
        stack.pop()
        color[u] = 2

    for m in sorted(graph):
        if not color.get(m):
            dfs(m, [])
    return cycles


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "wide"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")  # inside a function: still an edge
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import wide.a\n")
    cycles = find_cycles(import_graph(_modules(tmp_path)))
    assert cycles == [["wide.a", "wide.sub.b", "wide.c", "wide.a"]]


def test_no_import_cycles():
    graph = import_graph(_modules())
    assert "wide.method.modeling" in graph and "wide.base.arch" in graph["wide.method.modeling"]
    assert find_cycles(graph) == []


# Bottom to top (README, "How the code is laid out"). A module may import its own package and the
# packages of the layers below; two packages of one layer know nothing of each other. Units are
# wide's subpackages, the root's modules (cli, harness) and "wide", the root package itself (its
# __init__: the public API).
LAYERS = (
    ("base",),  # arch, cliargs, fileio, timing: import nothing of wide
    ("kernels", "data"),
    ("method",),  # config, routers, geometry, state, modeling, sparsity, offsets, fine, baselines
    ("io", "engine"),  # checkpoints on disk | the inference engine
    ("training", "evaluation"),
    ("wide",),  # wide/__init__.py: the public API
    ("commands",),  # runs, compare, demo, sampling_data, estimate
    ("benchmarks", "harness"),  # wide bench (consumers of every layer) | lm-eval's model "wide"
    ("cli",),  # the wide command, on top of everything (wide bench, wide lm-eval included)
)
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """wide -> "wide"; wide.cli -> "cli"; wide.method.modeling -> "method"; wide.kernels -> "kernels"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _longest(name: str, mods: dict) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return ""


def _called(call: ast.Call) -> str:
    return getattr(call.func, "attr", getattr(call.func, "id", ""))


def imports(mods: dict) -> list:
    """(importing module, imported wide module or package, line) for every import of every module,
    package __init__ files included: at module level or inside functions, relative or absolute, and
    importlib.import_module calls whose name is, or begins with, a constant "wide." string."""
    names = dict(mods)
    names.update({m.rpartition(".")[0]: None for m in mods if "." in m})  # packages without an __init__ file
    out = []
    for m, (f, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_longest(a.name, names) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".") if is_pkg else m.split(".")[:-1]
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in names else _longest(full, names)
                           for a in node.names]
            elif isinstance(node, ast.Call) and node.args and _called(node) == "import_module":
                arg = node.args[0]
                if isinstance(arg, ast.JoinedStr):
                    arg = arg.values[0] if arg.values else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    targets = [_longest(arg.value.rstrip("."), names)]
            out += [(m, t, node.lineno) for t in targets if t.split(".")[0] == "wide"]
    return out


def layer_violations(mods: dict) -> list:
    """'module:line imports target (layer of the unit)' for every import of a unit that is not the
    module's own and not in a layer below it; and every unit without a layer."""
    bad = [f"{m}: its unit {unit_of(m)!r} has no layer in LAYERS" for m in sorted(mods) if unit_of(m) not in RANK]
    for m, t, line in sorted(imports(mods)):
        src, dst = unit_of(m), unit_of(t)
        if src != dst and src in RANK and dst in RANK and RANK[dst] >= RANK[src]:
            bad.append(f"{m}:{line} imports {t} ({dst}: layer {RANK[dst]}, {src}: layer {RANK[src]})")
    return bad


def test_layer_check_finds_planted_upward_and_sideways_imports(tmp_path):
    pkg = tmp_path / "wide"
    for sub in ("base", "kernels", "data", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .engine.e import run\n")  # downward: allowed
    (pkg / "base" / "t.py").write_text("def f():\n    from ..engine import e\n")  # upward, inside a function
    (pkg / "kernels" / "k.py").write_text("from ..base import t\nimport wide.data.d\n")  # down; sideways
    (pkg / "data" / "d.py").write_text("import importlib\nm = importlib.import_module(f'wide.engine.{1}')\n")
    (pkg / "engine" / "e.py").write_text("from ..kernels import k\nfrom .. import data\nrun = 1\n")
    (pkg / "odd.py").write_text("")
    assert layer_violations(_modules(tmp_path)) == [
        "wide.odd: its unit 'odd' has no layer in LAYERS",
        "wide.base.t:2 imports wide.engine.e (engine: layer 3, base: layer 0)",
        "wide.data.d:2 imports wide.engine (engine: layer 3, data: layer 1)",
        "wide.kernels.k:2 imports wide.data.d (data: layer 1, kernels: layer 1)",
    ]


def test_every_module_has_a_layer_and_imports_only_below_it():
    mods = _modules()
    found = imports(mods)
    # the checker sees what it must: relative imports inside functions (of a module, of the root
    # package), a constant-prefixed importlib name
    pairs = {(m, t) for m, t, _ in found}
    assert {("wide.kernels.attention", "wide.base.timing"), ("wide.commands.sampling_data", "wide"),
            ("wide.cli", "wide.benchmarks")} <= pairs
    assert layer_violations(mods) == []


def test_kept_and_dropped_module_paths():
    """wide.fine and wide.pretrained (modules of the public API, README's examples) name the modules
    that moved; wide.cli and wide.harness never moved (the console script, python -m wide.cli,
    lm-eval's entry point); every other pre-layout path is gone rather than shimmed."""
    import wide
    from wide.io import pretrained
    from wide.method import fine

    assert importlib.import_module("wide.fine") is fine is wide.fine
    assert importlib.import_module("wide.pretrained") is pretrained is wide.pretrained
    from wide.fine import FineConfig  # noqa: F401
    from wide.pretrained import names  # noqa: F401
    for kept in ("wide.cli", "wide.harness", "wide.kernels", "wide.data", "wide.benchmarks"):
        assert importlib.util.find_spec(kept) is not None, kept
    for gone in ("wide.arch", "wide.modeling", "wide.inference", "wide.train", "wide.runs", "wide.timing"):
        assert importlib.util.find_spec(gone) is None, gone


def _jit_functions(path: Path) -> list:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    names.append(node.name)
    return names


@pytest.mark.parametrize("path", sorted(p for p in (SRC / "wide").rglob("*.py") if "kernels" not in p.parts),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_triton_kernels_live_in_kernels(path):
    assert _jit_functions(path) == [], f"{path.name} defines Triton kernels: move them to wide/kernels/"


def test_engine_is_small():
    lines = (SRC / "wide" / "engine" / "inference.py").read_text().count("\n")
    assert lines < 700, f"inference.py has {lines} lines: the engine should read like gpt-fast's generate.py"
