"""More ``torch.nested`` (NJT) calls that padless tensors answer the way NJT does.

* ``torch.masked_select(nt, mask)`` with a NestedTensor ``mask`` of ``nt``'s structure:
  a NestedTensor of 1-d samples, sample ``i`` holding the selected elements of sample ``i``
  in its row-major order (NJT's result; NJT only takes ``(B, j)`` inputs, padless takes any);
* ``nt.apply_(fn)``: ``fn`` on every element, in place (CPU only, as for dense tensors);
* ``aten._unsafe_view`` (what autograd formulas and decompositions emit for ``view``): the
  ``reshape`` rule, the batch dim and ragged dims kept;
* ``index_put`` / ``index_put_`` with integer index tensors ``(batch, *before, ragged, *rest)``
  on a NestedTensor with one ragged dim, at any place (a transposed tensor too, as NJT):
  element ``(b, ..., j, ...)`` of sample ``b``; and ``nt[mask] = v`` with a bool NestedTensor ``mask`` of
  ``nt``'s structure (NJT refuses it), ``v`` a scalar or one value per selected element in
  sample order, as for a dense tensor.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.ops.common.host import match_target
from padless.ops.common.structure import STATIC, keep_all, restructure
from padless.tensor.autograd import values_of
from padless.tensor.convert import unbind_samples
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.registry import implements, implements_aten

aten = torch.ops.aten


def _natural(nt: NestedTensor) -> bool:
    """Whether ``values`` enumerate each sample's elements in the sample's row-major order."""
    return tuple(nt.storage_order) == tuple(range(nt.sample_dim))


def _check_mask(nt: NestedTensor, mask: Any, what: str = "masked_select(nt, mask)") -> None:
    if not isinstance(mask, NestedTensor):
        raise TypeError(
            f"{what}: mask must be a NestedTensor with the structure of input, got {type(mask).__name__}; "
            "build it from the input (e.g. mask = nt > 0) as for torch.nested"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"{what}: mask must be a bool NestedTensor, got dtype {mask.dtype}")
    if mask.batch_size != nt.batch_size or mask.sample_dim != nt.sample_dim:
        raise StructureError(
            f"{what}: mask has {mask.batch_size} samples of rank {mask.sample_dim}, input has "
            f"{nt.batch_size} samples of rank {nt.sample_dim}; give a mask of input's structure"
        )
    hs, ms = nt.host_sizes(), mask.host_sizes()
    if not torch.equal(hs, ms):
        i = int((hs != ms).any(1).nonzero()[0])
        raise StructureError(
            f"{what}: mask sample {i} has shape {tuple(ms[i].tolist())}, input sample {i} has "
            f"{tuple(hs[i].tolist())}; give a mask of input's structure (e.g. mask = nt > 0)"
        )


@implements(torch.masked_select, torch.Tensor.masked_select)
def masked_select(func, nt: Any, mask: Any) -> NestedTensor:
    """Selected elements of every sample as a 1-d sample (differentiable w.r.t. ``nt``)."""
    from padless.tensor.construct import from_list, from_values

    if not isinstance(nt, NestedTensor):
        raise TypeError("masked_select(input, mask): a NestedTensor mask needs a NestedTensor input of the same structure")
    _check_mask(nt, mask)
    if not (_natural(nt) and _natural(mask) and nt.storage_order == mask.storage_order):
        # Elements of a sample are not stored in its row-major order: select sample by sample.
        picked = [torch.masked_select(x, m) for x, m in zip(unbind_samples(nt), unbind_samples(mask, differentiable=False))]
        return from_list(picked, ragged_dims=(0,), keep_history=True, sample_shape=(None,))
    vals, m = values_of(nt), mask._values
    rows = m.reshape(m.shape[0], math.prod(m.shape[1:])).sum(1)
    cum = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    offsets = cum[nt.host_offsets().to(cum.device)]
    return from_values(vals[m], offsets)


@implements(torch.Tensor.apply_)
def apply_(func, nt: NestedTensor, fn: Callable[[Any], Any]) -> NestedTensor:
    """``fn`` on every real element of ``nt``, in place; returns ``nt`` (CPU only)."""
    if nt.device.type != "cpu":
        raise TypeError(f"apply_(): only CPU tensors are supported (as for dense tensors); this NestedTensor is on {nt.device}")
    nt._values.apply_(fn)
    return nt


@implements(aten._unsafe_view, aten._unsafe_view.default)
def _unsafe_view(func, nt: NestedTensor, size: Sequence[int]) -> NestedTensor:
    """``torch.ops.aten._unsafe_view``: the ``reshape`` rule (batch and ragged dims kept) on
    ``values``, differentiable (a call above autograd)."""
    dims = match_target(nt, [int(s) for s in size], "_unsafe_view")
    static = [n for kind, n in dims if kind == STATIC]
    vals = values_of(nt)
    return restructure(nt, vals.reshape(vals.shape[0], *static), dims)


@implements_aten(aten._unsafe_view.default)
def _unsafe_view_aten(func, nt: NestedTensor, size: Sequence[int]) -> NestedTensor:
    """``aten._unsafe_view`` below autograd (decompositions): as :func:`_unsafe_view`."""
    dims = match_target(nt, [int(s) for s in size], "_unsafe_view")
    static = [n for kind, n in dims if kind == STATIC]
    return restructure(nt, nt._values.reshape(nt._values.shape[0], *static), dims)


def _sample_view(nt: NestedTensor, vals: Tensor) -> Tensor:
    """``vals`` (``nt``'s packed buffer, or one like it) with its dims in sample order: the
    row dim stands at the ragged dim's place (a view; for one ragged dim)."""
    order = list(nt.storage_order)
    perm = [order.index(d) for d in range(nt.sample_dim)]
    return vals if perm == sorted(perm) else vals.permute(perm)


def _index_rows(nt: NestedTensor, indices: Sequence[Any], op: str) -> list[Tensor]:
    """Index list into :func:`_sample_view` of ``values`` for NJT-style indices
    ``(batch, *before, ragged, *rest)``: the batch and ragged indices combine into packed rows,
    the other indices keep their place (NJT's rule, also for a transposed tensor whose ragged
    dim is not sample dim 0)."""
    if len(nt._ragged) != 1:
        raise NotImplementedError(
            f"{op}(): index_put with index tensors on a NestedTensor needs exactly one ragged dim "
            f"(got ragged sample dims {nt.ragged_dims}); index x.values() (packed rows) instead"
        )
    r = nt._ragged[0] + 1  # the ragged dim's place in the index list (batch first)
    if len(indices) <= r or any(not isinstance(t, Tensor) or isinstance(t, NestedTensor) for t in (indices[0], indices[r])):
        raise NotImplementedError(
            f"{op}(): indices must hold dense integer tensors for the batch dim (index 0) and the ragged dim "
            f"(index {r}) (got {len(indices)} index tensors); to write every element of some samples, "
            "index with the batch dim only or index x.values() instead"
        )
    if len(indices) > nt.dim():
        raise IndexError(f"{op}(): too many indices ({len(indices)}) for a NestedTensor of {nt.dim()} dims")
    for k, t in enumerate(indices):
        if t is not None and (t.dtype == torch.bool or t.is_floating_point()):
            raise TypeError(f"{op}(): index {k} must be an integer tensor, got dtype {t.dtype}")
    b, j = indices[0], indices[r]
    offsets = nt.offsets()
    starts, lengths = offsets[:-1], offsets.diff()
    bsz = nt.batch_size
    torch._assert_async(
        torch.all((b >= -bsz) & (b < bsz)), f"{op}(): a batch index (index 0) is out of range for {bsz} samples"
    )
    b = b.to(starts.device) % max(bsz, 1)
    n = lengths[b]
    torch._assert_async(
        torch.all((j >= -n) & (j < n)),
        f"{op}(): a ragged index (index {r}) is out of range for its sample's length",
    )
    rows = starts[b] + torch.where(j < 0, j + n, j)
    return [*indices[1:r], rows, *indices[r + 1 :]]


def _mask_index(nt: NestedTensor, mask: NestedTensor, op: str) -> Tensor:
    """``mask``'s packed buffer, aligned with ``nt``'s (``nt[mask] = v``)."""
    _check_mask(nt, mask, f"{op}(nt, (mask,), v)")
    if not (_natural(nt) and nt.storage_order == mask.storage_order):
        raise NotImplementedError(
            f"{op}(): a NestedTensor mask needs input and mask stored in their samples' row-major order "
            "(not transposed); call .contiguous() on both first"
        )
    return mask._values


@implements_aten(aten.index_put.default, aten.index_put_.default)
def index_put(func, nt: NestedTensor, indices: Sequence[Any], values: Tensor, accumulate: bool = False) -> NestedTensor:
    """Write ``values`` at elements ``(batch[k], ragged[k], ...)`` (in place for ``index_put_``)."""
    inplace = func is aten.index_put_.default
    op = "index_put_" if inplace else "index_put"
    if not isinstance(nt, NestedTensor) or isinstance(values, NestedTensor):
        raise NotImplementedError(f"{op}(): supported for a NestedTensor input with dense values only")
    if len(indices) == 1 and isinstance(indices[0], NestedTensor):
        idx = [_mask_index(nt, indices[0], op)]
        if inplace:
            nt._values.index_put_(idx, values, accumulate)
            return nt
        return restructure(nt, nt._values.index_put(idx, values, accumulate), keep_all(nt))
    idx = _index_rows(nt, list(indices), op)
    out = nt._values if inplace else nt._values.clone()
    _sample_view(nt, out).index_put_(idx, values, accumulate)  # a view: writes into ``out``
    return nt if inplace else restructure(nt, out, keep_all(nt))


@implements_aten(aten.index.Tensor)
def index(func, nt: NestedTensor, indices: Sequence[Any]) -> Tensor:
    """``nt[batch, ragged, *rest]`` with integer index tensors (index_put's backward): the dense
    elements ``(batch[k], ragged[k], ...)``."""
    return _sample_view(nt, nt._values)[tuple(_index_rows(nt, list(indices), "index"))]
