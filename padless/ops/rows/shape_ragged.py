"""Reshapes that merge or split ragged dims, as code written for padded images does.

* **merge**: ``x.view(B, -1, C)`` of ``(H_i, W_i, C)`` samples, or ``m.view(B, -1)`` of a
  pair map ``(N_i, N_i)``: the ``-1`` stands for a run of adjacent ragged dims, which
  become one ragged dim of ``H_i * W_i`` rows (the rows do not move; the same as
  ``flatten``).
* **split**: ``t.reshape(B, -1, height, width)`` of ``(C, L_i)`` tokens, with ``height``
  and ``width`` read from an image batch's shape (entries that remember each sample's own
  size, :mod:`padless.tensor.extents`), as smp's Segformer decoder writes it: a ragged dim
  of ``L_i = h_i * w_i`` rows becomes two ragged dims ``(h_i, w_i)``, row-major, the rows
  unchanged. ``x.unflatten(d, (h, w))`` with such sizes does the same. A sample whose
  length is not the product of its sizes is refused, naming it.
* **reinterpret**: ``t.reshape(B, C, height, width)`` of ``(h_i * w_i, C)`` maps (smp's MAnet
  writes it): neither a merge nor a split, but every sample's dense memory read in the new
  shape, exactly what ``reshape`` does to that sample alone. Each sample's new shape comes
  from the target (sizes read from a shape give each sample its own; one ``-1`` is inferred
  per sample); its element count must be the sample's. The rows are rebuilt with one gather
  (cached by content), differentiable. ``reshape`` only: ``view`` promises no copy.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from padless.ops.common import content
from padless.ops.common.host import from_host_structure, host_structure, match_target
from padless.ops.common.structure import RAGGED, call
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent, check_extent, sample_columns

__all__ = ["reshape_by_extents", "reshape_ragged", "split_ragged"]


def split_ragged(nt: NestedTensor, p: int, parts: Sequence[Any], op: str) -> NestedTensor:
    """Ragged sample dim ``p`` split into ``len(parts)`` ragged dims, row-major; each part is
    an :class:`Extent` (its per-sample values) or a plain int (the same for every sample)."""
    b = nt.batch_size
    for j, e in enumerate(parts):
        check_extent(e, nt, op, f"sizes[{j}]")
    cols = [e.per_sample() if isinstance(e, Extent) else [int(e)] * b for e in parts]
    hs, ho = host_structure(nt, op)
    lengths = hs[:, p].tolist()
    for i in range(b):
        got = math.prod(c[i] for c in cols)
        if got != lengths[i]:
            raise StructureError(
                f"{op}(): sample {i} has {lengths[i]} entries along dim {p + 1}, but its sizes "
                f"{tuple(c[i] for c in cols)} hold {got}; the split must give every sample its own length"
            )
    m = len(parts)
    new_hs = torch.cat([hs[:, :p], torch.tensor(cols, dtype=hs.dtype).T.reshape(b, m), hs[:, p + 1 :]], 1)
    ragged: list[int] = []
    for r in nt._ragged:  # storage order kept; the new dims take p's place, outer first
        if r == p:
            ragged += [p + j for j in range(m)]
        else:
            ragged.append(r if r < p else r + m - 1)
    return from_host_structure(values_of(nt), new_hs, tuple(ragged), nt, ho, nt._offsets)


def _split_plan(nt: NestedTensor, rest: list[Any]) -> list[tuple[int, list[Any]]] | None:
    """Which ragged dims ``rest`` (the target after the batch dim) splits, and into what."""
    if not any(isinstance(e, Extent) for e in rest):
        return None  # only sizes read from a shape split a ragged dim
    hs = None
    plan: list[tuple[int, list[Any]]] = []
    t = 0
    for p in range(nt.sample_dim):
        if t >= len(rest):
            return None
        if p not in nt._ragged:
            if rest[t] not in (-1, nt._env[p]):
                return None
            t += 1
            continue
        if hs is None:
            hs = nt.host_sizes()
        lengths = hs[:, p].tolist()
        for m in range(len(rest) - t, 1, -1):  # the longest group of sizes whose product is each length
            group = rest[t : t + m]
            if not any(isinstance(e, Extent) for e in group) or any(type(e) is not int and not isinstance(e, Extent) for e in group):
                continue
            if any(isinstance(e, Extent) and e.batch_size != nt.batch_size for e in group):
                continue
            cols = [e.per_sample() if isinstance(e, Extent) else [e] * nt.batch_size for e in group]
            if all(math.prod(c[i] for c in cols) == n for i, n in enumerate(lengths)):
                plan.append((p, group))
                t += m
                break
        else:
            if rest[t] not in (-1, nt._env[p]):
                return None
            t += 1
    return plan if t == len(rest) and plan else None


def _merge_span(nt: NestedTensor, rest: list[Any]) -> tuple[int, int] | None:
    """The run of sample dims ``[i, j)`` a single ``-1`` in ``rest`` stands for, when the
    entries before and after it match the sample dims exactly and the run is all ragged."""
    if rest.count(-1) != 1:
        return None
    k = rest.index(-1)
    pre, post = rest[:k], rest[k + 1 :]
    i, j = len(pre), nt.sample_dim - len(post)
    if j - i < 2 or any(pre[d] != nt._env[d] for d in range(i)) or any(post[d - j] != nt._env[d] for d in range(j, nt.sample_dim)):
        return None
    if not all(d in nt._ragged for d in range(i, j)):
        return None
    return i, j


def reshape_ragged(nt: NestedTensor, target: list[Any], op: str, reinterpreting: bool = True) -> NestedTensor | None:
    """``reshape``/``view`` that merges adjacent ragged dims or splits one by per-sample sizes
    (module docstring); None when ``target`` asks for neither (and, with ``reinterpreting``,
    ``reshape`` cannot read every sample in the new shape either)."""
    if torch.compiler.is_compiling() or not target or target[0] not in (-1, nt.batch_size):
        return None  # compiled: shapes are symbolic and host sizes cannot be read
    if any(isinstance(e, torch.SymInt) for e in target):
        return None
    rest = list(target[1:])
    span = _merge_span(nt, rest)
    if span is not None:
        return call(torch.flatten, nt, span[0] + 1, span[1])
    plan = _split_plan(nt, rest)
    if plan is None:
        return reinterpret(nt, rest, op) if op == "reshape" and reinterpreting else None
    out = nt
    for p, group in reversed(plan):  # last dim first: earlier indices stay valid
        out = split_ragged(out, p, group, op)
    return out


def reshape_by_extents(nt: NestedTensor, target: list[Any], op: str, static_path: Any, trusted: bool = False) -> Any:
    """``reshape``/``view`` to a target holding sizes read from a shape (:class:`Extent`).

    Such a size is each sample's own, so the target names one shape per sample and the
    answer is every sample reshaped to its own shape, as the dense op does on that sample
    alone. The ways that keep the rows (a reshape of the static dims, ``static_path(dims)``;
    a merge or a split of ragged dims) are taken only when they give every sample exactly
    that shape: the target's ints alone may fit a rule by coincidence (``(B, -1, h, w)`` of
    ``(C, h_i * w_i)`` tokens read as a static ``(1, 2, L)`` when ``C = 2`` and ``H = W = 2``).
    Otherwise ``reshape`` reads every sample's memory in its shape (*reinterpret*) and
    ``view`` refuses (it promises no copy). None when the batch dim is not kept (the
    caller's rules apply). ``trusted``: the extents were checked to match ``nt`` already
    (``reshape_as``), so the batch they were read from is not checked."""
    b = nt.batch_size
    if not target or target[0] not in (-1, b):
        return None
    rest = list(target[1:])
    if rest.count(-1) > 1 or any(not isinstance(e, Extent) and type(e) is not int for e in rest):
        return None
    for j, e in enumerate(rest):
        if not trusted:
            check_extent(e, nt, op, f"shape[{j + 1}]")
        elif isinstance(e, Extent) and e.batch_size != b:
            return None
    cols = [e._values() if isinstance(e, Extent) else (e,) * b for e in rest]  # per target dim; -1: inferred
    host_structure(nt, op)  # refused under torch.compile (sizes are runtime data there)

    def fits(got: list[tuple[int, ...]]) -> bool:
        """Every sample's shape (``got``: one column per dim, host ints) is its target shape.
        Column by column: a folded batch has sum N_i samples, so no Python loop per sample
        where the columns are equal (a tuple comparison)."""
        return len(got) == len(cols) and all(
            w == g or (len(w) == len(g) == b and all(t == -1 or t == n for t, n in zip(w, g))) for w, g in zip(cols, got)
        )

    try:
        dims = match_target(nt, target, op)
    except StructureError:
        dims = None
    if dims is not None:
        own = sample_columns(nt)
        if fits([own[n] if kind == RAGGED else (n,) * b for kind, n in dims]):
            # a static dim's size may be an Extent whose samples all have that size: the
            # structure keeps the plain int (its shape then reads every ragged dim as an Extent)
            return static_path([(kind, n if kind == RAGGED else int(n)) for kind, n in dims])
    out = reshape_ragged(nt, target, op, reinterpreting=False)
    if out is not None and fits(sample_columns(out)):
        return out
    if op == "reshape":
        out = reinterpret(nt, rest, op)
        if out is not None:
            return out
    shapes = ", ".join(f"sample {i}: {tuple(c[i] for c in cols)}" for i in range(min(b, 3)))
    raise StructureError(
        f"{op}(): the target {tuple(int(e) for e in target)} holds sizes read from a shape, which give every sample "
        f"its own shape ({shapes}{', ...' if b > 3 else ''}); reading each sample in its shape moves its elements "
        "to new rows, a copy that view() does not make. Use reshape()"
    )


def reinterpret(nt: NestedTensor, rest: list[Any], op: str) -> NestedTensor | None:
    """Every sample's dense memory in a new shape (module docstring: *reinterpret*); None when
    ``rest`` gives no sample its own size (no :class:`Extent`), so the usual error stands."""
    b = nt.batch_size
    if not any(isinstance(e, Extent) for e in rest) or rest.count(-1) > 1:
        return None
    if any(not isinstance(e, Extent) and type(e) is not int for e in rest):
        return None
    if any(isinstance(e, Extent) and e.batch_size != b for e in rest):
        return None
    hs, ho = host_structure(nt, op)
    numel = [math.prod(r) for r in hs.tolist()]
    cols = [e.per_sample() if isinstance(e, Extent) else [e] * b for e in rest]
    shapes = []
    for i in range(b):
        shape = [c[i] for c in cols]
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            if known == 0:
                raise StructureError(
                    f"{op}(): sample {i} holds {numel[i]} elements and its target shape {tuple(shape)} has a 0: "
                    "the -1 could be any size (as torch says for a dense tensor); give that dim's size"
                )
            shape[shape.index(-1)] = numel[i] // known if numel[i] % known == 0 else -1
        if math.prod(shape) != numel[i]:
            raise StructureError(
                f"{op}(): sample {i} holds {numel[i]} elements, its target shape {tuple(shape)} holds "
                f"{math.prod(shape)}; a reshape must keep every sample's element count"
            )
        shapes.append(shape)
    ragged = tuple(j for j, e in enumerate(rest) if isinstance(e, Extent) or e == -1)
    static = [rest[j] for j in range(len(rest)) if j not in ragged]
    new_hs = torch.tensor(shapes, dtype=hs.dtype).reshape(b, len(rest))
    vals = values_of(nt)
    skey = content.structure_key(nt)  # None without host metadata: then nothing is shared
    key = ("reinterpret", vals.device, skey, new_hs.numpy().tobytes(), ragged)
    idx = content.get(key) if skey is not None else None
    if idx is None:
        idx = _reinterpret_index(hs, ho, nt._ragged, new_hs, ragged, math.prod(nt._values.shape[1:]))
        idx = idx.to(vals.device, non_blocking=True)
        if skey is not None:
            content.put(key, idx)
    out = vals.reshape(-1).index_select(0, idx)
    if 0 in static:  # no element to count the rows by: each sample's rows are its ragged extents' product
        n_rows = int(new_hs[:, list(ragged)].prod(1).sum()) if ragged else b
        return from_host_structure(out.view(n_rows, *static), new_hs, ragged, nt)
    return from_host_structure(out.view(-1, *static), new_hs, ragged, nt)


def _reinterpret_index(hs, ho, src_ragged, new_hs, new_ragged, width: int) -> torch.Tensor:
    """For every element of the new layout (rows, then static dims), its position in the old
    values (flat): per sample, the dense flat index of each stored element, inverted on the
    source side and read on the target side (host arithmetic)."""
    d_src, d_new = hs.shape[1], new_hs.shape[1]
    o_src = layout.storage_order(d_src, src_ragged)
    o_new = layout.storage_order(d_new, new_ragged)
    parts = []
    for i, (s_shape, t_shape) in enumerate(zip(hs.tolist(), new_hs.tolist())):
        n = math.prod(s_shape)
        if n == 0:
            continue
        dense_at = torch.arange(n).view(s_shape).permute(o_src).reshape(-1)  # dense index of stored element p
        pos_of = torch.empty(n, dtype=torch.int64)
        pos_of[dense_at] = torch.arange(n)
        want = torch.arange(n).view(t_shape).permute(o_new).reshape(-1)  # dense index the new layout stores
        parts.append(pos_of[want] + int(ho[i]) * width)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
