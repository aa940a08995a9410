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

**Rows rebuilt chunk by chunk** (OpenFold's ``chunk_layer``, a Pairformer's inference-time
transition)::

    other = x.shape[:-1]; rows = x.reshape(-1, C)
    out = torch.empty((rows.shape[0], C2))          # or rows.new_zeros(...), torch.empty_like(rows)
    for s in range(0, rows.shape[0], chunk):
        out[s:s + chunk] = f(rows[s:s + chunk])      # f row-wise
    y = out.reshape(*other, C2)

A slice ``rows[s:e]`` along dim 0 is a *row chunk*: PackedRows that remember the row range
``s:e`` of their batch (``_span``), kept by row-wise work like the full rows. ``new_empty``,
``new_zeros``, ``new_ones``, ``new_full`` of packed rows or of a chunk, with the batch's row
count ``T`` on dim 0, are packed rows of the batch. ``rows.split(k)`` (``chunk``,
``tensor_split`` along dim 0) gives consecutive chunks, and ``torch.cat`` of consecutive chunks
along dim 0 holds their rows (all ``T``: the batch's rows again). Writing a chunk back at its own range
(``out[s:e] = chunk``) into a plain dense tensor of ``T`` rows makes that tensor packed rows of
the batch (its class becomes :class:`PackedRows`; it behaves as the dense tensor it was), so the
reshape to the batch's shape gives the NestedTensor once every row was written so (the tensor
records the rows written; a reshape before is refused, naming the rows never written).
``torch.empty((T, C2))`` itself cannot be told from any other dense tensor: the write is where
the rows are recognised. A write that is not the rows' own (a chunk at another range, a dense
value into part of dim 0) makes packed rows plain again; rows of another batch start its record. A chunk viewed to the batch's shape, or any view naming the
batch's sizes with another row count, is refused, naming the rewrite.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from padless.ops.common.dim0 import keeps_dim0
from padless.ops.common.structure import RAGGED, STATIC, restructure
from padless.tensor.core import NestedTensor
from padless.tensor.engine_calls import ENGINE_CALLS, call_read_as, reads_as
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent

__all__ = ["PackedRows", "packed_rows"]

_VIEWS = {Tensor.view, Tensor.reshape, torch.reshape}


