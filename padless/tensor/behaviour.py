"""Tensor behaviour of a NestedTensor: copies, moves, pinning, sharing, indexing, iteration.

These handlers keep the structure and act on the inner tensors declared in
``NestedTensor._INNER``, so adding an inner tensor needs no change here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.tensor import leaf_rows
from padless.tensor.convert import getitem, unbind_samples
from padless.tensor.core import NestedTensor, inner_tensors, wrap_like
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements, implements_aten, lent
from padless.tensor.errors import StructureError
from padless.tensor.structure import StructureMeta, check_same_structure

aten = torch.ops.aten


def _with_inner(nt: NestedTensor, tensors: list[Tensor]) -> NestedTensor:
    """``nt``'s structure around new inner tensors, given in ``NestedTensor._INNER`` order."""
    inner = dict(zip(nt._INNER, tensors))
    attrs = tuple(getattr(nt, a) for a in nt._ATTRS)
    out = NestedTensor.__tensor_unflatten__(inner, attrs, (nt.batch_size, *nt._env), None)
    out._meta = nt._meta
    return out


# ---------------------------------------------------------------------------- ATen level


@implements_aten(aten.detach.default, aten.alias.default)
def detach(func, nt: NestedTensor) -> NestedTensor:
    if torch.is_inference_mode_enabled() and not nt.is_inference():
        # autograd gives the result the input's version counter (it is a view of it): an
        # inference tensor has none, so the wrapper of a batch built outside the block must
        # not be one (as a plain tensor's detach inside inference_mode is a normal tensor)
        with torch.inference_mode(False):
            return wrap_like(func(nt._values), nt)
    return wrap_like(func(nt._values), nt)


@implements_aten(aten.clone.default)
def clone(func, nt: NestedTensor, *, memory_format=None) -> NestedTensor:
    # Metadata is immutable, so the clone shares it; only values are copied.
    return wrap_like(nt._values.clone(), nt)


@implements_aten(aten._to_copy.default)
def to_copy(func, nt: NestedTensor, **kwargs) -> NestedTensor:
    """``.to(device/dtype)``, ``.cuda()``, ``.cpu()``, ``.float()``...: values converted,
    offsets/sizes moved along (non_blocking honoured), host metadata kept."""
    kwargs.pop("memory_format", None)
    kwargs.pop("layout", None)
    values = func(nt._values, **kwargs)
    if values.device == nt._offsets.device:
        return NestedTensor(values, nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
    nb = kwargs.get("non_blocking", False)
    m = nt._meta
    src_o = m.host_offsets if m.host_offsets is not None else nt._offsets
    src_s = m.host_sizes if m.host_sizes is not None else nt._sizes
    offsets = src_o.to(values.device, non_blocking=nb)
    sizes = src_s.to(values.device, non_blocking=nb)
    meta = StructureMeta(m.host_sizes, m.host_offsets)
    return NestedTensor(values, offsets, sizes, nt._ragged, nt._env, meta)


@implements_aten(aten.copy_.default, accepts="packed; packed or dense source")
def copy_(func, dst: NestedTensor, src, non_blocking: bool = False) -> NestedTensor:
    if isinstance(src, NestedTensor):
        check_same_structure("copy_", dst, src)
        dst._values.copy_(src._values, non_blocking=non_blocking)
    else:
        dst._values.copy_(lent("dense_to_rows")("copy_", src, dst), non_blocking=non_blocking)
    return dst


@implements_aten(aten._pin_memory.default)
def pin_memory(func, nt: NestedTensor, device=None) -> NestedTensor:
    m = nt._meta
    meta = StructureMeta(
        None if m.host_sizes is None else m.host_sizes.pin_memory(),
        None if m.host_offsets is None else m.host_offsets.pin_memory(),
    )
    out = _with_inner(nt, [func(t, device) for t in inner_tensors(nt)])
    out._meta = meta
    return out


@implements_aten(aten.is_pinned.default)
def is_pinned(func, nt: NestedTensor, device=None) -> bool:
    return func(nt._values, device)


@implements_aten(aten.record_stream.default)
def record_stream(func, nt: NestedTensor, stream) -> None:
    for t in inner_tensors(nt):
        func(t, stream)


@implements_aten(
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
)
def like_factory(func, nt: NestedTensor, *args, **kwargs) -> NestedTensor:
    kwargs.pop("memory_format", None)
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev) != nt.device:
        return to_copy(aten._to_copy.default, like_factory(func, nt, *args, **{**kwargs, "device": None}), device=dev)
    kwargs.pop("device", None)
    return wrap_like(func(nt._values, *args, **kwargs), nt)


