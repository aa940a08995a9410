"""Folds under ``torch.compile``: the same structures as :mod:`padless.ops.rows.folds`, built
from the device sizes and offsets with tensor arithmetic only (no host read).

The folded batch of a ragged fold has ``sum N_i`` samples (:func:`fold_count`). Where the
batch has dim 0 as its only ragged dim that is its row count; where it has one more ragged dim
(pairs ``(N_i, N_i, d)``), the size carrier ``drop_count_k`` that every batch with host sizes
brings into a compiled graph (:mod:`padless.ops.common.carried`) holds it: an input size, so
the fold needs no data-dependent op and compiles in one graph also without ``fullgraph=True``
(no graph break at the fold). Otherwise it is an unbacked size computed in the graph
(:func:`padless.tensor.traced.traced_sum`: a graph break without ``fullgraph=True`` or
``capture_dynamic_output_shape_ops``). Batches of any lengths run in one graph. The link to the parent holds the parent's extents along the folded dim as a tensor,
its envelope as a symbol and its sizes after that dim as a tensor (a parent sample of extent 0
gave no samples: the unfold gives it its own extents from there, as eagerly); an unfold finds it
on the folded batch's structure (ops that keep the rows carry it). Sizes read from a shape are plain symbols here (no
:class:`~padless.tensor.extents.Extent`), so the unfold of a batch whose link was lost (the
pair product of ``softmax(q @ k^T) @ v``) and the per-row repeats of a bias are refused
(:func:`refuse`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from padless.ops.common.carried import DROP_COUNT
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import NestedTensor, StructureMeta
from padless.tensor.traced import traced_sum

__all__ = ["fold_count", "fold_ragged", "fold_static", "unfold", "same", "refuse"]


def same(a: Any, b: Any) -> bool:
    """``a == b`` for sizes, without a guard on a symbol (False unless known)."""
    if type(a) is int and type(b) is int:
        return a == b
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return int(a) == int(b)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def fold_count(nt: NestedTensor) -> Any:
    """``sum N_i`` (sample dim 0, ragged) as a size: the rows of a batch ragged along dim 0 only,
    the carried ``drop_count`` of the other ragged dim of a batch with two, else (no carrier, or
    three ragged dims) an unbacked size computed in the graph."""
    ragged = nt._ragged
    if ragged == (0,):
        return nt._values.shape[0]
    if len(ragged) == 2 and 0 in ragged:
        k = 1 - ragged.index(0)  # drop the other ragged dim: the rows left are sum N_i
        carrier = nt._meta.derived.get((DROP_COUNT[k], nt._values.device))
        if carrier is not None:
            return carrier.shape[0]
    return traced_sum(nt._sizes[:, 0])


def fold_ragged(nt: NestedTensor, link_type: type, key: tuple, s: Any = None) -> NestedTensor:
    """Sample dim 0 (ragged, stored first) folded into the batch; the rows stay. ``s``: its
    :func:`fold_count`, when read before ``nt`` was relaid out (the carrier is the source's)."""
    sizes, offsets = nt._sizes, nt._offsets
    n = sizes[:, 0]
    s = fold_count(nt) if s is None else s
    rows = offsets[1:] - offsets[:-1]
    per = torch.where(n > 0, torch.div(rows, n.clamp_min(1), rounding_mode="floor"), torch.zeros_like(rows))
    new_sizes = sizes[:, 1:].repeat_interleave(n, dim=0, output_size=s)
    first = (n.cumsum(0) - n).repeat_interleave(n, output_size=s)
    local = torch.arange(s, device=n.device) - first
    starts = offsets[:-1].repeat_interleave(n, output_size=s) + local * per.repeat_interleave(n, output_size=s)
    new_offsets = torch.cat([starts, offsets[-1:]])
    meta = StructureMeta()
    # the parent's sizes after the folded dim: an empty parent sample's own extents at the unfold
    meta.derived[key] = link_type("ragged", n, nt._env[0], (sizes[:, 1:], tuple(r - 1 for r in nt._ragged if r > 0)))
    ragged = tuple(r - 1 for r in nt._ragged[1:])
    return nested_from_values(values_of(nt), new_offsets, new_sizes, ragged, nt._env[1:], meta)


def fold_static(nt: NestedTensor, link_type: type, key: tuple) -> NestedTensor:
    """Sample dim 0 (static, extent ``h``) folded into the batch: one gather."""
    sizes, offsets = nt._sizes, nt._offsets
    h = nt._env[0]
    b = sizes.shape[0]
    vals = values_of(nt)
    rows = offsets[1:] - offsets[:-1]
    counts = rows.repeat_interleave(h)
    new_offsets = layout.offsets_from_counts(counts)
    total = vals.shape[0] * h
    sample = torch.arange(b * h, device=rows.device).repeat_interleave(counts, output_size=total)
    within = torch.arange(total, device=rows.device) - new_offsets[:-1].index_select(0, sample)
    row_idx = offsets[:-1].index_select(0, torch.div(sample, h, rounding_mode="floor")) + within
    head_idx = torch.remainder(sample, h)
    meta = StructureMeta()
    meta.derived[key] = link_type("static", torch.full_like(rows, h), h)
    new_sizes = sizes[:, 1:].repeat_interleave(h, dim=0)
    return nested_from_values(vals[row_idx, head_idx], new_offsets, new_sizes, tuple(r - 1 for r in nt._ragged), nt._env[1:], meta)


def unfold(nt: NestedTensor, link: Any, op: str = "unfold") -> NestedTensor:
    """The inverse of the fold ``link`` records (its counts a device tensor). A parent sample
    that gave no samples (``N_b = 0``) gets its own extents back from the link's
    :attr:`~padless.ops.rows.folds.FoldLink.rest`, as eagerly."""
    c = link.counts
    sizes, offsets = nt._sizes, nt._offsets
    s = sizes.shape[0]
    if link.kind == "static":
        return _unfold_static(nt, link.extent, c.shape[0])
    starts = c.cumsum(0) - c
    static = dict(zip(layout.static_dims(nt.sample_dim, nt._ragged), nt._values.shape[1:]))
    empty = [static.get(j, 0) for j in range(nt.sample_dim)]  # an empty group: ragged extents 0, static kept
    row = sizes.new_tensor(empty) if all(type(e) is int for e in empty) else sizes.new_zeros(nt.sample_dim)
    padded = torch.cat([sizes, row[None]])
    lead = padded.index_select(0, torch.where(c > 0, starts, torch.full_like(starts, s)))
    if link.rest:
        lead = _empty_parents(nt, lead, c, link.rest, op)
    new_sizes = torch.cat([c[:, None], lead], 1)
    new_offsets = torch.cat([offsets.index_select(0, starts), offsets[-1:]])
    ragged = (0, *[r + 1 for r in nt._ragged])
    return nested_from_values(values_of(nt), new_offsets, new_sizes, ragged, [link.extent, *nt._env], StructureMeta())


def _empty_parents(nt: NestedTensor, lead: Tensor, c: Tensor, rest: tuple, op: str) -> Tensor:
    """``lead`` (per parent sample, the unfolded sizes after the new leading dim) with the ragged
    extents of the parent samples of count 0 taken from the fold (``rest``: the parent's sizes
    after the folded dim and its ragged dims there). Where the folded samples' ragged extents
    changed since the fold, an empty parent sample's are not known: refused by a device-side
    assert (no host read), as eagerly (:meth:`~padless.ops.rows.folds.FoldLink.empty_sizes`)."""
    parent, ragged = rest
    empty = c == 0
    refused = (
        f"{op}(): under torch.compile, a parent sample gave no samples to the fold (a count of 0) and the folded "
        "samples' ragged extents changed since, so its own extents are not known; unfold before the op that "
        "changes them, or run this step eagerly"
    )
    if tuple(nt._ragged) != ragged or parent.shape[1] != lead.shape[1]:
        torch._assert_async(~empty.any(), refused)
        return lead
    cols = torch.tensor([j in ragged for j in range(lead.shape[1])], device=lead.device)
    changed = ((lead != parent) & cols).any(1) & ~empty
    torch._assert_async(~(empty.any() & changed.any()), refused)
    return torch.where(empty[:, None] & cols, parent, lead)


def _unfold_static(nt: NestedTensor, h: Any, b: Any) -> NestedTensor:
    sizes, offsets = nt._sizes, nt._offsets
    vals = values_of(nt)
    rows = (offsets[1:] - offsets[:-1]).view(b, h)[:, 0]
    new_offsets = layout.offsets_from_counts(rows)
    total = torch.div(vals.shape[0], h, rounding_mode="floor") if not isinstance(h, int) else vals.shape[0] // h
    sample = layout.row_sample_ids(new_offsets, total)
    within = torch.arange(total, device=rows.device) - new_offsets[:-1].index_select(0, sample)
    idx = (offsets[:-1].view(b, h).index_select(0, sample) + within[:, None]).reshape(-1)
    out = vals.index_select(0, idx).view(total, h, *vals.shape[1:])
    new_sizes = torch.cat([torch.full_like(rows, h)[:, None], sizes.view(b, h, -1)[:, 0]], 1)
    ragged = tuple(r + 1 for r in nt._ragged)
    return nested_from_values(out, new_offsets, new_sizes, ragged, [h, *nt._env], StructureMeta())


def refuse(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{op}(): {what} under torch.compile: sizes read from a shape are plain symbols there, with no "
        "per-sample meaning. Fold with a reshape inside the compiled region and unfold the batch it gave "
        "(ops that keep the rows carry the fold's link; a pair product such as q @ k.transpose(-1, -2) does "
        "not: use F.scaled_dot_product_attention), or run this step eagerly"
    )
