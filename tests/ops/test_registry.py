"""The handler registries: double registration, coverage table."""

import subprocess
import sys

import pytest
import torch

from padless.tensor.registry import RegistrationError, implements, implements_aten, registered


def test_double_registration_is_an_error():
    with pytest.raises(RegistrationError, match=r"torch.nn.functional.linear already has a function-level handler \(linear in padless.ops.rows.linear_norm\)"):
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


def test_the_tensor_layer_borrows_from_the_op_layer_by_name():
    """padless.tensor never imports padless.ops: the op layer lends what the tensor layer calls."""
    import pathlib

    import padless
    from padless.tensor.registry import lend, lent

    root = pathlib.Path(padless.__file__).parent / "tensor"
    for path in root.glob("*.py"):
        text = path.read_text()
        for layer in ("ops", "collate", "loaders", "jagged"):
            assert f"from padless.{layer}" not in text and f"import padless.{layer}" not in text, (path.name, layer)
    assert lent("pointwise_aten").__module__ == "padless.ops.common.engine"
    with pytest.raises(RegistrationError, match="'index_static' is already lent by padless.ops.rows.shape.index_static"):
        lend("index_static")(lambda nt, entries: nt)
    with pytest.raises(RuntimeError, match="'nothing' comes from the op layer, which is not loaded"):
        lent("nothing")
