"""``x[index] = value`` on a NestedTensor (``__setitem__``).

The view ``x[index]`` is taken as ``__getitem__`` takes it and filled or copied into: numbers
and 0-d tensors fill, tensors are copied (dense ones broadcast as the op layer broadcasts them,
padded coordinates included; NestedTensors of the view's structure). Sub-batches, samples
and indexing of static dims are views of ``x``'s rows; windows and positions of ragged dims
write through (:mod:`padless.tensor.views`)::

    x[:, :1] = 0          the first row of every sample (a sample may have none)
    x[:, -1] = t          the last row of every sample, t dense (B, C) or a number
    x[:, :2, 0] = 5.0     channel 0 of the first two rows of every sample
    x[1:] = 0, x[0] = s   samples
    x[idx] = v            whole samples at a list, index tensor or mask (index_put_)
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from padless.ops.common.structure import call
from padless.ops.rows.windows import take_windows
from padless.tensor.views import SETITEM, is_view, write_through
from padless.tensor.convert import _expand_index, getitem, index_ints, select_samples
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements, lend


def _advanced(e: Any) -> bool:
    return isinstance(e, (list, tuple)) or (isinstance(e, Tensor) and (e.dim() > 0 or e.dtype == torch.bool))


def _fill(view: Any, value: Any) -> None:
    """``view[...] = value`` for the view an index took."""
    if isinstance(value, numbers.Number) or (isinstance(value, Tensor) and not isinstance(value, NestedTensor) and value.dim() == 0):
        src = None
    elif isinstance(value, Tensor):
        src = value
    else:
        src = torch.as_tensor(value, device=view.device)
    if is_view(view):
        write_through(view, torch.Tensor.fill_ if src is None else torch.Tensor.copy_, (view, value if src is None else src), {})
        return
    with torch._C.DisableTorchFunctionSubclass():
        view.fill_(value) if src is None else view.copy_(src)


@lend("setitem")  # a write through a window then into static dims (padless.tensor.views)
@implements(torch.Tensor.__setitem__, accepts="packed; the index forms of __getitem__; a number, dense or packed value")
def setitem(func, nt: NestedTensor, index: Any, value: Any) -> None:
    """``nt[index] = value``: the view ``nt[index]`` filled or copied into (module docstring)."""
    entries = _expand_index(index_ints(index), nt.dim())
    batch, rest = entries[0], entries[1:]
    if batch is None:
        raise IndexError("NestedTensor indexing: None before the batch dim would add a dim in front of the batch")
    whole = all(isinstance(e, slice) and e == slice(None) for e in rest)
    if _advanced(batch):
        if not whole:
            raise StructureError(
                f"NestedTensor __setitem__: a batch index of type {type(batch).__name__} with an index inside the "
                "samples is not supported; write samples one by one (x[i][...] = v), or whole samples (x[idx] = v)"
            )
        call(torch.Tensor.index_put_, nt, (torch.as_tensor(batch),), torch.as_tensor(value, device=nt.device))
        return
    if isinstance(batch, slice) and batch != slice(None):
        setitem(func, select_samples(nt, batch), (slice(None), *rest), value)  # a view of nt's rows
        return
    if whole and isinstance(batch, slice):
        _fill(nt, value)
        return
    if not isinstance(batch, slice):  # one sample: a dense view of its rows
        _fill(getitem(nt, tuple(entries)), value)
        return
    view, remaining = take_windows(nt, rest)
    if view is nt:  # indexing of static dims: a view of nt's rows
        _fill(getitem(nt, (slice(None), *rest)), value)
    elif all(isinstance(e, slice) and e == slice(None) for e in remaining):
        _fill(view, value)
    else:  # a window or position, then static dims inside it
        write_through(view, SETITEM, (view, (slice(None), *remaining), value), {})

