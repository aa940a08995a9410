"""Binary elementwise ops and pooled lookups that padless answers the way ``torch.nested`` (NJT) does.

* ``torch.rsub``, ``torch.complex`` and ``torch.polar`` run on packed rows like every other
  elementwise op (their ATen schemas lack the pointwise tag, so the generic path missed them
  and the per-sample fallback handed a dense ``(B, 1)`` operand to every sample whole):
  a dense operand with a batch dim is read per sample, ``(B, 1) - nt`` gives sample ``i`` the
  row ``i`` (as NJT does).
* Gradients that are zero by definition (``copysign``'s and ``nextafter``'s w.r.t. ``other``,
  ``sgn``'s for real input): autograd builds them from the input's shape alone, as a *dense*
  zero tensor of the padded envelope, because padless tensors are not C++ nested tensors.
  Each NestedTensor operand of these ops is seen through an identity view whose backward
  packs such a gradient back into the operand's structure (:class:`_PackDenseGrad`), so
  ``x.grad`` is a NestedTensor of zeros, as for NJT.
* ``F.embedding_bag(nt, weight)`` with a NestedTensor of 1-d id samples: one bag per sample
  (NJT's rule: the ids are ``nt.values()``, the bags its offsets), optional
  ``per_sample_weights`` a NestedTensor of ``nt``'s structure; the result is dense ``(B, dim)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common.engine import pointwise_aten, pointwise_function
from padless.tensor.autograd import _apply, guard_broadcast, values_of
from padless.tensor.core import NestedTensor, _needs_grad, _structure_mismatch
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements, implements_aten

aten = torch.ops.aten

# Elementwise, but without the pointwise tag (torch 2.13): the generic handler, registered by name.
implements_aten(aten.rsub.Tensor, aten.complex.default, aten.polar.default, accepts="packed, dense or scalar operands")(
    pointwise_aten
)


class _PackDenseGrad(torch.autograd.Function):
    """Identity on a NestedTensor; its backward turns a dense gradient of the padded envelope
    (what autograd builds from shapes alone, e.g. ``zeros(other.shape)``) into a NestedTensor
    of the operand's structure. A NestedTensor gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, nt: NestedTensor) -> NestedTensor:  # type: ignore[override]
        ctx.struct = (nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
        ctx.rows = tuple(nt._values.shape)
        return NestedTensor(nt._values.detach(), *ctx.struct)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        if isinstance(grad, NestedTensor):
            return grad
        if grad._is_zerotensor():  # the usual case: no data to read
            return NestedTensor(grad.new_zeros(ctx.rows), *ctx.struct)
        from padless.tensor.convert import pack_like

        like = NestedTensor(grad.new_zeros(()).expand(ctx.rows), *ctx.struct)
        return pack_like(grad, like)


def _pack_dense_grads(a: Any) -> Any:
    return _apply(_PackDenseGrad, a) if isinstance(a, NestedTensor) and a.requires_grad else a


@implements(
    torch.copysign, torch.Tensor.copysign, torch.nextafter, torch.Tensor.nextafter, torch.sgn, torch.Tensor.sgn,
    accepts="packed, dense or scalar operands",
)
def zero_grad_elementwise(func, *args, **kwargs):
    """``copysign`` / ``nextafter`` / ``sgn``: elementwise on rows; NestedTensor operands that
    need a gradient go through :class:`_PackDenseGrad` (their zero gradient arrives dense)."""
    if torch.compiler.is_compiling():
        return func(*args, **kwargs)
    if not _needs_grad(args, kwargs):
        return pointwise_function(func, args, kwargs)
    args, kwargs = guard_broadcast(args, kwargs)
    return func(*[_pack_dense_grads(a) for a in args], **{k: _pack_dense_grads(v) for k, v in kwargs.items()})


@implements(F.embedding_bag, accepts="packed 1-d id samples, dense weight, packed per_sample_weights")
def embedding_bag(
    func,
    input: Any,
    weight: Tensor,
    offsets: Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Any = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> Tensor:
    """``F.embedding_bag(nt, weight)``: one bag per sample of ``nt`` (1-d id samples), dense ``(B, dim)``.

    The ids are ``nt.values()`` and the bags are its offsets, as for ``torch.nested``; an empty
    sample pools to zeros. ``per_sample_weights`` (mode ``'sum'``) is a NestedTensor of ``nt``'s
    structure; gradients reach ``weight`` and ``per_sample_weights``.
    """
    what = "embedding_bag()"
    if not isinstance(input, NestedTensor):
        raise TypeError(
            f"{what}: with a NestedTensor per_sample_weights, input must be a NestedTensor of ids of its "
            f"structure, got {type(input).__name__}"
        )
    if isinstance(weight, NestedTensor):
        raise TypeError(f"{what}: weight must be a dense (num_embeddings, dim) tensor, got a NestedTensor")
    if input.sample_dim != 1:
        raise StructureError(
            f"{what}: a NestedTensor input holds one bag of ids per sample, so its samples must be 1-d; got "
            f"samples of rank {input.sample_dim} (envelope {tuple(input.shape)}). Flatten each sample first "
            "(nt.flatten(1)) or pass nt.values() with offsets"
        )
    if offsets is not None:
        raise ValueError(
            f"{what}: offsets must be None when input is a NestedTensor (its samples are the bags); got a "
            f"{type(offsets).__name__}"
        )
    if include_last_offset:
        raise ValueError(f"{what}: include_last_offset has no meaning with a NestedTensor input (its samples are the bags)")
    psw = None
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, NestedTensor):
            raise TypeError(
                f"{what}: with a NestedTensor input, per_sample_weights must be a NestedTensor of its structure, "
                f"got {type(per_sample_weights).__name__}"
            )
        why = _structure_mismatch(input, per_sample_weights, what)
        if why is not None:
            raise StructureError(f"{what}: per_sample_weights must have input's structure: {why}")
        psw = values_of(per_sample_weights)
    return F.embedding_bag(
        input._values,
        weight,
        input._offsets,
        max_norm=max_norm,
        norm_type=norm_type,
        scale_grad_by_freq=scale_grad_by_freq,
        mode=mode,
        sparse=sparse,
        per_sample_weights=psw,
        include_last_offset=True,
        padding_idx=padding_idx,
    )
