"""Every self-contained ```python block of README.md and of the pages in docs/ runs.

A block is self-contained when every name it reads is defined in the block itself (by an
assignment, an import, a ``def``/``class``, a loop or ``with`` target) or is a builtin.
Blocks that read names they do not define (``model``, ``dataset``: sketches of a user's
own code) are reported as skipped, naming those names, so an edit of the page can make
them runnable. A block that touches CUDA runs on the CPU when no GPU is present only if
it chooses its device itself.
"""

from __future__ import annotations

import ast
import builtins
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python\s*\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, source)`` of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def free_names(source: str) -> set[str]:
    """Names the block reads but never defines (builtins excluded)."""
    tree = ast.parse(source)
    loaded: set[str] = set()
    defined: set[str] = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                defined.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return loaded - defined


def markdown_pages() -> list[pathlib.Path]:
    """README.md and every page of docs/ (docs/ops.md is generated and holds no code)."""
    return [p for p in (README, *sorted(DOCS.glob("*.md"))) if p.exists()]


BLOCKS = [
    (page.relative_to(ROOT).as_posix(), line, source)
    for page in markdown_pages()
    for line, source in python_blocks(page.read_text())
]


def test_finds_blocks_and_free_names():
    assert free_names("import torch\nx = torch.ones(2)\nprint(x, y)") == {"y"}
    assert free_names("def f(a):\n    return a\n[f(i) for i in range(2)]") == set()
    assert python_blocks("text\n```python\nx = 1\n```\nmore\n") == [(2, "x = 1\n")]


def test_readme_and_docs_have_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert "README.md" in pages and any(page.startswith("docs/") for page in pages)


@pytest.mark.parametrize("page, line, source", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_markdown_block_runs(page, line, source):
    missing = free_names(source)
    if missing:
        pytest.skip(f"{page}:{line} is a sketch: it reads {sorted(missing)} without defining them")
    exec(compile(source, f"{page}:{line}", "exec"), {"__name__": "__readme__"})
