"""Spatial plans: where every output pixel's window lies and how the dense work is batched.

Convolution and pooling on images ``(C, H_i, W_i)`` of different sizes run the native
dense kernel once on a few dense *blocks* built from the packed pixel rows, then take
the valid outputs back as packed rows. A :class:`SpatialPlan` holds that decision for
one image structure and one layer geometry (kernel, stride, padding, dilation,
ceil mode, transposed or not); it is built once from host metadata and cached.

Two block layouts are built here (``benchmarks/vision.py --designs`` measures them):

* ``"canvas"`` (the default): every image is placed on one shared canvas, inside a box
  that holds its zero padding and every window it reads; boxes are shelf-packed
  (tallest first), their origins aligned to the stride, so the canvas output pixel
  ``(Y/s + a, X/s + b)`` is exactly output pixel ``(a, b)`` of the image whose box starts
  at ``(Y, X)``. Gaps between images are the padding (fill value), so no window
  crosses into another image. Every input row lands on the canvas exactly once: each
  image is one strided copy into a filled NCHW buffer, and its gradient the copy back. Two images ``A`` (2x3) and ``B`` (2x2), 3x3 kernel, padding 1::

      . . . . . . . . .        '.' = fill (zero, or -inf for max pooling)
      . A A A . . B B .        box of A: 4x5 at (0, 0): its pixels, padding, windows
      . A A A . . B B .        box of B: 4x4 at (0, 5)
      . . . . . . . . .        a 3x3 window of A never reaches a pixel of B

* ``"tiles"``: equal output tiles ``t x t`` with their receptive-field halo gathered
  into a batch of small blocks (halo pixels are duplicated, so the gradient is an
  ``index_add``).

Both never allocate the batch-wide padded envelope. Measured on CPU
(``benchmarks/vision.py --designs``, ResNet-style train step, 12 images of sides
U[48, 216]): canvas 1.33x the padded batch, tiles 1.04x, so the canvas is the default;
the tiles layout stays for measurement. A lone 64-channel 3x3 convolution on small
images is still faster as a per-image loop (canvas 0.82x of it): the canvas pays
about five copies of the activation per layer (in, out, and three in backward).

Layout of a plan, canvas ``(N, Hb, Wb)`` with ``N = 1``::

    place   (T_in,)   canvas position of every input row            (index_copy target)
    gather  (N*Hb*Wb,) source row of every block position, T_in = fill (tiles only)
    take    (T_out,)  position in the flat block output of every output row

The Collator can build a batch's first-layer plan in its worker with
:func:`build_spatial_plan`; the plan travels with the batch's metadata.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.host import host_structure
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _fmt_shape, _is_traced
from padless.tensor.errors import StructureError

__all__ = ["Geometry", "SpatialPlan", "build_spatial_plan", "spatial_plan", "image_hw", "images_like"]

Pair = tuple[int, int]
LAYOUTS = ("canvas", "tiles")
DEFAULT_LAYOUT = "canvas"
TILE = 8  # output tile side of the "tiles" layout
RECT_LIMIT = 64  # up to this many images, canvas moves are per-image rectangle copies


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One layer's window geometry (2-D; 1-D ops use a height of 1).

    ``padding`` is ``(top, bottom, left, right)``. ``transposed`` layers read
    ``output_padding``; ``ceil_mode`` is for pooling.
    """

    kernel: Pair
    stride: Pair = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: Pair = (1, 1)
    ceil_mode: bool = False
    transposed: bool = False
    output_padding: Pair = (0, 0)

    @property
    def extent(self) -> Pair:
        """Dilated kernel extent ``d*(k-1)+1`` per axis."""
        return tuple(d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel))  # type: ignore[return-value]

    def out_hw(self, hw: Tensor) -> Tensor:
        """Output ``(oh, ow)`` of every image (``<= 0`` where the image is too small)."""
        cols = []
        for ax in range(2):
            n = hw[:, ax]
            k, s, e = self.kernel[ax], self.stride[ax], self.extent[ax]
            p0, p1 = self.padding[2 * ax], self.padding[2 * ax + 1]
            if self.transposed:
                cols.append((n - 1) * s - p0 - p1 + e + self.output_padding[ax])
                continue
            num = n + p0 + p1 - e
            if self.ceil_mode:
                o = torch.div(num + s - 1, s, rounding_mode="floor") + 1
                o = torch.where((o - 1) * s >= n + p0, o - 1, o)
            else:
                o = torch.div(num, s, rounding_mode="floor") + 1
            cols.append(o.clamp_min(0))  # <= 0: torch refuses the image (too small)
        return torch.stack(cols, 1)


