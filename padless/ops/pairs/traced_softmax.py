"""Softmax over a ragged dim of pair attention scores inside a compiled graph, as one island.

Scores ``(N_i, H, N_i, N_i)`` have three ragged dims; a softmax over one of them, built in
the graph, would need segment maps over every score row each step. Instead the eager softmax
(bucketed or per sample, its groups cached by content) runs as ``padless::nested_island``
(:mod:`padless.ops.pairs.traced`) with the scores' structure. The island keeps its result,
and its backward is the softmax's gradient equation on it (``y * (g - sum(g * y))``;
``g - exp(y) * sum(g)`` for ``log_softmax``): torch's softmax backward on each sample's rows
viewed ``(groups, n, features)`` when the softmax dim is the last ragged dim in storage order
(every group is ``n`` consecutive rows), else the eager ops on the result's structure. The
softmax is not recomputed.
"""

from __future__ import annotations

from typing import Any

import torch

from padless.ops.common.islands import TRACED_SOFTMAX
from padless.ops.pairs.traced import body, gradient, run_traced
from padless.tensor.autograd import nested_from_values
from padless.tensor.core import NestedTensor


@body("softmax")
def _softmax_body(nts: list, spec: Any) -> NestedTensor:
    return torch.softmax(nts[0], spec)


@body("log_softmax")
def _log_softmax_body(nts: list, spec: Any) -> NestedTensor:
    return torch.log_softmax(nts[0], spec)


def _runs_backward(y: NestedTensor, g: NestedTensor, d: int, log: bool) -> NestedTensor | None:
    """torch's softmax backward on each sample's rows viewed ``(groups, n, features)`` when the
    softmax dim ``d`` is the last ragged dim in storage order (every group is ``n``
    consecutive rows) and the rows are on the CPU (a call per sample), else None."""
    if y._ragged[-1] != d or y._values.device.type != "cpu" or g._ragged != y._ragged:
        return None
    yv, gv = y._values, g._values
    dx = torch.empty_like(yv)
    f = yv[0].numel() if yv.shape[0] else 1
    bwd = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    bounds, counts = y.host_offsets().tolist(), y.host_sizes()[:, d].tolist()
    for lo, hi, n in zip(bounds[:-1], bounds[1:], counts):
        if hi > lo:
            shape = ((hi - lo) // n, n, f)
            out = dx[lo:hi].view(shape)
            if log:  # the two out= overloads name their output differently
                bwd.out(gv[lo:hi].view(shape), yv[lo:hi].view(shape), 1, yv.dtype, out=out)
            else:
                bwd.out(gv[lo:hi].view(shape), yv[lo:hi].view(shape), 1, yv.dtype, grad_input=out)
    return nested_from_values(dx, y._offsets, y._sizes, y._ragged, y._env, y._meta)


@gradient("softmax", output=True)
def _softmax_grads(nts: list, g: NestedTensor, dim: Any, needs: list, y: NestedTensor | None) -> list:
    """``y * (g - sum(g * y))`` along ``dim`` on the kept result (torch's backward per sample's
    runs of rows, else the eager ops on ``y``'s structure): no softmax recomputed."""
    if y is None or not needs[0]:
        return [None]
    dx = _runs_backward(y, g, dim - 1, False)
    if dx is not None:
        return [dx]
    gy = g * y
    return [gy - y * gy.sum(dim, keepdim=True)]


@gradient("log_softmax", output=True)
def _log_softmax_grads(nts: list, g: NestedTensor, dim: Any, needs: list, y: NestedTensor | None) -> list:
    """``g - exp(y) * sum(g)`` along ``dim`` on the kept result."""
    if y is None or not needs[0]:
        return [None]
    dx = _runs_backward(y, g, dim - 1, True)
    if dx is not None:
        return [dx]
    return [g - torch.exp(y) * g.sum(dim, keepdim=True)]


def traced_softmax(nt: NestedTensor, dim: int, log: bool) -> NestedTensor:
    """A softmax along a ragged dim of a NestedTensor with several ragged dims (attention scores
    over pair rows) inside a compiled graph: the eager softmax (bucketed, its groups cached by
    content) as one opaque op with ``nt``'s structure, instead of segment maps built in the
    graph every step; its backward is the softmax's gradient equation on the kept result, run
    eagerly (:func:`_softmax_grads`)."""
    # ``dim`` is a sample dim; the eager body takes torch's (the batch dim first)
    return run_traced("log_softmax" if log else "softmax", dim + 1, [nt], nt._sizes, nt._ragged, nt._env, ())


if traced_softmax not in TRACED_SOFTMAX:
    TRACED_SOFTMAX.append(traced_softmax)
