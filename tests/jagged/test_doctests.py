"""The runnable examples in padless.jagged's docstrings."""

import doctest
import importlib

import pytest

MODULES = ["jagged_tensor", "keyed_jagged", "keyed_tensor", "pooling", "collate", "validate", "regroup"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f"padless.jagged.{name}")
    result = doctest.testmod(mod, extraglobs={"torch": importlib.import_module("torch")})
    assert result.failed == 0
