"""Segmented reductions over groups of rows: sum, mean, amax, amin, logsumexp, var.

A reduction over ragged dims groups rows (see :mod:`padless.ops.common.segment`). When
the reduced ragged dims are consecutive in storage order, every group is a
*strided run* of rows: ``rows = start[g] + k * stride[g]`` for ``k < count[g]``.
That covers the leading and the inner ragged level, and the rows (inner dim,
``stride 1``) and columns (leading dim, ``stride N_i``) of a pair state::

    pair sample (N=2, M=3) stored as rows  r0..r5 = (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
    reduce dim 2 (rows of the pair):   start 0, 3   count 3   stride 1
    reduce dim 1 (columns):            start 0, 1, 2   count 2   stride 3

The plan is three ``(G,)`` int64 tensors built once per structure from ``sizes``
and ``offsets`` on the device (no per-row index, no sync). The kernel runs one
program per (group, block of features), accumulating in float32; the backward is
one program per group as well. The torch **twin** is the ``index_add`` /
``scatter_reduce`` implementation over per-row group ids, the reference and the
path without Triton.
"""

from __future__ import annotations

import math
import types
from typing import Any, Protocol

import torch
from torch import Tensor

from padless.ops.kernels import dispatch



class Groups(Protocol):
    """What the kernels read of a row grouping (:class:`padless.ops.common.segment.Groups`,
    which is built above this layer: kernels import only the tensor layer)."""

    gid: Tensor  # (T,) group of every row
    n_groups: int  # python int (host metadata)
    counts: Tensor  # (G,) rows per group

    def plan(self) -> tuple[Tensor, Tensor, Tensor] | None: ...

FAMILY = "segment_reduce"
MODES = {"sum": 0, "mean": 1, "amax": 2, "amin": 3, "logsumexp": 4, "var": 5}
BLOCK_R = 16
tl: Any = None  # triton.language, bound when the kernels are first built


# ---------------------------------------------------------------------------- plan


