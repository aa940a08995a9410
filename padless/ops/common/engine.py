"""The generic pointwise engine: an elementwise op run once on the packed rows.

Any ATen op tagged ``torch.Tag.pointwise`` (add, mul, sigmoid, eq, where, clamp,
pow, their in-place and backward variants...) runs once on the packed
``values``. Operands are mapped onto rows:

* a NestedTensor of the same structure -> its ``values`` (structures are checked);
* a scalar or 0-d tensor -> itself;
* a dense tensor that broadcasts against the static tail, e.g. ``(C,)`` against
  samples ``(L_i, C)`` -> a view over the static dims;
* a dense tensor with a per-sample batch dim, e.g. ``(B, 1, C)`` -> gathered per row;
* a dense tensor whose extent along a ragged dim is the envelope's: read in padded
  coordinates, one cached gather (:mod:`padless.ops.common.padded`). This covers the
  zeros autograd makes for a custom Function's unused output during backward.

Any other dense operand that spans a ragged dim (size > 1 there) has no per-sample
meaning and is refused with a message naming the dim.

Because these run below autograd, backward formulas of pointwise ops are
pointwise ops on NestedTensors too, so gradients need nothing extra except the
reduction that ``sum_to_size`` performs for broadcast dense operands
(:func:`padless.ops.rows.reduce.sum_dim`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch import Tensor

from padless.ops.common import padded
from padless.tensor.core import NestedTensor, _structure_mismatch, wrap_like
from padless.tensor.registry import lend
from padless.tensor.errors import StructureError

aten = torch.ops.aten


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


@lend("dense_to_rows")
def dense_to_rows(opname: str, d: Tensor, ref: NestedTensor) -> Tensor:
    """Map a dense operand onto ``ref``'s rows (see module docstring)."""
    k = d.dim()
    if k == 0 or k <= _trailing_static(ref.sample_dim, ref._ragged):
        return d  # broadcasts against values (T, *static) as it is
    nd = len(ref._env) + 1
    if d.dim() > nd:
        raise StructureError(
            f"{opname}(): a dense operand of shape {tuple(d.shape)} has more dims than the "
            f"NestedTensor (envelope {tuple(ref.shape)}); broadcasting would add a batch dim"
        )
    aligned = (1,) * (nd - d.dim()) + tuple(d.shape)
    if padded.padded_extents(opname, aligned, ref, d.shape):
        if d.requires_grad and torch.is_grad_enabled():
            raise StructureError(
                f"{opname}(): a dense operand of the envelope shape {tuple(d.shape)} that requires grad; "
                "autograd cannot hand a packed gradient to a dense tensor here (an in-place op, or an op "
                "without a torch-level path). Write it out of place (x = x + d), or convert it first: "
                "padless.from_padded(dense, like=nt)"
            )
        return padded.read_rows(opname, d, ref, aligned)
    static = [s for s in range(ref.sample_dim) if s not in ref._ragged]
    rows = d.reshape(aligned[0], *[aligned[1 + s] for s in static])
    b = aligned[0]
    if b == 1:
        return rows
    if b != ref.batch_size:
        raise StructureError(
            f"{opname}(): a dense operand of shape {tuple(d.shape)} has {b} entries on the batch dim, "
            f"the NestedTensor has {ref.batch_size} samples"
        )
    return rows.index_select(0, ref.row_sample_ids())


@functools.lru_cache(maxsize=1024)  # keyed by (rank, ragged dims): a few entries in practice
def _trailing_static(ndim: int, ragged: tuple[int, ...]) -> int:
    """How many trailing sample dims are static (they are the trailing dims of values)."""
    return ndim - 1 - max(ragged) if ragged else ndim


NESTED_OP = threading.local()
"""``nts``: the NestedTensor operands of the op :func:`run_on_rows` is running on their rows
(below autograd, so those rows carry no history), None otherwise; ``gathers``: for an operand
broadcast onto the result's rows, ``id(its read rows) -> (operand, row map, squeezed dims)``
(:func:`padless.ops.common.broadcast.align`)."""

_INPLACE: dict[Any, bool] = {}


