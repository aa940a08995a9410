"""Index maps cached by content (tensor.layout.row_coords, ops.common.structure.derived_tensor):
structures of one batch share their rows' coordinates and reduction groups, and a cached map
is never served to a structure whose rows differ (other extents, another storage order)."""

from __future__ import annotations

import torch

import padless
from padless.ops.common import content
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


def test_row_coords_cache_is_bounded_by_bytes(monkeypatch):
    layout._COORDS.clear()
    monkeypatch.setattr(layout._COORDS, "max_bytes", 8000)
    for n in range(2, 12):
        sizes = torch.tensor([[n], [n + 1]])
        offsets = layout.offsets_from_counts(sizes[:, 0])
        layout.row_coords(sizes, offsets, (0,), int(offsets[-1]))
    assert 0 < layout._COORDS.held_bytes <= 8000
    assert len(layout._COORDS) < 10
    layout._COORDS.clear()


def test_row_coords_cache_is_bounded_by_entries():
    """Tiny batches that never repeat (1,000 collated batches) used to stay under the byte bound
    and grow the cache without end (+31.8 MiB): the entry bound stops them."""
    layout._COORDS.clear()
    for n in range(512):
        sizes = torch.tensor([[n + 1], [2 * n + 1]])
        offsets = layout.offsets_from_counts(sizes[:, 0])
        sid, (c,) = layout.row_coords(sizes, offsets, (0,), int(offsets[-1]))
        assert torch.equal(c, torch.cat([torch.arange(n + 1), torch.arange(2 * n + 1)]))
    assert len(layout._COORDS) == 256
    layout._COORDS.clear()


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
    assert any(k[0][0] == "groups" for k in content._CACHE)


def test_content_cache_is_bounded(monkeypatch):
    content.clear()
    monkeypatch.setattr(content._CACHE, "max_bytes", 40000)
    for k in range(12):
        x = _pairs([k + 2, k + 3], seed=k)
        torch.softmax(x, dim=2)
        x.unsqueeze(2) * x.unsqueeze(1)  # a broadcast plan
        assert 0 < content.held() <= 40000
    content.clear()


def _random_layout(g, b, k, lo=0, hi=5):
    sizes = torch.randint(lo, hi, (b, k + 1), generator=g)
    sizes[:, k] = 3  # a static dim
    return sizes


def test_per_sample_maps_equal_the_vectorised_ones(monkeypatch):
    """The per-sample builds of row coordinates and broadcast/relayout rows (host metadata with
    many rows per sample) give exactly the vectorised maps, on random layouts with empty
    samples, extents of 1 that broadcast, and every storage order."""
    import itertools

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        b = int(torch.randint(1, 5, (1,), generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        out_sizes = _random_layout(g, b, k)
        order = list(itertools.permutations(range(k)))[trial % len(list(itertools.permutations(range(k))))]
        out_ragged = tuple(order)
        out_offsets = layout.offsets_from_counts(layout.row_counts(out_sizes, out_ragged))
        total = int(out_offsets[-1])
        # a source that broadcasts: some ragged dims of extent 1 (or static there), any storage order
        src_dims = [d for d in range(k) if bool(torch.rand(1, generator=g) < 0.7)] or [0]
        src_sizes = out_sizes.clone()
        for d in range(k):
            if d not in src_dims or bool(torch.rand(1, generator=g) < 0.3):
                src_sizes[:, d] = 1
        src_ragged = tuple(src_dims[::-1] if trial % 2 else src_dims)
        src_offsets = layout.offsets_from_counts(layout.row_counts(src_sizes, src_ragged))
        monkeypatch.setattr(layout, "PER_SAMPLE_ROWS", 10**9)
        layout._COORDS.clear()
        want_sid, want = layout.row_coords(out_sizes, out_offsets, out_ragged, total)
        want_rows = layout.broadcast_rows(out_sizes, out_offsets, out_ragged, src_sizes, src_offsets, src_ragged, total)
        monkeypatch.setattr(layout, "PER_SAMPLE_ROWS", 0)
        layout._COORDS.clear()
        sid, got = layout.row_coords(out_sizes, out_offsets, out_ragged, total)
        rows = layout.broadcast_rows(out_sizes, out_offsets, out_ragged, src_sizes, src_offsets, src_ragged, total)
        assert torch.equal(sid, want_sid)
        for a, c in zip(got, want):
            assert torch.equal(a, c)
        assert torch.equal(rows, want_rows), (out_sizes.tolist(), out_ragged, src_sizes.tolist(), src_ragged)
    layout._COORDS.clear()


def test_pair_ops_with_per_sample_maps_match_dense(monkeypatch):
    """End to end with the per-sample builds forced: pair broadcasting, a transposed pair
    (relayout) and its gradient, per sample against the dense computation."""
    monkeypatch.setattr(layout, "PER_SAMPLE_ROWS", 0)
    layout._COORDS.clear()
    content.clear()
    g = torch.Generator().manual_seed(2)
    ns = [3, 0, 5, 1]
    xs = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in ns]
    x = padless.from_list([t.clone() for t in xs]).requires_grad_()
    p = x.unsqueeze(2) * x.unsqueeze(1)
    q = p + p.transpose(1, 2) * 2
    q.values().pow(2).sum().backward()
    leaves = [t.clone().requires_grad_() for t in xs]
    refs = []
    for t in leaves:
        pp = t.unsqueeze(1) * t.unsqueeze(0)
        refs.append(pp + pp.transpose(0, 1) * 2)
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(q.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for got, t in zip(x.grad.unbind(), leaves):
        torch.testing.assert_close(got, t.grad)
    layout._COORDS.clear()
    content.clear()


def test_contraction_plans_shared_by_content(monkeypatch):
    """A bucketed contraction on other structure objects with the same rows (the next layer of a
    stack, a new batch object of the same sizes) reuses the plan's index maps: no new plan, its
    own result metadata, results equal per sample; other rows build their own plan."""
    from padless.ops.pairs import bucketed

    content.clear()
    built = []
    real = bucketed._build
    monkeypatch.setattr(bucketed, "_build", lambda *a, **k: built.append(1) or real(*a, **k))
    ns = (3, 0, 5, 2)
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for n in ns]
    ks = [torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for n in ns]
    outs = []
    for _ in range(2):  # two batch objects with the same rows
        q, k = padless.from_list(qs), padless.from_list(ks)
        outs.append(torch.einsum("bihd,bjhd->bhij", q, k))
    assert len(built) == 1
    assert outs[0]._meta is not outs[1]._meta
    for out in outs:
        for got, a, b in zip(out.unbind(), qs, ks):
            torch.testing.assert_close(got, torch.einsum("ihd,jhd->hij", a, b))
    q2 = padless.from_list([torch.randn(n + 1, 2, 4, dtype=torch.float64) for n in ns])
    torch.einsum("bihd,bjhd->bhij", q2, q2)
    assert len(built) == 2
