"""Elementwise ops that need a gradient, run on the packed buffers with plain autograd.

Without a gradient, ``NestedTensor.__torch_function__`` runs an elementwise callable
straight on ``values`` (:data:`padless.tensor.registry.FAST_POINTWISE`). With one, the call
used to go down to ATen on the NestedTensor itself, so autograd recorded it there and its
backward formula dispatched again on NestedTensor gradients (two to four ``__torch_dispatch__``
round trips per op). When every NestedTensor operand has one structure and every dense
operand broadcasts over the static tail only, the op is exactly the same op on the packed
rows: here it runs on ``values`` through the differentiable bridges
(:func:`padless.tensor.core.values_of` in, :func:`padless.tensor.autograd.rewrap` out), and
autograd records plain tensor ops. A dense operand that reaches a ragged dim (a rotary
``cos``/``sin`` table, a position embedding built from the envelope) is first read onto the
rows by the op layer's padded-coordinate rule (lent as ``padded_rows``: one cached gather,
``(T, *its static extents)``), so ``q * cos + rotate_half(q) * sin`` on ``(H, L_i, D)``
queries is plain autograd on the rows too. Anything else (structures that broadcast against
each other, in-place calls) returns ``None`` and takes the general path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from padless.tensor.autograd import rewrap
from padless.tensor.core import NestedTensor, values_of
from padless.tensor.registry import lend, lent
from padless.tensor.structure import sizes_signature

_WHERE = {torch.where, torch.Tensor.where}
_padded_rows = None  # padless.ops.common.padded.padded_rows, borrowed on first use


def _same(a: NestedTensor, ref: NestedTensor) -> bool:
    """One set of rows: the same structure, or the same ragged extents with static extents
    that broadcast on ``values`` as on the samples (``x * x.pow(2).mean(-1, keepdim=True)``)."""
    if a._meta is ref._meta or (a._sizes is ref._sizes and a._offsets is ref._offsets and a._ragged == ref._ragged):
        return True
    if a._offsets is not ref._offsets or a._ragged != ref._ragged or len(a._env) != len(ref._env):
        return False
    if a._meta.host_sizes is None or ref._meta.host_sizes is None or any(a._env[r] != ref._env[r] for r in ref._ragged):
        return False
    return sizes_signature(a._meta, ref._ragged) == sizes_signature(ref._meta, ref._ragged)


@lend("pointwise_with_grad")
def pointwise_with_grad(func: Any, args: tuple, kwargs: dict) -> NestedTensor | None:
    """``func`` on the packed rows with autograd, or ``None`` when not eligible (module docstring)."""
    if "out" in kwargs or kwargs.get("inplace") or any(a is True for a in args[1:]):
        return None
    if func in _WHERE and len(args) + len(kwargs) < 3:
        return None
    ref = None
    n_dense_max = -1
    for a in (*args, *kwargs.values()):
        if isinstance(a, NestedTensor):
            if ref is None:
                ref = a
            elif not _same(a, ref):
                return None
        elif isinstance(a, Tensor):
            n_dense_max = max(n_dense_max, a.dim())
        elif isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) for b in a):
            return None
    if ref is None or not ref._ragged:
        return None
    # values are (T, *static dims in sample order): a dense operand broadcasts on them as on
    # the samples when it reaches no further than the static dims after the last ragged one
    tail = len(ref._env) - 1 - max(ref._ragged)
    reads: dict[int, Tensor] = {}
    if n_dense_max > tail:  # it reaches a ragged dim: read it onto the rows (padded coordinates)
        global _padded_rows
        read = _padded_rows or lent("padded_rows")
        _padded_rows = read
        name = getattr(func, "__name__", "op").strip("_")
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor) and not isinstance(a, NestedTensor) and a.dim() > tail and id(a) not in reads:
                rows = read(name, a, ref)
                if rows is None:
                    return None  # not a padded-coordinate operand: the general path decides
                reads[id(a)] = rows

    def conv(a):
        if isinstance(a, NestedTensor):
            return values_of(a)
        return reads.get(id(a), a) if reads and isinstance(a, Tensor) else a

    new_args = [conv(a) for a in args]
    new_kwargs = {k: conv(a) for k, a in kwargs.items()}
    out = func(*new_args, **new_kwargs)
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != ref._values.shape[0]:
        raise RuntimeError(f"padless internal: elementwise {func} changed the row count")
    return rewrap(out, ref)
