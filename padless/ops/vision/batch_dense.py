"""Dense maps of a batch of images, resized back to every image's own size.

``F.adaptive_avg_pool2d(x, 6)`` of images at their own sizes gives one dense
``(B, C, 6, 6)`` map per batch (every image has the same 6 x 6 bins), and pyramid pooling
(smp's PSPNet and UPerNet) then brings each map back to its image's size:
``F.interpolate(pooled, size=x.shape[2:])`` and concatenates it with ``x``. Dense, that is
"to the padded envelope", and the concatenation would read the envelope-sized map in
padded coordinates: each image would get the top-left crop of a map stretched to the
envelope, not its own map stretched to its own size.

:class:`BatchDense` is that dense map, a plain ``torch.Tensor`` subclass that knows its
dim 0 is a NestedTensor's batch: every op runs on it as on the dense tensor (results that
keep the batch dim keep the knowledge: the PSP block's 1x1 conv, norm and ReLU), and
``F.interpolate(pooled, size=...)`` with a size read from a NestedTensor's shape (entries
that remember each image's own size, :mod:`padless.tensor.extents`) resizes image ``i`` to
its own size and returns a NestedTensor, as the dense code does for each image alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common.dim0 import keeps_dim0
from padless.tensor.construct import from_padded
from padless.tensor.core import NestedTensor
from padless.tensor.engine_calls import ENGINE_CALLS, call_read_as, reads_as
from padless.ops.vision.resample import SIZE_REWRITE
from padless.tensor.extents import Extent, per_sample_extents

__all__ = ["BatchDense", "batch_dense"]


class BatchDense(Tensor):
    """Dense ``(B, ...)`` whose dim 0 is a NestedTensor's batch (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ENGINE_CALLS:  # as the plain tensor it reads as: NestedTensors among inputs then answer
            out = call_read_as(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if any(issubclass(t, NestedTensor) for t in types):
            return NotImplemented  # with a NestedTensor operand its handlers read this as dense
        if func is F.interpolate:
            out = _interpolate_per_image(*args, **kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if func is Tensor.__repr__:
                return out
            src = _source(args, kwargs)
            if src is None or not keeps_dim0(func, args, kwargs, src, mixing=True):
                return out  # dim 0 moved (p.transpose(0, 1), p[perm]): no longer the batch
            return _keep(out, src.shape[0], src.__dict__.get("_lineage"))


reads_as(BatchDense)  # its gradients are asked of the plain tensor it reads as (tensor.engine_calls)


def batch_dense(t: Tensor, lineage: Any = None) -> BatchDense:
    """``t`` (``(B, ...)``, dim 0 the batch of a NestedTensor of lineage ``lineage``, see
    :mod:`padless.tensor.lineage`) as :class:`BatchDense`."""
    out = t.as_subclass(BatchDense)
    out._lineage = lineage
    return out


def _source(args: Any, kwargs: dict) -> BatchDense | None:
    for a in (*args, *kwargs.values()):  # called with torch functions off
        if isinstance(a, BatchDense) and a.dim():
            return a
    return None


def _keep(out: Any, b: int, lineage: Any) -> Any:
    if type(out) in (tuple, list):
        return type(out)(_keep(o, b, lineage) for o in out)
    if type(out) is Tensor and out.dim() >= 1 and out.shape[0] == b:
        return batch_dense(out, lineage)
    return out


def _interpolate_per_image(input: Tensor, size: Any = None, *args: Any, **kwargs: Any) -> NestedTensor | None:
    if size is None or not isinstance(input, BatchDense) or input.dim() < 3:
        return None
    k = input.dim() - 2
    if isinstance(size, Extent):
        size = (size,) * k
    if not isinstance(size, (tuple, list)) or len(size) != k:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        b, spatial = input.shape[0], list(input.shape[2:])
        targets = per_sample_extents(size, _Target(b, input.__dict__.get("_lineage")), "interpolate", SIZE_REWRITE)
        if targets is None:
            return None
        plain = input.as_subclass(Tensor)
        lengths = torch.tensor([spatial] * b, dtype=torch.long)
        images = from_padded(plain, lengths, ragged_dims=tuple(range(1, 1 + k)))
        images._lineage = input.__dict__.get("_lineage")  # the pooled batch's samples
    return F.interpolate(images, targets, *args, **kwargs)  # padless' per-image resize


class _Target:
    """The batch a pooled map belongs to, for :func:`per_sample_extents`."""

    def __init__(self, batch_size: int, lineage: Any) -> None:
        self.batch_size, self._lineage = batch_size, lineage
