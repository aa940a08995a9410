"""The handler registries: double registration, coverage table."""

import subprocess
import sys

import pytest
import torch

from padless.tensor.registry import RegistrationError, implements, implements_aten, registered


def test_double_registration_is_an_error():
    with pytest.raises(RegistrationError, match=r"torch.nn.functional.linear already has a function-level handler \(linear in padless.ops.linear_norm\)"):
        @implements(torch.nn.functional.linear)
        def linear_again(func, *args):  # pragma: no cover
            pass

    with pytest.raises(RegistrationError, match=r"aten._to_copy.default already has a aten-level handler"):
        @implements_aten(torch.ops.aten._to_copy.default)
        def to_copy_again(func, *args):  # pragma: no cover
            pass


def test_every_handler_is_named_after_its_op_and_declares_inputs():
    rows = registered()
    assert len(rows) > 40
    for h in rows:
        assert h.handler.__name__ != "_" and h.accepts


def test_coverage_cli_prints_markdown_table():
    out = subprocess.run([sys.executable, "-m", "padless.ops", "--markdown"], capture_output=True, text=True, check=True).stdout
    assert "| `torch.nn.functional.linear` | function |" in out
    assert "| `aten._to_copy.default` | aten |" in out
