"""Sizes that only the data knows, for ops that build a new structure under ``torch.compile``.

Eagerly, an op that makes new samples (``torch.cat`` along a ragged dim, ``from_padded``
with lengths) reads their envelope, the largest extent per ragged dim, from host sizes.
Inside a compiled graph the sizes are runtime tensors, and ``int(sizes.max())`` would be
a data-dependent ``.item()`` (a graph break, an error with ``fullgraph=True``). The ops
below are ``torch.library`` custom ops whose fake implementations give such values as
*unbacked* sizes (``ctx.new_dynamic_size()``): the graph carries them as symbols, computed
once at run time by the real implementation.

Row counts are not made here when they follow from sizes the compiler already knows
(``cat`` along a ragged dim has the rows of its inputs together; ``narrow`` of the only
ragged dim has ``B * length``); only what no input size can express is.

The ops: :func:`extent_carrier` (an envelope extent, carried on the new structure as the
inner tensor ``_env<d>`` so the symbol stays bound), :func:`total_carrier` (a new row
count), :func:`masked_rows` and :func:`row_range` (row indices of data-dependent length),
:func:`select_sample` (``nt[i]`` with its own extents, differentiable).

Example: the envelope of ``torch.cat([x, y], dim=1)`` for samples ``(L_i, C)`` and
``(M_i, C)`` is ``max_i (L_i + M_i)``::

    lens = x.sizes()[:, 0] + y.sizes()[:, 0]     # tensor [5, 3, 9]
    traced_max(lens)                              # 9 eagerly; an unbacked SymInt u0 in a graph
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from padless.tensor.dynamo import _is_traced
from padless.tensor.layout import sample_view
from padless.tensor.structure import StructureMeta, register_carried

#: Carried names of the extent carriers, one per sample dim: a structure built under compile
#: with a data-dependent envelope extent along sample dim ``d`` caches its carrier under
#: ``("env<d>", device)``, so ``__tensor_flatten__`` hands it to the compiler as an inner
#: tensor and the unbacked symbol in the outer size is bound to a graph output.
ENVELOPE_KEYS = tuple(register_carried(f"env{d}") for d in range(8))


@torch.library.custom_op("padless::extent_carrier", mutates_args=())
def extent_carrier(counts: Tensor) -> Tensor:
    """An empty ``int8`` tensor of length ``max(counts)`` (0 when ``counts`` is empty)."""
    n = int(counts.max()) if counts.numel() else 0
    return torch.empty((max(n, 0),), dtype=torch.int8, device=counts.device)


@extent_carrier.register_fake
def _extent_carrier_fake(counts: Tensor) -> Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return counts.new_empty((n,), dtype=torch.int8)


def traced_max(counts: Tensor, meta: StructureMeta | None = None, dim: int = 0) -> int | torch.SymInt:
    """``max(counts)`` as a size: a python int eagerly; under compile an unbacked SymInt,
    whose carrier is cached on ``meta`` for sample dim ``dim`` (see :data:`ENVELOPE_KEYS`)."""
    if not _is_traced(counts):
        return int(counts.max()) if counts.numel() else 0
    carrier = extent_carrier(counts)
    if meta is not None:
        if dim >= len(ENVELOPE_KEYS):
            raise NotImplementedError(f"padless: a new envelope extent along sample dim {dim} under torch.compile (at most {len(ENVELOPE_KEYS)} dims)")
        meta.derived[(ENVELOPE_KEYS[dim], counts.device)] = carrier
    return carrier.shape[0]


@torch.library.custom_op("padless::total_carrier", mutates_args=())
def total_carrier(counts: Tensor) -> Tensor:
    """An empty ``int8`` tensor of length ``sum(counts)``: a new row count as a size."""
    return torch.empty((int(counts.sum()),), dtype=torch.int8, device=counts.device)


@total_carrier.register_fake
def _total_carrier_fake(counts: Tensor) -> Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return counts.new_empty((n,), dtype=torch.int8)


def traced_sum(counts: Tensor) -> int | torch.SymInt:
    """``sum(counts)`` as a size (a row count no input size gives): a python int eagerly,
    an unbacked SymInt under compile (bound by the ``values`` of the structure it sizes)."""
    if not _is_traced(counts):
        return int(counts.sum())
    return total_carrier(counts).shape[0]


@torch.library.custom_op("padless::masked_rows", mutates_args=())
def masked_rows(mask: Tensor) -> Tensor:
    """Flat indices where the bool ``mask`` is True (``mask.nonzero()`` as a 1-D int64 tensor),
    with a data-dependent length that compiled graphs see as an unbacked size."""
    return mask.reshape(-1).nonzero().reshape(-1)


@masked_rows.register_fake
def _masked_rows_fake(mask: Tensor) -> Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return mask.new_empty((n,), dtype=torch.int64)



# ---------------------------------------------------------------------------- one sample


@torch.library.custom_op("padless::select_sample", mutates_args=())
def select_sample(values: Tensor, offsets: Tensor, sizes: Tensor, index: int, order: list[int]) -> Tensor:
    """Sample ``index`` as a dense tensor in its own dim order (a copy): rows
    ``offsets[index]:offsets[index + 1]`` of ``values`` viewed as that sample's shape.

    ``order`` is the storage order of the sample dims (ragged dims first). Under compile the
    sample's ragged extents are unbacked sizes: ``nt[i]`` compiles without reading sizes."""
    lo, hi = int(offsets[index]), int(offsets[index + 1])
    shape = [int(s) for s in sizes[index].tolist()]
    return sample_view(values[lo:hi], shape, order).clone()


