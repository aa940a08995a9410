"""The persistent canvas: image activations that stay in the canvas layout between layers.

``channels_last`` is a second layout of a dense tensor; the canvas is a second layout of a
NestedTensor of images ``(C, H_i, W_i)``. The images lie on one shared channels-last plane
``(P, C)`` (``P = Hc * Wc`` positions), each at an origin aligned to 2, with zero gaps of at
least ``gap`` pixels after every image (below and to the right; the plane's own top and left
edges are the native kernel's zero padding). Two images ``A`` (2x3) and ``B`` (2x2), gap 1::

    A A A . B B .        '.' = gap: zero between layers
    A A A . B B .
    . . . . . . .

On this plane a convolution or pooling window of padding ``<= gap`` never reaches another
image, so the native kernel runs on the plane as it is:

* a stride-1 layer whose output has the input's size (a "same" convolution) writes its output
  at the same positions: the output is a canvas of the same layout, nothing moves;
* a strided layer (origins aligned to the stride) writes image ``i``'s output at ``origin / s``
  of the native output plane; one gather re-lays it onto the standard canvas of the output
  sizes (an index cached per structure and geometry);
* batch norm takes its statistics over the real pixels (the gaps are zero, so the plane's sums
  are the images' sums; the variance's gap term ``(P - N) mean^2`` is taken off exactly);
  ReLU and the sum of two canvases of one layout run on the plane (both keep zero gaps).

Invariants (forward and backward): a canvas's gaps are zero, and the gradient arriving at a
canvas is zero in its gaps. Ops whose output gaps are not zero (a convolution's halo, batch
norm's shift) zero them in place on their fresh output (one ``index_fill_`` over the gap
positions, not a copy); their backward zeroes the gaps of the input gradient the same way.

Entering: a convolution or max pool whose input is rows (the images into the stem) runs on its
layer's :class:`~padless.ops.vision.spatial.SpatialPlan` canvas (which the Collator may have built
in its worker) and re-lays its output onto the standard canvas of the output sizes.

Rows: :class:`CanvasImages` is a NestedTensor whose packed rows are gathered only when an op
without a canvas rule reads them (attention, a per-pixel loss, ``unbind``, a global pool): one
gather with an index cached on the layout, whose backward puts the row gradient back on the
canvas. An in-place op on a canvas tensor first gathers its rows and leaves the canvas.

Off by default (``CANVAS_PERSIST``): on the CPU it is slower than rows between layers
(``benchmarks/vision.py --designs``, one thread, widths 16..128: 1.48x padded against the rows
design's 1.86x in one run, 0.8-0.97x of the rows design's time ratio over several; the same batch
repeated, min of 8: 0.89-0.92x at widths 16..128, 0.91-0.97x at ResNet-18 widths). Its aten ops
take less time (profiled: 50.0 against 52.3 ms a step; 3.7 against 6.0 ms of ``index_select``)
but the plane holds 1.2x (stem) to 1.5x (last stage) the pixels, so batch norm, ReLU and the
adds do that much more work, batch norm over the real pixels takes two more passes and a dozen
small ops more than torch's kernel, and every op pays for one more autograd node. Saved
activations: 27.9 against 19.7 MiB. Where a gather costs more than a pass over the plane (a
launch-bound GPU) it is the design to measure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from padless.ops.vision.pack import grid_index, grid_sources, pack_boxes, plane_side
from padless.tensor.core import NestedTensor

__all__ = ["CANVAS_PERSIST", "CanvasImages", "CanvasLayout", "canvas_of", "from_relu", "layout_for", "wrap_canvas"]

CANVAS_PERSIST = False  # measured no faster than rows between layers on the CPU (module docstring); --designs
GAP = 1  # the standard canvas's gap: the halo of a 3x3 window
ALIGN = 2  # origins aligned to 2: a stride-2 layer reads the canvas as it is


class CanvasLayout:
    """Where every image of one structure lies on a canvas (host ints), with the cached indices:
    ``place`` (the canvas position of every packed row), ``src`` (the row of every canvas
    position, 0 in the gaps) and ``gaps`` (the gap positions), per device."""

    def __init__(self, hw: list[tuple[int, int]], gap: int, align: int) -> None:
        self.hw, self.gap, self.align = hw, gap, align
        boxes = [(h + gap, w + gap) if h > 0 and w > 0 else (0, 0) for h, w in hw]
        pos, hc, wc = pack_boxes(boxes, (align, align))
        self.origins = pos
        self.hc, self.wc = plane_side(max(hc, 1)), plane_side(max(wc, 1))
        self.P = self.hc * self.wc
        self.N = sum(h * w for h, w in hw)
        self.bases = [y * self.wc + x for y, x in pos]
        self.live = [b[0] > 0 for b in boxes]
        self._dev: dict[Any, Any] = {}
        self.relays: dict[Any, Any] = {}  # geometry -> the strided layer's output re-lay (canvas.relay)

    def indices(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``(place, src, gaps)`` on ``device`` (built once)."""
        hit = self._dev.get(device)
        if hit is None:
            place = grid_index(self.bases, self.hw, self.wc)
            src = grid_sources(self.bases, self.hw, self.wc, self.P, self.live, -1)
            gaps = np.flatnonzero(src < 0)
            src[gaps] = 0
            hit = tuple(torch.from_numpy(a).to(device) for a in (place, src, gaps))
            self._dev[device] = hit
        return hit  # type: ignore[return-value]

    def fits(self, pad: tuple[int, int], stride: tuple[int, int]) -> bool:
        """Whether a window of padding ``pad`` and ``stride`` reads this canvas as it is."""
        return max(pad) <= self.gap and self.align % stride[0] == 0 and self.align % stride[1] == 0


