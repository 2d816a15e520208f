"""Relative links in the project's markdown resolve: README.md, docs/, every README under
bench/results/ and experiments/, and (in one test) every other markdown file there (results move
between those folders; a link left pointing at the old place fails here). Web links and in-page anchors are not followed; a link's own
#anchor is dropped before the check."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for top in ("bench/results", "experiments"):
        files += sorted((root / top).rglob("README.md"))
    return [f for f in files if f.is_file()]


def links(text: str) -> list:
    """The targets of a markdown text's links and images (inline and reference definitions),
    leaving out code blocks and code spans."""
    text = _CODE.sub("", _FENCE.sub("", text))
    found = [m.group(1) for m in _INLINE.finditer(text)] + [m.group(1) for m in _REFDEF.finditer(text)]
    return [t[1:-1] if t.startswith("<") else t for t in found]


def broken_links(path: Path) -> list:
    """(target, why) for every relative link of ``path`` that names nothing on disk."""
    bad = []
    for target in links(path.read_text(encoding="utf-8")):
        if _SCHEME.match(target) or target.startswith(("#", "//")):
            continue
        rel = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not rel:
            continue
        resolved = (path.parent / rel) if not rel.startswith("/") else (ROOT / rel.lstrip("/"))
        if not resolved.exists():
            bad.append((target, "missing"))
        elif rel.endswith("/") and not resolved.is_dir():
            bad.append((target, "not a folder"))
    return bad


def test_checker_finds_a_broken_link_and_passes_good_ones(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "there.md").write_text("x")
    md = tmp_path / "README.md"
    md.write_text(
        "[ok](sub/there.md#part) [dir](sub/) ![img](sub/there.md \"title\") [web](https://x.org/a)\n"
        "[anchor](#top) [gone](sub/moved.md) `[code](not/checked.md)`\n"
        "```\n[fenced](not/checked/either.md)\n```\n"
        "[ref]: sub/gone-too.md\n"
    )
    assert broken_links(md) == [("sub/moved.md", "missing"), ("sub/gone-too.md", "missing")]


def test_the_files_checked_hold_links():
    files = markdown_files()
    assert ROOT / "README.md" in files and ROOT / "bench/results/README.md" in files
    assert sum(len(links(f.read_text(encoding="utf-8"))) for f in files) > 100


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)} links to what is not there"


def test_the_other_markdown_under_bench_and_experiments_links_right():
    """Notes and generated tables beside the results (kernels_notes.md, e2e.md, ...)."""
    readmes = set(markdown_files())
    others = [f for top in ("bench", "experiments") for f in sorted((ROOT / top).rglob("*.md")) if f not in readmes]
    assert len(others) > 50
    bad = {str(f.relative_to(ROOT)): b for f in others if (b := broken_links(f))}
    assert bad == {}
