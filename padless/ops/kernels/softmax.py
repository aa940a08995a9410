"""Ragged softmax / log_softmax along a ragged dim, fused forward and backward.

The normalised groups are the strided runs of :mod:`padless.ops.kernels.segment`
(one group per position of the other ragged dims), so this covers a token axis
``(L_i, C)``, and the rows or the columns of a pair state ``(N_i, N_i, H)``: the
triangle-attention pattern. One program per (group, block of features) makes two
passes: an online max/sum, then the write; the backward also makes two passes
(``sum(dy * y)`` or ``sum(dy)``, then the write). The torch **twin** is the
``scatter_reduce`` / ``index_add`` composition over per-row group ids; when the groups are
runs of consecutive rows (softmax over the last ragged dim), a dense softmax per padded
bucket of similar samples (a few calls whatever the batch size, :class:`_BucketedSoftmax`),
or per sample for large samples.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import Tensor

from padless.ops.kernels import dispatch
from padless.ops.kernels.layout import (
    padding_maps,
    read_elements,
    read_rows,
    size_buckets,
)
from padless.ops.kernels.segment import BLOCK_R, Groups, twin_reduce

FAMILY = "softmax"
tl: Any = None


def _softmax_kernel(x_ptr, y_ptr, start_ptr, count_ptr, stride_ptr, F,
                    LOG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    start = tl.load(start_ptr + g)
    count = tl.load(count_ptr + g)
    stride = tl.load(stride_ptr + g)
    r = tl.arange(0, BLOCK_R)
    m = tl.full([BLOCK_F], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_F], dtype=tl.float32)
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * F + cols[None, :], mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[None, :]), 0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        ptrs = rows[:, None] * F + cols[None, :]
        x = tl.load(x_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
        if LOG:
            y = x - m[None, :] - log_s[None, :]
        else:
            y = tl.exp(x - m[None, :]) / s[None, :]
        tl.store(y_ptr + ptrs, y.to(y_ptr.dtype.element_ty), mask=msk)


def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, start_ptr, count_ptr, stride_ptr, F,
                        LOG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < F
    start = tl.load(start_ptr + g)
    count = tl.load(count_ptr + g)
    stride = tl.load(stride_ptr + g)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        ptrs = rows[:, None] * F + cols[None, :]
        dy = tl.load(dy_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
        if LOG:
            acc += tl.sum(dy, 0)
        else:
            y = tl.load(y_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
            acc += tl.sum(dy * y, 0)
    for k0 in range(0, count, BLOCK_R):
        k = k0 + r
        rows = start + k.to(tl.int64) * stride
        msk = (k < count)[:, None] & cmask[None, :]
        ptrs = rows[:, None] * F + cols[None, :]
        dy = tl.load(dy_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + ptrs, mask=msk, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * acc[None, :]
        else:
            dx = y * (dy - acc[None, :])
        tl.store(dx_ptr + ptrs, dx.to(dx_ptr.dtype.element_ty), mask=msk)


def _build(triton: Any, tl_mod: Any) -> types.SimpleNamespace:
    global tl
    tl = tl_mod
    return types.SimpleNamespace(fwd=triton.jit(_softmax_kernel), bwd=triton.jit(_softmax_bwd_kernel))


kernels = dispatch.jit_kernels(_build)


def _grid(start: Tensor, f: int) -> tuple[tuple[int, int], int]:
    bf = dispatch.next_pow2(f, lo=16, hi=128)
    return (start.shape[0], (f + bf - 1) // bf), bf


@torch.library.triton_op("padless::ragged_softmax", mutates_args=())
def ragged_softmax_op(x: Tensor, start: Tensor, count: Tensor, stride: Tensor, log: bool) -> Tensor:
    """Softmax (``log=True``: log_softmax) of ``(T, F)`` rows within each strided group."""
    y = torch.empty_like(x)
    if start.shape[0] and x.shape[0] and x.shape[1]:
        grid, bf = _grid(start, x.shape[1])
        dispatch.launch(kernels().fwd, grid, x, y, start, count, stride, x.shape[1], LOG=log, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return y


@ragged_softmax_op.register_fake
def _ragged_softmax_fake(x, start, count, stride, log):
    return torch.empty_like(x)


@torch.library.triton_op("padless::ragged_softmax_backward", mutates_args=())
def ragged_softmax_backward_op(y: Tensor, dy: Tensor, start: Tensor, count: Tensor, stride: Tensor, log: bool) -> Tensor:
    """Gradient of :func:`ragged_softmax_op` from its output ``y``."""
    dx = torch.empty_like(y)
    if start.shape[0] and y.shape[0] and y.shape[1]:
        grid, bf = _grid(start, y.shape[1])
        dispatch.launch(kernels().bwd, grid, y, dy.contiguous(), dx, start, count, stride, y.shape[1],
                        LOG=log, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return dx


@ragged_softmax_backward_op.register_fake
def _ragged_softmax_backward_fake(y, dy, start, count, stride, log):
    return torch.empty_like(y)


def _setup(ctx, inputs, output):
    _, start, count, stride, log = inputs
    ctx.save_for_backward(output, start, count, stride)
    ctx.log = log


def _backward(ctx, dy):
    y, start, count, stride = ctx.saved_tensors
    return ragged_softmax_backward_op(y, dy, start, count, stride, ctx.log), None, None, None, None


ragged_softmax_op.register_autograd(_backward, setup_context=_setup)


def twin_softmax(values: Tensor, g: "Groups", log: bool) -> Tensor:
    """The torch twin: max and sum per group with ``scatter_reduce`` / ``index_add``; when
    every sample's groups are runs of consecutive rows (``g.runs()``: softmax over the last
    ragged dim in storage order), a dense softmax along dim 1 instead: of padded buckets
    (:func:`_bucketed_runs`: a few calls whatever the batch size) for small samples, of
    every sample's rows for large ones (:data:`BUCKET_LIMIT`)."""
    runs = g.runs() if hasattr(g, "runs") else None
    if runs is not None and not values.shape[0]:
        return values.clone()
    if runs is not None and (values.numel() <= BUCKET_LIMIT * len(runs) or values.device.type != "cpu"):
        return _bucketed_runs(values, runs, g.cache, log)  # launches: few calls (empty groups hold no rows)
    if runs is not None and g.empty_group_sample < 0:
        return _RunsSoftmax.apply(values, tuple(runs), log)
    low = values.dtype in (torch.float16, torch.bfloat16)
    x = values.float() if low else values  # accumulate as torch's softmax does: one rounding at the end
    with torch.no_grad():
        m = twin_reduce(x, g, "amax") if g.n_groups else x.new_zeros((0, *x.shape[1:]))
    shifted = x - m.index_select(0, g.gid)
    e = torch.exp(shifted)
    s = twin_reduce(e, g, "sum")
    out = shifted - torch.log(s.index_select(0, g.gid)) if log else e / s.index_select(0, g.gid)
    return out.to(values.dtype) if low else out


