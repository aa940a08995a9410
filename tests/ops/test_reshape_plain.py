"""Reshape targets of plain ints that have two readings (issue 39, fuzzer entry
``reshape_plain``): a plain int equal to the envelope at a ragged position keeps that ragged
dim, but when a ``-1`` of the same target could absorb the ragged dim instead (what each
sample alone does), or a leading ``B`` is also ``B * 1`` (a fold of a ragged dim of envelope
1), the target is refused, naming both readings and the rewrite. Sizes read from the shape
resolve it, per sample."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.tensor.errors import StructureError
from padless.testing import check_samples, leaves


def test_plain_int_with_inferred_static_dim_is_refused():
    # (L_i, 2) samples of envelope (2, 2): x.reshape(B, 2, -1) is (2, L_i) on each sample alone,
    # the identity on the padded envelope; it used to give the identity silently
    x = padless.from_list([torch.randn(2, 2), torch.randn(1, 2), torch.randn(0, 2)])
    for op in ("reshape", "view"):
        with pytest.raises(StructureError, match=rf"{op}\(\): target \(3, 2, -1\) is ambiguous .* -1 absorbs the ragged dim.*"
                           rf"{op}\(3, x.shape\[1\], -1\) keeps the ragged dim, {op}\(3, 2, x.shape\[1\]\) is each sample's own"):
            getattr(x, op)(3, 2, -1)


@pytest.mark.parametrize("shapes", [[(2, 2), (1, 2), (0, 2)], [(2, 2)]], ids=["batch", "one_sample"])
def test_sizes_from_the_shape_resolve_both_readings(shapes):
    nts = [leaves(shapes, 1, dtype=torch.float64)]
    check_samples(lambda x: x.reshape(x.shape[0], 2, x.shape[1]), lambda s: s.reshape(2, s.shape[0]), nts)
    nts = [leaves(shapes, 2, dtype=torch.float64)]
    check_samples(lambda x: x.reshape(x.shape[0], x.shape[1], -1), lambda s: s.reshape(s.shape[0], 2), nts)  # -1 is 2 (an empty sample alone cannot infer it)


def test_unambiguous_plain_targets_still_work():
    # a ragged dim written -1 with plain static sizes: every sample alone reads it the same way
    nts = [leaves([(3, 2, 4), (1, 2, 4), (0, 2, 4)], 3, dtype=torch.float64)]
    check_samples(lambda x: x.reshape(3, -1, 8), lambda s: s.reshape(-1, 8), nts)
    # the envelope int with no -1 (padded code's (B, N, H * D)): kept as the ragged dim
    x = padless.from_list([torch.randn(3, 2, 4), torch.randn(1, 2, 4)])
    y = x.reshape(2, 3, 8)
    assert [tuple(s.shape) for s in y.unbind()] == [(3, 8), (1, 8)]


def test_batch_entry_that_is_also_a_fold_of_envelope_one_is_refused():
    # (L_i, 3) samples of envelope (1, 3): x.view(B, -1) flattens each sample alone, but B == B * 1
    # also folds the ragged dim into the batch (it used to fold: one sample per row)
    x = padless.from_list([torch.randn(0, 3), torch.randn(1, 3)])
    with pytest.raises(StructureError, match=r"view\(\): target \(2, -1\) is ambiguous .* both the batch size and batch \* "
                       r"envelope of ragged dim 1 .* x.flatten\(0, 1\)"):
        x.view(2, -1)
    folded = x.flatten(0, 1)  # the fold, said unambiguously
    assert folded.batch_size == 1


def test_a_ragged_dim_written_as_its_envelope_int_is_refused_where_a_sample_reads_it_otherwise():
    """``(B, -1, 1)`` of samples (2, 1, 1), (3, 1, 0): the plain int 1 is ragged dim 3's envelope,
    but sample 1 alone reshapes to (0, 1), not the kept (3, 0) (a silent wrong structure found by
    the long fuzz run, seed 323204): refused, naming the rewrite. Where every sample reads the
    ints as the kept shape, or none can take them alone, the kept reading stands."""
    xs = [torch.randn(2, 1, 1), torch.randn(3, 1, 0)]
    x = padless.from_list(xs, ragged_dims=(0, 2))
    with pytest.raises(padless.StructureError, match=r"sample 1 of shape \(3, 1, 0\) alone reads these ints as \(0, 1\), "
                       r"not \(3, 0\).*x\.shape\[3\]\) or as -1"):
        x.reshape(2, -1, 1)
    ys = [torch.randn(2, 1, 1), torch.randn(3, 1, 1)]
    y = padless.from_list(ys, ragged_dims=(0, 2))
    for got, d in zip(y.reshape(2, -1, 1).unbind(), ys):
        torch.testing.assert_close(got, d.reshape(-1, 1))
