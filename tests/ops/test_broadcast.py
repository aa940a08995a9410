"""Broadcasting that creates ragged axes (pair states), checked per sample with gradients."""

import pytest
import torch

import padless
from padless.testing import check_samples, leaves


LENS = [3, 5, 0, 1]


def test_square_pair_from_one_single():
    x = leaves([(n, 4) for n in LENS])
    out = check_samples(lambda a: a.unsqueeze(2) + a.unsqueeze(1), lambda a: a.unsqueeze(1) + a.unsqueeze(0), [x])
    assert out.ragged_dims == (0, 1) and out.values().shape == (sum(n * n for n in LENS), 4)


def test_outer_product_from_two_singles():
    u = leaves([(n, 4) for n in LENS], seed=1)
    v = leaves([(n, 4) for n in LENS], seed=2)
    check_samples(lambda a, b: a.unsqueeze(2) * b.unsqueeze(1), lambda a, b: a.unsqueeze(1) * b.unsqueeze(0), [u, v])


def test_rectangular_pairs():
    q = leaves([(n, 3) for n in (2, 4, 1)], seed=1)
    k = leaves([(m, 3) for m in (5, 0, 3)], seed=2)
    out = check_samples(lambda a, b: (a.unsqueeze(2) - b.unsqueeze(1)).relu(), lambda a, b: (a.unsqueeze(1) - b.unsqueeze(0)).relu(), [q, k])
    assert out.sizes()[:, :2].tolist() == [[2, 5], [4, 0], [1, 3]]


def test_pair_plus_single_and_dense():
    p = leaves([(n, n, 4) for n in LENS], seed=3)
    s = leaves([(n, 4) for n in LENS], seed=4)
    w = torch.randn(4)
    check_samples(lambda a, b: a + b.unsqueeze(1) * w, lambda a, b: a + b.unsqueeze(0) * w, [p, s])
    p2 = leaves([(n, n, 4) for n in LENS], seed=3)
    s2 = leaves([(n, 4) for n in LENS], seed=4)
    check_samples(lambda a, b: a * b.unsqueeze(2), lambda a, b: a * b.unsqueeze(1), [p2, s2])


def test_pair_plus_its_transpose():
    p = leaves([(n, n, 2) for n in LENS], seed=5)
    check_samples(lambda a: a + a.transpose(1, 2) * 3, lambda a: a + a.transpose(0, 1) * 3, [p])


def test_mean_keepdim_broadcasts_back():
    p = leaves([(n, n, 2) for n in (2, 4, 3)], seed=6)
    check_samples(lambda a: a - a.mean(dim=2, keepdim=True), lambda a: a - a.mean(dim=1, keepdim=True), [p])


def test_non_leading_layouts():
    x = leaves([(3, n) for n in LENS], seed=7, ragged=(1,))  # (C, N_i)
    out = check_samples(lambda a: a.unsqueeze(-1) * a.unsqueeze(-2), lambda a: a.unsqueeze(-1) * a.unsqueeze(-2), [x])
    assert out.ragged_dims == (1, 2)
    h = leaves([(2, n, n) for n in (3, 1, 4)], seed=8, ragged=(1, 2))  # (H, N_i, N_i)
    s = leaves([(n,) for n in (3, 1, 4)], seed=9)
    check_samples(lambda a, b: a + b.unsqueeze(1).unsqueeze(1), lambda a, b: a + b, [h, s])


def test_pair_ops_reuse_cached_maps():
    x, _ = leaves([(n, 4) for n in LENS])
    a = x.unsqueeze(2) + x.unsqueeze(1)
    b = x.unsqueeze(2) + x.unsqueeze(1)
    assert a._meta is b._meta  # same plan, same output structure object


def test_incompatible_structures_raise():
    a = padless.from_list([torch.randn(2, 1, 4), torch.randn(3, 1, 4)], ragged_dims=(0,))
    b = padless.from_list([torch.randn(1, 2, 4), torch.randn(1, 5, 4)], ragged_dims=(1,))
    a + b  # fine: (2, 2) and (3, 5)
    c = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    d = padless.from_list([torch.randn(2, 4), torch.randn(4, 4)])
    with pytest.raises(ValueError, match=r"mul\(\): ragged structures differ: sample 1 has \(3, 4\), other has \(4, 4\)"):
        c * d
    e = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(ValueError, match=r"sample ranks differ: 2 vs 3 \(unsqueeze explicitly"):
        e + a
    with pytest.raises(ValueError, match=r"in-place op cannot change the structure of its first operand"):
        c.unsqueeze(2).add_(c.unsqueeze(1))


def test_contiguous_relayouts_transposed_pairs():
    p = leaves([(n, n, 2) for n in LENS], seed=11)
    out = check_samples(lambda a: a.transpose(1, 2).contiguous() * 2, lambda a: a.transpose(0, 1) * 2, [p])
    assert out.is_contiguous()
    pt = p[0].transpose(1, 2)
    assert not pt.is_contiguous() and pt.contiguous().is_contiguous()


def test_gradcheck_pair_broadcast():
    values = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 6])

    def f(v):
        x = padless.from_values(v, offsets)
        p = x.unsqueeze(2) * x.unsqueeze(1)
        return (p + p.transpose(1, 2)).mean(dim=2).values()

    assert torch.autograd.gradcheck(f, (values,))
