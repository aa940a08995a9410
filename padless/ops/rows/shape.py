"""Shape ops that keep every sample's rows: reshape/view, flatten/unflatten, expand,
pad, split/chunk/tensor_split (``narrow``, ``cat``, ``stack`` and ``gather``, which
build new rows, are in :mod:`padless.ops.rows.shape_rows`).

Every op here follows one rule per kind of dim (dims are *outer* dims, 0 = batch):

* **static dims** are the trailing dims of ``values``, so an op on them is the same
  dense op on ``values`` (a view when torch makes one) and the rows are untouched;
* **ragged dims** have a different extent in every sample. Ops that keep each sample's
  rows (``flatten`` of ragged dims adjacent in storage) only change metadata; ops
  that change which rows a sample holds (``cat``/``narrow``/``gather`` along a ragged
  dim) gather rows through an index computed once on the host metadata;
* **the batch dim** stays dim 0: ``cat`` along it joins batches, ``split``/``chunk``/
  ``tensor_split``/``narrow`` along it take sub-batches (views of ``values``).

Where an op has no per-sample meaning (reshaping across a ragged dim, padding a
ragged dim) it raises, naming the op, the dim and the ragged dims. Nothing pads.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.structure import RAGGED, STATIC, keep_all, outer_dim, restructure, sample_dim, values_dim
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.behaviour import contiguous as canonical_layout
from padless.tensor.convert import select_samples
from padless.tensor.core import (
    NestedTensor,
    StructureMeta,
    _fmt_shape,
    _is_traced,
)
from padless.ops.common.host import check_envelope_reading, from_host_structure, host_structure, int_entries, match_target, ragged_error, shape_arg, static_changed
from padless.ops.rows import batch_repeats, folds
from padless.ops.rows.shape_idioms import expand_dense_as, flatten_rows
from padless.ops.rows.shape_ragged import reshape_by_extents, reshape_ragged, split_ragged
from padless.tensor.extents import Extent, applies_to, for_batch, sample_columns
from padless.tensor.lineage import Fold
from padless.tensor.views import as_view, put_view, writes_matter
from padless.ops.rows.windows import take_windows
from padless.tensor.registry import implements, lend
from padless.tensor.errors import StructureError
from padless.tensor.traced import traced_max

@implements(torch.reshape, torch.Tensor.reshape, torch.Tensor.view, accepts="packed")
def reshape(func, nt: NestedTensor, *shape, **kw) -> NestedTensor:
    """Reshape static dims of every sample; the batch dim and ragged dims stay.

    The rule: the target lists the batch dim (``B`` or ``-1``) and every ragged dim
    (``-1`` or its envelope extent ``x.shape[d]``) in their order; the static dims
    between two ragged dims (a *run*) may take any shape with the same number of
    elements, with one ``-1`` inferred per run. ``(C, L_i)`` with ``C = 6`` reshapes to
    ``(2, 3, L_i)`` by ``x.reshape(B, 2, 3, -1)``; ``(L_i, H, D)`` to ``(L_i, H*D)`` by
    ``x.reshape(B, -1, H * D)``. ``view`` does the same on ``values`` with ``view``
    (no copy), and ``x.view(dtype)`` reinterprets the last (static) dim.

    Sizes read from this batch's shape (``h, w = x.shape[-2:]``) are each sample's own:
    a target holding them gives every sample its own shape, as the dense op on that sample
    alone (:func:`padless.ops.rows.shape_ragged.reshape_by_extents`).
    """
    op = "view" if func is torch.Tensor.view else "reshape"
    if kw:  # t.reshape(shape=...), torch.reshape(t, shape=...), t.view(size=...)
        shape = (*shape, *[kw.pop(k) for k in ("shape", "size") if k in kw])
        if kw:
            raise TypeError(f"{op}() got an unexpected keyword argument {next(iter(kw))!r}")
    if op == "view" and len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return _view_dtype(nt, shape[0])
    kept = _keep_leading(nt, shape_arg(shape), op)
    if kept is not None:
        return kept
    return _reshape(nt, shape, op)


def _keep_leading(nt: NestedTensor, raw: list, op: str) -> NestedTensor | None:
    """The reshape every attention layer writes, answered from host metadata alone, or None.

    ``q.view(*x.shape[:-1], -1, d)`` (split heads), ``o.reshape(B, -1, L, d)``,
    ``o.reshape(*x.shape[:-1], -1)`` (merge heads): the batch as the plain int ``B``, every
    ragged dim (and the static dims before the last one) kept, each ragged dim by a size read
    from this batch's shape whose per-sample sizes are this batch's, and the static dims after
    the last ragged dim regrouped by plain ints. Every sample keeps its rows; this is the
    answer :func:`_reshape`'s rules give such a target (a folded batch, a ``-1`` or a plain int
    at a ragged dim, a size of another batch go there), without walking them."""
    if torch.compiler.is_compiling() or nt._meta.host_sizes is None or _is_traced(nt._values):
        return None  # (sizes on the device only, or symbols: the rules below decide, and say what they read)
    b = nt.batch_size
    if not nt._ragged or len(raw) < 2 or type(raw[0]) is not int or raw[0] != b or type(nt._lineage) is Fold:
        return None
    last = max(nt._ragged)
    if len(raw) < last + 2:
        return None
    vshape = nt._values.shape
    k = sum(1 for d in range(last) if d not in nt._ragged)
    static_lead = list(vshape[1:1 + k])  # static dims before the last ragged one (stored first among the static)
    tail_numel = math.prod(vshape[1 + len(static_lead):])
    holes = [e for e in raw[1:] if type(e) is int and e == -1]
    if len(holes) > 1 or (holes and tail_numel == 0):
        return None
    cols = None
    dims: list = []
    static_it = iter(static_lead)
    hole = None
    for d, e in enumerate(raw[1:last + 2]):
        if d in nt._ragged:
            if type(e) is not Extent or not applies_to(e, nt):
                return None
            cols = cols if cols is not None else sample_columns(nt)
            if e._values() != cols[d]:
                return None
            dims.append((RAGGED, d))
        else:
            n = next(static_it)
            if type(e) is not int or (e != n and e != -1) or (e == -1 and n == 0):
                return None
            if e == -1:
                hole = len(dims)
            dims.append((STATIC, n))
    tail = raw[last + 2:]
    if any(type(e) is not int or e < -1 for e in tail):
        return None
    known = math.prod(e for e in tail if e != -1)
    if hole is not None:  # the -1 sits at a kept static dim: the tail must fill the rest exactly
        if known != tail_numel:
            return None
    elif -1 in tail:
        if known == 0 or tail_numel % known:
            return None
        tail = [tail_numel // known if e == -1 else e for e in tail]
    elif known != tail_numel:
        return None
    return _reshape_static(nt, dims + [(STATIC, n) for n in tail], op)


def _reshape(nt: NestedTensor, shape: tuple, op: str, trusted: bool = False) -> NestedTensor:
    """``reshape``/``view``; ``trusted``: the target's sizes come from a batch whose ragged sizes
    were checked to be ``nt``'s (``reshape_as``)."""
    raw = list(shape_arg(shape))  # before int_entries: size entries that remember each sample's size
    if folds.folds_own_dim(nt, raw):  # z.reshape(B * N, M, d), N = z.shape[1]: the fold, nothing else
        return folds.fold_reshape(nt, raw, op)
    entry = folds.folded_batch_entry(nt, raw, op)  # q.view(B * N, ...) of a batch folded from B samples
    if entry is not raw:
        # B * N == B where the folded dim's envelope is 1: (B, N, ...) unfolds first (the parent's
        # empty samples come back), the folded batch entry where that does not fit
        try:
            unfolded = folds.unfold_reshape(nt, raw, op)
        except StructureError:
            unfolded = None
        if unfolded is not None:
            return unfolded
    raw = entry
    unfolded = folds.unfold_reshape(nt, raw, op)  # (b i) j d -> b i j d (padless.ops.rows.folds)
    if unfolded is not None:
        return unfolded
    # sizes read from the batch this one was folded from: each folded sample its parent's (q.view(B * N, N, H, d))
    raw = raw[:1] + [for_batch(e, nt) for e in raw[1:]]
    target = int_entries(op, "shape", raw)
    if any(type(e) is Extent for e in raw):  # sizes read from a shape stay: each sample's own
        target = [e if type(e) is Extent else t for e, t in zip(raw, target)]
    if any(type(e) is Extent for e in target):
        try:
            out = reshape_by_extents(nt, target, op, lambda dims: _reshape_static(nt, dims, op), trusted)
        except StructureError:
            # (-1, N, d) of (N_i, N_i, d) samples: no sample holds N_i * d elements, so the -1 is not
            # the batch but the fold (z.reshape(-1, N, d), as the dense code reads it)
            folded = folds.fold_reshape(nt, raw, op) if target[0] == -1 else None
            if folded is None:
                raise
            return folded
        if out is not None:
            return out
    try:
        dims = match_target(nt, target, op)
    except StructureError:
        if target[0] == -1 and len(target) > 1 and math.prod(target[1:]) == math.prod(nt._values.shape[1:]):
            # (-1, C) of pairs: every row (as the padded code means it), also where a fold of an
            # envelope of 1 ((N_i, 1, C) samples, or none with rows) would fit the target too
            flat = flatten_rows(nt, target, op)
            if flat is not None:
                return flat
        folded = folds.fold_reshape(nt, raw, op)  # b i j d -> (b i) j d, b h l d -> (b h) l d
        if folded is not None:
            return folded
        merged_or_split = reshape_ragged(nt, target, op)  # (B, -1, C) of (H_i, W_i, C); (B, -1, h, w) of (C, h_i*w_i)
        if merged_or_split is not None:
            return merged_or_split
        flat = flatten_rows(nt, target, op)  # (-1, C): every real row, dense (it leaves the batch)
        if flat is None and nt._ragged != tuple(sorted(nt._ragged)) and target and target[0] == -1:
            # ragged dims stored in another order (after a transpose): each sample's reshape
            # copies its elements in sample-dim order, as the batch's contiguous() stores them
            canonical = canonical_layout(torch.Tensor.contiguous, nt)
            canonical._lineage = nt._lineage  # the same samples (the handler is called without inherit)
            if op == "reshape" or nt._values.shape[0] == 0:  # no element: a view copies nothing
                flat = flatten_rows(canonical, target, op)
            elif flatten_rows(canonical, target, "reshape") is not None:
                raise StructureError(
                    f"view(): this batch stores its ragged dims in another order than its shape lists them (storage "
                    f"order {nt._ragged}, after a transpose), so the rows of view{tuple(int(t) for t in target)} are "
                    "not adjacent in its memory, and view() never copies. Use reshape (each sample's rows in order, "
                    "copied), or .contiguous() first"
                ) from None
        if flat is None:
            raise
        return flat
    if target[0] == -1 and any(k == RAGGED and type(e) is int and e != -1 for (k, _), e in zip(dims, target[1:])):
        # (-1, 1) of (L_i,) samples whose envelope is 1: a plain 1 fits the ragged dim by coincidence;
        # read as at any other envelope, every real row (as the dense (B*L, 1))
        flat = flatten_rows(nt, target, op)
        if flat is not None:
            return flat
    _refuse_plain_ambiguity(nt, target, dims, op)
    check_envelope_reading(nt, target, dims, op)
    return _reshape_static(nt, dims, op)


