"""Terms broadcast onto pending attention scores, kept at their own size.

A triangle bias ``(1, H, N_i, N_i)`` added to triangle-attention scores ``(N_i, H, N_i, N_i)``
(or a key mask ``(N_i, 1, 1, N_i)``) is a NestedTensor whose extent-1 dims broadcast over the
scores'. Read onto the scores' rows, as any broadcast is (:mod:`padless.ops.common.broadcast`),
it becomes a score-sized tensor: one gather as large as the scores, another into the fused
attention's buckets, and a scatter-add of a score-sized gradient back. Here the term stays a
:class:`Spread`: the recipe of the pending scores (:mod:`padless.ops.pairs.pending`) holds the
NestedTensor itself, and the fused node (:mod:`padless.ops.pairs.attend`) reads its rows once
into a buffer of the buckets' shape with its extent-1 dims kept (``(count, 1, H, J, K)`` per
bucket), adds it to every bucket's scores by broadcasting, and makes its gradient by summing
the bucket's score gradient over those dims and reading the sum back (a gather each way, the
size of the term). Only an op that computes the scores themselves (printing, any use other
than the fused contraction) reads the term onto their rows (:meth:`Spread.rows`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.ops.common import broadcast, content, padded
from padless.ops.kernels.layout import RowMap, grid_positions, padding_maps, read_rows
from padless.ops.pairs.bucket_nodes import _Plan
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _is_traced


class Spread:
    """A NestedTensor ``src`` broadcast onto the pending scores of ``plan`` (the scores' plan:
    same batch and rank; every dim of ``src`` has the scores' extents or a static extent of
    1). Holds the plan, not the scores, whose values hold the recipe that holds this."""

    __slots__ = ("src", "plan")

    def __init__(self, src: NestedTensor, plan: _Plan) -> None:
        self.src, self.plan = src, plan

    @property
    def _version(self) -> int:
        return self.src._values._version

    def rows(self) -> Tensor:
        """The term read onto the scores' rows (no autograd history)."""
        p = self.plan
        offsets, sizes, env, meta = p.structure
        v = self.src._values
        scores = NestedTensor(v.new_zeros(()).expand(p.out_rows, *p.out_static), offsets, sizes, p.out_ragged, env, meta)
        b = broadcast.plan("add", [scores, self.src])
        return broadcast.align(v.detach(), b.rows[1], b.squeeze[1])


def spreads(x: NestedTensor, y: NestedTensor) -> bool:
    """Whether ``y`` broadcasts onto the scores ``x`` (whose values are pending) without growing
    them and without being their shape: a :class:`Spread` term."""
    if not isinstance(y, NestedTensor) or y.batch_size != x.batch_size or y.sample_dim != x.sample_dim:
        return False
    if getattr(type(y._values), "padless_deferred", False) or y.dtype != x.dtype or y.device != x.device:
        return False
    hx, hy = x._meta.host_sizes, y._meta.host_sizes
    if hx is None or hy is None or _is_traced(y._values) or torch.compiler.is_compiling():
        return False
    spread = False
    for d in range(x.sample_dim):
        ye = int(y._env[d])
        if d in y._ragged:
            if d not in x._ragged or not torch.equal(hy[:, d], hx[:, d]):
                return False
        elif d in x._ragged:
            if ye != 1:
                return False
            spread = True
        elif ye != int(x._env[d]):
            if ye != 1:
                return False
            spread = True
    return spread


def dense(x: NestedTensor, y: Tensor) -> NestedTensor | None:
    """A dense term ``y`` read in padded coordinates (a key mask ``(B, I, 1, 1, K)`` built from
    the padded batch's mask) as a NestedTensor of its own shape when it broadcasts onto the
    scores ``x``: every sample's window of it (:func:`padless.ops.common.padded.dense_samples`),
    not read onto the scores' rows. None when it is not such a term (the op's rule then reads
    it). A dense term that needs a gradient reaches the op as a NestedTensor already."""
    if isinstance(y, NestedTensor) or not isinstance(y, Tensor) or y.requires_grad or y.dim() != x.dim():
        return None
    if y.dtype != x.dtype or y.device != x.device or x._meta.host_sizes is None or _is_traced(y):
        return None
    env = [int(e) for e in x._env]
    b = x.batch_size
    if y.shape[0] not in (1, b):
        return None
    spread = False
    for d in range(x.sample_dim):
        e = y.shape[1 + d]
        if e == 1:
            spread = spread or env[d] != 1 or d in x._ragged
        elif e != env[d]:
            return None
    ragged = tuple(d for d in sorted(x._ragged) if y.shape[1 + d] != 1)
    if not spread or not ragged:
        return None
    hs = x._meta.host_sizes.tolist()
    views = padded.dense_samples("add", "term", y, hs, env, x._ragged, x)
    order = layout.storage_order(x.sample_dim, ragged)
    static = [y.shape[1 + d] for d in order[len(ragged):]]
    rows = [v.permute(order).reshape(-1, *static) for v in views]
    sizes = torch.tensor([[h[d] if d in ragged else y.shape[1 + d] for d in range(x.sample_dim)] for h in hs],
                         dtype=torch.int64).reshape(b, x.sample_dim)
    offsets = layout.offsets_from_counts(layout.row_counts(sizes, ragged))
    env_y = [env[d] if d in ragged else y.shape[1 + d] for d in range(x.sample_dim)]
    dev = y.device
    on = (lambda t: t) if dev.type == "cpu" else (lambda t: t.to(dev, non_blocking=True))  # noqa: E731
    values = torch.cat(rows) if rows else y.new_zeros((0, *static))
    return NestedTensor(values, on(offsets), on(sizes), ragged, env_y, StructureMeta(sizes, offsets))


