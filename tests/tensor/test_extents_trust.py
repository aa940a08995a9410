"""Envelope extents that never give a silent wrong size and never keep a batch alive
(padless.tensor.extents, padless.tensor.lineage): what an Extent holds, how it pickles, which
batch it applies to, and ``max``/``min`` of extents."""

from __future__ import annotations

import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.core import NestedTensor, StructureMeta
from padless.tensor.extents import Extent


def _images(sizes, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(c, h, w, generator=g, dtype=torch.float64) for h, w in sizes]
    return xs, padless.from_list(xs, ragged_dims=(1, 2))


# ---------------------------------------------------------------------------- what an extent holds


def test_keeping_shapes_keeps_no_batch():
    """A log of ``x.shape`` / ``x.size(d)`` / sizes computed from them keeps a few ints per step:
    the batches, their structures and their caches are freed."""
    kept, refs = [], []
    for step in range(12):
        _, x = _images([(2 + step % 3, 4), (5, 1 + step % 2)], seed=step)
        t = x.flatten(2)
        x.row_sample_ids()  # a cache on the structure
        h, w = x.shape[2:]
        kept.append((x.shape, x.size(3), h * w, h // 2, t.shape))
        refs += [weakref.ref(x._values), weakref.ref(x._sizes), weakref.ref(x.row_sample_ids()), weakref.ref(t._sizes)]
        del x, t, h, w
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    shape, w, hw, half, tokens = kept[1]  # sizes stay readable: they are host ints
    assert shape[2].per_sample() == [3, 5] and w.per_sample() == [4, 2] and hw.per_sample() == [12, 10]
    assert half.per_sample() == [1, 2] and tokens[2].per_sample() == [12, 10]


def test_a_kept_shape_costs_a_few_hundred_bytes():
    """What one kept ``x.shape`` of a 4-sample batch with two ragged dims holds once the batch is
    freed (Python allocations, traced): the ``torch.Size``, two ints and their 4 sizes each, and the
    lineage's weak reference; about 500 bytes (800 when every extent carried an instance dict)."""
    import tracemalloc

    from padless.tensor import extents

    def batch(i):
        return padless.from_list([torch.zeros(1, 2 + i % 7, 3 + i % 5), torch.zeros(1, 9, 2), torch.zeros(1, 4, 6),
                                  torch.zeros(1, 1, 1)], ragged_dims=(1, 2))

    batch(0).shape  # noqa: B018  (imports and first-call caches)
    n = 300
    gc.collect()
    live = len(extents._STATE)
    tracemalloc.start()
    try:
        kept = [batch(i).shape for i in range(n)]
        gc.collect()
        held, states = tracemalloc.get_traced_memory()[0], len(extents._STATE)
        del kept
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # (the table's own slots, about 40 bytes an extent, stay allocated for the next ones)
    assert freed / n <= 640, f"a kept shape holds {freed / n:.0f} bytes"
    assert states == live + 2 * n and len(extents._STATE) == live  # a freed extent leaves no entry behind


def test_equal_sizes_of_one_read_are_one_extent():
    x = padless.from_list([torch.zeros(3, 3, 2), torch.zeros(5, 5, 2)], ragged_dims=(0, 1))
    n, m = x.shape[1:3]
    assert n is m and n.per_sample() == [3, 5] and (n * m).per_sample() == [9, 25]
    with pytest.raises(TypeError, match="read from a NestedTensor's shape"):
        Extent(3)


def test_arithmetic_dividing_by_an_empty_sample_fails_only_where_used():
    x = padless.from_list([torch.zeros(4, 2), torch.zeros(0, 2)])
    n = x.shape[1]
    q = 8 // n  # the padded int is 8 // 4; sample 1 divides by 0
    assert int(q) == 2
    with pytest.raises(ZeroDivisionError):
        q.per_sample()
    assert (n // 2).per_sample() == [2, 0]


def test_device_batch_without_host_metadata_reads_sizes_lazily():
    def device_like(x):  # as a device batch built without host metadata
        return NestedTensor(x._values, x._offsets, x._sizes.clone(), x._ragged, x._env, StructureMeta())

    x = device_like(padless.from_list([torch.randn(2, 3), torch.randn(5, 3)]))
    n = x.shape[1]
    assert x._meta.host_sizes is None and n.per_sample() == [2, 5]  # read while the batch lives (a sync on a device)
    y = device_like(padless.from_list([torch.randn(3, 3), torch.randn(4, 3)]))
    lazy, sizes = y.shape[1], weakref.ref(y._sizes)
    del y
    gc.collect()
    assert sizes() is None  # the kept size did not keep the batch
    assert sizes() is None  # the kept size did not keep the batch
    with pytest.raises(padless.StructureError, match="used after the batch was freed.*never read"):
        lazy.per_sample()


def test_shapes_pickle_as_plain_ints():
    _, x = _images([(2, 3), (4, 1)])
    h, w = x.shape[2:]
    assert b"padless" not in pickle.dumps(x.shape) and b"builtins" not in pickle.dumps(x.shape)
    buf = io.BytesIO()
    torch.save({"shape": x.shape, "h": h, "hw": h * w, "tail": x.shape[2:], "t": tuple(x.shape)}, buf)
    buf.seek(0)
    got = torch.load(buf, weights_only=True)
    assert got["shape"] == torch.Size([2, 2, 4, 3]) and type(got["shape"]) is torch.Size
    assert all(type(v) is int for v in (*got["shape"], got["h"], got["hw"], *got["tail"], *got["t"]))
    assert (got["h"], got["hw"]) == (4, 12)


# ---------------------------------------------------------------------------- which batch


def test_size_kept_from_another_batch_is_refused():
    """A size kept from an earlier batch of as many samples would give every sample that batch's
    sizes: refused, naming the rewrite, whether the earlier batch is alive or gone."""
    _, old = _images([(4, 4), (2, 6)])
    size = old.shape[2:]  # e.g. a module's last input size
    _, x = _images([(3, 5), (5, 3)], seed=1)
    with pytest.raises(padless.StructureError, match=r"interpolate\(\): size\[0\] = 4 was read from the shape of another "
                                                      r"batch of 2 samples.*Read the size from this batch's shape.*size=other"):
        F.interpolate(x, size=size)
    with pytest.raises(padless.StructureError, match=r"unflatten\(\): sizes\[0\] = 4 .*another batch"):
        x.flatten(2).unflatten(2, size)
    del old
    gc.collect()
    with pytest.raises(padless.StructureError, match="a batch that no longer exists"):
        F.interpolate(x, size=size)
    h, w = x.shape[2:]  # the rewrite
    assert F.interpolate(x, size=(h, w)).sizes()[:, 1:].tolist() == [[3, 5], [5, 3]]
    assert F.interpolate(x, size=tuple(int(s) for s in size)).sizes()[:, 1:].tolist() == [[4, 6]] * 2


def test_sizes_apply_to_what_ops_made_from_the_batch():
    xs, x = _images([(4, 6), (6, 2), (2, 2)])
    skip = x.shape[2:]
    y = F.avg_pool2d(torch.relu(x * 2), 2)  # another structure, the same samples
    up = F.interpolate(y, size=skip, mode="nearest")
    for got, xi in zip(up.unbind(), xs):
        ref = F.interpolate(F.avg_pool2d(torch.relu(xi[None] * 2), 2), size=xi.shape[1:], mode="nearest")[0]
        torch.testing.assert_close(got, ref)
    b, c, h, w = x.shape
    back = x.flatten(2).transpose(1, 2).transpose(1, 2).reshape(b, -1, h, w)
    torch.testing.assert_close(back.values(), x.values())


def test_fields_of_one_collated_batch_are_one_batch():
    g = torch.Generator().manual_seed(0)
    samples = [{"img": torch.randn(2, h, w, generator=g), "mask": torch.randn(1, 2 * h, 2 * w, generator=g)}
               for h, w in [(2, 3), (4, 1)]]
    for batch in (padless.collate(samples), pickle.loads(pickle.dumps(padless.collate(samples))),
                  padless.Collator()(samples), pickle.loads(pickle.dumps(padless.Collator()(samples)))):
        img, mask = batch["img"], batch["mask"]
        assert img._lineage is not None and img._lineage is mask._lineage
        up = F.interpolate(img, size=mask.shape[-2:])
        assert up.sizes()[:, 1:].tolist() == [[4, 6], [8, 2]]


def test_same_batch_declares_separately_built_batches():
    _, img = _images([(2, 3), (4, 1)])
    _, mask = _images([(4, 6), (8, 2)], c=1, seed=1)
    with pytest.raises(padless.StructureError, match="another batch"):
        F.interpolate(img, size=mask.shape[-2:])
    assert padless.same_batch(img, mask) == (img, mask)
    assert F.interpolate(img, size=mask.shape[-2:]).sizes()[:, 1:].tolist() == [[4, 6], [8, 2]]
    _, three = _images([(1, 1)] * 3)
    with pytest.raises(padless.StructureError, match="argument 1 has 3 samples, argument 0 has 2"):
        padless.same_batch(img, three)
    with pytest.raises(TypeError, match="not a NestedTensor"):
        padless.same_batch(img, torch.zeros(2))


def test_a_tensor_of_unknown_batch_takes_live_sizes_only():
    """A NestedTensor made outside padless' ops and constructors (a compiled region's output) has
    no lineage: sizes of a batch that still lives apply, sizes of a freed batch are refused."""
    _, x = _images([(2, 3), (4, 1)])
    orphan = NestedTensor(x._values, x._offsets, x._sizes, x._ragged, x._env, x._meta)
    assert orphan._lineage is None
    assert F.interpolate(orphan, size=x.shape[2:]).sizes()[:, 1:].tolist() == [[2, 3], [4, 1]]
    _, gone = _images([(3, 3), (1, 1)], seed=2)
    size = gone.shape[2:]
    del gone
    gc.collect()
    with pytest.raises(padless.StructureError, match="no longer exists"):
        F.interpolate(orphan, size=size)


# ---------------------------------------------------------------------------- max / min


def test_max_of_extents_whose_order_differs_between_samples_is_refused():
    xs, x = _images([(1, 2), (2, 1)])
    h, w = x.shape[2:]
    with pytest.raises(padless.StructureError, match=r"2 > 2: .*order\s+differs between samples.*sample 0 has 2 > 1.*padless\.extent_max"):
        max(h, w)
    with pytest.raises(padless.StructureError, match="extent_min"):
        min(h, w)
    side = padless.extent_max(h, w)
    assert side == 2 and side.per_sample() == [2, 2] and padless.extent_min(h, w).per_sample() == [1, 1]
    y = F.interpolate(x, size=(side, side))
    for got, xi in zip(y.unbind(), xs):
        s = max(xi.shape[1:])
        torch.testing.assert_close(got, F.interpolate(xi[None], size=(s, s))[0])


def test_common_comparisons_keep_working():
    _, x = _images([(5, 2), (3, 1), (0, 0)])
    h, w = x.shape[2:]
    assert max(h, w) is h and min(h, w) is w  # every sample orders them as the envelope does
    assert max(h, w).per_sample() == [5, 3, 0]
    assert (h > 4) is True and (w < 2) is False and h == 5 and h != w  # with ints: the envelope
    assert x.shape == torch.Size([3, 2, 5, 2]) and sorted([w, h]) == [2, 5]
    assert padless.extent_max(h, 4).per_sample() == [5, 4, 4] and padless.extent_max(7, 4) == 7
    assert padless.extent_min([h, w, 1]).per_sample() == [1, 1, 0]
    _, other = _images([(1, 1)] * 3, seed=3)
    with pytest.raises(padless.StructureError, match="two different batches"):
        padless.extent_max(h, other.shape[2])


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_every_result_keeps_its_batch_lineage(mode):
    """Results of one batch stay that batch (sizes read from their shapes are checked and map
    through folds): a broadcast that builds pairs with autograd, return_types results
    (``max(dim).values``), stacked batches under inference mode. The first lost it and a fold
    written with its sizes was refused (long fuzz run, seed 310579)."""
    xs = [torch.randn(n, n, 2, dtype=torch.float64) for n in (2, 1, 0)]
    ctx = torch.inference_mode() if mode == "inference" else torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with ctx:
        x = padless.from_list(xs, ragged_dims=(0, 1), requires_grad=mode == "grad")
        token = x._lineage
        t = x.sum(dim=1, keepdim=True) * x.sum(dim=2, keepdim=True)
        y = x[:2]  # no empty sample: max over a ragged dim
        results = [t, torch.stack([x * 2, x.clone()]).sum(0), torch.stack([x, x])[1]]
        assert y.max(dim=2).values._lineage is y._lineage and y.min(dim=1)[0]._lineage is y._lineage
        assert all(r._lineage is token for r in results)
        b, n, m = t.shape[0], t.shape[1], t.shape[2]
        folded = t.reshape(b * n, m, 2)
        back = (folded - folded.mean(1, keepdim=True)).reshape(b, n, m, 2)
    for got, d in zip(back.unbind(), xs):
        td = d.sum(0, keepdim=True) * d.sum(1, keepdim=True)
        torch.testing.assert_close(got, td - td.mean(1, keepdim=True))


def test_rows_of_a_transposed_batch_view_back_in_its_batch():
    """``reshape(-1, C)`` of pairs stored transposed goes through a contiguous copy: the rows
    still belong to the batch, so sizes read from its shape apply to the result viewed back."""
    xs = [torch.randn(n, n, 1) for n in (2, 2, 1)]
    x = padless.from_list(xs, ragged_dims=(0, 1))
    t = x.transpose(2, 1)
    back = torch.tanh(t.reshape(-1, 1)).view(t.shape)
    assert back._lineage is x._lineage
    for got, d in zip(back.unbind(), xs):
        torch.testing.assert_close(got, torch.tanh(d.transpose(0, 1)))
