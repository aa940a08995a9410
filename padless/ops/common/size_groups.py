"""Run a dense op on a NestedTensor's samples, batched by sample shape.

Some ops are exact only when run on each sample alone (resampling, padding of ragged
dims, pixel shuffles): their result at a pixel depends on the image's own extent. This
module runs such an op with as few dense calls as the batch allows: samples are grouped
by their exact shape (plus an optional per-sample key, e.g. a per-image target size),
each group is gathered into one dense ``(n, *sample_shape)`` tensor, the op runs once
per group, and the outputs are scattered back into one packed buffer in sample order.
Nothing is padded: a group holds samples of one shape, so no position is invented.

Layout, three images ``(C, H_i, W_i)`` of shapes ``(C, 2, 3)``, ``(C, 4, 4)``, ``(C, 2, 3)``::

    groups        (C, 2, 3): samples [0, 2]      (C, 4, 4): sample [1]
    dense calls   f(x[[0, 2]] as (2, C, 2, 3))   f(x[[1]] as (1, C, 4, 4))
    output rows   cat(group outputs) reordered to samples 0, 1, 2

The grouping and both row indices are computed once per (structure, keys) on the host
metadata and cached on the structure. Autograd flows through ``index_select`` /
``narrow`` and the op itself, so gradients need no extra code.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _fmt_shape, _is_traced
from padless.tensor.errors import StructureError

__all__ = ["apply_by_shape", "shape_groups"]

DenseOp = Callable[[Tensor, Hashable], Tensor]


def shape_groups(nt: NestedTensor, op: str, keys: Sequence[Hashable] | None = None) -> list[tuple[tuple[int, ...], Hashable, list[int], Tensor | None]]:
    """Samples of ``nt`` grouped by (shape, key), in order of first appearance.

    Each group is ``(sample shape, key, sample ids, input rows)``; ``input rows`` is an
    int64 index into ``values`` on its device, or ``None`` when the group's rows are one
    contiguous run (then a ``narrow`` view is used). Cached per structure and keys.
    """
    cache_key = ("shape_groups", None if keys is None else tuple(keys), nt._values.device)
    hit = nt._meta.derived.get(cache_key)
    if hit is not None:
        return hit
    hs, ho = host_structure(nt, op)
    shapes = [tuple(s) for s in hs.tolist()]
    if keys is not None and len(keys) != len(shapes):
        raise StructureError(f"{op}(): {len(keys)} per-sample entries given for a batch of {len(shapes)} samples")
    by: dict[tuple, list[int]] = {}
    for i, s in enumerate(shapes):
        by.setdefault((s, None if keys is None else keys[i]), []).append(i)
    groups = []
    counts = layout.row_counts(hs, nt._ragged)
    for (shape, key), ids in by.items():
        if ids == list(range(ids[0], ids[0] + len(ids))):
            rows = None
        else:
            idt = torch.tensor(ids, dtype=torch.int64)
            rows = (ho[idt, None] + torch.arange(int(counts[ids[0]]))).flatten()
            rows = rows.to(nt._values.device, non_blocking=True)
        groups.append((shape, key, ids, rows))
    if not _is_traced(nt._values):
        nt._meta.derived[cache_key] = groups
    return groups


def _to_dense(nt: NestedTensor, vals: Tensor, shape: tuple[int, ...], ids: list[int], rows: Tensor | None) -> Tensor:
    """The group's samples as one dense ``(n, *shape)`` tensor (differentiable)."""
    ho = nt.host_offsets()
    n = len(ids)
    if rows is None:
        start, stop = int(ho[ids[0]]), int(ho[ids[-1] + 1])
        part = vals.narrow(0, start, stop - start)
    else:
        part = vals.index_select(0, rows)
    order = layout.storage_order(len(shape), nt._ragged)
    stored = part.reshape(n, *[shape[d] for d in order])
    return stored.permute(0, *[1 + p for p in layout.inverse_order(order)])