class Maps(NamedTuple):
    """How a :class:`Spread` term's elements sit in the buckets of a scores plan."""

    to_buf: RowMap  # buffer elements read from the term's elements (holes: 0)
    to_src: RowMap  # the term's elements read from the buffer
    splits: list[int]  # buffer elements of every bucket
    shapes: list[list[int]]  # per bucket: (count, *dims) in sample order, extent-1 dims kept
    sums: list[tuple[int, ...]]  # per bucket: dims summed by the gradient (extent 1 here, more in the scores)


def maps(plan: _Plan, src: NestedTensor) -> Maps:
    """The bucket maps of ``src`` for the scores' ``plan`` (cached on the plan by content)."""
    key = ("spread", content.structure_key(src), tuple(int(e) for e in src._env), str(src._values.device))
    hit = plan.cache.get(key)
    if hit is None:
        hit = plan.cache[key] = _build(plan, src)
    return hit


def _build(plan: _Plan, src: NestedTensor) -> Maps:
    letters = plan.equation.split("->")[1][1:]  # the scores' sample dims (after the batch letter)
    hs = src._meta.host_sizes.numpy()
    ragged = src._ragged  # storage order: the order rows enumerate them
    static = [d for d in range(src.sample_dim) if d not in ragged]
    senv = [int(e) for e in src._env]
    shapes, sums, splits, pieces = [], [], [], []
    start = 0
    for count, ext in plan.buckets:
        dims = [ext[letters[d]] if d in ragged else senv[d] for d in range(src.sample_dim)]
        shapes.append([count, *dims])
        sums.append(tuple(1 + d for d in range(src.sample_dim) if dims[d] == 1 and ext[letters[d]] != 1))
        per = math.prod(dims)
        strides = [math.prod(dims[d + 1:]) for d in range(src.sample_dim)]
        splits.append(count * per)
        pieces.append((start, per, strides))
        start += count * per
    where = {s: (k, q) for k, ids in enumerate(plan.groups) for q, s in enumerate(ids)}
    order = [*ragged, *static]  # a sample's elements: rows (ragged dims, storage order), then features
    places = [where[i] for i in range(src.batch_size)]
    idx = grid_positions(hs[:, order].astype(np.int64).reshape(src.batch_size, len(order)),
                         np.array([pieces[k][0] + q * pieces[k][1] for k, q in places], dtype=np.int64),
                         np.array([[pieces[k][2][d] for d in order] for k, _ in places], dtype=np.int64).reshape(src.batch_size, len(order)))
    to_buf, to_src = padding_maps(idx, start, src._values.device)
    return Maps(to_buf, to_src, splits, shapes, sums)


def read(m: Maps, src: Tensor) -> list[Tensor]:
    """Per bucket, the term ``(count, *dims)`` (padded places 0) from its rows ``src``."""
    buf = read_rows(src.reshape(-1), m.to_buf, 0.0)
    return [p.view(s) for p, s in zip(buf.split(m.splits), m.shapes)]


def grad(m: Maps, dx: Sequence[Tensor], like: Tensor) -> Tensor:
    """The term's gradient (rows shaped like ``like``) from the scores' gradient per bucket
    (sample order, ``(count, *dims)``): summed over the broadcast dims, read back."""
    parts = [(d.sum(s, keepdim=True) if s else d).reshape(-1) for d, s in zip(dx, m.sums)]
    buf = torch.cat(parts) if len(parts) > 1 else parts[0]
    return read_rows(buf, m.to_src, 0.0).view(like.shape)
