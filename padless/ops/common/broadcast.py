"""Broadcasting between NestedTensors of different structures: how pair axes are created.

Operands must have the same batch size and sample rank. Per sample and per dim the
extents must agree or be 1 (torch's rule, applied sample by sample). A dim that is
ragged in any operand is ragged in the result, so::

    (N_i, 1, C) + (1, N_i, C)  ->  (N_i, N_i, C)        square pairs
    (N_i, 1, C) + (1, M_i, C)  ->  (N_i, M_i, C)        rectangular pairs
    p + p.transpose(1, 2)       ->  (N_i, N_i, C)        storage orders differ: re-laid out
    (H, N_i, 1) * (1, 1, N_i)   ->  (H, N_i, N_i)        non-leading layouts

Each operand is mapped onto the result's rows through a row index (its
"coordinate map"), computed once per pair of structures from host metadata and
cached; the op then runs once on the gathered rows. Backward is the matching
``index_add`` (autograd of ``index_select``) plus the segmented ``sum_to_size``.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch
from torch import Tensor

from padless.ops.common import content
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, _fmt_shape, _is_traced
from padless.tensor.errors import StructureError


PLAN_PROVIDERS: list[Callable[[str, Sequence[NestedTensor]], "Plan | None"]] = []
"""Functions that may supply a precomputed :class:`Plan` before one is computed here."""


class Plan:
    """How to map every operand onto the result's rows.

    ``template``: the result's structure (values are a zero-size placeholder); ``rows``: per
    NestedTensor operand a row index ``(T_out,)`` or None (identity); ``squeeze``: per operand the
    values dims to squeeze (static 1 -> ragged). ``rows`` may be given as a function returning
    them, called on first read: a call that runs per sample on views (:mod:`padless.ops.common.
    sample_views`, triangle-attention scores plus a bias) reads only the template, and the maps
    over every result row of a new batch are then never built. ``gathered`` says which operands
    are read through a map without building any.
    """

    __slots__ = ("template", "_rows", "squeeze", "keepalive", "gathered")

    def __init__(self, template: NestedTensor, rows, squeeze: list[tuple[int, ...]], keepalive: tuple = (),
                 gathered: tuple[bool, ...] | None = None) -> None:
        self.template = template
        self._rows = rows
        self.squeeze = squeeze
        self.keepalive = keepalive
        self.gathered = gathered if gathered is not None else tuple(r is not None for r in rows)

    @property
    def rows(self) -> list[Tensor | None]:
        if callable(self._rows):
            self._rows = self._rows()
        return self._rows


def _fail(opname: str, hs: Sequence[Tensor], b: int) -> StructureError:
    """Name the first pair of operands whose shapes clash in sample ``b``."""

    def clash(x: Tensor, y: Tensor) -> bool:
        return bool(((x != y) & (x != 1) & (y != 1)).any())

    pairs = [(i, j) for i in range(len(hs)) for j in range(i + 1, len(hs))]
    i, j = next(((i, j) for i, j in pairs if clash(hs[i][b], hs[j][b])), (0, 1))
    return StructureError(
        f"{opname}(): ragged structures differ: sample {b} has {_fmt_shape(hs[i][b].tolist())}, "
        f"other has {_fmt_shape(hs[j][b].tolist())} (extents must agree or be 1 in every dim of every sample)"
    )


def plan(opname: str, nts: Sequence[NestedTensor]) -> Plan:
    """Broadcast plan for NestedTensor operands (the first is the reference; cached there)."""
    ref = nts[0]
    if _is_traced(ref._values):  # compiled: row counts come from carried maps (padless.ops.common.carried)
        from padless.ops.common.carried import traced_pair_plan

        traced = traced_pair_plan(opname, nts)
        if traced is not None:
            return Plan(*traced)
    key = ("broadcast",) + tuple((id(n._meta), n._ragged) for n in nts[1:])
    dev = ref._values.device
    hit = ref._meta.derived.get(key)
    if hit is not None:
        order = ref._meta.derived.get(_ORDER)
        if order is not None and key in order:
            order.move_to_end(key)
        return hit
    for provide in PLAN_PROVIDERS:  # e.g. pair maps precomputed by the collator in a worker
        provided = provide(opname, nts)
        if provided is not None:
            _remember(ref._meta, key, provided)
            return provided
    b = ref.batch_size
    ndim = ref.sample_dim
    for j, n in enumerate(nts[1:], 1):
        if n.batch_size != b:
            raise StructureError(f"{opname}(): ragged structures differ: batch sizes differ: {b} vs {n.batch_size}")
        if n.sample_dim != ndim:
            raise StructureError(
                f"{opname}(): ragged structures differ: sample ranks differ: {ndim} vs {n.sample_dim} "
                "(unsqueeze explicitly: NestedTensors broadcast sample dim by sample dim)"
            )
    ckey = None
    if any(_is_traced(n._values) for n in nts) or any(n._meta.host_sizes is None for n in nts):
        hs = [n.host_sizes() for n in nts]  # under tracing this reads device data; documented limit
    else:
        hs = [n._meta.host_sizes for n in nts]
        # the same rows met before (another layer's scores, a gradient): the plan by content
        ckey = ("broadcast", dev, ref._values.dtype, tuple(n._env for n in nts)) + tuple(content.structure_key(n) for n in nts)
        shared = content.get(ckey)
        if shared is not None:  # (rows, squeeze, out sizes, out offsets, envelope, ragged): a new template
            rows, squeeze, out_sizes, out_offsets, env, out_ragged = shared
            p = Plan(_template(ref, out_sizes, out_offsets, env, out_ragged), list(rows), list(squeeze),
                     keepalive=tuple(n._meta for n in nts[1:]))
            _remember(ref._meta, key, p)
            return p
    out_ragged = tuple(sorted({r for n in nts for r in n._ragged}))
    for d in out_ragged:
        for j, n in enumerate(nts):
            if d not in n._ragged:
                ext = int(hs[j][0, d]) if b else 1
                if ext != 1:
                    raise StructureError(
                        f"{opname}(): dim {d + 1} is ragged in one operand and static with extent {ext} in "
                        "another; only a static extent of 1 broadcasts against a ragged dim"
                    )
    out_sizes = hs[0].clone()
    for h in hs[1:]:
        out_sizes = torch.where(out_sizes == 1, h, out_sizes)  # torch's rule: 1 broadcasts (also to 0)
    for j, h in enumerate(hs):
        bad = ((h != out_sizes) & (h != 1)).any(1)
        if bool(bad.any()):
            raise _fail(opname, hs, int(bad.nonzero()[0, 0]))
    out_offsets = layout.offsets_from_counts(layout.row_counts(out_sizes, out_ragged))
    total = int(out_offsets[-1])
    sources: list[tuple | None] = []  # per operand: what its row map is built from, None: identity
    squeeze: list[tuple[int, ...]] = []
    for n, h in zip(nts, hs):
        static = layout.static_dims(ndim, n._ragged)
        squeeze.append(tuple(1 + static.index(d) for d in out_ragged if d not in n._ragged))
        same = n._ragged == out_ragged and torch.equal(h[:, list(out_ragged)], out_sizes[:, list(out_ragged)])
        sources.append(None if same else (h, n.host_offsets(), n._ragged))
    env = [int(out_sizes[:, d].max()) if b else 0 for d in range(ndim)]
    for d in range(ndim):
        if d not in out_ragged:
            env[d] = max(n._env[d] for n in nts)
    entry = (tuple(squeeze), out_sizes, out_offsets, tuple(env), out_ragged)

    def build_rows() -> list[Tensor | None]:  # holds host tensors only: no structure object
        rows = [None if src is None else
                layout.broadcast_rows(out_sizes, out_offsets, out_ragged, *src, total).to(dev, non_blocking=True)
                for src in sources]
        if ckey is not None:  # maps and host metadata only: no structure kept alive from here
            content.put(ckey, (tuple(rows), *entry))
        return rows

    p = Plan(_template(ref, out_sizes, out_offsets, env, out_ragged), build_rows, squeeze,
             keepalive=tuple(n._meta for n in nts[1:]), gathered=tuple(src is not None for src in sources))
    _remember(ref._meta, key, p)
    return p


def _template(ref: NestedTensor, out_sizes: Tensor, out_offsets: Tensor, env: Sequence, out_ragged: tuple) -> NestedTensor:
    """The result's structure (values are a zero-size placeholder), on ``ref``'s device."""
    dev = ref._values.device
    static_env = [env[d] for d in layout.static_dims(len(env), out_ragged)]
    total = int(out_offsets[-1])
    placeholder = ref._values.new_zeros(()).expand(total, *static_env)
    meta = StructureMeta(out_sizes, out_offsets)
    sizes_dev = out_sizes if dev.type == "cpu" else out_sizes.to(dev, non_blocking=True)
    offsets_dev = out_offsets if dev.type == "cpu" else out_offsets.to(dev, non_blocking=True)
    return NestedTensor(placeholder, offsets_dev, sizes_dev, tuple(out_ragged), list(env), meta)


PLAN_CACHE_SIZE = 16
"""Plans one structure keeps for its latest broadcast partners. A plan keeps its partners'
metadata alive (its key holds their ``id``), so a long-lived operand broadcast against a new
structure every step would otherwise keep every partner ever seen."""

_ORDER = "broadcast_lru"


def _remember(meta: StructureMeta, key: tuple, p: Plan) -> None:
    """Cache ``p`` on ``meta`` under ``key``, dropping the least recently used plan past
    :data:`PLAN_CACHE_SIZE` (plans installed directly by the collator are not counted)."""
    d = meta.derived
    order = d.get(_ORDER)
    if order is None:
        order = d[_ORDER] = collections.OrderedDict()
    d[key] = p
    order[key] = None
    order.move_to_end(key)
    while len(order) > PLAN_CACHE_SIZE:
        old, _ = order.popitem(last=False)
        d.pop(old, None)


def align(values: Tensor, rows: Tensor | None, squeeze: tuple[int, ...]) -> Tensor:
    """One operand's values mapped onto the result's rows."""
    if squeeze:
        values = values.squeeze(squeeze)
    if rows is not None:
        values = values.index_select(0, rows)
    return values
