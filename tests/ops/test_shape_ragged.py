"""Reshapes that merge or split ragged dims (padless.ops.rows.shape_ragged), sample by sample
against the dense code on each sample: smp Segformer's ``t.reshape(B, -1, height, width)``
of tokens, ``x.view(B, -1, C)`` of ``(H_i, W_i, C)``, ``unflatten`` with sizes read from a shape."""

from __future__ import annotations

import pytest
import torch

import padless

SIZES = [(4, 6), (6, 4), (0, 3), (2, 3)]


def _images(sizes, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(c, h, w, generator=g, dtype=torch.float64) for h, w in sizes]
    return xs, padless.from_list([x.clone() for x in xs], ragged_dims=(1, 2)).requires_grad_()


def segformer_mlp(x, lin):  # smp's Segformer MLP: (B, C, H, W) -> tokens -> linear -> back
    batch, _, height, width = x.shape
    t = x.flatten(2).transpose(1, 2)
    t = lin(t)
    return t.transpose(1, 2).reshape(batch, -1, height, width)


@pytest.mark.parametrize("sizes", [SIZES, SIZES[:1]], ids=["batch", "one_image"])
def test_split_by_extents_values_and_grads(sizes):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5).double()
    xs, x = _images(sizes)
    y = segformer_mlp(x, lin)
    assert y.ragged_dims == (1, 2) and y.sizes().tolist() == [[5, h, w] for h, w in sizes]
    g = [torch.randn(5, h, w, dtype=torch.float64) for h, w in sizes]
    (y * padless.from_list(g, ragged_dims=(1, 2))).values().sum().backward()
    for i, xi in enumerate(xs):
        if xi.numel() == 0:  # the dense code cannot infer -1 for an empty image; padless keeps it empty
            assert y.unbind()[i].shape == (5, *xi.shape[1:]) and x.grad.unbind()[i].abs().sum() == 0
            continue
        xi = xi.clone().requires_grad_()
        ref = segformer_mlp(xi[None], lin)[0]
        torch.testing.assert_close(y.unbind()[i].detach(), ref.detach())
        (ref * g[i]).sum().backward()
        torch.testing.assert_close(x.grad.unbind()[i], xi.grad)


def test_merge_adjacent_ragged_dims_with_minus_one():
    xs, x = _images(SIZES)
    hwc = x.permute(0, 2, 3, 1)
    z = hwc.view(x.shape[0], -1, 3)
    assert z.ragged_dims == (0,) and z.sizes()[:, 0].tolist() == [h * w for h, w in SIZES]
    for zi, xi in zip(z.unbind(), xs):
        torch.testing.assert_close(zi.detach(), xi.permute(1, 2, 0).reshape(-1, 3))
    pair = padless.from_list([torch.randn(n, n) for n in (3, 1, 2)])
    flat = pair.view(3, -1)
    assert flat.sizes()[:, 0].tolist() == [9, 1, 4]


def test_unflatten_by_extents_and_round_trip():
    xs, x = _images(SIZES)
    h, w = x.shape[2:]
    tokens = x.flatten(2)
    back = tokens.unflatten(2, (h, w))
    assert back.sizes().tolist() == x.sizes().tolist()
    torch.testing.assert_close(back.values(), x.values())
    # a product of extents splits a merged pair map back (smp MAnet: view(B, h * w, h * w))
    m = padless.from_list([torch.randn(n * n) for n in (2, 3)])
    p = padless.from_list([torch.randn(n, 1) for n in (2, 3)])
    padless.same_batch(m, p)  # built separately from the same samples
    n = p.shape[1]
    assert m.view(2, n, n).sizes().tolist() == [[2, 2], [3, 3]]


def test_split_that_does_not_fit_a_sample_is_refused():
    _, x = _images(SIZES)
    _, other = _images([(4, 6), (6, 4), (1, 3), (2, 3)], seed=1)
    padless.same_batch(x, other)  # declared the same samples: the sizes are checked sample by sample
    h, w = other.shape[2:]
    with pytest.raises(padless.StructureError, match=r"sample 2 has 0 entries along dim 2, but its sizes \(1, 3\) hold 3"):
        x.flatten(2).unflatten(2, (h, w))
    # a reshape by sizes that do not hold a sample's elements names the sample
    with pytest.raises(padless.StructureError, match=r"sample 2 holds 0 elements, its target shape \(3, 1, 3\) holds 9"):
        x.flatten(2).reshape(4, 3, h, w)


def manet_map(x, lin):  # smp's MAnet position attention ends with a reshape that reinterprets memory
    batch, c, height, width = x.shape
    t = lin(x.flatten(2).transpose(1, 2))  # (B, HW, C) tokens
    return t.reshape(batch, c, height, width)  # (HW, C) memory read as (C, H, W)


@pytest.mark.parametrize("sizes", [SIZES, SIZES[:1]], ids=["batch", "one_image"])
def test_reinterpreting_reshape_values_and_grads(sizes):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    xs, x = _images(sizes, seed=1)
    y = manet_map(x, lin)
    assert y.ragged_dims == (1, 2)
    y.values().pow(2).sum().backward()
    got_w = lin.weight.grad.clone()
    lin.zero_grad()
    leaves = [a.clone().requires_grad_() for a in xs]
    refs = [manet_map(a[None], lin)[0] for a in leaves]
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(y.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for got, leaf in zip(x.grad.unbind(), leaves):
        torch.testing.assert_close(got, leaf.grad)
    torch.testing.assert_close(got_w, lin.weight.grad)


def test_reinterpreting_reshape_infers_one_minus_one_per_sample():
    sizes = [s for s in SIZES if 0 not in s]
    xs, x = _images(sizes, c=4, seed=2)
    b, c, h, w = x.shape
    t = x.detach().flatten(2).transpose(1, 2)
    y = t.reshape(b, -1, h, w)  # the -1 is each sample's c
    for got, a in zip(y.unbind(), xs):
        torch.testing.assert_close(got, a.flatten(1).transpose(0, 1).reshape(-1, a.shape[1], a.shape[2]))
    _, x = _images(SIZES, c=4, seed=2)  # an empty image: the -1 could be anything, as torch says
    t = x.detach().flatten(2).transpose(1, 2)
    with pytest.raises(padless.StructureError, match="sample 2 holds 0 elements.*could be any size"):
        t.reshape(x.shape[0], -1, *x.shape[2:])


def test_reinterpreting_reshape_that_loses_elements_is_refused_and_view_is_not_a_copy():
    _, x = _images(SIZES, seed=3)
    b, c, h, w = x.shape
    t = x.detach().flatten(2).transpose(1, 2)
    with pytest.raises(padless.StructureError, match="sample 0 holds 72 elements"):
        t.reshape(b, c + 1, h, w)
    with pytest.raises(padless.StructureError):
        t.view(b, c, h, w)  # view promises no copy: the usual refusal
