"""``torch.nested`` (NJT) calls that padless tensors answer the same way.

* ``nt.to_padded_tensor(padding, output_size=None)``: the method form of
  ``torch.nested.to_padded_tensor``;
* ``torch.select(nt, dim, index)`` / ``nt.select(dim, index)``: ``dim=0`` gives sample
  ``index`` as a dense tensor (a view of ``values`` when the sample is stored in its own
  dim order), other dims index inside every sample (as ``nt[:, ..., index]``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.ops.common.structure import outer_dim
from padless.tensor.behaviour import getitem
from padless.tensor.convert import padded_copy
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements


@implements(torch.Tensor.to_padded_tensor)
def to_padded_tensor(func, nt: NestedTensor, padding: float, output_size=None) -> Tensor:
    """Dense copy with ``padding`` in the padded positions (``output_size`` may only enlarge)."""
    return padded_copy(nt, padding, output_size)


@implements(torch.select, torch.Tensor.select)
def select(func, nt: NestedTensor, dim: int, index: int) -> Tensor:
    """Sample ``index`` for ``dim=0``; otherwise ``index`` along a dim inside every sample."""
    d = outer_dim(nt, dim, "select")
    if d == 0:
        b = nt.shape[0]
        if not -b <= index < b:
            raise IndexError(f"select(): index {index} is out of range for a batch of {b} samples")
        return getitem(nt, index % b)
    return getitem(nt, (slice(None),) * d + (index,))
