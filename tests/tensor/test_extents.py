"""Envelope extents: ``x.shape`` entries at ragged dims remember each sample's own size, so
``F.interpolate(x, size=skip.shape[2:])`` (smp's U-Net decoder) brings every image to its own
skip's size, as the dense code does for each image alone."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.extents import Extent

SKIPS = [(3, 10, 14), (3, 8, 8), (3, 1, 3)]


def _batch(shapes, seed=0, like=None):
    """Samples and their batch; ``like``: a batch of the same samples (padless.same_batch)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    x = padless.from_list(xs)
    if like is not None:
        padless.same_batch(like, x)
    return xs, x


def test_shape_entries_at_ragged_dims_are_extents():
    _, x = _batch(SKIPS)
    s = x.shape
    assert s == torch.Size([3, 3, 10, 14])
    assert [type(v) is Extent for v in s] == [False, False, True, True]
    assert x.size() == s and isinstance(x.size(-1), Extent) and x.size(2) == 10
    assert x.shape[2].per_sample() == [10, 8, 1] and x.shape[3].per_sample() == [14, 8, 3]
    assert type(x.size(1)) is int and type(x.shape[0]) is int


def test_extents_behave_as_plain_ints():
    _, x = _batch(SKIPS)
    h, w = x.shape[2:]
    assert type(int(h)) is int and h * 2 == 20 and h // 4 == 2
    assert (h // 4).per_sample() == [2, 2, 0] and (h * w).per_sample() == [140, 64, 3] and int(h * w) == 140
    assert (2 * h - 1).per_sample() == [19, 15, 1] and (-h).per_sample() == [-10, -8, -1]
    assert type(h / 2) is float and type(h * 1.5) is float
    assert repr(h) == "10" and f"{w}" == "14"
    assert type(copy.deepcopy(h)) is int and type(pickle.loads(pickle.dumps(h))) is int
    assert torch.zeros(x.shape).shape == (3, 3, 10, 14)
    with pytest.raises(IndexError, match="out of range"):
        x.size(4)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("unpack", [False, True])
def test_interpolate_to_each_skip_size(mode, unpack):
    skips, skip = _batch(SKIPS)
    small = [(3, 5, 7), (3, 4, 4), (3, 1, 2)]
    xs, x = _batch(small, seed=1, like=skip)
    x.requires_grad_()
    size = skip.shape[2:]
    if unpack:  # smp: height, width = spatial_shapes[i]; F.interpolate(x, size=(height, width))
        h, w = size
        size = (h, w)
    y = F.interpolate(x, size=size, mode=mode)
    assert y.sizes().tolist() == [list(s) for s in SKIPS]
    g = padless.from_list([torch.randn(*s, dtype=torch.float64) for s in SKIPS])
    (y * g).sum().backward()
    for i, xi in enumerate(xs):  # values and gradients against the dense op on each image alone
        xi_ = xi.detach().clone().requires_grad_()
        want = F.interpolate(xi_[None], size=SKIPS[i][1:], mode=mode)[0]
        torch.testing.assert_close(y.unbind()[i].detach(), want.detach())
        (want * g.unbind()[i]).sum().backward()
        torch.testing.assert_close(x.grad.unbind()[i], xi_.grad)


def test_mixed_and_single_extent_sizes():
    _, skip = _batch(SKIPS)
    _, x = _batch([(3, 5, 7), (3, 4, 4), (3, 1, 2)], seed=1, like=skip)
    h = skip.shape[2]
    assert F.interpolate(x, size=(h, 6)).sizes()[:, 1:].tolist() == [[10, 6], [8, 6], [1, 6]]
    assert F.interpolate(x, size=h).sizes()[:, 1:].tolist() == [[10, 10], [8, 8], [1, 1]]
    # int(...) gives every image the envelope size, as before
    assert F.interpolate(x, size=(int(h), 6)).sizes()[:, 1:].tolist() == [[10, 6]] * 3


def test_extent_from_another_batch_is_refused():
    _, skip = _batch(SKIPS[:2])
    _, x = _batch([(3, 5, 7), (3, 4, 4), (3, 1, 2)], seed=1)
    with pytest.raises(padless.StructureError, match=r"size\[0\] = 10 was read from the shape of a batch of 2 samples.*int\(\.\.\.\)"):
        F.interpolate(x, size=skip.shape[2:])


def test_one_sample_batch():
    skips, skip = _batch([(2, 6, 4)])
    _, x = _batch([(2, 3, 2)], seed=3, like=skip)
    y = F.interpolate(x, size=skip.shape[-2:], mode="bilinear")
    torch.testing.assert_close(y.unbind()[0], F.interpolate(x.unbind()[0][None], size=(6, 4), mode="bilinear")[0])


def test_compiled_shape_is_plain():
    _, x = _batch(SKIPS)

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        return t * t.shape[-1]

    torch.testing.assert_close(f(x).values(), x.values() * 14)


def test_interpolate_to_sizes_computed_from_extents():
    """smp's PAN: ``F.interpolate(x, size=(height // 4, width // 4))`` per image."""
    sizes = [(3, 10, 14), (3, 8, 8), (3, 2, 3)]
    _, skip = _batch(sizes)
    _, x = _batch([(3, 2, 2), (3, 3, 1), (3, 1, 1)], seed=5, like=skip)
    height, width = skip.shape[2:]
    y = F.interpolate(x, size=(height // 2, width // 2), mode="bilinear")
    assert y.sizes()[:, 1:].tolist() == [[5, 7], [4, 4], [1, 1]]
    for got, xi, (c, h, w) in zip(y.unbind(), x.unbind(), sizes):
        torch.testing.assert_close(got, F.interpolate(xi[None], size=(h // 2, w // 2), mode="bilinear")[0])
