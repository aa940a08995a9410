"""Reductions that skip elements: ``torch.nansum``, ``torch.nanmean``, ``torch.count_nonzero``.

Each one is a :mod:`padless.ops.rows.reduce` sum over the same dims, so it follows the same rules
(a ragged dim reduced gives a dense ``(B, ...)`` tensor, the batch dim only together with every
ragged dim, ``keepdim`` keeps reduced dims as extent 1) and runs as one segmented sum over the
packed rows:

* ``nansum``: the sum with NaNs counted as zero (their gradient is zero, as torch);
* ``nanmean``: that sum over the count of non-NaN elements (NaN where every one is NaN);
* ``count_nonzero``: the int64 count of non-zero elements (no ``keepdim``, as torch).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.ops.rows import reduce
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements

_Dim = int | Sequence[int] | None


class _NanToZero(torch.autograd.Function):
    """NaN -> 0; the gradient is ``grad * (x is not NaN)``, as torch's ``nansum`` backward
    (so an infinite or NaN incoming gradient gives NaN at a NaN input, as in torch)."""

    @staticmethod
    def forward(ctx, v: Tensor) -> Tensor:
        keep = ~v.isnan()
        ctx.save_for_backward(keep)
        return torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (keep,) = ctx.saved_tensors
        return grad * keep


def _not_nan(nt: NestedTensor) -> NestedTensor:
    """``nt`` with every NaN replaced by 0 (see :class:`_NanToZero` for the gradient)."""
    v = values_of(nt)
    return rewrap(_NanToZero.apply(v) if v.requires_grad else v.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf), nt)


@implements(torch.nansum, torch.Tensor.nansum)
def nansum(func, nt: NestedTensor, dim: _Dim = None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Sum of the real elements, NaNs counted as zero: ``x.nansum(dim=1)`` on ``(L_i, C)`` gives ``(B, C)``."""
    return reduce.sum_(func, _not_nan(nt), dim, keepdim, dtype=dtype)


@implements(torch.nanmean, torch.Tensor.nanmean)
def nanmean(func, nt: NestedTensor, dim: _Dim = None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Mean of the non-NaN real elements; NaN where there is none (as torch)."""
    total = reduce.sum_(func, _not_nan(nt), dim, keepdim, dtype=dtype)
    v = nt._values
    count = rewrap((~v.isnan()).to(total.dtype), nt)
    return total / reduce.sum_(func, count, dim, keepdim)


@implements(torch.count_nonzero, torch.Tensor.count_nonzero)
def count_nonzero(func, nt: NestedTensor, dim: _Dim = None) -> Tensor:
    """int64 count of the non-zero real elements over ``dim`` (every element when None)."""
    v = nt._values
    return reduce.sum_(func, rewrap((v != 0).to(torch.int64), nt), dim, False)
