"""The code layout the README promises: no import cycles among wide's modules (imports inside
functions count too), every Triton kernel under wide/kernels/, and an engine module that holds
none."""

import ast
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
