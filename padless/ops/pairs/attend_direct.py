"""The fused attention's operands read straight into their batched-matmul layout.

A bucket of the fast path (:class:`padless.ops.pairs.attend._Fast`) multiplies 3-d operands:
``q`` of rows ``(N_i, H, D)`` as ``(count * H, L, D)``, ``k`` as its transpose ``(count * H, D,
L)``, ``v`` as ``(count * H, L, D)``. Gathering the rows into the bucket's padded rows
``(count, L, H, D)`` and then copying that into ``(count, H, L, D)`` (a reshape of a permuted
view) moves every operand twice and costs a few aten calls per bucket and operand. Here the
rows are read by *units* of their last dim (``D`` numbers, ``U = H`` units per row): one map per
layout sends every place of ``(count, H, L, D)`` (all buckets one after another) to its unit of
the packed rows, so one ``index_select`` reads every bucket's operand in its matmul layout, and
the gradient comes back by the inverse map, one ``index_select`` from the buckets' products
written into one buffer (no per-bucket copy, no ``cat``).

``q``, ``k`` and ``v`` of one batch share their row maps (one layout) and so their unit maps:
built once per layout and lengths (cached by content), on the first step of a new batch; a few numpy ops on maps as
long as the padded units. On the CPU only (the fused node's device; building the maps elsewhere
would read the device's row maps back).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from padless.ops.common import content
from padless.ops.kernels.layout import RowMap

ENABLED = True
"""False: the gather-and-copy path (for comparisons)."""


class Direct:
    """How one operand reads its buckets through unit maps: ``fwd`` (every place of the
    concatenated bucket layouts -> its unit of the packed rows, holes read 0), ``bwd`` (every
    unit of the packed rows -> its place), per bucket its units and its 3-d view, and whether
    that view is the transpose of the gathered layout (``trans``: ``k`` of ``q @ k^T``)."""

    __slots__ = ("fwd", "bwd", "units", "dims", "trans", "width")

    def read(self, values: Tensor) -> list[Tensor]:
        """Per bucket the 3-d operand ``(batch, m, k)`` (or ``(batch, k, n)``), views of one buffer."""
        rows = values.reshape(-1, self.width)
        buf = rows.index_select(0, self.fwd.safe)
        if self.fwd.holes is not None:
            buf.index_fill_(0, self.fwd.holes, 0.0)
        out = []
        for piece, (bt, mid, rest) in zip(buf.split(self.units), self.dims):
            out.append(piece.view(bt, rest, mid).transpose(1, 2) if self.trans else piece.view(bt, mid, rest))
        return out

    def grad_buffer(self, like: Tensor) -> tuple[Tensor, list[Tensor]]:
        """One buffer for the operand's gradient and, per bucket, the 3-d piece a ``bmm`` writes
        (the gathered layout: ``(batch, k, n)`` stored as ``(batch, n, k)`` when ``trans``)."""
        buf = like.new_empty((sum(self.units), self.width))
        pieces = []
        for piece, (bt, mid, rest) in zip(buf.split(self.units), self.dims):
            pieces.append(piece.view(bt, rest, mid) if self.trans else piece.view(bt, mid, rest))
        return buf, pieces

    def back(self, buf: Tensor, like) -> Tensor:
        """The packed rows (shaped ``like``: a tensor or a shape) from a filled buffer."""
        return buf.index_select(0, self.bwd).view(like if isinstance(like, tuple) else like.shape)


def build(maps: tuple[RowMap, RowMap], splits: Sequence[int], views: Sequence[tuple], static: Sequence[int]) -> Direct | None:
    """The unit maps of one operand (row maps ``maps`` into buffers of ``splits`` rows per bucket,
    each bucket's piece ``views[k] = (shape, comp, dims)``: its storage shape, the permutation to
    the matmul form and the 3-d extents), or None when its last stored dim is not a static dim
    that the form keeps last or next to last, or its maps are not on the host (the
    gather-and-copy path then). The maps are cached by content
    (:mod:`padless.ops.common.content`): ``q``, ``k``, ``v`` and the result share them, and a
    batch of lengths seen before builds none."""
    if not static or math.prod(static) == 0 or maps[0].safe.device.type != "cpu":
        return None
    width = static[-1]
    per_row = math.prod(static) // width
    plans, kinds = [], set()
    for (shape, comp, dims) in views:
        nd = len(shape)
        if nd - len(static) < 1 or list(shape[nd - len(static):]) != list(static):
            return None
        if comp[-1] == nd - 1:
            order, trans = list(comp), False
        elif comp[-2] == nd - 1 and dims[1] == shape[comp[-2]] and dims[2] == shape[comp[-1]]:
            order, trans = [*comp[:-2], comp[-1], comp[-2]], True
        else:
            return None
        plans.append((tuple(shape), tuple(order[:-1])))
        kinds.add(trans)
    if len(kinds) != 1:
        return None
    # by the row maps' identity: they are shared by content (one object per layout and lengths,
    # padless.ops.common.content), and the entry holds them, so the identity cannot be reused
    key = ("direct_units", id(maps[0].safe), tuple(splits), tuple(plans), per_row)
    hit = content.get(key)
    if hit is None:
        hit = _unit_maps(maps, splits, plans, per_row) + (maps,)
        held = sum(t.numel() * t.element_size() for m in (hit[0], maps[0], maps[1]) for t in m if t is not None)
        content.put(key, hit, held + hit[1].numel() * hit[1].element_size() + 1024)
    d = Direct()
    d.fwd, d.bwd, d.units = hit[0], hit[1], hit[2]
    d.dims, d.trans, d.width = [tuple(v[2]) for v in views], kinds.pop(), width
    return d


def _unit_maps(maps: tuple[RowMap, RowMap], splits: Sequence[int], plans: Sequence[tuple], per_row: int):
    """``(fwd, bwd, units per bucket)``: see :class:`Direct`. With numpy on the host maps (a few
    thousand entries: torch's per-call cost would dominate)."""
    to_buf, to_rows = maps
    orders, units, start = [], [], 0
    for rows, (shape, order) in zip(splits, plans):
        n = rows * per_row  # the bucket's units, in its buffer's storage order
        ids = np.arange(start * per_row, start * per_row + n)
        orders.append(ids.reshape(shape[:-1]).transpose(order).reshape(-1))
        units.append(n)
        start += rows
    order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
    row, sub = np.divmod(order, per_row)
    safe = to_buf.safe.numpy().astype(np.int64)[row] * per_row + sub
    holes = None
    if to_buf.holes is not None and to_buf.holes.numel():
        hole = np.zeros(start, dtype=bool)
        hole[to_buf.holes.numpy()] = True
        holes = np.flatnonzero(hole[row])
    place = np.empty_like(order)
    place[order] = np.arange(order.size)
    packed = to_rows.safe.numpy().astype(np.int64)[:, None] * per_row + np.arange(per_row)
    bwd = place[packed.reshape(-1)]
    t = torch.from_numpy
    return RowMap(t(safe), t(holes) if holes is not None and holes.size else None), t(bwd), units
