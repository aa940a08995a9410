"""Row-creating ops under ``torch.compile``: row counts as sizes of carried tensors.

Eagerly, pair broadcasting (``(N_i, 1, C) + (1, N_i, C) -> (N_i, N_i, C)``) learns its
``sum N_i**2`` rows from host sizes. Inside a compiled graph sizes are runtime data, so
reading them would be a data-dependent ``.item()`` (a graph break, or an error with
``fullgraph=True``). The design, in one place:

* Before the compiled region, :func:`prepare_for_compile` computes the row maps the op
  needs, on the host as eager code would, and caches them on the batch's structure
  (``nt._meta.derived[("pair_rows", device)]``, row-level metadata that ops keeping the
  rows pass on, like ``cu_seqlens``).
* ``NestedTensor.__tensor_flatten__`` flattens every such cached map as an extra inner
  tensor (the set of names goes into the static context, so a batch with and without
  maps are two programs). The compiler therefore sees ``sum N_i**2`` as the *size* of
  the map: a symbol it reasons about, not data.
* Under tracing, :func:`traced_pair_plan` builds the broadcast plan from that map and
  from device sizes and offsets (tensor arithmetic only), and records on the pair
  structure how reducing either pair axis groups its rows (:func:`traced_pair_groups`):
  ``p.mean(dim=2)`` then has ``sum N_i`` groups, the row count of the source batch, so
  ``x + g(p.mean(dim=2))`` adds tensors of one symbolic length.

Layout of the map for ``x`` with samples ``(N_i, C)`` (``N = 2, 1``, offsets ``[0, 2, 3]``)::

    pair rows (i, a, b)   (0,0,0) (0,0,1) (0,1,0) (0,1,1) (1,0,0)
    pair_rows             [0,      0,      1,      1,      2]       = offsets[i] + a

Without a map (a batch not prepared), pair ops under compile keep their eager path,
which graph-breaks on the host read (or raises under ``fullgraph=True``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _weak_dynamic

PAIR_ROWS = "pair_rows"  # carried: (sum N_i**2,) source row of the pair's first axis
PAIR_GROUPS = "pair_groups"  # on a traced pair structure: (rows_a, rows_b, source NestedTensor rows)


def pair_rows(offsets: Tensor, total: int) -> Tensor:
    """``offsets[i] + a`` for every pair row ``(i, a, b)`` in row-major order (see module doc)."""
    counts = offsets[1:] - offsets[:-1]
    p_offsets = layout.offsets_from_counts(counts * counts)
    sid = layout.row_sample_ids(p_offsets, total)
    local = torch.arange(total, device=offsets.device) - p_offsets[:-1].index_select(0, sid)
    n = counts.index_select(0, sid).clamp_min(1)
    return offsets[:-1].index_select(0, sid) + torch.div(local, n, rounding_mode="floor")


def prepare_for_compile(nt: NestedTensor, pairs: bool = True) -> NestedTensor:
    """Cache on ``nt``'s structure what row-creating ops need inside a compiled region.

    ``pairs=True``: the ``(N_i, N_i)`` pair row map of a batch with one ragged dim, so
    ``u(x).unsqueeze(2) + v(x).unsqueeze(1)`` and the reductions of the pair state back
    to ``(N_i, C)`` compile with ``fullgraph=True`` and symbolic row counts. Call it
    outside the compiled function (or in the collate worker); returns ``nt`` itself.

    Example::

        x = padless.prepare_for_compile(padless.from_list([torch.randn(n, 8) for n in (3, 5)]))
        y = torch.compile(pair_block, fullgraph=True)(x)
    """
    if not isinstance(nt, NestedTensor):
        raise TypeError(f"prepare_for_compile(): nt must be a NestedTensor, got {type(nt).__name__}")
    if pairs:
        if len(nt._ragged) != 1:
            raise ValueError(
                f"prepare_for_compile(pairs=True): the batch has ragged dims {nt.ragged_dims}; pair maps "
                "are built for batches with exactly one ragged dim (samples (N_i, ...))"
            )
        ho = nt.host_offsets()
        counts = ho[1:] - ho[:-1]
        total = int((counts * counts).sum())
        rows = pair_rows(ho, total).to(nt._values.device, non_blocking=True)
        _weak_dynamic(rows, {0})  # sum N_i**2 is a symbol from the first compiled call
        nt._meta.derived[(PAIR_ROWS, nt._values.device)] = rows
    return nt


def _squeeze(n: NestedTensor, ndim: int, out_ragged: tuple[int, ...]) -> tuple[int, ...]:
    static = layout.static_dims(ndim, n._ragged)
    return tuple(1 + static.index(d) for d in out_ragged if d not in n._ragged)


def traced_pair_plan(opname: str, nts: Sequence[NestedTensor]):
    """The broadcast plan of ``(N_i, 1, ...) (op) (1, N_i, ...)`` under tracing, from the
    carried pair map (None when the operands are not such a pair or carry no map)."""
    from padless.ops.broadcast import Plan

    if len(nts) != 2:
        return None
    a, b = nts
    flip = a._ragged == (1,) and b._ragged == (0,)
    if flip:
        a, b = b, a
    if a._ragged != (0,) or b._ragged != (1,) or a.sample_dim != b.sample_dim or a.sample_dim < 2:
        return None
    dev = a._values.device
    carried = a._meta.derived.get((PAIR_ROWS, dev))
    if carried is None or b._meta.derived.get((PAIR_ROWS, dev)) is not carried:
        return None  # both operands must come from the rows of one prepared batch
    if a._env[1] != 1 or b._env[0] != 1:
        return None  # a static extent other than 1 against a ragged dim: the eager path explains
    ndim = a.sample_dim
    total = carried.shape[0]
    n = a._sizes[:, 0]
    out_sizes = torch.where(a._sizes == 1, b._sizes, a._sizes)
    out_offsets = layout.offsets_from_counts(n * n)
    sid = layout.row_sample_ids(out_offsets, total)
    local = torch.arange(total, device=dev) - out_offsets[:-1].index_select(0, sid)
    col = torch.remainder(local, n.index_select(0, sid).clamp_min(1))
    rows_b = b._offsets[:-1].index_select(0, sid) + col
    out_ragged = (0, 1)
    env = [a._env[0], b._env[1]] + [max(a._env[d], b._env[d]) for d in range(2, ndim)]
    static_env = [env[d] for d in layout.static_dims(ndim, out_ragged)]
    meta = StructureMeta()
    meta.derived[(PAIR_GROUPS, dev)] = (carried, rows_b, a)
    placeholder = a._values.new_zeros(()).expand(total, *static_env)
    template = NestedTensor(placeholder, out_offsets, out_sizes, out_ragged, env, meta)
    rows = [carried, rows_b]
    squeeze = [_squeeze(a, ndim, out_ragged), _squeeze(b, ndim, out_ragged)]
    if flip:
        rows.reverse()
        squeeze.reverse()
    return Plan(template, rows, squeeze)


def traced_pair_groups(nt: NestedTensor, reduced: tuple[int, ...]):
    """Groups for reducing one axis of a pair structure made by :func:`traced_pair_plan`
    (None otherwise): the groups are the source batch's rows, ``sum N_i`` of them."""
    from padless.ops.segment import Groups

    entry = nt._meta.derived.get((PAIR_GROUPS, nt._values.device))
    if entry is None or nt._ragged != (0, 1) or reduced not in ((0,), (1,)):
        return None
    rows_a, rows_b, src = entry
    gid, other = (rows_a, rows_b) if reduced == (1,) else (rows_b, rows_a)
    n_src = src._values.shape[0]
    n = src._sizes[:, 0]
    counts = n.index_select(0, layout.row_sample_ids(src._offsets, n_src))
    local = other - src._offsets[:-1].index_select(0, layout.row_sample_ids(nt._offsets, nt._values.shape[0]))
    return Groups(gid, n_src, counts, None, (local,), -1, (nt._sizes, nt._offsets, nt._ragged, reduced))
