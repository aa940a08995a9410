"""Feature-wise layers: they act on the static tail of every row, so they run once on ``values``.

``F.linear`` / ``nn.Linear`` over the last dim, ``F.layer_norm`` / ``nn.LayerNorm``
over trailing static dims (or over whole samples, ragged dims included, when
``normalized_shape`` spans every sample dim, e.g. ``x.shape[1:]``), ``F.dropout``. The last sample dim must be static
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
    # Static dims are stored ascending after the ragged ones (layout.storage_order), so once the
    # last k dims are static they are the trailing dims of every row: only k itself can fail.
    if k > d or (k == 0 and d > 0):
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
    """Layer norm over trailing static dims, or over whole samples when ``normalized_shape``
    spans every sample dim including ragged ones (as torch.nested does for ``x.shape[-2:]``)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    d = x.sample_dim
    if len(shape) == d and any(j in x._ragged for j in range(d)):
        return _whole_sample_layer_norm(x, shape, weight, bias, eps)
    _trailing_static("layer_norm", x, len(shape))
    return rewrap(F.layer_norm(values_of(x), normalized_shape, weight, bias, eps), x)


def _whole_sample_layer_norm(x: NestedTensor, shape: tuple, weight, bias, eps: float) -> NestedTensor:
    """Normalise every sample over all of its elements (mean and biased variance per sample);
    ``weight``/``bias`` act on the trailing static dims, as torch.nested accepts them."""
    op = "layer_norm"
    env = x._env
    for j, (want, got) in enumerate(zip(env, shape)):
        if int(got) != int(want):
            kind = "ragged" if j in x._ragged else "static"
            raise StructureError(
                f"{op}(): normalized_shape {tuple(int(s) for s in shape)} does not match the samples: sample dim {j} "
                f"({kind}) has envelope extent {want}, normalized_shape gives {got}; pass x.shape[1:] to "
                "normalise each whole sample"
            )
    v = values_of(x)
    static = tuple(v.shape[1:])
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if isinstance(t, NestedTensor) or t.dim() > len(static) or tuple(t.shape) != static[len(static) - t.dim():]:
            raise StructureError(
                f"{op}(): {name} of shape {tuple(t.shape)} must match the trailing static dims {static} when "
                "normalized_shape spans a ragged dim (it is applied to every row)"
            )
    d, ns = x.sample_dim, v.dim() - 1
    if ns and x.storage_order[-ns:] != tuple(range(d - ns, d)):
        raise StructureError(f"{op}(): the static dims must be stored last to apply weight/bias; call x.contiguous() first")
    acc = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    rows = v.reshape(v.shape[0], -1).to(acc)
    sid = x.row_sample_ids()
    per_row = rows.shape[1]
    count = ((x._offsets[1:] - x._offsets[:-1]) * per_row).to(acc).clamp_min(1)
    mean = rows.new_zeros(x.batch_size).index_add(0, sid, rows.sum(1)) / count
    centered = rows - mean.index_select(0, sid).unsqueeze(1)
    var = rows.new_zeros(x.batch_size).index_add(0, sid, centered.square().sum(1)) / count
    out = (centered * torch.rsqrt(var + eps).index_select(0, sid).unsqueeze(1)).to(v.dtype).reshape(v.shape)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return rewrap(out, x)


@implements(F.dropout, accepts="packed")
def dropout(func, x: NestedTensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> NestedTensor:
    """Dropout on real elements only (padding is never drawn).

    Under ``torch.compile`` the keep mask comes from :func:`dropout_scale`, an opaque op that
    draws with ATen's generator as eager does: inductor's generated code would otherwise draw
    one Philox number per element, which on the CPU costs more than the rest of a small
    layer's elementwise work (a compiled decoder layer was slower than eager)."""
    if not training or p == 0.0:
        return x
    vals = values_of(x)
    if torch.compiler.is_compiling() and 0.0 < p < 1.0:
        return rewrap(vals * torch.ops.padless.dropout_scale(vals.detach(), float(p)), x)
    return rewrap(F.dropout(vals, p, training, False), x)


@torch.library.custom_op("padless::dropout_scale", mutates_args=())
def dropout_scale(x: Tensor, p: float) -> Tensor:
    """``bernoulli(1 - p) / (1 - p)`` in ``x``'s shape, dtype and device, ATen's generator."""
    return torch.empty_like(x).bernoulli_(1.0 - p).div_(1.0 - p)


@dropout_scale.register_fake
def _dropout_scale_fake(x: Tensor, p: float) -> Tensor:
    return torch.empty_like(x)
