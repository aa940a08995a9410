"""Layout conversions: Triton kernels vs torch twins, and vs NestedTensor.to_padded."""

import random

import pytest
import torch

from padless.ops.kernels import dispatch
from padless.ops.kernels.layout import LayoutMeta, packed_to_padded, padded_to_packed, transpose_pair, valid_mask
from padless.testing import make_batch
from padless.testing.kernels import SCALE, compare_backends, kernels_mode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = ["empty_sample", "all_empty", "one_sample", "pair", "rect", "three_ragged", "channels_first"]


def _meta(nt, device):
    hs = nt.host_sizes()
    return LayoutMeta.from_host(hs, nt.ragged_dims_sample if hasattr(nt, "ragged_dims_sample") else nt._ragged,
                                list(nt._env), device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_padded_roundtrip_matches_twin(kernel_device, dtype):
    for name in VARIANTS if dtype == torch.float32 else ["pair"]:
        nt, _ = make_batch(name, dtype=dtype, device=kernel_device)
        meta = _meta(nt, kernel_device)
        vals = nt._values
        total = vals.shape[0]

        def make():
            return [vals.clone().requires_grad_()]

        grid = compare_backends(lambda x: packed_to_padded(x, meta, -1.0), make, dtype)
        assert dispatch.explain("layout").backend == "triton"
        compare_backends(lambda g: padded_to_packed(g, meta, total), lambda: [grid.clone().requires_grad_()], dtype)


def test_kernel_grid_is_to_padded(kernel_device):
    for name in ("pair", "three_ragged", "channels_first", "empty_sample"):
        nt, _ = make_batch(name, device=kernel_device)
        meta = _meta(nt, kernel_device)
        with kernels_mode("triton"):
            grid = packed_to_padded(nt._values, meta, 0.0)
            mask = valid_mask(meta, nt._values.shape[0])
        b = nt.batch_size
        env = [nt._env[d] for d in nt._ragged]
        want = nt.to_padded(0.0)
        # to_padded permutes the grid (B, *ragged env, *static) to sample order
        order = nt.storage_order
        inv = [order.index(d) for d in range(len(order))]
        got = grid.reshape(b, *env, *nt._values.shape[1:]).permute(0, *[p + 1 for p in inv])
        torch.testing.assert_close(got, want)
        assert int(mask.sum()) == nt._values.shape[0]


def test_thousands_of_short_samples(kernel_device):
    rng = random.Random(0)
    lens = [rng.randint(0, 2) for _ in range(1000 * SCALE)]
    sizes = torch.tensor([[n, 2] for n in lens])
    meta = LayoutMeta.from_host(sizes, (0,), [2, 2], kernel_device)
    x = torch.randn(sum(lens), 2, device=kernel_device)
    compare_backends(lambda v: packed_to_padded(v, meta, 0.0), lambda: [x.clone()], torch.float32, grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transpose_pair_matches_twin(kernel_device, dtype):
    ns, ms = [3, 0, 2, 20 * SCALE], [2, 4, 2, 3]
    n, m = torch.tensor(ns, device=kernel_device), torch.tensor(ms, device=kernel_device)
    rows = n * m
    offsets = torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])
    x = torch.randn(int(rows.sum()), 5, device=kernel_device).to(dtype)
    compare_backends(lambda v: transpose_pair(v, n, m, offsets, int(rows.max())), lambda: [x.clone().requires_grad_()], dtype)
    # the twin against per-sample transposes
    parts = torch.split(x, rows.tolist())
    want = torch.cat([p.reshape(a, b, 5).transpose(0, 1).reshape(-1, 5) for p, a, b in zip(parts, ns, ms)])
    with kernels_mode("triton"):
        torch.testing.assert_close(transpose_pair(x, n, m, offsets, int(rows.max())), want)


def test_more_than_three_ragged_dims_is_an_error():
    with pytest.raises(ValueError, match=r"layout kernels: at most 3 ragged dims, got 4"):
        LayoutMeta.from_host(torch.ones(1, 4, dtype=torch.long), (0, 1, 2, 3), [1, 1, 1, 1], "cpu")


def test_to_padded_runs_the_kernel(kernel_device, monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    for name in ("pair", "channels_first", "empty_sample"):
        nt, dense = make_batch(name, device=kernel_device, requires_grad=True)
        got = nt.to_padded(-1.0)
        assert dispatch.explain("layout").backend == "triton"
        monkeypatch.setenv("PADLESS_KERNELS", "torch")
        want = nt.to_padded(-1.0)
        monkeypatch.setenv("PADLESS_KERNELS", "triton")
        torch.testing.assert_close(got, want)
        (got * 2).sum().backward()  # every packed element reaches exactly one padded slot
        torch.testing.assert_close(nt.grad._values, torch.full_like(nt._values, 2.0))


def test_contiguous_of_a_transposed_pair_runs_the_kernel(kernel_device):
    make = lambda: [make_batch("rect", requires_grad=True, device=kernel_device)[0]]  # noqa: E731
    compare_backends(lambda x: x.transpose(1, 2).contiguous(), make, torch.float32)
    assert dispatch.explain("layout").backend == "triton"
