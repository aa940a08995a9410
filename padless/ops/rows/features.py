"""Feature-wise ops: norms, gating and lookups that act inside every sample's static dims.

Everything here runs on the packed rows of ``values`` and keeps the ragged
structure; none of it ever sees padding.

* ``F.rms_norm`` / ``nn.RMSNorm`` over trailing static dims (like ``layer_norm``);
* ``F.group_norm`` / ``nn.GroupNorm`` on channels-first samples ``(C, *spatial)``,
  e.g. images ``(C, H_i, W_i)``: statistics are per sample and per group, over the
  group's channels and *that sample's* spatial positions, with one segmented
  ``index_add`` over all rows of the batch;
* ``F.glu`` / ``nn.GLU`` and ``F.normalize`` over a static dim;
* ``F.embedding`` / ``nn.Embedding`` on an integer NestedTensor of any layout: the
  output gains a trailing static dim of extent ``embedding_dim``.

Layout of a group-norm input (two ``(C=2, L_i)`` samples, ``L = 2, 1``)::

    samples   [[a0 b0]    [[c0]
               [a1 b1]]    [c1]]
    values    [[a0 a1] [b0 b1] [c0 c1]]      (T=3, C=2): one row per position
    groups    sample 0 reduces rows 0-1, sample 1 reduces row 2 (per channel group)
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.rows.linear_norm import _trailing_static
from padless.ops.common.structure import STATIC, keep_all, restructure, sample_dim, values_dim
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _dense_only(op: str, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if isinstance(t, NestedTensor):
            raise TypeError(
                f"{op}(): {name} must be a dense tensor (one value per feature), got a NestedTensor"
            )


def _static_values_dim(op: str, nt: NestedTensor, dim: int) -> int:
    """Outer ``dim`` -> the dim of ``values`` holding it; a ragged dim is refused."""
    s = sample_dim(nt, dim, op)
    if s in nt._ragged:
        static = [d + 1 for d in range(nt.sample_dim) if d not in nt._ragged]
        raise StructureError(
            f"{op}(): dim {dim} is ragged (sample dim {s}); {op} acts along a static dim, "
            f"and this NestedTensor's static dims are {static} (e.g. dim=-1 for features last)"
        )
    return values_dim(nt, s)


@implements(F.rms_norm, torch.rms_norm, accepts="packed, dense weight")
def rms_norm(
    func,
    x: NestedTensor,
    normalized_shape: Sequence[int] | int,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> NestedTensor:
    """RMS norm over the trailing static dims of every row (never over a ragged dim).

    >>> x = padless.from_list([torch.randn(3, 8), torch.randn(5, 8)])
    >>> torch.nn.RMSNorm(8)(x).values().shape
    torch.Size([8, 8])
    """
    _dense_only("rms_norm", weight=weight)
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    _trailing_static("rms_norm", x, k)
    return rewrap(F.rms_norm(values_of(x), normalized_shape, weight, eps), x)


@implements(F.group_norm, accepts="packed (C, *spatial), dense weight, dense bias")
def group_norm(
    func,
    x: NestedTensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> NestedTensor:
    """Group norm of channels-first samples ``(C, *spatial)`` with ragged spatial dims.

    For every sample and every group of ``C // num_groups`` channels, mean and
    (biased) variance are taken over those channels and all of the sample's spatial
    positions, exactly as ``F.group_norm`` on that sample alone. Sample dim 0 (dim 1
    of the NestedTensor) is the channel dim and must be static.

    >>> imgs = padless.from_list([torch.randn(4, 5, 6), torch.randn(4, 3, 2)])   # (C, H_i, W_i)
    >>> torch.nn.GroupNorm(2, 4)(imgs).values().shape
    torch.Size([36, 4])
    """
    _dense_only("group_norm", weight=weight, bias=bias)
    if x.sample_dim < 1 or 0 in x._ragged:
        raise StructureError(
            "group_norm(): dim 1 (the channel dim) is ragged; group_norm needs channels-first samples "
            "(C, *spatial) with a static C, e.g. images (C, H_i, W_i). For (L_i, C) sequences, "
            "transpose first: x.transpose(1, 2)"
        )
    v = values_of(x)
    t, c = v.shape[0], v.shape[1]
    if not isinstance(num_groups, int) or num_groups <= 0 or c % num_groups != 0:
        raise ValueError(f"group_norm(): num_groups={num_groups!r} must be a positive divisor of the {c} channels")
    rest = v.shape[2:]
    per_row = (c // num_groups) * math.prod(rest)  # elements of one group in one row
    acc = v.float() if v.dtype in _LOW_PRECISION else v
    grouped = acc.reshape(t, num_groups, per_row)

    b = x.batch_size
    sid = x.row_sample_ids()
    rows = (x._offsets[1:] - x._offsets[:-1]).to(acc.dtype)
    count = (rows * per_row).clamp_min(1).unsqueeze(1)  # (B, 1); empty samples own no rows
    mean = acc.new_zeros(b, num_groups).index_add(0, sid, grouped.sum(2)) / count
    centered = grouped - mean.index_select(0, sid).unsqueeze(2)
    var = acc.new_zeros(b, num_groups).index_add(0, sid, centered.square().sum(2)) / count
    out = centered * torch.rsqrt(var + eps).index_select(0, sid).unsqueeze(2)

    out = out.reshape(v.shape)
    affine_shape = (c,) + (1,) * len(rest)
    if weight is not None:
        out = out * weight.to(acc.dtype).reshape(affine_shape)
    if bias is not None:
        out = out + bias.to(acc.dtype).reshape(affine_shape)
    return rewrap(out.to(v.dtype), x)


@implements(F.glu, accepts="packed")
def glu(func, x: NestedTensor, dim: int = -1) -> NestedTensor:
    """Gated linear unit ``a * sigmoid(b)`` with ``a, b`` the halves of static dim ``dim``."""
    vd = _static_values_dim("glu", x, dim)
    v = values_of(x)
    if v.shape[vd] % 2 != 0:
        raise ValueError(f"glu(): dim {dim} has size {v.shape[vd]}; glu halves it, so it must be even")
    return rewrap(F.glu(v, vd), x)


@implements(F.normalize, accepts="packed")
def normalize(
    func, x: NestedTensor, p: float = 2.0, dim: int | Sequence[int] = 1, eps: float = 1e-12, out: Tensor | None = None
) -> NestedTensor:
    """``x / max(||x||_p, eps)`` along static dim(s) ``dim`` of every row.

    Mind torch's default ``dim=1``: for ``(L_i, C)`` sequences dim 1 is the ragged
    dim, so pass ``dim=-1`` to normalize features.
    """
    if out is not None:
        raise TypeError("normalize(): out= is not supported with NestedTensor operands")
    dims = [dim] if isinstance(dim, int) else list(dim)
    vdims = [_static_values_dim("normalize", x, d) for d in dims]
    return rewrap(F.normalize(values_of(x), p, vdims[0] if isinstance(dim, int) else vdims, eps), x)


@implements(F.embedding, accepts="packed integer input, dense weight")
def embedding(
    func,
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> NestedTensor:
    """Look up every id of an integer NestedTensor; the output gains a trailing static dim.

    Works for any layout: ids ``(L_i,)`` give ``(L_i, E)``, ids ``(C, L_i)`` give
    ``(C, L_i, E)``. ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` behave as in ``F.embedding``.

    >>> ids = padless.from_list([torch.tensor([1, 2, 3]), torch.tensor([4])])
    >>> torch.nn.Embedding(10, 8)(ids).values().shape
    torch.Size([4, 8])
    """
    if not isinstance(input, NestedTensor):
        raise TypeError(
            "embedding(): the weight is a NestedTensor; only the input (ids) may be a NestedTensor, "
            "the weight must be a dense (num_embeddings, embedding_dim) tensor"
        )
    _dense_only("embedding", weight=weight)
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"embedding(): input must be an integer (int64 or int32) NestedTensor of ids, got {input.dtype}"
        )
    out = F.embedding(input._values, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    return restructure(input, out, keep_all(input) + [(STATIC, weight.shape[-1])])
