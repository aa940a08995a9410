"""Row-creating ops under ``torch.compile``: row counts as sizes of carried tensors.

Eagerly, pair broadcasting (``(N_i, 1, C) + (1, N_i, C) -> (N_i, N_i, C)``) learns its
``sum N_i**2`` rows from host sizes. Inside a compiled graph sizes are runtime data, so
reading them would be a data-dependent ``.item()`` (a graph break, or an error with
``fullgraph=True``). The design, in one place:

* A *size carrier* is a stride-0 tensor ``(R,)`` (one byte of storage, expanded) whose
  only meaning is its length ``R``: a row count an op will create. Carriers are cached on
  a batch's structure (``nt._meta.derived[(name, device)]``) and ``__tensor_flatten__``
  flattens them as extra inner tensors, so the compiler sees ``R`` as a *size*: a symbol
  it reasons about, not data.
* Nobody has to make them: :func:`auto_carriers` runs when a real batch is flattened
  for a compiled graph (never in eager code) and computes them from host sizes, a few
  microseconds once per batch:

  ===================  =========================================  ========================
  name                 length                                     on
  ===================  =========================================  ========================
  ``pair_count``       ``sum N_i**2`` (square pair broadcasting)  batches with 1 ragged dim
  ``drop_count_k``     rows after reducing the k-th ragged dim    batches with 2-4 ragged
                       in storage order (``sum H_i`` for images)   dims
  ``rect_count``       ``sum N_i * M_i``; the *same* object on    :func:`prepare_for_compile`
                       both operands of a rectangular pair         ``(x, pairs_with=y)``
  ``pair_rows/cols``   the Collator's worker-built pair maps      ``Field(pair=True)``
  ===================  =========================================  ========================

* Under tracing, :func:`traced_pair_plan` builds the broadcast plan from the carried maps,
  or from a carrier and the device sizes and offsets with ``repeat_interleave(...,
  output_size=R)`` (tensor arithmetic only), and records on the pair structure how
  reducing either pair axis groups its rows (:func:`traced_pair_groups`): ``p.mean(dim=2)``
  then has ``sum N_i`` groups, the row count of the source batch, so
  ``x + g(p.mean(dim=2))`` adds tensors of one symbolic length.

* A pair state met with one of its operands (``p * x.unsqueeze(1)``, and every backward
  of a pair product) gathers the operand through the same maps (:func:`_traced_onto_pair`).

Both operands of a pair must carry the *same* carrier object (they come from one batch, or
from two batches prepared together); otherwise the op keeps its eager path, which reads
host sizes (a graph break, or an error under ``fullgraph=True``). Batches built from device
tensors without host sizes get no automatic carriers (that would cost a sync);
:func:`prepare_for_compile` makes them with one.

Layout of the maps for ``x`` with samples ``(N_i, C)`` (``N = 2, 1``, offsets ``[0, 2, 3]``)::

    pair rows (i, a, b)   (0,0,0) (0,0,1) (0,1,0) (0,1,1) (1,0,0)
    rows of x.unsqueeze(2)  [0,      0,      1,      1,      2]    = offsets[i] + a
    rows of x.unsqueeze(1)  [0,      1,      0,      1,      2]    = offsets[i] + b
    pair_count              5 rows, stride 0
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _weak_dynamic, register_auto_carrier, register_carried
from padless.tensor.errors import StructureError

PAIR_COUNT = register_carried("pair_count")  # stride-0 (sum N_i**2,)
RECT_COUNT = register_carried("rect_count")  # stride-0 (sum N_i*M_i,), shared by both operands
PAIR_ROWS = register_carried("pair_rows")  # (P,) the Collator's map: row of the pair's first axis
PAIR_COLS = register_carried("pair_cols")  # (P,) the Collator's map: row of the pair's second axis
MAX_DROP = 4
DROP_COUNT = tuple(register_carried(f"drop_count_{k}") for k in range(MAX_DROP))
PAIR_GROUPS = "pair_groups"  # on a traced pair structure: (rows_a, rows_b, operand a, operand b)


def size_carrier(rows: int, device: torch.device | str) -> Tensor:
    """A ``(rows,)`` tensor of stride 0 over one byte: carries the number ``rows`` into a
    compiled graph as a symbolic size (marked unbacked, so it never specialises)."""
    t = torch.empty_strided((rows,), (0,), dtype=torch.uint8, device=device)  # one byte of storage, not a view
    _as_count(t)
    return t


def _as_count(t: Tensor) -> None:
    """Mark a carrier's length unbacked: a symbol with no size classes, so a count passing a
    threshold the compiler specialises on (4096 in the CPU code generator) does not recompile.
    Dynamo is not imported for it (a Collator worker makes carriers): a carrier made before
    Dynamo loads is weakly dynamic until :func:`auto_carriers` marks it when it enters a graph."""
    decorators = sys.modules.get("torch._dynamo.decorators")
    if decorators is None:
        _weak_dynamic(t, {0})
    elif 0 not in getattr(t, "_dynamo_unbacked_indices", ()):
        decorators.mark_unbacked(t, 0)


@register_auto_carrier
def auto_carriers(nt: NestedTensor) -> None:
    """Cache the carriers a real batch needs in a compiled graph (see the module doc).

    Runs from ``__tensor_flatten__`` on real batches only; computes from host sizes and
    does nothing when the batch has none (device-built batches: no sync is paid) or when
    the carriers are already cached."""
    m = nt._meta
    d = m.derived
    dev = nt._values.device
    for name in (PAIR_COUNT, RECT_COUNT, *DROP_COUNT):
        if (name, dev) in d:
            _as_count(d[(name, dev)])
    hs = m.host_sizes
    if hs is None:
        return
    ragged = nt._ragged
    if len(ragged) == 1:
        if (PAIR_COUNT, dev) not in d:
            n = hs[:, ragged[0]]
            d[(PAIR_COUNT, dev)] = size_carrier(int(torch.dot(n, n)), dev)
    elif len(ragged) <= MAX_DROP:
        for k in range(len(ragged)):
            if (DROP_COUNT[k], dev) not in d:
                keep = [r for j, r in enumerate(ragged) if j != k]
                d[(DROP_COUNT[k], dev)] = size_carrier(int(hs[:, keep].prod(1).sum()), dev)


def pair_rows(offsets: Tensor, total: int) -> Tensor:
    """``offsets[i] + a`` for every square pair row ``(i, a, b)`` in row-major order (see module doc)."""
    counts = offsets[1:] - offsets[:-1]
    rows_a, _, _, _ = pair_maps(offsets, counts, offsets, counts, total)
    return rows_a


def pair_maps(
    off_a: Tensor, n: Tensor, off_b: Tensor, m: Tensor, total: int | torch.SymInt
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row maps of the pair ``(N_i, M_i)`` from operand offsets and extents, without a host read.

    Returns ``(rows_a, rows_b, out_offsets, sid)``: for every pair row ``(i, r, c)`` (row-major
    per sample) the row ``off_a[i] + r`` of the first operand and ``off_b[i] + c`` of the second,
    the pair's offsets and each pair row's sample. ``total`` must be ``sum(n * m)``."""
    out_offsets = layout.offsets_from_counts(n * m)
    sid = layout.row_sample_ids(out_offsets, total)
    local = torch.arange(total, device=n.device) - out_offsets[:-1].index_select(0, sid)
    cols = m.index_select(0, sid).clamp_min(1)
    rows_a = off_a[:-1].index_select(0, sid) + torch.div(local, cols, rounding_mode="floor")
    rows_b = off_b[:-1].index_select(0, sid) + torch.remainder(local, cols)
    return rows_a, rows_b, out_offsets, sid