def _refuse_plain_ambiguity(nt: NestedTensor, target: list, dims: list, op: str) -> None:
    """Refuse a target that keeps a ragged dim by a plain int equal to its envelope while a
    ``-1`` sits at a static dim: ``x.reshape(B, 2, -1)`` of ``(L_i, 2)`` samples whose envelope
    is ``(2, 2)``. Read on the padded envelope, the 2 keeps ``L_i`` (the identity); read on
    each sample alone, the 2 is a fixed size and the ``-1`` absorbs ``L_i`` (``(2, L_i)``).
    Sizes read from the shape (:class:`~padless.tensor.extents.Extent`) say which one."""
    pairs = list(zip(dims, target[1:]))
    kept = [(j, p, e) for j, ((kind, p), e) in enumerate(pairs) if kind == RAGGED and type(e) is int and e != -1]
    inferred = [j for j, ((kind, _), e) in enumerate(pairs) if kind == STATIC and type(e) is int and e == -1]
    if not kept or not inferred:
        return
    j, p, e = kept[0]
    keep = list(target)
    keep[j + 1] = f"x.shape[{p + 1}]"
    alone = list(target)
    alone[inferred[0] + 1] = f"x.shape[{p + 1}]"
    raise StructureError(
        f"{op}(): target {tuple(target)} is ambiguous for a NestedTensor of envelope {tuple(nt.shape)} (ragged "
        f"outer dims {tuple(r + 1 for r in nt.ragged_dims)}): read on the padded envelope, {e} at dim {j + 1} keeps "
        f"ragged dim {p + 1} (every sample its own size) and -1 is static; read on each sample alone, {e} is a "
        f"fixed size and -1 absorbs the ragged dim. Read the size from the shape, which resolves per sample: "
        f"{op}({', '.join(map(str, keep))}) keeps the ragged dim, {op}({', '.join(map(str, alone))}) is each "
        "sample's own reshape"
    )


