"""Convolutions of images ``(C, H_i, W_i)`` and sequences ``(C, L_i)`` at their own sizes.

``F.conv2d`` / ``nn.Conv2d`` (any kernel, stride, padding ints / ``"same"`` / ``"valid"``,
dilation, groups, bias), ``F.conv_transpose2d``, ``F.conv1d`` and ``F.conv_transpose1d``.
Every image keeps its own coordinate system: windows, zero padding and output sizes are
exactly those of the dense op on that image alone, and no window reaches another image.
The dense work runs once per layer on the blocks of a cached
:class:`~padless.ops.vision.spatial.SpatialPlan` (one shared canvas by default).
``nn.Conv2d(padding_mode="reflect" | "replicate" | "circular")`` pads through ``F.pad``
first, as torch does, then convolves with padding 0.

Kernel == stride without padding (patch embeddings) and 1x1 convolutions skip the plan:
the pixels are cut into patches (one row permutation) and multiplied by the flattened
weight. An image too small for a layer raises torch's own error for it, naming it::

    conv2d(): image 2 of shape (3, 2, 2) is too small for this layer: Calculated padded
    input size per channel: (2 x 2). Kernel size: (3 x 3). Kernel size can't be greater ...
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common.amp import autocast_inputs
from padless.ops.vision.pack import grid_index
from padless.ops.vision.spatial import (
    BlocksToRows,
    RowsToBlocks,
    Geometry,
    SpatialPlan,
    _cache_for,
    _cache_of,
    conv_channels_last,
    image_hw,
    images_like,
    spatial_plan,
    to_pair,
    conv_padding as _padding,
    too_small_error,
)
from padless.tensor.autograd import values_of
from padless.ops.vision import canvas as canvas_mod
from padless.ops.vision import traced as vision_traced
from padless.ops.vision.compiled import island
from padless.ops.vision.canvas import canvas_of, from_relu, wrap_canvas
from padless.ops.vision.canvas_ops import CanvasConv, Relay, relay_index
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.lru import LRU, MiB
from padless.tensor.registry import implements

__all__ = ["conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d"]


def _dense_params(op: str, x: Any, weight: Any, bias: Any) -> None:
    if not isinstance(x, NestedTensor):
        raise TypeError(f"{op}(): only the input may be a NestedTensor; weight and bias must be dense tensors")
    if isinstance(weight, NestedTensor) or isinstance(bias, NestedTensor):
        raise TypeError(f"{op}(): weight and bias must be dense tensors, got a NestedTensor")


_VALID = LRU("conv_checked_arguments", max_entries=4096, max_bytes=16 * MiB,
              what="(op, arguments, geometry) whose arguments passed torch's check on images large enough")


def _validate(op: str, plan: SpatialPlan, channels: int, dense: Callable[[Tensor], Any], key: Any = None) -> None:
    """Torch's errors, from the dense op on meta tensors: a too-small image (named), else the
    arguments themselves (weight shape, groups, output_padding) on the first image's shape.
    With ``key`` (everything besides the plan that ``dense`` depends on), a passing check is
    remembered on the plan and not run again (a steady-state layer does no meta calls), and for the
    layer's geometry: once the arguments pass on one batch, a batch whose images are all large enough
    for the window passes too (the check on the first image is then a check of the arguments alone)."""
    if key is not None:
        if ("valid", op, key) in plan._divisors:
            return
        if not plan.too_small and _VALID.get((op, key, plan.geometry)):  # the arguments were checked on other sizes
            return
        _validate(op, plan, channels, dense)
        plan._divisors[("valid", op, key)] = True
        if not plan.too_small:
            _VALID.put((op, key, plan.geometry), True)
        return
    err = too_small_error(op, plan, channels, dense)
    if err is not None:
        raise err
    if plan.in_hw.shape[0] == 0:
        return
    hh, ww = (int(v) for v in plan.in_hw[0])
    shape = (1, channels, ww) if plan.cache is not None and plan.cache.ragged == (1,) else (1, channels, hh, ww)
    try:
        dense(torch.empty(shape, device="meta"))
    except Exception as e:
        raise type(e)(f"{op}(): {e}") from None


class _PlanConv(torch.autograd.Function):
    """rows -> canvas -> native (transposed) convolution -> rows, saving only the packed input
    (its canvas instead when the input needs no gradient: the images into a stem).

    Autograd of the three steps would save the canvas (a second copy of the input,
    ~1.2x its size) and turn the output gather's gradient into a scatter-add; here the
    backward rebuilds the canvas from the saved rows (one gather), puts the output
    gradient on the canvas (one gather: output positions are unique) and reads the input
    gradient back with one ``index_select``. The canvas is channels-last while it holds
    more elements than the weight (:func:`~padless.ops.vision.spatial.conv_channels_last`).
    First-order only."""

    @staticmethod
    def forward(ctx, v, weight, bias, plan, stride, dilation, groups, transposed):  # type: ignore[override]
        cl = conv_channels_last(plan, v.shape[1], weight)
        blocks = plan.to_blocks(v, channels_last=cl)
        y = torch.ops.aten.convolution(blocks, weight, bias, stride, [0, 0], dilation, transposed, [0, 0], groups)
        # an input without gradient (the images into the stem) keeps its canvas: the backward then
        # needs no gather (and the rows may not be kept alive by anything else)
        ctx.keep_canvas = not ctx.needs_input_grad[0]
        ctx.save_for_backward(blocks if ctx.keep_canvas else v, weight)
        ctx.args = (plan, stride, dilation, groups, transposed, None if bias is None else [bias.shape[0]], cl)
        return plan.from_blocks(y)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[override]
        v, weight = ctx.saved_tensors
        plan, stride, dilation, groups, transposed, bias_sizes, cl = ctx.args
        need = list(ctx.needs_input_grad[:3])
        need[2] = need[2] and bias_sizes is not None
        gi, gw, gb = torch.ops.aten.convolution_backward(
            plan.blocks_of_rows(g.contiguous(), channels_last=cl), v if ctx.keep_canvas else plan.to_blocks(v, channels_last=cl), weight,
            bias_sizes, stride, [0, 0], dilation, transposed, [0, 0], groups, need,
        )
        gv = plan.rows_of_blocks(gi, v.shape[0]) if need[0] else None
        return gv, gw, gb, None, None, None, None, None


def _plan_conv(plan: SpatialPlan, x: NestedTensor, weight: Tensor, bias: Tensor | None, stride, dilation, groups: int, transposed: bool, out_channels: int) -> NestedTensor:
    v = values_of(x)
    if int(plan.out_offsets[-1]) == 0 or plan.blocks[1] == 0:
        return images_like(v.new_zeros((0, out_channels)), out_channels, plan.cache, x)  # type: ignore[arg-type]
    with autocast_inputs(v, weight, bias) as (v, weight, bias):  # bf16 convolutions under autocast
        out = _PlanConv.apply(v, weight, bias, plan, list(stride), list(dilation), groups, transposed)
    return images_like(out, out_channels, plan.cache, x)  # type: ignore[arg-type]


def _on_blocks(plan: SpatialPlan, x: NestedTensor, out_channels: int, native: Callable[[Tensor], Tensor], fill: float = 0.0) -> NestedTensor:
    """Run ``native`` once on the plan's blocks and pack the valid outputs as images."""
    v = values_of(x)
    if int(plan.out_offsets[-1]) == 0 or plan.blocks[1] == 0:
        out = v.new_zeros((0, out_channels))
    else:
        out = BlocksToRows.apply(native(RowsToBlocks.apply(v, plan, fill)), plan)
    return images_like(out, out_channels, plan.cache, x)  # type: ignore[arg-type]


