"""Views of a NestedTensor that in-place ops write through to it.

Dense code writes into views: ``x[:, :1].zero_()``, ``x[:, 0] = cls``, ``x[..., 0].fill_(1)``,
``x[1:] += 1``. On a NestedTensor some of these views are copies: a window of a ragged dim
(``x[:, :2]``, ``x.narrow(1, 0, 2)``) and a position (``x[:, -1]``) gather rows that are not
evenly spaced in ``values``. Others share ``values``' storage (indexing static dims, samples,
sub-batches), so a write reaches the base's values, but autograd records it on the view
only. Both kinds are made views here (:class:`NestedView`, :class:`DenseView`), each
remembering its base and how to put new values back into the base's rows (``put``). An
in-place op on one runs on a copy of it; then the base is overwritten with its rows updated
(``base.copy_``, recorded by autograd like any in-place op on it), and the view takes the
result (``view.copy_``)::

    x samples (3, C) (1, C) (0, C)      w = x[:, :2]  rows 0 1 | 3 | (none)
    w.zero_()                           x rows 0 1 3 become 0 (index_copy), w zeros

Values, version counters and gradients are those of the dense code run on each sample: the
base's gradient at the written elements comes from what was written, the rest from the base.
A view of a leaf that requires grad is refused by torch (the base's ``copy_``), as for a dense
view of a leaf. A view of a view writes through both. A window clamped short writes the rows
it holds. Reads are not aliased for copies: a window taken *before* its base is written keeps
the values it had (take it again after the write).

Windows and positions are always such views (eager; under ``torch.compile`` they are copies,
graphs being functional). Storage-sharing views are only when their write could otherwise be
wrong: their base requires grad (with grad enabled) or is itself a view.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.engine_calls import ENGINE_CALLS, call_read_as, reads_as
from padless.tensor.registry import lent

SETITEM = torch.Tensor.__setitem__
_VIEW = "_padless_view_of"  # (base, put): put(base rows, view's new values) -> base's new rows
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __imatmul__".split()
)
_NOT_WRITES = frozenset("requires_grad_ share_memory_ detach_ retain_grad record_stream".split())


def _may_write(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` may write its first argument in place (``add_``, ``x += 1``,
    ``F.relu(x, inplace=True)``); :func:`write_through` checks what it did."""
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or kwargs.get("inplace") is True:
        return True
    if name.endswith("_") and not name.startswith("_"):
        return name not in _NOT_WRITES
    return getattr(func, "__module__", "") == "torch.nn.functional" and any(a is True for a in args[1:])


class NestedView(NestedTensor):
    """A NestedTensor-valued view of a NestedTensor (a window of ragged dims, a sub-batch,
    indexing of static dims): in-place ops on it write through to its base (module docstring).
    Every other op is the NestedTensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and type(args[0]) is NestedView and _may_write(func, args, kwargs):
            return write_through(args[0], func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


class DenseView(Tensor):
    """A dense view of a NestedTensor (position ``k`` of every sample, ``x[:, k]``; a sample,
    ``x[i]``): in-place ops on it write through to the NestedTensor (module docstring). Every
    other op sees a plain tensor and returns plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ENGINE_CALLS:
            # as the plain tensor it reads as: NestedTensors among inputs then answer (tensor.engine_calls)
            out = call_read_as(func, args, kwargs)
            if out is not NotImplemented or any(issubclass(t, NestedTensor) for t in types):
                return out  # NestedTensor answers gradients of its intermediates (tensor.grad_rows)
        if args and type(args[0]) is DenseView and _may_write(func, args, kwargs):
            return write_through(args[0], func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __reduce_ex__(self, protocol):  # saved and copied as the plain tensor it reads as
        return self.as_subclass(Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.as_subclass(Tensor).__deepcopy__(memo)


reads_as(DenseView)  # its gradients are asked of the plain tensor it reads as (tensor.engine_calls)


def put_rows(rows: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """The ``put`` of a view holding the base's rows ``rows`` (a window, a position)."""
    return lambda base_rows, new: base_rows.index_copy(0, rows, new)


def put_view(view_fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The ``put`` of a view that is ``view_fn`` of the base's rows (indexing, a slice of rows)."""

    def put(base_rows: Tensor, new: Tensor) -> Tensor:
        out = base_rows.clone()
        view_fn(out).copy_(new)
        return out

    return put


def writes_matter(base: NestedTensor) -> bool:
    """Whether a storage-sharing view of ``base`` must be a write-through view: a write to
    it would be recorded wrong (``base`` needs a gradient) or lost (``base`` is a copy view)."""
    return (base.requires_grad and torch.is_grad_enabled()) or _VIEW in base.__dict__


def as_view(out: Any, base: NestedTensor, put: Callable[[Tensor, Tensor], Tensor]) -> Any:
    """``out`` as a write-through view of ``base`` (:class:`NestedView` or :class:`DenseView`).
    Eager only: under ``torch.compile`` it is returned as it is."""
    if torch.compiler.is_compiling() or _is_traced(out._values if isinstance(out, NestedTensor) else out):
        return out
    if isinstance(out, NestedTensor):
        out.__class__ = NestedView
    else:
        out = out.as_subclass(DenseView)
    out.__dict__[_VIEW] = (base, put)
    return out


def write_through(view: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(view, *args[1:])``, in place, written through to ``view``'s base (module docstring)."""
    base, put = view.__dict__[_VIEW]
    nested = isinstance(view, NestedTensor)
    with torch._C.DisableTorchFunctionSubclass():
        tmp = view.clone() if nested else view.as_subclass(Tensor).clone()
    if nested:  # the copy is no view (clone keeps the class of what it copies)
        tmp.__class__ = NestedTensor
        tmp.__dict__.pop(_VIEW, None)
    with torch._C._EnableTorchFunction():
        if func is SETITEM and nested:
            lent("setitem")(func, tmp, *args[1:], **kwargs)
            res = None
        else:
            res = func(tmp, *args[1:], **kwargs)
    if func is not SETITEM and res is not tmp:
        return res  # not a write after all (``F.dropout(w, p, True)`` is training=True): its result
    merged = put(values_of(base), values_of(tmp) if nested else tmp)
    assign(base, rewrap(merged, base))
    with torch._C.DisableTorchFunctionSubclass():
        view.copy_(tmp)  # the view takes what was written (recorded on it)
    return None if func is SETITEM else view


def assign(dst: Any, src: Any) -> None:
    """``dst.copy_(src)``, through to ``dst``'s base when ``dst`` is itself a view."""
    if _VIEW in dst.__dict__:
        write_through(dst, torch.Tensor.copy_, (dst, src), {})
        return
    with torch._C.DisableTorchFunctionSubclass():
        dst.copy_(src)


def is_view(t: Any) -> bool:
    return isinstance(t, Tensor) and _VIEW in t.__dict__
