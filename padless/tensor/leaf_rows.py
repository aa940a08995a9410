"""A leaf NestedTensor's rows as the autograd leaf: row-wise ops read them with no view node.

A leaf ``x`` (``from_list(..., requires_grad=True)``, ``x.detach().requires_grad_()``) is read by
row-wise ops through :func:`padless.tensor.core.values_of`. Recording that read as an op on ``x``
(a view whose backward wraps the rows' gradient as a NestedTensor, then ``AccumulateGrad`` of a
NestedTensor gradient) costs a Python ``autograd.Function`` forward and backward and a wrapper
per step. Instead ``x`` keeps one alias of its rows (:func:`leaf_rows`: same storage, same
version counter) that is itself a leaf requiring grad; row-wise consumers record plain ops on it,
and autograd accumulates a plain gradient into ``rows.grad``::

    x = from_list(samples, requires_grad=True)     rows = x._values.detach().requires_grad_()
    lin(x).relu().sum().backward()                 rows.grad = dense (T, C) gradient
    x.grad                                         NestedTensor(rows.grad, x's structure), moved
                                                   into x's own .grad when read (fold)

Consumers on the general path (ATen handlers, the per-sample fallback) still record on ``x``
itself and accumulate into ``x``'s own ``.grad``: :func:`fold` adds what ``rows.grad`` gathered
into it whenever ``x.grad`` is read, so ``x.grad`` is the sum of both, and ``x.grad = None`` (or
any value) clears what the rows gathered. ``torch.autograd.grad(out, [x])`` and
``backward(inputs=[x])`` ask for both (:mod:`padless.tensor.grad_rows`). A hook on ``x`` sends
later reads back through the recorded view (every gradient then reaches the hook once) and is
also put on rows read before it was registered; a graph built before the hook that read ``x``
both ways (rare: nearly every handler reads rows) calls it once per way, each with its part.
Under ``torch.compile`` and functorch transforms the read stays the recorded view.
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.tensor.autograd import nested_from_values
from padless.tensor.core import NestedTensor
from padless.tensor.registry import lend

KEY = "_leaf_rows"  # x.__dict__[KEY] = (rows, the values they alias)


@lend("leaf_rows")  # values_of (tensor.core) calls it; core cannot import this module
def leaf_rows(nt: NestedTensor) -> Tensor:
    """The rows of leaf ``nt`` as a leaf requiring grad (made once, then the same tensor while
    ``nt`` keeps the same values)."""
    d = nt.__dict__
    hit = d.get(KEY)
    if hit is not None:
        if hit[1] is nt._values:
            return hit[0]
        fold(nt)  # values replaced (nt.data = ...): what the old rows gathered is kept
    rows = nt._values.detach().requires_grad_()
    d[KEY] = (rows, nt._values)
    return rows


def pending_rows(nt: NestedTensor) -> Tensor | None:
    """The rows of leaf ``nt`` read by row-wise ops, when they are still its rows; None otherwise."""
    hit = nt.__dict__.get(KEY)
    return None if hit is None or hit[1] is not nt._values else hit[0]


def _set_grad(nt: NestedTensor, g: Tensor | None) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.grad.__set__(nt, g)


def _get_grad(nt: NestedTensor) -> Tensor | None:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.grad.__get__(nt)


def as_gradient(g: Tensor, nt: NestedTensor) -> NestedTensor:
    """A gradient ``g`` of ``nt``'s rows as ``nt``'s gradient (with its history under ``create_graph``)."""
    if g.requires_grad and torch.is_grad_enabled():
        return nested_from_values(g, nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
    return NestedTensor(g, nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)


def fold(nt: NestedTensor) -> None:
    """Add the gradient gathered on ``nt``'s rows into ``nt.grad`` and clear it from the rows, as
    ``AccumulateGrad`` accumulates (in place, or out of place when either carries history)."""
    hit = nt.__dict__.get(KEY)
    if hit is None:
        return
    rows = hit[0]
    g = rows.grad
    if g is None:
        return
    rows.grad = None
    new = as_gradient(g, nt)
    old = _get_grad(nt)
    if old is None:
        _set_grad(nt, new)
    elif old.requires_grad or g.requires_grad or not isinstance(old, NestedTensor) or old._meta is not nt._meta:
        with torch._C.DisableTorchFunctionSubclass():
            _set_grad(nt, old + new)
    else:
        with torch.no_grad():
            old._values.add_(g)


def clear(nt: NestedTensor) -> None:
    """Forget the gradient gathered on ``nt``'s rows (``nt.grad = ...`` replaces it)."""
    hit = nt.__dict__.get(KEY)
    if hit is not None:
        hit[0].grad = None
