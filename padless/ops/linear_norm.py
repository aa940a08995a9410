"""Feature-wise layers: they act on the static tail of every row, so they run once on ``values``.

``F.linear`` / ``nn.Linear`` over the last dim, ``F.layer_norm`` / ``nn.LayerNorm``
over trailing static dims, ``F.dropout``. The last sample dim must be static
(a ragged last dim has no fixed feature size); the error says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError


def _trailing_static(name: str, nt: NestedTensor, k: int) -> None:
    d = nt.sample_dim
    for j in range(d - k, d):
        if j in nt._ragged:
            raise StructureError(
                f"{name}(): sample dim {j} is ragged, but {name} acts on the last {k} dim(s); "
                "transpose/permute the features to the end first (e.g. x.transpose(1, 2))"
            )
    if nt.storage_order[-k:] != tuple(range(d - k, d)):
        raise ValueError(f"{name}(): the feature dims must be the trailing static dims of the layout")


@implements(F.linear, accepts="packed, dense weight, dense bias")
def linear(func, x: NestedTensor, weight: Tensor, bias: Tensor | None = None) -> NestedTensor:
    """``y = x @ W.T + b`` on every row; samples keep their shape but the last dim."""
    if isinstance(weight, NestedTensor) or isinstance(bias, NestedTensor):
        raise TypeError("linear(): weight and bias must be dense tensors")
    _trailing_static("linear", x, 1)
    return rewrap(F.linear(values_of(x), weight, bias), x)


@implements(F.layer_norm, accepts="packed, dense weight, dense bias")
def layer_norm(func, x: NestedTensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> NestedTensor:
    """Layer norm over trailing static dims (never over a ragged dim)."""
    k = len(normalized_shape) if not isinstance(normalized_shape, int) else 1
    _trailing_static("layer_norm", x, k)
    return rewrap(F.layer_norm(values_of(x), normalized_shape, weight, bias, eps), x)


@implements(F.dropout, accepts="packed")
def dropout(func, x: NestedTensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> NestedTensor:
    """Dropout on real elements only (padding is never drawn)."""
    if not training or p == 0.0:
        return x
    return rewrap(F.dropout(values_of(x), p, training, False), x)
