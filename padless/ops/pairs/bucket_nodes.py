"""The dense side of a bucketed contraction (:mod:`padless.ops.pairs.bucketed` builds the plan):
the padded buckets of every operand viewed as dense tensors, one ``bmm`` per bucket, the
results gathered back, and the autograd nodes that run all of it as one node.

* :class:`_Contract`: a two-operand contraction whose gradients are contractions of the same
  form (``out,other->mine``); forward and backward each gather into the buckets, run one
  dense call per bucket and operand, and gather back.
* :class:`_SoftmaxContract`: ``softmax(x) @ other`` when the operand is the bucketed softmax's
  output over the summed dim (:func:`padless.ops.kernels.softmax.softmax_source`); its
  backward turns the weights' gradient into ``x``'s inside the buckets, so the softmax's own
  backward (gathers in and out of its buckets) does not run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common import segment
from padless.ops.kernels.layout import RowMap, read_elements, read_rows
from padless.ops.kernels.softmax import softmax_source
from padless.tensor import layout
from padless.tensor.core import NestedTensor

_BATCH = "z"  # the batch letter of every dense equation


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a bucketed contraction needs that depends only on the structures."""

    equation: str  # the dense equation, batch letter first in every term
    buckets: list[tuple[int, dict[str, int]]]  # per bucket: sample count, padded extent per letter
    pads: list[tuple[RowMap, RowMap]]  # per operand: its padded buffer's rows <-> its packed rows
    packs: tuple[RowMap, RowMap]  # the concatenated bucket results' rows <-> the result's rows
    splits: list[list[int]]  # per operand: buffer rows (elements, when flat) of every bucket
    flat: list[bool]  # per operand, then the result: maps over elements (bucketed._buffer_index)
    views: list[list[tuple[list[int], list[int] | None]]]  # per bucket, per operand: dense shape, permutation
    out_perm: list[int]  # result of a bucket -> storage order (identity when flat: sample order)
    out_shapes: list[list[int]]  # per bucket: its result in storage (or, when flat, sample) order
    grad_equations: list[str] | None  # per operand: its gradient's equation (fused backward), or None
    out_ragged: tuple[int, ...]
    out_static: tuple[int, ...]
    structure: tuple  # (offsets, sizes, env, meta) of the result
    out_rows: int = 0  # rows of the result
    softmax_letters: tuple[str, ...] = ()  # per operand: its last ragged letter (storage order), or ""
    groups: tuple = ()  # per bucket: its samples, in slot order
    rows: Any = None  # the result's row maps when ``packs`` maps elements (:func:`result_rows`), lazy
    cache: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)  # derived buffers and plans


def _dense(plan: _Plan, bufs: Sequence[Tensor]) -> list[list[Tensor]]:
    """Per bucket, every operand's padded samples ``(nb, *sample)`` (views of its buffer)."""
    # one split per buffer (its backward is one cat; a narrow per bucket would zero-fill the
    # whole buffer's gradient once per bucket)
    pieces = [buf.split(sp) for buf, sp in zip(bufs, plan.splits)]
    out = []
    for k, views in enumerate(plan.views):
        dense = []
        for pc, (shape, perm) in zip(pieces, views):
            x = pc[k].view(shape)
            dense.append(x.permute(perm) if perm is not None else x)
        out.append(dense)
    return out


def result_rows(plan: _Plan) -> tuple[RowMap, RowMap]:
    """The result's rows <-> its buckets laid out by rows: ``(to_padded, to_packed)``.

    A result read through element maps (attention scores ``(H, N_i, N_i)`` stored as rows
    ``(i, j)`` of ``H`` features) also has row maps: every row ``(i, j)`` to its place in
    buffers holding, per bucket, its slots one after the other, each ``(L_b, L_b)`` rows of
    ``H`` features (the storage order, padded; :func:`result_row_shapes`). They are ``H`` times
    shorter than the element maps, so a new batch builds them ``H`` times faster, and a
    full-size term (a pair bias) is read onto the scores by rows, then laid out in sample order
    by one copy per bucket (:mod:`padless.ops.pairs.attend`). A result read by rows: its maps."""
    maps = plan.packs if plan.rows is None else plan.rows
    return maps[0], maps[1]


def result_row_shapes(plan: _Plan) -> tuple[list[list[int]], list[int]]:
    """Per bucket the shape of its rows in :func:`result_rows`'s buffer (storage order), and the
    permutation from that order to sample order."""
    out = plan.equation.split("->")[1][1:]
    order = layout.storage_order(len(out), plan.out_ragged)
    shapes = [[nb, *[ext[out[d]] for d in order]] for nb, ext in plan.buckets]
    return shapes, [0, *[1 + d for d in layout.inverse_order(order)]]


