"""Pooling of images ``(C, H_i, W_i)`` at their own sizes.

``F.max_pool2d`` (padding, dilation, ceil_mode) and ``F.avg_pool2d`` (count_include_pad,
ceil_mode, divisor_override) run the native pool once on the blocks of the layer's
:class:`~padless.ops.vision.spatial.SpatialPlan`, with windows, padding and output sizes of
each image alone (max pooling fills the gaps with ``-inf``; average pooling sums on
the canvas and divides each window by the count torch uses for that image).

``F.adaptive_avg_pool2d`` / ``F.adaptive_max_pool2d`` with one output size for every
image reduce over each image's own windows and return a dense ``(B, C, oh, ow)``
tensor, as reductions that consume every ragged dim do::

    images (3, 5, 7), (3, 2, 2)  --adaptive_avg_pool2d(., 1)-->  dense (2, 3, 1, 1)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.vision.batch_dense import batch_dense
from padless.ops.vision import canvas as canvas_mod
from padless.ops.vision.canvas import wrap_canvas
from padless.ops.vision.canvas_ops import canvas_max_pool
from padless.ops.vision.conv import _on_blocks, _validate, canvas_setup
from padless.ops.vision.spatial import Geometry, _cache_of, images_like, spatial_plan, to_pair, to_padding
from padless.tensor.autograd import rewrap, values_of
from padless.ops.vision import traced as vision_traced
from padless.ops.vision.compiled import index_island
from padless.tensor.core import NestedTensor, _fmt_shape, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements

__all__ = ["adaptive_avg_pool2d", "adaptive_max_pool2d", "avg_pool2d", "max_pool2d", "max_pool2d_with_indices"]


def _images(op: str, x: Any) -> NestedTensor:
    if not isinstance(x, NestedTensor) or x.sample_dim != 3:
        got = f"samples of rank {x.sample_dim}" if isinstance(x, NestedTensor) else type(x).__name__
        raise StructureError(f"{op}(): expected a NestedTensor of images (C, H_i, W_i), got {got}")
    return x


def _geometry(op: str, kernel_size, stride, padding, dilation, ceil_mode: bool) -> Geometry:
    k = to_pair(op, "kernel_size", kernel_size)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else to_pair(op, "stride", stride)
    return Geometry(k, s, to_padding(op, padding), to_pair(op, "dilation", dilation), bool(ceil_mode))


@implements(F.max_pool2d_with_indices, F.adaptive_max_pool2d_with_indices, accepts="refused: indices")
def max_pool2d_with_indices(func, input: NestedTensor, *args, **kwargs):
    """Refused: the indices of a max pool are positions inside each image's own ``H_i*W_i``;
    they have no packed form yet."""
    name = "adaptive_max_pool2d" if func is F.adaptive_max_pool2d_with_indices else "max_pool2d"
    raise NotImplementedError(
        f"{name}(): return_indices=True is not supported on a NestedTensor (indices into each image's own "
        f"H_i*W_i have no packed form yet); pool with return_indices=False, or per image on x.unbind()"
    )


@implements(F.max_pool2d, accepts="packed images (C, H_i, W_i)")
def max_pool2d(func, input: NestedTensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False, return_indices: bool = False) -> NestedTensor:
    """``F.max_pool2d`` / ``nn.MaxPool2d`` on every image alone (``return_indices`` is refused)."""
    x = _images("max_pool2d", input)
    if return_indices:
        raise NotImplementedError(
            "max_pool2d(): return_indices=True is not supported on a NestedTensor (indices into each image's "
            "own H_i*W_i have no packed form yet); pool with return_indices=False, or per image on x.unbind()"
        )
    g = _geometry("max_pool2d", kernel_size, stride, padding, dilation, ceil_mode)
    out = _canvas_max_pool(x, g)
    if out is not None:
        return out
    if _is_traced(x._values):  # torch.compile: see padless.ops.vision.compiled
        return vision_traced.traced_pool("max_pool2d", x, g, (kernel_size, stride, padding, dilation, ceil_mode))
    plan = spatial_plan("max_pool2d", x, g)
    c = x._values.shape[1]
    pad = (g.padding[0], g.padding[2])
    _validate("max_pool2d", plan, c, lambda t: F.max_pool2d(t, g.kernel, g.stride, pad, g.dilation, g.ceil_mode), key=c)
    v = values_of(x)
    if int(plan.out_offsets[-1]) == 0 or plan.blocks[1] == 0:
        return _on_blocks(plan, x, c, lambda blk: blk)  # empty output
    out = _PlanMaxPool.apply(v, plan, list(g.kernel), list(g.stride), list(g.dilation))
    return images_like(out, c, plan.cache, x)  # type: ignore[arg-type]


def _canvas_max_pool(x: NestedTensor, g: Geometry) -> NestedTensor | None:
    """max_pool2d on the persistent canvas (:mod:`padless.ops.vision.canvas`), or ``None``."""
    if not canvas_mod.CANVAS_PERSIST or g.dilation != (1, 1):
        return None
    c = x._env[0]
    pad = (g.padding[0], g.padding[2])
    dense = lambda t: F.max_pool2d(t, g.kernel, g.stride, pad, g.dilation, g.ceil_mode)
    got = canvas_setup("max_pool2d", x, g, c, dense, c, fill=float("-inf"))
    if got is None:
        return None
    xc, plane, in_gaps, npad, relay, out_gaps, lay2, ocache = got
    yc = canvas_max_pool(xc, plane, in_gaps, list(g.kernel), list(g.stride), npad, out_gaps, relay)
    return wrap_canvas(yc, lay2, c, ocache, x)


class _PlanMaxPool(torch.autograd.Function):
    """rows -> canvas (gaps ``-inf``) -> native max pool -> rows.

    The pool's indices (canvas positions of every output's maximum) are turned into input rows
    through the plan's inverse and saved; the backward is then one ``scatter_add`` of the output
    gradient into the input rows (a maximum found in a gap, possible only where a window holds no
    real value above ``-inf``, sends its gradient to a dropped row).
    Autograd of the native pool would save the canvas too and rebuild a canvas of gradients.
    First-order only."""

    @staticmethod
    def forward(ctx, v: Tensor, plan, kernel: list, stride: list, dilation: list) -> Tensor:  # type: ignore[override]
        y, rows = _pool_rows(v, plan, kernel, stride, dilation)
        if v.shape[0] < 2**31 - 1:
            rows = rows.to(torch.int32)  # half the saved bytes; widened again in the backward
        ctx.save_for_backward(rows)  # (T_out, C): the input row of every maximum
        ctx.in_rows = v.shape[0]
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        gv = g.new_zeros((ctx.in_rows + 1, g.shape[1])).scatter_add_(0, rows.long(), g.contiguous())
        return gv[: ctx.in_rows], None, None, None, None


def _pool_rows(v: Tensor, plan, kernel: list, stride: list, dilation: list) -> tuple[Tensor, Tensor]:
    """Max pooling on the plan's canvas: the output rows and the input row of every maximum
    ``(T_out, C)`` (``v.shape[0]``, a dropped row, for a maximum found in a gap)."""
    blocks = plan.to_blocks(v, float("-inf"))
    y, idx = torch.ops.aten.max_pool2d_with_indices(blocks, kernel, stride, [0, 0], dilation, False)
    pos = plan.from_blocks(idx)  # (T_out, C) positions in each block's plane
    (n, hb, wb), (_, ho, wo) = plan.blocks, plan.out_blocks
    if n > 1:  # tiles: the block of every output row
        pos = pos + torch.div(plan.take, ho * wo, rounding_mode="floor").mul_(hb * wb).unsqueeze(1)
    rows = plan.row_of_block("in", v.device).index_select(0, pos.view(-1)).view(-1, v.shape[1])
    return plan.from_blocks(y), rows


def max_pool_rows(x: NestedTensor, g: Geometry) -> Tensor:
    """The input row of every output's maximum, ``(T_out, C)`` int64 (``x``'s row count where
    it lies in a gap): what the compiled max pool gathers (:mod:`padless.ops.vision.traced`)."""
    plan = spatial_plan("max_pool2d", x, g)
    c = x._values.shape[1]
    pad = (g.padding[0], g.padding[2])
    _validate("max_pool2d", plan, c, lambda t: F.max_pool2d(t, g.kernel, g.stride, pad, g.dilation, g.ceil_mode), key=c)
    v = x._values
    if int(plan.out_offsets[-1]) == 0 or plan.blocks[1] == 0:
        return torch.zeros((0, c), dtype=torch.int64, device=v.device)  # as the eager op: no output row
    return _pool_rows(v, plan, list(g.kernel), list(g.stride), list(g.dilation))[1]


@index_island("max_pool2d_rows")
def _max_pool_rows_island(nt: NestedTensor, spec: tuple) -> Tensor:
    """The compiled max pool's index (:func:`padless.ops.vision.traced.traced_pool`)."""
    k, st, pad, dil, ceil = spec
    return max_pool_rows(nt, Geometry(tuple(k), tuple(st), tuple(pad), tuple(dil), bool(ceil)))


