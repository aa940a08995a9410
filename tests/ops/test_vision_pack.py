"""The canvas packer and the index builders of the spatial plans against plain references: the
skyline placement (a column-height map with the same candidate rule), the choice among canvas
widths, and the canvas positions / sources of every pixel row (a loop over pixels)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from padless.ops.vision import pack


def _ref_skyline(boxes, align, wc, order=None):
    """Tallest first (or ``order``); each box at the lowest segment start (leftmost on ties) of a
    skyline whose segments start at 0 and at the right edge of every box placed (never merged)."""
    ah, aw = align
    if order is None:
        order = sorted(range(len(boxes)), key=lambda i: (-boxes[i][0], -boxes[i][1]))
    live = [i for i in order if boxes[i][0] > 0 and boxes[i][1] > 0]
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    height, starts, pos = [0] * wc, {0}, [(0, 0)] * len(boxes)
    for i in live:
        h, w = boxes[i]
        cols = -(-w // aw)
        if cols > wc:
            return None
        best = None
        for x in sorted(starts):
            if x + cols > wc:
                break
            y = max(height[x : x + cols])
            if best is None or y < best[1]:
                best = (x, y)
        x, y = best
        for c in range(x, x + cols):
            height[c] = y + pack.align_up(h, ah)
        starts = {s for s in starts if not x < s < x + cols} | {x} | ({x + cols} if x + cols < wc else set())
        pos[i] = (y, x * aw)
    return pos, max(pos[i][0] + boxes[i][0] for i in live), max(pos[i][1] + boxes[i][1] for i in live)


def _boxes(rng: random.Random):
    n = rng.randint(0, 13)
    return [(0 if rng.random() < 0.05 else rng.randint(1, 90), rng.randint(0 if rng.random() < 0.05 else 1, 90)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_skyline_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        boxes = _boxes(rng)
        align = rng.choice([(1, 1), (2, 2), (4, 4), (1, 3), (8, 8)])
        for wc in (1, 7, 40, 150):
            assert pack.skyline(boxes, align, wc) == _ref_skyline(boxes, align, wc), (boxes, align, wc)


def _ref_candidates(boxes, align):
    """Every box order of ``PACK_ORDERS`` (first occurrence) with every ``PACK_WIDTHS`` width, then,
    for at most ``FEW_BOXES`` boxes, tallest first at each sum of some boxes' widths between the
    widest box and ``SUBSET_SPAN`` x sqrt(area) that is not one of those widths."""
    live = [i for i in range(len(boxes)) if boxes[i][0] > 0 and boxes[i][1] > 0]
    if not live:
        return []
    aw = align[1]
    cols = {i: -(-boxes[i][1] // aw) for i in live}
    area = sum(pack.align_up(boxes[i][0], align[0]) * cols[i] * aw for i in live)
    widest = max(cols.values())
    widths = []
    for f in pack.PACK_WIDTHS:
        w = max(widest, int(math.sqrt(area) * f / aw))
        if w not in widths:
            widths.append(w)
    tallest = sorted(live, key=lambda i: (-boxes[i][0], -boxes[i][1], i))
    orders = []
    for key in pack.PACK_ORDERS if len(live) <= pack.FEW_BOXES else pack.PACK_ORDERS[:1]:  # ties: tallest first
        o = sorted(tallest, key=lambda i: key(boxes[i]))
        if o not in orders:
            orders.append(o)
    out = [(o, w) for o in orders for w in widths]
    if len(live) <= pack.FEW_BOXES:
        sums = {sum(cols[i] for i in c) for r in range(1, len(live) + 1) for c in itertools.combinations(live, r)}
        top = pack.SUBSET_SPAN * math.sqrt(area) / aw
        out += [(tallest, w) for w in sorted(sums) if widest <= w <= top and w not in widths]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_pack_boxes_keeps_the_smallest_canvas_tried(seed):
    """The smallest area over the tried orders and widths, the first tried on ties: the early stop
    of a try already past the best area found changes no result."""
    rng = random.Random(10 + seed)
    for _ in range(100):
        boxes = _boxes(rng)
        align = rng.choice([(1, 1), (2, 2), (4, 4)])
        cands = _ref_candidates(boxes, align)
        assert pack.pack_candidates(boxes, align) == cands, (boxes, align)
        if not cands:
            assert pack.pack_boxes(boxes, align) == ([(0, 0)] * len(boxes), 0, 0)
            continue
        best = None
        for order, wc in cands:
            got = _ref_skyline(boxes, align, wc, order)
            if best is None or got[1] * got[2] < best[1] * best[2]:
                best = got
        assert pack.pack_boxes(boxes, align) == best, (boxes, align)


def test_grid_index_and_sources_match_a_pixel_loop():
    rng = random.Random(7)
    for _ in range(40):
        sizes = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rng.randint(0, 6))]
        stride = max([w for _, w in sizes] + [1]) + rng.randint(0, 3)
        bases, o = [], 0
        for h, w in sizes:
            bases.append(o + rng.randint(0, 2))
            o = bases[-1] + (h + 1) * stride
        live = [rng.random() > 0.2 for _ in sizes]
        total = o + stride
        for col in (1, 2):
            want = [b + r * stride + c * col for b, (h, w) in zip(bases, sizes) for r in range(h) for c in range(w)]
            assert pack.grid_index(bases, sizes, stride, col).tolist() == want
        src = np.full(total, -1)
        row = 0
        for b, (h, w), ok in zip(bases, sizes, live):
            for r in range(h):
                for c in range(w):
                    if ok:
                        src[b + r * stride + c] = row
                    row += 1
        assert pack.grid_sources(bases, sizes, stride, total, live).tolist() == src.tolist()
        assert pack.grid_sources(bases, sizes, stride, total, live, fill=99).tolist() == np.where(src < 0, 99, src).tolist()