@dataclasses.dataclass
class SpatialPlan:
    """Blocks, input placement and output take of one layer on one image structure."""

    geometry: Geometry
    layout: str
    in_hw: Tensor  # (B, 2) host
    out_hw: Tensor  # (B, 2) host
    out_offsets: Tensor  # (B+1,) host
    too_small: list[int]  # images whose output is empty where torch refuses them
    blocks: tuple[int, int, int]  # (N, Hb, Wb) dense input blocks
    out_blocks: tuple[int, int, int]  # (N, Ho, Wo) native output of the blocks
    place: Tensor | None  # (T_in,) canvas position of every input row, or None
    gather: Tensor | None  # (N*Hb*Wb,) source row per block position (T_in = fill), or None
    take: Tensor  # (T_out,) flat block-output position of every output row
    cache: "SpatialCache | None" = None  # the output structure's cache (shared plans)
    _divisors: dict = dataclasses.field(default_factory=dict)

    in_rects: list[tuple[int, int, int, int, int]] | None = None  # (row offset, y, x, h, w) per image
    out_rects: list[tuple[int, int, int, int, int]] | None = None  # the same on the output canvas

    # The four moves between packed rows and blocks. With rectangles (a canvas of a few
    # images) each image is one strided copy of contiguous pixel runs; otherwise (tiles,
    # or many small samples) one index op over all rows.

    def to_blocks(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """Packed rows ``(T_in, C)`` -> dense blocks ``(N, C, Hb, Wb)``, contiguous (NCHW: on
        CPU a batch-of-one channels-last convolution runs about half as fast)."""
        n, hb, wb = self.blocks
        c = values.shape[1]
        if self.in_rects is not None:
            buf = values.new_full((n, c, hb, wb), fill)
            _copy_rects(buf[0], values, self.in_rects, to_canvas=True)
            return buf
        if self.place is not None:
            flat = values.new_full((n * hb * wb, c), fill).index_copy(0, self.place, values)
        else:
            ext = torch.cat([values, values.new_full((1, c), fill)])
            flat = ext.index_select(0, self.gather)  # type: ignore[arg-type]
        return flat.view(n, hb, wb, c).permute(0, 3, 1, 2).contiguous()

    def rows_of_blocks(self, gb: Tensor, rows: int) -> Tensor:
        """Adjoint of :meth:`to_blocks`: block gradients ``(N, C, Hb, Wb)`` -> row gradients ``(rows, C)``."""
        if self.in_rects is not None:
            out = gb.new_empty((rows, gb.shape[1]))
            _copy_rects(gb[0], out, self.in_rects, to_canvas=False)
            return out
        flat = gb.permute(0, 2, 3, 1).reshape(-1, gb.shape[1])
        if self.place is not None:
            return flat.index_select(0, self.place)
        out = flat.new_zeros((rows + 1, flat.shape[1])).index_add_(0, self.gather, flat)  # type: ignore[arg-type]
        return out[:rows]

    def blocks_of_rows(self, g: Tensor) -> Tensor:
        """Adjoint of :meth:`from_blocks`: output-row gradients ``(T_out, O)`` -> ``(N, O, Ho, Wo)``."""
        n, ho, wo = self.out_blocks
        if self.out_rects is not None:
            buf = g.new_zeros((n, g.shape[1], ho, wo))
            _copy_rects(buf[0], g, self.out_rects, to_canvas=True)
            return buf
        buf = g.new_zeros((n * ho * wo, g.shape[1])).index_copy_(0, self.take, g)
        return buf.view(n, ho, wo, g.shape[1]).permute(0, 3, 1, 2).contiguous()

    def from_blocks(self, y: Tensor) -> Tensor:
        """Native output ``(N, O, Ho, Wo)`` -> packed output rows ``(T_out, O)``."""
        if self.out_rects is not None:
            out = y.new_empty((int(self.out_offsets[-1]), y.shape[1]))
            _copy_rects(y[0], out, self.out_rects, to_canvas=False)
            return out
        return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1]).index_select(0, self.take)

    def avg_divisor(self, include_pad: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Per output row, the element count ``F.avg_pool2d`` divides that window's sum by."""
        key = (include_pad, dtype, device)
        hit = self._divisors.get(key)
        if hit is not None:
            return hit
        g = self.geometry
        _, sid, a, b = _coords(self.out_hw)
        counts = []
        for ax, o in enumerate((a, b)):
            n = self.in_hw[sid, ax]
            p0 = g.padding[2 * ax]
            start = o * g.stride[ax] - p0
            end = torch.minimum(start + g.kernel[ax], n + g.padding[2 * ax + 1])
            size = end - start
            start, end = start.clamp_min(0), torch.minimum(end, n)
            counts.append(size if include_pad else end - start)
        div = (counts[0] * counts[1]).to(dtype).to(device).unsqueeze(1)
        self._divisors[key] = div
        return div


def _copy_rects(canvas: Tensor, rows: Tensor, rects: list[tuple[int, int, int, int, int]], to_canvas: bool) -> None:
    """Copy every image between its packed rows ``(h*w, C)`` and its rectangle of ``canvas`` ``(C, H, W)``."""
    for off, y, x, h, w in rects:
        block = rows[off : off + h * w].view(h, w, rows.shape[1]).permute(2, 0, 1)
        if to_canvas:
            canvas[:, y : y + h, x : x + w].copy_(block)
        else:
            block.copy_(canvas[:, y : y + h, x : x + w])


class RowsToBlocks(torch.autograd.Function):
    """:meth:`SpatialPlan.to_blocks` with its adjoint as the backward (nothing saved but the plan)."""

    @staticmethod
    def forward(ctx, values: Tensor, plan: SpatialPlan, fill: float) -> Tensor:  # type: ignore[override]
        ctx.plan, ctx.rows = plan, values.shape[0]
        return plan.to_blocks(values, fill)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return ctx.plan.rows_of_blocks(g, ctx.rows), None, None


class BlocksToRows(torch.autograd.Function):
    """:meth:`SpatialPlan.from_blocks` with its adjoint as the backward."""

    @staticmethod
    def forward(ctx, y: Tensor, plan: SpatialPlan) -> Tensor:  # type: ignore[override]
        ctx.plan = plan
        return plan.from_blocks(y)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        return ctx.plan.blocks_of_rows(g.contiguous()), None


class SpatialCache:
    """Everything spatial shared by the batches of one image-size structure: plans by
    geometry, and the NestedTensor structures of those images at each channel count.
    Found again through the sizes (a weak table), so two branches of a network that reach
    the same sizes (a residual block and its projection) share one structure."""

    __slots__ = ("hw", "host_offsets", "ragged", "plans", "structures", "__weakref__")

    def __init__(self, hw: Tensor, host_offsets: Tensor, ragged: tuple[int, ...]) -> None:
        self.hw = hw
        self.host_offsets = host_offsets
        self.ragged = ragged
        self.plans: dict[Any, SpatialPlan] = {}
        self.structures: dict[Any, tuple] = {}


_CACHES: "weakref.WeakValueDictionary[Any, SpatialCache]" = weakref.WeakValueDictionary()
_KEY = "spatial"


def image_hw(op: str, nt: NestedTensor) -> tuple[Tensor, Tensor]:
    """Host ``(H_i, W_i)`` ``(B, 2)`` and row offsets of images ``(C, H_i, W_i)``; ``(C, L_i)``
    samples are images of height 1. Other layouts raise, naming the op."""
    if not isinstance(nt, NestedTensor):
        raise TypeError(f"{op}(): expected a NestedTensor of images, got {type(nt).__name__}")
    hs, ho = host_structure(nt, op)
    if nt.sample_dim == 3 and nt._ragged in ((1, 2),):
        return hs[:, 1:], ho
    if nt.sample_dim == 2 and nt._ragged == (1,):
        return torch.stack([torch.ones_like(hs[:, 1]), hs[:, 1]], 1), ho
    want = "sequences (C, L_i) with ragged dim 1" if nt.sample_dim == 2 else "images (C, H_i, W_i) with ragged sample dims (1, 2) stored in that order"
    raise StructureError(
        f"{op}(): expected {want}, got samples of rank {nt.sample_dim} with ragged sample dims stored as "
        f"{nt._ragged} (envelope {tuple(nt.shape)}). Declare both spatial dims ragged when packing, even if the "
        "sizes of this batch agree along one (padless.from_list(images, ragged_dims=(1, 2))), and put the "
        "channels first (x.permute(0, 3, 1, 2) for channel-last images)."
    )


def _cache_of(op: str, nt: NestedTensor) -> SpatialCache:
    if not isinstance(nt, NestedTensor):
        raise TypeError(f"{op}(): expected a NestedTensor of images, got {type(nt).__name__}")
    hit = nt._meta.derived.get(_KEY)
    if hit is not None:
        return hit
    hw, ho = image_hw(op, nt)
    key = (nt._ragged, hw.numpy().tobytes(), ho.numpy().tobytes())
    cache = _CACHES.get(key)
    if cache is None:
        cache = SpatialCache(hw, ho, nt._ragged)
        _CACHES[key] = cache
    if not _is_traced(nt._values):
        nt._meta.derived[_KEY] = cache
    return cache


def _cache_for(hw: Tensor, offsets: Tensor, ragged: tuple[int, ...]) -> SpatialCache:
    key = (ragged, hw.numpy().tobytes(), offsets.numpy().tobytes())
    cache = _CACHES.get(key)
    if cache is None:
        cache = SpatialCache(hw, offsets, ragged)
        _CACHES[key] = cache
    return cache


def images_like(values: Tensor, channels: int, cache: SpatialCache, like: NestedTensor) -> NestedTensor:
    """A NestedTensor of images with ``cache``'s sizes and ``channels`` channels around
    ``values`` (autograd kept). One structure object per (sizes, channels, device)."""
    from padless.tensor.autograd import nested_from_values
    from padless.tensor.core import envelope_from_sizes

    dev = like._offsets.device
    key = (channels, dev)
    hit = cache.structures.get(key)
    if hit is None:
        hw = cache.hw
        if cache.ragged == (1,):
            hs = torch.stack([torch.full_like(hw[:, 1], channels), hw[:, 1]], 1)
        else:
            hs = torch.cat([torch.full_like(hw[:, :1], channels), hw], 1)
        meta = StructureMeta(hs, cache.host_offsets)
        meta.derived[_KEY] = cache
        on_cpu = dev.type == "cpu"
        offsets = cache.host_offsets if on_cpu else cache.host_offsets.to(dev, non_blocking=True)
        sizes = hs if on_cpu else hs.to(dev, non_blocking=True)
        env = envelope_from_sizes(hs, cache.ragged, (channels,))
        hit = (offsets, sizes, meta, env)
        cache.structures[key] = hit
    offsets, sizes, meta, env = hit
    return nested_from_values(values, offsets, sizes, cache.ragged, env, meta)


# ------------------------------------------------------------------ packing


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _shelf_pack(boxes: list[Pair], align: Pair) -> tuple[list[Pair], int, int]:
    """Shelf-pack boxes ``(h, w)`` (tallest first) onto one canvas; origins aligned.

    Tries a few canvas widths and keeps the smallest area. Boxes of zero area get no room.
    Returns the origin of every box, and the canvas height and width.
    """
    ah, aw = align
    order = sorted(range(len(boxes)), key=lambda i: -boxes[i][0])
    live = [i for i in order if boxes[i][0] > 0 and boxes[i][1] > 0]
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    widths = [_align(boxes[i][1], aw) for i in range(len(boxes))]
    wmin = max(widths[i] for i in live)
    area = sum(_align(boxes[i][0], ah) * widths[i] for i in live)
    cands = {wmin, sum(widths[i] for i in live)}
    for f in (0.8, 1.0, 1.25, 1.5, 2.0, 3.0):
        cands.add(max(wmin, _align(int(math.sqrt(area) * f), aw)))
    best = None
    for wc in sorted(cands):
        pos = [(0, 0)] * len(boxes)
        x = y = shelf = used = 0
        for i in live:
            if x + widths[i] > wc and x > 0:
                y += _align(shelf, ah)
                x = shelf = 0
            pos[i] = (y, x)
            x += widths[i]
            used = max(used, x)
            shelf = max(shelf, boxes[i][0])
        hc = y + shelf
        if best is None or hc * used < best[1] * best[2]:
            best = (pos, hc, used)
    return best  # type: ignore[return-value]


def _coords(hw: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row offsets and per-row ``(sample, row, col)`` of images with sizes ``hw``."""
    off = layout.offsets_from_counts(hw.prod(1))
    sid, (a, b) = layout.row_coords(hw, off, (0, 1), int(off[-1]))
    return off, sid, a, b


def _grid_index(base: Tensor, hw: Tensor, row_stride: int) -> Tensor:
    """``base[i] + r * row_stride + c`` for every pixel ``(r, c)`` of every image, row-major
    per image, images in order: the flat position of each packed row on a canvas."""
    if hw.shape[0] > 64:  # many small samples (sequences): one vectorised pass
        _, sid, a, b = _coords(hw)
        return base[sid] + a * row_stride + b
    parts = [
        (int(base[i]) + torch.arange(h).unsqueeze(1) * row_stride + torch.arange(w)).flatten()
        for i, (h, w) in enumerate(hw.tolist())
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _canvas(g: Geometry, hw: Tensor, ohw: Tensor) -> tuple:
    h, w = hw[:, 0].tolist(), hw[:, 1].tolist()
    oh, ow = ohw[:, 0].tolist(), ohw[:, 1].tolist()
    (kh, kw), (sh, sw), (eh, ew) = g.kernel, g.stride, g.extent
    pt, pb, pl, pr = g.padding
    boxes = []
    for i in range(len(h)):
        if oh[i] <= 0 or ow[i] <= 0:
            boxes.append((0, 0))
        elif g.transposed:  # in input units: the scattered footprint and the output window
            boxes.append((-(-max((h[i] - 1) * sh + eh, pt + oh[i]) // sh), -(-max((w[i] - 1) * sw + ew, pl + ow[i]) // sw)))
        else:
            boxes.append((max(pt + h[i], (oh[i] - 1) * sh + eh), max(pl + w[i], (ow[i] - 1) * sw + ew)))
    align = (1, 1) if g.transposed else (sh, sw)
    pos, hc, wc = _shelf_pack(boxes, align)
    if g.transposed:
        hc, wc = hc + 1, wc + 1  # one more input row/col so the output reaches the last box's end
        ho, wo = (hc - 1) * sh + eh, (wc - 1) * sw + ew
    else:
        hc, wc = max(hc, eh), max(wc, ew)
        ho, wo = (hc - eh) // sh + 1, (wc - ew) // sw + 1
    y0 = torch.tensor([p[0] for p in pos], dtype=torch.int64)
    x0 = torch.tensor([p[1] for p in pos], dtype=torch.int64)
    if g.transposed:
        place = _grid_index(y0 * wc + x0, hw, wc)
        take = _grid_index((y0 * sh + pt) * wo + x0 * sw + pl, ohw, wo)
    else:
        place = _grid_index((y0 + pt) * wc + x0 + pl, hw, wc)
        take = _grid_index((y0 // sh) * wo + x0 // sw, ohw, wo)
    rects = None
    if len(pos) <= RECT_LIMIT:
        ioff = layout.offsets_from_counts(hw.prod(1)).tolist()
        ooff = layout.offsets_from_counts(ohw.prod(1)).tolist()
        py, px = (0, 0) if g.transposed else (pt, pl)
        ys, xs = y0.tolist(), x0.tolist()
        live = [i for i in range(len(pos)) if oh[i] > 0 and ow[i] > 0]
        if g.transposed:
            orect = [(ooff[i], ys[i] * sh + pt, xs[i] * sw + pl, oh[i], ow[i]) for i in live]
        else:
            orect = [(ooff[i], ys[i] // sh, xs[i] // sw, oh[i], ow[i]) for i in live]
        rects = ([(ioff[i], ys[i] + py, xs[i] + px, h[i], w[i]) for i in live], orect)
    return (1, hc, wc), (1, ho, wo), place, None, take, rects


def _tiles(g: Geometry, hw: Tensor, ohw: Tensor) -> tuple:
    (sh, sw), (eh, ew) = g.stride, g.extent
    pt, _, pl, _ = g.padding
    t = TILE
    th = torch.div(ohw[:, 0] + t - 1, t, rounding_mode="floor").clamp_min(0)
    tw = torch.div(ohw[:, 1] + t - 1, t, rounding_mode="floor").clamp_min(0)
    tw = torch.where(th > 0, tw, torch.zeros_like(tw))
    th = torch.where(tw > 0, th, torch.zeros_like(th))
    tgrid = torch.stack([th, tw], 1)
    toff, tsid, ty, tx = _coords(tgrid)
    n = int(toff[-1])
    hb, wb = (t - 1) * sh + eh, (t - 1) * sw + ew
    in_off = layout.offsets_from_counts(hw.prod(1))
    total_in = int(in_off[-1])
    u = torch.arange(hb).view(1, hb, 1)
    v = torch.arange(wb).view(1, 1, wb)
    r = (ty * t * sh - pt).view(n, 1, 1) + u
    c = (tx * t * sw - pl).view(n, 1, 1) + v
    hh, ww = hw[tsid, 0].view(n, 1, 1), hw[tsid, 1].view(n, 1, 1)
    inside = (r >= 0) & (r < hh) & (c >= 0) & (c < ww)
    src = in_off[tsid].view(n, 1, 1) + r.clamp_min(0) * ww + c.clamp_min(0)
    gather = torch.where(inside, src, torch.full_like(src, total_in)).reshape(-1)
    _, osid, oa, ob = _coords(ohw)
    tile = toff[osid] + torch.div(oa, t, rounding_mode="floor") * tw[osid] + torch.div(ob, t, rounding_mode="floor")
    take = tile * t * t + (oa % t) * t + ob % t
    return (n, hb, wb), (n, t, t), None, gather, take, None


def _new_plan(cache: SpatialCache, g: Geometry, layout_name: str, device: torch.device) -> SpatialPlan:
    hw = cache.hw
    ohw = g.out_hw(hw)
    nonempty = (hw[:, 0] > 0) & (hw[:, 1] > 0)
    too_small = ((ohw[:, 0] <= 0) | (ohw[:, 1] <= 0) | ~nonempty).nonzero().flatten().tolist()
    ohw = ohw.clamp_min(0)
    for i in too_small:
        ohw[i] = 0
    if layout_name == "tiles" and not g.transposed:
        parts = _tiles(g, hw, ohw)
    elif layout_name in LAYOUTS:
        parts = _canvas(g, hw, ohw)
    else:
        raise ValueError(f"spatial plan: layout must be one of {LAYOUTS}, got {layout_name!r}")
    blocks, out_blocks, place, gather, take, rects = parts
    out_off = layout.offsets_from_counts(ohw.prod(1))

    def dev(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return SpatialPlan(
        g, layout_name, hw, ohw, out_off, too_small, blocks, out_blocks, dev(place), dev(gather), dev(take),  # type: ignore[arg-type]
        _cache_for(ohw, out_off, cache.ragged), in_rects=rects[0] if rects else None, out_rects=rects[1] if rects else None,
    )


def spatial_plan(op: str, nt: NestedTensor, g: Geometry, layout_name: str | None = None) -> SpatialPlan:
    """The cached plan of geometry ``g`` on ``nt``'s images (built on first use)."""
    cache = _cache_of(op, nt)
    lay = layout_name or DEFAULT_LAYOUT
    dev = nt._values.device
    key = (g, lay, dev)
    plan = cache.plans.get(key)
    if plan is None:
        plan = _new_plan(cache, g, lay, dev)
        cache.plans[key] = plan
    return plan


def too_small_error(op: str, plan: SpatialPlan, channels: int, dense_call) -> Exception | None:
    """Torch's own error for the first image the layer cannot run on, naming the image.

    ``dense_call(t)`` runs the dense op on a meta tensor ``t`` of one image's batched shape;
    torch's message for that image is kept. ``None`` when every image is large enough.
    """
    for i in plan.too_small:
        hh, ww = (int(v) for v in plan.in_hw[i])
        shape = (channels, hh, ww) if plan.cache is None or plan.cache.ragged != (1,) else (channels, ww)
        try:
            dense_call(torch.empty((1, *shape), device="meta"))
        except Exception as e:  # torch's message for this image alone
            return type(e)(f"{op}(): image {i} of shape {_fmt_shape(list(shape))} is too small for this layer: {e}")
        if plan.in_hw[i].prod() == 0 and plan.out_hw[i].prod() == 0:
            continue  # an empty image torch accepts gives an empty output: nothing to do
        return StructureError(f"{op}(): image {i} of shape {_fmt_shape(list(shape))} gives an empty output")
    return None


def build_spatial_plan(
    nt: NestedTensor,
    kernel: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    *,
    ceil_mode: bool = False,
    layout_name: str | None = None,
) -> SpatialPlan:
    """Build (and cache on ``nt``'s structure) the plan of one convolution or pooling layer.

    For the Collator: call it in the DataLoader worker on the collated image batch with the
    first layer's geometry, and the layer finds the plan ready. ``padding`` is an int, a pair
    ``(ph, pw)`` or ``(top, bottom, left, right)``.

    >>> x = padless.from_list([torch.randn(3, 20, 30), torch.randn(3, 9, 7)])
    >>> p = build_spatial_plan(x, 7, 2, 3)
    >>> p.out_hw.tolist()
    [[10, 15], [5, 4]]
    """
    g = Geometry(to_pair("build_spatial_plan", "kernel", kernel), to_pair("build_spatial_plan", "stride", stride),
                 to_padding("build_spatial_plan", padding), to_pair("build_spatial_plan", "dilation", dilation), ceil_mode)
    return spatial_plan("build_spatial_plan", nt, g, layout_name)


def to_pair(op: str, name: str, v: Any, *, minimum: int = 1) -> Pair:
    """An int or a 2-sequence of ints ``>= minimum`` as a pair (errors name the op and argument)."""
    t = (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list, torch.Size)) else None
    if t is not None and len(t) == 1:
        t = (t[0], t[0])
    if t is None or len(t) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in t):
        raise ValueError(f"{op}(): {name} must be an int >= {minimum} or a pair of them, got {v!r}")
    return t  # type: ignore[return-value]


def to_padding(op: str, v: Any) -> tuple[int, int, int, int]:
    """``p``, ``(ph, pw)`` or ``(top, bottom, left, right)`` as ``(top, bottom, left, right)``."""
    if isinstance(v, (tuple, list)) and len(v) == 4 and all(isinstance(x, int) and x >= 0 for x in v):
        return tuple(v)  # type: ignore[return-value]
    ph, pw = to_pair(op, "padding", v, minimum=0)
    return (ph, ph, pw, pw)


def conv_padding(op: str, padding: Any, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    """A convolution's ``padding`` (``'same'``, ``'valid'``, an int or a pair) as ``(top, bottom, left, right)``."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        if stride != (1, 1):
            raise ValueError(f"{op}(): padding='same' is not supported for strided convolutions (stride {stride})")
        pads = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)  # type: ignore[return-value]
    if isinstance(padding, str):
        raise ValueError(f"{op}(): padding must be 'same', 'valid', an int or a pair of ints, got {padding!r}")
    return to_padding(op, padding)
