"""Convolution, max pooling and batch norm on the persistent canvas (:mod:`.canvas`).

Each op runs the native kernel once on the whole canvas plane ``(1, C, Hc, Wc)`` (a
channels-last view of the canvas ``(P, C)``, no copy):

* convolution (any kernel, stride dividing the canvas alignment, padding ``<= gap`` and equal
  on both sides of an axis, dilation, groups): a "same" layer's output is a canvas of the same
  layout, its halo in the gaps zeroed in place; a strided one is re-laid by one gather onto the
  standard canvas of its output sizes (:func:`relay`);
* max pooling (no ceil mode, dilation 1): the gaps set to ``-inf`` in a copy, the native pool,
  the output re-laid (strided) or its gaps zeroed;
* batch norm in training: statistics over the real pixels only, from the plane's sums (zero
  gaps) with the gap term taken off; the backward is torch's eval-mode kernel (one pass: the
  affine part and both parameter gradients) plus one ``addcmul`` for the statistics' terms.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from padless.ops.vision.canvas import layout_for
from padless.ops.vision.pack import grid_index, grid_sources

__all__ = ["CanvasBatchNorm", "CanvasConv", "canvas_max_pool", "relay_index"]


def _plane(xc: Tensor, plane: tuple[int, int]) -> Tensor:
    """Canvas ``(P, C)`` as its channels-last plane ``(1, C, Hc, Wc)`` (a view)."""
    return xc.view(1, plane[0], plane[1], xc.shape[1]).permute(0, 3, 1, 2)


def _flat(y: Tensor) -> Tensor:
    """Plane ``(1, C, H, W)`` -> ``(H*W, C)`` (a view when channels-last)."""
    return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


def relay_index(store: dict, nat_bases: list, native: tuple[int, int], out_hw: list, out_cache, device, step: int = 1) -> tuple:
    """The gather that re-lays a layer's native output plane ``native = (Ho, Wo)`` (image ``i``'s
    output at flat position ``nat_bases[i]``, rows ``Wo`` apart) onto the standard canvas of the
    output sizes, and its adjoint: ``(fwd, fwd_gaps, bwd, bwd_gaps)`` and the output layout,
    cached in ``store`` (the input layout's or plan's). ``step``: output pixels ``step`` positions
    apart along both axes of the native plane (a strided 1x1 layer reading the input plane itself)."""
    key = ("relay", native, device, id(out_cache), step)
    hit = store.get(key)
    if hit is not None and hit[-1] is out_cache:
        return hit[:-1]
    ho, wo = native
    lay2 = layout_for(out_cache, device)
    native_pos = grid_index(nat_bases, out_hw, wo * step, step)
    rows = grid_sources(lay2.bases, out_hw, lay2.wc, lay2.P, lay2.live, -1)
    fwd_gaps = np.flatnonzero(rows < 0)
    fwd = native_pos[np.where(rows < 0, 0, rows)] if native_pos.size else np.zeros_like(rows)
    bwd = np.full(ho * wo, -1, dtype=np.int64)
    bwd[native_pos] = grid_index(lay2.bases, out_hw, lay2.wc)
    bwd_gaps = np.flatnonzero(bwd < 0)
    bwd[bwd_gaps] = 0
    t = tuple(torch.from_numpy(a).to(device) for a in (fwd, fwd_gaps, bwd, bwd_gaps))
    hit = (t, lay2, out_cache)
    store[key] = hit
    return hit[:-1]


def _gather_fill(src: Tensor, idx: Tensor, gaps: Tensor, fill: float = 0.0) -> Tensor:
    out = src.index_select(0, idx)
    return out.index_fill_(0, gaps, fill) if gaps.numel() else out


class Relay(torch.autograd.Function):
    """A native output plane ``(Ho*Wo, C)`` -> the standard canvas of the output sizes."""

    @staticmethod
    def forward(ctx, yn: Tensor, fwd: Tensor, fwd_gaps: Tensor, bwd: Tensor, bwd_gaps: Tensor) -> Tensor:  # type: ignore[override]
        ctx.idx = (bwd, bwd_gaps)
        return _gather_fill(yn, fwd, fwd_gaps)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return _gather_fill(g.contiguous(), *ctx.idx), None, None, None, None


class CanvasConv(torch.autograd.Function):
    """Native (non-transposed) convolution on a canvas plane ``(P, C)`` of ``plane = (Hc, Wc)``.
    ``relay``: ``None`` for a "same" layer (the output keeps the input's layout, its gaps
    ``out_gaps`` zeroed in place), else the re-lay indices of :func:`relay_index`. The input
    gradient's gaps ``in_gaps`` are zeroed in place (``None``: the input came from rows, whose
    adjoint reads the real positions only). Saves the canvas itself (what the layer before keeps
    already: no copy). First-order only."""

    @staticmethod
    def forward(ctx, xc, weight, bias, plane, in_gaps, stride, padding, dilation, groups, out_gaps, relay):  # type: ignore[override]
        x4 = _plane(xc, plane)
        cl = xc.numel() >= weight.numel()  # a small late-layer plane with a large weight: NCHW (no weight conversion)
        y = torch.ops.aten.convolution(x4 if cl else x4.contiguous(), weight, bias, stride, padding, dilation, False, [0, 0], groups)
        ctx.save_for_backward(xc, weight)
        ctx.args = (plane, in_gaps, stride, padding, dilation, groups, None if bias is None else [bias.shape[0]], cl, relay, y.shape)
        yf = _owned_flat(y)
        if relay is None:
            if out_gaps is not None and out_gaps.numel():
                yf.index_fill_(0, out_gaps, 0.0)
            return yf
        return _gather_fill(yf, relay[0], relay[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[override]
        xc, weight = ctx.saved_tensors
        plane, in_gaps, stride, padding, dilation, groups, bias_sizes, cl, relay, yshape = ctx.args
        g = g.contiguous()
        if relay is not None:
            g = _gather_fill(g, relay[2], relay[3])
        g4 = g.view(1, yshape[2], yshape[3], g.shape[1]).permute(0, 3, 1, 2)
        x4 = _plane(xc, plane)
        if not cl:
            g4, x4 = g4.contiguous(), x4.contiguous()
        need = list(ctx.needs_input_grad[:3])
        need[2] = need[2] and bias_sizes is not None
        gi, gw, gb = torch.ops.aten.convolution_backward(g4, x4, weight, bias_sizes, stride, padding, dilation, False, [0, 0], groups, need)
        gx = None
        if need[0]:
            gx = _owned_flat(gi)
            if in_gaps is not None and in_gaps.numel():
                gx.index_fill_(0, in_gaps, 0.0)
        return gx, gw, gb, None, None, None, None, None, None, None, None


def _owned_flat(y: Tensor) -> Tensor:
    """``_flat(y)`` as a contiguous tensor (a view of a fresh channels-last ``y``, else a copy)."""
    f = _flat(y)
    return f if f.is_contiguous() else f.contiguous()


def canvas_max_pool(xc: Tensor, plane, in_gaps, kernel, stride, padding, out_gaps, relay) -> Tensor:
    """Max pooling on a canvas plane (autograd of the native pool). ``in_gaps``: zero gaps set to
    ``-inf`` in a copy (``None``: the plane's gaps are ``-inf`` already)."""
    if relay is not None and len(relay) == 5:  # a 1x1 window with a stride: the pixels themselves
        return Relay.apply(xc, *relay[:4])
    xm = xc.index_fill(0, in_gaps, float("-inf")) if in_gaps is not None and in_gaps.numel() else xc
    y = torch.nn.functional.max_pool2d(_plane(xm, plane), kernel, stride, padding)
    yf = _flat(y)
    if relay is None:
        return yf.index_fill(0, out_gaps, 0.0) if out_gaps is not None and out_gaps.numel() else yf
    return Relay.apply(yf, *relay)


class CanvasBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of a zero-gap canvas over its ``N`` real pixels. Returns the
    normalised canvas (zero gaps) and the batch mean and biased variance (no gradient)."""

    @staticmethod
    def forward(ctx, xc, weight, bias, lay, eps):  # type: ignore[override]
        p, n = xc.shape[0], lay.N
        # the plane's mean and biased variance from torch's batch-norm statistics kernel (no output
        # written), then over the N real pixels: the P - N gaps are zeros, so mean = mean_P * P / N,
        # and var = var_P * P / N - mean^2 (P - N) / P
        mean_p, var_p = torch.batch_norm_update_stats(xc.t().unsqueeze(0).unsqueeze(-1), None, None, 0.0)
        mean = mean_p.mul_(p / n)
        var = torch.addcmul(var_p.mul_(p / n), mean, mean, value=-(p - n) / p).clamp_min_(0)
        invstd = (var + eps).rsqrt_()
        scale = invstd if weight is None else weight * invstd
        shift = torch.addcmul(bias, mean, scale, value=-1) if bias is not None else -mean * scale
        y = torch.addcmul(shift, xc, scale)
        gaps = lay.indices(xc.device)[2]
        if gaps.numel():
            y.index_fill_(0, gaps, 0.0)
        ctx.save_for_backward(xc, weight, mean, invstd)
        ctx.lay, ctx.eps = lay, eps
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, _gm, _gv):  # type: ignore[override]
        xc, weight, mean, invstd = ctx.saved_tensors
        lay, n = ctx.lay, ctx.lay.N
        gy = gy.contiguous()
        c = xc.shape[1]
        w = weight if weight is not None else xc.new_ones(c)
        as4 = lambda t: t.t().unsqueeze(0).unsqueeze(-1)  # (P, C) -> channels-last (1, C, P, 1)
        # torch's training-mode kernel with our statistics: its sums run over the P plane positions
        # (the gradient is zero in the gaps, so they are the real pixels' sums) but it divides them
        # by P; the difference to 1/N is one per-channel affine term, added in place
        gx4, gw, gb = torch.ops.aten.native_batch_norm_backward(as4(gy), as4(xc), w, None, None, mean, invstd, True, ctx.eps, [True, True, True])
        gx = gx4.squeeze(-1).squeeze(0).t()
        if not gx.is_contiguous():
            gx = gx.contiguous()
        k = w * invstd * (1.0 / lay.P - 1.0 / n)
        c1 = k * invstd * gw
        c0 = k * gb - mean * c1
        gx = gx.addcmul_(xc, c1.unsqueeze(0)).add_(c0.unsqueeze(0))
        gaps = lay.indices(gx.device)[2]
        if gaps.numel():
            gx.index_fill_(0, gaps, 0.0)
        return gx, (gw if weight is not None and ctx.needs_input_grad[1] else None), (gb if ctx.needs_input_grad[2] else None), None, None


def update_running(running_mean, running_var, mean: Tensor, var: Tensor, n: int, momentum: float) -> None:
    """Torch's running-statistics update (unbiased variance over the ``n`` real pixels)."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(var.to(running_var.dtype) * (n / max(n - 1, 1)), alpha=momentum)

