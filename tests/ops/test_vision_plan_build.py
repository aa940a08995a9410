"""The host builders of a new batch's spatial plans are bit-identical to their first versions.

The packer (:func:`padless.ops.vision.pack.pack_boxes`, :func:`~padless.ops.vision.pack.skyline`), the
canvas index builders (:func:`~padless.ops.vision.pack.grid_index`, ``grid_sources``) and the strided
1x1 rows (:func:`padless.ops.vision.conv.subsample_of`) were rewritten for speed (numpy over all grid
rows at once, row structures shared by content, a leaner skyline). Kept here, their first versions
(plain per-box and per-image loops, torch arithmetic) are the references, on a few hundred random
size sets, small grids and large (both index paths), with empty and zero-area grids and one-grid lists.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import padless
from padless.ops.vision import conv, pack
from padless.ops.vision import spatial as sp
from padless.tensor import layout


# ------------------------------------------------------------------ the first versions


def _old_align_up(x, a):
    return -(-x // a) * a


def _old_order(boxes):
    return [i for i in sorted(range(len(boxes)), key=lambda i: (-boxes[i][0], -boxes[i][1])) if boxes[i][0] > 0 and boxes[i][1] > 0]


def _old_skyline(boxes, align, wc, bound=None, order=None):
    ah, aw = align
    live = _old_order(boxes) if order is None else order
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    xs, ws, ys = [0], [wc], [0]
    pos = [(0, 0)] * len(boxes)
    top = right = 0
    for i in live:
        h, w = boxes[i]
        cols = -(-w // aw)
        if cols > wc:
            return None
        best_j, best_y = -1, 0
        n = len(xs)
        for j in range(n):
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
        top = max(top, best_y + h)
        right = max(right, x0 * aw + w)
        if bound is not None and top * right >= bound:
            return None
        k = best_j
        while k < n and xs[k] < x1:
            k += 1
        last_end = xs[k - 1] + ws[k - 1]
        if last_end > x1:
            xs[best_j:k], ws[best_j:k], ys[best_j:k] = [x0, x1], [cols, last_end - x1], [best_y + _old_align_up(h, ah), ys[k - 1]]
        else:
            xs[best_j:k], ws[best_j:k], ys[best_j:k] = [x0], [cols], [best_y + _old_align_up(h, ah)]
    return pos, top, right


def _old_pack_boxes(boxes, align):
    live = [b for b in boxes if b[0] > 0 and b[1] > 0]
    if not live:
        return [(0, 0)] * len(boxes), 0, 0
    aw = align[1]
    area = sum(_old_align_up(h, align[0]) * -(-w // aw) * aw for h, w in live)
    widest = max(-(-w // aw) for _, w in live)
    order = _old_order(boxes)
    best = None
    for f in pack.PACK_WIDTHS:
        got = _old_skyline(boxes, align, max(widest, int(math.sqrt(area) * f / aw)), None if best is None else best[1] * best[2], order)
        if got is not None and (best is None or got[1] * got[2] < best[1] * best[2]):
            best = got
    return best


def _old_grid_index(bases, sizes, row_stride, col_stride=1):
    out = np.empty(sum(h * w for h, w in sizes), dtype=np.int64)
    o = 0
    for i, (b, (h, w)) in enumerate(zip(bases, sizes)):
        n = h * w
        s = row_stride if isinstance(row_stride, int) else int(row_stride[i])
        if n:
            np.add(np.arange(b, b + h * s, s, dtype=np.int64)[:, None],
                   np.arange(0, w * col_stride, col_stride, dtype=np.int64), out=out[o : o + n].reshape(h, w))
        o += n
    return out


def _old_grid_sources(bases, sizes, row_stride, total, live, fill=-1):
    src = np.full(total + row_stride, fill, dtype=np.int64)
    o = 0
    for b, (h, w), ok in zip(bases, sizes, live):
        n = h * w
        if n and ok:
            np.add(np.arange(o, o + n, w, dtype=np.int64)[:, None], np.arange(w, dtype=np.int64),
                   out=src[b : b + h * row_stride].reshape(h, row_stride)[:, :w])
        o += n
    return src[:total]


def _old_subsample(hw, off, st):
    ohw = torch.stack([(hw[:, 0] + st[0] - 1) // st[0], (hw[:, 1] + st[1] - 1) // st[1]], 1)
    ooff = torch.cat([off.new_zeros(1), ohw.prod(1).cumsum(0)])
    o = layout.offsets_from_counts(ohw.prod(1))
    sid, (a, b) = layout.row_coords(ohw, o, (0, 1), int(o[-1]))
    return off[:-1][sid] + a * st[0] * hw[sid, 1] + b * st[1], ohw, ooff


# ------------------------------------------------------------------ random inputs


def _sizes(rng: random.Random, big: bool):
    n = rng.choice([0, 1, 1, 2, 5, 12, 13])
    hi = 90 if big else 9
    return [(0 if rng.random() < 0.06 else rng.randint(1, hi), 0 if rng.random() < 0.06 else rng.randint(1, hi)) for _ in range(n)]


def _canvas(rng: random.Random, sizes):
    """Bases of non-overlapping grids on a canvas, its row stride and total positions."""
    stride = max([w for _, w in sizes] + [1]) + rng.randint(0, 3)
    bases, o = [], 0
    for h, _ in sizes:
        bases.append(o + rng.randint(0, 2))
        o = bases[-1] + (h + 1) * stride
    return bases, stride, o + stride


@pytest.mark.parametrize("big", [False, True], ids=["small-grids", "large-grids"])
def test_grid_builders_match_their_first_versions(big):
    rng = random.Random(11 + big)
    for _ in range(300):
        sizes = _sizes(rng, big)
        bases, stride, total = _canvas(rng, sizes)
        live = [rng.random() > 0.15 for _ in sizes]
        for col in (1, 2, 3):
            want = _old_grid_index(bases, sizes, stride, col)
            got = pack.grid_index(bases, sizes, stride, col)
            assert got.dtype == np.int64 and np.array_equal(got, want), (sizes, bases, stride, col)
        strides = [stride * rng.randint(1, 3) for _ in sizes]  # one row stride per grid
        assert np.array_equal(pack.grid_index(bases, np.array(sizes, dtype=np.int64).reshape(-1, 2), strides, 2),
                              _old_grid_index(bases, sizes, strides, 2))
        for ok in (live, [True] * len(sizes)):
            for fill in (-1, 7, 10**6):
                got = pack.grid_sources(bases, torch.tensor(sizes, dtype=torch.int64).view(-1, 2), stride, total, ok, fill)
                assert np.array_equal(got, _old_grid_sources(bases, sizes, stride, total, ok, fill)), (sizes, ok, fill)


def test_grid_builders_take_both_paths(monkeypatch):
    """The thresholds between one pass over all grid rows and one write per grid change no result."""
    rng = random.Random(5)
    for scatter, loop in ((0, 0), (10**9, 10**9), (0, 10**9), (10**9, 0)):
        monkeypatch.setattr(pack, "SCATTER_PIXELS", scatter)
        monkeypatch.setattr(pack, "LOOP_PIXELS", loop)
        pack._GRID_ROWS.clear()
        for _ in range(60):
            sizes = _sizes(rng, rng.random() < 0.5)
            bases, stride, total = _canvas(rng, sizes)
            live = [rng.random() > 0.15 for _ in sizes]
            assert np.array_equal(pack.grid_index(bases, sizes, stride, 2), _old_grid_index(bases, sizes, stride, 2))
            assert np.array_equal(pack.grid_sources(bases, sizes, stride, total, live, 3), _old_grid_sources(bases, sizes, stride, total, live, 3))
    pack._GRID_ROWS.clear()


def test_packer_matches_its_first_version():
    """The packer tries more box orders and widths than its first version, whose tries come first:
    it returns the first version's packing unless it found a smaller canvas."""
    rng = random.Random(3)
    smaller = 0
    for _ in range(400):
        n = rng.choice([0, 1, 2, 6, 12, 14])
        boxes = [(0 if rng.random() < 0.05 else rng.randint(1, 220), rng.randint(0 if rng.random() < 0.05 else 1, 220)) for _ in range(n)]
        align = rng.choice([(1, 1), (2, 2), (4, 4), (1, 3), (8, 8), (32, 32)])
        got, old = pack.pack_boxes(boxes, align), _old_pack_boxes(boxes, align)
        if got != old:
            assert got[1] * got[2] < old[1] * old[2], (boxes, align)
            smaller += 1
        for wc in (1, 9, 60, 400):
            for bound in (None, 5000, 10**6):
                assert pack.skyline(boxes, align, wc, bound) == _old_skyline(boxes, align, wc, bound), (boxes, align, wc, bound)
    assert smaller > 40  # the added tries do find smaller canvases