@select_sample.register_fake
def _select_sample_fake(values: Tensor, offsets: Tensor, sizes: Tensor, index: int, order: list[int]) -> Tensor:
    ctx = torch.library.get_ctx()
    n_ragged = len(order) - (values.dim() - 1)
    ext = {d: ctx.new_dynamic_size() for d in order[:n_ragged]}  # the sample's ragged extents
    ext.update(zip(order[n_ragged:], values.shape[1:]))  # static extents, as stored
    return values.new_empty([ext[d] for d in range(len(order))])


@torch.library.custom_op("padless::select_sample_backward", mutates_args=())
def select_sample_backward(
    grad: Tensor, offsets: Tensor, sizes: Tensor, index: int, order: list[int], values_shape: list[int]
) -> Tensor:
    """Gradient of :func:`select_sample` w.r.t. ``values``: zeros with the sample's rows filled."""
    out = grad.new_zeros(values_shape)
    lo, hi = int(offsets[index]), int(offsets[index + 1])
    out[lo:hi] = grad.permute(order).reshape(hi - lo, *values_shape[1:])
    return out


@select_sample_backward.register_fake
def _select_sample_backward_fake(grad, offsets, sizes, index, order, values_shape):
    return grad.new_empty(values_shape)


def _select_sample_setup(ctx, inputs, output) -> None:
    values, offsets, sizes, index, order = inputs
    ctx.save_for_backward(offsets, sizes)
    ctx.index, ctx.order, ctx.values_shape = index, order, list(values.shape)


def _select_sample_grad(ctx, grad: Tensor):
    offsets, sizes = ctx.saved_tensors
    g = select_sample_backward(grad.contiguous(), offsets, sizes, ctx.index, ctx.order, ctx.values_shape)
    return g, None, None, None, None


select_sample.register_autograd(_select_sample_grad, setup_context=_select_sample_setup)


# ---------------------------------------------------------------------------- row ranges


@torch.library.custom_op("padless::row_range", mutates_args=())
def row_range(offsets: Tensor, lo: int, hi: int) -> Tensor:
    """``arange(offsets[lo], offsets[hi])``: the rows of segments ``lo..hi-1`` (e.g. one key's
    ids in a KeyedJaggedTensor), whose count compiled graphs see as an unbacked size."""
    return torch.arange(int(offsets[lo]), int(offsets[hi]), dtype=torch.int64, device=offsets.device)


@row_range.register_fake
def _row_range_fake(offsets: Tensor, lo: int, hi: int) -> Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return offsets.new_empty((n,), dtype=torch.int64)


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd back on inside a ``torch.library.custom_op`` implementation.

    The dispatcher runs a custom op's implementation below the autograd dispatch keys (they
    are in the thread's exclude set), so a backward op that recomputes its forward per sample
    and differentiates it (attention with dropout or masks, row attention, the image islands)
    must take them out of the exclude set again for the recompute. This uses torch's private
    ``_ForceDispatchKeyGuard``; it is the one place padless does.
    """
    keys = torch._C.DispatchKey
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.ADInplaceOrView, keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield
