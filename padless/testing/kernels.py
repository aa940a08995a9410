"""Kernel-vs-twin checks: run one op with ``PADLESS_KERNELS=torch`` and ``=triton``.

Used by ``tests/ops/kernels`` (on CPU under ``TRITON_INTERPRET=1``, on CUDA when
present) and by ``benchmarks/gpu_check.py``. Both runs start from the same batch;
outputs and the gradients of every input are compared with per-dtype tolerances.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor

TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
"""Kernels accumulate in float32 and round once; twins round every intermediate op."""

SCALE = max(1, int(os.environ.get("PADLESS_KERNEL_TEST_SCALE", "1")))
"""``PADLESS_KERNEL_TEST_SCALE=k`` multiplies the sizes of the kernel tests (default 1: tiny)."""


@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """Set ``PADLESS_KERNELS`` for the block (``"torch"`` or ``"triton"``)."""
    old = os.environ.get("PADLESS_KERNELS")
    os.environ["PADLESS_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PADLESS_KERNELS", None)
        else:
            os.environ["PADLESS_KERNELS"] = old


def _flat(t: Tensor) -> Tensor:
    return values_of(t) if isinstance(t, NestedTensor) else t


def _leaf_grad(x: Tensor) -> Tensor | None:
    g = x.grad
    if g is None:
        return None
    return g._values if isinstance(g, NestedTensor) else g


def compare_backends(
    fn: Callable[..., Tensor],
    make: Callable[[], Sequence[Tensor]],
    dtype: torch.dtype,
    grad: bool = True,
    **tol: float,
) -> Tensor:
    """Run ``fn(*make())`` with the twins and with the kernels; compare values and gradients.

    ``make`` must build fresh leaves (requires_grad set) each call, from a fixed seed.
    Returns the kernel run's output.
    """
    tol = {**TOL.get(dtype, TOL[torch.float32]), **tol}
    results = []
    for mode in ("torch", "triton"):
        with kernels_mode(mode):
            inputs = list(make())
            out = fn(*inputs)
            vals = _flat(out)
            grads: list[Tensor | None] = []
            if grad and vals.requires_grad and vals.numel():
                gen = torch.Generator().manual_seed(7)
                cot = torch.randn(vals.shape, generator=gen, dtype=torch.float32).to(vals.device, vals.dtype)
                (vals.float() * cot.float()).sum().backward()
                grads = [_leaf_grad(x) for x in inputs]
            results.append((vals.detach(), grads))
    (want, want_g), (got, got_g) = results
    torch.testing.assert_close(got.float(), want.float(), equal_nan=True, **tol, msg=lambda m: f"output: {m}")
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise AssertionError(f"gradient of input {i}: one backend produced none")
        torch.testing.assert_close(a.float(), b.float(), equal_nan=True, **tol, msg=lambda m: f"gradient {i}: {m}")
    return got