def layout_for(cache, device: torch.device, gap: int = GAP, align: int = ALIGN) -> CanvasLayout:
    """The canvas layout of a structure (its :class:`~padless.ops.vision.spatial.SpatialCache`)."""
    key = ("canvas", gap, align)
    hit = cache.plans.get(key)
    if hit is None:
        hit = CanvasLayout([tuple(r) for r in cache.hw.tolist()], gap, align)
        cache.plans[key] = hit
    return hit


# ------------------------------------------------------------------ rows <-> canvas


def _to_canvas(v: Tensor, lay: CanvasLayout, fill: float = 0.0) -> Tensor:
    """Packed rows ``(T, C)`` -> canvas ``(P, C)``, gaps ``fill`` (one gather, the gaps filled in place)."""
    _, src, gaps = lay.indices(v.device)
    if v.shape[0] == 0:
        return v.new_full((lay.P, v.shape[1]), fill)
    out = v.index_select(0, src)
    return out.index_fill_(0, gaps, fill) if gaps.numel() else out


# ------------------------------------------------------------------ the tensor


class CanvasImages(NestedTensor):
    """A NestedTensor of images ``(C, H_i, W_i)`` held on a canvas; its rows are gathered on
    first read (see the module docstring). Ops with a canvas rule read :func:`canvas_of`."""

    @property
    def _values(self) -> Tensor:  # type: ignore[override]
        d = self.__dict__
        v = d.get("_vals")
        if v is None:
            xc, lay = d["_lazy"]
            v = xc.index_select(0, lay.indices(xc.device)[0])  # no history: values_of links it to the canvas
            d["_vals"] = v
        return v

    @_values.setter
    def _values(self, v: Tensor) -> None:
        self.__dict__["_vals"] = v

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            out = rule(args, kwargs)
            if out is not NotImplemented:
                return out
        name = getattr(func, "__name__", "")
        if kwargs.get("inplace") or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name in ("__setitem__", "__set__"):
            for a in args:  # an in-place op: the tensor leaves the canvas (its rows are what it writes)
                if isinstance(a, CanvasImages):
                    a._values  # noqa: B018  (gathered from the canvas before it is dropped)
                    a.__dict__["_canvas"] = None
        return super().__torch_function__(func, types, args, kwargs)


