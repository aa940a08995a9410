"""Rows read from a dense table in padded coordinates are cached per structure (issue 23).

A table that needs no gradient (rotary cos/sin, built once per forward) is read by every
layer, forward and backward; reads after the first are a lookup. The cache must never serve
stale rows: an in-place change of the table, another table, a table that requires grad.
"""

import gc

import torch

import padless
from padless.ops.common import padded

LENS = [3, 0, 5, 1]


def _q(seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(2, n, 4, generator=g, dtype=torch.float64) for n in LENS], ragged_dims=(1,))


def _per_sample(q, table):
    return [s * table[0, :, : s.shape[1]] for s in q.unbind()]


def test_rotary_style_table_read_by_many_layers_and_its_backward(one_thread):
    q = _q().requires_grad_()
    cos = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64)
    out = q
    for _ in range(3):  # three layers multiply by the same table
        out = out * cos + out
    (out.values() ** 2).sum().backward()
    ref_in = [s.detach().clone().requires_grad_() for s in _q().unbind()]
    tot = 0
    for s in ref_in:
        o = s
        for _ in range(3):
            o = o * cos[0, :, : s.shape[1]] + o
        tot = tot + (o ** 2).sum()
    tot.backward()
    for got, ref in zip(q.grad.unbind(), ref_in):
        torch.testing.assert_close(got, ref.grad)
    cache = padded._read_cache(q)
    assert len(cache) == 1 and next(iter(cache.values()))[0]() is cos


def test_in_place_change_of_the_table_is_read_again(one_thread):
    q = _q()
    t = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64)
    first = q * t
    t.mul_(3.0)
    for got, ref in zip((q * t).unbind(), _per_sample(q, t)):
        torch.testing.assert_close(got, ref)
    for got, ref in zip(first.unbind(), _per_sample(q, t / 3.0)):
        torch.testing.assert_close(got, ref)


def test_another_table_at_a_reused_address_is_not_served_stale_rows(one_thread):
    q = _q()
    for seed in range(4):
        t = torch.full((1, 1, max(LENS), 4), float(seed), dtype=torch.float64)
        for got, ref in zip((q * t).unbind(), _per_sample(q, t)):
            torch.testing.assert_close(got, ref)
        del t
        gc.collect()
    assert len(padded._read_cache(q)) <= padded._READ_CACHE_SIZE


def test_table_that_requires_grad_is_not_cached_and_gets_its_gradient(one_thread):
    q = _q()
    t = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64, requires_grad=True)
    (q * t).values().sum().backward()
    (q * t).values().sum().backward()
    expect = torch.zeros_like(t)
    for s in q.unbind():
        expect[0, :, : s.shape[1]] += 2 * s.sum(0)
    torch.testing.assert_close(t.grad, expect)
    assert not padded._read_cache(q)


def test_rows_written_in_place_through_expand_as_are_read_again(one_thread):
    q = _q()
    t = torch.randn(1, 2, max(LENS), 4, dtype=torch.float64)
    e = t.expand_as(q)  # the NestedTensor's values are the cached rows
    e.values().add_(1.0)
    for got, s in zip((q * t).unbind(), q.unbind()):
        torch.testing.assert_close(got, s * t[0, :, : s.shape[1]])
