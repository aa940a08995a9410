"""Softmax over the last ragged dim, one dense call per sample (large samples): each sample's
groups are normalised with the normalised dim last and contiguous (a transposing copy when
static features follow), in one autograd node. Forced on here with ``BUCKET_LIMIT = 0``."""

import pytest
import torch

import padless
from padless.testing import check_samples, leaves


@pytest.fixture
def per_sample(monkeypatch):
    from padless.ops.kernels import softmax as ks

    monkeypatch.setattr(ks, "BUCKET_LIMIT", 0)
    calls = []
    real = ks._RunsSoftmax.apply
    monkeypatch.setattr(ks._RunsSoftmax, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


# (sample shapes, ragged dims, torch dim, reference dim): pair rows with heads after them (the
# triangle-attention layout), a pair without features, tokens with features, heads in the middle
CASES = [
    ([(n, n, 2) for n in (3, 5, 1, 4)], None, 2, 1),
    ([(n, n) for n in (3, 5, 1, 4)], None, 2, 1),
    ([(n, 3) for n in (3, 5, 1, 4)], None, 1, 0),
    ([(n, 2, n) for n in (3, 5, 1, 4)], (0, 2), 3, 2),
    ([(4, 3)], None, 1, 0),  # one sample
]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_per_sample_softmax_matches_each_sample(per_sample, case, log):
    shapes, ragged, dim, ref_dim = CASES[case]
    fn = torch.log_softmax if log else torch.softmax
    x = leaves(shapes, seed=case, ragged=ragged, dtype=torch.float64)
    check_samples(lambda t: fn(t, dim), lambda t: fn(t, ref_dim), [x], atol=1e-10, rtol=1e-10)
    assert per_sample, "the per-sample path did not run"


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_per_sample_softmax_gradients_twice(per_sample, log):
    fn = torch.log_softmax if log else torch.softmax
    x = padless.from_list([torch.randn(n, n, 2, dtype=torch.float64) for n in (2, 3, 1)])
    v = x.values().clone().requires_grad_()

    def f(vals):
        return fn(padless.from_values(vals, sizes=x._sizes, ragged_dims=(0, 1)), 2).values()

    torch.autograd.gradcheck(f, (v,))
    torch.autograd.gradgradcheck(f, (v,))
    assert per_sample


def test_per_sample_softmax_in_a_triangle_attention(per_sample):
    """``softmax(q @ k^T + bias) @ v`` over rows of a pair state, float64, values and gradients."""
    ns = (3, 1, 4)
    q, k, v = (leaves([(n, 2, n, 3) for n in ns], seed=s, ragged=(0, 2), dtype=torch.float64) for s in (1, 2, 3))
    b = leaves([(2, n, n) for n in ns], seed=4, ragged=(1, 2), dtype=torch.float64)

    def run(q, k, v, b):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + b.unsqueeze(-4), -1), v)

    check_samples(run, run, [q, k, v, b], atol=1e-10, rtol=1e-10)
