"""Ragged softmax / log_softmax: Triton kernel vs torch twin, forward and backward."""

import random

import pytest
import torch

from padless.ops.kernels import dispatch
from padless.tensor.construct import from_list
from padless.testing import check_op, make_batch
from padless.testing.kernels import SCALE, compare_backends

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (variant, torch dim): token axis, pair rows and columns (triangle attention), inner level of three
CASES = [("empty_sample", 1), ("all_empty", 1), ("one_sample", 1), ("pair", 1), ("pair", 2), ("rect", 2),
         ("heads_pair", 3), ("three_ragged", 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_matches_twin(kernel_device, log, dtype):
    fn = torch.log_softmax if log else torch.softmax
    for name, dim in CASES if dtype == torch.float32 else [("pair", 1), ("pair", 2)]:
        make = lambda: [make_batch(name, dtype=dtype, requires_grad=True, device=kernel_device)[0]]  # noqa: E731
        compare_backends(lambda x: fn(x, dim=dim), make, dtype)
        assert dispatch.explain("softmax").backend == "triton", (name, dim)


def test_softmax_kernel_against_dense_samples(kernel_device, monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    check_op(lambda x: torch.softmax(x, dim=2), "pair", atol=1e-5, rtol=1e-5)
    check_op(lambda x: torch.log_softmax(x, dim=1), "pair", atol=1e-5, rtol=1e-5)


def test_softmax_rows_wider_than_one_block(kernel_device):
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(20 * SCALE, 20 * SCALE, 3, generator=g), torch.randn(2, 2, 3, generator=g)]

    def make():
        return [from_list([s.to(kernel_device) for s in samples], ragged_dims=(0, 1), requires_grad=True)]

    for dim in (1, 2):
        compare_backends(lambda x: torch.softmax(x, dim=dim), make, torch.float32)


def test_softmax_thousands_of_short_samples(kernel_device):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(rng.randint(0, 3), 1, generator=g) for _ in range(1000 * SCALE)]
    make = lambda: [from_list([s.to(kernel_device) for s in samples], ragged_dims=(0,))]  # noqa: E731
    compare_backends(lambda x: torch.softmax(x, dim=1), make, torch.float32, grad=False)


def test_softmax_on_a_transposed_pair(kernel_device):
    make = lambda: [make_batch("rect", requires_grad=True, device=kernel_device)[0]]  # noqa: E731
    for dim in (1, 2):
        compare_backends(lambda x: torch.softmax(x.transpose(1, 2), dim=dim), make, torch.float32)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_low_precision_softmax_rounds_once_as_torch_does(log):
    """A bfloat16 softmax over a non-last ragged dim (groups strided in storage) accumulates in
    float32 and rounds once, as torch's softmax does on each sample: every value is the float64
    softmax rounded to the nearest bfloat16 (it rounded max, exp and sum on their own before)."""
    fn = torch.log_softmax if log else torch.softmax
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, n, 2, generator=g).bfloat16() for n in (3, 0, 4, 40)]
    out = fn(from_list(xs), dim=1)
    for x, y in zip(xs, out.unbind()):
        ref = fn(x.double(), dim=0)
        ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - 8)  # bfloat16: 8 significant bits
        err = (y.double() - ref).abs()
        assert bool((err <= 0.5 * ulp * 1.01 + 1e-6 * ref.abs()).all()), (err / ulp).max()
