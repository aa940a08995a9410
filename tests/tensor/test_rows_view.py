"""One read of a NestedTensor's rows per graph (padless.tensor.core.values_of): a leaf read by
several ops (a residual ``lin(x) + x``) hands out its rows as the autograd leaf
(padless.tensor.leaf_rows), with no view node; a leaf with a hook is one recorded view whose dense
gradients autograd sums on the rows, and that view is forgotten once the rows are written or
replaced. Gradients are checked against the dense ops on each sample alone."""

from __future__ import annotations

import torch

import padless
from padless.testing.reference import graph_nodes
from padless.tensor.core import values_of

LENGTHS = [3, 0, 5, 1]


def _leaf(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in lengths]
    return xs, padless.from_list([x.clone() for x in xs]).requires_grad_()


def _nodes(fn) -> list[str]:
    return sorted(type(n).__name__ for n in graph_nodes(fn))


def _residual(lengths, hooked=False):
    xs, x = _leaf(lengths)
    if hooked:
        x.register_hook(lambda g: g)
    torch.manual_seed(1)
    lin, ln = torch.nn.Linear(4, 4).double(), torch.nn.LayerNorm(4).double()
    chain = lambda t: torch.softmax(ln(torch.relu(lin(t)) + t), -1)  # noqa: E731
    loss = chain(x).values().pow(2).sum()
    # two reads of x: one view node when x has a hook, else none (its rows are the leaf)
    assert _nodes(loss.grad_fn).count("_ValuesViewBackward") == int(hooked)
    loss.backward()
    leaves = [a.clone().requires_grad_() for a in xs]
    sum(chain(a).pow(2).sum() for a in leaves).backward()
    for i, a in enumerate(leaves):
        torch.testing.assert_close(x.grad.values()[sum(lengths[:i]):sum(lengths[: i + 1])], a.grad)


def test_two_reads_are_one_view():
    _, x = _leaf()
    assert values_of(x) is values_of(x)
    _residual(LENGTHS)
    _residual(LENGTHS, hooked=True)


def test_one_sample_and_empty():
    _residual([4])
    _residual([0, 2])
    _residual([0, 2], hooked=True)


def test_written_rows_are_read_again():
    _, x = _leaf()
    x.register_hook(lambda g: g)  # a leaf with a hook is read through a view
    first = values_of(x)
    with torch.no_grad():
        x.values().mul_(2)  # the rows moved on: the old view is not their view any more
    again = values_of(x)
    assert again is not first
    torch.testing.assert_close(again, x._values)


def test_written_leaf_rows_are_its_rows():
    _, x = _leaf()
    first = values_of(x)  # the leaf's rows alias its values (storage and version counter)
    with torch.no_grad():
        x.values().mul_(2)
    assert values_of(x) is first
    torch.testing.assert_close(first, x._values)


def test_replaced_rows_are_read_again():
    _, x = _leaf()
    first = values_of(x)
    _, other = _leaf(seed=3)
    x.data = other.detach()
    assert "_rows_view" not in x.__dict__ and "_leaf_rows" not in x.__dict__  # the old rows are not kept by x
    again = values_of(x)
    assert again is not first
    torch.testing.assert_close(again, other._values)
    again.sum().backward()
    torch.testing.assert_close(x.grad.values(), torch.ones_like(other._values))

