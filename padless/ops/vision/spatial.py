"""Spatial plans: where every output pixel's window lies and how the dense work is batched.

Convolution and pooling on images ``(C, H_i, W_i)`` of different sizes run the native
dense kernel once on a few dense *blocks* built from the packed pixel rows, then take
the valid outputs back as packed rows. A :class:`SpatialPlan` holds that decision for
one image structure and one layer geometry (kernel, stride, padding, dilation,
ceil mode, transposed or not); it is built once from host metadata and cached.

Two block layouts are built here (``benchmarks/vision.py --designs`` measures them):

* ``"canvas"`` (the default): every image is placed on one shared canvas, inside a box
  that holds its top and left padding (``pt + H_i`` by ``pl + W_i``); boxes are
  skyline-packed (tallest first, each at the lowest place it fits), their origins
  aligned to the stride, so the canvas output pixel ``(Y/s + a, X/s + b)`` is exactly
  output pixel ``(a, b)`` of the image whose box starts at ``(Y, X)``. Neighbours share
  their gaps: a window that reaches past its box (the bottom and right padding) lands in
  the top or left gap of whatever box lies there, or in empty canvas, so no window
  crosses into another image (any two boxes that do not overlap are separated along
  one axis, and the later box's pixels start ``pt`` rows / ``pl`` columns into it).
  Two images ``A`` (2x3) and ``B`` (2x2), 3x3 kernel, padding 1::

      . . . . . . . .        '.' = fill (zero, or -inf for max pooling)
      . A A A . B B .        box of A: 3x4 at (0, 0); box of B: 3x3 at (0, 4)
      . A A A . B B .        A's windows read column 4: B's left gap
      . . . . . . . .        one more row and column for the windows at the edges

  Canvases are channels-last, so every move between rows and canvas is one gather of
  whole rows with an index cached on the plan, whatever the number of images.

* ``"tiles"``: equal output tiles ``t x t`` with their receptive-field halo gathered
  into a batch of small blocks (halo pixels are duplicated, so the gradient is an
  ``index_add``).

Both never allocate the batch-wide padded envelope. Measured on CPU
(``benchmarks/vision.py --designs``, ResNet-18-width train step, 12 images of sides
U[48, 216], one thread): canvas 1.74x the padded batch, the same canvas in NCHW (a
transpose per move) 1.27x, tiles 1.32x, so the channels-last canvas is the default
(convolutions whose weight outweighs the canvas keep it NCHW: :func:`conv_channels_last`);
a lone 64-channel 3x3 convolution on small images runs 1.38x a per-image loop.

Layout of a plan, canvas ``(N, Hb, Wb)`` with ``N = 1``::

    place   (T_in,)   canvas position of every input row (built on first use; its inverse: the gather)
    gather  (N*Hb*Wb,) source row of every block position, T_in = fill (tiles only)
    take    (T_out,)  position in the flat block output of every output row
    grids   host ints: each image's origin on the input and output canvases (canvas only)

Every image's rows are a grid on the canvas (``origin + r * Wb + c``), so ``place`` and ``take``
and their inverses are built on the host by one numpy slice per image
(:func:`~padless.ops.vision.pack.grid_index`), well under a millisecond per layer for a
batch of a dozen images at 200 x 200.

The Collator can build a batch's first-layer plan in its worker with
:func:`build_spatial_plan`; the plan travels with the batch's metadata. With a network plan
recipe (:mod:`padless.ops.vision.recipe`, ``padless.vision.plan_recipe``) it builds every layer's
plans there, and their derived indices (``row_of_block``, the gap lists), so the first step of a
new batch builds none.

A batch of new image sizes runs on a canvas shape an earlier batch used when its boxes fit one at
most 15% larger (:func:`~padless.ops.vision.pack.reuse_plane`): oneDNN builds a convolution for
every new shape, and a first call costs about twice a call on a known shape.

Activations kept on one canvas between layers (batch norm, ReLU and adds on the canvas too) are
the opt-in design of :mod:`padless.ops.vision.canvas` (measured slower on the CPU, see there).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.ops.common.host import host_structure
from padless.ops.vision.pack import grid_index, grid_sources, pack_boxes, plane_side, reuse_plane
from padless.ops.vision.window_args import conv_padding, to_padding, to_pair  # noqa: F401  (re-exported)
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _fmt_shape, _is_traced
from padless.tensor.errors import StructureError

__all__ = ["Geometry", "SpatialPlan", "build_spatial_plan", "spatial_plan", "image_hw", "images_like"]

Pair = tuple[int, int]
LAYOUTS = ("canvas", "tiles")
DEFAULT_LAYOUT = "canvas"
TILE = 8  # output tile side of the "tiles" layout
_FILL_AFTER = 1 << 19  # rows.numel() from which a gather + index_fill_ of the gaps beats appending a fill row
CANVAS_FORMAT = "channels_last"  # or "contiguous" (NCHW canvases: a transpose per move), measured by --designs


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

    @functools.cached_property
    def extent(self) -> Pair:
        """Dilated kernel extent ``d*(k-1)+1`` per axis (computed once: plans read it per image)."""
        return tuple(d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel))  # type: ignore[return-value]

    def out_size(self, n: int, ax: int) -> int:
        """Output extent of an input extent ``n`` along axis ``ax`` (``<= 0``: too small), host ints:
        the same rule as :meth:`out_hw`."""
        s, e = self.stride[ax], self.extent[ax]
        p0, p1 = self.padding[2 * ax], self.padding[2 * ax + 1]
        if self.transposed:
            return (n - 1) * s - p0 - p1 + e + self.output_padding[ax]
        num = n + p0 + p1 - e
        if self.ceil_mode:
            o = (num + s - 1) // s + 1
            return max(o - 1 if (o - 1) * s >= n + p0 else o, 0)
        return max(num // s + 1, 0)

    def out_hw(self, hw: Tensor) -> Tensor:
        """Output ``(oh, ow)`` of every image (``<= 0`` where the image is too small)."""
        cols = []
        for ax in range(2):
            n = hw[:, ax]
            s, e = self.stride[ax], self.extent[ax]
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
    place: Tensor | None  # (T_in,) canvas position of every input row (tiles: None; canvas: None until needed)
    gather: Tensor | None  # (N*Hb*Wb,) source row per block position (T_in = fill), or None
    take: Tensor  # (T_out,) flat block-output position of every output row
    cache: "SpatialCache | None" = None  # the output structure's cache (shared plans)
    # canvas layout: (in bases, in row stride, out bases, out row stride, live images): every image's
    # rows and output rows are grids on the canvases (host ints), so the inverses are built by slices
    grids: tuple | None = None
    _divisors: dict = dataclasses.field(default_factory=dict)

    # The four moves between packed rows and blocks, each one gather over all rows with the
    # plan's cached indices (no per-image copy: the op count does not grow with the batch; a
    # gather of whole rows measured 2.5x faster than filling the gaps and scattering the rows).
    # Canvases are channels-last (``CANVAS_FORMAT``): a pixel's C channels are contiguous, as in
    # the rows, so a move copies whole rows and no transpose is made.

    def to_blocks(self, values: Tensor, fill: float = 0.0, channels_last: bool = True) -> Tensor:
        """Packed rows ``(T_in, C)`` -> dense blocks ``(N, C, Hb, Wb)``, gaps = ``fill``
        (channels-last unless ``channels_last=False`` or ``CANVAS_FORMAT`` says otherwise)."""
        n, hb, wb = self.blocks
        if self.gather is not None:  # tiles: halo pixels repeat, the fill is a row appended
            ext = torch.cat([values, values.new_full((1, values.shape[1]), fill)])
            return _blocks(ext.index_select(0, self.gather), n, hb, wb, channels_last)
        return _blocks(self._gather_filled("in", values, fill, n * hb * wb), n, hb, wb, channels_last)

    def rows_of_blocks(self, gb: Tensor, rows: int) -> Tensor:
        """Adjoint of :meth:`to_blocks`: block gradients ``(N, C, Hb, Wb)`` -> row gradients ``(rows, C)``."""
        flat = gb.permute(0, 2, 3, 1).reshape(-1, gb.shape[1])
        if self.gather is None:
            return flat.index_select(0, self.placement(flat.device))
        out = flat.new_zeros((rows + 1, flat.shape[1])).index_add_(0, self.gather, flat)  # type: ignore[arg-type]
        return out[:rows]

    def blocks_of_rows(self, g: Tensor, channels_last: bool = True) -> Tensor:
        """Adjoint of :meth:`from_blocks`: output-row gradients ``(T_out, O)`` -> ``(N, O, Ho, Wo)``."""
        n, ho, wo = self.out_blocks
        return _blocks(self._gather_filled("out", g, 0.0, n * ho * wo), n, ho, wo, channels_last)

    def from_blocks(self, y: Tensor) -> Tensor:
        """Native output ``(N, O, Ho, Wo)`` -> packed output rows ``(T_out, O)``."""
        return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1]).index_select(0, self.take)

    def _gather_filled(self, side: str, rows: Tensor, fill: float, total: int) -> Tensor:
        """Rows ``(T, C)`` on a canvas of ``total`` positions (``"in"``: the input canvas, ``"out"``:
        the output canvas), the gaps ``fill``. Large: one gather of whole rows (the gaps read row
        0), then the gaps filled in place; small: a fill row appended (a copy of every row) and one
        gather (measured: 0.32 vs 0.44 ms at 52k x 16 rows, 0.058 vs 0.051 ms at 13k x 16)."""
        if rows.shape[0] == 0:
            return rows.new_full((total, rows.shape[1]), fill)
        widths = self._divisors.get(("width", side))  # the channel counts met (a network plan recipe reads them)
        if widths is None:
            self._divisors[("width", side)] = {rows.shape[1]}
        elif rows.shape[1] not in widths:
            widths.add(rows.shape[1])
        if rows.numel() < _FILL_AFTER or self.grids is None:  # small: index_fill_'s fixed cost outweighs the copy
            ext = torch.cat([rows, rows.new_full((1, rows.shape[1]), fill)])
            return ext.index_select(0, self._row_of(side, rows.device))
        src, gaps = self._sources(side, rows.device, total)
        out = rows.index_select(0, src)
        return out.index_fill_(0, gaps, fill) if gaps.numel() else out

    def placement(self, device: torch.device) -> Tensor:
        """``place`` on ``device``: built from the grids on first use (a layer whose input needs no
        gradient, or a max pool, never reads it)."""
        if self.place is not None:
            return self.place
        key = ("place", device)
        hit = self._divisors.get(key)
        if hit is None:
            if self.grids is None:
                raise RuntimeError("padless internal: a canvas index asked of a plan without canvas grids")
            hit = torch.from_numpy(grid_index(self.grids[0], self.in_hw, self.grids[1])).to(device)
            self._divisors[key] = hit
        return hit

    def row_of_block(self, side: str, device: torch.device) -> Tensor:
        """The row of every block position (``"in"``: input blocks, ``"out"``: output blocks), the
        number of rows (one past the last) in the gaps and at repeated halo pixels of tiles."""
        self._divisors[("used", side)] = True  # asked for by an op itself (a network plan recipe reads it)
        return self._row_of(side, device)

    def _row_of(self, side: str, device: torch.device) -> Tensor:
        key = ("row_of", side, device)
        hit = self._divisors.get(key)  # the plan's derived-index cache (carried only with a network plan recipe)
        if hit is None:
            rows = int(self.in_hw.prod(1).sum()) if side == "in" else int(self.out_offsets[-1])
            n, h, w = self.blocks if side == "in" else self.out_blocks
            if self.gather is not None and side == "in":  # tiles: the gather is that map already
                hit = self.gather
            elif self.grids is None:  # the inverse of the placement, on its device (no sync)
                used = self.place if side == "in" else self.take
                hit = torch.full((n * h * w,), rows, dtype=torch.int64, device=device)
                hit.index_copy_(0, used, torch.arange(rows, device=device))  # type: ignore[arg-type]
            else:
                hit = torch.from_numpy(self._host_sources(side, n * h * w, rows)).to(device)
            self._divisors[key] = hit
        return hit

    def _sources(self, side: str, device: torch.device, total: int) -> tuple[Tensor, Tensor]:
        """The row of every canvas position (0 in the gaps) and the gap positions, on ``device``."""
        key = ("sources", side, device)
        hit = self._divisors.get(key)
        if hit is None:
            src = self._host_sources(side, total, -1)
            gaps = np.flatnonzero(src < 0)
            np.maximum(src, 0, out=src)  # the gaps read row 0 (one pass, not a scatter)
            hit = (torch.from_numpy(src).to(device), torch.from_numpy(gaps).to(device))
            self._divisors[key] = hit
        return hit

    def _host_sources(self, side: str, total: int, fill: int) -> np.ndarray:
        """The inverse of ``place`` (``"in"``) or ``take`` (``"out"``) on the host, ``fill`` in the gaps:
        one slice per image of the plan's grids."""
        grids = self.grids
        if grids is None:
            raise RuntimeError("padless internal: canvas sources asked of a plan without canvas grids")
        bases, stride = (grids[0], grids[1]) if side == "in" else (grids[2], grids[3])
        return grid_sources(bases, self.in_hw if side == "in" else self.out_hw, stride, total, grids[4], fill)

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