def strided_plan(
    sizes: Tensor, offsets: Tensor, ragged: tuple[int, ...], reduced: tuple[int, ...], n_groups: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(start, count, stride)`` per group, in the group order of ``Groups.gid``; None when
    the reduced dims are not consecutive among the ragged dims (storage order, as ``ragged``)."""
    ragged = tuple(ragged)  # storage order (a transposed pair stores (1, 0))
    pos = sorted(ragged.index(d) for d in reduced)
    if not pos or pos != list(range(pos[0], pos[0] + len(pos))):
        return None
    before, block, after = ragged[: pos[0]], ragged[pos[0] : pos[-1] + 1], ragged[pos[-1] + 1 :]
    b = sizes.shape[0]
    dev = sizes.device
    one = torch.ones(b, dtype=torch.int64, device=dev)
    after_n = sizes[:, list(after)].prod(1) if after else one
    count_s = sizes[:, list(block)].prod(1)
    keep = before + after
    if not keep:
        return offsets[:-1].clone(), count_s, after_n
    out_counts = sizes[:, list(keep)].prod(1)
    sid = torch.repeat_interleave(torch.arange(b, device=dev), out_counts, output_size=n_groups)
    out_offsets = torch.cumsum(out_counts, 0) - out_counts
    local = torch.arange(n_groups, device=dev) - out_offsets.index_select(0, sid)
    start = offsets[:-1].index_select(0, sid)
    rstride = torch.ones(n_groups, dtype=torch.int64, device=dev)  # row stride of the current dim
    for d in reversed(ragged):
        n = sizes[:, d].index_select(0, sid)
        if d in keep:
            c = torch.remainder(local, n.clamp_min(1))
            local = torch.div(local, n.clamp_min(1), rounding_mode="floor")
            start = start + c * rstride
        rstride = rstride * n
    return start, count_s.index_select(0, sid), after_n.index_select(0, sid)


# ---------------------------------------------------------------------------- kernels


def _segment_reduce_kernel(x_ptr, out_ptr, start_ptr, count_ptr, stride_ptr, F, correction,
                           MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)  # G * F may exceed 2**31
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    start = tl.load(start_ptr + g)
    count = tl.load(count_ptr + g)
    stride = tl.load(stride_ptr + g)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)
    if MODE == 2:
        acc = tl.full([BLOCK_F], float("-inf"), tl.float32)
    if MODE == 3:
        acc = tl.full([BLOCK_F], float("inf"), tl.float32)
    m = tl.full([BLOCK_F], float("-inf"), tl.float32)
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        ptrs = x_ptr + rows[:, None] * F + cols[None, :]
        if MODE == 2:
            x = tl.load(ptrs, mask=msk, other=float("-inf")).to(tl.float32)
            acc = tl.maximum(acc, tl.max(x, 0))
        elif MODE == 3:
            x = tl.load(ptrs, mask=msk, other=float("inf")).to(tl.float32)
            acc = tl.minimum(acc, tl.min(x, 0))
        elif MODE == 4:
            x = tl.load(ptrs, mask=msk, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[None, :]), 0)
            m = m_new
        else:
            x = tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
            acc += tl.sum(x, 0)
    cnt = count.to(tl.float32)
    if MODE == 1:
        acc = acc / cnt
    if MODE == 4:
        acc = tl.log(acc) + tl.where(m == float("-inf"), 0.0, m)
    if MODE == 5:
        mean = acc / cnt
        acc = tl.zeros([BLOCK_F], dtype=tl.float32)
        for k0 in range(0, count, BLOCK_R):
            k = k0 + r
            rows = start + k.to(tl.int64) * stride
            msk = (k < count)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
            dev = tl.where(msk, x - mean[None, :], 0.0)
            acc += tl.sum(dev * dev, 0)
        acc = acc / tl.maximum(cnt - correction, 0.0)
    tl.store(out_ptr + g * F + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _segment_reduce_bwd_kernel(gout_ptr, x_ptr, out_ptr, gin_ptr, start_ptr, count_ptr, stride_ptr, F, correction,
                               MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)  # G * F may exceed 2**31
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    start = tl.load(start_ptr + g)
    count = tl.load(count_ptr + g)
    stride = tl.load(stride_ptr + g)
    r = tl.arange(0, BLOCK_R)
    go = tl.load(gout_ptr + g * F + cols, mask=cmask, other=0.0).to(tl.float32)
    o = tl.load(out_ptr + g * F + cols, mask=cmask, other=0.0).to(tl.float32)
    cnt = count.to(tl.float32)
    aux = tl.zeros([BLOCK_F], dtype=tl.float32)  # ties (amax/amin) or the mean (var)
    if MODE == 2 or MODE == 3 or MODE == 5:
        for k0 in range(0, count, BLOCK_R):
            k = k0 + r
            rows = start + k.to(tl.int64) * stride
            msk = (k < count)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
            if MODE == 5:
                aux += tl.sum(tl.where(msk, x, 0.0), 0)
            else:
                aux += tl.sum(tl.where(msk & (x == o[None, :]), 1.0, 0.0), 0)
        if MODE == 5:
            aux = aux / cnt
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        ptrs = rows[:, None] * F + cols[None, :]
        if MODE == 0:
            gi = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32) + go[None, :]
        elif MODE == 1:
            gi = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32) + (go / cnt)[None, :]
        else:
            x = tl.load(x_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
            if MODE == 4:
                gi = go[None, :] * tl.exp(x - o[None, :])
            elif MODE == 5:
                gi = go[None, :] * 2.0 * (x - aux[None, :]) / tl.maximum(cnt - correction, 0.0)
            else:
                gi = tl.where(x == o[None, :], (go / aux)[None, :], 0.0)
        tl.store(gin_ptr + ptrs, gi.to(gin_ptr.dtype.element_ty), mask=msk)


def _build(triton: Any, tl_mod: Any) -> types.SimpleNamespace:
    global tl
    tl = tl_mod
    return types.SimpleNamespace(
        fwd=triton.jit(_segment_reduce_kernel), bwd=triton.jit(_segment_reduce_bwd_kernel)
    )


kernels = dispatch.jit_kernels(_build)


def _block_f(f: int) -> int:
    return dispatch.next_pow2(f, lo=16, hi=128)


def launch_reduce(x: Tensor, start: Tensor, count: Tensor, stride: Tensor, mode: str, correction: float) -> Tensor:
    """Host launcher: ``x`` is ``(T, F)`` contiguous; returns ``(G, F)``. Grid from shapes only."""
    g, f = start.shape[0], x.shape[1]
    out = x.new_empty((g, f))
    if g == 0 or f == 0:
        return out
    bf = _block_f(f)
    dispatch.launch(kernels().fwd, (g, triton_cdiv(f, bf)), x, out, start, count, stride, f, float(correction),
                    MODE=MODES[mode], BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return out


def launch_reduce_backward(gout: Tensor, x: Tensor, out: Tensor, start: Tensor, count: Tensor, stride: Tensor,
                           mode: str, correction: float) -> Tensor:
    g, f = start.shape[0], x.shape[1]
    gin = torch.zeros_like(x)  # rows outside every group (none for a partition) stay zero
    if g == 0 or f == 0 or x.shape[0] == 0:
        return gin
    bf = _block_f(f)
    dispatch.launch(kernels().bwd, (g, triton_cdiv(f, bf)), gout.contiguous(), x, out, gin, start, count, stride, f,
                    float(correction), MODE=MODES[mode], BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return gin


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---------------------------------------------------------------------------- custom op


@torch.library.triton_op("padless::segment_reduce", mutates_args=())
def segment_reduce_op(x: Tensor, start: Tensor, count: Tensor, stride: Tensor, mode: str, correction: float) -> Tensor:
    """``(T, F)`` rows -> ``(G, F)`` per strided group (see module docstring)."""
    return launch_reduce(x, start, count, stride, mode, correction)


@segment_reduce_op.register_fake
def _segment_reduce_fake(x, start, count, stride, mode, correction):
    return x.new_empty((start.shape[0], x.shape[1]))


@torch.library.triton_op("padless::segment_reduce_backward", mutates_args=())
def segment_reduce_backward_op(gout: Tensor, x: Tensor, out: Tensor, start: Tensor, count: Tensor, stride: Tensor,
                               mode: str, correction: float) -> Tensor:
    """Gradient of :func:`segment_reduce_op` with respect to ``x``."""
    return launch_reduce_backward(gout, x, out, start, count, stride, mode, correction)


@segment_reduce_backward_op.register_fake
def _segment_reduce_backward_fake(gout, x, out, start, count, stride, mode, correction):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, start, count, stride, mode, correction = inputs
    ctx.save_for_backward(x, output, start, count, stride)
    ctx.mode, ctx.correction = mode, correction


def _backward(ctx, gout):
    x, out, start, count, stride = ctx.saved_tensors
    gin = segment_reduce_backward_op(gout, x, out, start, count, stride, ctx.mode, ctx.correction)
    return gin, None, None, None, None, None


segment_reduce_op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------- twin


def twin_reduce(values: Tensor, g: "Groups", mode: str, correction: float = 1.0) -> Tensor:
    """The torch twin: ``index_add`` / ``scatter_reduce`` over per-row group ids."""
    if mode in ("sum", "mean"):
        out = values.new_zeros((g.n_groups, *values.shape[1:])).index_add(0, g.gid, values)
        return out if mode == "sum" else out / _counts_like(g, out)
    if mode in ("amax", "amin"):
        out = values.new_zeros((g.n_groups, *values.shape[1:]))
        idx = g.gid.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
        return out.scatter_reduce(0, idx, values, mode, include_self=False)
    if mode == "logsumexp":
        with torch.no_grad():
            m = twin_reduce(values, g, "amax")
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = twin_reduce(torch.exp(values - m.index_select(0, g.gid)), g, "sum")
        return torch.log(s) + m
    if mode == "var":
        n = _counts_like(g, values)
        mu = twin_reduce(values, g, "sum") / n
        dev = values - mu.index_select(0, g.gid)
        return twin_reduce(dev * dev, g, "sum") / (n - correction).clamp_min(0)
    raise ValueError(f"segment_reduce(): unknown mode {mode!r}; use one of {', '.join(MODES)}")


def _counts_like(g: "Groups", values: Tensor) -> Tensor:
    dt = values.dtype if values.is_floating_point() else torch.float32
    return g.counts.to(dt).view(-1, *([1] * (values.dim() - 1)))


# ---------------------------------------------------------------------------- dispatch


def _unsupported(values: Tensor, g: "Groups") -> str | None:
    if not values.is_floating_point():
        return f"dtype {values.dtype} (the kernel reduces floating point rows)"
    if g.plan() is None:
        return "reduced ragged dims are not consecutive in storage order"
    return None


def segment_reduce(values: Tensor, g: "Groups", mode: str, correction: float = 1.0) -> Tensor:
    """Reduce ``values`` ``(T, *static)`` over the groups of ``g``: ``(G, *static)``.

    The kernel when :mod:`~padless.ops.kernels.dispatch` picks it, else the twin.
    """
    if not dispatch.use_kernel(FAMILY, values, unsupported=lambda: _unsupported(values, g)):
        return twin_reduce(values, g, mode, correction)
    start, count, stride = g.plan()
    flat = values.reshape(values.shape[0], math.prod(values.shape[1:])).contiguous()
    out = segment_reduce_op(flat, start, count, stride, mode, float(correction))
    return out.reshape(g.n_groups, *values.shape[1:])
