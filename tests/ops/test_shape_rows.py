"""Shape ops that build new rows or join NestedTensors (padless/ops/rows/shape_rows.py):
narrow, cat, stack, gather, through the reference harness."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

import padless
from padless.ops.rows.shape_rows import relayout
from padless.testing import check_op, make_batch, variant
from padless.tensor.core import NestedTensor

Case = tuple[str, Callable]

# ---------------------------------------------------------------------------- narrow

NARROW: list[Case] = [
    ("seq", lambda x: x.narrow(1, 0, 1)),
    ("seq", lambda x: x.narrow(1, -1, 1)),
    ("seq", lambda x: torch.narrow(x, 2, 1, 2)),
    ("empty_sample", lambda x: x.narrow(1, 0, 0)),
    ("empty_sample", lambda x: x.narrow(-1, 3, 1)),
    ("all_empty", lambda x: x.narrow(1, 0, 0)),
    ("one_sample", lambda x: x.narrow(1, 1, 3)),
    ("all_equal", lambda x: x.narrow(1, 1, 2)),
    ("channels_first", lambda x: x.narrow(2, 1, 1)),
    ("channels_first", lambda x: x.narrow(1, 1, 2)),
    ("image", lambda x: x.narrow(2, 0, 2)),
    ("image", lambda x: x.narrow(3, -3, 2)),
    ("pair", lambda x: x.narrow(2, 0, 1)),
    ("rect", lambda x: x.narrow(1, 1, 1)),
    ("heads_pair", lambda x: x.narrow(3, 1, 1)),
    ("three_ragged", lambda x: x.narrow(2, 0, 1)),
    ("three_ragged", lambda x: x.narrow(3, 0, 1)),
    ("pair", lambda x: x.transpose(1, 2).narrow(1, 0, 1)),  # ragged dims stored as (1, 0)
    ("static_zero", lambda x: x.narrow(1, 1, 1)),
    ("seq", lambda x: x.narrow(1, torch.tensor(0), 1)),
]


@pytest.mark.parametrize("v, fn", NARROW, ids=[f"{c[0]}-{i}" for i, c in enumerate(NARROW)])
def test_narrow(v, fn):
    check_op(fn, v)


def test_narrow_keeps_host_metadata_and_batch_narrow_is_a_view():
    nt, dense = make_batch("image")
    out = nt.narrow(2, 1, 1)
    assert torch.equal(out._meta.host_sizes, torch.tensor([[3, 1, 5], [3, 1, 6], [3, 1, 3]]))
    assert torch.equal(out._meta.host_offsets, torch.tensor([0, 5, 11, 14]))
    sub = nt.narrow(0, -2, 2)
    assert sub.batch_size == 2 and sub.values().data_ptr() == nt.values()[20:].data_ptr()
    for got, want in zip(sub.unbind(), dense[1:]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "v, fn",
    [
        ("pair", lambda x: torch.cat([x, x.narrow(1, 0, 1)], 1)),
        ("image", lambda x: torch.stack([x, x], -1).narrow(3, 1, 1)),
    ],
)
def test_row_ops_bf16(v, fn):
    check_op(fn, v, dtype=torch.bfloat16)


def test_narrow_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(IndexError, match=r"narrow\(\): sample 2 has size 1 along dim 1, too short for the window start=1, length=1"):
        nt.narrow(1, 1, 1)
    with pytest.raises(IndexError, match=r"narrow\(\): sample 0 has size 3 along dim 1, too short for the window start=-4, length=1"):
        nt.narrow(1, -4, 1)
    with pytest.raises(ValueError, match=r"narrow\(\): length must be non-negative, got -1"):
        nt.narrow(1, 0, -1)
    with pytest.raises(IndexError, match=r"narrow\(\): start 2 \+ length 2 is out of range for a batch of 3 samples"):
        nt.narrow(0, 2, 2)
    with pytest.raises(TypeError, match=r"narrow\(\): start must be a python int \(or a one-element CPU integer tensor\)"):
        nt.narrow(1, torch.tensor([0, 1]), 1)


# ---------------------------------------------------------------------------- cat

CAT: list[Case] = [
    ("seq", lambda x: torch.cat([x, x * 2], 1)),
    ("empty_sample", lambda x: torch.cat([x * 2, x, x + 1], dim=1)),
    ("all_empty", lambda x: torch.concat([x, x], 1)),
    ("one_sample", lambda x: torch.cat([x.narrow(1, 0, 2), x], 1)),
    ("channels_first", lambda x: torch.cat([x, -x], -1)),
    ("image", lambda x: torch.cat([x, x * 3], 2)),
    ("image", lambda x: torch.concatenate([x, x * 3], axis=3)),
    ("pair", lambda x: torch.cat([x, x * 2], 1)),
    ("pair", lambda x: torch.cat([x, x * 2], 2)),
    ("rect", lambda x: torch.cat([x * 2, x], 2)),
    ("heads_pair", lambda x: torch.cat([x, x + 1], 2)),
    ("three_ragged", lambda x: torch.cat([x, x * 2], 2)),
    ("pair", lambda x: torch.cat([x.transpose(1, 2), x], 1)),  # input 1 re-laid out as (1, 0)
    ("pair", lambda x: torch.cat([x, x.transpose(1, 2)], -1)),
    ("pair", lambda x: torch.stack([x, x.transpose(1, 2)], 1)),
    # static dims
    ("seq", lambda x: torch.cat([x, x[..., :1]], 2)),
    ("image", lambda x: torch.cat([x, x[:, :1]], 1)),
    ("pair", lambda x: torch.cat([x, x], -1)),
    ("static_zero", lambda x: torch.cat([x, x], -1)),
    ("all_empty", lambda x: torch.cat([x, x], 2)),
]


@pytest.mark.parametrize("v, fn", CAT, ids=[f"{c[0]}-{i}" for i, c in enumerate(CAT)])
def test_cat(v, fn):
    check_op(fn, v)


def test_relayout_and_cat_batches_of_mixed_storage_orders():
    nt, dense = make_batch("pair")
    t = relayout(nt.transpose(1, 2), (0, 1))
    assert t._ragged == (0, 1) and t.is_contiguous()
    for got, s in zip(t.unbind(), dense):
        torch.testing.assert_close(got, s.transpose(0, 1))
    out = torch.cat([nt, nt.transpose(1, 2)], 0)
    for got, s in zip(out.unbind(), [*dense, *[s.transpose(0, 1) for s in dense]]):
        torch.testing.assert_close(got, s)
    check_op(lambda x: relayout(x.transpose(1, 2), (0, 1, 2)), "three_ragged", ref=lambda s: s.transpose(0, 1))
    with pytest.raises(ValueError, match=r"relayout\(\): \(0, 2\) is not a permutation of the ragged dims \(0, 1\)"):
        relayout(nt, (0, 2))


def test_cat_ragged_of_different_lengths():
    """``(L_i, C) + (M_i, C) -> (L_i + M_i, C)`` for two separately built batches."""
    a_s = [torch.randn(n, 3, requires_grad=True) for n in (2, 0, 4)]
    b_s = [torch.randn(n, 3, requires_grad=True) for n in (1, 3, 0)]
    a = padless.from_list([s.detach() for s in a_s], requires_grad=True)
    b = padless.from_list([s.detach() for s in b_s], requires_grad=True)
    out = torch.cat([a, b], 1)
    assert out.shape == (3, 4, 3)
    assert torch.equal(out._meta.host_offsets, torch.tensor([0, 3, 6, 10]))
    for got, x, y in zip(out.unbind(), a_s, b_s):
        torch.testing.assert_close(got, torch.cat([x, y]))
    g = [torch.randn(n, 3) for n in (3, 3, 4)]
    out.backward(padless.from_list(g))
    torch.autograd.backward([torch.cat([x, y]) for x, y in zip(a_s, b_s)], g)
    for nt, dense in ((a, a_s), (b, b_s)):
        for got, s in zip(nt.grad.unbind(), dense):
            torch.testing.assert_close(got, s.grad)


@pytest.mark.parametrize("with_host", [True, False])
def test_cat_batches(with_host):
    a, da = make_batch("empty_sample", requires_grad=True)
    b, db = make_batch("seq", seed=1, requires_grad=True)
    c, _ = make_batch("all_empty")
    if not with_host:  # a device batch built without host metadata: no sync is needed
        b = NestedTensor(b._values, b._offsets, b._sizes, b._ragged, b._env, requires_grad=True)
    out = torch.cat([a, b, c], 0)
    assert out.batch_size == 8 and out.shape == (8, 5, 4)
    assert (out._meta.host_sizes is not None) == with_host
    assert torch.equal(out.offsets(), torch.tensor([0, 3, 3, 5, 8, 13, 14, 14, 14]))
    for got, want in zip(out.unbind(), [*da, *db]):
        torch.testing.assert_close(got, want)
    (out * 2).sum().backward()
    torch.testing.assert_close(a.grad.values(), torch.full((5, 4), 2.0))
    torch.testing.assert_close(b.grad.values(), torch.full((9, 4), 2.0))


def test_cat_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(TypeError, match=r"cat\(\): input 1 is a dense Tensor of shape \(2, 4\); every input must be a NestedTensor"):
        torch.cat([nt, torch.zeros(2, 4)], 1)
    with pytest.raises(ValueError, match=r"cat\(\): static dims differ: input 0 has static extents \(4,\), input 1 has \(2,\)"):
        torch.cat([nt, nt[..., :2]], 0)
    with pytest.raises(ValueError, match=r"cat\(\): input 1 has sample rank 3 and ragged dims stored as \(0, 1\); input 0 has 2 and \(0,\)"):
        torch.cat([nt, make_batch("pair")[0]], 0)
    with pytest.raises(ValueError, match=r"cat\(\): along ragged dim 1 every other dim must agree per sample: sample 0 has \(3, 3, 2\) in input 0 and \(3, 4, 2\) in input 1"):
        p = make_batch("pair")[0]
        torch.cat([p, torch.cat([p, p.narrow(2, 0, 1)], 2)], 1)
    with pytest.raises(ValueError, match=r"cat\(\): batch sizes differ: input 0 has 3 samples, input 1 has 1"):
        torch.cat([nt, make_batch("one_sample")[0]], 1)
    with pytest.raises(ValueError, match=r"cat\(\): ragged structures differ: sample 0 has \(3, 4\), other has \(5, 4\)"):
        torch.cat([nt, nt[[1, 0, 2]]], 2)
    with pytest.raises(NotImplementedError, match=r"cat\(\): out= is not supported"):
        torch.cat([nt, nt], 2, out=torch.empty(0))


# ---------------------------------------------------------------------------- stack

STACK: list[Case] = [
    ("seq", lambda x: torch.stack([x, x * 2], 1)),
    ("seq", lambda x: torch.stack([x, x * 2, -x], 2)),
    ("empty_sample", lambda x: torch.stack([x, x + 1], -1)),
    ("all_empty", lambda x: torch.stack([x, x], 1)),
    ("one_sample", lambda x: torch.stack([x], 3)),
    ("image", lambda x: torch.stack([x, x * 2], 2)),
    ("pair", lambda x: torch.stack([x, x * 2], -1)),
    ("channels_first", lambda x: torch.stack([x, x * 2], 1)),
]


@pytest.mark.parametrize("v, fn", STACK, ids=[f"{c[0]}-{i}" for i, c in enumerate(STACK)])
def test_stack(v, fn):
    check_op(fn, v)


def test_stack_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"stack\(\): ragged structures differ"):
        torch.stack([nt, nt[[1, 0, 2]]])  # dim 0: a StackedBatch (tests/ops/test_stack_batches.py)
    with pytest.raises(ValueError, match=r"stack\(\): ragged structures differ: sample 0 has \(3, 4\), other has \(5, 4\)"):
        torch.stack([nt, nt[[1, 0, 2]]], 1)
    with pytest.raises(ValueError, match=r"stack\(\): static dims differ"):
        torch.stack([nt, nt[..., :2]], 1)
    with pytest.raises(NotImplementedError, match=r"stack\(\): out= is not supported"):
        torch.stack([nt, nt], 1, out=torch.empty(0))


# ---------------------------------------------------------------------------- gather


def _index_batch(v: str, dim: int, extent: Callable[[tuple[int, ...]], int], seed: int = 0) -> tuple[NestedTensor, list[torch.Tensor]]:
    """An int64 index NestedTensor for variant ``v``: sample dim ``dim`` gets ``extent(shape)``
    entries drawn in ``[0, shape[dim])``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in variant(v).shapes:
        shape = list(s)
        shape[dim] = extent(s)
        out.append(torch.randint(0, max(s[dim], 1), shape, generator=g) if s[dim] else torch.zeros(shape, dtype=torch.int64))
    return padless.from_list(out, ragged_dims=variant(v).ragged_dims), out


