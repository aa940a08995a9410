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
    pixels, where shelves of boxes with both gaps took 1.33x.
    """
    live = [b for b in boxes if b[0] > 0 and b[1] > 0]
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    aw = align[1]
    area = sum(align_up(h, align[0]) * -(-w // aw) * aw for h, w in live)
    widest = max(-(-w // aw) for _, w in live)
    best = None
    for f in PACK_WIDTHS:
        pos, hc, used = skyline(boxes, align, max(widest, int(math.sqrt(area) * f / aw)))  # type: ignore[misc]
        if best is None or hc * used < best[1] * best[2]:
            best = (pos, hc, used)
    return best  # type: ignore[return-value]


def skyline(boxes: list[Pair], align: Pair, wc: int) -> tuple[list[Pair], int, int] | None:
    """One skyline packing of ``boxes`` on a canvas ``wc`` units of ``align[1]`` wide (``None``
    where a box is wider): origins, height and used width."""
    ah, aw = align
    order = sorted(range(len(boxes)), key=lambda i: (-boxes[i][0], -boxes[i][1]))
    live = [i for i in order if boxes[i][0] > 0 and boxes[i][1] > 0]
    cols = {i: -(-boxes[i][1] // aw) for i in live}  # widths in units of aw
    if not live or max(cols.values()) > wc:
        return None if live else ([(0, 0)] * len(boxes), 0, 0)
    rows = {i: align_up(boxes[i][0], ah) for i in live}
    sky = [(0, wc, 0)]  # the skyline: segments (x, width, height), left to right
    pos = [(0, 0)] * len(boxes)
    for i in live:
        w = cols[i]
        best_j, best_y = -1, 0
        for j in range(len(sky)):  # the lowest place starts where a segment starts
            x0 = sky[j][0]
            if x0 + w > wc:
                break
            y, k = 0, j
            while sky[k][0] < x0 + w:
                y = max(y, sky[k][2])
                k += 1
                if k == len(sky):
                    break
            if best_j < 0 or y < best_y:
                best_j, best_y = j, y
        x0 = sky[best_j][0]
        pos[i] = (best_y, x0 * aw)
        sky = _raise_skyline(sky, x0, w, best_y + rows[i])
    return pos, max(pos[i][0] + boxes[i][0] for i in live), max(pos[i][1] + boxes[i][1] for i in live)


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


def _raise_skyline(sky: list[tuple[int, int, int]], x0: int, w: int, top: int) -> list[tuple[int, int, int]]:
    """The skyline with columns ``[x0, x0 + w)`` raised to ``top`` (neighbouring segments cut)."""
    out = []
    for x, sw, y in sky:
        if x + sw <= x0 or x >= x0 + w:
            out.append((x, sw, y))
            continue
        if x < x0:
            out.append((x, x0 - x, y))
        if x + sw > x0 + w:
            out.append((x0 + w, x + sw - x0 - w, y))
    out.append((x0, w, top))
    return sorted(out)


def grid_index(bases: list[int], sizes: list[Pair], row_stride: int, col_stride: int = 1) -> np.ndarray:
    """``bases[i] + r * row_stride + c * col_stride`` for every pixel ``(r, c)`` of every ``(h_i, w_i)``
    grid, row-major per grid, grids in order: the flat canvas position of each packed row (int64, on
    the host). One small numpy loop over the images (the canvas plans' index builder)."""
    out = np.empty(sum(h * w for h, w in sizes), dtype=np.int64)
    o = 0
    for b, (h, w) in zip(bases, sizes):
        n = h * w
        if n:
            v = out[o : o + n].reshape(h, w)
            v[:] = np.arange(0, w * col_stride, col_stride, dtype=np.int64)
            v += np.arange(b, b + h * row_stride, row_stride, dtype=np.int64)[:, None]
        o += n
    return out


def grid_sources(bases: list[int], sizes: list[Pair], row_stride: int, total: int, live: list[bool], fill: int = -1) -> np.ndarray:
    """The inverse of :func:`grid_index` on a canvas of ``total`` positions: the packed row of every
    position, ``fill`` in the gaps. Grids not ``live`` (no room on the canvas) are skipped."""
    src = np.full(total + row_stride, fill, dtype=np.int64)  # one spare canvas row: every grid row is a full slice
    o = 0
    for b, (h, w), ok in zip(bases, sizes, live):
        n = h * w
        if n and ok:
            src[b : b + h * row_stride].reshape(h, row_stride)[:, :w] = np.arange(o, o + n, dtype=np.int64).reshape(h, w)
        o += n
    return src[:total]