def _reshape_static(nt: NestedTensor, dims: list, op: str) -> NestedTensor:
    """The rows unchanged, the static dims regrouped (``dims`` from :func:`match_target`)."""
    vals = values_of(nt)
    new_static = [n for kind, n in dims if kind == STATIC]
    vals = vals.view(vals.shape[0], *new_static) if op == "view" else vals.reshape(vals.shape[0], *new_static)
    return restructure(nt, vals, dims)


def _view_dtype(nt: NestedTensor, dtype: torch.dtype) -> NestedTensor:
    if nt.sample_dim == 0 or nt.sample_dim - 1 in nt._ragged:
        raise StructureError(
            f"view(): viewing as {dtype} rescales the last dim, which must be static "
            f"(ragged outer dims: {tuple(r + 1 for r in nt.ragged_dims)})"
        )
    vals = values_of(nt).view(dtype)
    return restructure(nt, vals, static_changed(nt, nt.sample_dim - 1, vals.shape[-1]))


@implements(torch.Tensor.reshape_as, torch.Tensor.view_as, accepts="packed; packed or dense other")
def reshape_as(func, nt: NestedTensor, other: Tensor) -> NestedTensor:
    """``reshape``/``view`` to ``other.shape``; a NestedTensor ``other`` must share the ragged structure."""
    op = "view_as" if func is torch.Tensor.view_as else "reshape_as"
    if isinstance(other, NestedTensor):
        _check_ragged_match(op, nt, other)  # the same sizes sample by sample: other's extents fit nt
    return _reshape(nt, (tuple(other.shape),), "view" if op == "view_as" else "reshape", isinstance(other, NestedTensor))


