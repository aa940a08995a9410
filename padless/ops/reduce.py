"""Reductions over NestedTensors (torch-function level, autograd through ``values``).

Rule: a reduction never sees padding. ``x.sum()`` / ``x.mean()`` with no dim reduce
every real element; a mean over zero elements is NaN, as in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements


def _no_dim(name: str, dim) -> None:
    if dim is not None:
        raise NotImplementedError(
            f"{name}(dim={dim!r}) on a NestedTensor: reductions over single dims are not available yet; "
            f"{name}() with no dim reduces every real element"
        )


@implements(torch.sum, torch.Tensor.sum)
def sum_(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Sum of every real element (``dim=None``)."""
    _no_dim("sum", dim)
    return values_of(nt).sum(dtype=dtype)


@implements(torch.mean, torch.Tensor.mean)
def mean(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Mean over every real element (``dim=None``); NaN for a batch with no elements."""
    _no_dim("mean", dim)
    return values_of(nt).mean(dtype=dtype)
