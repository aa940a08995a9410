"""Broadcasting ops on few large samples run per sample on views (ops.common.sample_views):
values, gradients and in-place writes against the dense computation on each sample, with the
threshold forced so small random batches (empty samples included) take the path."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.ops.common import sample_views, segment

NS = [3, 0, 5, 1]


@pytest.fixture(autouse=True)
def _force(monkeypatch):
    monkeypatch.setattr(sample_views, "ROWS_PER_SAMPLE", 0)
    calls = []
    real_run, real_seg = sample_views.run, segment._per_sample

    def seg(*a, **k):
        out = real_seg(*a, **k)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(sample_views, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    monkeypatch.setattr(segment, "_per_sample", seg)
    yield calls
    assert calls, "the per-sample path was not taken"


def _nt(shapes, ragged, seed, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]
    return xs, padless.from_list([x.clone() for x in xs], ragged_dims=ragged).requires_grad_(grad)


def test_scores_plus_bias_and_mask_in_place_like_triangle_attention():
    """boltz's ``a += b`` for b in (mask bias (N,1,1,N), triangle bias (1,H,N,N)) on scores
    (N,H,N,N): values and gradients of all three, per sample."""
    H = 2
    s, scores = _nt([(n, H, n, n) for n in NS], (0, 2, 3), 0)
    m, mask = _nt([(n, 1, 1, n) for n in NS], (0, 3), 1)
    t, tri = _nt([(1, H, n, n) for n in NS], (2, 3), 2)
    a = scores * 1.0
    a += mask
    a += tri
    out = torch.softmax(a, -1)
    out.values().pow(2).sum().backward()
    leaves = [[x.clone().requires_grad_() for x in xs] for xs in (s, m, t)]
    refs = [torch.softmax(a_ * 1.0 + b_ + c_, -1) for a_, b_, c_ in zip(*leaves)]
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(out.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for nt, ls in ((scores, leaves[0]), (mask, leaves[1]), (tri, leaves[2])):
        for got, leaf in zip(nt.grad.unbind(), ls):
            torch.testing.assert_close(got, leaf.grad)


def test_outer_product_pair_broadcast_out_of_place():
    xs, x = _nt([(n, 4) for n in NS], (0,), 3)
    p = x.unsqueeze(2) * x.unsqueeze(1) + x.unsqueeze(1)
    p.values().pow(2).sum().backward()
    leaves = [a.clone().requires_grad_() for a in xs]
    refs = [a.unsqueeze(1) * a.unsqueeze(0) + a.unsqueeze(0) for a in leaves]
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(p.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for got, leaf in zip(x.grad.unbind(), leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_three_operands_and_type_promotion():
    _, a = _nt([(n, 1, 3) for n in NS], (0,), 4, grad=False)
    _, b = _nt([(1, n, 3) for n in NS], (1,), 5, grad=False)
    cond = (a > 0)
    out = torch.where(cond, a, b)  # (N, N, 3) from three operands
    for got, c, x, y in zip(out.unbind(), cond.unbind(), a.unbind(), b.unbind()):
        torch.testing.assert_close(got, torch.where(c, x, y))
    ints = padless.from_list([torch.arange(n).view(n, 1) for n in NS])
    fl = padless.from_list([torch.rand(1, n, dtype=torch.float32) for n in NS], ragged_dims=(1,))
    mixed = ints + fl
    assert mixed.dtype == torch.float32
    for got, i, f in zip(mixed.unbind(), ints.unbind(), fl.unbind()):
        torch.testing.assert_close(got, i + f)


def test_one_sample_and_all_empty():
    _, x = _nt([(4, 2)], (0,), 6, grad=False)
    p = x.unsqueeze(2) - x.unsqueeze(1)
    torch.testing.assert_close(p.unbind()[0], x.unbind()[0].unsqueeze(1) - x.unbind()[0].unsqueeze(0))
    e = padless.from_list([torch.zeros(0, 3), torch.zeros(0, 3)])
    q = e.unsqueeze(2) + e.unsqueeze(1)
    assert q.shape[0] == 2 and q.values().shape[0] == 0


@pytest.mark.parametrize("dims", [(1,), (3,), (1, 3), (1, 2)])
def test_segment_sum_and_mean_per_sample(dims):
    """Sums and means over ragged dims of (N, H, N, N) scores (the gradient of a bias, a mean
    over a pair axis), with gradients, per sample; dim 2 is static (heads)."""
    xs, x = _nt([(n, 2, n, n) for n in NS], (0, 2, 3), 7)
    s = x.sum(dim=dims, keepdim=True)
    m = x.mean(dim=dims)
    (s.values().pow(2).sum() if isinstance(s, padless.NestedTensor) else s.pow(2).sum()).backward(retain_graph=True)
    leaves = [a.clone().requires_grad_() for a in xs]
    d = tuple(k - 1 for k in dims)
    refs_s = [a.sum(dim=d, keepdim=True) for a in leaves]
    sum(r.pow(2).sum() for r in refs_s).backward()
    got_s = s.unbind() if isinstance(s, padless.NestedTensor) else list(s)
    for got, want in zip(got_s, refs_s):
        torch.testing.assert_close(got, want.detach())
    for got, leaf in zip(x.grad.unbind(), leaves):
        torch.testing.assert_close(got, leaf.grad)
    got_m = m.unbind() if isinstance(m, padless.NestedTensor) else list(m)
    for got, a in zip(got_m, xs):
        torch.testing.assert_close(got, a.mean(dim=d), equal_nan=True)


def test_frexp_keeps_the_rows_path(_force):
    """two results: the per-sample path stops at the first sample, the rows path answers"""
    _force.append(1)  # the fixture's "path taken" check does not apply here
    a = padless.from_list([torch.rand(n, 1) + 0.5 for n in NS])
    b = padless.from_list([torch.rand(1, n) + 0.5 for n in NS], ragged_dims=(1,))
    m, e = torch.frexp(a * b)
    for mm, ee, x, y in zip(m.unbind(), e.unbind(), a.unbind(), b.unbind()):
        want_m, want_e = torch.frexp(x * y)
        torch.testing.assert_close(mm, want_m)
        assert torch.equal(ee, want_e)


def test_reduction_with_no_group_stays_on_the_graph():
    """a batch whose only sample is empty: the per-sample sum has no group, yet its result is
    still on the autograd graph (found by the differential fuzzer with the paths forced)"""
    x = padless.from_list([torch.zeros(0, 0, 0)], ragged_dims=(0, 1, 2)).requires_grad_()
    s = x.sum(dim=1)
    (s * 2).values().sum().backward()
    assert x.grad.values().shape == (0,) or x.grad.values().numel() == 0
