"""The examples in the loaders' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "padless.loaders",
    "padless.loaders._deps",
    "padless.loaders.constraints",
    "padless.loaders.distributed",
    "padless.loaders.errors",
    "padless.loaders.hf",
    "padless.loaders.image_folder",
    "padless.loaders.images",
    "padless.loaders.samplers.base",
    "padless.loaders.samplers.bucket",
    "padless.loaders.samplers.budget",
    "padless.loaders.samplers.random_batches",
    "padless.loaders.streaming",
    "padless.loaders.synthetic",
    "padless.loaders.tarstream",
    "padless.loaders.transforms",
    "padless.loaders.webdataset",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