def _is_inplace(func) -> bool:
    hit = _INPLACE.get(func)
    if hit is None:
        a0 = func._schema.arguments[0] if func._schema.arguments else None
        hit = bool(a0 is not None and a0.alias_info is not None and a0.alias_info.is_write)
        _INPLACE[func] = hit
    return hit


def _first_nested(args, kwargs) -> NestedTensor:
    for a in args:
        if isinstance(a, NestedTensor):
            return a
    for a in kwargs.values():
        if isinstance(a, NestedTensor):
            return a
    raise RuntimeError("padless internal: pointwise handler called without a NestedTensor operand")


def run_on_rows(opname, func, args, kwargs, inplace: bool):
    """Call ``func`` with every operand mapped onto rows; wrap the result in the structure.

    ``opname`` is a string or a callable returning it (names are only built for errors).
    """
    ref = _first_nested(args, kwargs)
    if callable(opname):
        opname = _LazyName(opname)
    if "out" in kwargs:
        raise NotImplementedError(f"{opname}(): out= is not supported with NestedTensor operands")

    aligned: dict[int, Tensor] = {}
    gathers: dict[int, tuple] = {}
    nts = _nested_operands(args, kwargs)
    if func in _SHIFTS and len(args) == 2 and isinstance(args[0], NestedTensor):
        zero = _zero_term(func, args, kwargs) if len(nts) == 2 else None
        if zero is not None:  # deferred scores + an all-zero mask term: a constant, no broadcast
            return run_on_rows(opname, func, zero, kwargs, inplace)
        for hook in SHIFT_HOOKS:  # deferred scores + a term broadcast onto them, kept at its size
            out = hook(func, args, kwargs, inplace)
            if out is not None:
                return args[0] if inplace else wrap_like(out, args[0])
    if len(nts) > 1 and _needs_broadcast(ref, nts, opname):
        from padless.ops.common import broadcast

        p = broadcast.plan(str(opname), nts)
        if inplace and (p.gathered[0] or p.squeeze[0]):
            raise StructureError(
                f"{opname}(): an in-place op cannot change the structure of its first operand "
                f"(ragged dims {ref.ragged_dims}) to the broadcast result's {p.template.ragged_dims}"
            )
        from padless.ops.common import sample_views

        if sample_views.eligible(p.template, nts, args, kwargs):  # few large samples: no gathers
            out = sample_views.run(func, args, kwargs, nts, p.template, inplace)
            if out is not sample_views.NOT_TAKEN:
                return args[0] if inplace else wrap_like(out, p.template)
        if len(nts) == 2 and len(args) == 2 and not kwargs and not inplace:
            from padless.ops.kernels.pair import broadcast_pair

            fused = broadcast_pair(func, nts, p)  # (N,1,C) (+|*) (1,M,C) without gathers, on CUDA
            if fused is not None:
                return wrap_like(fused, p.template)
        for n, rows, sq in zip(nts, p.rows, p.squeeze):
            aligned[id(n)] = broadcast.align(n._values, rows, sq)
            if rows is not None or sq:  # deferred scores ask how a term was read (pairs.pending)
                gathers[id(aligned[id(n)])] = (n, rows, sq)
        ref = p.template
    new_args = []
    for a in args:
        if isinstance(a, NestedTensor):
            a = aligned.get(id(a), a._values)
        elif isinstance(a, Tensor):
            a = dense_to_rows(opname, a, ref)
        new_args.append(a)
    new_kwargs = kwargs
    if kwargs:
        new_kwargs = {}
        for k, a in kwargs.items():
            if isinstance(a, NestedTensor):
                a = aligned.get(id(a), a._values)
            elif isinstance(a, Tensor):
                a = dense_to_rows(opname, a, ref)
            new_kwargs[k] = a
    if inplace:
        if not isinstance(args[0], NestedTensor):
            raise StructureError(
                f"{opname}(): an in-place op on a dense tensor cannot take a NestedTensor operand "
                "(the result would need the ragged structure)"
            )
        NESTED_OP.nts, NESTED_OP.gathers = nts, gathers
        try:
            func(*new_args, **new_kwargs)
        finally:
            NESTED_OP.nts = NESTED_OP.gathers = None
        return args[0]
    # deferred rows read which operands need a gradient, and how a broadcast operand's rows
    # were read onto the result's (padless.ops.pairs.pending)
    NESTED_OP.nts, NESTED_OP.gathers = nts, gathers
    try:
        out = func(*new_args, **new_kwargs)
    finally:
        NESTED_OP.nts = NESTED_OP.gathers = None
    if isinstance(out, tuple):
        return tuple(wrap_like(o, ref) for o in out)
    return wrap_like(out, ref)


