"""``reshape``/``view`` to targets holding sizes read from a shape (:class:`padless.tensor.extents.Extent`):
each such size is every sample's own, so every sample must come out as the dense reshape of that
sample alone, never as a static reshape the target's ints happen to fit. A sweep over small image
configurations (several B, C and sizes 1..3 per dim) for the two idioms of model code: images to
tokens and back (smp's Segformer, ``x.flatten(2)`` ... ``reshape(B, -1, h, w)``), and token maps
read as images (smp's MAnet, ``(h*w, C) -> (B, C, h, w)``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import padless

HW = list(itertools.product((1, 2, 3), repeat=2))


def _configs():
    """(sizes, C): every configuration of 1 and 2 images, every 7th of 3 images."""
    out = []
    for b in (1, 2, 3):
        for k, sizes in enumerate(itertools.product(HW, repeat=b)):
            if b == 3 and k % 7:
                continue
            for c in (1, 2, 3):
                out.append((list(sizes), c))
    return out


CONFIGS = _configs()


def _images(sizes, c):
    xs = [torch.arange(c * h * w, dtype=torch.float64).view(c, h, w) + 100 * i for i, (h, w) in enumerate(sizes)]
    return xs, padless.from_list(xs, ragged_dims=(1, 2))


# Each idiom: (padless code given the image batch, dense code given one image alone)
def _round_trip(x):  # images -> tokens (C, L) -> images, -1 for the channels
    b, _, h, w = x.shape
    return x.flatten(2).reshape(b, -1, h, w)


def _round_trip_c(x):  # the same with C written out
    b, c, h, w = x.shape
    return x.flatten(2).reshape(b, c, h, w)


def _segformer(x):  # images -> tokens (L, C) -> images (smp's Segformer MLP)
    b, _, h, w = x.shape
    return x.flatten(2).transpose(1, 2).transpose(1, 2).reshape(b, -1, h, w)


def _manet(x):  # token maps (h*w, C) read as (C, h, w) images (smp's MAnet)
    b, c, h, w = x.shape
    return x.flatten(2).transpose(1, 2).reshape(b, c, h, w)


def _manet_minus_one(x):
    b, _, h, w = x.shape
    return x.flatten(2).transpose(1, 2).reshape(b, -1, h, w)


IDIOMS = {
    "round_trip": _round_trip,
    "round_trip_c": _round_trip_c,
    "segformer": _segformer,
    "manet": _manet,
    "manet_minus_one": _manet_minus_one,
}


def _sweep(fn, view: bool = False):
    """Counts of (correct, refused, wrong) over CONFIGS: each sample against ``fn`` on it alone."""
    correct = refused = wrong = 0
    for sizes, c in CONFIGS:
        xs, x = _images(sizes, c)
        try:
            y = fn(x)
        except padless.StructureError:
            refused += 1
            continue
        ok = isinstance(y, padless.NestedTensor) and y.batch_size == len(xs)
        for got, xi in zip(y.unbind() if ok else [], xs):
            ref = fn(xi[None])[0]
            ok = ok and got.shape == ref.shape and torch.equal(got, ref)
        correct += ok
        wrong += not ok
    return correct, refused, wrong


@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_sweep_every_sample_is_its_own_dense_reshape(idiom):
    correct, refused, wrong = _sweep(IDIOMS[idiom])
    assert wrong == 0 and refused == 0 and correct == len(CONFIGS)


def _view_round_trip(x):
    b, _, h, w = x.shape
    return x.flatten(2).view(b, -1, h, w)


def _view_manet(x):
    b, c, h, w = x.shape
    return x.flatten(2).transpose(1, 2).view(b, c, h, w)


def test_view_sweep_is_correct_or_refused():
    """``view`` promises no copy: a split of the rows, or a clear refusal (never a coincidence)."""
    assert _sweep(_view_round_trip) == (len(CONFIGS), 0, 0)
    correct, refused, wrong = _sweep(_view_manet)
    assert wrong == 0 and refused > 0


def test_the_reported_case():
    xs = [torch.arange(4.0).view(2, 1, 2), torch.arange(4.0).view(2, 2, 1)]
    x = padless.from_list(xs, ragged_dims=(1, 2))
    h, w = x.shape[-2:]
    y = x.flatten(2).reshape(2, -1, h, w)  # the ints alone fit a static (1, 2, L) reshape
    assert y.sizes().tolist() == [[2, 1, 2], [2, 2, 1]]
    for got, xi in zip(y.unbind(), xs):
        torch.testing.assert_close(got, xi)
    with pytest.raises(padless.StructureError, match=r"view\(\).*sample 0: \(2, 1, 2\).*Use reshape"):
        x.flatten(2).transpose(1, 2).view(2, 2, h, w)


def test_empty_and_one_sample_batches():
    xs = [torch.randn(3, 2, 2), torch.randn(3, 0, 2), torch.randn(3, 1, 3)]
    x = padless.from_list(xs, ragged_dims=(1, 2))
    b, c, h, w = x.shape
    y = x.flatten(2).reshape(b, c, h, w)
    assert y.sizes().tolist() == [[3, 2, 2], [3, 0, 2], [3, 1, 3]]
    for got, xi in zip(y.unbind(), xs):
        torch.testing.assert_close(got, xi.flatten(1).reshape(3, *xi.shape[1:]))
    one = padless.from_list(xs[:1], ragged_dims=(1, 2))
    b, c, h, w = one.shape
    torch.testing.assert_close(one.flatten(2).transpose(1, 2).reshape(b, c, h, w).unbind()[0],
                               xs[0].flatten(1).transpose(0, 1).reshape(3, 2, 2))


def test_sizes_of_another_batch_are_refused():
    _, x = _images([(1, 2), (2, 1)], 2)
    _, other = _images([(2, 1), (1, 2)], 2)  # as many samples, the same products h_i * w_i
    h, w = other.shape[-2:]
    with pytest.raises(padless.StructureError, match=r"reshape\(\): shape\[2\] = 2 was read from the shape of another batch of 2 samples.*same_batch"):
        x.flatten(2).reshape(2, -1, h, w)
    _, three = _images([(1, 2), (2, 1), (1, 1)], 2)
    with pytest.raises(padless.StructureError, match=r"batch of 3 samples, and this input has 2"):
        x.flatten(2).reshape(2, -1, *three.shape[-2:])


@pytest.mark.parametrize("shapes", [[(1, 1, 2), (1, 1, 3)], [(1, 1, 2)], [(2, 1, 1), (2, 1, 3), (2, 1, 2)]],
                         ids=["two", "one_sample", "three"])  # no empty sample: its -1 is ambiguous alone
def test_a_size_kept_as_a_static_dim_is_read_back_as_int(shapes):
    """``x.reshape(B, -1, s1, s2)`` where every sample has the same ``s1`` (read from the shape):
    the structure keeps that dim static with the plain int, so the result's shape still gives
    an :class:`Extent` for every ragged dim and a window bounded by it is each sample's own
    (the static dim kept the Extent object itself, the shape fell back to plain ints, and
    ``y[..., :y.shape[3] - 1]`` cut every sample at the envelope: seed 313624 of the long
    fuzz run)."""
    xs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    x = padless.from_list(xs, ragged_dims=(1, 2))
    b, _, s1, s2 = x.shape
    y = x.reshape(b, -1, s1, s2)
    assert isinstance(y.shape[-1], padless.tensor.extents.Extent)
    z = y[..., : y.shape[-1] - 1]
    for got, t in zip(z.unbind(), xs):
        u = t.reshape(-1, t.shape[1], t.shape[2])
        torch.testing.assert_close(got, u[..., : u.shape[-1] - 1])
