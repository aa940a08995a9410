"""Structures that come back: an attention block's split heads / transpose / merge heads and a
feed-forward's two linears return the structure they started from (so every layer of a stack
reads one structure and the plans cached on it), and the reshape that keeps the leading dims
(``q.view(*x.shape[:-1], -1, d)``) answers from host metadata. Values and gradients stay each
sample's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.errors import StructureError

LENGTHS = [[3, 0, 5], [4], [2, 6, 1, 6]]


def _batch(lengths, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g) for n in lengths]


def _block(x, w_in, w_out, heads=2, causal=False):
    """One transformer block written as transformers writes it: split heads, attend, merge, FFN
    (a dense sample of no token cannot infer its head count: it is given)."""
    shape = x.shape[:-1]
    split = -1 if isinstance(x, padless.NestedTensor) else heads
    q = F.linear(x, w_in).view(*shape, split, x.shape[-1] // heads).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, q, q, is_causal=causal)
    o = o.reshape(o.shape[0], split, q.shape[2], q.shape[-1]).transpose(1, 2).contiguous()
    h = x + o.reshape(*shape, -1 if split == -1 else x.shape[-1]).contiguous()
    return h + F.linear(F.gelu(F.linear(h, w_out)), w_out.t())


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_block_returns_its_structure_and_each_samples_values(lengths, causal):
    xs = _batch(lengths)
    g = torch.Generator().manual_seed(1)
    w_in, w_out = torch.randn(8, 8, generator=g) * 0.3, torch.randn(16, 8, generator=g) * 0.3
    x = padless.from_list([t.clone().requires_grad_() for t in xs])
    x = x.detach().requires_grad_()
    y = _block(x, w_in, w_out, causal=causal)
    z = _block(y, w_in, w_out, causal=causal)  # a second layer on what the first returned
    assert y._meta is x._meta and z._meta is x._meta  # one structure for the whole stack
    z.values().pow(2).sum().backward()
    for i, t in enumerate(xs):
        ti = t.clone().requires_grad_()
        zi = _block(_block(ti[None], w_in, w_out, causal=causal), w_in, w_out, causal=causal)[0]
        zi.pow(2).sum().backward()
        torch.testing.assert_close(z[i], zi, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(x.grad[i], ti.grad, atol=1e-4, rtol=1e-4)


def test_split_heads_transpose_and_merge_come_back_to_the_same_structures():
    x = padless.from_list(_batch([3, 1, 4]))
    h = x.view(*x.shape[:-1], -1, 4)
    t = h.transpose(1, 2)
    assert t.transpose(1, 2)._meta is h._meta
    assert t.reshape(t.shape[0], -1, t.shape[2], 4)._meta is t._meta  # the same dims: the same structure
    assert h.reshape(*x.shape[:-1], -1)._meta is x._meta
    wide = F.linear(x, torch.randn(16, 8))
    assert wide._meta is not x._meta and F.linear(wide, torch.randn(8, 16))._meta is x._meta
    for i, s in enumerate(x.unbind()):
        torch.testing.assert_close(t[i], s.view(s.shape[0], -1, 4).transpose(0, 1))


def test_keep_leading_reshape_is_each_samples_reshape():
    x = padless.from_list(_batch([3, 0, 5]))
    for target, dense in (((-1, 4), lambda s: s.view(s.shape[0], 2, 4)), ((2, 4), lambda s: s.view(s.shape[0], 2, 4)),
                          ((2, -1, 2), lambda s: s.reshape(s.shape[0], 2, 2, 2))):  # (-1 inferred from the static width)
        y = x.reshape(*x.shape[:-1], *target)
        for i, s in enumerate(x.unbind()):
            torch.testing.assert_close(y[i], dense(s))
    t = x.view(*x.shape[:-1], 2, 4).transpose(1, 2)  # (2, L_i, 4): a static dim before the ragged one
    y = t.reshape(t.shape[0], -1, t.shape[2], 2, 2)
    for i, s in enumerate(t.unbind()):
        torch.testing.assert_close(y[i], s.reshape(2, s.shape[1], 2, 2))


def test_keep_leading_reshape_still_refuses_a_size_of_another_batch():
    x = padless.from_list(_batch([3, 5]))
    other = padless.from_list(_batch([3, 5], seed=2))
    with pytest.raises(StructureError, match="was read from the shape of another batch"):
        x.view(*other.shape[:-1], -1, 4)