def _check_ragged_match(op: str, nt: NestedTensor, other: NestedTensor) -> None:
    """``other`` has ``nt``'s ragged extents, sample by sample (in sample order); under
    torch.compile only the count of ragged dims can be checked (sizes are runtime data)."""
    ra, rb = sorted(nt._ragged), sorted(other._ragged)
    if len(ra) != len(rb) or nt.batch_size != other.batch_size:
        raise StructureError(
            f"{op}(): ragged structures differ: ragged sample dims {nt.ragged_dims} vs {other.ragged_dims}, "
            f"batch sizes {nt.batch_size} vs {other.batch_size}"
        )
    if nt._meta is other._meta or _is_traced(nt._sizes) or _is_traced(other._sizes):
        return
    hs, ho = nt.host_sizes(), other.host_sizes()
    bad = (hs[:, ra] != ho[:, rb]).any(1).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise StructureError(
            f"{op}(): ragged structures differ: sample {i} has {_fmt_shape(hs[i].tolist())}, "
            f"other has {_fmt_shape(ho[i].tolist())}"
        )


# ---------------------------------------------------------------------------- flatten / unflatten


@implements(torch.flatten, torch.Tensor.flatten, accepts="packed")
def flatten(func, nt: NestedTensor, start_dim: int = 0, end_dim: int = -1) -> NestedTensor:
    """Flatten outer dims ``start_dim..end_dim``: all static (a reshape of ``values``), or all
    ragged and adjacent in storage order (rows unchanged: ``(C, H_i, W_i).flatten(2)`` gives
    ``(C, H_i*W_i)`` tokens). Mixing ragged and static dims, or the batch dim, raises."""
    s, e = outer_dim(nt, start_dim, "flatten"), outer_dim(nt, end_dim, "flatten")
    if s > e:
        raise ValueError(f"flatten(): start_dim {start_dim} comes after end_dim {end_dim}")
    if s == e:
        return nt
    if s == 0 and e == 1 and nt.sample_dim >= 2:
        return folds.fold(nt, "flatten")  # x.flatten(0, 1): dim 1 folded into the batch (padless.ops.rows.folds)
    if s == 0:
        raise StructureError(
            f"flatten(): dims {s}..{e} include the batch dim (0); a NestedTensor keeps its batch dim. "
            "Use flatten(1) to flatten each sample, or x.values() for the packed rows."
        )
    span = list(range(s - 1, e))
    rag = [p for p in span if p in nt._ragged]
    if not rag:
        dims = keep_all(nt)
        v0 = values_dim(nt, span[0])
        vals = values_of(nt).flatten(v0, v0 + len(span) - 1)
        new = dims[: span[0]] + [(STATIC, math.prod(dims[p][1] for p in span))] + dims[e:]
        return restructure(nt, vals, new)
    if len(rag) != len(span):
        static = [p + 1 for p in span if p not in nt._ragged]
        raise StructureError(
            f"flatten(): dims {s}..{e} mix ragged dims {tuple(p + 1 for p in rag)} with static dims "
            f"{tuple(static)}; only all-static or all-ragged spans can be flattened "
            f"(ragged outer dims: {tuple(r + 1 for r in nt.ragged_dims)}). Move the static dims out first "
            "(e.g. x.movedim(1, -1))."
        )
    q = nt._ragged.index(span[0])
    if tuple(nt._ragged[q : q + len(span)]) != tuple(span):
        raise StructureError(
            f"flatten(): ragged dims {s}..{e} are stored in order {tuple(r + 1 for r in nt._ragged)} "
            "(they were transposed), so their elements are not adjacent in each sample's rows"
        )
    k = len(span)
    keep = [c for c in range(nt.sample_dim) if c not in span[1:]]
    ragged = tuple(r if r <= span[0] else r - (k - 1) for r in nt._ragged if r not in span[1:])
    if nt._meta.host_sizes is None and _is_traced(nt._sizes):  # compiled: same rows, a new extent
        sizes = nt._sizes[:, keep].clone()
        sizes[:, span[0]] = nt._sizes[:, span].prod(1)
        meta = StructureMeta()
        env = [nt._env[c] for c in keep]
        env[span[0]] = traced_max(sizes[:, span[0]], meta, span[0])
        return nested_from_values(values_of(nt), nt._offsets, sizes, ragged, env, meta)
    hs, ho = host_structure(nt, "flatten")
    new_hs = hs[:, keep].clone()
    new_hs[:, span[0]] = hs[:, span].prod(1)
    return from_host_structure(values_of(nt), new_hs, ragged, nt, ho, nt._offsets)


