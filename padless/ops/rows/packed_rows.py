"""Rows that leave the batch and come back: ``x.reshape(-1, C)`` ... ``y.view(x.shape)``.

Code written for padded batches often flattens the batch to rows, runs row-wise work, and
views the result back to the shape it read before (transformers' GPT-2 ``Conv1D``:
``size_out = x.size()[:-1] + (nf,)``, ``addmm(b, x.view(-1, C), W).view(size_out)``; OPT's
MLP: ``h.reshape(-1, C)`` ... ``(residual + h).view(shape)``). On a NestedTensor the
flattening gives every real row, dense ``(T, C)`` (:func:`padless.ops.rows.shape_idioms.flatten_rows`),
so the view back to the padded envelope cannot work on the dense tensor alone.

:class:`PackedRows` is that dense ``(T, C)`` tensor, a plain ``torch.Tensor`` subclass that
remembers the batch its rows came from. Every op runs on it as on the dense tensor; results
with the same ``T`` rows keep the memory (row-wise work: linears, activations, adds, dropout);
anything else (a reduction, a transpose) is a plain tensor. ``view``/``reshape`` to a target
that starts with the batch's envelope, ``(B, *ragged extents, *tail)``, as read from its
``shape``, gives the NestedTensor back: sample ``i`` is its own rows, regrouped as ``tail``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from padless.ops.common.dim0 import keeps_dim0
from padless.ops.common.structure import RAGGED, STATIC, restructure
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent

__all__ = ["PackedRows", "packed_rows"]

_VIEWS = {Tensor.view, Tensor.reshape, torch.reshape}


class PackedRows(Tensor):
    """Dense ``(T, *tail)``: every real row of a NestedTensor, in storage order (see the module
    docstring). Behaves as the dense tensor; ``view``/``reshape`` to the batch's envelope
    (``(B, *ragged extents, *tail)``) gives a NestedTensor of the batch's structure back."""

    _origin: NestedTensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, NestedTensor) for t in types):
            return NotImplemented  # with a NestedTensor operand: its handlers read this as dense
        origin = _origin_of(args, kwargs)
        if func in _VIEWS and origin is not None:
            back = _back_to_batch(func, args, kwargs, origin)
            if back is not None:
                return back
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if origin is None or func is Tensor.__repr__:
            return out
        if not _rows_sized(out, origin) or not keeps_dim0(func, args, kwargs, _owner(args, kwargs)):
            return out  # not T rows, or dim 0 moved or mixed (rows.t(), rows[perm]): a plain tensor
        return _keep(out, origin)


def packed_rows(rows: Tensor, origin: NestedTensor) -> PackedRows:
    """``rows`` (``(T, ...)``, the real rows of ``origin`` in storage order) as :class:`PackedRows`."""
    out = rows.as_subclass(PackedRows)
    out._origin = origin
    return out


def _origin_of(args: Any, kwargs: dict) -> NestedTensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, PackedRows):
            return a.__dict__.get("_origin")
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, PackedRows):
                    return b.__dict__.get("_origin")
    return None


def _owner(args: Any, kwargs: dict) -> Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, PackedRows):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, PackedRows):
                    return b
    return None


def _rows_sized(out: Any, origin: NestedTensor) -> bool:
    if type(out) in (tuple, list):
        return any(_rows_sized(o, origin) for o in out)
    return type(out) is Tensor and out.dim() >= 1 and out.shape[0] == origin._values.shape[0]


def _keep(out: Any, origin: NestedTensor) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_keep(o, origin) for o in out) if type(out) in (tuple, list) else out
    if type(out) is Tensor and out.dim() >= 1 and out.shape[0] == origin._values.shape[0]:
        return packed_rows(out, origin)
    return out


def _target(args: tuple, kwargs: dict) -> list | None:
    shape = list(args[1:]) + [kwargs[k] for k in ("shape", "size") if k in kwargs]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = list(shape[0])
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        return None  # a dtype view, or symbolic sizes: the dense op decides
    return shape


def _same_extent(want: int, got: int, origin: NestedTensor, d: int) -> bool:
    if got != want:
        return False
    if isinstance(got, Extent) and not got.read_from(origin):
        # read from another structure's shape: the same per-sample sizes are the same rows
        if got.batch_size != origin.batch_size or got.per_sample() != origin.host_sizes()[:, d].tolist():
            return False
    return True


