"""Shape ops that change which rows a sample holds, or join NestedTensors: ``narrow``,
``cat``/``concat``/``concatenate``, ``stack`` and ``gather``.

Along static dims these are the dense op on ``values``. Along a ragged dim every sample
gets new rows: the row index is computed once from the host metadata (no device sync
when the batch carries it, as collated batches do) and applied with one
``index_select`` / ``gather``, so autograd flows through ``values``. Along the batch
dim, ``cat`` joins batches and ``narrow`` takes a sub-batch (a view).

Per-sample layout of ``torch.cat([a, b], dim=1)`` with ``a`` samples ``(L_i, C)`` and
``b`` samples ``(M_i, C)``, ``L = (2, 1)``, ``M = (1, 2)``::

    a values   [a0 a1 | a2]        b values   [b0 | b1 b2]
    out values [a0 a1 b0 | a2 b1 b2]          offsets [0, 3, 6], sizes [[3, C], [3, C]]
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure, static_changed
from padless.ops.rows.shape_idioms import dense_cat_operands, drop_empty_dense
from padless.ops.rows.stacked import stack_batches
from padless.ops.rows.static_dims import join_static
from padless.ops.rows.windows import window_rows
from padless.tensor.views import as_view, put_rows
from padless.ops.common.structure import STATIC, keep_all, outer_dim, restructure, sample_dim, values_dim
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.convert import select_samples
from padless.tensor.core import NestedTensor, StructureMeta, _fmt_shape, _is_traced, check_same_structure
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent, check_extent
from padless.tensor.traced import traced_max, traced_sum


def _host_int(op: str, what: str, x: Any) -> int:
    if isinstance(x, Tensor):
        if x.numel() != 1 or x.is_floating_point() or x.device.type != "cpu":
            raise TypeError(f"{op}(): {what} must be a python int (or a one-element CPU integer tensor), got {x!r}")
        return int(x)
    return operator.index(x)


@implements(torch.narrow, torch.Tensor.narrow, accepts="packed")
def narrow(func, nt: NestedTensor, dim: int, start, length) -> NestedTensor:
    """The window ``[start, start + length)`` of every sample along ``dim``.

    Static dim: a view of ``values``. Batch dim: a sub-batch (a view). Ragged dim: the
    same window of every sample (a negative ``start`` counts from each sample's end),
    gathered into new rows; a sample too short for the window raises, naming it.
    """
    o = outer_dim(nt, dim, "narrow")
    if (isinstance(start, Extent) or isinstance(length, Extent)) and o - 1 in nt._ragged:
        return _narrow_per_sample(nt, o - 1, start, length)
    start, length = _host_int("narrow", "start", start), _host_int("narrow", "length", length)
    if length < 0:
        raise ValueError(f"narrow(): length must be non-negative, got {length}")
    if o == 0:
        b = nt.batch_size
        s = start + b if start < 0 else start
        if s < 0 or s + length > b:
            raise IndexError(f"narrow(): start {start} + length {length} is out of range for a batch of {b} samples")
        return select_samples(nt, slice(s, s + length))
    p = o - 1
    if p not in nt._ragged:
        vd = values_dim(nt, p)
        return restructure(nt, values_of(nt).narrow(vd, start, length), static_changed(nt, p, length))
    if nt._meta.host_sizes is None and _is_traced(nt._sizes):
        return _narrow_traced(nt, p, start, length)
    hs, ho = host_structure(nt, "narrow")
    n = hs[:, p]
    s = n + start if start < 0 else torch.full_like(n, start)
    bad = ((s < 0) | (s + length > n)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise IndexError(
            f"narrow(): sample {i} has size {int(n[i])} along dim {o}, too short for the window "
            f"start={start}, length={length}"
        )
    return _window_view(nt, hs, ho, p, s, length)


def _narrow_per_sample(nt: NestedTensor, p: int, start: Any, length: Any) -> NestedTensor:
    """``narrow`` of ragged dim ``p`` with a start or length read from the batch's shape
    (``x.narrow(1, 0, x.shape[1] - 1)``): every sample's own window, as ``narrow`` on that
    sample alone (a negative start counts from its end; a window past it raises, naming it)."""
    hs, ho = host_structure(nt, "narrow")
    n = hs[:, p]

    def column(x: Any, what: str) -> Tensor:
        if isinstance(x, Extent):
            check_extent(x, nt, "narrow", what, " (x.narrow(1, 0, x.shape[1] - 1))")
            return torch.tensor(x.per_sample(), dtype=torch.int64)
        return torch.full_like(n, _host_int("narrow", what, x))

    s0, length_i = column(start, "start"), column(length, "length")
    s = torch.where(s0 < 0, n + s0, s0)
    bad = ((s0 < -n) | (s0 > n) | (length_i < 0) | (s + length_i > n)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise IndexError(
            f"narrow(): sample {i} has size {int(n[i])} along dim {p + 1}, too short for its window "
            f"start={int(s0[i])}, length={int(length_i[i])} (its own values of the sizes read from the shape)"
        )
    return _window_view(nt, hs, ho, p, s, length_i)


def _window_view(nt: NestedTensor, hs: Tensor, ho: Tensor, p: int, start: Tensor, length: Any) -> NestedTensor:
    """The window ``[start, start + length)`` of ragged dim ``p`` of every sample, as a view that
    writes through to ``nt``."""
    rows, out_hs, out_ho = window_rows(nt, hs, ho, p, start, length)
    return as_view(from_host_structure(values_of(nt).index_select(0, rows), out_hs, nt._ragged, nt, out_ho), nt, put_rows(rows))


def _narrow_traced(nt: NestedTensor, p: int, start: int, length: int) -> NestedTensor:
    """``narrow`` of ragged dim ``p`` inside a compiled graph, from device sizes. With one
    ragged dim the output has ``B * length`` rows (a size the compiler knows); with several,
    the row count is a new size (:func:`padless.tensor.traced.traced_sum`)."""
    n = nt._sizes[:, p]
    s = n + start if start < 0 else torch.full_like(n, start)
    torch._assert_async(
        ((s >= 0) & (s + length <= n)).all(),
        f"narrow(): a sample is too short along dim {p + 1} for the window start={start}, length={length}",
    )
    out_sizes = nt._sizes.clone()
    out_sizes[:, p] = length
    counts = layout.row_counts(out_sizes, nt._ragged)
    out_offsets = layout.offsets_from_counts(counts)
    total = nt.batch_size * length if len(nt._ragged) == 1 else traced_sum(counts)
    sid, coords = layout.row_coords(out_sizes, out_offsets, nt._ragged, total)
    q = nt._ragged.index(p)
    coords[q] = coords[q] + s.index_select(0, sid)
    rows = layout.source_rows(sid, dict(zip(nt._ragged, coords)), nt._sizes, nt._offsets, nt._ragged)
    env = list(nt._env)
    env[p] = length
    return nested_from_values(values_of(nt).index_select(0, rows), out_offsets, out_sizes, nt._ragged, env, StructureMeta())


# ---------------------------------------------------------------------------- cat / stack


def _nested_inputs(op: str, tensors: Sequence[Any]) -> list[NestedTensor]:
    """The inputs, checked to be NestedTensors, with ragged dims re-laid out in input 0's
    storage order where one of them was transposed (a row gather for that input only)."""
    for j, t in enumerate(tensors):
        if not isinstance(t, NestedTensor):
            what = f"a dense Tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(
                f"{op}(): input {j} is {what}; every input must be a NestedTensor "
                "(pack dense samples with padless.from_list first)"
            )
    order = tensors[0]._ragged
    return [
        relayout(t, order) if t._ragged != order and sorted(t._ragged) == sorted(order) else t for t in tensors
    ]


def relayout(nt: NestedTensor, ragged_order: Sequence[int]) -> NestedTensor:
    """The same samples with ragged dims stored in ``ragged_order`` (a permutation of
    ``nt``'s ragged dims): ``relayout(x.transpose(1, 2), (0, 1))`` makes a transposed pair
    batch contiguous again. One row gather through host metadata; differentiable."""
    order = tuple(ragged_order)
    if sorted(order) != sorted(nt._ragged):
        raise StructureError(f"relayout(): {order} is not a permutation of the ragged dims {nt._ragged}")
    if order == nt._ragged:
        return nt
    if nt._meta.host_sizes is None and _is_traced(nt._sizes):  # compiled: same rows, sizes, envelope
        _, rows = layout.relayout_rows(nt._sizes, nt._offsets, nt._ragged, order, nt._values.shape[0])
        vals = values_of(nt).index_select(0, rows)
        return nested_from_values(vals, nt._offsets, nt._sizes, order, nt._env, StructureMeta())
    hs, ho = host_structure(nt, "relayout")
    _, rows = layout.relayout_rows(hs, ho, nt._ragged, order, nt._values.shape[0])
    vals = values_of(nt).index_select(0, rows.to(nt._values.device, non_blocking=True))
    return from_host_structure(vals, hs, order, nt, ho, nt._offsets)


def _same_static(op: str, ts: Sequence[NestedTensor], skip: int | None = None) -> None:
    t0 = ts[0]
    for j, t in enumerate(ts[1:], 1):
        if t.sample_dim != t0.sample_dim or t._ragged != t0._ragged:
            raise StructureError(
                f"{op}(): input {j} has sample rank {t.sample_dim} and ragged dims stored as "
                f"{t._ragged}; input 0 has {t0.sample_dim} and {t0._ragged}"
            )
        a, b = list(t0._values.shape[1:]), list(t._values.shape[1:])
        if skip is not None:
            a[skip - 1], b[skip - 1] = 0, 0
        if a != b:
            raise StructureError(
                f"{op}(): static dims differ: input 0 has static extents {tuple(t0._values.shape[1:])}, "
                f"input {j} has {tuple(t._values.shape[1:])}"
            )


@implements(torch.cat, torch.concat, torch.concatenate, accepts="packed (all inputs)")
def cat(func, tensors: Sequence[Tensor], dim: int = 0, *, axis: int | None = None, out=None) -> NestedTensor:
    """Concatenate NestedTensors.

    * ``dim=0``: join batches (``B1 + B2`` samples; same rank, ragged dims and static extents);
    * a static dim: concatenate ``values`` along it (same ragged structure);
    * a ragged dim: per-sample concatenation, ``(L_i, C)`` and ``(M_i, C)`` give
      ``(L_i + M_i, C)``; every other dim must agree sample by sample. Rows are gathered
      through an index built on the host metadata.
    """
    if out is not None:
        raise NotImplementedError("cat(): out= is not supported for NestedTensors")
    dim = axis if axis is not None else dim
    joined = join_static("cat", tensors, dim)  # one structure, a static dim: a cat of the rows
    if joined is not None:
        return joined
    tensors = drop_empty_dense(tensors, dim)  # torch.cat([empty_cache, x], dim): the empty adds nothing
    tensors = dense_cat_operands(tensors, dim)  # a dense (B, k, C) block: k rows of every sample
    if len(tensors) == 1 and isinstance(tensors[0], NestedTensor):
        return tensors[0].clone()
    ts = _nested_inputs("cat", tensors)
    o = outer_dim(ts[0], dim, "cat")
    if o == 0:
        return _cat_batches(ts)
    p = o - 1
    if p not in ts[0]._ragged:
        _same_static("cat", ts, skip=values_dim(ts[0], p))
        for t in ts[1:]:
            check_same_structure("cat", ts[0], t)
        vd = values_dim(ts[0], p)
        vals = torch.cat([values_of(t) for t in ts], vd)
        return restructure(ts[0], vals, static_changed(ts[0], p, vals.shape[vd]))
    return _cat_ragged(ts, p)


def _cat_batches(ts: list[NestedTensor]) -> NestedTensor:
    _same_static("cat", ts)
    vals = torch.cat([values_of(t) for t in ts], 0)
    env = [max(t._env[d] for t in ts) for d in range(ts[0].sample_dim)]
    sizes = torch.cat([t._sizes for t in ts], 0)
    parts, base = [ts[0]._offsets[:1]], 0
    for t in ts:
        parts.append(t._offsets[1:] + base)
        base = base + t._values.shape[0]
    meta = StructureMeta()
    if all(t._meta.host_sizes is not None for t in ts):
        meta.host_sizes = torch.cat([t._meta.host_sizes for t in ts], 0)
        meta.host_offsets = layout.offsets_from_counts(layout.row_counts(meta.host_sizes, ts[0]._ragged))
    return nested_from_values(vals, torch.cat(parts), sizes, ts[0]._ragged, env, meta)


def _cat_ragged(ts: list[NestedTensor], p: int) -> NestedTensor:
    _same_static("cat", ts)
    t0, ragged = ts[0], ts[0]._ragged
    traced = _is_traced(t0._sizes) and any(t._meta.host_sizes is None for t in ts)
    if traced:  # compiled: device sizes; the row count is the inputs' together, the envelope a symbol
        hosts = [(t._sizes, t._offsets) for t in ts]
        for j, t in enumerate(ts[1:], 1):
            if t.batch_size != t0.batch_size:
                raise StructureError(f"cat(): batch sizes differ: input 0 has {t0.batch_size} samples, input {j} has {t.batch_size}")
    else:
        hosts = [host_structure(t, "cat") for t in ts]
    others = [c for c in range(t0.sample_dim) if c != p]
    for j, (hs, _) in enumerate(hosts[1:], 1):
        if traced:
            torch._assert_async(
                (hs[:, others] == hosts[0][0][:, others]).all(),
                f"cat(): along ragged dim {p + 1} every other dim must agree per sample (input {j} differs)",
            )
            continue
        if hs.shape[0] != t0.batch_size:
            raise StructureError(f"cat(): batch sizes differ: input 0 has {t0.batch_size} samples, input {j} has {hs.shape[0]}")
        bad = (hs[:, others] != hosts[0][0][:, others]).any(1).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise StructureError(
                f"cat(): along ragged dim {p + 1} every other dim must agree per sample: sample {i} has "
                f"{_fmt_shape(hosts[0][0][i].tolist())} in input 0 and {_fmt_shape(hs[i].tolist())} in input {j}"
            )
    lens = torch.stack([hs[:, p] for hs, _ in hosts], 1)  # (B, n)
    cum = torch.cat([torch.zeros_like(lens[:, :1]), lens.cumsum(1)], 1)
    out_hs = hosts[0][0].clone()
    out_hs[:, p] = cum[:, -1]
    out_ho = hosts[0][1]  # rows of a sample add up: the other dims agree
    for _, ho in hosts[1:]:
        out_ho = out_ho + ho
    total = sum(t._values.shape[0] for t in ts)
    sid, coords = layout.row_coords(out_hs, out_ho, ragged, total)
    q = ragged.index(p)
    c = coords[q]
    j = (c.unsqueeze(1) >= cum[sid, 1:-1]).sum(1)  # input holding each row: boundaries passed
    coords[q] = c - cum[sid, j]
    sizes_all = torch.stack([hs for hs, _ in hosts])  # (n, B, D)
    offs_all = torch.stack([ho for _, ho in hosts])  # (n, B+1)
    base = torch.cat([offs_all.new_zeros(1), offs_all[:, -1].cumsum(0)])  # first row of each input
    row = torch.zeros_like(sid)
    for d, cd in zip(ragged, coords):
        row = row * sizes_all[j, sid, d] + cd
    rows = base[j] + offs_all[j, sid] + row
    vals = torch.cat([values_of(t) for t in ts], 0)
    if traced:
        env, meta = list(t0._env), StructureMeta()
        env[p] = traced_max(out_hs[:, p], meta, p)
        return nested_from_values(vals.index_select(0, rows), out_ho, out_hs, ragged, env, meta)
    vals = vals.index_select(0, rows.to(t0._values.device, non_blocking=True))
    return from_host_structure(vals, out_hs, ragged, t0, out_ho)


@implements(torch.stack, accepts="packed (all inputs)")
def stack(func, tensors: Sequence[Tensor], dim: int = 0, *, out=None) -> NestedTensor:
    """Stack NestedTensors of one structure along a new static dim ``dim >= 1``
    (``(L_i, C)`` x n -> ``(n, L_i, C)`` at ``dim=1``). ``dim=0`` puts the new dim in front
    of the batch: a :class:`padless.ops.rows.stacked.StackedBatch` (reduce or index it)."""
    if out is not None:
        raise NotImplementedError("stack(): out= is not supported for NestedTensors")
    joined = join_static("stack", tensors, dim)  # one structure, a static dim: a stack of the rows
    if joined is not None:
        return joined
    ts = _nested_inputs("stack", tensors)
    o = outer_dim(ts[0], dim, "stack", extra=1)
    if o == 0:
        return stack_batches(ts)
    _same_static("stack", ts)
    for t in ts[1:]:
        check_same_structure("stack", ts[0], t)
    dims = keep_all(ts[0])
    p = o - 1
    vpos = 1 + sum(1 for kind, _ in dims[:p] if kind == STATIC)
    dims.insert(p, (STATIC, len(ts)))
    return restructure(ts[0], torch.stack([values_of(t) for t in ts], vpos), dims)


# ---------------------------------------------------------------------------- gather


@implements(torch.gather, torch.Tensor.gather, accepts="packed input, packed int64 index")
def gather(func, nt: NestedTensor, dim: int, index: Tensor, *, sparse_grad: bool = False, out=None) -> NestedTensor:
    """``out[i][..., k, ...] = nt[i][..., index[i][..., k, ...], ...]`` sample by sample.

    ``index`` is an int64 NestedTensor with the same ragged dims as ``nt``; the result
    takes its structure. Along a static dim, ``index`` has the ragged extents of ``nt``.
    Along a ragged dim its extent is free per sample (indices are sample-local, in
    ``[0, n_i)``) and its other ragged extents equal ``nt``'s. Its static extents may be
    smaller than ``nt``'s, as in torch.
    """
    if out is not None:
        raise NotImplementedError("gather(): out= is not supported for NestedTensors")
    if not isinstance(index, NestedTensor):
        raise TypeError(
            f"gather(): index must be a NestedTensor of the input's ragged structure, got a dense "
            f"Tensor of shape {tuple(index.shape)}"
        )
    o = outer_dim(nt, dim, "gather")
    p = sample_dim(nt, dim, "gather")
    if index.dtype != torch.int64:
        raise TypeError(f"gather(): index must be int64, got {index.dtype}")
    if index.sample_dim != nt.sample_dim or index._ragged != nt._ragged or index.batch_size != nt.batch_size:
        raise StructureError(
            f"gather(): index (batch {index.batch_size}, rank {index.sample_dim}, ragged dims stored as "
            f"{index._ragged}) must match the input (batch {nt.batch_size}, rank {nt.sample_dim}, {nt._ragged})"
        )
    for k, (a, b) in enumerate(zip(nt._values.shape[1:], index._values.shape[1:]), 1):
        if k != (values_dim(nt, p) if p not in nt._ragged else -1) and b > a:
            raise ValueError(
                f"gather(): index static extents {tuple(index._values.shape[1:])} exceed the input's "
                f"{tuple(nt._values.shape[1:])} outside dim {o}"
            )
    vals, idx = values_of(nt), index._values
    if p not in nt._ragged:  # same rows: a gather inside every row (works under torch.compile)
        check_same_structure("gather", nt, index)
        return _restructure_as(torch.gather(vals, values_dim(nt, p), idx), index)
    rag = [r for r in nt._ragged if r != p]
    traced = _is_traced(idx) and (nt._meta.host_sizes is None or index._meta.host_sizes is None)
    if traced:  # compiled: device sizes; the output has the index's rows (a size the graph knows)
        hs, ho, his, hio = nt._sizes, nt._offsets, index._sizes, index._offsets
        torch._assert_async(
            (hs[:, rag] == his[:, rag]).all(),
            f"gather(): index and input may differ only along dim {o} and in static extents",
        )
        bad = hs.new_zeros((0, 1))
    else:
        hs, ho = host_structure(nt, "gather")
        his, hio = host_structure(index, "gather")
        bad = (hs[:, rag] != his[:, rag]).any(1).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise StructureError(
            f"gather(): index sample {i} has {_fmt_shape(his[i].tolist())}, input has "
            f"{_fmt_shape(hs[i].tolist())}; they may differ only along dim {o} and in static extents"
        )
    sid, coords = layout.row_coords(his, hio, nt._ragged, idx.shape[0])
    q = nt._ragged.index(p)
    coords[q] = torch.zeros_like(sid)
    base = layout.source_rows(sid, dict(zip(nt._ragged, coords)), hs, ho, nt._ragged)
    stride = torch.ones_like(sid)
    for r in nt._ragged[q + 1 :]:
        stride = stride * hs[sid, r]
    extent = hs[sid, p]
    shape = (-1,) + (1,) * (idx.dim() - 1)
    dev = idx.device
    extent_d = extent.to(dev, non_blocking=True).view(shape)
    ok = (idx >= 0) & (idx < extent_d)
    if dev.type == "cpu" and not traced:
        if not bool(ok.all()):
            row = int((~ok).reshape(ok.shape[0], -1).any(1).nonzero()[0, 0])
            i, v = int(sid[row]), int(idx[row][~ok[row]].flatten()[0])
            raise IndexError(f"gather(): index {v} is out of range for sample {i} of size {int(extent[row])} along dim {o}")
    else:
        torch._assert_async(ok.all(), f"gather(): an index is out of range for its sample along dim {o}")
    src = base.to(dev, non_blocking=True).view(shape) + idx * stride.to(dev, non_blocking=True).view(shape)
    return _restructure_as(torch.gather(vals, 0, src), index)


def _restructure_as(vals: Tensor, like: NestedTensor) -> NestedTensor:
    """``vals`` (same rows and static extents as ``like``) with ``like``'s structure, autograd kept."""
    return nested_from_values(vals, like._offsets, like._sizes, like._ragged, like._env, like._meta)