@functools.lru_cache(maxsize=256)
def _matmul_form(equation: str) -> tuple | None:
    """``A,B->O`` as one batched matmul: the permutations that bring ``A`` to ``(batch, m, k)``
    and ``B`` to ``(batch, k, n)``, and ``(batch, m, n)`` to ``O``; None when a letter is
    summed within one operand (einsum then)."""
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    a, b = terms
    if any(c not in out and c not in (b if t is a else a) for t in (a, b) for c in t):
        return None
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    k = [c for c in a if c in b and c not in out]
    pa = [a.index(c) for c in batch + m + k]
    pb = [b.index(c) for c in batch + k + n]
    order = batch + m + n
    return pa, pb, len(batch), len(m), len(n), [order.index(c) for c in out]


def gemm_ready(t: Tensor) -> Tensor:
    """``t`` (``(batch, m, k)``) as a batched matmul reads it in one call. A matrix with neither
    dim of unit stride (a channels-last operand whose channel is the batch, in a bucket of one
    sample: ``(1, I, K, C)`` read as ``(C, I, K)``) makes torch's CPU ``bmm`` multiply one
    matrix at a time, each after a copy (about 15 ops per matrix); one copy of the operand
    instead."""
    s, n = t.stride(), t.shape
    return t if s[-1] == 1 or s[-2] == 1 or n[-1] == 1 or n[-2] == 1 else t.contiguous()