def prepare_for_compile(nt: NestedTensor, pairs: bool = True, pairs_with: NestedTensor | None = None) -> NestedTensor:
    """Cache on ``nt``'s structure what row-creating ops need inside a compiled region.

    Square pairs need nothing: every batch with host sizes gets its carriers when it enters
    a compiled graph. ``pairs=True`` makes them now (what that automatic step does).
    ``pairs_with=y``: the rectangular pair ``x.unsqueeze(2) + y.unsqueeze(1)`` (samples
    ``(N_i, C)`` and ``(M_i, C)``, giving ``(N_i, M_i, C)``) gets one carrier of
    ``sum N_i * M_i`` rows shared by both batches. Call it outside the compiled function;
    returns ``nt`` itself.

    Example::

        x, y = padless.from_list(xs), padless.from_list(ys)
        padless.prepare_for_compile(x, pairs_with=y)
        p = torch.compile(lambda x, y: x.unsqueeze(2) + y.unsqueeze(1), fullgraph=True)(x, y)
    """
    if not isinstance(nt, NestedTensor):
        raise TypeError(f"prepare_for_compile(): nt must be a NestedTensor, got {type(nt).__name__}")
    if pairs_with is not None:
        _prepare_rect(nt, pairs_with)
    elif pairs:
        if len(nt._ragged) != 1:
            raise StructureError(
                f"prepare_for_compile(pairs=True): the batch has ragged dims {nt.ragged_dims}; pair maps "
                "are built for batches with exactly one ragged dim (samples (N_i, ...))"
            )
        nt.host_sizes()  # device-built batches: one sync here, so the carrier can be made
        auto_carriers(nt)
    return nt