def _blocks(flat: Tensor, n: int, h: int, w: int, channels_last: bool = True) -> Tensor:
    """Flat block positions ``(n*h*w, C)`` as ``(n, C, h, w)``: channels-last (a view), or NCHW."""
    out = flat.view(n, h, w, flat.shape[1]).permute(0, 3, 1, 2)
    return out if channels_last and CANVAS_FORMAT == "channels_last" else out.contiguous()


def conv_channels_last(plan: "SpatialPlan", channels: int, weight: Tensor) -> bool:
    """Whether a convolution runs on a channels-last canvas. Its moves are then views, but the
    native kernel converts the weight to that format (and its gradient back) at every call:
    worth it while the canvas holds more elements than the weight (early layers: large
    images, few channels); late layers (small images, 512x512x3x3 weights) stay NCHW."""
    n, hb, wb = plan.blocks
    return n * hb * wb * channels >= weight.numel()


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
_RECENT: "collections.deque[SpatialCache]" = collections.deque(maxlen=2)  # the latest input batches' caches
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
    cache = _cache_for(hw, ho, nt._ragged)
    if not _is_traced(nt._values):
        nt._meta.derived[_KEY] = cache
        if nt._values.device.type == "cpu" and cache not in _RECENT:  # the next step on these sizes (a new
            _RECENT.append(cache)  # batch object) finds its plans; not on a device: its maps hold its memory
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


