"""The per-sample fallback for ATen ops without a handler."""

import warnings

import pytest
import torch

import padless
from padless.testing import check_op, make_batch


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("v", ["seq", "pair", "image", "empty_sample", "one_sample"])
def test_fallback_matches_dense_per_sample(v):
    check_op(lambda x: torch.flip(x, dims=[1]), v)
    check_op(lambda x: torch.roll(x, 1, dims=-1), v)
    check_op(lambda x: torch.cumprod(x, dim=-1), v, atol=1e-5, rtol=1e-5)


def test_fallback_tuple_outputs():
    nt, dense = make_batch("pair")
    out = torch.sort(nt, dim=2)
    padless.testing.assert_close_samples(out.values, [s.sort(dim=1).values for s in dense])
    padless.testing.assert_close_samples(out.indices, [s.sort(dim=1).indices for s in dense])


def test_fallback_op_that_moves_the_ragged_dim():
    """An op run sample by sample that moves the ragged dim (``transpose`` below the torch-function
    level, as a custom Function's backward runs it on torch < 2.12): the result's ragged dim is
    where the samples' extents now differ, one empty sample included."""
    from padless.tensor import fallback

    samples = [torch.randn(4, 3), torch.randn(4, 0), torch.randn(4, 2)]
    x = padless.from_list(samples, ragged_dims=(1,))
    out = fallback.per_sample(torch.ops.aten.transpose.int, (x, 1, 2), {})
    assert out.ragged_dims == (0,)
    padless.testing.assert_close_samples(out, [s.t() for s in samples])


def test_fallback_warns_once_per_op():
    from padless.tensor import core

    core._WARNED.discard(("per_sample", torch.ops.aten.flip.default))
    nt, _ = make_batch("seq")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.flip(nt, dims=[1])
        torch.flip(nt, dims=[1])
    msgs = [str(w.message) for w in rec if "sample by sample" in str(w.message)]
    assert msgs == [
        "padless: aten.flip.default has no NestedTensor handler; running it sample by sample "
        "(eager only, a Python loop: slow). Please report it so it gets a packed implementation."
    ]


def test_fallback_refusals():
    nt, _ = make_batch("seq")
    with pytest.raises(NotImplementedError, match=r"argument dim=0 names the batch dim"):
        torch.cumprod(nt, dim=0)
    with pytest.raises(NotImplementedError, match=r"argument size is a size list"):
        torch.ops.aten.view.default(nt, [3, -1])
    with pytest.raises(NotImplementedError, match=r"it is an in-place or out= op"):
        torch.ops.aten.cumprod_.default(nt, 1)


def test_fallback_is_eager_only():
    nt, _ = make_batch("seq")
    f = torch.compile(lambda x: torch.flip(x, dims=[1]), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="eager-only"):
        f(nt)