def _check_other_batch(func, target: list, origin: NestedTensor, rows: Tensor) -> None:
    """Rows viewed to a shape read from another batch (sizes that are not these rows' own):
    the padless error naming both, instead of the dense view's size mismatch."""
    k = len(origin._ragged)
    extents = [(d, e) for d, e in enumerate(target[1 : 1 + k]) if isinstance(e, Extent)]
    if not extents:
        return
    hs = origin.host_sizes()
    why = None
    for d, e in extents:
        if e.batch_size != origin.batch_size:
            why = f"a batch of {e.batch_size} samples"
            break
        got, own = e.per_sample(), hs[:, d].tolist()
        if got != own:
            i = next(i for i, (g, o) in enumerate(zip(got, own)) if g != o)
            why = f"its sample {i} has {got[i]} entries along dim {d + 1}, this batch's sample {i} has {own[i]}"
            break
    if why is None:
        return
    op = "view" if func is Tensor.view else "reshape"
    raise StructureError(
        f"{op}(): these {rows.shape[0]} rows are the packed rows of a batch of {origin.batch_size} samples of sizes "
        f"{_fmt_sizes(hs)}; the target {tuple(int(t) for t in target)} holds sizes read from the shape of another "
        f"batch ({why}). View them to the shape of the batch they came from (x.shape, or x.shape[:-1] + (C,))"
    )


def _fmt_sizes(hs: Tensor) -> str:
    rows = [tuple(r) for r in hs.tolist()]
    return ", ".join(str(r) for r in rows[:4]) + (", ..." if len(rows) > 4 else "")


def _refuse_tail(func, target: list, origin: NestedTensor, rows: Tensor) -> None:
    """The target starts with the batch's envelope, but its tail does not hold a row: every
    non-empty sample alone fails this view, so the batch refuses it (the dense view of all the
    rows, which may happen to have the element count, is not what any sample computes)."""
    op = "view" if func is Tensor.view else "reshape"
    k = len(origin._ragged)
    hs = origin.host_sizes()
    i = next(i for i, n in enumerate(hs[:, list(origin._ragged)].prod(1).tolist()) if n)
    own = tuple(int(n) for n in hs[i].tolist())
    lead = tuple(own[d] for d in origin._ragged)
    tail = tuple(int(t) for t in target[1 + k :])
    raise StructureError(
        f"{op}(): these {rows.shape[0]} rows have {tuple(rows.shape[1:])} entries each and are the packed rows of a "
        f"batch of {origin.batch_size} samples; the target {tuple(int(t) for t in target)} starts with that batch's "
        f"envelope, so each row would become {tail}, which does not fit (sample {i}'s rows alone, "
        f"{lead + tuple(rows.shape[1:])}, cannot take the shape {lead + tail}). View the rows back with their own "
        f"last dims (x.shape[:-1] + tuple(rows.shape[1:])), or map them back to {tail} first"
    )


def _back_to_batch(func, args: tuple, kwargs: dict, origin: NestedTensor) -> NestedTensor | None:
    rows = args[0]
    if not isinstance(rows, PackedRows) or rows.dim() == 0 or rows.shape[0] != origin._values.shape[0]:
        return None
    target = _target(args, kwargs)
    k = len(origin._ragged)
    if target is None or len(target) < 1 + k:
        return None
    _check_other_batch(func, target, origin, rows)
    if target[0] != origin.batch_size:
        return None
    if not all(_same_extent(origin._env[d], target[1 + d], origin, d) for d in range(k)):
        return None
    tail = list(target[1 + k :])
    per_row = math.prod(rows.shape[1:])
    if tail.count(-1) == 1:
        known = math.prod(t for t in tail if t != -1)
        if known == 0 or per_row % known:
            return _refuse_tail(func, target, origin, rows) if rows.shape[0] else None
        tail[tail.index(-1)] = per_row // known
    if any(t < 0 for t in tail):
        return None  # the dense op's own error
    if math.prod(tail) != per_row and rows.shape[0]:
        # the target is the batch's envelope, so each row must become ``tail``: a dense
        # reshape that only happens to have the element count would mix the samples (with
        # no rows at all, every sample alone takes the shape: the batch does too)
        _refuse_tail(func, target, origin, rows)
    with torch._C.DisableTorchFunctionSubclass():
        plain = rows.as_subclass(Tensor)
        vals = plain.view(plain.shape[0], *tail) if func is Tensor.view else plain.reshape(plain.shape[0], *tail)
        return restructure(origin, vals, [(RAGGED, d) for d in range(k)] + [(STATIC, n) for n in tail])