def from_relu(x: Any) -> bool:
    """Whether canvas tensor ``x`` is a ReLU's output: its values are ``>= 0``, and the gradient
    its backward sends to the gaps is zero whatever arrives (the gaps hold 0, where ReLU's
    derivative is 0)."""
    return type(x) is CanvasImages and bool(x.__dict__.get("_relu"))


def canvas_of(x: Any) -> tuple[Tensor, CanvasLayout] | None:
    """``(canvas (P, C) with its autograd history, layout)`` of a canvas tensor, else ``None``."""
    if type(x) is CanvasImages:
        return x.__dict__.get("_canvas")
    return None


class _CanvasView(torch.autograd.Function):
    """Canvas ``(P, C)`` -> :class:`CanvasImages` (rows not gathered); backward: the rows'
    gradient back on the canvas."""

    @staticmethod
    def forward(ctx, xc: Tensor, lay: CanvasLayout, struct: tuple) -> NestedTensor:  # type: ignore[override]
        ctx.lay = lay
        return _make(xc, lay, struct)  # keeps xc itself (its history): the canvas rules read it

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        rows = g._values if isinstance(g, NestedTensor) else g
        return _to_canvas(rows.contiguous(), ctx.lay), None, None


def _make(xc: Tensor, lay: CanvasLayout, struct: tuple) -> CanvasImages:
    offsets, sizes, meta, env, ragged = struct
    out = NestedTensor.__new__(CanvasImages, xc, offsets, sizes, ragged, env, meta)
    d = out.__dict__
    d["_vals"] = None
    d["_lazy"] = (xc.detach(), lay)
    d["_canvas"] = (xc, lay)
    return out


def wrap_canvas(xc: Tensor, lay: CanvasLayout, channels: int, cache, like: NestedTensor) -> CanvasImages:
    """A :class:`CanvasImages` of ``cache``'s image sizes with ``channels`` channels on canvas ``xc``."""
    from padless.ops.vision.spatial import images_like

    hit = cache.structures.get((channels, like._offsets.device))
    if hit is None:  # built by images_like (one structure per sizes, channels and device)
        images_like(xc.new_zeros((int(cache.host_offsets[-1]), channels)), channels, cache, like)
        hit = cache.structures[(channels, like._offsets.device)]
    offsets, sizes, meta, env = hit
    struct = (offsets, sizes, meta, env, cache.ragged)
    if xc.requires_grad and torch.is_grad_enabled():
        return _CanvasView.apply(xc, lay, struct)
    return _make(xc, lay, struct)


# ------------------------------------------------------------------ pointwise rules


def _relu(args, kwargs):
    x = args[0]
    cv = canvas_of(x)
    if cv is None or kwargs.get("inplace") or len(args) > 1:
        return NotImplemented
    xc, lay = cv
    out = wrap_canvas(torch.relu(xc), lay, x._env[0], _cache(x), x)
    out.__dict__["_relu"] = True  # non-negative; its backward zeroes the gaps' gradient (relu'(0) = 0)
    return out


def _add(args, kwargs):
    if len(args) != 2 or kwargs.get("alpha", 1) != 1 or kwargs.get("out") is not None:
        return NotImplemented
    a, b = canvas_of(args[0]), canvas_of(args[1])
    if a is None or b is None or a[1] is not b[1] or a[0].shape != b[0].shape or a[0].dtype != b[0].dtype:
        return NotImplemented
    x = args[0]
    return wrap_canvas(a[0] + b[0], a[1], x._env[0], _cache(x), x)


def _cache(x: NestedTensor):
    from padless.ops.vision.spatial import _cache_of

    return _cache_of("canvas", x)


def _rules() -> dict:
    import torch.nn.functional as F

    out: dict = {}
    for f in (torch.relu, torch.Tensor.relu, F.relu):
        out[f] = _relu
    for f in (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__):
        out[f] = _add
    return out


_RULES = _rules()