def _prepare_rect(x: NestedTensor, y: NestedTensor) -> None:
    op = "prepare_for_compile(pairs_with=)"
    if not isinstance(y, NestedTensor):
        raise TypeError(f"{op}: pairs_with must be a NestedTensor, got {type(y).__name__}")
    for name, t in (("nt", x), ("pairs_with", y)):
        if len(t._ragged) != 1 or t._ragged != (0,):
            raise StructureError(
                f"{op}: {name} has ragged dims {t.ragged_dims}; rectangular pairs are built from two "
                "batches with samples (N_i, ...) ragged along dim 1 only"
            )
    if x.batch_size != y.batch_size:
        raise StructureError(f"{op}: batch sizes differ: {x.batch_size} vs {y.batch_size}")
    if x._values.device != y._values.device:
        raise ValueError(f"{op}: the batches are on different devices ({x.device} vs {y.device})")
    n, m = x.host_sizes()[:, 0], y.host_sizes()[:, 0]
    dev = x._values.device
    carrier = size_carrier(int((n * m).sum()), dev)
    x._meta.derived[(RECT_COUNT, dev)] = carrier
    y._meta.derived[(RECT_COUNT, dev)] = carrier


def carry_pair_maps(x: NestedTensor, y: NestedTensor, rows_a: Tensor, rows_b: Tensor) -> None:
    """Carry a pair's ready maps (built by the Collator's workers) into compiled graphs.

    Square pairs (``y is x``): ``x.unsqueeze(2) + x.unsqueeze(1)`` uses the maps instead of
    building them in the graph. Rectangular pairs: both fields get one shared carrier of
    the pair's row count (as :func:`prepare_for_compile` with ``pairs_with=``)."""
    dev = x._values.device
    if rows_a.device != dev or dev.type == "meta":
        return
    if y is x:
        d = x._meta.derived
        if (PAIR_ROWS, dev) not in d:
            _weak_dynamic(rows_a, {0})
            _weak_dynamic(rows_b, {0})
            d[(PAIR_ROWS, dev)] = rows_a
            d[(PAIR_COLS, dev)] = rows_b
        return
    carrier = size_carrier(rows_a.shape[0], dev)
    x._meta.derived.setdefault((RECT_COUNT, dev), carrier)
    y._meta.derived.setdefault((RECT_COUNT, dev), carrier)