class _Subsample(torch.autograd.Function):
    """Rows ``idx`` of ``v`` (every ``s``-th pixel of every image): one gather; the backward
    writes the gradient back into a zero buffer with one ``index_copy``."""

    @staticmethod
    def forward(ctx, v: Tensor, idx: Tensor) -> Tensor:  # type: ignore[override]
        ctx.rows, ctx.idx = v.shape[0], idx
        return v.index_select(0, idx)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return g.new_zeros((ctx.rows, g.shape[1])).index_copy_(0, ctx.idx, g), None


def _strided_1x1(x: NestedTensor, weight: Tensor, bias: Tensor | None, st: tuple[int, int]) -> NestedTensor:
    """1x1 convolution with stride and no padding: keep every ``s``-th pixel (an index cached on
    the structure), then a matmul."""
    idx, out_cache = subsample_index(x, st)
    v = _Subsample.apply(values_of(x), idx)
    return images_like(F.linear(v, weight.flatten(1), bias), weight.shape[0], out_cache, x)


def subsample_index(x: NestedTensor, st: tuple[int, int]) -> tuple[Tensor, Any]:
    """The rows of every ``st``-th pixel of every image (``ceil(h / s)`` by ``ceil(w / s)`` each,
    row-major) and the output structure cache, cached on ``x``'s structure."""
    return subsample_of(_cache_of("conv2d", x), st, x._values.device)


