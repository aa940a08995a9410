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

import numpy as np

__all__ = ["align_up", "grid_index", "grid_sources", "pack_boxes", "plane_side", "reuse_plane", "skyline"]

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


def pack_boxes(boxes: list[Pair], align: Pair) -> tuple[list[Pair], int, int]:
    """Skyline-pack boxes ``(h, w)`` onto one canvas (tallest first, each at the lowest place it
    fits, leftmost on ties), origins aligned to ``align``.

    Tries a few canvas widths and keeps the smallest area. Boxes of zero area get no room.
    Returns the origin of every box, and the canvas height and width. On 12 images of sides
    U[48, 216] at stride 4 (boxes sharing their gaps) the canvas is about 1.25x their
    pixels, where shelves of boxes with both gaps took 1.33x. A width whose packing already
    covers the best area found is abandoned early.
    """
    live = [b for b in boxes if b[0] > 0 and b[1] > 0]
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    aw = align[1]
    area = sum(align_up(h, align[0]) * -(-w // aw) * aw for h, w in live)
    widest = max(-(-w // aw) for _, w in live)
    order = _order(boxes)
    best = None
    for f in PACK_WIDTHS:
        got = skyline(boxes, align, max(widest, int(math.sqrt(area) * f / aw)), None if best is None else best[1] * best[2], order)
        if got is not None and (best is None or got[1] * got[2] < best[1] * best[2]):
            best = got
    return best  # type: ignore[return-value]


def _order(boxes: list[Pair]) -> list[int]:
    """The boxes of non-zero area, tallest first (widest first among equal heights)."""
    return [i for i in sorted(range(len(boxes)), key=lambda i: (-boxes[i][0], -boxes[i][1])) if boxes[i][0] > 0 and boxes[i][1] > 0]


def skyline(boxes: list[Pair], align: Pair, wc: int, bound: int | None = None, order: list[int] | None = None) -> tuple[list[Pair], int, int] | None:
    """One skyline packing of ``boxes`` on a canvas ``wc`` units of ``align[1]`` wide (``None``
    where a box is wider, or where the canvas reaches an area of ``bound`` before the last box).

    The skyline is three lists (segment starts, widths, heights, left to right); a box goes to the
    segment start where the highest segment under it is lowest (leftmost on ties), and the
    segments it covers are replaced by one at its top."""
    ah, aw = align
    live = _order(boxes) if order is None else order
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    xs, ws, ys = [0], [wc], [0]
    pos = [(0, 0)] * len(boxes)
    top = right = 0  # the canvas extent so far (its height and used width, in pixels)
    for i in live:
        h, w = boxes[i]
        cols = -(-w // aw)
        if cols > wc:
            return None
        best_j, best_y = -1, 0
        n = len(xs)
        for j in range(n):  # the lowest place starts where a segment starts (leftmost on ties)
            x1 = xs[j] + cols
            if x1 > wc:
                break
            y = ys[j]
            if best_j >= 0 and y >= best_y:
                continue
            k = j + 1
            while k < n and xs[k] < x1:
                if ys[k] > y:
                    y = ys[k]
                    if best_j >= 0 and y >= best_y:
                        break
                k += 1
            if best_j < 0 or y < best_y:
                best_j, best_y = j, y
        x0 = xs[best_j]
        x1 = x0 + cols
        pos[i] = (best_y, x0 * aw)
        if best_y + h > top:
            top = best_y + h
        if x0 * aw + w > right:
            right = x0 * aw + w
        if bound is not None and top * right >= bound:
            return None
        # raise columns [x0, x1) to the box's top: the covered segments become one (the box starts
        # at segment best_j; a last covered segment reaching past x1 keeps its right part)
        k = best_j
        while k < n and xs[k] < x1:
            k += 1
        last_end = xs[k - 1] + ws[k - 1]
        if last_end > x1:
            xs[best_j:k], ws[best_j:k], ys[best_j:k] = [x0, x1], [cols, last_end - x1], [best_y + align_up(h, ah), ys[k - 1]]
        else:
            xs[best_j:k], ws[best_j:k], ys[best_j:k] = [x0], [cols], [best_y + align_up(h, ah)]
    return pos, top, right


REUSE_PLANES = True  # --designs: False = every batch its own plane shape
REUSE_AREA = 1.15  # a remembered plane is reused for a batch that needs at least 1/1.15 of it
_PLANES: dict = {}  # layer kind -> the plane shapes used lately, most recent first


def reuse_plane(key, boxes: list[Pair], align: Pair, extent, pos: list[Pair], hc: int, wc: int) -> tuple[list[Pair], int, int]:
    """A plane shape used before for a layer of kind ``key`` instead of ``(hc, wc)``, when the boxes
    fit it (as packed, or packed again at its width) and it is at most ``REUSE_AREA`` times larger:
    the native kernels keep one plan per shape (oneDNN builds a convolution for every new shape:
    a first call on a shape costs about twice a call on a known one), so batches of new image sizes
    then run on shapes they know. ``extent(pos)`` is the plane ``(hc, wc)`` that origins ``pos``
    need. Returns the origins and the plane."""
    if not REUSE_PLANES:
        return pos, hc, wc
    seen = _PLANES.setdefault(key, [])
    need = hc * wc
    for k, (h2, w2) in sorted(enumerate(seen), key=lambda t: t[1][0] * t[1][1]):
        if not need <= h2 * w2 <= need * REUSE_AREA:
            continue
        if h2 >= hc and w2 >= wc:
            hit = (pos, h2, w2)
        else:
            got = skyline(boxes, align, w2 // align[1])
            if got is None:
                continue
            eh, ew = extent(got[0])
            if eh > h2 or ew > w2:
                continue
            hit = (got[0], h2, w2)
        seen.insert(0, seen.pop(k))
        return hit
    seen.insert(0, (hc, wc))
    del seen[32:]
    return pos, hc, wc


def grid_index(bases: list[int], sizes: list[Pair], row_stride: int, col_stride: int = 1) -> np.ndarray:
    """``bases[i] + r * row_stride + c * col_stride`` for every pixel ``(r, c)`` of every ``(h_i, w_i)``
    grid, row-major per grid, grids in order: the flat canvas position of each packed row (int64, on
    the host). One small numpy loop over the images (the canvas plans' index builder)."""
    out = np.empty(sum(h * w for h, w in sizes), dtype=np.int64)
    o = 0
    for b, (h, w) in zip(bases, sizes):
        n = h * w
        if n:  # one pass: the row starts plus the column offsets, written in place
            np.add(np.arange(b, b + h * row_stride, row_stride, dtype=np.int64)[:, None],
                   np.arange(0, w * col_stride, col_stride, dtype=np.int64), out=out[o : o + n].reshape(h, w))
        o += n
    return out


def grid_sources(bases: list[int], sizes: list[Pair], row_stride: int, total: int, live: list[bool], fill: int = -1) -> np.ndarray:
    """The inverse of :func:`grid_index` on a canvas of ``total`` positions: the packed row of every
    position, ``fill`` in the gaps. Grids not ``live`` (no room on the canvas) are skipped."""
    src = np.full(total + row_stride, fill, dtype=np.int64)  # one spare canvas row: every grid row is a full slice
    o = 0
    for b, (h, w), ok in zip(bases, sizes, live):
        n = h * w
        if n and ok:  # one pass into the grid's strided view
            np.add(np.arange(o, o + n, w, dtype=np.int64)[:, None], np.arange(w, dtype=np.int64),
                   out=src[b : b + h * row_stride].reshape(h, row_stride)[:, :w])
        o += n
    return src[:total]
