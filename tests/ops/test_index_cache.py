"""Index maps cached by content (tensor.layout.row_coords, ops.common.structure.derived_tensor):
structures of one batch share their rows' coordinates and reduction groups, and a cached map
is never served to a structure whose rows differ (other extents, another storage order)."""

from __future__ import annotations

import torch

import padless
from padless.ops.common import structure
from padless.tensor import layout


def _pairs(ns, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(n, n, c, generator=g) for n in ns], ragged_dims=(0, 1))


def test_row_coords_by_content_equal_to_fresh_and_shared():
    layout._COORDS.clear()
    sizes = torch.tensor([[3, 2], [0, 4], [1, 1]])
    counts = sizes.prod(1)
    offsets = layout.offsets_from_counts(counts)
    total = int(offsets[-1])
    for ragged in ((0, 1), (1, 0)):
        want_sid, want = layout._row_coords(sizes, offsets, ragged, total)
        sid, got = layout.row_coords(sizes.clone(), offsets.clone(), ragged, total)  # other objects
        sid2, got2 = layout.row_coords(sizes.clone(), offsets.clone(), ragged, total)  # a hit
        assert sid2 is sid and all(a is b for a, b in zip(got, got2))
        torch.testing.assert_close(sid, want_sid)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    # the two storage orders differ, and each got its own entry
    _, c01 = layout.row_coords(sizes, offsets, (0, 1), total)
    _, c10 = layout.row_coords(sizes, offsets, (1, 0), total)
    assert not torch.equal(c01[1], c10[0])


def test_row_coords_cache_is_bounded(monkeypatch):
    layout._COORDS.clear()
    layout._coords_elements[0] = 0
    monkeypatch.setattr(layout, "COORDS_CACHE_ELEMENTS", 400)
    for n in range(2, 12):
        sizes = torch.tensor([[n], [n + 1]])
        offsets = layout.offsets_from_counts(sizes[:, 0])
        layout.row_coords(sizes, offsets, (0,), int(offsets[-1]))
    assert layout._coords_elements[0] <= 400
    assert sum(s.numel() * (1 + len(c)) for s, c in layout._COORDS.values()) == layout._coords_elements[0]
    layout._COORDS.clear()
    layout._coords_elements[0] = 0


def test_reduction_groups_shared_between_structures_of_one_batch_and_correct():
    """A softmax over the last dim of two different structures with the same rows (a linear
    of the batch) reuses the groups; a batch with other sizes, or the transposed storage
    order, gets its own, and every result equals the dense computation per sample."""
    x = _pairs([3, 0, 5, 1])
    w = torch.randn(3, 4)
    y = x @ w  # another structure (static extent 4), the same rows
    for t in (x, y, x.transpose(1, 2), _pairs([2, 4, 1, 3], seed=1)):
        out = torch.softmax(t, dim=2)
        for got, s in zip(out.unbind(), t.unbind()):
            torch.testing.assert_close(got, torch.softmax(s, dim=1))
        out = t.sum(dim=1)
        for got, s in zip(out.unbind(), t.unbind()):
            torch.testing.assert_close(got, s.sum(dim=0))
    key = next(k for k in structure._CONTENT if k[0][0] == "groups")
    assert key[2] in ((0, 1), (1, 0))


def test_content_cache_is_bounded(monkeypatch):
    structure._CONTENT.clear()
    structure._content_elements[0] = 0
    monkeypatch.setattr(structure, "CONTENT_CACHE_ELEMENTS", 2000)
    for k in range(12):
        x = _pairs([k + 2, k + 3], seed=k)
        torch.softmax(x, dim=2)
        assert structure._content_elements[0] <= 2000
    structure._CONTENT.clear()
    structure._content_elements[0] = 0