BUCKET_LIMIT = 1024
"""Mean elements per sample up to which the twin runs in padded buckets on the CPU (a few calls
for the batch); larger samples run one softmax each on views of their rows
(:class:`_RunsSoftmax`), which needs no index maps. The buckets' element maps are built for each
new structure, about 16 ns per element, which is more than the calls they save unless samples
are tiny: forward + backward, one thread, a new batch each time, buckets / per sample: B=4
N 16..48 scores ``(N, N, N, 2)`` 6.1 / 2.0 ms, B=16 N 16..48 ``(N, N, 8)`` 12.3 / 3.7 ms, B=64
N 4..16 ``(N, N, N, 4)`` 59 / 26 ms; the same batch again (maps cached) 2.3 / 2.2, 1.5 / 1.3 and
15 / 26 ms (it was 65,536, chosen on reused batches). On an accelerator every size runs in
buckets: a call per sample is a kernel launch per sample."""
SOFTMAX_CALL_COST = 10_000.0
"""Fixed price of one more softmax bucket (its calls and autograd nodes), in padded
elements (forward and backward: about 40 us on a CPU)."""


def _runs_plan(runs: list[tuple[int, int, int]], total: int, static: tuple[int, ...], device: torch.device) -> tuple:
    """Padded buckets for groups of ``c_i`` consecutive rows (sample ``i``'s rows ``lo:hi``):
    samples of similar ``c`` share a bucket ``(groups, features, max c)``, the normalised dim
    last and contiguous (the layout a dense ``(B, H, I, J)`` score tensor has, so no
    transposing copy runs on either side). Returns the per-bucket ``(first element, groups,
    width)`` and the element maps between the flat buffer and the flat values.

    Samples of 2 and 3 rows per group (``c``), one feature each, one bucket of width 3::

        values rows      [a0 a1 | a2 a3 | b0 b1 b2]       (sample a: 2 groups, b: 1 group)
        buffer (3, 1, 3) [a0 a1 -inf | a2 a3 -inf | b0 b1 b2]
    """
    live = [(i, lo, hi, c) for i, (lo, hi, c) in enumerate(runs) if hi > lo]
    ext = torch.tensor([[c] for _, _, _, c in live], dtype=torch.int64).reshape(len(live), 1)
    weight = torch.tensor([(hi - lo) // c for _, lo, hi, c in live], dtype=torch.int64)
    f = math.prod(static)
    buckets = []
    dest = torch.empty(total, f, dtype=torch.int64)
    feat = torch.arange(f)
    start = 0
    for ids in size_buckets(ext, weight, cost=lambda e: e[0] * float(f), overhead=SOFTMAX_CALL_COST):
        width = int(ext[ids, 0].max())
        groups = 0
        for j in ids:
            _, lo, hi, c = live[j]
            local = torch.arange(hi - lo)
            row = start + (groups + local // c) * (f * width) + local % c
            dest[lo:hi] = row[:, None] + feat[None, :] * width
            groups += (hi - lo) // c
        buckets.append((start, groups, width))
        start += groups * f * width
    return buckets, padding_maps(dest.reshape(-1), start, device)


def _bucketed_runs(values: Tensor, runs: list[tuple[int, int, int]], cache: dict, log: bool) -> Tensor:
    """Softmax over runs of consecutive rows, in padded buckets (``-inf`` at padded places)."""
    key = ("bucketed_runs", values.device, tuple(values.shape[1:]))
    if key not in cache:
        cache[key] = _runs_plan(runs, values.shape[0], tuple(values.shape[1:]), values.device)
    dev = values.device.type
    if torch.is_autocast_enabled(dev):  # autocast runs softmax in float32; its backward then sees one dtype
        with torch.autocast(dev, enabled=False):
            return _BucketedSoftmax.apply(values.float(), cache[key], log)
    y = _BucketedSoftmax.apply(values, cache[key], log)
    if not log and y.requires_grad:
        y.__dict__[_SOURCE] = (values, runs, y._version)
    return y


_SOURCE = "_padless_softmax_of"


def softmax_source(y: Tensor) -> tuple[Tensor, list[tuple[int, int, int]]] | None:
    """``(x, runs)`` when the rows ``y`` are the bucketed ``softmax(x)`` over the runs ``runs``
    (groups of consecutive rows: the last ragged dim in storage order), unchanged since, and
    made with a gradient wanted; else None. A contraction that sums over that dim
    (``softmax(q @ k^T + bias) @ v``) differentiates from ``x`` directly
    (:class:`padless.ops.pairs.bucket_nodes._SoftmaxContract`). The mark keeps ``x`` alive as
    long as ``y``."""
    hit = y.__dict__.get(_SOURCE) if hasattr(y, "__dict__") else None
    if hit is None or hit[2] != y._version:
        return None
    return hit[0], hit[1]


def _per_bucket(fn, buckets, f: int, *bufs: Tensor) -> Tensor:
    """``fn`` along the last dim of every bucket ``(groups * features, width)`` of the flat
    padded buffer(s); the flat results one bucket after another. ``fn(*views, out=view)``
    writes into its place of one result buffer (no cat) unless a gradient is recorded (double
    backward), where ``fn(*views)`` returns it."""
    if len(buckets) == 1:
        _, n, w = buckets[0]
        return fn(*[b.view(n * f, w) for b in bufs]).reshape(-1)
    sizes = [n * f * w for _, n, w in buckets]
    pieces = [t.split(sizes) for t in bufs]  # one split each: the backward is one cat
    if torch.is_grad_enabled():
        return torch.cat([fn(*[p[k].view(n * f, w) for p in pieces]).reshape(-1) for k, (_, n, w) in enumerate(buckets)])
    out = bufs[0].new_empty(bufs[0].shape)
    for k, ((_, n, w), o) in enumerate(zip(buckets, out.split(sizes))):
        fn(*[p[k].view(n * f, w) for p in pieces], out=o.view(n * f, w))
    return out


class _BucketedSoftmax(torch.autograd.Function):
    """Softmax over runs of rows as one autograd node: gather into padded buckets, one dense
    (log_)softmax per bucket along its contiguous last dim, gather back; the backward does the
    same with torch's softmax backward (written with differentiable ops on the saved output:
    double backward works)."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: tuple, log: bool) -> Tensor:
        buckets, (to_buf, to_rows) = plan
        op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
        f = math.prod(x.shape[1:])
        buf = read_rows(x.reshape(-1), to_buf, float("-inf"))

        def fn(t: Tensor, out: Tensor | None = None) -> Tensor:
            return op(t, -1, False) if out is None else op.out(t, -1, False, out=out)

        ypad = _per_bucket(fn, buckets, f, buf)
        y = read_elements(ypad, to_rows, 0.0, x.shape)
        ctx.plan, ctx.log = plan, log
        ctx.save_for_backward(y, ypad)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        y, ypad = ctx.saved_tensors
        buckets, (to_buf, to_rows) = ctx.plan
        f = math.prod(y.shape[1:])
        # padded places: output 0 (softmax) or -inf (log_softmax), gradient 0: they add nothing
        if torch.is_grad_enabled():  # double backward: the padded output as a function of y
            ypad = read_rows(y.reshape(-1), to_buf, float("-inf") if ctx.log else 0.0)
        dypad = read_rows(dy.reshape(-1), to_buf, 0.0)
        bwd = torch.ops.aten._log_softmax_backward_data if ctx.log else torch.ops.aten._softmax_backward_data

        def fn(g: Tensor, yk: Tensor, out: Tensor | None = None) -> Tensor:
            return bwd(g, yk, -1, y.dtype) if out is None else bwd.out(g, yk, -1, y.dtype, grad_input=out)

        dx = _per_bucket(fn, buckets, f, dypad, ypad)
        return read_rows(dx, to_rows, 0.0).view(y.shape), None, None


def _normalised_last(x: Tensor, c: int) -> Tensor:
    """Rows ``(groups * c, *static)`` as ``(groups, features, c)``: the normalised dim last and
    contiguous (a copy when there are features). torch's CPU softmax along a dim with a
    small inner extent (``(groups, c, H)`` along ``c``) runs strided and costs about twice the
    transposing copies and a contiguous softmax."""
    f = math.prod(x.shape[1:])
    t = x.reshape(x.shape[0] // c, c, f)
    return t.transpose(1, 2).contiguous() if f != 1 else t.reshape(-1, 1, c)


def _rows_back(t: Tensor, out: Tensor) -> None:
    """Write ``(groups, features, c)`` back into the rows ``out`` ``(groups * c, *static)``."""
    out.view(t.shape[0], t.shape[2], t.shape[1]).copy_(t.transpose(1, 2))


class _RunsSoftmax(torch.autograd.Function):
    """Softmax over runs of consecutive rows, one dense call per sample (large samples), as one
    autograd node: each sample's groups with the normalised dim last and contiguous, written
    into one output (no cat). The backward is written with differentiable ops on the saved
    output, so double backward works."""

    @staticmethod
    def forward(ctx, x: Tensor, runs: tuple, log: bool) -> Tensor:
        op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        for lo, hi, c in runs:
            if hi > lo:
                _rows_back(op(_normalised_last(x[lo:hi], c), -1, False), y[lo:hi])
        ctx.runs, ctx.log = runs, log
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (y,) = ctx.saved_tensors
        bwd = torch.ops.aten._log_softmax_backward_data if ctx.log else torch.ops.aten._softmax_backward_data
        if torch.is_grad_enabled():  # double backward: differentiable ops on y (an output of this node)
            parts = []
            for lo, hi, c in ctx.runs:
                if hi > lo:
                    d = bwd(_normalised_last(dy[lo:hi], c), _normalised_last(y[lo:hi], c), -1, y.dtype)
                    parts.append(d.transpose(1, 2).reshape(y[lo:hi].shape))
            return (torch.cat(parts) if parts else torch.zeros_like(y)), None, None
        dx = torch.empty_like(y)
        for lo, hi, c in ctx.runs:
            if hi > lo:
                _rows_back(bwd(_normalised_last(dy[lo:hi], c), _normalised_last(y[lo:hi], c), -1, y.dtype), dx[lo:hi])
        return dx, None, None


DEFER: list = []
"""Hooks ``(values, groups, log) -> rows or None`` asked first when ``values`` is a tensor
subclass: deferred attention scores (:func:`padless.ops.pairs.pending.softmax`)."""


def ragged_softmax(values: Tensor, g: "Groups", log: bool = False) -> Tensor:
    """Softmax of ``values`` ``(T, *static)`` within each group of ``g`` (same shape out)."""
    if DEFER and type(values) is not Tensor:
        for hook in DEFER:
            out = hook(values, g, log)
            if out is not None:
                return out

    def unsupported() -> str | None:
        if not values.is_floating_point():
            return f"dtype {values.dtype}"
        return None if g.plan() is not None else "the ragged dim's groups are not strided runs"

    if not dispatch.use_kernel(FAMILY, values, unsupported=unsupported):
        return twin_softmax(values, g, log)
    start, count, stride = g.plan()
    flat = values.reshape(values.shape[0], math.prod(values.shape[1:])).contiguous()
    return ragged_softmax_op(flat, start, count, stride, bool(log)).reshape(values.shape)
