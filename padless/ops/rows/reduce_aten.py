"""ATen-level reductions that NJT code calls directly (``torch.ops.aten.mean.dim(nt, [1])``),
and that decompositions and compiled graphs reach below ``__torch_function__``.

``aten.sum`` already had its ATen-level handler (autograd's ``sum_to_size`` needs it); a
direct call from Python now goes to the torch-level ``sum`` too, whose gradient is per
sample, where ATen's backward formula gave a dense gradient of the padded envelope.

Each one is the torch-level handler of :mod:`padless.ops.rows.reduce` with the ATen argument
conventions (an empty ``dim`` list means every dim), registered at both levels: a direct
call from user code is handled above autograd (gradients flow through ``values``, per
sample, not through ATen's padded-shape backward formula), a call from a decomposition or
a backward formula below it. Both give the torch-level result and errors: reducing a ragged dim gives a dense ``(B, ...)`` tensor, reducing the
batch dim alone is refused with a :class:`~padless.StructureError` naming the dims. Without
them these ops ran through the per-sample fallback (slow, with a warning) and returned a
NestedTensor where torch.nested returns a dense tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.ops.rows import reduce
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements, implements_aten

aten = torch.ops.aten


def _dim(nt: NestedTensor, dim: Sequence[int] | None) -> list[int]:
    """ATen's reduction dims: ``None`` or ``[]`` reduce every dim (listed, so ``keepdim``
    keeps each as extent 1, as ATen does)."""
    return list(range(nt.dim())) if dim is None or len(dim) == 0 else list(dim)


@implements(aten.sum.dim_IntList)
def sum_dim_function(func, nt: NestedTensor, dim: Sequence[int] | None = None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """``torch.ops.aten.sum.dim_IntList`` called from Python: :func:`padless.ops.rows.reduce.sum_`,
    so the gradient is per sample (ATen's formula would expand it to the padded envelope).
    Below autograd the ATen handler :func:`padless.ops.rows.pointwise.sum_dim` gives the same result."""
    return reduce.sum_(func, nt, _dim(nt, dim), keepdim, dtype=dtype)


@implements(aten.sum.default)
def sum_default_function(func, nt: NestedTensor, *, dtype=None) -> Tensor:
    """``torch.ops.aten.sum.default`` called from Python: the sum of every real element."""
    return reduce.sum_(func, nt, None, False, dtype=dtype)


@implements(aten.mean.dim)
@implements_aten(aten.mean.dim)
def mean_dim(func, nt: NestedTensor, dim: Sequence[int] | None = None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """``aten.mean.dim``: :func:`padless.ops.rows.reduce.mean` over ``dim``."""
    return reduce.mean(func, nt, _dim(nt, dim), keepdim, dtype=dtype)


@implements(aten.amax.default)
@implements_aten(aten.amax.default)
def amax_default(func, nt: NestedTensor, dim: Sequence[int] = (), keepdim: bool = False) -> Tensor:
    """``aten.amax``: :func:`padless.ops.rows.reduce.amax` over ``dim`` (``[]``: every element)."""
    return reduce.amax(func, nt, _dim(nt, dim), keepdim)


@implements(aten.amin.default)
@implements_aten(aten.amin.default)
def amin_default(func, nt: NestedTensor, dim: Sequence[int] = (), keepdim: bool = False) -> Tensor:
    """``aten.amin``: :func:`padless.ops.rows.reduce.amin` over ``dim`` (``[]``: every element)."""
    return reduce.amin(func, nt, _dim(nt, dim), keepdim)