def test_subsample_rows_match_their_first_version():
    rng = random.Random(9)
    for _ in range(200):
        hw = torch.tensor([(rng.randint(1, 60), rng.randint(1, 60)) for _ in range(rng.choice([1, 2, 7, 12]))], dtype=torch.int64)
        off = layout.offsets_from_counts(hw.prod(1))
        cache = sp._cache_for(hw, off, (1, 2))
        st = rng.choice([(1, 1), (2, 2), (3, 2), (4, 4)])
        idx, out = conv.subsample_of(cache, st, torch.device("cpu"))
        want, ohw, ooff = _old_subsample(hw, off, st)
        assert idx.dtype == torch.int64 and torch.equal(idx, want)
        assert torch.equal(out.hw, ohw) and torch.equal(out.host_offsets, ooff)


@pytest.mark.parametrize("geometry", [((7, 7), (2, 2), 3), ((3, 3), (1, 1), 1), ((3, 3), (2, 2), 1), ((2, 2), (2, 2), 0)])
def test_plan_indices_are_the_first_builders_on_the_plan_grids(geometry):
    """Every index of a canvas plan (take, place, the row of every block position on both sides)
    equals the first builders' on the plan's own grids, on random batches (one image, empty images)."""
    k, s, p = geometry
    rng = random.Random(sum(k) + sum(s))
    cpu = torch.device("cpu")
    for _ in range(40):
        sizes = [(rng.randint(0, 40) if rng.random() < 0.1 else rng.randint(4, 40), rng.randint(4, 40)) for _ in range(rng.choice([1, 3, 12]))]
        x = padless.from_list([torch.zeros(1, h, w) for h, w in sizes], ragged_dims=(1, 2))
        plan = sp.build_spatial_plan(x, k, s, p)
        in_b, in_s, out_b, out_s, live = plan.grids
        in_hw, out_hw = plan.in_hw.tolist(), plan.out_hw.tolist()
        assert torch.equal(plan.take, torch.from_numpy(_old_grid_index(out_b, out_hw, out_s)))
        assert torch.equal(plan.placement(cpu), torch.from_numpy(_old_grid_index(in_b, in_hw, in_s)))
        (_, hb, wb), (_, ho, wo) = plan.blocks, plan.out_blocks
        rows_in, rows_out = sum(h * w for h, w in in_hw), int(plan.out_offsets[-1])
        assert torch.equal(plan.row_of_block("in", cpu), torch.from_numpy(_old_grid_sources(in_b, in_hw, in_s, hb * wb, live, rows_in)))
        assert torch.equal(plan.row_of_block("out", cpu), torch.from_numpy(_old_grid_sources(out_b, out_hw, out_s, ho * wo, live, rows_out)))
