"""Issue 13, op side: gradients of broadcasts at extent 1 (item 3), extremes over an empty
ragged dim (item 9), and the bounded broadcast-plan cache (item 5)."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.testing import check_samples, leaves

# ---------------------------------------------------------------------------- item 3: extent 1


def _square(x):
    return x.unsqueeze(-1) + x.unsqueeze(-2)


@pytest.mark.parametrize(
    "lengths",
    [[1], [1, 1, 1], [0, 0], [1, 0, 1], [0], [3, 1]],
    ids=["one_sample_len1", "all_ones", "all_zeros", "ones_and_zeros", "one_empty", "mixed"],
)
def test_square_pair_backward_at_extent_one(lengths):
    # Failed before: "gradient with ragged dims (0, 1) cannot flow into ... (1,)"
    check_samples(_square, _square, [leaves([(n,) for n in lengths], seed=1)])


@pytest.mark.parametrize("channels", [False, True])
def test_rect_pair_backward_when_other_operand_is_all_ones(channels):
    tail = (2,) if channels else ()
    x = leaves([(3, *tail), (2, *tail), (0, *tail)], seed=2)
    y = leaves([(1, *tail), (1, *tail), (1, *tail)], seed=3, ragged=(0,))
    if channels:
        fn = lambda a, b: a.unsqueeze(2) * b.unsqueeze(1)  # noqa: E731  (N,1,C) * (1,M,C)
        ref = lambda a, b: a.unsqueeze(1) * b.unsqueeze(0)  # noqa: E731
    else:
        fn = lambda a, b: a.unsqueeze(-1) + b.unsqueeze(-2)  # noqa: E731
        ref = fn
    check_samples(fn, ref, [x, y])


def test_per_sample_broadcast_one_against_n_reaches_leaves():
    # Before: x.grad had y's 5 rows for x's 4 (envelopes agree, so autograd skipped sum_to_size)
    x = leaves([(3, 2), (1, 2)], seed=4)
    y = leaves([(3, 2), (2, 2)], seed=5)
    check_samples(torch.add, torch.add, [x, y])


def test_per_sample_broadcast_one_against_zero_reaches_leaves():
    # Before: x.grad had 1 row for x's 2 and held y's values
    x = leaves([(1, 2), (1, 2)], seed=6)
    y = leaves([(1, 2), (0, 2)], seed=7)
    check_samples(torch.mul, torch.mul, [x, y])


def test_per_sample_broadcast_through_an_intermediate():
    x = leaves([(1, 3), (1, 3), (2, 3)], seed=8)
    y = leaves([(4, 3), (0, 3), (2, 3)], seed=9)
    fn = lambda a, b: (a * 2).tanh() - b.sin()  # noqa: E731
    check_samples(fn, fn, [x, y])


@pytest.mark.parametrize("shapes", [[(1,)], [(1,), (0,), (1,)], [(1, 3), (1, 3)]], ids=["b1", "b3_empty", "static"])
def test_dense_operand_shaped_like_the_envelope_gets_a_dense_gradient(shapes):
    # Found by the fuzzer: x - x.mean(1, keepdim=True) at length <= 1, where the dense (B, 1)
    # mean has the envelope's shape, so autograd skipped sum_to_size ("aten.view ... not supported")
    fn = lambda t: t - t.mean(dim=1, keepdim=True) * 2  # noqa: E731
    ref = lambda t: t - t.mean(dim=0, keepdim=True) * 2  # noqa: E731
    check_samples(fn, ref, [leaves(shapes, seed=3)])


# ---------------------------------------------------------------------------- item 9: empty extremes


@pytest.mark.parametrize("op", ["amax", "amin"])
@pytest.mark.parametrize("dim", [1, 2])
def test_extreme_over_empty_ragged_dim_of_zero_by_zero_sample_raises(op, dim):
    x = padless.from_list([torch.zeros(0, 0), torch.ones(2, 3)], ragged_dims=(0, 1))
    with pytest.raises(IndexError):
        getattr(torch.empty(0, 0), op)(dim=dim - 1)  # torch's own rule
    with pytest.raises(IndexError, match=rf"{op}\(\): sample 0 has extent 0 along reduced dim\(s\) \({dim},\)"):
        getattr(x, op)(dim=dim)
    with pytest.raises(padless.StructureError, match="undefined"):  # also a ValueError and a RuntimeError
        getattr(x, op)(dim=dim)


def test_extreme_over_nonempty_ragged_dim_keeps_working_beside_empty_samples():
    x = padless.from_list([torch.zeros(2, 0), torch.ones(2, 3)], ragged_dims=(0, 1))
    out = x.amax(dim=1)  # torch: (2, 0).amax(0) is a (0,) tensor
    assert [tuple(s.shape) for s in out.unbind()] == [(0,), (3,)]


# ---------------------------------------------------------------------------- item 5: bounded plan cache


def _live_metas() -> int:
    import gc

    from padless.tensor.core import StructureMeta

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is StructureMeta)



def test_broadcast_plans_of_a_long_lived_left_operand_stay_bounded(one_thread):
    # Before: one plan per partner, each keeping two StructureMetas alive (2,002 after 1,000 steps)
    from padless.ops.common.broadcast import PLAN_CACHE_SIZE

    g = torch.Generator().manual_seed(0)
    left = padless.from_list([torch.randn(3, 1, 2, generator=g) for _ in range(8)])
    base = _live_metas()
    seen = []
    for step in range(1000):
        lens = torch.randint(1, 6, (8,), generator=g)
        right = padless.from_values(torch.ones(int(lens.sum()), 1, 2), lengths=lens, ragged_dims=(1,))
        out = left + right
        if step == 0:
            assert [tuple(s.shape) for s in out.unbind()] == [(3, n, 2) for n in lens.tolist()]
        del out, right
        if step in (99, 999):
            seen.append(_live_metas() - base)
    assert seen[0] == seen[1] <= 2 * PLAN_CACHE_SIZE + 2, seen


def test_recently_used_plan_survives_eviction():
    from padless.ops.common.broadcast import PLAN_CACHE_SIZE, plan

    left = padless.from_list([torch.randn(2, 1), torch.randn(3, 1)])
    keep = padless.from_list([torch.randn(1, 2), torch.randn(1, 4)], ragged_dims=(1,))
    first = plan("add", [left, keep])
    for n in range(PLAN_CACHE_SIZE + 4):
        plan("add", [left, keep])  # touched: most recent
        other = padless.from_list([torch.randn(1, n + 1), torch.randn(1, 1)], ragged_dims=(1,))
        plan("add", [left, other])
    assert plan("add", [left, keep]) is first


# ---------------------------------------------------------------------------- found by the fuzzer


@pytest.mark.parametrize("largest", [True, False])
def test_max_min_over_a_ragged_dim_holding_nan(largest):
    # Before: "index 8 is out of bounds" (a NaN never equals the group's NaN extreme)
    f = torch.max if largest else torch.min
    x, dense = leaves([(3, 2), (2, 2), (1, 2)], seed=0)
    nan_col = torch.tensor([1.0, float("nan")])
    out = check_samples(lambda t: f(t * nan_col, dim=1).values, lambda t: f(t * nan_col, dim=0).values, [(x, dense)])
    assert out[:, 1].isnan().all()
    y = padless.from_list([torch.tensor([1.0, -1.0, 2.0]), torch.tensor([-3.0, 4.0])])
    got = f(y.log(), dim=1)
    want = [f(s.log(), dim=0) for s in y.unbind()]
    assert got.indices.tolist() == [int(w.indices) for w in want]


@pytest.mark.parametrize("first", [float("nan"), float("inf"), 1e20], ids=["nan", "inf", "huge"])
def test_cumsum_along_a_ragged_dim_never_leaks_into_the_next_sample(first):
    # Before: a global cumsum minus each run's start gave sample 1 NaN (or 0 after 1e20)
    x = padless.from_list([torch.tensor([first, 1.0]), torch.tensor([1.0, 2.0])])
    assert x.cumsum(1).unbind()[1].tolist() == [1.0, 3.0]
    p = padless.from_list([torch.full((2, 3, 1), first), torch.ones(1, 2, 1)], ragged_dims=(0, 1))
    for d in (1, 2):
        assert p.cumsum(d).unbind()[1].tolist() == torch.ones(1, 2, 1).cumsum(d - 1).tolist()


def test_cumsum_along_ragged_dims_matches_torch_with_gradients():
    for shapes, rag in [([(3, 2), (0, 2), (5, 2)], (0,)), ([(2, 3, 2), (1, 4, 2), (0, 2, 2)], (0, 1))]:
        for d in range(len(shapes[0])):
            check_samples(lambda t: t.cumsum(d + 1), lambda t: t.cumsum(d), [leaves(shapes, seed=1, ragged=rag)])
