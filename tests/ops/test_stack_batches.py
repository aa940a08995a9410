"""``torch.stack(batches, dim=0)`` of NestedTensors of one structure (padless.ops.rows.stacked):
a StackedBatch reduced (``.sum(0)``, ``.mean(0)``, ``.amax(0)``) or indexed (``[k]``)."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.ops.rows.stacked import StackedBatch
from padless.testing import check_samples, leaves

SEQ = [(3, 4), (0, 4), (5, 4), (1, 4)]
IMG = [(2, 4, 6), (2, 2, 2), (2, 3, 1)]
ONE = [(3, 4)]
REDUCE = {
    "sum0": (lambda s: s.sum(0), lambda *xs: torch.stack(xs).sum(0)),
    "torch_sum_dim0": (lambda s: torch.sum(s, dim=0), lambda *xs: torch.stack(xs).sum(0)),
    "mean0": (lambda s: s.mean(0), lambda *xs: torch.stack(xs).mean(0)),
    "amax0": (lambda s: s.amax(0), lambda *xs: torch.stack(xs).amax(0)),
    "amin0": (lambda s: s.amin(dim=0), lambda *xs: torch.stack(xs).amin(0)),
    # every member takes part, so every input gets a gradient
    "index1": (lambda s: s[1] * 2 + s.sum(0), lambda *xs: torch.stack(xs)[1] * 2 + torch.stack(xs).sum(0)),
    "index_neg_then_static": (
        lambda s: s[-1, ..., :1] + s[:2].sum(0)[..., :1],
        lambda *xs: torch.stack(xs)[-1][..., :1] + torch.stack(xs)[:2].sum(0)[..., :1],
    ),
    "sum0_keepdim_index": (lambda s: s.sum(0, keepdim=True)[0], lambda *xs: torch.stack(xs).sum(0, keepdim=True)[0]),
    "sum_inner_static": (lambda s: s.sum(-1).sum(0), lambda *xs: torch.stack(xs).sum(-1).sum(0)),
    "arith_then_sum": (lambda s: (s * 2 + 1).sum(0), lambda *xs: (torch.stack(xs) * 2 + 1).sum(0)),
}


def _batches(shapes, ragged=None, n=3):
    return [leaves(shapes, seed, ragged=ragged, dtype=torch.float64) for seed in range(n)]


@pytest.mark.parametrize("name", list(REDUCE))
@pytest.mark.parametrize("shapes, ragged", [(SEQ, None), (ONE, (0,)), (IMG, (1, 2))], ids=["seq", "one_sample", "images"])
def test_stack_then_reduce_or_index(name, shapes, ragged):
    fn, ref = REDUCE[name]
    check_samples(lambda *xs: fn(torch.stack(list(xs))), ref, _batches(shapes, ragged))


def test_fpn_merge_idiom():
    """segmentation-models-pytorch's FPN merge: ``torch.stack(features).sum(dim=0)``."""
    check_samples(
        lambda *xs: torch.stack(list(xs), dim=0).sum(dim=0),
        lambda *xs: torch.stack(xs, dim=0).sum(dim=0),
        _batches(IMG, (1, 2), n=4),
    )


def test_stacked_batch_looks_like_the_dense_stack():
    a = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    s = torch.stack([a, a * 2])
    assert isinstance(s, StackedBatch)
    assert s.shape == (2, 2, 3, 4) and s.dim() == 4 and len(s) == 2 and s.size(0) == 2
    torch.testing.assert_close(s[0].values(), a.values())  # a's values (a view that refuses writes)
    parts = s.unbind(0)
    torch.testing.assert_close(parts[1].values(), (a * 2).values())
    inner = s.nested()
    assert inner.shape == (2, 2, 3, 4)  # stacked inside every sample: (2, L_i, C)
    torch.testing.assert_close(inner.unbind()[1][1], (a * 2).unbind()[1])


def test_mean_over_everything_is_the_dense_mean():
    xs = [torch.randn(2, 4), torch.randn(3, 4)]
    a = padless.from_list(xs)
    s = torch.stack([a, a + 1])
    expect = torch.cat([torch.cat(xs), torch.cat(xs) + 1]).mean()
    torch.testing.assert_close(s.mean(), expect)


def test_stack_errors():
    a = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    b = padless.from_list([torch.randn(3, 4), torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"stack\(\): ragged structures differ"):
        torch.stack([a, b])
    with pytest.raises(ValueError, match=r"stack\(\): NestedTensors of shapes \(2, 3, 4\) and \(2, 3, 2\) differ in static extents"):
        torch.stack([a, a[..., :2]])
    s = torch.stack([a, a])
    with pytest.raises(NotImplementedError, match=r"softmax\(\): a StackedBatch .* reduce or index the stack dim first"):
        torch.softmax(s, 0)
    with pytest.raises(ValueError, match=r"a dense operand of shape \(2, 2, 3, 4\) spans the stack dim"):
        s + torch.randn(2, 2, 3, 4)


def test_a_member_written_after_stacking_is_refused_not_read():
    """Dense ``torch.stack`` copies: ``a.add_(10)`` afterwards leaves the stack as it was. The
    stack here holds its members, so a use after such a write raises instead of reading 13."""
    a = padless.from_list([torch.ones(2, 1), torch.ones(1, 1)])
    b = a * 2
    s = torch.stack([a, b])
    torch.testing.assert_close(s.sum(0).values(), torch.full((3, 1), 3.0))  # before the write: fine
    a.add_(10)
    for use in (lambda: s.sum(0), lambda: s[1], lambda: s * 2, lambda: s.unbind(0), lambda: s.amax(0), lambda: list(s)):
        with pytest.raises(RuntimeError, match=r"stack\(\): member 0 of the stack was written in place after torch.stack.*t.clone\(\)"):
            use()


def test_stacking_under_inference_mode_copies():
    """Inference tensors have no version counter to watch: they are copied when stacked."""
    with torch.inference_mode():
        a = padless.from_list([torch.ones(2, 1), torch.ones(1, 1)])
        s = torch.stack([a, a * 2])
        a.add_(10)
        torch.testing.assert_close(s.sum(0).values(), torch.full((3, 1), 3.0))


def test_a_member_handed_out_refuses_writes():
    a = padless.from_list([torch.ones(2, 1), torch.ones(1, 1)])
    s = torch.stack([a, a * 2])
    with pytest.raises(RuntimeError, match=r"s\[k\] \(and unbind, iteration\) hands out a member of the stack.*y = s\[k\] \+ 1"):
        s[0].add_(1)
    with pytest.raises(RuntimeError, match="hands out a member of the stack"):
        s.unbind(0)[1].zero_()
    torch.testing.assert_close(a.values(), torch.ones(3, 1))  # nothing was written
    torch.testing.assert_close((s[0] + 1).values(), torch.full((3, 1), 2.0))


def test_stacked_batch_out_of_range_and_missing_methods_name_the_fix():
    a = padless.from_list([torch.ones(2, 1), torch.ones(1, 1)])
    s = torch.stack([a, a])
    with pytest.raises(IndexError, match=r"index 5 is out of range for a stack of 2 members"):
        s[5]
    for name in ("max", "softmax", "exp"):
        with pytest.raises(AttributeError, match=rf"StackedBatch.{name}: .* supports sum/mean/amax/amin.*s.sum\(0\).*torch.stack\(tensors, dim=1\)"):
            getattr(s, name)
    with pytest.raises(AttributeError, match=r"StackedBatch.add_\(\): a stack of NestedTensors is not written in place.*s \+ 1"):
        s.add_(1)
    assert not hasattr(s, "max") and not hasattr(s, "no_such_name")