def _unwrap(t: Tensor) -> Tensor:
    """The tensor under AOTAutograd's functional wrapper (each graph input is wrapped apart,
    so one carrier flattened from two batches arrives as two wrappers of one tensor)."""
    return torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t


def _shared(a: NestedTensor, b: NestedTensor, name: str) -> Tensor | None:
    """The carrier ``name`` when ``a`` and ``b`` carry the very same one, else None."""
    dev = a._values.device
    t, u = a._meta.derived.get((name, dev)), b._meta.derived.get((name, dev))
    if t is None or u is None:
        return None
    return t if t is u or _unwrap(t) is _unwrap(u) else None


def _squeeze(n: NestedTensor, ndim: int, out_ragged: tuple[int, ...]) -> tuple[int, ...]:
    static = layout.static_dims(ndim, n._ragged)
    return tuple(1 + static.index(d) for d in out_ragged if d not in n._ragged)


def traced_pair_plan(opname: str, nts: Sequence[NestedTensor]):
    """The broadcast plan of ``(N_i, 1, ...) (op) (1, M_i, ...)`` under tracing, from carried
    maps or a carried row count (None when the operands are not such a pair or carry none),
    as the arguments of :class:`padless.ops.common.broadcast.Plan`: ``(template, rows, squeeze)``."""
    if len(nts) != 2:
        return None
    a, b = nts
    if (0, 1) in (a._ragged, b._ragged):
        return _traced_onto_pair(a, b)
    flip = a._ragged == (1,) and b._ragged == (0,)
    if flip:
        a, b = b, a
    if a._ragged != (0,) or b._ragged != (1,) or a.sample_dim != b.sample_dim or a.sample_dim < 2:
        return None
    if a._env[1] != 1 or b._env[0] != 1:
        return None  # a static extent other than 1 against a ragged dim: the eager path explains
    dev = a._values.device
    n, m = a._sizes[:, 0], b._sizes[:, 1]
    maps_a, maps_b = _shared(a, b, PAIR_ROWS), _shared(a, b, PAIR_COLS)
    if maps_a is not None and maps_b is not None:  # the Collator's square maps
        rows_a, rows_b = maps_a, maps_b
        out_offsets = layout.offsets_from_counts(n * m)
    else:
        carrier = _shared(a, b, RECT_COUNT)
        if carrier is None:
            carrier = _shared(a, b, PAIR_COUNT)
        if carrier is None:
            return None
        rows_a, rows_b, out_offsets, _ = pair_maps(a._offsets, n, b._offsets, m, carrier.shape[0])
    total = rows_a.shape[0]
    ndim = a.sample_dim
    out_sizes = torch.where(a._sizes == 1, b._sizes, a._sizes)
    out_ragged = (0, 1)
    env = [a._env[0], b._env[1]] + [max(a._env[d], b._env[d]) for d in range(2, ndim)]
    static_env = [env[d] for d in layout.static_dims(ndim, out_ragged)]
    meta = StructureMeta()
    meta.derived[(PAIR_GROUPS, dev)] = (rows_a, rows_b, a, b)
    placeholder = a._values.new_zeros(()).expand(total, *static_env)
    template = NestedTensor(placeholder, out_offsets, out_sizes, out_ragged, env, meta)
    rows = [rows_a, rows_b]
    squeeze = [_squeeze(a, ndim, out_ragged), _squeeze(b, ndim, out_ragged)]
    if flip:
        rows.reverse()
        squeeze.reverse()
    return template, rows, squeeze


def _same_rows(c: NestedTensor, src: NestedTensor) -> bool:
    """Whether ``c`` holds the rows of ``src`` (one of a pair's operands): they carry the same
    pair carrier and their row counts are provably equal (no guard is added)."""
    if not any(_shared(c, src, k) is not None for k in (PAIR_ROWS, RECT_COUNT, PAIR_COUNT)):
        return False
    return statically_known_true(c._values.shape[0] == src._values.shape[0])