@implements(F.avg_pool2d, accepts="packed images (C, H_i, W_i)")
def avg_pool2d(func, input: NestedTensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> NestedTensor:
    """``F.avg_pool2d`` / ``nn.AvgPool2d`` on every image alone: each window's sum divided by the
    count torch uses for that window of that image (padding counted or not, ceil-mode edges)."""
    x = _images("avg_pool2d", input)
    g = _geometry("avg_pool2d", kernel_size, stride, padding, 1, ceil_mode)
    if _is_traced(x._values):  # torch.compile: see padless.ops.vision.compiled
        spec = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        return vision_traced.traced_pool("avg_pool2d", x, g, spec)
    plan = spatial_plan("avg_pool2d", x, g)
    c = x._values.shape[1]
    pad = (g.padding[0], g.padding[2])
    _validate("avg_pool2d", plan, c,
              lambda t: F.avg_pool2d(t, g.kernel, g.stride, pad, g.ceil_mode, count_include_pad, divisor_override),
              key=(c, bool(count_include_pad), divisor_override))
    sums = _on_blocks(plan, x, c, lambda blk: F.avg_pool2d(blk, g.kernel, g.stride, 0, False, True, 1))
    v = values_of(sums)
    if divisor_override:
        out = v / divisor_override
    else:
        out = v / plan.avg_divisor(bool(count_include_pad), v.dtype, v.device)
    return rewrap(out, sums)


def _adaptive_index(op: str, x: NestedTensor, oh: int, ow: int) -> tuple[Tensor | None, Tensor, Tensor]:
    """Per (pixel, window) pair: the pixel row (None: every row once, in order), the cell
    ``i*oh*ow + a*ow + b`` it pools into, and the pixel count of every cell. Cached."""
    return adaptive_of(_cache_of(op, x), oh, ow, x._values.device)


def adaptive_of(cache: Any, oh: int, ow: int, dev: torch.device) -> tuple[Tensor | None, Tensor, Tensor]:
    """:func:`_adaptive_index` on a spatial cache (what a network plan recipe replays in a worker)."""
    key = ("adaptive", oh, ow, dev)
    hit = cache.plans.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    hw, off = cache.hw, cache.host_offsets
    if (oh, ow) == (1, 1):  # global pooling: every pixel pools into its image's one cell
        n = hw.prod(1)
        out = (None, torch.repeat_interleave(torch.arange(hw.shape[0]), n).to(dev), n.to(dev))
        cache.plans[key] = out  # type: ignore[assignment]
        return out
    rows, cells, counts = [], [], []
    for i, (h, w) in enumerate(hw.tolist()):
        def member(n: int, o: int) -> Tensor:
            j = torch.arange(o)
            start = torch.div(j * n, o, rounding_mode="floor")
            end = torch.div((j + 1) * n + o - 1, o, rounding_mode="floor")
            pos = torch.arange(n)
            return (pos >= start[:, None]) & (pos < end[:, None])  # (o, n)

        mh, mw = member(h, oh), member(w, ow)
        m = mh[:, None, :, None] & mw[None, :, None, :]  # (oh, ow, h, w)
        a, b, r, c = m.nonzero().unbind(1)
        rows.append(int(off[i]) + r * w + c)
        cells.append(i * oh * ow + a * ow + b)
        counts.append((mh.sum(1)[:, None] * mw.sum(1)[None, :]).flatten())
    row = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    cell = torch.cat(cells) if cells else torch.zeros(0, dtype=torch.int64)
    count = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)
    identity = (oh, ow) == (1, 1)
    out = (None if identity else row.to(dev), cell.to(dev), count.to(dev))
    cache.plans[key] = out  # type: ignore[assignment]
    return out