@implements_aten(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)
def fill_(func, nt: NestedTensor, *args) -> NestedTensor:
    func(nt._values, *args)
    return nt


@implements_aten(
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default,
)
def new_factory(func, nt: NestedTensor, size, *args, **kwargs) -> Tensor:
    """``x.new_zeros(size)`` and friends.

    A size equal to the envelope ``x.shape`` means "another tensor like x" (this is what
    autograd asks for when it lays out a gradient), so the result keeps x's structure;
    any other size gives a dense tensor, as in torch.
    """
    if tuple(size) != tuple(nt.shape):
        return func(nt._values, size, *args, **kwargs)
    if func is aten.new_empty_strided.default:
        return wrap_like(nt._values.new_empty(nt._values.shape, **kwargs), nt)
    return wrap_like(func(nt._values, nt._values.shape, *args, **kwargs), nt)


@implements_aten(aten.is_same_size.default)
def is_same_size(func, a, b) -> bool:
    if isinstance(a, NestedTensor) and isinstance(b, NestedTensor):
        return a.same_structure(b)
    return False


# ---------------------------------------------------------------------------- function level


@implements(torch.Tensor.__getitem__)
def getitem_(func, nt: NestedTensor, index):
    return getitem(nt, index)


@implements(torch.Tensor.data.__set__, accepts="a NestedTensor of the same structure, dtype and device")
def set_data(func, nt: NestedTensor, other) -> None:
    """``nt.data = other``: ``nt`` holds ``other``'s rows from now on (shared, as in torch), untracked by
    autograd. ``nt``'s shape, dtype and device are fixed when it is made, so ``other`` must agree."""
    if not isinstance(other, NestedTensor):
        raise StructureError(
            f"NestedTensor.data = ...: expected a NestedTensor of the same structure, got {type(other).__name__} of "
            f"shape {tuple(getattr(other, 'shape', ()))}; to write rows, use `with torch.no_grad(): nt.copy_(src)`"
        )
    if other.dtype != nt.dtype or other.device != nt.device or other._values.shape[1:] != nt._values.shape[1:]:
        raise StructureError(
            f"NestedTensor.data = ...: nt is {tuple(nt.shape)} {nt.dtype} on {nt.device}, the new data "
            f"{tuple(other.shape)} {other.dtype} on {other.device}; a NestedTensor's shape, dtype and device are "
            "fixed, so make a new one (nt = other) or convert first (other.to(nt.dtype))"
        )
    check_same_structure("NestedTensor.data =", nt, other)
    if type(nt) is not NestedTensor:  # a view or a canvas: from now on plain rows
        nt.__class__ = NestedTensor
    nt.__dict__.pop("_grad_rows", None)  # rows remembered from the op that built nt (tensor.autograd)
    nt.__dict__.pop("_rows_view", None)  # the view of the old rows (tensor.core.values_of)
    leaf_rows.fold(nt)  # what the old rows of a leaf gathered stays in nt.grad (tensor.leaf_rows)
    nt.__dict__.pop(leaf_rows.KEY, None)
    nt.__dict__.pop("_padless_view_of", None)
    nt._values = other._values