def _traced_onto_pair(x: NestedTensor, y: NestedTensor):
    """Plan for a traced pair state ``(N_i, M_i, ...)`` (op) one of its operands, e.g.
    ``p * x.unsqueeze(1)`` or the backward of ``x.unsqueeze(2) * x.unsqueeze(1)``: the
    operand's rows are gathered through the pair's maps; the pair's rows stay. Returns the
    arguments of the plan, as :func:`traced_pair_plan`."""
    flip = y._ragged == (0, 1)
    p, c = (y, x) if flip else (x, y)
    dev = p._values.device
    entry = p._meta.derived.get((PAIR_GROUPS, dev))
    if entry is None or p._ragged != (0, 1) or c.sample_dim != p.sample_dim:
        return None
    rows_a, rows_b, a, b = entry
    if c._ragged == (0,) and c._env[1] == 1 and _same_rows(c, a):
        rows = rows_a
    elif c._ragged == (1,) and c._env[0] == 1 and _same_rows(c, b):
        rows = rows_b
    else:
        return None
    ndim = p.sample_dim
    out_ragged = (0, 1)
    env = [p._env[0], p._env[1]] + [max(p._env[d], c._env[d]) for d in range(2, ndim)]
    static_env = [env[d] for d in layout.static_dims(ndim, out_ragged)]
    if list(static_env) == list(p._values.shape[1:]):
        sizes, meta = p._sizes, p._meta
    else:
        sizes, meta = torch.where(p._sizes == 1, c._sizes, p._sizes), StructureMeta()
        meta.derived[(PAIR_GROUPS, dev)] = entry
    placeholder = p._values.new_zeros(()).expand(p._values.shape[0], *static_env)
    template = NestedTensor(placeholder, p._offsets, sizes, out_ragged, env, meta)
    plan_rows = [None, rows]
    squeeze = [(), _squeeze(c, ndim, out_ragged)]
    if flip:
        plan_rows.reverse()
        squeeze.reverse()
    return template, plan_rows, squeeze


def traced_pair_groups(nt: NestedTensor, reduced: tuple[int, ...]):
    """Groups for reducing one axis of a pair structure made by :func:`traced_pair_plan`
    (None otherwise): the groups are the rows of the operand that keeps its axis
    (``sum N_i`` of them when reducing dim 2 of ``(N_i, M_i)``), as the arguments of
    :class:`padless.ops.common.segment.Groups`."""
    entry = nt._meta.derived.get((PAIR_GROUPS, nt._values.device))
    if entry is None or nt._ragged != (0, 1) or reduced not in ((0,), (1,)):
        return None
    rows_a, rows_b, a, b = entry
    if reduced == (1,):  # groups: a's rows, each of M_i pair rows
        gid, other, src, partner, ext = rows_a, rows_b, a, b, b._sizes[:, 1]
    else:  # groups: b's rows, each of N_i pair rows
        gid, other, src, partner, ext = rows_b, rows_a, b, a, a._sizes[:, 0]
    n_src = src._values.shape[0]
    counts = ext.index_select(0, layout.row_sample_ids(src._offsets, n_src))
    sid = layout.row_sample_ids(nt._offsets, nt._values.shape[0])
    local = other - partner._offsets[:-1].index_select(0, sid)
    return gid, n_src, counts, None, (local,), -1, (nt._sizes, nt._offsets, nt._ragged, reduced)


def traced_group_count(nt: NestedTensor, reduced: tuple[int, ...]) -> int | torch.SymInt | None:
    """Under tracing, the number of groups when one of several ragged dims is reduced, from
    the carried ``drop_count_k`` (None when not carried: the caller reads data instead)."""
    if len(reduced) != 1 or reduced[0] not in nt._ragged or len(nt._ragged) < 2:
        return None
    k = nt._ragged.index(reduced[0])
    if k >= MAX_DROP:
        return None
    carrier = nt._meta.derived.get((DROP_COUNT[k], nt._values.device))
    return None if carrier is None else carrier.shape[0]