_SHIFTS = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
SHIFT_HOOKS: list = []
"""``hook(func, args, kwargs, inplace)`` asked first by a shift whose first operand is a NestedTensor
(the second a NestedTensor or a dense tensor): the result's values (``args[0]``'s structure), or
None (:func:`padless.ops.pairs.pending.spread_shift`)."""


def _zero_term(func, args, kwargs) -> tuple | None:
    """``args`` with the second operand replaced by a signed zero number when the first holds
    deferred attention scores (:mod:`padless.ops.pairs.pending`) and the second is a NestedTensor
    that broadcasts into them without growing them, needs no gradient and is zero everywhere
    (an additive key mask ``(1 - mask) * -inf`` of a mask that is all ones on real positions),
    else None. ``x + 0`` is ``x`` exactly, so the scores' recipe takes a constant instead of a
    term read onto every score (a gather as large as the scores). The test reads the small
    operand's values: on the CPU only (on a device it would be a sync)."""
    if len(args) != 2 or set(kwargs) - {"alpha"}:
        return None
    x, y = args
    if not (isinstance(x, NestedTensor) and isinstance(y, NestedTensor)) or y.requires_grad:
        return None
    if not getattr(type(x._values), "padless_deferred", False) or isinstance(y._values, type(x._values)):
        return None
    v = y._values
    if v.device.type != "cpu" or v.dtype != x._values.dtype or v.numel() >= x._values.numel() or v.numel() == 0:
        return None
    hx, hy = x._meta.host_sizes, y._meta.host_sizes
    if hx is None or hy is None or hx.shape != hy.shape or not bool(((hy == 1) | (hy == hx)).all()):
        return None
    if torch.compiler.is_compiling():
        return None
    c = zero_constant(v)
    return None if c is None else (x, c)


def zero_constant(v: Tensor) -> float | None:
    """The signed zero ``v`` adds when it is zero everywhere with one sign (``x + v`` is then
    ``x + c`` exactly), else None. Reads ``v``: callers keep it to host tensors."""
    if bool(v.any()):
        return None
    neg = torch.signbit(v)
    if v.numel() and bool(neg.all()):
        return -0.0
    return 0.0 if not bool(neg.any()) else None


def _nested_operands(args, kwargs) -> list[NestedTensor]:
    out: list[NestedTensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, NestedTensor) and all(a is not b for b in out):
            out.append(a)
    return out


def _needs_broadcast(ref: NestedTensor, nts: list[NestedTensor], opname=None) -> bool:
    """False when every operand has ``ref``'s structure (the common case: an identity test).
    Under compile, operands of distinct structures get a run-time check named ``opname``."""
    for n in nts[1:]:
        if n._meta is ref._meta and n._ragged == ref._ragged:
            continue
        if _structure_mismatch(ref, n, opname, broadcast=True) is not None:
            return True
    return False


class _LazyName:
    """Formats as the op name, computed only when an error message needs it."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __str__(self) -> str:
        return self.fn()

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


@lend("pointwise_aten")
def pointwise_aten(func, *args, **kwargs):
    """Run an elementwise ATen op on packed rows (below autograd)."""
    return run_on_rows(lambda: _name(func), func, args, kwargs, _is_inplace(func))


def pointwise_function(func, args, kwargs):
    """Torch-level fast path for an elementwise callable when no gradient is needed."""
    if func in _WHERE and len(args) + len(kwargs) < 3:
        return func(*args, **kwargs)  # torch.where(cond) is nonzero(), not elementwise
    if kwargs.get("inplace") or any(a is True for a in args[1:]):
        return func(*args, **kwargs)  # F.relu(x, inplace=True): the ATen path bumps versions
    return run_on_rows(lambda: getattr(func, "__name__", "op").strip("_"), func, args, kwargs, False)


_WHERE = {torch.where, torch.Tensor.where}