def _to_rows(out: Tensor, ragged: tuple[int, ...]) -> Tensor:
    """A dense ``(n, *sample)`` output as packed rows ``(n * rows, *static)``."""
    d = out.dim() - 1
    order = layout.storage_order(d, ragged)
    stored = out.permute(0, *[1 + o for o in order])
    static = [out.shape[1 + s] for s in layout.static_dims(d, ragged)]
    return stored.reshape(-1, *static)


def apply_by_shape(
    op: str,
    nt: NestedTensor,
    fn: DenseOp,
    *,
    keys: Sequence[Hashable] | None = None,
    out_ragged: tuple[int, ...] | None = None,
) -> NestedTensor:
    """``fn`` applied to every sample of ``nt``, one dense call per group of equal shape.

    ``fn(dense, key)`` gets a dense ``(n, *sample_shape)`` batch of samples sharing one
    shape (and one entry of ``keys``, the optional per-sample key) and returns their
    outputs ``(n, *out_shape)``. The result is a NestedTensor with ragged sample dims
    ``out_ragged`` (default: ``nt``'s), whose sample i is ``fn`` of sample i. An error
    raised by ``fn`` is re-raised with the same type, naming ``op`` and the first sample
    of the group (so a too-small image gets torch's own message plus its index).
    """
    ragged = nt._ragged if out_ragged is None else tuple(out_ragged)
    vals = values_of(nt)
    groups = shape_groups(nt, op, keys)
    b = nt.batch_size
    if b == 0:
        raise StructureError(f"{op}(): the batch has no samples; there is no sample shape to run the op on")
    pieces: list[Tensor] = []
    out_shapes: list[tuple[int, ...]] = [()] * b
    statics: set[tuple[int, ...]] = set()
    for shape, key, ids, rows in groups:
        dense = _to_dense(nt, vals, shape, ids, rows)
        try:
            out = fn(dense, key)
        except (RuntimeError, ValueError) as e:
            raise _named(e, f"{op}(): sample {ids[0]} of shape {_fmt_shape(list(shape))}: {e}") from e
        if out.dim() - 1 < (max(ragged) + 1 if ragged else 0):
            raise RuntimeError(f"padless internal: {op} output of rank {out.dim() - 1} lacks ragged dims {ragged}")
        for i in ids:
            out_shapes[i] = tuple(out.shape[1:])
        statics.add(tuple(out.shape[1 + s] for s in layout.static_dims(out.dim() - 1, ragged)))
        pieces.append(_to_rows(out, ragged))
    if len(statics) > 1:
        raise StructureError(
            f"{op}(): the outputs of different samples differ in the static dims {sorted(statics)}; "
            "a static dim must have one extent for the whole batch (make the dims that vary ragged)"
        )
    out_hs = torch.tensor(out_shapes, dtype=torch.int64)
    out_ho = layout.offsets_from_counts(layout.row_counts(out_hs, ragged))
    ordered = [i for _, _, ids, _ in groups for i in ids]
    vals_out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
    if ordered != list(range(b)):
        vals_out = vals_out.index_select(0, _reorder_index(out_hs, out_ho, ragged, ordered).to(vals_out.device, non_blocking=True))
    return from_host_structure(vals_out, out_hs, ragged, nt, out_ho)


def _reorder_index(out_hs: Tensor, out_ho: Tensor, ragged: tuple[int, ...], ordered: list[int]) -> Tensor:
    """For every output row in sample order, its row in the group-ordered concatenation."""
    counts = out_ho[1:] - out_ho[:-1]
    ordt = torch.tensor(ordered, dtype=torch.int64)
    start_cat = torch.empty_like(counts)
    start_cat[ordt] = layout.offsets_from_counts(counts[ordt])[:-1]
    total = int(out_ho[-1])
    sid = layout.row_sample_ids(out_ho, total)
    return start_cat[sid] + torch.arange(total) - out_ho[:-1][sid]


def _named(e: Exception, msg: str) -> Exception:
    """``e``'s type with a message naming the sample (a plain RuntimeError if that type
    cannot be built from a message)."""
    try:
        return type(e)(msg)
    except Exception:  # exotic constructor signatures
        return RuntimeError(msg)