def _adaptive(op: str, x: Any, output_size, reduce: str) -> Tensor:
    x = _images(op, x)
    osz = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    if len(osz) != 2 or any(o is None for o in osz) or any(not isinstance(o, int) or o < 1 for o in osz):
        raise ValueError(
            f"{op}(): output_size must be one positive int or a pair of them for every image, got {output_size!r} "
            "(None would keep each image's own size; that output is ragged and not supported)"
        )
    oh, ow = osz
    if _is_traced(x._values):  # torch.compile: B * oh * ow rows, the eager op as one opaque call
        return vision_traced.traced_adaptive(op, x, oh, ow)
    cache = _cache_of(op, x)
    c = x._values.shape[1]
    for i in (cache.hw.prod(1) == 0).nonzero().flatten().tolist():
        shape = (1, c, *cache.hw[i].tolist())
        dense = F.adaptive_avg_pool2d if reduce == "mean" else F.adaptive_max_pool2d
        try:
            dense(torch.zeros(shape), osz)
        except Exception as e:
            raise type(e)(f"{op}(): image {i} of shape {_fmt_shape(list(shape[1:]))}: {e}") from None
        if reduce == "amax":
            raise StructureError(f"{op}(): image {i} of shape {_fmt_shape(list(shape[1:]))} is empty; it has no maximum")
    row, cell, count = _adaptive_index(op, x, oh, ow)
    v = values_of(x)
    src = v if row is None else v.index_select(0, row)
    b = x.batch_size
    if reduce == "mean":
        out = v.new_zeros((b * oh * ow, c)).index_add(0, cell, src) / count.to(v.dtype).unsqueeze(1)
    else:
        out = src.gather(0, _first_max(src, cell, b * oh * ow))
    out = out.view(b, oh, ow, c).permute(0, 3, 1, 2)
    # a map of several cells remembers its batch: F.interpolate(pooled, size=x.shape[2:]) then
    # brings each image's map to its own size (pyramid pooling; padless.ops.vision.batch_dense)
    return batch_dense(out, x._lineage) if oh * ow > 1 and not torch.compiler.is_compiling() else out