class PackedRows(Tensor):
    """Dense ``(T, *tail)``: every real row of a NestedTensor, in storage order, or a chunk
    ``s:e`` of them (see the module docstring). Behaves as the dense tensor; ``view``/``reshape``
    of all ``T`` rows to the batch's envelope (``(B, *ragged extents, *tail)``) gives a
    NestedTensor of the batch's structure back."""

    _origin: NestedTensor
    _span: tuple[int, int] | None  # the rows s:e of the batch it holds; None: all T rows
    _filled: tuple | None  # recognised by writes: the row ranges written so far (None, or absent: all)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ENGINE_CALLS:  # as the plain tensor it reads as: NestedTensors among inputs then answer
            out = call_read_as(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if any(issubclass(t, NestedTensor) for t in types):
            return NotImplemented  # with a NestedTensor operand: its handlers read this as dense
        owner = _owner(args, kwargs)
        origin = None if owner is None else owner.__dict__.get("_origin")
        if func is Tensor.__setitem__:
            return _write(args)
        if func in _VIEWS and origin is not None:
            back = _back_to_batch(func, args, kwargs, origin)
            if back is not None:
                return back
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if origin is None or func is Tensor.__repr__:
            return out
        name = getattr(func, "__name__", "")
        span = _joined_span(args, kwargs) if name in _JOIN else None
        if span is not None:  # torch.cat([f(rows[0:3]), f(rows[3:6])]): the rows 0:6
            return _keep(out, origin, span)
        if not _agree(owner, args, kwargs):
            return out  # rows of two batches, or two ranges of one (rows[:5] + rows[5:10]): plain
        if name in _PIECES and args[0] is owner and _along_dim0(args, kwargs, owner.dim()):
            return _pieces(out, origin, _abs_span(owner)[0])  # rows.split(chunk): consecutive chunks
        if name in _NEW:  # out = rows.new_zeros((T, C2)): the batch's rows, to be filled
            return _keep(out, origin, None) if _rows_sized(out, _rows(origin)) else out
        if name == "__getitem__" and args[0] is owner:
            span = _chunk_span(owner, args[1])
            if span is not None:  # rows[s:e]: a chunk of the batch's rows
                return _keep(out, origin, span)
        span = _span_of(owner)
        if not _rows_sized(out, _length(origin, span)) or not keeps_dim0(func, args, kwargs, owner):
            return out  # not these rows, or dim 0 moved or mixed (rows.t(), rows[perm]): a plain tensor
        return _keep(out, origin, span, owner.__dict__.get("_filled"))


_NEW = {"new_empty", "new_zeros", "new_ones", "new_full"}
_PIECES = {"split", "chunk", "tensor_split", "split_with_sizes"}
_JOIN = {"cat", "concat", "concatenate"}


reads_as(PackedRows)  # its gradients are asked of the plain tensor it reads as (tensor.engine_calls)


def _along_dim0(args: tuple, kwargs: dict, ndim: int) -> bool:
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    return isinstance(dim, int) and ndim > 0 and dim % ndim == 0


def _pieces(out: Any, origin: NestedTensor, start: int) -> Any:
    """The pieces of a split along dim 0, each a chunk of the rows it holds (in order)."""
    if type(out) not in (tuple, list) or not all(type(o) is Tensor and o.dim() >= 1 for o in out):
        return out
    kept = []
    for o in out:
        kept.append(packed_rows(o, origin, _normal((start, start + o.shape[0]), origin)))
        start += o.shape[0]
    return type(out)(kept)


def _joined_span(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """The rows ``torch.cat`` of chunks along dim 0 holds: consecutive chunks of one batch's rows."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(type(t) is PackedRows for t in tensors):
        return None
    first = tensors[0]
    if not isinstance(dim, int) or first.dim() == 0 or dim % first.dim() != 0:
        return None
    origin = first.__dict__.get("_origin")
    spans = [_abs_span(t) for t in tensors]
    if origin is None or any(not _same_rows(origin, t.__dict__.get("_origin", origin)) for t in tensors[1:]):
        return None
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None  # not consecutive: rows out of order
    return (spans[0][0], spans[-1][1])


def _normal(span: tuple[int, int], origin: NestedTensor) -> tuple[int, int] | None:
    return None if span == (0, _rows(origin)) else span


def packed_rows(rows: Tensor, origin: NestedTensor, span: tuple[int, int] | None = None) -> PackedRows:
    """``rows`` (``(T, ...)``, the real rows of ``origin`` in storage order; with ``span``
    ``(s, e)``, its rows ``s:e``) as :class:`PackedRows`."""
    out = rows.as_subclass(PackedRows)
    out._origin = origin
    out._span = span
    return out


def _rows(origin: NestedTensor) -> int:
    return origin._values.shape[0]


def _span_of(t: Tensor) -> tuple[int, int] | None:
    return t.__dict__.get("_span")


def _length(origin: NestedTensor, span: tuple[int, int] | None) -> int:
    return _rows(origin) if span is None else span[1] - span[0]


def _packed_args(args: Any, kwargs: dict) -> list[PackedRows]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, PackedRows):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, PackedRows))
    return found


def _owner(args: Any, kwargs: dict) -> PackedRows | None:
    found = _packed_args(args, kwargs)
    return found[0] if found else None


def _same_rows(a: NestedTensor, b: NestedTensor) -> bool:
    """Two batches whose rows are the same rows (one structure, or equal sizes and layout)."""
    if a is b or a._meta is b._meta:
        return True
    return (a._ragged == b._ragged and a.batch_size == b.batch_size and _rows(a) == _rows(b)
            and torch.equal(a.host_sizes(), b.host_sizes()))


def _agree(owner: PackedRows, args: Any, kwargs: dict) -> bool:
    """Every packed operand holds the same rows as ``owner`` (same batch rows, same range)."""
    o, span = owner.__dict__.get("_origin"), _span_of(owner)
    for p in _packed_args(args, kwargs):
        q = p.__dict__.get("_origin")
        if p is not owner and (q is None or _span_of(p) != span or not _same_rows(o, q)):
            return False
    return True


def _rows_sized(out: Any, n: int) -> bool:
    if type(out) in (tuple, list):
        return any(_rows_sized(o, n) for o in out)
    return type(out) is Tensor and out.dim() >= 1 and out.shape[0] == n


def _keep(out: Any, origin: NestedTensor, span: tuple[int, int] | None, filled: Any = None) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_keep(o, origin, span, filled) for o in out) if type(out) in (tuple, list) else out
    if type(out) is Tensor and out.dim() >= 1 and out.shape[0] == _length(origin, span):
        kept = packed_rows(out, origin, None if span is None else _normal(span, origin))
        if filled is not None and kept._span is None:
            kept._filled = filled  # rows never written from the batch's rows stay unwritten
        return kept
    return out


def _dim0_slice(index: Any) -> slice | None:
    """The slice ``index`` takes along dim 0 when it is a basic slice there and leaves dim 0 in
    place (``t[s:e]``, ``t[s:e, :4]``, ``t[s:e, ..., 0]``; no tensor or list entries, which could
    move the dims they broadcast to the front), else None."""
    entries = index if isinstance(index, tuple) else (index,)
    if not entries or not isinstance(entries[0], slice):
        return None
    if any(isinstance(e, (Tensor, list, tuple, bool)) for e in entries[1:]):
        return None
    first = entries[0]
    if first.step not in (None, 1):
        return None
    return first


def _chunk_span(t: PackedRows, index: Any) -> tuple[int, int] | None:
    """The batch's row range ``t[index]`` holds when it is a chunk of ``t``'s rows along dim 0."""
    sl = _dim0_slice(index)
    if sl is None or sl == slice(None) or t.dim() == 0:
        return None
    s, e, _ = sl.indices(t.shape[0])
    off = _abs_span(t)[0]
    return (off + s, off + max(s, e))


def _write(args: tuple) -> None:
    """``dst[index] = value``; then ``dst`` holds the rows of a batch or not (module docstring)."""
    dst, index, value = args
    with torch._C.DisableTorchFunctionSubclass():
        Tensor.__setitem__(dst, index, value)
    src = value.__dict__.get("_origin") if isinstance(value, PackedRows) else None
    if type(dst) is PackedRows:
        if _keeps_all_rows(index, dst.dim()):
            return None  # dim 0 whole (rows[:, :4] = ...): every row keeps its meaning
        origin = dst.__dict__.get("_origin")
        if src is not None and origin is not None and _same_rows(src, origin) and _written_span(dst, index, value) == _abs_span(value):
            _fill(dst, _abs_span(value))  # a chunk written back at its own rows
            return None
        _plain(dst)  # rows[s:e] = other values: its rows are no longer the batch's, row for row
    if type(dst) is Tensor and src is not None and dst.dim() >= 1 and dst.shape[0] == _rows(src):
        if _written_span(dst, index, value) == _abs_span(value):
            dst.__class__ = PackedRows  # out[s:e] = f(rows[s:e]): out holds the batch's rows from now on
            dst._origin, dst._span, dst._filled = src, None, ()
            _fill(dst, _abs_span(value))
    return None


def _fill(dst: PackedRows, span: tuple[int, int]) -> None:
    """Record that rows ``span`` of ``dst`` (packed rows recognised by a write) hold the batch's
    rows; once every row does, ``dst`` is the batch's rows like any other (no record)."""
    filled = dst.__dict__.get("_filled")
    if filled is None:
        return  # every row was the batch's already (rows.new_zeros(...), a completed fill)
    merged: list[tuple[int, int]] = []
    for s, e in sorted([*filled, span]):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    done = merged == [(0, _rows(dst.__dict__["_origin"]))] or _rows(dst.__dict__["_origin"]) == 0
    dst._filled = None if done else tuple(merged)


def _unfilled(t: PackedRows) -> str | None:
    """The rows of ``t`` no write of the batch's rows reached yet, as text (None: every row)."""
    filled = t.__dict__.get("_filled")
    if filled is None:
        return None
    gaps, at = [], 0
    for s, e in [*filled, (_rows(t.__dict__["_origin"]),) * 2]:
        if s > at:
            gaps.append(f"{at}:{s}")
        at = max(at, e)
    return ", ".join(gaps)


def _keeps_all_rows(index: Any, ndim: int) -> bool:
    """``t[index]`` takes every row, in order (``t[:, :4]``, ``t[..., 0]`` of a 2-d ``t``)."""
    entries = index if isinstance(index, tuple) else (index,)
    if not entries:
        return False
    if entries[0] is Ellipsis:
        return sum(e is not None for e in entries[1:]) < ndim
    return isinstance(entries[0], slice) and entries[0] == slice(None)


def _written_span(dst: Tensor, index: Any, value: Tensor) -> tuple[int, int] | None:
    """The rows of the batch that ``dst[index] = value`` writes ``value``'s rows to, when its dim 0
    lands on dim 0 of ``dst`` row for row; None otherwise."""
    sl = _dim0_slice(index)
    if sl is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        region = Tensor.__getitem__(dst, index)
    if region.dim() != value.dim() or region.dim() == 0 or region.shape[0] != value.shape[0]:
        return None  # broadcast along dim 0, or value's rows land on another dim
    s, e, _ = sl.indices(dst.shape[0])
    off = _abs_span(dst)[0] if isinstance(dst, PackedRows) else 0
    return (off + s, off + max(s, e))


def _abs_span(t: PackedRows) -> tuple[int, int]:
    span = _span_of(t)
    return (0, _rows(t.__dict__["_origin"])) if span is None else span


def _plain(t: PackedRows) -> None:
    """``t`` no longer holds a batch's rows: a plain tensor again (the same object)."""
    t.__dict__.pop("_origin", None)
    t.__dict__.pop("_span", None)
    t.__dict__.pop("_filled", None)
    t.__class__ = Tensor


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


def _back_to_batch(func, args: tuple, kwargs: dict, origin: NestedTensor) -> NestedTensor | None:
    rows = args[0]
    if not isinstance(rows, PackedRows) or rows.dim() == 0:
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
    # sizes read from the batch's shape name the batch: a view that cannot be it is refused
    names = any(isinstance(e, Extent) for e in target[1 : 1 + k])
    op = "view" if func is Tensor.view else "reshape"
    span, t_rows = _span_of(rows), _rows(origin)
    if span is not None or rows.shape[0] != t_rows:
        if not names:
            return None
        raise StructureError(
            f"{op}(): these {rows.shape[0]} rows are rows {span[0]}:{span[1]} of the {t_rows} packed rows of a batch "
            f"of {origin.batch_size} samples; only all {t_rows} rows view back to the batch's shape "
            f"{tuple(int(t) for t in target)}. Write every chunk into one tensor of {t_rows} rows "
            f"(out = rows.new_empty(...); out[s:e] = f(rows[s:e])) and {op} that"
        )
    missing = _unfilled(rows)
    if missing is not None:
        raise StructureError(
            f"{op}(): these {t_rows} rows were recognised as the packed rows of a batch of {origin.batch_size} "
            f"samples by writes of its rows, and rows {missing} were never written from that batch's rows (they "
            f"hold what the tensor held before, or rows of another batch): a sample alone would not read them. "
            f"Write every chunk (out[s:e] = f(rows[s:e]) for every s), or allocate with rows.new_zeros(...)"
        )
    tail = list(target[1 + k :])
    per_row = math.prod(rows.shape[1:])
    if tail.count(-1) == 1:
        known = math.prod(t for t in tail if t != -1)
        if known != 0 and per_row % known == 0:
            tail[tail.index(-1)] = per_row // known
    if any(t < 0 for t in tail) or (math.prod(tail) != per_row and t_rows > 0):  # no rows: every sample is empty
        if not names:
            return None
        raise StructureError(
            f"{op}(): these {t_rows} rows of {tuple(rows.shape[1:])} are the packed rows of a batch of "
            f"{origin.batch_size} samples of sizes {_fmt_sizes(origin.host_sizes())}; the target "
            f"{tuple(int(t) for t in target)} names the batch's sizes and gives every row the shape "
            f"{tuple(int(t) for t in tail)}, which does not hold {per_row} elements (each sample alone fails the "
            f"same way). Give the rows' own last dims: x.shape[:-1] + tuple(rows.shape[1:])"
        )
    with torch._C.DisableTorchFunctionSubclass():
        plain = rows.as_subclass(Tensor)
        vals = plain.view(plain.shape[0], *tail) if func is Tensor.view else plain.reshape(plain.shape[0], *tail)
        out = restructure(origin, vals, [(RAGGED, d) for d in range(k)] + [(STATIC, n) for n in tail])
    if out._lineage is None and not torch.compiler.is_compiling():
        out._lineage = origin._lineage  # the batch's own samples: sizes read from either apply to both
    return out
