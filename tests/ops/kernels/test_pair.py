"""Pair construction: Triton kernel vs torch twin (and the broadcasting it replaces)."""

import random

import pytest
import torch

from padless.ops.kernels import dispatch
from padless.ops.kernels.pair import PairMeta, pair_combine
from padless.tensor.construct import from_list
from padless.testing.kernels import SCALE, compare_backends, kernels_mode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = {
    "square": ([3, 0, 4, 1], [3, 0, 4, 1]),
    "rect": ([2, 4, 3], [3, 1, 5]),
    "one_sample": ([5], [5]),
    "all_empty": ([0, 0], [0, 0]),
    "wide": ([20 * SCALE, 3], [17, 2]),  # pair rows of one sample span several blocks
}


def _make(ns, ms, c, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(ns), c, generator=g).to(device, dtype)
    y = torch.randn(sum(ms), c, generator=g).to(device, dtype)
    total = sum(a * b for a, b in zip(ns, ms))
    z = torch.randn(total, c, generator=g).to(device, dtype) if bias else None
    meta = PairMeta.from_host(torch.tensor(ns), torch.tensor(ms), device)

    def make():
        leaves = [x.clone().requires_grad_(), y.clone().requires_grad_()]
        if z is not None:
            leaves.append(z.clone().requires_grad_())
        return leaves

    return make, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["add", "mul"])
def test_pair_matches_twin(kernel_device, op, dtype):
    names = list(SHAPES) if dtype == torch.float32 else ["square", "rect"]
    for name in names:
        for bias in (False, True):
            ns, ms = SHAPES[name]
            make, meta = _make(ns, ms, 3, dtype, kernel_device, bias)
            compare_backends(lambda x, y, *z: pair_combine(x, y, op, meta, *z), make, dtype)
            assert dispatch.explain("pair").backend == "triton"


def test_pair_features_wider_than_one_block(kernel_device):
    make, meta = _make([3, 2], [2, 4], 70, torch.float32, kernel_device, True)
    compare_backends(lambda x, y, z: pair_combine(x, y, "mul", meta, z), make, torch.float32)


def test_pair_thousands_of_short_samples(kernel_device):
    rng = random.Random(0)
    ns = [rng.randint(0, 2) for _ in range(1000 * SCALE)]
    make, meta = _make(ns, ns, 1, torch.float32, kernel_device, False)
    compare_backends(lambda x, y: pair_combine(x, y, "add", meta), make, torch.float32, grad=False)


def test_pair_equals_broadcasting(kernel_device):
    ns = [3, 0, 2]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 1, 4, generator=g).to(kernel_device) for n in ns]
    ys = [torch.randn(1, n, 4, generator=g).to(kernel_device) for n in ns]
    want = from_list(xs, ragged_dims=(0,)) * from_list(ys, ragged_dims=(1,))
    meta = PairMeta.from_host(torch.tensor(ns), torch.tensor(ns), kernel_device)
    with kernels_mode("triton"):
        got = pair_combine(torch.cat([x.reshape(-1, 4) for x in xs]), torch.cat([y.reshape(-1, 4) for y in ys]), "mul", meta)
    torch.testing.assert_close(got, want._values.reshape(-1, 4))


def test_pair_bad_op():
    meta = PairMeta.from_host(torch.tensor([1]), torch.tensor([1]), "cpu")
    with pytest.raises(ValueError, match=r"pair_combine\(\): op must be 'add' or 'mul', got 'sub'"):
        pair_combine(torch.ones(1, 2), torch.ones(1, 2), "sub", meta)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_broadcasting_runs_the_pair_kernel(kernel_device, op):
    ns, ms = [3, 0, 2], [2, 1, 4]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 1, 4, generator=g).to(kernel_device) for n in ns]
    ys = [torch.randn(1, m, 4, generator=g).to(kernel_device) for m in ms]

    def make():
        return [from_list(xs, ragged_dims=(0,), requires_grad=True), from_list(ys, ragged_dims=(1,), requires_grad=True)]

    fn = (lambda a, b: b + a) if op == "add" else (lambda a, b: a * b)
    compare_backends(fn, make, torch.float32)
    assert dispatch.explain("pair").backend == "triton"