def _per_sample(idx: list[torch.Tensor], dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    it: Iterator[torch.Tensor] = iter(idx)
    return lambda s: torch.gather(s, dim, next(it))


GATHER = [
    # (variant, sample dim, index extent along it)
    ("seq", 0, lambda s: s[0] + 1 if s[0] else 0),
    ("seq", 1, lambda s: 2),
    ("empty_sample", 0, lambda s: 2 * s[0]),
    ("all_empty", 1, lambda s: 3),
    ("one_sample", 0, lambda s: 1),
    ("channels_first", 1, lambda s: 4),
    ("channels_first", 0, lambda s: 6),
    ("image", 2, lambda s: s[2] - 1),
    ("image", 1, lambda s: 2),
    ("pair", 1, lambda s: 2),
    ("pair", 0, lambda s: s[0] + 2),
    ("rect", 1, lambda s: 1),
    ("three_ragged", 1, lambda s: 2),
    ("three_ragged", 3, lambda s: 1),
]


@pytest.mark.parametrize("v, d, extent", GATHER, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(GATHER)])
def test_gather(v, d, extent):
    idx, dense_idx = _index_batch(v, d, extent)
    out = check_op(lambda x: torch.gather(x, d + 1, idx), v, ref=_per_sample(dense_idx, d))
    assert out.same_structure(idx)