def _coords(hw: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row offsets and per-row ``(sample, row, col)`` of images with sizes ``hw`` (the layers of a
    network meet the same sizes several times: the coordinates come from the bounded row-coordinate
    cache, :func:`padless.tensor.layout.row_coords`; shared, never written)."""
    hw = hw.to(torch.int64).contiguous()
    off = layout.offsets_from_counts(hw.prod(1))
    sid, (a, r) = layout.row_coords(hw, off, (0, 1), int(off[-1]))
    return off, sid, a, r


def _canvas(g: Geometry, hw: Tensor, ohw: Tensor) -> tuple:
    h, w = hw[:, 0].tolist(), hw[:, 1].tolist()
    oh, ow = ohw[:, 0].tolist(), ohw[:, 1].tolist()
    (sh, sw), (eh, ew) = g.stride, g.extent
    pt, pb, pl, pr = g.padding
    boxes = []
    for i in range(len(h)):
        if oh[i] <= 0 or ow[i] <= 0:
            boxes.append((0, 0))
        elif g.transposed:  # in input units: the scattered footprint and the output window
            boxes.append((-(-max((h[i] - 1) * sh + eh, pt + oh[i]) // sh), -(-max((w[i] - 1) * sw + ew, pl + ow[i]) // sw)))
        else:  # shared gaps: windows may read up to pt rows (pl cols) past the box, the next box's top gap
            boxes.append((max(pt + h[i], (oh[i] - 1) * sh + eh - pt), max(pl + w[i], (ow[i] - 1) * sw + ew - pl)))
    align = (1, 1) if g.transposed else (sh, sw)
    pos, hc, wc = pack_boxes(boxes, align)
    if g.transposed:
        hc, wc = hc + 1, wc + 1  # one more input row/col so the output reaches the last box's end
        ho, wo = (hc - 1) * sh + eh, (wc - 1) * sw + ew
    else:  # room for the windows of the boxes at the bottom and right edges
        live = [i for i in range(len(h)) if oh[i] > 0 and ow[i] > 0]
        extent = lambda p: (plane_side(max([eh] + [p[i][0] + max(pt + h[i], (oh[i] - 1) * sh + eh) for i in live])),  # noqa: E731
                            plane_side(max([ew] + [p[i][1] + max(pl + w[i], (ow[i] - 1) * sw + ew) for i in live])))
        pos, hc, wc = reuse_plane((g, "canvas"), boxes, align, extent, pos, *extent(pos))
        ho, wo = (hc - eh) // sh + 1, (wc - ew) // sw + 1
    y0, x0 = [p[0] for p in pos], [p[1] for p in pos]
    if g.transposed:
        in_bases = [y * wc + x for y, x in zip(y0, x0)]
        out_bases = [(y * sh + pt) * wo + x * sw + pl for y, x in zip(y0, x0)]
    else:
        in_bases = [(y + pt) * wc + x + pl for y, x in zip(y0, x0)]
        out_bases = [(y // sh) * wo + x // sw for y, x in zip(y0, x0)]
    take = torch.from_numpy(grid_index(out_bases, ohw, wo))
    grids = (in_bases, wc, out_bases, wo, [bh > 0 and bw > 0 for bh, bw in boxes])
    return (1, hc, wc), (1, ho, wo), None, None, take, grids  # place: built when a backward needs it


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
    sizes = hw.tolist()  # host ints: a plan is a few Python loops over the images
    out, too_small = [], []
    for i, (h, w) in enumerate(sizes):
        o = (g.out_size(h, 0), g.out_size(w, 1))
        if o[0] <= 0 or o[1] <= 0 or h <= 0 or w <= 0:
            too_small.append(i)
            o = (0, 0)
        out.append(o)
    ohw = torch.tensor(out, dtype=torch.int64).view(-1, 2)
    if layout_name == "tiles" and not g.transposed:
        parts = _tiles(g, hw, ohw)
    elif layout_name in LAYOUTS:
        parts = _canvas(g, hw, ohw)
    else:
        raise ValueError(f"spatial plan: layout must be one of {LAYOUTS}, got {layout_name!r}")
    blocks, out_blocks, place, gather, take, grids = parts
    out_off = layout.offsets_from_counts(ohw.prod(1))

    def dev(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return SpatialPlan(
        g, layout_name, hw, ohw, out_off, too_small, blocks, out_blocks, dev(place), dev(gather), dev(take),  # type: ignore[arg-type]
        _cache_for(ohw, out_off, cache.ragged), grids,
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
