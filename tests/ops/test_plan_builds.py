"""What a new batch builds for its bucketed contractions (padless.ops.pairs.bucketed): the host
index maps (``grid_positions``, ``padding_maps``) against element-by-element references, and the
content cache's count of a plan's bytes (the result maps it builds later included)."""

import itertools

import numpy as np
import pytest
import torch

import padless
from padless.ops.common import content
from padless.ops.kernels import layout as kl
from padless.ops.pairs import bucketed
from padless.tensor import lru


def _grid_reference(ext, base, strides):
    out = []
    for e, o, st in zip(ext, base, strides):
        for c in itertools.product(*(range(n) for n in e)):
            out.append(o + sum(x * s for x, s in zip(c, st)))
    return out


@pytest.mark.parametrize("per_sample", [True, False], ids=["grid_by_grid", "all_at_once"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_grid_positions_matches_element_by_element(per_sample, k, monkeypatch):
    """Every sample's grid row-major at its own base and strides, empty samples included, on
    both paths (few large grids, many small ones)."""
    monkeypatch.setattr(kl, "GRID_ELEMENTS_PER_SAMPLE", 0 if per_sample else 1 << 30)
    g = np.random.default_rng(k)
    for b in (1, 5):
        ext = g.integers(0, 4, size=(b, k))
        ext[0] = np.maximum(ext[0], 1)  # at least one sample with elements
        if b > 1 and k:
            ext[1, 0] = 0  # an empty sample
        base = g.integers(0, 1000, size=b)
        strides = g.integers(1, 50, size=(b, k))
        got = kl.grid_positions(ext, base, strides)
        assert got.dtype == np.int64
        assert got.tolist() == _grid_reference(ext.tolist(), base.tolist(), strides.tolist())


@pytest.mark.parametrize("index", [[4, 0, 2, 1, 3], [4, 0, 2], []], ids=["every_row_placed", "rows_dropped", "no_rows"])
def test_padding_maps_both_directions(index):
    """``to_padded`` reads every padded place's packed row (holes where none lands), ``to_packed``
    every packed row's place; from a tensor or a numpy array alike."""
    rows = 6
    for given in (torch.tensor(index, dtype=torch.int64), np.array(index, dtype=np.int64)):
        to_padded, to_packed = kl.padding_maps(given, rows, "cpu")
        want = [index.index(r) if r in index else None for r in range(rows)]
        holes = [r for r, w in enumerate(want) if w is None]
        assert to_padded.safe.tolist() == [0 if w is None else w for w in want]
        assert (to_padded.holes.tolist() if to_padded.holes is not None else []) == holes
        assert to_packed.safe.tolist() == index and to_packed.holes is None


def test_content_entry_counts_the_result_maps_built_later():
    """A plan's result maps (attention scores' element maps, built only when the scores are read
    as rows) are counted when the plan enters the content cache: the entry's bytes are at least
    what its maps hold once built."""
    content.clear()
    ns = [30, 20, 40]
    q = padless.from_list([torch.randn(n, 2, 4) for n in ns])
    k = padless.from_list([torch.randn(n, 2, 4) for n in ns])
    bias = padless.from_list([torch.randn(2, n, n) for n in ns], ragged_dims=(1, 2))
    scores = torch.einsum("bihd,bjhd->bhij", q, k)
    plan = bucketed._plan(["ihd", "jhd"], "hij", [q, k])  # the plan the einsum built
    assert plan is not None
    entry_bytes = [n for key, (v, n) in content._CACHE._data.items() if key[0] == "bucketed" and v[0] is not None]
    assert len(entry_bytes) == 1
    (scores + bias).values()  # read as rows: the result maps are built
    built = lru.nbytes(tuple(plan.packs[i] for i in (0, 1)))
    assert entry_bytes[0] >= built + lru.nbytes(plan.pads)
    assert entry_bytes[0] <= 2 * (built + lru.nbytes(plan.pads) + bucketed.PLAN_PYTHON_BYTES)  # not far above
