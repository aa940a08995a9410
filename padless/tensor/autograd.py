"""Autograd bridge between a NestedTensor and its packed ``values``.

Structure-aware handlers compute on ``values`` with ordinary torch ops. Two
autograd functions connect the NestedTensor to that buffer in both directions:

* :func:`values_of` (NestedTensor -> values): the backward wraps the incoming dense
  gradient into a NestedTensor of the same structure;
* :func:`nested_from_values` (values -> NestedTensor): the backward hands the
  NestedTensor gradient's ``values`` to the buffer.

Both are no-ops (no autograd node, no cost) when no gradient is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, static_change


def _grad_values(grad: Tensor, like: NestedTensor | None = None) -> Tensor:
    if isinstance(grad, NestedTensor):
        return grad._values
    raise TypeError(
        f"padless: expected the gradient of a NestedTensor to be a NestedTensor, got a dense "
        f"Tensor of shape {tuple(grad.shape)}"
    )


class _ValuesView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, nt: NestedTensor) -> Tensor:  # type: ignore[override]
        ctx.struct = (nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
        return nt._values.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        if any(st == 0 and n > 1 for st, n in zip(grad.stride(), grad.shape)):
            # e.g. the expanded ones of ``values().sum()``: autograd may keep this gradient as a
            # leaf's ``.grad`` and accumulate into it in place, which an overlapping buffer refuses
            grad = grad.contiguous()
        return NestedTensor(grad, *ctx.struct)


class _NestedView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, offsets, sizes, ragged, envelope, meta) -> NestedTensor:  # type: ignore[override]
        out = NestedTensor(values.detach(), offsets, sizes, ragged, envelope, meta)
        ctx.out = (offsets, sizes, ragged, tuple(envelope), out._meta)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _conform(grad, ctx.out), None, None, None, None, None


def _conform(grad: Tensor, struct: tuple) -> Tensor:
    """The gradient's rows in the layout of the forward output.

    Autograd hands a NestedTensor input the gradient of an op's *output*; when the
    input was stored in another order (a transposed pair), its rows are permuted.
    """
    values = _grad_values(grad)
    offsets, sizes, ragged, envelope, meta = struct
    if grad._meta is meta or grad._ragged == ragged:
        return values
    if set(grad._ragged) != set(ragged):
        raise RuntimeError(
            f"padless: gradient with ragged dims {grad.ragged_dims} cannot flow into a NestedTensor with "
            f"ragged dims {tuple(sorted(ragged))}"
        )
    key = ("relayout", grad._ragged, ragged)
    idx = meta.derived.get(key)
    if idx is None:
        hs = meta.host_sizes if meta.host_sizes is not None else sizes.cpu()
        ho = meta.host_offsets if meta.host_offsets is not None else offsets.cpu()
        _, idx = layout.relayout_rows(hs, ho, grad._ragged, ragged, values.shape[0])
        idx = idx.to(values.device, non_blocking=True)
        meta.derived[key] = idx
    return values.index_select(0, idx)


def _apply(fn: type[torch.autograd.Function], *args):
    """``fn.apply`` without the Python wrapper's functorch bookkeeping when no functorch
    transform is active and nothing is being compiled (a few microseconds per op)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)  # type: ignore[misc]


def values_of(nt: NestedTensor) -> Tensor:
    """``nt``'s packed buffer, differentiable w.r.t. ``nt`` when a gradient is needed."""
    if nt.requires_grad and torch.is_grad_enabled():
        return _apply(_ValuesView, nt)
    return nt._values


def nested_from_values(
    values: Tensor,
    offsets: Tensor,
    sizes: Tensor,
    ragged: tuple[int, ...],
    envelope: Sequence,
    meta: StructureMeta | None = None,
) -> NestedTensor:
    """Build a NestedTensor around ``values``, keeping ``values``' autograd history."""
    if values.requires_grad and torch.is_grad_enabled():
        return _apply(_NestedView, values, offsets, sizes, ragged, tuple(envelope), meta)
    return NestedTensor(values, offsets, sizes, ragged, envelope, meta)


def rewrap(values: Tensor, like: NestedTensor) -> NestedTensor:
    """``values`` on ``like``'s rows (static extents may differ), keeping ``values``' history."""
    if values.shape[1:] == like._values.shape[1:]:
        sizes, meta, env = like._sizes, like._meta, like._env
    else:
        sizes, meta, env = static_change(values, like)
    if values.requires_grad and torch.is_grad_enabled():
        return _apply(_NestedView, values, like._offsets, sizes, like._ragged, env, meta)
    return NestedTensor(values, like._offsets, sizes, like._ragged, env, meta)