@implements(torch.unflatten, torch.Tensor.unflatten, accepts="packed")
def unflatten(func, nt: NestedTensor, dim: int, sizes: Sequence[int]) -> NestedTensor:
    """Split a static dim into ``sizes`` (one ``-1`` inferred), or a ragged dim into sizes read
    from a batch's shape (each sample its own, :func:`padless.ops.rows.shape_ragged.split_ragged`)."""
    o = outer_dim(nt, dim, "unflatten")
    if o == 0:  # x.unflatten(0, (B, H)): the inverse of a fold (padless.ops.rows.folds)
        out = _unflatten_batch(nt, list(sizes))
        if out is not None:
            return out
    p = sample_dim(nt, dim, "unflatten")
    sizes = [for_batch(s, nt) for s in sizes]  # read from the batch this one was folded from: each its parent's
    if p in nt._ragged and any(isinstance(s, Extent) for s in sizes):
        return split_ragged(nt, p, list(sizes), "unflatten")
    if p in nt._ragged:
        raise ragged_error("unflatten", nt, o, "samples have different extents along it, so no single split fits them all")
    vals = values_of(nt).unflatten(values_dim(nt, p), tuple(int_entries("unflatten", "sizes", sizes)))
    vd = values_dim(nt, p)
    dims = keep_all(nt)
    new = dims[:p] + [(STATIC, n) for n in vals.shape[vd : vd + len(sizes)]] + dims[p + 1 :]
    return restructure(nt, vals, new)


