"""Autocast around padless' own autograd nodes.

A custom ``autograd.Function`` that calls ATen inside its forward escapes torch's autocast
policy (``torch.ops.aten.convolution`` is not on it) or, when the policy does apply inside,
leaves the backward with operands of two dtypes. The nodes that do math (the planned
convolution, the bucketed contraction) therefore cast their floating inputs to the autocast
dtype outside the node and run it with autocast off, as ``torch.amp.custom_fwd(cast_inputs=...)``
does: the node sees one dtype forward and backward, and autograd casts the gradients back.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["autocast_inputs"]


@contextlib.contextmanager
def autocast_inputs(*tensors: Tensor | None) -> Iterator[tuple[Tensor | None, ...]]:
    """``tensors`` cast to the autocast dtype of their device (float32 ones only) with autocast
    off inside the block, when autocast is on; else ``tensors`` unchanged."""
    first = next(t for t in tensors if t is not None)
    dev = first.device.type
    if not torch.is_autocast_enabled(dev) or not any(t is not None and t.dtype == torch.float32 for t in tensors):
        yield tensors
        return
    low = torch.get_autocast_dtype(dev)
    cast = tuple(t.to(low) if t is not None and t.dtype == torch.float32 else t for t in tensors)
    with torch.autocast(dev, enabled=False):
        yield cast
