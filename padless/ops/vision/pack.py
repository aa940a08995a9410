"""Skyline packing of image boxes onto one canvas (the spatial plans' ``"canvas"`` layout).

Boxes ``(h, w)`` are placed tallest first, each at the lowest place it fits (leftmost on
ties), origins aligned to the layer's stride; a few canvas widths are tried and the
smallest area kept. Pure Python on a handful of boxes: well under a millisecond for a
batch of a few dozen images. A skyline of three placed boxes (heights per column)::

    A A C C        y grows downwards; the skyline as segments (x, width, height):
    A A . .        (0, 2, 3) (2, 2, 1): the next box of width <= 2 goes to x = 2, y = 1
    B B . .
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np

from padless.tensor.lru import LRU, MiB, nbytes

__all__ = ["GridRows", "align_up", "grid_index", "grid_rows", "grid_sources", "pack_boxes", "plane_side", "reuse_plane", "skyline"]

Pair = tuple[int, int]


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


QUANTIZE = False  # plane sides from a ladder (measured: no gain, see plane_side)


def plane_side(n: int) -> int:
    """``n`` rounded up to the ladder ``{8..15} * 2^k`` (steps of at most 1/8): canvas planes of
    batches of similar pixel counts then have the same shape, and the native kernels reuse their
    per-shape plans (oneDNN's JIT-compiled convolutions cost about twice a run on each new shape).
    Sides up to 16 are kept. Off by default: over 60 batches of 12 images U[48, 216] the new
    convolution shapes per batch fall from 7-9 of 14 to 0-4, but the planes are ~9% larger, and
    ``benchmarks/vision.py`` (widths 16..128, one thread, 7 and 30 rounds) showed no gain."""
    if not QUANTIZE or n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)  # n in [8 step, 16 step)
    return -(-n // step) * step


PACK_WIDTHS = (1.0, 1.15, 1.3, 1.5, 1.75, 2.0)  # canvas widths tried, x sqrt(area) (3 of them: 2.4% more area, half the time)
#: Few boxes (up to :data:`FEW_BOXES`, images of a small batch) pack badly at the widths of
#: ``PACK_WIDTHS`` in one order (6 images U[48, 128]: the canvas is 1.21x their boxes), so for
#: them more tries: these box orders (tallest, widest, largest, longest side first), each at every
#: width, and tallest first at every width where a row of boxes ends exactly (the sums of some
#: boxes' widths between the widest box and ``SUBSET_SPAN`` x sqrt(area)): 1.17x, for about
#: 0.15 ms per plan. For 12 images the orders would save 1.7% of the canvas for 0.13 ms per plan,
#: which a network's first step on a new batch does not earn back: one order there.
PACK_ORDERS = (
    lambda b: (-b[0], -b[1]),
    lambda b: (-b[1], -b[0]),
    lambda b: (-b[0] * b[1], -b[0]),
    lambda b: (-max(b), -b[0] * b[1]),
)
FEW_BOXES = 6
SUBSET_SPAN = 2.2


def pack_boxes(boxes: list[Pair], align: Pair) -> tuple[list[Pair], int, int]:
    """Skyline-pack boxes ``(h, w)`` onto one canvas (each at the lowest place it fits, leftmost
    on ties), origins aligned to ``align``.

    Tries a few canvas widths, and for few boxes a few box orders too (:func:`pack_candidates`),
    and keeps the smallest area (the first found on ties). Boxes of zero area get no room.
    Returns the origin of every box, and the canvas height and width. On 12 images of sides
    U[48, 216] at stride 4 (boxes sharing their gaps) the canvas is about 1.19x the boxes, on 6
    images of U[48, 128] 1.17x. A try whose packing already covers the best area found is
    abandoned early.
    """
    cands = pack_candidates(boxes, align)
    if not cands:
        return [(0, 0)] * len(boxes), 0, 0
    units = _units(boxes, align)
    best = None
    for order, wc in cands:
        got = _skyline(boxes, units, order, align[1], wc, None if best is None else best[1] * best[2])
        if got is not None and (best is None or got[1] * got[2] < best[1] * best[2]):
            best = got
    return best  # type: ignore[return-value]


def pack_candidates(boxes: list[Pair], align: Pair) -> list[tuple[list[int], int]]:
    """The (box order, canvas width in units of ``align[1]``) pairs :func:`pack_boxes` tries, in
    its order (empty when no box has an area)."""
    order = _order(boxes)
    if not order:
        return []
    aw = align[1]
    cols, heights = _units(boxes, align)
    area = sum(heights[i] * cols[i] * aw for i in order)
    widest = max(cols[i] for i in order)
    root = math.sqrt(area)
    widths = list(dict.fromkeys(max(widest, int(root * f / aw)) for f in PACK_WIDTHS))
    orders = _orders(boxes, order)
    out = [(o, w) for o in orders for w in widths]
    if len(order) <= FEW_BOXES:  # the widths where a row of boxes ends, tallest first only
        top = SUBSET_SPAN * root / aw
        sums = {0}
        for i in order:
            sums |= {t + cols[i] for t in sums}
        out += [(order, w) for w in sorted(sums) if widest <= w <= top and w not in widths]
    return out


def _orders(boxes: list[Pair], tallest: list[int] | None = None) -> list[list[int]]:
    """The distinct box orders of :data:`PACK_ORDERS` (ties keep the tallest-first order); tallest
    first only for more than :data:`FEW_BOXES` boxes."""
    tallest = _order(boxes) if tallest is None else tallest
    if len(tallest) > FEW_BOXES:
        return [tallest]
    orders: list[list[int]] = []
    for key in PACK_ORDERS:
        o = sorted(tallest, key=lambda i: key(boxes[i]))
        if o not in orders:
            orders.append(o)
    return orders


def _order(boxes: list[Pair]) -> list[int]:
    """The boxes of non-zero area, tallest first (widest first among equal heights)."""
    return [i for i in sorted(range(len(boxes)), key=lambda i: (-boxes[i][0], -boxes[i][1])) if boxes[i][0] > 0 and boxes[i][1] > 0]


def _units(boxes: list[Pair], align: Pair) -> tuple[list[int], list[int]]:
    """Every box's width in units of ``align[1]`` and its height rounded up to ``align[0]``."""
    ah, aw = align
    return [-(-w // aw) for _, w in boxes], [-(-h // ah) * ah for h, _ in boxes]


def skyline(boxes: list[Pair], align: Pair, wc: int, bound: int | None = None, order: list[int] | None = None) -> tuple[list[Pair], int, int] | None:
    """One skyline packing of ``boxes`` on a canvas ``wc`` units of ``align[1]`` wide (``None``
    where a box is wider, or where the canvas reaches an area of ``bound`` before the last box).

    The skyline is two lists (segment starts and heights, left to right; a segment ends where the
    next starts, the last at ``wc``); a box goes to the segment start where the highest segment under
    it is lowest (leftmost on ties), and the segments it covers are replaced by one at its top."""
    live = _order(boxes) if order is None else order
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    return _skyline(boxes, _units(boxes, align), live, align[1], wc, bound)


_HIGH = 1 << 62  # above any skyline height


def _skyline(boxes: list[Pair], units: tuple[list[int], list[int]], live: list[int], aw: int, wc: int, bound: int | None) -> tuple[list[Pair], int, int] | None:
    cols_of, height_of = units
    xs, ys = [0], [0]
    pos = [(0, 0)] * len(boxes)
    top = right = 0  # the canvas extent so far (its height and used width, in pixels)
    for i in live:
        cols = cols_of[i]
        if cols > wc:
            return None
        last = wc - cols  # the rightmost start where the box fits
        n = len(xs)
        best_j, best_y = 0, _HIGH
        for j in range(n):  # the lowest place starts where a segment starts (leftmost on ties)
            x0 = xs[j]
            if x0 > last:
                break
            y = ys[j]
            if y >= best_y:
                continue
            x1 = x0 + cols
            k = j + 1
            while k < n and xs[k] < x1:
                if ys[k] > y:
                    y = ys[k]
                    if y >= best_y:
                        break
                k += 1
            if y < best_y:
                best_j, best_y = j, y
        x0 = xs[best_j]
        x1 = x0 + cols
        px = x0 * aw
        pos[i] = (best_y, px)
        h, w = boxes[i]
        if best_y + h > top:
            top = best_y + h
        if px + w > right:
            right = px + w
        if bound is not None and top * right >= bound:
            return None
        # raise columns [x0, x1) to the box's top: the covered segments become one (the box starts
        # at segment best_j; a last covered segment reaching past x1 keeps its right part)
        k = bisect_left(xs, x1, best_j + 1)
        if (xs[k] if k < n else wc) > x1:
            xs[best_j:k], ys[best_j:k] = [x0, x1], [best_y + height_of[i], ys[k - 1]]
        else:
            xs[best_j:k], ys[best_j:k] = [x0], [best_y + height_of[i]]
    return pos, top, right


REUSE_PLANES = True  # --designs: False = every batch its own plane shape
REUSE_AREA = 1.15  # a remembered plane is reused for a batch that needs at least 1/1.15 of it
_PLANES: dict = {}  # layer kind -> the plane shapes used lately, most recent first
PLANE_KINDS = 256
"""Layer kinds whose plane shapes are remembered (the oldest kind goes first), each with at most
32 shapes: a few hundred KiB at most."""


def reuse_plane(key, boxes: list[Pair], align: Pair, extent, pos: list[Pair], hc: int, wc: int) -> tuple[list[Pair], int, int]:
    """A plane shape used before for a layer of kind ``key`` instead of ``(hc, wc)``, when the boxes
    fit it (as packed, or packed again at its width) and it is at most ``REUSE_AREA`` times larger:
    the native kernels keep one plan per shape (oneDNN builds a convolution for every new shape:
    a first call on a shape costs about twice a call on a known one), so batches of new image sizes
    then run on shapes they know. ``extent(pos)`` is the plane ``(hc, wc)`` that origins ``pos``
    need. Returns the origins and the plane."""
    if not REUSE_PLANES:
        return pos, hc, wc
    seen = _PLANES.get(key)
    if seen is None:
        seen = _PLANES[key] = []
        while len(_PLANES) > PLANE_KINDS:
            del _PLANES[next(iter(_PLANES))]
    need = hc * wc
    for k, (h2, w2) in sorted(enumerate(seen), key=lambda t: t[1][0] * t[1][1]):
        if not need <= h2 * w2 <= need * REUSE_AREA:
            continue
        if h2 >= hc and w2 >= wc:
            hit = (pos, h2, w2)
        else:
            hit = None
            for order in _orders(boxes):  # packed again at its width, each box order in turn
                got = skyline(boxes, align, w2 // align[1], None, order)
                if got is not None:
                    eh, ew = extent(got[0])
                    if eh <= h2 and ew <= w2:
                        hit = (got[0], h2, w2)
                        break
            if hit is None:
                continue
        seen.insert(0, seen.pop(k))
        return hit
    seen.insert(0, (hc, wc))
    del seen[32:]
    return pos, hc, wc


def grid_index(bases, sizes, row_stride, col_stride: int = 1) -> np.ndarray:
    """``bases[i] + r * row_stride + c * col_stride`` for every pixel ``(r, c)`` of every ``(h_i, w_i)``
    grid, row-major per grid, grids in order: the flat canvas position of each packed row (int64, on
    the host). ``row_stride`` is one int or one per grid. See :class:`GridRows` (this is its
    :meth:`~GridRows.index` on the rows of ``sizes``, found by content)."""
    return grid_rows(sizes).index(bases, row_stride, col_stride)


def grid_sources(bases, sizes, row_stride: int, total: int, live, fill: int = -1) -> np.ndarray:
    """The inverse of :func:`grid_index` on a canvas of ``total`` positions: the packed row of every
    position, ``fill`` in the gaps. Grids not ``live`` (no room on the canvas) are skipped."""
    return grid_rows(sizes).sources(bases, row_stride, total, live, fill)


SCATTER_PIXELS = 512  # pixels per grid up to which sources are one scatter (above: one strided write per grid)
LOOP_PIXELS = 4096  # pixels per grid from which an index is written grid by grid (below: one pass over all rows)


class GridRows:
    """The row structure of grids ``(h_i, w_i)``: built once per list of sizes (:func:`grid_rows`) and
    shared by every index on those sizes (the input and output canvases of every plan that meets
    them), so an index is a handful of numpy calls whatever the number of grids.

    Two grids ``(2, 3)`` and ``(1, 2)``: ``img = [0, 0, 1]`` (the grid of each grid row), ``r = [0, 1,
    0]`` (its row in that grid), ``width = [3, 3, 2]``, ``first = [0, 3, 6]`` (its first packed row).
    Small grids (many grids of few pixels: the late layers of a network) take one pass over all grid
    rows; large ones one numpy slice per grid (fewer passes over the pixels)."""

    __slots__ = ("hw", "count", "pixels", "img", "r", "width", "first", "_arange")

    def __init__(self, sizes) -> None:
        hw = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        h, w = hw[:, 0], hw[:, 1]
        n = h * w
        self.hw = hw.tolist()
        self.count = hw.shape[0]
        self.pixels = int(n.sum())
        self.img = np.repeat(np.arange(self.count), h)
        self.r = np.arange(self.img.shape[0], dtype=np.int64) - np.repeat(np.cumsum(h) - h, h)
        self.width = w[self.img]
        self.first = np.cumsum(self.width) - self.width
        self._arange: np.ndarray | None = None

    def _rows(self) -> np.ndarray:
        """``arange(pixels)`` (kept: callers never write it; only asked for on the one-pass paths, i.e.
        at most ``LOOP_PIXELS`` pixels per grid)."""
        if self._arange is None:
            self._arange = np.arange(self.pixels, dtype=np.int64)
        return self._arange

    def _per_grid(self) -> bool:
        return self.pixels > LOOP_PIXELS * self.count

    def index(self, bases, row_stride, col_stride: int = 1) -> np.ndarray:
        """``bases[i] + r * row_stride(_i) + c * col_stride`` for every pixel of every grid."""
        if self.pixels == 0:
            return np.empty(0, dtype=np.int64)
        per_image = not isinstance(row_stride, (int, np.integer))
        if self._per_grid():
            out = np.empty(self.pixels, dtype=np.int64)
            rs = list(row_stride) if per_image else None
            o = 0
            for i, (b, (h, w)) in enumerate(zip(bases, self.hw)):
                n = h * w
                if n:  # one pass: the row starts plus the column offsets, written in place
                    s = rs[i] if rs is not None else row_stride
                    np.add(np.arange(b, b + h * s, s, dtype=np.int64)[:, None],
                           np.arange(0, w * col_stride, col_stride, dtype=np.int64), out=out[o : o + n].reshape(h, w))
                o += n
            return out
        img = self.img
        rs = np.asarray(row_stride, dtype=np.int64)[img] if per_image else row_stride
        start = np.asarray(bases, dtype=np.int64)[img] + self.r * rs - self.first * col_stride  # per grid row
        out = np.repeat(start, self.width)
        if col_stride == 1:
            out += self._rows()
        else:
            out += np.arange(0, self.pixels * col_stride, col_stride, dtype=np.int64)
        return out

    def sources(self, bases, row_stride: int, total: int, live, fill: int = -1) -> np.ndarray:
        """The packed row of every position of a canvas of ``total`` positions (:func:`grid_sources`)."""
        if self.pixels <= SCATTER_PIXELS * self.count and all(live):
            src = np.full(total, fill, dtype=np.int64)
            if self.pixels:
                src[self.index(bases, row_stride)] = self._rows()
            return src
        src = np.full(total + row_stride, fill, dtype=np.int64)  # one spare canvas row: every grid row is a full slice
        rows = np.arange(self.pixels, dtype=np.int64)  # copied grid by grid (faster than a broadcast add per grid)
        o = 0
        for b, (h, w), ok in zip(bases, self.hw, live):
            n = h * w
            if n and ok:  # one copy into the grid's strided view
                src[b : b + h * row_stride].reshape(h, row_stride)[:, :w] = rows[o : o + n].reshape(h, w)
            o += n
        return src[:total]


_GRID_ROWS = LRU("grid_rows", max_entries=32, max_bytes=64 * MiB,
                 what="row structure of image grids, by the grids' sizes (host bytes)",
                 size=lambda k, v: nbytes((k, v)) + 8 * v.pixels)  # + the arange it may build later


def grid_rows(sizes) -> GridRows:
    """The :class:`GridRows` of ``sizes`` (a list of ``(h, w)`` or a ``(B, 2)`` array / host tensor),
    by content: the last few distinct lists of sizes are kept (a network meets each a few times)."""
    arr = sizes.numpy() if hasattr(sizes, "numpy") else np.asarray(sizes, dtype=np.int64)
    key = arr.astype(np.int64, copy=False).tobytes()
    hit = _GRID_ROWS.get(key)
    if hit is None:
        hit = GridRows(arr)
        _GRID_ROWS.put(key, hit)
    return hit
