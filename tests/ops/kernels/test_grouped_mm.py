"""Grouped matmul: one launch for per-sample contractions, vs the per-sample twin."""

import random

import pytest
import torch

from padless.ops.kernels import dispatch
from padless.tensor.construct import from_list
from padless.testing.kernels import SCALE, compare_backends

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _nt(shapes, ragged, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return from_list([torch.randn(s, generator=g).to(device, dtype) for s in shapes], ragged_dims=ragged,
                     requires_grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_scores_and_values(kernel_device, dtype):
    lens = [3, 0, 5, 1] if dtype == torch.float32 else [3, 5]
    q = lambda: _nt([(2, n, 4) for n in lens], (1,), dtype, kernel_device, 0)  # noqa: E731
    k = lambda: _nt([(2, n, 4) for n in lens], (1,), dtype, kernel_device, 1)  # noqa: E731
    compare_backends(lambda a, b: a @ b.transpose(-1, -2), lambda: [q(), k()], dtype)
    assert dispatch.explain("grouped_mm").backend == "triton"
    attn = lambda: _nt([(2, n, n) for n in lens], (1, 2), dtype, kernel_device, 2)  # noqa: E731
    v = lambda: _nt([(2, n, 3) for n in lens], (1,), dtype, kernel_device, 3)  # noqa: E731
    compare_backends(lambda a, b: a @ b, lambda: [attn(), v()], dtype)
    assert dispatch.explain("grouped_mm").backend == "triton"


def test_rectangular_cross_scores(kernel_device):
    q = lambda: _nt([(3, 4), (1, 4), (5, 4)], (0,), torch.float32, kernel_device, 0)  # noqa: E731
    k = lambda: _nt([(2, 4), (6, 4), (0, 4)], (0,), torch.float32, kernel_device, 1)  # noqa: E731
    compare_backends(lambda a, b: a @ b.transpose(-1, -2), lambda: [q(), k()], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triangle_einsums(kernel_device, dtype):
    ns = [3, 0, 4 * SCALE, 1]
    a = lambda: _nt([(n, n, 3) for n in ns], (0, 1), dtype, kernel_device, 0)  # noqa: E731
    b = lambda: _nt([(n, n, 3) for n in ns], (0, 1), dtype, kernel_device, 1)  # noqa: E731
    for eq in ("bikc,bjkc->bijc", "bkic,bkjc->bijc"):
        compare_backends(lambda x, y: torch.einsum(eq, x, y), lambda: [a(), b()], dtype)
        assert dispatch.explain("grouped_mm").backend == "triton", eq


def test_blocks_wider_than_one_tile(kernel_device):
    # M, N, K all above the 32-wide tile
    q = lambda: _nt([(40 * SCALE, 36), (33, 36)], (0,), torch.float32, kernel_device, 0)  # noqa: E731
    k = lambda: _nt([(35, 36), (34, 36)], (0,), torch.float32, kernel_device, 1)  # noqa: E731
    compare_backends(lambda a, b: a @ b.transpose(-1, -2), lambda: [q(), k()], torch.float32)


def test_thousands_of_short_samples(kernel_device):
    rng = random.Random(0)
    lens = [rng.randint(0, 2) for _ in range(1000 * SCALE)]
    q = lambda: _nt([(n, 2) for n in lens], (0,), torch.float32, kernel_device, 0)  # noqa: E731
    compare_backends(lambda a: a @ a.transpose(-1, -2), lambda: [q()], torch.float32, grad=False)


def test_mismatched_contraction_still_raises(kernel_device, monkeypatch):
    monkeypatch.setenv("PADLESS_KERNELS", "triton")
    a = _nt([(2, 3), (2, 4)], (1,), torch.float32, kernel_device, 0)
    b = _nt([(3, 2), (5, 2)], (0,), torch.float32, kernel_device, 1)
    with pytest.raises(RuntimeError, match="cannot be multiplied|size mismatch|must match|contracts dims of extents"):
        a @ b
