"""Every public name of ``padless`` explains itself: a docstring with what it takes, what it
returns and an example, and that example runs."""

import doctest
import inspect

import pytest

import padless

NAMES = sorted(padless.__all__)


def _doc(name):
    return inspect.getdoc(getattr(padless, name)) or ""


@pytest.mark.parametrize("name", NAMES)
def test_public_name_has_a_docstring_with_an_example(name):
    doc = _doc(name)
    assert len(doc.splitlines()) >= 6, f"padless.{name}: docstring too short ({len(doc.splitlines())} lines)"
    assert ">>>" in doc or "::" in doc, f"padless.{name}: docstring has no example"


@pytest.mark.parametrize("name", NAMES)
def test_public_docstring_examples_run(name):
    obj = getattr(padless, name)
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    import torch

    module = inspect.getmodule(obj)
    globs = {**(vars(module) if module is not None else {}), "torch": torch, "padless": padless}
    for test in finder.find(obj, f"padless.{name}", globs=globs):
        runner.run(test)
    assert runner.failures == 0


def test_collate_is_the_function_and_collation_the_package():
    import importlib

    assert callable(padless.collate) and padless.collate.__module__ == "padless.collation.collate"
    assert importlib.import_module("padless.collation").Collator is padless.Collator
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("padless.collate")  # no package hides behind the function
