"""Shape idioms of padded code (padless.ops.rows.shape_idioms): ``reshape(shape=...)``,
``reshape(-1, C)`` of every real row, ``unbind`` of a static dim, ``dense.expand_as(nt)``,
``torch.cat`` with an empty dense KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing import check_samples, leaves

SEQ = [(3, 8), (0, 8), (5, 8), (1, 8)]
PAIR = [(3, 3, 4), (0, 0, 4), (2, 2, 4)]


def _same_values_and_grads(out, refs, x, dense, dn, dr):
    """``out`` equals the per-sample ``refs``, and the gradients of one squared-sum loss agree:
    the NestedTensor's against each dense sample's, the dense operand ``dn``'s against ``dr``'s."""
    for got, ref in zip(out.unbind(), refs):
        torch.testing.assert_close(got, ref.detach())
    (out.values() ** 2).sum().backward()
    sum((r**2).sum() for r in refs).backward()
    torch.testing.assert_close(dn.grad, dr.grad)
    for g, s in zip(x.grad.unbind(), dense):
        torch.testing.assert_close(g, s.grad)


def test_reshape_keyword_shape():
    nts = [leaves(SEQ, 1, dtype=torch.float64)]
    check_samples(lambda x: x.reshape(shape=(4, -1, 2, 4)), lambda s: s.reshape(shape=(-1, 2, 4)), nts)
    check_samples(lambda x: torch.reshape(x, shape=(4, -1, 2, 4)), lambda s: s.reshape(-1, 2, 4), nts)
    check_samples(lambda x: x.view(size=(4, -1, 4, 2)), lambda s: s.view(-1, 4, 2), nts)


@pytest.mark.parametrize("shapes", [SEQ, [(4, 8)], PAIR], ids=["seq", "one_sample", "pairs"])
@pytest.mark.parametrize("tail", [(8,), (2, 4), (4,)], ids=["C", "2x4", "half"])
def test_reshape_flattens_every_real_row(shapes, tail):
    """``x.reshape(-1, C)``: the per-sample flattenings concatenated, dense, with autograd."""
    c = shapes[0][-1]
    if c % (tail[0] if len(tail) == 1 else tail[0] * tail[1]):
        pytest.skip("tail does not divide the static extent")
    x, dense = leaves(shapes, 2, dtype=torch.float64)
    out = x.reshape(-1, *tail)
    assert not isinstance(out, padless.NestedTensor)
    ref = torch.cat([d.reshape(-1, *tail) for d in dense])
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(ref)
    out.backward(cot)
    ref.backward(cot)
    for g, d in zip(x.grad.unbind(), dense):
        torch.testing.assert_close(g, d.grad)
    torch.testing.assert_close(x.view(-1, *tail), ref.detach())


def test_reshape_that_mixes_rows_is_refused():
    x = padless.from_list([torch.randn(3, 8), torch.randn(2, 8)])
    with pytest.raises(ValueError, match=r"reshape\(\): cannot reshape a NestedTensor of envelope \(2, 3, 8\)"):
        x.reshape(-1, 16)  # two rows into one: rows of different samples would meet
    t = x.transpose(1, 2)  # (8, L_i): rows are not in sample-dim order
    with pytest.raises(ValueError, match=r"reshape\(\): cannot reshape"):
        t.reshape(-1, 8)


def test_unbind_static_dim():
    """``q, k, v = qkv.unbind(dim=-3)`` on a static dim: a tuple of NestedTensors."""
    x, dense = leaves([(3, 3, 2, 4), (0, 3, 2, 4), (2, 3, 2, 4)], 3, dtype=torch.float64)
    t = x.transpose(1, 2)  # (3, L_i, 2, 4)
    parts = t.unbind(dim=-4)
    assert len(parts) == 3 and all(isinstance(p, padless.NestedTensor) for p in parts)
    check_samples(
        lambda a: sum(p * (k + 1) for k, p in enumerate(a.transpose(1, 2).unbind(dim=1))),
        lambda s: sum(p * (k + 1) for k, p in enumerate(s.transpose(0, 1).unbind(dim=0))),
        [(x, dense)],
    )
    check_samples(lambda a: torch.unbind(a, -1)[2], lambda s: torch.unbind(s, -1)[2], [leaves(SEQ, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"unbind\(\): dim 1 is ragged"):
        x.unbind(1)


@pytest.mark.parametrize("dshape", ["C", "1C", "LC", "B1C", "BLC", "L1"])
def test_dense_expand_as(dshape):
    x, dense = leaves(SEQ, 5, dtype=torch.float64)
    dims = {"B": len(SEQ), "L": max(s[0] for s in SEQ), "C": 8, "1": 1}
    d = torch.randn(*[dims[c] for c in dshape], dtype=torch.float64)
    dn, dr = d.clone().requires_grad_(), d.clone().requires_grad_()
    out = dn.expand_as(x) * x
    aligned = dr.reshape((1,) * (3 - dr.dim()) + tuple(dr.shape))
    refs = []
    for i, s in enumerate(dense):
        w = aligned[i if aligned.shape[0] != 1 else 0]
        if w.shape[0] == dims["L"] and dims["L"] != 1:
            w = w[: s.shape[0]]
        refs.append(w.expand_as(s) * s)
    _same_values_and_grads(out, refs, x, dense, dn, dr)


def test_dense_expand_as_refuses_what_does_not_expand():
    x = padless.from_list([torch.randn(3, 8), torch.randn(2, 8)])
    with pytest.raises(ValueError, match=r"expand_as\(\): a dense operand of shape \(4, 8\) spans ragged dim 1"):
        torch.randn(4, 8).expand_as(x)
    with pytest.raises(ValueError, match=r"expand_as\(\): a dense tensor of shape \(3, 4\) does not expand to \(2, 3, 8\)"):
        torch.randn(3, 4).expand_as(x)


@pytest.mark.parametrize("empty", ["legacy", "B0C", "10C"])
def test_cat_with_empty_dense_cache(empty):
    x, dense = leaves(SEQ, 6, dtype=torch.float64)
    e = {"legacy": torch.empty(0), "B0C": torch.zeros(len(SEQ), 0, 8), "10C": torch.zeros(1, 0, 8)}[empty]
    e = e.double()
    if empty == "10C":
        with pytest.raises(ValueError, match=r"cat\(\): a dense input of shape \(1, 0, 8\) has 1 entries on the batch dim"):
            torch.cat([e, x], dim=1)  # batch extent 1 against 4: not the empty cache of this batch
        return
    check_samples(lambda a: torch.cat([e, a], dim=1) * 2, lambda s: torch.cat([e if e.dim() == 1 else e[0], s]) * 2, [(x, dense)])
    cache = torch.cat([e, x], dim=1)
    grown = torch.cat([cache, x], dim=1)  # the next step: two NestedTensors, per sample
    for g, s in zip(grown.unbind(), dense):
        torch.testing.assert_close(g, torch.cat([s, s]).detach())


def test_interpolate_size_nested_is_torch_error():
    """``F.interpolate(dense, size=nt)``: torch dispatches ``interpolate`` on ``input`` only, so a
    NestedTensor ``size`` never reaches padless; torch refuses it (documented in docs/limits.md)."""
    img = padless.from_list([torch.randn(3, 4, 6), torch.randn(3, 2, 2)], ragged_dims=(1, 2))
    with pytest.raises(TypeError):
        F.interpolate(torch.randn(1, 3, 2, 2), size=img)


@pytest.mark.parametrize("k", [1, 2])
def test_cat_dense_block_along_the_ragged_dim(k):
    """ViT class/register tokens: ``torch.cat([cls.expand(B, -1, -1), x], dim=1)``."""
    x, dense = leaves(SEQ, 7, dtype=torch.float64)
    cls_n, cls_r = (torch.randn(1, k, 8, dtype=torch.float64).requires_grad_() for _ in range(2))
    with torch.no_grad():
        cls_r.copy_(cls_n)
    check_samples(
        lambda a: torch.cat([cls_n.expand(len(SEQ), -1, -1), a, cls_n.expand(len(SEQ), -1, -1) * 2], dim=1),
        lambda s: torch.cat([cls_r[0], s, cls_r[0] * 2]),
        [(x, dense)],
    )
    torch.testing.assert_close(cls_n.grad, cls_r.grad)


def test_cat_dense_in_padded_coordinates_along_a_static_dim():
    x, dense = leaves(SEQ, 8, dtype=torch.float64)
    d = torch.randn(len(SEQ), max(s[0] for s in SEQ), 3, dtype=torch.float64)
    dn, dr = d.clone().requires_grad_(), d.clone().requires_grad_()
    out = torch.cat([x, dn], dim=-1)
    refs = [torch.cat([s, dr[i, : s.shape[0]]], -1) for i, s in enumerate(dense)]
    _same_values_and_grads(out, refs, x, dense, dn, dr)


def test_cat_dense_block_errors():
    x = padless.from_list([torch.randn(3, 8), torch.randn(2, 8)])
    with pytest.raises(ValueError, match=r"cat\(\): a dense input of shape \(1, 1, 8\) has 1 entries on the batch dim, the NestedTensor has 2 samples"):
        torch.cat([torch.randn(1, 1, 8), x], dim=1)
    with pytest.raises(ValueError, match=r"cat\(\): a dense input of shape \(2, 1, 4\) has extent 4 along dim 2"):
        torch.cat([torch.randn(2, 1, 4), x], dim=1)