@implements(torch.Tensor.unbind, torch.unbind)
def unbind(func, nt: NestedTensor, dim: int = 0):
    if dim != 0:
        return lent("unbind_static")(nt, dim)  # a static dim: NestedTensors (padless.ops.rows.shape_idioms)
    return unbind_samples(nt)


@implements(torch.Tensor.__iter__)
def iter_(func, nt: NestedTensor):
    return iter(unbind_samples(nt))


@implements(torch.Tensor.tolist)
def tolist(func, nt: NestedTensor):
    return [s.tolist() for s in unbind_samples(nt, differentiable=False)]


@implements(torch.Tensor.numpy, torch.Tensor.__array__)
def numpy(func, nt: NestedTensor, *args, **kwargs):
    """There is no one dense array of a ragged batch: say which array the caller may mean."""
    raise StructureError(
        f"{func.__name__}(): a NestedTensor of {nt.batch_size} ragged samples is not one numpy array; use "
        "x.values().numpy() for the packed rows, [s.numpy() for s in x.unbind()] for one array per sample, "
        "or x.to_padded().numpy() for the padded envelope (add .detach() first when x requires grad)"
    )


@implements(torch.Tensor.share_memory_)
def share_memory_(func, nt: NestedTensor) -> NestedTensor:
    for t in inner_tensors(nt):
        t.share_memory_()
    return nt


@implements(torch.Tensor.is_shared)
def is_shared(func, nt: NestedTensor) -> bool:
    return nt._values.is_shared()


RELAYOUT_KERNELS: list = []
"""Registered by the op layer (``padless.ops.kernels.layout``): each may return the values of a
transposed pair re-laid out in canonical order by a kernel, or None for the row-gather path."""


@implements(torch.Tensor.contiguous)
def contiguous(func, nt: NestedTensor, memory_format=torch.contiguous_format) -> NestedTensor:
    """Canonical layout: ragged dims stored in ascending order, contiguous values.

    A transposed pair (ragged dims stored as (1, 0)) is re-laid out with one row gather."""
    from padless.tensor import layout
    from padless.tensor.autograd import nested_from_values, rewrap, values_of

    canonical = tuple(sorted(nt._ragged))
    if nt._ragged != canonical:
        vals = None
        for kernel in RELAYOUT_KERNELS:  # a Triton kernel when the op layer's dispatch picks one
            vals = kernel(nt, values_of(nt))
        if vals is None:
            _, idx = layout.relayout_rows(nt.host_sizes(), nt.host_offsets(), nt._ragged, canonical, nt._values.shape[0])
            vals = values_of(nt).index_select(0, idx.to(nt._values.device))
        meta = StructureMeta(nt._meta.host_sizes, nt._meta.host_offsets)  # caches are per layout
        return nested_from_values(vals.contiguous(), nt._offsets, nt._sizes, canonical, nt._env, meta)
    if nt._values.is_contiguous():
        return nt
    return rewrap(values_of(nt).contiguous(), nt)


@implements(torch.Tensor.is_contiguous)
def is_contiguous(func, nt: NestedTensor, memory_format=torch.contiguous_format) -> bool:
    """True when :meth:`contiguous` has nothing to do: ragged dims stored in ascending order
    and contiguous ``values``.

    A transposed batch with one ragged dim (``(B, C, L_i)`` from ``(B, L_i, C)``) is
    contiguous: every sample is stored with its ragged dim first whatever the dim order, so
    the rows are already canonical (torch.nested answers False there, as its values are a
    strided view). ``nested.narrow`` and ``lengths=`` pack a copy (padless has no holes), so
    their results are contiguous too. A transposed pair (ragged dims stored as ``(1, 0)``)
    is not.
    """
    return nt._ragged == tuple(sorted(nt._ragged)) and nt._values.is_contiguous()


@implements(torch.Tensor.data_ptr)
def data_ptr(func, nt: NestedTensor) -> int:
    return nt._values.data_ptr()