def _first_max(src: Tensor, cell: Tensor, cells: int) -> Tensor:
    """Per cell and channel, the position in ``src`` (pixels of a window in row-major order, the
    windows one after another) of the pixel torch's adaptive max pooling picks: the first
    maximum, or the last NaN (its kernel keeps a pixel when ``val > max or isnan(val)``). The
    gradient goes to that pixel alone, as in torch, also where a window holds ties (a ReLU's
    zeros). ``(cells, C)`` int64, no sync."""
    c = src.shape[1]
    idx = cell.unsqueeze(1).expand(-1, c)
    with torch.no_grad():
        s = src.detach()
        best = s.new_zeros((cells, c)).scatter_reduce(0, idx, s, "amax", include_self=False)
        n = s.shape[0]
        pos = torch.arange(n, device=s.device).unsqueeze(1).expand(-1, c)
        nan = s.isnan()
        first = torch.where(s == best.index_select(0, cell), pos, n)
        pick = torch.full((cells, c), n, dtype=torch.int64, device=s.device).scatter_reduce(0, idx, first, "amin")
        last_nan = torch.full((cells, c), -1, dtype=torch.int64, device=s.device)
        last_nan = last_nan.scatter_reduce(0, idx, torch.where(nan, pos, -1), "amax")
        return torch.where(last_nan >= 0, last_nan, pick)


@implements(F.adaptive_avg_pool2d, accepts="packed images (C, H_i, W_i)")
def adaptive_avg_pool2d(func, input: NestedTensor, output_size) -> Tensor:
    """``F.adaptive_avg_pool2d`` / ``nn.AdaptiveAvgPool2d``: the same ``(oh, ow)`` for every image,
    each image's own adaptive windows; returns a dense ``(B, C, oh, ow)`` tensor."""
    return _adaptive("adaptive_avg_pool2d", input, output_size, "mean")


@implements(F.adaptive_max_pool2d, accepts="packed images (C, H_i, W_i)")
def adaptive_max_pool2d(func, input: NestedTensor, output_size, return_indices: bool = False) -> Tensor:
    """``F.adaptive_max_pool2d`` / ``nn.AdaptiveMaxPool2d`` (dense ``(B, C, oh, ow)``). The gradient
    goes to the pixel torch picks (the first maximum of a window, also among ties);
    ``return_indices`` is refused."""
    if return_indices:
        raise NotImplementedError("adaptive_max_pool2d(): return_indices=True is not supported on a NestedTensor")
    return _adaptive("adaptive_max_pool2d", input, output_size, "amax")