def _unflatten_batch(nt: NestedTensor, sizes: list) -> NestedTensor | None:
    if len(sizes) != 2:
        return None
    return folds.unfold_reshape(nt, [*sizes, *nt.shape[1:]], "unflatten")


# ---------------------------------------------------------------------------- expand / pad


@implements(torch.Tensor.expand, accepts="packed")
def expand(func, nt: NestedTensor, *sizes, implicit: bool = False) -> NestedTensor:
    """Expand static dims of extent 1 (a stride-0 view of ``values``). ``-1`` keeps a dim;
    the batch dim and ragged dims must be ``-1`` or their current extent."""
    raw = shape_arg(sizes)
    raw = raw[:1] + [for_batch(e, nt) for e in raw[1:]]  # read from the batch this one was folded from
    grown = batch_repeats.expand_extents(nt, raw)  # a static 1 expanded to sizes read from a shape: a new ragged dim
    if grown is not None:
        return grown
    target = int_entries("expand", "size", raw)
    if len(target) != nt.dim():
        raise StructureError(
            f"expand(): target {tuple(target)} must have {nt.dim()} entries (batch included); "
            "a NestedTensor cannot grow new leading dims"
        )
    if target[0] not in (-1, nt.batch_size):
        raise StructureError(f"expand(): the batch dim must stay {nt.batch_size} (or -1), got {target[0]}")
    dims = keep_all(nt)
    for p, t in enumerate(target[1:]):
        kind, n = dims[p]
        if t == -1 or (kind == RAGGED and t == nt._env[p]):
            continue
        if kind == RAGGED:
            raise ragged_error("expand", nt, p + 1, f"it cannot be expanded to {t}")
        if t != n and n != 1:
            raise StructureError(f"expand(): static dim {p + 1} has extent {n}; only extent-1 dims expand (to {t})")
        dims[p] = (STATIC, t)
    vals = values_of(nt)
    return restructure(nt, vals.expand(vals.shape[0], *[n for kind, n in dims if kind == STATIC]), dims)


@implements(torch.Tensor.expand_as, accepts="packed; packed or dense other")
def expand_as(func, nt: NestedTensor, other: Tensor) -> NestedTensor:
    """``expand(other.shape)``; a NestedTensor ``other`` must share the ragged structure.
    A dense tensor expanded as a NestedTensor is broadcast to every sample."""
    if not isinstance(nt, NestedTensor):
        return expand_dense_as(nt, other)
    if isinstance(other, NestedTensor):
        _check_ragged_match("expand_as", nt, other)
    return expand(torch.Tensor.expand, nt, tuple(other.shape))


