"""Every sample of a batch repeated along the batch dim (``bias.repeat_interleave(N, dim=0)``, the
bias of every folded row: sample ``(b, i)`` of the repeat is sample ``(b, i)`` of a fold,
:mod:`padless.ops.rows.folds`), and a static dim of extent 1 expanded to sizes read from a shape
(a new ragged dim)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common import content
from padless.ops.common import repeats as repeat_record
from padless.ops.common.host import host_structure
from padless.ops.common.structure import call
from padless.ops.rows import folds_traced
from padless.ops.rows.folds import _regrouped, _to, _traced
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import NestedTensor, StructureMeta, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent, check_extent, for_batch


def repeat_batch(nt: NestedTensor, repeats: Any, op: str = "repeat_interleave") -> NestedTensor:
    """``x.repeat_interleave(r, dim=0)``: every sample repeated ``r`` times in place (sample
    ``b`` becomes samples ``b*r .. b*r+r-1``). ``r`` read from a shape (``z.shape[1]``) repeats
    sample ``b`` by sample ``b``'s own size; a 1-D tensor gives one count per sample. One copy
    (:func:`padless.ops.common.repeats.repeat_rows`); attention over a folded batch reads ``x``
    instead of the copy (:mod:`padless.ops.attention.runs`)."""
    b = nt.batch_size
    if _traced(nt):
        raise folds_traced.refuse(op, "repeating every sample along the batch dim")
    if isinstance(repeats, Extent):
        repeats = for_batch(repeats, nt)  # read from the batch nt was folded from: each folded sample its parent's
        if repeats.batch_size != b:
            raise StructureError(
                f"{op}(): repeats = {int(repeats)} was read from the shape of a batch of {repeats.batch_size} samples "
                f"and this batch has {b}; a size read from a shape repeats every sample by its own size. "
                f"Pass int(...) to repeat every sample {int(repeats)} times"
            )
        check_extent(repeats, nt, op, "repeats", rewrite=" (N = x.shape[1])")
        counts = repeats.per_sample()
    elif isinstance(repeats, Tensor):
        if repeats.dim() == 0:
            counts = [int(repeats)] * b
        elif repeats.dim() == 1 and repeats.numel() in (1, b):
            counts = repeats.tolist() * (b if repeats.numel() == 1 else 1)
        else:
            raise StructureError(f"{op}(): repeats must hold 1 or {b} counts along the batch dim, got shape {tuple(repeats.shape)}")
    else:
        counts = [int(repeats)] * b
    if any(c < 0 for c in counts):
        raise StructureError(f"{op}(): repeats must be non-negative, got {tuple(counts)}")
    hs, ho = host_structure(nt, op)
    c = torch.tensor(counts, dtype=torch.int64)
    s = int(c.sum())
    new_hs = hs.repeat_interleave(c, dim=0, output_size=s)
    rows = (ho[1:] - ho[:-1]).repeat_interleave(c, output_size=s)
    new_ho = layout.offsets_from_counts(rows)
    total = int(new_ho[-1])
    if b <= repeat_record.ROW_COPY_SAMPLES:  # one broadcast copy per sample
        vals = repeat_record.repeat_rows(values_of(nt), ho.tolist(), counts)
    else:
        src = ho[:-1].repeat_interleave(c, output_size=s).repeat_interleave(rows, output_size=total)
        idx = src + torch.arange(total) - new_ho[:-1].repeat_interleave(rows, output_size=total)
        vals = values_of(nt).index_select(0, _to(idx, nt))
    env = list(nt._env)
    for r in nt._ragged:
        env[r] = int(new_hs[:, r].max()) if s else 0
    out = nested_from_values(vals, _to(new_ho, nt), _to(new_hs, nt), nt._ragged, env, StructureMeta(new_hs, new_ho))
    repeat_record.mark(out, nt, tuple(counts))  # attention over a folded batch reads nt instead (ops.attention.runs)
    return _regrouped(out, nt._lineage, counts)  # sample (b, r) of bias.repeat_interleave(N) is sample (b, i) of a fold


def expand_extents(nt: NestedTensor, target: Sequence[Any], op: str = "expand") -> NestedTensor | None:
    """``expand`` whose target gives a static dim of extent 1 a size read from a shape of this
    batch (an :class:`Extent`): each sample is expanded to its own size, a new ragged dim (one
    row gather; stored where it keeps sample-dim order). None when no such entry."""
    if len(target) != nt.dim() or _is_traced(nt._values):
        return None
    new = [p for p, t in enumerate(target[1:]) if isinstance(t, Extent) and p not in nt._ragged
           and int(nt._env[p]) == 1 and t.batch_size == nt.batch_size]
    if not new:
        return None
    for p in new:
        check_extent(target[p + 1], nt, op, f"size[{p + 1}]")  # of this batch, not of another of as many samples
    hs, ho = host_structure(nt, op)
    hs = hs.clone()
    for p in new:
        hs[:, p] = torch.tensor(target[p + 1].per_sample(), dtype=torch.int64)
    order = list(nt._ragged)
    for p in new:  # a new ragged dim goes before the first stored dim that comes after it
        order.insert(next((j for j, r in enumerate(order) if r > p), len(order)), p)
    ragged = tuple(order)
    new_ho = layout.offsets_from_counts(layout.row_counts(hs, ragged))
    skey = content.structure_key(nt)
    key = ("expand_extents", ragged, skey, hs.numpy().tobytes())
    idx = content.get(key) if skey is not None else None
    if idx is None:  # every new row reads the row of its sample with the new dims' coordinates dropped
        idx = _to(layout.broadcast_rows(hs, new_ho, ragged, hs, ho, nt._ragged, int(new_ho[-1])), nt)
        if skey is not None:
            content.put(key, idx)
    old_static = layout.static_dims(nt.sample_dim, nt._ragged)
    vals = values_of(nt).index_select(0, idx).squeeze(tuple(1 + old_static.index(p) for p in new))
    env = list(nt._env)
    for p in new:
        env[p] = int(hs[:, p].max()) if hs.shape[0] else 0
    out = nested_from_values(vals, _to(new_ho, nt), _to(hs, nt), ragged, env, StructureMeta(hs, new_ho))
    rest = [-1] + [-1 if p in ragged else t for p, t in enumerate(target[1:])]
    if any(t != -1 and t != out._env[p - 1] for p, t in enumerate(rest) if p):
        return call(torch.Tensor.expand, out, rest)  # static dims expanded in the same call
    return out
