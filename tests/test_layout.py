"""The package's shape: small modules, and the op layer declared as families.

The import contract itself (layers, independent families, no cycle between files) is
checked by ``lint-imports`` in ``make test``, from ``[tool.importlinter]`` in pyproject.toml.
"""

from __future__ import annotations

import importlib
import pathlib

import padless.ops

PACKAGE = pathlib.Path(padless.ops.__file__).resolve().parents[1]
MAX_LINES = 600


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by meaning): {long}"


def test_every_family_is_a_package_that_registers_handlers():
    from padless.tensor.registry import registered

    modules = {h.module for h in registered()}
    for family in padless.ops.FAMILIES:
        pkg = importlib.import_module(f"padless.ops.{family}")
        assert pathlib.Path(pkg.__file__).name == "__init__.py", family
        assert any(m.startswith(f"padless.ops.{family}.") for m in modules), f"{family} registers no handler"


def test_one_public_attention_entry():
    import padless.ops.attention as attention

    assert attention.__all__ == ["attention", "explain", "row_attention"]
    assert not hasattr(padless.ops, "attention_rows")
