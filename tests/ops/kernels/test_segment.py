"""Segmented reductions: Triton kernel vs torch twin, forward and backward."""

import random

import pytest
import torch

from padless.ops.kernels import dispatch
from padless.ops.kernels.segment import strided_plan
from padless.tensor.construct import from_list
from padless.testing import make_batch
from padless.testing.kernels import SCALE, compare_backends

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

REDUCTIONS = {
    "sum": lambda x, d: torch.sum(x, dim=d),
    "mean": lambda x, d: torch.mean(x, dim=d),
    "amax": lambda x, d: torch.amax(x, dim=d),
    "amin": lambda x, d: torch.amin(x, dim=d),
    "logsumexp": lambda x, d: torch.logsumexp(x, dim=d),
    "var": lambda x, d: torch.var(x, dim=d),
}

# (variant, reduced torch dim): leading level, inner level, pair rows/columns, three ragged dims
CASES = [
    ("empty_sample", 1),
    ("one_sample", 1),
    ("pair", 1),
    ("pair", 2),
    ("rect", 1),
    ("heads_pair", 3),
    ("three_ragged", 2),
]


def _batch(name, dtype, device):
    return lambda: [make_batch(name, dtype=dtype, requires_grad=True, device=device)[0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reductions_match_twin(kernel_device, op, dtype):
    # every named case in float32; the half types on the pair (rows and columns)
    for name, dim in CASES if dtype == torch.float32 else [("pair", 1), ("pair", 2)]:
        if op in ("amax", "amin") and name == "empty_sample":
            continue  # an error before any kernel runs (tested in test_reduce)
        compare_backends(lambda x: REDUCTIONS[op](x, dim), _batch(name, dtype, kernel_device), dtype)
        assert dispatch.explain("segment_reduce").backend == "triton", (op, name, dim)


def test_empty_groups_and_all_empty(kernel_device):
    for op in ("sum", "mean", "logsumexp", "var"):
        compare_backends(lambda x: REDUCTIONS[op](x, 1), _batch("empty_sample", torch.float32, kernel_device), torch.float32)
        compare_backends(lambda x: REDUCTIONS[op](x, 1), _batch("all_empty", torch.float32, kernel_device), torch.float32)


def test_rows_wider_than_one_block(kernel_device):
    # 40 rows per group (> BLOCK_R = 16) and 130 features (> BLOCK_F = 128)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(40 * SCALE, 130, generator=g), torch.randn(17, 130, generator=g)]

    def make():
        return [from_list([s.to(kernel_device) for s in samples], ragged_dims=(0,), requires_grad=True)]

    for op in ("sum", "amax", "logsumexp", "var"):
        compare_backends(lambda x: REDUCTIONS[op](x, 1), make, torch.float32)


def test_thousands_of_short_samples(kernel_device):
    rng = random.Random(0)
    lens = [rng.randint(0, 3) for _ in range(1000 * SCALE)]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(n, 2, generator=g) for n in lens]

    def make():
        return [from_list([s.to(kernel_device) for s in samples], ragged_dims=(0,), requires_grad=True)]

    compare_backends(lambda x: torch.sum(x, dim=1), make, torch.float32, grad=False)  # one program per sample


def test_plan_columns_of_a_pair():
    # sample 0 is (2, 3), sample 1 is (1, 2): columns of the pair (reduce the leading dim)
    sizes = torch.tensor([[2, 3], [1, 2]])
    offsets = torch.tensor([0, 6, 8])
    start, count, stride = strided_plan(sizes, offsets, (0, 1), (0,), 5)
    assert start.tolist() == [0, 1, 2, 6, 7]
    assert count.tolist() == [2, 2, 2, 1, 1]
    assert stride.tolist() == [3, 3, 3, 2, 2]
    start, count, stride = strided_plan(sizes, offsets, (0, 1), (1,), 3)
    assert start.tolist() == [0, 3, 6] and count.tolist() == [3, 3, 2] and stride.tolist() == [1, 1, 1]
    assert strided_plan(torch.ones(1, 3, dtype=torch.long), torch.tensor([0, 1]), (0, 1, 2), (0, 2), 1) is None


def test_integer_and_non_consecutive_dims_use_the_twin(kernel_device, monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    nt, _ = make_batch("seq", dtype=torch.int64, device=kernel_device)
    torch.sum(nt, dim=1)
    assert dispatch.explain("segment_reduce").backend == "torch"
    assert "dtype" in dispatch.explain("segment_reduce").reason
    nt, _ = make_batch("three_ragged", device=kernel_device)
    torch.sum(nt, dim=(1, 3))
    assert "not consecutive" in dispatch.explain("segment_reduce").reason


def test_transposed_pair_storage_order(kernel_device):
    # p.transpose(1, 2) stores its ragged dims as (1, 0): groups follow the storage order
    for dim in (1, 2):
        for op in ("sum", "logsumexp"):
            compare_backends(lambda x: REDUCTIONS[op](x.transpose(1, 2), dim), _batch("rect", torch.float32, kernel_device), torch.float32)
            assert dispatch.explain("segment_reduce").backend == "triton"