# ---------------------------------------------------------------------------- split / chunk / narrow


def _batch_pieces(nt: NestedTensor, pieces: Sequence[Tensor]) -> tuple[NestedTensor, ...]:
    out, start = [], 0
    for piece in pieces:
        n = piece.shape[0]
        out.append(select_samples(nt, slice(start, start + n)))
        start += n
    return tuple(out)


def _split_like(op: str, nt: NestedTensor, dim: int, run) -> tuple[NestedTensor, ...]:
    """Shared body of split/chunk/tensor_split: ``run(t, d)`` splits a plain tensor."""
    o = outer_dim(nt, dim, op)
    if o == 0:
        return _batch_pieces(nt, run(torch.arange(nt.batch_size), 0))
    p = o - 1
    if p in nt._ragged:
        raise ragged_error(
            op, nt, o,
            "samples have different extents along it, so the pieces would not line up; "
            f"{op} a static dim or the batch dim, or use narrow({o}, start, length) for one window",
        )
    vd = values_dim(nt, p)
    return tuple(restructure(nt, v, static_changed(nt, p, v.shape[vd])) for v in run(values_of(nt), vd))


@implements(torch.split, torch.Tensor.split, accepts="packed")
def split(func, nt: NestedTensor, split_size_or_sections, dim: int = 0) -> tuple[NestedTensor, ...]:
    """Split along a static dim (pieces share the structure) or the batch dim (sub-batches)."""
    if not isinstance(split_size_or_sections, int) and outer_dim(nt, dim, "split") == 0:
        total = sum(split_size_or_sections)
        if total != nt.batch_size:
            raise StructureError(f"split(): sections {tuple(split_size_or_sections)} sum to {total}, the batch has {nt.batch_size} samples")
    return _split_like("split", nt, dim, lambda t, d: torch.split(t, split_size_or_sections, d))


@implements(torch.chunk, torch.Tensor.chunk, accepts="packed")
def chunk(func, nt: NestedTensor, chunks: int, dim: int = 0) -> tuple[NestedTensor, ...]:
    """``chunk`` along a static dim or the batch dim (same piece sizes as torch)."""
    return _split_like("chunk", nt, dim, lambda t, d: torch.chunk(t, chunks, d))


@implements(torch.tensor_split, torch.Tensor.tensor_split, accepts="packed")
def tensor_split(func, nt: NestedTensor, indices_or_sections=None, dim: int = 0, **kwargs) -> tuple[NestedTensor, ...]:
    """``tensor_split`` along a static dim or the batch dim (``sections=``/``indices=`` accepted)."""
    arg = indices_or_sections
    for k in ("sections", "indices", "tensor_indices_or_sections"):
        arg = kwargs.pop(k, arg)
    return _split_like("tensor_split", nt, dim, lambda t, d: torch.tensor_split(t, arg, d))


# ------------------------------------------------------------------ indexing inside samples (lent to NestedTensor.__getitem__)


def _covers_ragged(e: Any, extent: int) -> bool:
    """True for a slice that keeps every sample whole along a ragged dim of envelope ``extent``."""
    return (
        isinstance(e, slice)
        and e.start in (None, 0)
        and e.step in (None, 1)
        and (e.stop is None or (isinstance(e.stop, int) and e.stop >= extent))
    )


