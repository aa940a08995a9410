"""Batches stacked in front of the batch dim: ``torch.stack([a, b], dim=0)``.

Decoders that merge feature maps write ``torch.stack(features).sum(0)`` (the FPN merge of
segmentation-models-pytorch), ``.mean(0)``, ``.amax(0)``, or take one back with ``[k]``.
For NestedTensors of one structure (the same samples, the same ragged extents) that gives
a :class:`StackedBatch`: ``n`` batches, shape ``(n, B, *envelope)``::

    a    samples (2, C) (3, C)        values [a0 a1 | a2 a3 a4]
    b    samples (2, C) (3, C)        values [b0 b1 | b2 b3 b4]   (a's structure)
    s = torch.stack([a, b])           s.shape == (2, 2, 3, C); s.members == (a, b)
    s.sum(0)  -> a + b                s[1] -> b                   s.amax(0) -> maximum(a, b)

**Why a lazy stack and not a NestedTensor.** A NestedTensor's batch dim is outer dim 0:
``shape``, every handler's dim arithmetic, the structure metadata and the compiled path
all count from it. A static dim in front of it would be a second layout every handler
must learn, for an idiom that only ever reduces or indexes the new dim. The ``n`` batches
share one structure, so a reduction over the stack dim is ``n - 1`` elementwise ops on
their ``values`` (no stacked copy is made: less memory than ``torch.stack`` of dense
tensors), indexing is free, and autograd flows through the members as it would through
the dense stack. Ops over other dims map over the members (``s.sum(2)`` is the stack of
``m.sum(1)``); elementwise arithmetic maps over members and broadcasts an operand without
the stack dim. Anything else names the fix: reduce or index the stack dim first, or stack
inside every sample with ``torch.stack(tensors, dim=1)`` (:meth:`StackedBatch.nested`).

**Copy semantics without the copy.** A dense ``torch.stack`` copies its inputs, so writing one
of them afterwards (``a.add_(10)``) leaves the stack as it was. The stack here holds its
members, so it remembers their version counters when it is made and every use checks them:
a member written in place since makes the use raise, naming the member and the rewrite
(stack after the write, or stack copies). Members without a version counter (inference
tensors, made under ``torch.inference_mode()``) are copied when stacked. What ``s[k]``,
``unbind`` and iteration hand out are the members' values as views that refuse in-place
writes (a write into the dense ``s[k]`` would change the stack's copy, not ``a``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _is_traced, check_same_structure
from padless.tensor.errors import StructureError
from padless.tensor.views import as_view


class StackedBatch:
    """``n`` NestedTensors of one structure stacked along a new dim 0 (module docstring)."""

    __slots__ = ("members", "_versions")

    def __init__(self, members: Sequence[NestedTensor]):
        members = tuple(members)
        if not members:
            raise ValueError("stack(): expected a non-empty sequence of NestedTensors")
        for m in members[1:]:
            check_same_structure("stack", members[0], m)
            if m._values.shape[1:] != members[0]._values.shape[1:]:
                raise StructureError(
                    f"stack(): NestedTensors of shapes {tuple(members[0].shape)} and {tuple(m.shape)} differ in "
                    "static extents; stacked batches must have one shape"
                )
        # an inference tensor has no version counter to watch: it is copied (module docstring)
        self.members = tuple(_copy(m) if m._values.is_inference() else m for m in members)
        self._versions = tuple(_version(m) for m in self.members)

    def _fresh(self) -> tuple[NestedTensor, ...]:
        """The members, after checking that none was written in place since the stack was made."""
        for k, (m, v) in enumerate(zip(self.members, self._versions)):
            if v is not None and _version(m) != v:
                raise StructureError(
                    f"stack(): member {k} of the stack was written in place after torch.stack (a NestedTensor stack "
                    "holds its members rather than a copy, so it would read the new values where the dense stack "
                    "keeps the old ones); stack after the write, or stack copies: torch.stack([t.clone() for t in ts])"
                )
        return self.members

    # ------------------------------------------------------------------ what it looks like
    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.members), *self.members[0].shape))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.members[0].dim() + 1

    ndim = property(dim)

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):
        return iter([_read_only(m) for m in self._fresh()])

    dtype = property(lambda self: self.members[0].dtype)
    device = property(lambda self: self.members[0].device)
    requires_grad = property(lambda self: any(m.requires_grad for m in self.members))

    def __repr__(self) -> str:
        return f"StackedBatch(n={len(self.members)}, shape={tuple(self.shape)}, ragged_dims={self.members[0].ragged_dims})"

    def unbind(self, dim: int = 0) -> tuple:
        if self._dim(dim, "unbind") == 0:
            return tuple(_read_only(m) for m in self._fresh())
        return tuple(_wrap(parts) for parts in zip(*(m.unbind(self._dim(dim, "unbind") - 1) for m in self._fresh())))

    def nested(self, dim: int = 1) -> NestedTensor:
        """The members stacked inside every sample (``torch.stack(members, dim)``, ``dim >= 1``)."""
        return torch.stack(list(self._fresh()), dim)

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, index: Any):
        index = index if isinstance(index, tuple) else (index,)
        if not index:
            return self
        first, rest = index[0], index[1:]
        if first is Ellipsis:
            raise IndexError("StackedBatch indexing: index the stack dim first (s[k], s[:, ...])")
        members = self._fresh()
        if isinstance(first, int) and not isinstance(first, bool):
            if not -len(members) <= first < len(members):
                raise IndexError(
                    f"StackedBatch indexing: index {first} is out of range for a stack of {len(members)} members "
                    f"(the stack dim has size {len(members)})"
                )
            m = _read_only(members[first])
            return m[rest] if rest else m
        if isinstance(first, slice):
            picked = members[first]
            if not picked:
                raise IndexError(f"StackedBatch indexing: {first!r} selects no member of {len(members)}")
            return _wrap([m[rest] if rest else m for m in picked])
        raise IndexError(f"StackedBatch indexing: the stack dim takes an int or a slice, got {type(first).__name__}")

    # ------------------------------------------------------------------ reductions
    def _dim(self, dim: int, op: str) -> int:
        n = self.dim()
        if not isinstance(dim, int) or not -n <= dim < n:
            raise IndexError(f"{op}(): dim {dim!r} is out of range for a StackedBatch of {n} dims")
        return dim % n

    def _reduce(self, op: str, combine: Callable, method: str, dim, keepdim: bool, finish=None, **kw):
        if dim is None:
            return functools.reduce(combine, [getattr(m, method)(**kw) for m in self._fresh()])
        if isinstance(dim, (tuple, list)):
            dims = sorted((self._dim(d, op) for d in dim), reverse=True)
            out = self
            for d in dims:
                out = out._reduce(op, combine, method, d, keepdim, finish, **kw)
            return out
        d = self._dim(dim, op)
        if d > 0:
            return _wrap([getattr(m, method)(d - 1, keepdim=keepdim, **kw) for m in self._fresh()])
        out = functools.reduce(combine, self._fresh())
        if finish is not None:
            out = finish(out)
        if kw.get("dtype") is not None:
            out = out.to(kw["dtype"])
        return StackedBatch([out]) if keepdim else out

    def sum(self, dim=None, keepdim: bool = False, *, dtype=None):
        return self._reduce("sum", operator.add, "sum", dim, keepdim, dtype=dtype)

    def mean(self, dim=None, keepdim: bool = False, *, dtype=None):
        n = len(self.members)
        if dim is None:
            return self.sum(dtype=dtype) / (n * self.members[0].numel())
        return self._reduce("mean", operator.add, "mean" if self._dim(dim, "mean") else "sum", dim, keepdim,
                            finish=lambda t: t / n, dtype=dtype)

    def amax(self, dim=0, keepdim: bool = False):
        return self._reduce("amax", torch.maximum, "amax", dim, keepdim)

    def amin(self, dim=0, keepdim: bool = False):
        return self._reduce("amin", torch.minimum, "amin", dim, keepdim)

    # ------------------------------------------------------------------ elementwise, mapped over members
    def _map(self, fn: Callable, other: Any) -> "StackedBatch":
        if isinstance(other, StackedBatch):
            if len(other) != len(self):
                raise StructureError(f"StackedBatch: stacks of {len(self)} and {len(other)} members do not broadcast")
            return _wrap([fn(a, b) for a, b in zip(self._fresh(), other._fresh())])
        if isinstance(other, Tensor) and not isinstance(other, NestedTensor) and other.dim() > self.dim() - 1:
            raise StructureError(
                f"StackedBatch: a dense operand of shape {tuple(other.shape)} spans the stack dim; index or reduce "
                "the stack first (s[k], s.sum(0))"
            )
        return _wrap([fn(a, other) for a in self._fresh()])

    def __add__(self, o):
        return self._map(operator.add, o)

    def __radd__(self, o):
        return self._map(lambda a, b: b + a, o)

    def __sub__(self, o):
        return self._map(operator.sub, o)

    def __rsub__(self, o):
        return self._map(lambda a, b: b - a, o)

    def __mul__(self, o):
        return self._map(operator.mul, o)

    def __rmul__(self, o):
        return self._map(lambda a, b: b * a, o)

    def __truediv__(self, o):
        return self._map(operator.truediv, o)

    def __neg__(self):
        return StackedBatch([-m for m in self._fresh()])

    # ------------------------------------------------------------------ torch.<fn>(stacked, ...)
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if args and isinstance(args[0], StackedBatch) and name in _METHODS:
            return getattr(args[0], name)(*args[1:], **kwargs)
        if func in (torch.add, torch.sub, torch.mul, torch.div) and len(args) == 2:
            a, b = args
            op = {torch.add: operator.add, torch.sub: operator.sub, torch.mul: operator.mul, torch.div: operator.truediv}[func]
            if isinstance(a, StackedBatch):
                return a._map(op, b)
            return b._map(lambda x, y: op(y, x), a)
        raise NotImplementedError(
            f"{getattr(func, '__name__', func)}(): a StackedBatch (NestedTensors stacked in front of the batch dim) "
            "supports sum/mean/amax/amin, indexing, unbind and elementwise arithmetic; reduce or index the stack dim "
            "first (s.sum(0), s[k]), or stack inside every sample with torch.stack(tensors, dim=1)"
        )


_METHODS = {"sum", "mean", "amax", "amin", "unbind", "dim", "size"}
_SUPPORTED = "sum/mean/amax/amin, indexing, unbind and elementwise arithmetic (+ - * /)"


def _missing(self: StackedBatch, name: str):
    """Tensor methods a StackedBatch lacks: an AttributeError that names the fix (so ``hasattr`` stays False)."""
    if name.startswith("_") or not hasattr(Tensor, name):
        raise AttributeError(f"'StackedBatch' object has no attribute '{name}'")
    if name.endswith("_") and not name.endswith("__"):
        raise AttributeError(
            f"StackedBatch.{name}(): a stack of NestedTensors is not written in place (it holds its members); "
            f"write the members before stacking, or compute out of place (s + 1, s * 2), which a StackedBatch supports"
        )
    raise AttributeError(
        f"StackedBatch.{name}: a StackedBatch (NestedTensors stacked in front of the batch dim) supports {_SUPPORTED}; "
        "reduce or index the stack dim first (s.sum(0), s.amax(0), s[k]), or stack inside every sample with "
        "torch.stack(tensors, dim=1)"
    )


StackedBatch.__getattr__ = _missing  # only reached for names the class does not define


def _version(m: NestedTensor) -> int | None:
    """``m``'s values' version counter; None where there is none to read (inference, tracing)."""
    v = m._values
    return None if _is_traced(v) or v.is_inference() else v._version


def _refuse_write(base_rows: Tensor, new: Tensor) -> Tensor:
    raise RuntimeError(
        "StackedBatch: s[k] (and unbind, iteration) hands out a member of the stack, which is not written in place "
        "through it (in dense torch it would be the stack's copy, here it is the tensor that was stacked); "
        "write out of place (y = s[k] + 1), or write the member itself before stacking"
    )


def _copy(m: NestedTensor) -> NestedTensor:
    out = m.clone()
    out._lineage = m._lineage  # the same samples (a clone below __torch_function__ is not given it)
    return out


def _read_only(m: NestedTensor) -> NestedTensor:
    """``m``'s values as a view whose in-place writes are refused (:mod:`padless.tensor.views`)."""
    return as_view(rewrap(values_of(m), m), m, _refuse_write)


def _wrap(parts: Sequence[Tensor]):
    """Per-member results stacked again: a StackedBatch of NestedTensors, or a dense stack
    when the op left the batch (``s.sum(2)`` over a ragged dim gives dense ``(B, C)`` members)."""
    if all(isinstance(p, NestedTensor) for p in parts):
        return StackedBatch(parts)
    return torch.stack(list(parts), 0)


def stack_batches(tensors: Sequence[NestedTensor]) -> StackedBatch:
    """``torch.stack(tensors, dim=0)`` for NestedTensors of one structure."""
    return StackedBatch(tensors)