def subsample_of(cache: Any, st: tuple[int, int], dev: torch.device) -> tuple[Tensor, Any]:
    """:func:`subsample_index` on a spatial cache (what a network plan recipe replays in a worker)."""
    key = ("subsample", st, dev)
    hit = cache.plans.get(key)
    if hit is None:
        idx, ohw, ooff = _subsample_rows(cache.hw.numpy(), cache.host_offsets.numpy(), st)
        hit = (torch.from_numpy(idx).to(dev, non_blocking=True), _cache_for(torch.from_numpy(ohw), torch.from_numpy(ooff), cache.ragged))
        cache.plans[key] = hit  # type: ignore[assignment]
    return hit  # type: ignore[return-value]


def _subsample_rows(hw: np.ndarray, off: np.ndarray, st: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host ``(rows, out sizes, out offsets)`` of :func:`subsample_of`, in numpy: image ``i``'s
    output pixel ``(a, b)`` is its row ``off_i + a * s0 * w_i + b * s1``."""
    ohw = np.stack([(hw[:, 0] + st[0] - 1) // st[0], (hw[:, 1] + st[1] - 1) // st[1]], 1)
    ooff = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(ohw[:, 0] * ohw[:, 1])])
    return grid_index(off[:-1], ohw, st[0] * hw[:, 1], st[1]), ohw, ooff


def _strided_1x1_backward(nt: NestedTensor, tensors: list, spec: tuple, grad: Tensor, needs: list) -> list:
    """The compiled strided projection's gradient: two matmuls and one ``index_copy`` on the rows
    of its pixels (no canvas, no recompute)."""
    st, has_bias = spec
    w, v = tensors[0], nt._values
    idx = subsample_index(nt, tuple(st))[0]
    out: list = [None, None] + ([None] if has_bias else [])
    if needs[0]:
        gi = grad.mm(w.flatten(1))
        out[0] = gi.new_zeros((v.shape[0], gi.shape[1])).index_copy_(0, idx, gi)
    if needs[1]:
        out[1] = grad.t().mm(v.index_select(0, idx)).view_as(w)
    if has_bias and needs[2]:
        out[2] = grad.sum(0)
    return out


@island("strided_1x1", backward=_strided_1x1_backward)
def _strided_1x1_island(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    """The compiled strided projection (:func:`padless.ops.vision.traced.traced_conv2d`): the eager
    op, which runs :func:`_strided_1x1` unless an image is empty (then torch's error)."""
    st, has_bias = spec
    return values_of(F.conv2d(nt, tensors[0], tensors[1] if has_bias else None, tuple(st)))


def _patch_conv(x: NestedTensor, weight: Tensor, bias: Tensor | None, kh: int, kw: int) -> NestedTensor:
    """kernel == stride, no padding, dilation 1, one group: patches times the flat weight."""
    from padless.ops.vision.patchify import _tokens

    o = weight.shape[0]
    if (kh, kw) == (1, 1):
        out = F.linear(values_of(x), weight.flatten(1), bias)
        return images_like(out, o, _cache_for(*image_hw("conv2d", x), x._ragged), x)
    tok, grid, tok_off = _tokens("conv2d", x, kh, kw, False)
    out = F.linear(tok, weight.flatten(1), bias)
    return images_like(out, o, _cache_for(grid, tok_off, (1, 2)), x)


def canvas_setup(op: str, x: NestedTensor, g: Geometry, channels: int, dense: Callable[[Tensor], Any], key: Any, fill: float = 0.0):
    """A layer on the persistent canvas (:mod:`padless.ops.vision.canvas`): ``(input plane (P, C),
    its (Hc, Wc), its gaps or None, native padding, re-lay indices or None, output gaps (same
    layout) or None, output layout, output structure cache)``, or ``None`` where the layer takes
    the rows path (compile, autocast, dtype mismatch, asymmetric padding, ceil mode, 1-D)."""
    cv = canvas_of(x)
    if not canvas_mod.CANVAS_PERSIST or g.transposed or g.ceil_mode:
        return None
    pt, pb, pl, pr = g.padding
    if pt != pb or pl != pr or x.sample_dim != 3 or x._ragged != (1, 2):
        return None
    dev = x._offsets.device
    if cv is None and (_is_traced(x._values) or x._values.dim() != 2):
        return None
    if torch.is_autocast_enabled(dev.type) or (cv is not None and not cv[0].dtype.is_floating_point):
        return None
    cache = _cache_of(op, x)
    info = cache.plans.get(("canvas_out", g))
    if info is None:
        hw = cache.hw.tolist()
        outs = [(g.out_size(h, 0), g.out_size(w, 1)) if h > 0 and w > 0 else (0, 0) for h, w in hw]
        odd = any(h * w == 0 for h, w in hw) or any(a <= 0 or b <= 0 for (a, b), (h, w) in zip(outs, hw) if h * w)
        outs = [(a, b) if a > 0 and b > 0 else (0, 0) for a, b in outs]
        ohw = torch.tensor(outs, dtype=torch.int64).view(-1, 2)
        same = g.stride == (1, 1) and 2 * pt == g.extent[0] - 1 and 2 * pl == g.extent[1] - 1
        ocache = cache if same else _cache_for(ohw, layout_offsets(ohw), cache.ragged)
        info = (outs, ocache, odd, same)
        cache.plans[("canvas_out", g)] = info
    outs, ocache, odd, same = info
    if cv is not None and cv[1].fits((pt, pl), g.stride):
        if odd or not _VALID.get((op, key, g)):  # torch's errors (a too-small image, the arguments): the rows path's check
            _validate(op, spatial_plan(op, x, g), channels, dense, key=key)
        xc, lay = cv
        gaps = lay.indices(dev)[2]
        # a ReLU's output needs neither its gaps' gradient zeroed (ReLU's backward does it) nor,
        # for max pooling, its zero gaps set to -inf (every window holds a real pixel >= 0; where
        # all of them are 0 the maximum's gradient, wherever it lands, meets ReLU's derivative 0)
        in_gaps = None if from_relu(x) else gaps
        if same:
            return xc, (lay.hc, lay.wc), in_gaps, [pt, pl], None, gaps, lay, ocache
        if g.extent == (1, 1) and (pt, pl) == (0, 0) and g.stride[0] == g.stride[1]:  # strided 1x1: read the plane itself
            bases = [y * lay.wc + xx for y, xx in lay.origins]
            relay, lay2 = relay_index(lay.relays, bases, (lay.hc, lay.wc), outs, ocache, dev, g.stride[0])
            return xc, (lay.hc, lay.wc), in_gaps, [0, 0], (*relay, "1x1"), None, lay2, ocache
        native = ((lay.hc + 2 * pt - g.extent[0]) // g.stride[0] + 1, (lay.wc + 2 * pl - g.extent[1]) // g.stride[1] + 1)
        bases = [(y // g.stride[0]) * native[1] + xx // g.stride[1] for y, xx in lay.origins]
        relay, lay2 = relay_index(lay.relays, bases, native, outs, ocache, dev)
        return xc, (lay.hc, lay.wc), in_gaps, [pt, pl], relay, None, lay2, ocache
    # rows (or a canvas whose gaps are too narrow): the layer's spatial plan puts them on its own
    # canvas (a plan the Collator may have built in its worker), padding included
    plan = spatial_plan(op, x, g)
    _validate(op, plan, channels, dense, key=key)
    if plan.grids is None or plan.blocks[0] != 1 or plan.blocks[1] == 0 or int(plan.out_offsets[-1]) == 0:
        return None  # the tiles layout (--designs), or no output pixel
    xc = _flat_rows(RowsToBlocks.apply(values_of(x), plan, fill))
    relay, lay2 = relay_index(plan._divisors, plan.grids[2], plan.out_blocks[1:], outs, ocache, dev)
    return xc, plan.blocks[1:], None, [0, 0], relay, None, lay2, ocache


def _flat_rows(b: Tensor) -> Tensor:
    f = b.permute(0, 2, 3, 1).reshape(-1, b.shape[1])
    return f if f.is_contiguous() else f.contiguous()


def layout_offsets(hw: Tensor) -> Tensor:
    from padless.tensor import layout

    return layout.offsets_from_counts(hw.prod(1))


def _canvas_conv(x: NestedTensor, weight: Tensor, bias: Tensor | None, g: Geometry, groups: int, windowed: bool) -> NestedTensor | None:
    """conv2d on the persistent canvas, or ``None`` (the rows path)."""
    if not canvas_mod.CANVAS_PERSIST or (canvas_of(x) is None and not windowed):
        return None
    c = x._env[0]
    st, dil = g.stride, g.dilation
    dense = lambda t: F.conv2d(t, weight.to("meta"), None, st, (g.padding[0], g.padding[2]), dil, groups)
    got = canvas_setup("conv2d", x, g, c, dense, (tuple(weight.shape), weight.dtype, groups, c))
    if got is None:
        return None
    xc, plane, in_gaps, pad, relay, out_gaps, lay2, ocache = got
    if g.kernel == (1, 1) and pad == [0, 0] and groups == 1 and relay is not None and len(relay) == 5:
        # a strided 1x1 layer (a projection): its pixels gathered from the plane, then a matmul
        yc = F.linear(Relay.apply(xc, *relay[:4]), weight.flatten(1), bias)
        if bias is not None:
            yc.index_fill_(0, layout_gaps(lay2, yc.device), 0.0)
    elif g.kernel == (1, 1) and pad == [0, 0] and groups == 1 and relay is None:
        yc = F.linear(xc, weight.flatten(1), bias)  # a 1x1 layer: a matmul on the plane
        if bias is not None:
            yc.index_fill_(0, layout_gaps(lay2, yc.device), 0.0)
    else:
        yc = CanvasConv.apply(xc, weight, bias, plane, in_gaps, list(st), pad, list(dil), groups, out_gaps, relay)
    return wrap_canvas(yc, lay2, weight.shape[0], ocache, x)


def layout_gaps(lay, device) -> Tensor:
    return lay.indices(device)[2]


@implements(F.conv2d, accepts="packed images (C, H_i, W_i), dense weight, dense bias")
def conv2d(func, input: NestedTensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1, groups: int = 1) -> NestedTensor:
    """``F.conv2d`` / ``nn.Conv2d`` on every image alone: output ``(O, oh_i, ow_i)``.

    >>> x = padless.from_list([torch.randn(3, 32, 48), torch.randn(3, 17, 9)])
    >>> torch.nn.Conv2d(3, 8, 7, stride=2, padding=3)(x).sizes().tolist()
    [[8, 16, 24], [8, 9, 5]]
    """
    _dense_params("conv2d", input, weight, bias)
    x = input
    if x.sample_dim != 3:
        raise StructureError(f"conv2d(): expected images (C, H_i, W_i), got samples of rank {x.sample_dim}; use conv1d for (C, L_i)")
    if weight.dim() != 4:
        raise ValueError(f"conv2d(): weight must be (out_channels, in_channels / groups, kh, kw), got shape {tuple(weight.shape)}")
    k = (int(weight.shape[2]), int(weight.shape[3]))
    st = to_pair("conv2d", "stride", stride)
    dil = to_pair("conv2d", "dilation", dilation)
    pad = _padding("conv2d", padding, k, st, dil)
    if x._ragged != (1, 2):
        image_hw("conv2d", x)  # raises: names the layout it expects
    if canvas_of(x) is not None and isinstance(groups, int) and groups > 0 and weight.shape[1] * groups == x._env[0]:
        out = _canvas_conv(x, weight, bias, Geometry(k, st, pad, dil), groups, True)
        if out is not None:
            return out
    c = x._values.shape[1]
    if isinstance(groups, int) and groups > 0 and weight.shape[1] * groups != c:
        raise ValueError(
            f"conv2d(): weight expects {weight.shape[1] * groups} input channels (weight.shape[1] * groups), "
            f"the images have {c}"
        )
    g = Geometry(k, st, pad, dil)
    if _is_traced(x._values):  # torch.compile: symbolic row counts, the eager op as one opaque call
        return vision_traced.traced_conv2d(x, weight, bias, stride, padding, dilation, groups, g)
    plan_free = st == k and pad == (0, 0, 0, 0) and dil == (1, 1) and groups == 1
    if plan_free and x._ragged == (1, 2) and x._values.shape[1] == weight.shape[1]:
        hw, _ = image_hw("conv2d", x)
        small = ((hw[:, 0] < k[0]) | (hw[:, 1] < k[1])) & (hw.prod(1) > 0)  # empty images: empty output
        if bool(small.any()):
            plan = spatial_plan("conv2d", x, g)  # only to name the image with torch's error
            _validate("conv2d", plan, x._values.shape[1], lambda t: F.conv2d(t, weight.to("meta"), None, st, 0, dil, groups))
        return _patch_conv(x, weight, bias, *k)
    if k == (1, 1) and pad == (0, 0, 0, 0) and groups == 1 and bool((image_hw("conv2d", x)[0] > 0).all()):
        return _strided_1x1(x, weight, bias, st)  # a strided projection: no window overlaps, no canvas
    out = _canvas_conv(x, weight, bias, g, groups, True)
    if out is not None:
        return out
    plan = spatial_plan("conv2d", x, g)
    _validate("conv2d", plan, x._values.shape[1], lambda t: F.conv2d(t, weight.to("meta"), None, st, pad[::2], dil, groups),
              key=(tuple(weight.shape), weight.dtype, groups, x._values.shape[1]))
    return _plan_conv(plan, x, weight, bias, st, dil, groups, False, weight.shape[0])


@implements(F.conv_transpose2d, accepts="packed images (C, H_i, W_i), dense weight, dense bias")
def conv_transpose2d(func, input: NestedTensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0, groups: int = 1, dilation=1) -> NestedTensor:
    """``F.conv_transpose2d`` / ``nn.ConvTranspose2d`` on every image alone:
    output ``((H_i-1)s - 2p + d(k-1) + output_padding + 1, ...)`` per image."""
    _dense_params("conv_transpose2d", input, weight, bias)
    if weight.dim() != 4:
        raise ValueError(f"conv_transpose2d(): weight must be (in_channels, out_channels / groups, kh, kw), got shape {tuple(weight.shape)}")
    k = (int(weight.shape[2]), int(weight.shape[3]))
    st = to_pair("conv_transpose2d", "stride", stride)
    dil = to_pair("conv_transpose2d", "dilation", dilation)
    ph, pw = to_pair("conv_transpose2d", "padding", padding, minimum=0)
    op = to_pair("conv_transpose2d", "output_padding", output_padding, minimum=0)
    g = Geometry(k, st, (ph, ph, pw, pw), dil, transposed=True, output_padding=op)
    _check_output_padding("conv_transpose2d", g)
    if _is_traced(input._values) and input.sample_dim == 3 and input._ragged == (1, 2):  # torch.compile
        return vision_traced.traced_conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation, g)
    plan = spatial_plan("conv_transpose2d", input, g)
    _validate("conv_transpose2d", plan, input._values.shape[1],
              lambda t: F.conv_transpose2d(t, weight.to("meta"), None, st, (ph, pw), op, groups, dil))
    o = weight.shape[1] * groups
    return _plan_conv(plan, input, weight, bias, st, dil, groups, True, o)


def _check_output_padding(op: str, g: Geometry) -> None:
    """Torch's rule (checked by the CPU kernel, not by the shape check on meta tensors)."""
    for ax, name in enumerate(("height", "width")):
        o, s, d = g.output_padding[ax], g.stride[ax], g.dilation[ax]
        if o >= s and o >= d:
            raise RuntimeError(
                f"{op}(): output padding must be smaller than either stride or dilation, but got output_padding "
                f"{g.output_padding}, stride {g.stride}, dilation {g.dilation} ({name})"
            )


def _seq_geometry(op: str, weight: Tensor, stride, padding, dilation, transposed: bool = False, output_padding=0) -> tuple[Geometry, int, int, int]:
    if weight.dim() != 3:
        raise ValueError(f"{op}(): weight must be 3-D (channels, channels / groups, k), got shape {tuple(weight.shape)}")
    one = lambda v, name, m=1: v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v  # noqa: E731
    s = to_pair(op, "stride", one(stride, "stride"))[1]
    d = to_pair(op, "dilation", one(dilation, "dilation"))[1]
    k = int(weight.shape[2])
    if transposed:
        p = to_pair(op, "padding", one(padding, "padding"), minimum=0)[1]
        opad = to_pair(op, "output_padding", one(output_padding, "output_padding"), minimum=0)[1]
        return Geometry((1, k), (1, s), (0, 0, p, p), (1, d), transposed=True, output_padding=(0, opad)), s, p, d
    pads = _padding(op, padding if isinstance(padding, str) else (0, one(padding, "padding")), (1, k), (1, s), (1, d))
    return Geometry((1, k), (1, s), pads, (1, d)), s, pads[2], d


def _check_seq(op: str, x: Any) -> None:
    if isinstance(x, NestedTensor) and (x.sample_dim != 2 or x._ragged != (1,)):
        raise StructureError(
            f"{op}(): expected sequences (C, L_i) with a static C and ragged length (dim 2 of the NestedTensor), "
            f"got samples of rank {x.sample_dim} with ragged sample dims {x.ragged_dims}. For (L_i, C) rows, "
            "transpose first: x.transpose(1, 2)"
        )


@implements(F.conv1d, accepts="packed sequences (C, L_i), dense weight, dense bias")
def conv1d(func, input: NestedTensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1, groups: int = 1) -> NestedTensor:
    """``F.conv1d`` / ``nn.Conv1d`` on every sequence ``(C, L_i)`` alone (audio, text CNNs)."""
    _dense_params("conv1d", input, weight, bias)
    _check_seq("conv1d", input)
    g, s, p, d = _seq_geometry("conv1d", weight, stride, padding, dilation)
    plan = spatial_plan("conv1d", input, g)
    pad_arg = padding if isinstance(padding, str) else p
    _validate("conv1d", plan, input._values.shape[1], lambda t: F.conv1d(t, weight.to("meta"), None, s, pad_arg, d, groups))
    w4 = weight.unsqueeze(2)
    return _plan_conv(plan, input, w4, bias, (1, s), (1, d), groups, False, weight.shape[0])


@implements(F.conv_transpose1d, accepts="packed sequences (C, L_i), dense weight, dense bias")
def conv_transpose1d(func, input: NestedTensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0, groups: int = 1, dilation=1) -> NestedTensor:
    """``F.conv_transpose1d`` / ``nn.ConvTranspose1d`` on every sequence ``(C, L_i)`` alone."""
    _dense_params("conv_transpose1d", input, weight, bias)
    _check_seq("conv_transpose1d", input)
    g, s, p, d = _seq_geometry("conv_transpose1d", weight, stride, padding, dilation, True, output_padding)
    _check_output_padding("conv_transpose1d", g)
    plan = spatial_plan("conv_transpose1d", input, g)
    opad = g.output_padding[1]
    _validate("conv_transpose1d", plan, input._values.shape[1],
              lambda t: F.conv_transpose1d(t, weight.to("meta"), None, s, p, opad, groups, d))
    w4 = weight.unsqueeze(2)
    o = weight.shape[1] * groups
    return _plan_conv(plan, input, w4, bias, (1, s), (1, d), groups, True, o)