@lend("index_static")
def index_static(nt: NestedTensor, entries: Sequence[Any]) -> NestedTensor:
    """Basic indexing inside every sample: ints and slices on static dims, None inserts a
    static dim of extent 1; a slice of a ragged dim takes that window of every sample
    (:mod:`padless.ops.rows.windows`). One indexing of ``values``."""
    nt, entries = take_windows(nt, entries)
    if not isinstance(nt, NestedTensor):  # x[:, k] on the only ragged dim: dense (B, ...)
        if all(isinstance(e, slice) and e == slice(None) for e in entries):
            return nt  # the position itself (a view that writes through, padless.tensor.views)
        return nt[(slice(None), *entries)]
    if all(isinstance(e, slice) and e == slice(None) for e in entries):
        return nt  # windows only
    dims = keep_all(nt)
    new: list[Any] = []
    vidx: list[Any] = [slice(None)]
    p = 0
    for e in entries:
        if e is None:
            new.append((STATIC, 1))
            vidx.append(None)
            continue
        kind, n = dims[p]
        if kind != STATIC:
            if not _covers_ragged(e, nt._env[p]):
                raise NotImplementedError(
                    f"NestedTensor indexing: dim {p + 1} is ragged (samples have different extents along "
                    f"it), so {e!r} would cut every sample at a different place: of the batch and ragged dims, "
                    "only the batch dim can be indexed (a ragged dim takes a slice, the same window of every "
                    "sample, or is taken whole). Take the same window from every sample with x[:, a:b] or "
                    f"x.narrow({p + 1}, start, length), or index samples one by one (x[i])."
                )
            new.append(dims[p])
        elif isinstance(e, slice):
            if e.step is not None and e.step <= 0:
                raise StructureError(f"NestedTensor indexing: slice step must be positive, got {e.step} at dim {p + 1}")
            new.append((STATIC, len(range(n)[e])))
            vidx.append(e)
        elif isinstance(e, int) and not isinstance(e, bool):
            if not -n <= e < n:
                raise IndexError(f"NestedTensor indexing: index {e} is out of range for static dim {p + 1} of size {n}")
            vidx.append(e)
        else:
            raise NotImplementedError(
                f"NestedTensor indexing: only ints, slices, None and ... can index the dims inside samples "
                f"(got {type(e).__name__} at dim {p + 1}); use torch.gather or index x.values() for advanced indexing"
            )
        p += 1
    vidx = tuple(vidx)
    out = restructure(nt, values_of(nt)[vidx], new)
    if writes_matter(nt):  # in-place ops on it write through to nt (padless.tensor.views)
        out = as_view(out, nt, put_view(lambda r: r[vidx]))
    return out


@implements(torch.repeat_interleave, torch.Tensor.repeat_interleave, accepts="packed; int, size read from a shape or 1-D tensor repeats")
def repeat_interleave(func, nt: NestedTensor, repeats=None, dim=None, *, output_size=None) -> Tensor:
    """Along the batch dim, every sample repeated in place: ``x.repeat_interleave(1, dim=0)``
    (boltz's pair bias with diffusion multiplicity 1) is a copy with the same structure;
    ``r`` repeats every sample ``r`` times, a size read from a shape (``z.shape[1]``) repeats
    sample ``b`` by its own size (the bias of every folded row,
    :func:`padless.ops.rows.batch_repeats.repeat_batch`). Any other form takes the path it takes
    without this handler (torch's decomposition into handled ATen ops, else the per-sample
    fallback)."""
    if type(repeats) is int and repeats == 1 and dim is not None and outer_dim(nt, dim, "repeat_interleave") == 0:
        return nested_from_values(values_of(nt).clone(), nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
    if dim is not None and isinstance(nt, NestedTensor) and outer_dim(nt, dim, "repeat_interleave") == 0:
        return batch_repeats.repeat_batch(nt, repeats)  # (b r) ...: every sample repeated
    from padless.tensor.core import _TLS, NeedsPerSample
    from padless.tensor.fallback import per_sample_function

    kwargs = {"output_size": output_size} if output_size is not None else {}
    _TLS.depth = getattr(_TLS, "depth", 0) + 1  # as NestedTensor.__torch_function__ does for unhandled calls
    try:
        return func(nt, repeats, dim, **kwargs)
    except NeedsPerSample as e:
        return per_sample_function(func, (nt, repeats, dim), kwargs, e.aten_op)
    finally:
        _TLS.depth -= 1