def test_gather_static_dim_compiles():
    idx, dense_idx = _index_batch("seq", 1, lambda s: 3)
    check_op(lambda x: torch.gather(x, 2, idx), "seq", ref=_per_sample(dense_idx, 1), compiled=True)


def test_gather_smaller_static_extent_and_method():
    nt, dense = make_batch("seq")
    idx = padless.from_list([torch.randint(0, 3, (n, 2)) for n in (3, 5, 1)])  # index (L_i, 2) into (L_i, 4) along dim 1
    out = nt.gather(2, idx)
    for got, s, i in zip(out.unbind(), dense, idx.unbind()):
        torch.testing.assert_close(got, torch.gather(s, 1, i))


def test_gather_errors():
    nt, _ = make_batch("seq")
    idx, _ = _index_batch("seq", 0, lambda s: 2)
    with pytest.raises(TypeError, match=r"gather\(\): index must be a NestedTensor of the input's ragged structure, got a dense Tensor of shape \(2, 4\)"):
        torch.gather(nt, 1, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"gather\(\): index must be int64, got torch.int32"):
        torch.gather(nt, 1, idx.to(torch.int32))
    bad = padless.from_list([torch.tensor([[0, 0, 0, 3]]), torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64)])
    with pytest.raises(IndexError, match=r"gather\(\): index 3 is out of range for sample 0 of size 3 along dim 1"):
        torch.gather(nt, 1, bad)
    with pytest.raises(ValueError, match=r"gather\(\): ragged structures differ: sample 0 has \(3, 4\), other has \(2, 4\)"):
        torch.gather(nt, 2, idx)
    p, _ = make_batch("pair")
    pidx, _ = _index_batch("pair", 1, lambda s: 2)
    with pytest.raises(ValueError, match=r"gather\(\): index sample 0 has \(3, 2, 2\), input has \(3, 3, 2\); they may differ only along dim 1"):
        torch.gather(p, 1, pidx)
    with pytest.raises(ValueError, match=r"gather\(\): index static extents \(5,\) exceed the input's \(4,\) outside dim 1"):
        torch.gather(nt, 1, padless.from_list([torch.zeros(1, 5, dtype=torch.int64)] * 3))
    with pytest.raises(ValueError, match=r"gather\(\): index \(batch 1, rank 2, ragged dims stored as \(0,\)\) must match the input \(batch 3"):
        torch.gather(nt, 1, padless.from_list([torch.zeros(1, 4, dtype=torch.int64)]))
    with pytest.raises(ValueError, match=r"gather\(\): dim 0 is the batch dim"):
        torch.gather(nt, 0, idx)
    with pytest.raises(NotImplementedError, match=r"gather\(\): out= is not supported"):
        torch.gather(nt, 1, idx, out=torch.empty(0))
