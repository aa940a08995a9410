"""Shape idioms of code written for padded batches, on NestedTensors.

* ``x.reshape(-1, C)`` / ``x.view(-1, C)`` when the target flattens every real row (ragged
  dims leading, in storage order, the static tail regrouped): the batch is gone, so the
  result is the dense ``values()`` ``(T, C)`` (autograd kept), exactly the per-sample
  flattenings concatenated. Samples ``(2, C)``, ``(0, C)``, ``(3, C)`` give ``(5, C)``.
  When the flattening keeps one row per row (``T`` rows), the result remembers the batch
  (:class:`padless.ops.rows.packed_rows.PackedRows`): row-wise work on it, then a ``view``
  back to ``x.shape`` (with a new last dim) gives the NestedTensor back.
* ``qkv.unbind(dim)`` on a static dim: a tuple of NestedTensors (views of ``values``).
* ``dense.expand_as(nt)``: the dense tensor broadcast to every sample (a dense operand in
  padded coordinates is read at each element's coordinates, see
  :mod:`padless.ops.common.padded`), with ``nt``'s structure.
* ``torch.cat([cls, x], dim=1)`` with a dense ``(B, k, C)`` block (ViT class and register
  tokens, ``cls_token.expand(B, -1, -1)``) along the sole ragged dim: the same ``k`` rows
  join every sample. Along a static dim a dense operand in padded coordinates is read
  per element, as in elementwise ops.
* ``torch.cat([empty, nt], dim)``: an empty dense tensor (a KV cache before its first step,
  ``(0,)``, or extent 0 along ``dim`` and the envelope's elsewhere) adds nothing to any
  sample and is dropped.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common import padded
from padless.ops.common.engine import dense_to_rows
from padless.ops.rows.packed_rows import packed_rows
from padless.ops.common.structure import build_nested, keep_all, outer_dim, restructure, values_dim
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.convert import unbind_samples
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.registry import lend


def flatten_rows(nt: NestedTensor, target: Sequence[int], op: str) -> Tensor | None:
    """``values()`` regrouped as ``(-1, *tail)`` when ``target`` is ``(-1, *tail)`` and that
    flattens every real row (else None: the caller raises its own message)."""
    k = len(nt._ragged)
    if not target or target[0] != -1 or any(t < 0 for t in target[1:]):
        return None
    if nt._ragged != tuple(range(k)):
        return None  # rows are not in sample-dim order: a flattening would interleave dims
    static = nt._values.shape[1:]
    tail = math.prod(target[1:])
    if tail == 0 or math.prod(static) % tail:
        return None
    vals = values_of(nt)
    flat = vals.view(-1, *target[1:]) if op == "view" else vals.reshape(-1, *target[1:])
    if flat.shape[0] != vals.shape[0] or torch.compiler.is_compiling():
        return flat  # compiled: the plain dense rows (a subclass cannot be made inside a trace)
    return packed_rows(flat, nt)


@lend("unbind_static")
def unbind_static(nt: NestedTensor, dim: int) -> tuple:
    """``unbind(dim)``: the batch dim gives dense samples; a static dim a tuple of NestedTensors."""
    o = outer_dim(nt, dim, "unbind")
    if o == 0:
        return unbind_samples(nt)
    p = o - 1
    if p in nt._ragged:
        raise StructureError(
            f"unbind(): dim {dim} is ragged (samples have different extents along it); unbind the batch "
            "dim (dim=0) or a static dim, or take windows with x[:, a:b]"
        )
    dims = keep_all(nt)
    del dims[p]
    return tuple(restructure(nt, v, dims) for v in values_of(nt).unbind(values_dim(nt, p)))


def expand_dense_as(d: Tensor, nt: NestedTensor) -> NestedTensor:
    """``d.expand_as(nt)`` for a dense ``d``: every sample gets ``d`` broadcast to its own shape."""
    op = "expand_as"
    nd = nt.dim()
    if d.dim() > nd:
        raise StructureError(f"{op}(): a dense tensor of shape {tuple(d.shape)} has more dims than {tuple(nt.shape)}")
    aligned = (1,) * (nd - d.dim()) + tuple(d.shape)
    if d.dim() > padded.layout_trailing_static(nt) and padded.padded_extents(op, aligned, nt, d.shape):
        rows = padded.read_rows(op, d, nt, aligned)
    else:
        rows = dense_to_rows(op, d, nt)
        rows = rows.reshape((1,) * (1 + len(nt._values.shape[1:]) - rows.dim()) + tuple(rows.shape))
    static = nt._values.shape[1:]
    try:
        rows = rows.expand(nt._values.shape[0], *static)
    except RuntimeError:
        raise StructureError(
            f"{op}(): a dense tensor of shape {tuple(d.shape)} does not expand to {tuple(nt.shape)}"
        ) from None
    return rewrap(rows, nt)


def drop_empty_dense(tensors: Sequence[Any], dim: int) -> list[Any]:
    """``tensors`` without the empty dense ones that add nothing along ``dim`` (a KV cache that
    starts empty): shape ``(0,)`` (torch's legacy empty), or extent 0 at ``dim`` and the
    envelope's extents elsewhere (what dense ``torch.cat`` would accept)."""
    ref = next((t for t in tensors if isinstance(t, NestedTensor)), None)
    if ref is None:
        return list(tensors)
    o = outer_dim(ref, dim, "cat")

    def empty(t: Any) -> bool:
        if not isinstance(t, Tensor) or isinstance(t, NestedTensor) or t.numel():
            return False
        if t.dim() == 1:
            return True  # torch's legacy empty (0,), skipped by torch.cat too
        return t.dim() == ref.dim() and t.shape[o] == 0 and all(
            t.shape[j] == ref.shape[j] for j in range(t.dim()) if j != o
        )

    return [t for t in tensors if not empty(t)]


def dense_cat_operands(tensors: Sequence[Any], dim: int) -> list[Any]:
    """Dense inputs of ``torch.cat`` with NestedTensors, as NestedTensors where they have a
    per-sample meaning (module docstring); others are left for ``cat`` to refuse."""
    ref = next((t for t in tensors if isinstance(t, NestedTensor)), None)
    if ref is None or all(isinstance(t, NestedTensor) or not isinstance(t, Tensor) for t in tensors):
        return list(tensors)
    o = outer_dim(ref, dim, "cat")
    if o == 0:
        return list(tensors)
    p = o - 1
    out = []
    for t in tensors:
        if isinstance(t, Tensor) and not isinstance(t, NestedTensor) and t.dim() == ref.dim():
            if p not in ref._ragged:
                nt = padded.as_nested("cat", t, ref, whole=True)
                t = t if nt is None else nt
            elif ref._ragged == (p,) and ref._meta.host_sizes is not None:
                t = _block(t, ref, p)
        out.append(t)
    return out


def _block(t: Tensor, ref: NestedTensor, p: int) -> NestedTensor:
    """A dense ``(B, ..., k, ...)`` block as k rows of every sample along ragged dim ``p``."""
    b = ref.batch_size
    if t.shape[0] != b:
        raise StructureError(
            f"cat(): a dense input of shape {tuple(t.shape)} has {t.shape[0]} entries on the batch dim, "
            f"the NestedTensor has {b} samples (expand it: t.expand({b}, ...))"
        )
    static = [s for s in range(ref.sample_dim) if s != p]
    for s in static:
        if t.shape[1 + s] != ref._env[s]:
            raise StructureError(
                f"cat(): a dense input of shape {tuple(t.shape)} has extent {t.shape[1 + s]} along dim {s + 1}, "
                f"the NestedTensor {ref._env[s]} (shape {tuple(ref.shape)})"
            )
    k = t.shape[1 + p]
    values = t.permute(0, 1 + p, *[1 + s for s in static]).reshape(b * k, *[t.shape[1 + s] for s in static])
    hs = ref._meta.host_sizes.clone()
    hs[:, p] = k
    env = list(ref._env)
    env[p] = k
    return build_nested(values, ref, hs, hs, (p,), env, cache_key=("cat_block", p, k))