def _einsum(equation: str, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``torch.einsum(equation, a, b)`` as one ``bmm`` on permuted views (a transposed operand
    is read in place: einsum would copy it, a whole padded score buffer per call); the
    result may be a permuted view. ``out`` (flat, contiguous, no autograd): written with the
    result in ``equation``'s output order, directly by the ``bmm`` when it can."""
    form = _matmul_form(equation)
    c = None
    if form is not None:
        pa, pb, nb, nm, nn, po = form
        x, y = a.permute(pa), b.permute(pb)
        bs, ms, ns = x.shape[:nb], x.shape[nb:nb + nm], y.shape[y.dim() - nn:]
        if bs == y.shape[:nb] and x.shape[nb + nm:] == y.shape[nb:y.dim() - nn]:  # else size-1 dims broadcast
            bt, mm, kk, nt = math.prod(bs), math.prod(ms), math.prod(x.shape[nb + nm:]), math.prod(ns)
            x3, y3 = gemm_ready(x.reshape(bt, mm, kk)), gemm_ready(y.reshape(bt, kk, nt))
            if out is not None and po == sorted(po):
                torch.bmm(x3, y3, out=out.view(bt, mm, nt))
                return out.view(*bs, *ms, *ns)
            c = torch.bmm(x3, y3).view(*bs, *ms, *ns).permute(po)
    if c is None:
        c = torch.einsum(equation, a, b)
    if out is not None:
        out.view(c.shape).copy_(c)
        return out.view(c.shape)
    return c


def _flatten(v: Tensor, flat: bool) -> Tensor:
    """An operand's values as its maps read them: rows, or elements (``flat``)."""
    return v.reshape(-1) if flat else v


def _packed(plan: _Plan, buf: Tensor) -> Tensor:
    """The result's rows ``(T, *static)`` read from the buckets' results (through row maps,
    or element maps into a new tensor, not a view: callers may change it in place)."""
    if not plan.flat[-1]:
        return read_rows(buf, plan.packs[1], 0.0)
    return read_elements(buf, plan.packs[1], 0.0, (plan.out_rows, *plan.out_static))


def _buckets(plan: _Plan, bufs: Sequence[Tensor]) -> Tensor:
    """The dense contraction of every bucket, as rows (storage order) or elements (sample
    order, when the result's maps are flat) one bucket after another."""
    if plan.flat[-1] and not (torch.is_grad_enabled() and any(b.requires_grad for b in bufs)):
        # results in sample order: every bucket's bmm writes into its place of one buffer
        sizes = [math.prod(shape) for shape in plan.out_shapes]
        out = bufs[0].new_empty(sum(sizes))
        for dense, piece in zip(_dense(plan, bufs), out.split(sizes)):
            _einsum(plan.equation, *dense, out=piece)
        return out
    parts = [_einsum(plan.equation, *dense).permute(plan.out_perm) for dense in _dense(plan, bufs)]
    static = () if plan.flat[-1] else plan.out_static
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        parts = [p.reshape(-1, *static) for p in parts]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    return _join(parts, static)


def _join(parts: Sequence[Tensor], static: Sequence[int]) -> Tensor:
    """Strided bucket results copied once into one buffer of rows (no reshape copy + cat)."""
    rows = [math.prod(p.shape) // max(math.prod(static), 1) for p in parts]
    out = parts[0].new_empty((sum(rows), *static))
    for p, lo, n in zip(parts, itertools.accumulate([0] + rows), rows):
        out[lo:lo + n].view(p.shape).copy_(p)
    return out


class _Contract(torch.autograd.Function):
    """A two-operand bucketed contraction as one autograd node: forward and backward each
    gather into the padded buckets, run one dense ``einsum`` per bucket and operand, and
    gather back (the gradients are contractions of the same form, ``out,other->mine``).
    The backward is written with differentiable ops on the saved inputs, so double
    backward works."""

    @staticmethod
    def forward(ctx, plan: _Plan, a: Tensor, b: Tensor) -> Tensor:
        ctx.plan = plan
        bufs = [read_rows(_flatten(v, fl), to_buf, 0.0) for v, (to_buf, _), fl in zip((a, b), plan.pads, plan.flat)]
        ctx.save_for_backward(a, b, *bufs)
        return _packed(plan, _buckets(plan, bufs))

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b, *bufs = ctx.saved_tensors
        return (None, *contract_backward(ctx.plan, a, b, bufs, g, ctx.needs_input_grad[1:]))


def contract_backward(plan: _Plan, a: Tensor, b: Tensor, bufs: Sequence[Tensor], g: Tensor,
                      needs: Sequence[bool]) -> list[Tensor | None]:
    """The gradients of both operands of a two-operand bucketed contraction from the result's
    gradient ``g`` (``out,other->mine`` per bucket); ``bufs``: the operands' padded buffers
    (recomputed from ``a`` and ``b`` when a gradient of the gradient is recorded)."""
    if torch.is_grad_enabled() or not bufs:  # double backward: the buffers again, as functions of a and b
        bufs = [read_rows(_flatten(v, fl), to_buf, 0.0) for v, (to_buf, _), fl in zip((a, b), plan.pads, plan.flat)]
    gbuf = read_rows(_flatten(g.contiguous(), plan.flat[-1]), plan.packs[0], 0.0)
    per = 1 if plan.flat[-1] else math.prod(plan.out_static)
    gparts = gbuf.split([math.prod(shape) // per for shape in plan.out_shapes])
    inv_out = layout.inverse_order(plan.out_perm)
    grads: list[list[Tensor]] = [[], []]
    for k, dense in enumerate(_dense(plan, bufs)):
        gk = gparts[k].view(plan.out_shapes[k]).permute(inv_out)
        for j, need in enumerate(needs):
            if not need:
                continue
            gj = _einsum(plan.grad_equations[j], gk, dense[1 - j])
            shape, perm = plan.views[k][j]
            grads[j].append(gj.permute(layout.inverse_order(perm)) if perm is not None else gj)
    return [gather_back(plan, j, parts, (a, b)[j]) if parts else None for j, parts in enumerate(grads)]


def gather_back(plan: _Plan, j: int, parts: Sequence[Tensor], like: Tensor) -> Tensor:
    """Operand ``j``'s rows (shaped like ``like``) from its per-bucket dense pieces (storage order)."""
    static = () if plan.flat[j] else like.shape[1:]
    if torch.is_grad_enabled():  # double backward: differentiable ops
        parts = [p.reshape(-1, *static) for p in parts]
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
    else:
        rows = _join(parts, static)
    return read_rows(rows, plan.pads[j][1], 0.0).view(like.shape)


def _softmax_operand(ins: Sequence[str], out: str, operands: Sequence[NestedTensor],
                     vals: Sequence[Tensor]) -> tuple[int, Tensor, Tensor] | None:
    """``(j, x, y)`` when operand ``j``'s rows ``y`` are ``softmax(x)`` over the dim this
    contraction sums (the bucketed softmax leaves that mark on its output,
    :func:`padless.ops.kernels.softmax.softmax_source`) and a gradient is wanted: the
    contraction then differentiates from ``x`` directly (:class:`_SoftmaxContract`), so the
    softmax's own backward, with its gathers in and out of its buckets, never runs. None
    otherwise (and under autocast, whose casts sit between the softmax and the contraction)."""
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(vals[0].device.type):
        return None
    for j, (o, y) in enumerate(zip(operands, vals)):
        src = softmax_source(y)
        if src is None or not o._ragged:
            continue
        x, runs = src
        d = o._ragged[-1]  # the softmax ran over runs of rows: the last ragged dim in storage order
        c = ins[j][d]
        if c in out or c not in ins[1 - j] or not x.requires_grad or x.dtype != vals[1 - j].dtype:
            continue
        if segment.groups(o, [d]).runs() is not runs:  # another structure on the same rows
            continue
        return j, x, y
    return None


class _SoftmaxContract(torch.autograd.Function):
    """``softmax(x) @ other`` (any two-operand contraction summing the softmax dim) as one
    autograd node over the bucketed contraction: the forward reads the softmax's output ``y``
    (already computed); the backward turns the gradient of ``y``, still in the padded buckets,
    into the gradient of ``x`` (``y * (dy - sum(dy * y))`` along the softmax dim, zero at
    padded places since ``y`` is zero there) and gathers that back once. Double backward
    recomputes ``y`` in the buckets from ``x`` with differentiable ops; ``x`` is saved for
    it, so changing ``x`` in place after the softmax raises autograd's usual error."""

    @staticmethod
    def forward(ctx, plan: _Plan, j: int, x: Tensor, other: Tensor, y: Tensor) -> Tensor:
        ctx.plan, ctx.j = plan, j
        ops = (y, other) if j == 0 else (other, y)
        bufs = [read_rows(_flatten(v, fl), to_buf, 0.0) for v, (to_buf, _), fl in zip(ops, plan.pads, plan.flat)]
        ctx.save_for_backward(x, other, *bufs)
        return _packed(plan, _buckets(plan, bufs))

    @staticmethod
    def backward(ctx, g: Tensor):
        plan, j = ctx.plan, ctx.j
        x, other, *bufs = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: the buffers as functions of x and other
            fl = plan.flat
            ybuf = read_rows(_flatten(x, fl[j]), plan.pads[j][0], torch.finfo(x.dtype).min)
            obuf = read_rows(_flatten(other, fl[1 - j]), plan.pads[1 - j][0], 0.0)
            bufs = [ybuf, obuf] if j == 0 else [obuf, ybuf]
            bufs[j] = _softmax_buckets(plan, j, bufs[j], _dense(plan, bufs))
        c = plan.equation.split("->")[0].split(",")[j][1:]
        dim = 1 + c.index(_summed(plan, j))
        gbuf = read_rows(_flatten(g.contiguous(), plan.flat[-1]), plan.packs[0], 0.0)
        per = 1 if plan.flat[-1] else math.prod(plan.out_static)
        gparts = gbuf.split([math.prod(shape) // per for shape in plan.out_shapes])
        inv_out = layout.inverse_order(plan.out_perm)
        needs = (ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        mine = (j, 1 - j)
        grads: list[list[Tensor]] = [[], []]
        for k, dense in enumerate(_dense(plan, bufs)):
            gk = gparts[k].view(plan.out_shapes[k]).permute(inv_out)
            for slot, q in enumerate(mine):
                if not needs[slot]:
                    continue
                gq = _einsum(plan.grad_equations[q], gk, dense[1 - q])
                if q == j:  # softmax backward in the bucket (y * (g - sum(g * y))): padded places have y == 0
                    gq = torch._softmax_backward_data(gq.contiguous(), dense[j].contiguous(), dim, gq.dtype)
                _, perm = plan.views[k][q]
                grads[slot].append(gq.permute(layout.inverse_order(perm)) if perm is not None else gq)
        out = [None, None]
        for slot, parts in enumerate(grads):
            if parts:
                q = mine[slot]
                like = (x, other)[slot]
                static = () if plan.flat[q] else like.shape[1:]
                if torch.is_grad_enabled():
                    parts = [p.reshape(-1, *static) for p in parts]
                    rows = torch.cat(parts) if len(parts) > 1 else parts[0]
                else:
                    rows = _join(parts, static)
                out[slot] = read_rows(rows, plan.pads[q][1], 0.0).view(like.shape)
        return None, None, out[0], out[1], None


def _summed(plan: _Plan, j: int) -> str:
    """The letter operand ``j``'s softmax ran over: its last ragged letter (storage order)."""
    return plan.softmax_letters[j]


def _softmax_buckets(plan: _Plan, j: int, buf: Tensor, dense: list[list[Tensor]]) -> Tensor:
    """Softmax of operand ``j``'s padded buckets along its summed letter (differentiable),
    as one flat buffer again (padded places read a large negative number, so they get 0)."""
    c = plan.equation.split("->")[0].split(",")[j][1:]
    dim = 1 + c.index(_summed(plan, j))
    parts = []
    for k, views in enumerate(dense):
        p = views[j].softmax(dim)
        _, perm = plan.views[k][j]
        p = p.permute(layout.inverse_order(perm)) if perm is not None else p
        parts.append(p.reshape(-1))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    # holes (padded places) must read 0 after the softmax: a padded place of a real row got
    # exp(min - max) = 0, a padded row is masked here
    mask = torch.zeros_like(buf)
    mask.index_fill_(0, plan.pads[j][1].safe.long(), 1.0)
    return (flat.view(buf.shape) * mask)
