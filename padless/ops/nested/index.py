"""``index_put`` with batch indices only, as ``torch.nested`` (NJT) does it.

``torch.index_put(nt, [batch], v)`` with one dense integer index tensor writes ``v`` to every
element of the samples ``batch`` names (NJT pads, writes ``padded[batch] = v`` and packs
again); with ``accumulate=True`` ``v`` is added once per occurrence of a sample in ``batch``.
Here that is one ``torch.where`` (or one multiply-add) over the packed rows: no padding, no
sync, differentiable w.r.t. ``nt`` and ``v``. ``v`` is the same for every written element up
to the static dims: a scalar or a tensor broadcasting against a sample with extent 1 along
its ragged dims (leading dims of extent 1 are allowed). Any layout works: several ragged dims,
or a transposed tensor (NJT refuses those, padless writes what the dense op on each sample
writes). Index lists of another form go to the ATen handler
(``padless.ops.nested.parity``: ``(batch, ragged, *rest)`` indices, a NestedTensor mask).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements


def _batch_only(indices: Any) -> bool:
    if not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return False
    t = indices[0]
    return isinstance(t, Tensor) and not isinstance(t, NestedTensor) and not t.is_floating_point() and t.dtype != torch.bool


def _value_rows(op: str, nt: NestedTensor, v: Tensor) -> Tensor:
    """``v`` (broadcasting against a sample, extent 1 along the ragged dims) as one row value
    broadcasting against ``values`` ``(T, *static)``, whose static dims are in storage order."""
    d = nt.sample_dim
    extra = max(v.dim() - d, 0)
    shape = (1,) * (d - v.dim() + extra) + tuple(v.shape[extra:])
    if any(n != 1 for n in v.shape[:extra]) or any(shape[r] != 1 for r in nt._ragged):
        static = tuple(n for i, n in enumerate(nt.shape[1:]) if i not in nt._ragged)
        raise StructureError(
            f"{op}(): with batch indices only, values must be the same for every element of a written "
            f"sample: a scalar or a tensor broadcasting against the static dims {static}; got shape "
            f"{tuple(v.shape)} (index the ragged dim too to write per element)"
        )
    v = v.reshape(shape).permute(list(nt.storage_order))  # sample dims in storage order
    return v.reshape(v.shape[len(nt._ragged) :])


def put_samples(op: str, nt: NestedTensor, batch: Tensor, v: Tensor, accumulate: bool) -> Tensor:
    """``nt`` with every element of samples ``batch`` set to (or, accumulating, increased by) ``v``."""
    if isinstance(v, NestedTensor):
        raise NotImplementedError(f"{op}(): values must be dense (a scalar or per static-dims values)")
    bsz = nt.batch_size
    batch = batch.to(nt._values.device)
    torch._assert_async(
        torch.all((batch >= -bsz) & (batch < bsz)), f"{op}(): a batch index (index 0) is out of range for {bsz} samples"
    )
    counts = torch.zeros(bsz, dtype=nt._values.dtype if accumulate else torch.int64, device=batch.device)
    counts = counts.index_add(0, batch.long() % max(bsz, 1), torch.ones_like(batch, dtype=counts.dtype))
    per_row = counts[nt.row_sample_ids()].view(-1, *([1] * (nt._values.dim() - 1)))
    vals = values_of(nt)
    v = _value_rows(op, nt, v).to(vals.dtype)
    out = vals + per_row * v if accumulate else torch.where(per_row > 0, v, vals)
    return rewrap(out, nt)


@implements(torch.index_put, torch.Tensor.index_put, accepts="packed input, dense batch indices, dense values")
def index_put_function(func, nt: Any, indices: Sequence[Any], values: Tensor, accumulate: bool = False) -> Any:
    """``torch.index_put(nt, [batch], v)``: every element of the samples named (see module docstring)."""
    if isinstance(nt, NestedTensor) and _batch_only(indices):
        return put_samples("index_put", nt, indices[0], values, accumulate)
    return func(nt, indices, values, accumulate)


@implements(torch.Tensor.index_put_, torch.index_put_, accepts="packed input, dense batch indices, dense values")
def index_put_inplace(func, nt: Any, indices: Sequence[Any], values: Tensor, accumulate: bool = False) -> Any:
    """``nt.index_put_([batch], v)``: :func:`put_samples` written into ``nt``'s buffer."""
    if not (isinstance(nt, NestedTensor) and _batch_only(indices)):
        return func(nt, indices, values, accumulate)
    if torch.is_grad_enabled() and (nt.requires_grad or (isinstance(values, Tensor) and values.requires_grad)):
        raise NotImplementedError(
            "index_put_(): batch indices only, in place, on tensors that require grad; use the out-of-place "
            "torch.index_put(nt, [batch], v), which is differentiable"
        )
    out = put_samples("index_put_", nt, indices[0], values, accumulate)
    nt._values.copy_(out._values)
    return nt
