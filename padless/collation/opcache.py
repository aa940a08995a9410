"""Hand the worker's metadata to the op layer, so its first use on a batch is a cache hit.

The op layer caches derived metadata per structure in ``nt._meta.derived``
(``cu_seqlens``, ``row_sample_ids``, reduction groups, padded indices, broadcast
plans). A collated batch fills those caches from :class:`FieldMeta` when it is
built, unpickled, pinned or moved: wrapping tensors the worker computed, never
computing structure in the main process. This module is the one place that knows
the op layer's cache keys; ``tests/collation/test_opcache.py`` fails if they drift.

Pair fields: ``x.unsqueeze(2) + x.unsqueeze(1)`` (and the reversed order, and
``x.unsqueeze(2) + y.unsqueeze(1)`` for a rectangular pair against field ``y``)
finds a ready broadcast plan, and ``p.mean(dim=2)`` / ``p.sum(dim=1)`` find their
groups. Pair states made from *transformed* fields (``u(x).unsqueeze(2) + ...``)
reach the maps through :func:`collated_plan`, once ``padless.ops.common.broadcast.plan``
asks plan providers on a miss (see the README of padless.collate).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from padless.collation.metadata import FieldMeta, PairMaps, SpatialMaps
from padless.collation.network import NetworkPlans, install_network
from padless.collation.pair_plans import install_pair_plans
from padless.ops.common.broadcast import Plan
from padless.ops.common.carried import carry_pair_maps
from padless.ops.common.segment import Groups
from padless.tensor.core import NestedTensor, StructureMeta

FIELD_KEY = "collate_field_meta"  # nt._meta.derived[FIELD_KEY] -> FieldMeta of a collated field
_PAIRS_ATTR = "_padless_pair_maps"  # on a field's host offsets: {id(peer host offsets): (peer, PairMaps)}


def field_meta(nt: NestedTensor) -> FieldMeta | None:
    """The worker-computed metadata of a collated NestedTensor, or None."""
    return nt._meta.derived.get(FIELD_KEY)


def install(nt: NestedTensor, fm: FieldMeta) -> None:
    """Fill ``nt``'s op-layer caches from its field metadata (no computation)."""
    m = nt._meta
    m.derived[FIELD_KEY] = fm
    dev = nt._values.device
    if dev.type == "meta":  # the op layer never caches on the meta device
        return
    m.derived[("cu_seqlens", nt._offsets.device)] = fm.cu_seqlens
    m.derived["partitions"] = fm.partitions
    if fm.padded_index is not None:
        m.derived[("padded_idx", dev, tuple(nt._env))] = fm.padded_index
    r = fm.rows
    if r is not None:
        m.derived[("row_ids", dev)] = r.row_ids
        reduced = tuple(sorted(nt._ragged))
        by_dim = dict(zip(nt._ragged, r.coords))
        local = tuple(by_dim[d] for d in reduced)
        m.derived[("groups_obj", reduced, dev)] = Groups(r.row_ids, nt.batch_size, r.counts, None, local, r.empty_sample)
    if fm.spatial:
        install_spatial(nt, fm.spatial)
    if fm.pair_plans is not None:
        install_pair_plans(nt, fm.pair_plans)


# The index tensors of a spatial plan that live on the batch's device; its other tensors are host metadata.
_SPATIAL_DEVICE_FIELDS = ("place", "gather", "take")
_SPATIAL_SKIPPED = ("geometry", "layout", "cache", "_divisors")  # carried apart, or rebuilt here


def spatial_maps(plan: Any) -> SpatialMaps:
    """What a :class:`padless.ops.vision.spatial.SpatialPlan` carries to the main process: its index
    tensors and host fields, without its caches (the output structure's cache, divisors)."""
    host = {
        f.name: getattr(plan, f.name)
        for f in dataclasses.fields(plan)
        if f.name not in _SPATIAL_DEVICE_FIELDS and f.name not in _SPATIAL_SKIPPED
    }
    return SpatialMaps(plan.geometry, plan.layout, plan.place, plan.gather, plan.take, host)


def install_spatial(nt: NestedTensor, maps: Sequence[SpatialMaps | NetworkPlans]) -> None:
    """Put the carried plans where ``conv2d``/``max_pool2d``/... look for them on ``nt``'s images
    (the spatial cache of its structure, keyed by geometry, layout and device)."""
    from padless.ops.vision import spatial as sp

    dev = nt._values.device
    cache = sp._cache_of("Collator", nt)
    for m in maps:
        if isinstance(m, NetworkPlans):  # Field(spatial_plan=recipe): a whole network's plans
            install_network(nt, m)
            continue
        key = (m.geometry, m.layout, dev)
        if key in cache.plans:
            continue
        plan = sp.SpatialPlan(geometry=m.geometry, layout=m.layout, place=m.place, gather=m.gather, take=m.take, **m.host)
        plan.cache = sp._cache_for(plan.out_hw, plan.out_offsets, cache.ragged)
        cache.plans[key] = plan


def install_pair(x: NestedTensor, y: NestedTensor, pm: PairMaps) -> None:
    """Broadcast plans for ``x.unsqueeze(2) + y.unsqueeze(1)`` (both orders) and the pair's groups."""
    dev = x._values.device
    if dev.type == "meta":
        return
    reg = getattr(x._meta.host_offsets, _PAIRS_ATTR, None)
    if reg is None:
        reg = {}
        setattr(x._meta.host_offsets, _PAIRS_ATTR, reg)
    reg[id(y._meta.host_offsets)] = (y._meta.host_offsets, pm)
    a, b = x.unsqueeze(2), y.unsqueeze(1)
    template = _template(pm, a, b)
    t = template._meta.derived
    static = list(template._env[2:])
    if list(x._env[1:]) == static and list(y._env[1:]) == static:
        # p.mean(2) has x's structure, p.sum(2, keepdim=True) (autograd's sum_to_size) a's
        t[("reduced", (1,), (), False)] = (x._offsets, x._sizes, x._meta)
        t[("reduced", (0,), (), False)] = (y._offsets, y._sizes, y._meta)
        t[("reduced", (1,), (), True)] = (a._offsets, a._sizes, a._meta)
        t[("reduced", (0,), (), True)] = (b._offsets, b._sizes, b._meta)
    a._meta.derived[("broadcast", (id(b._meta), b._ragged))] = Plan(
        template, [pm.rows_i, pm.rows_j], [(1,), (1,)], keepalive=(a._meta, b._meta)
    )
    b._meta.derived[("broadcast", (id(a._meta), a._ragged))] = Plan(
        template, [pm.rows_j, pm.rows_i], [(1,), (1,)], keepalive=(b._meta, a._meta)
    )
    # Backward (and ``p * x.unsqueeze(1)``-style code) meets pair and operand structures together.
    for op, rows in ((a, pm.rows_i), (b, pm.rows_j)):
        t[("broadcast", (id(op._meta), op._ragged))] = Plan(template, [None, rows], [(), (1,)], keepalive=(template._meta, op._meta))
        op._meta.derived[("broadcast", (id(template._meta), (0, 1)))] = Plan(
            template, [rows, None], [(1,), ()], keepalive=(op._meta, template._meta)
        )
    carry_pair_maps(x, y, pm.rows_i, pm.rows_j)  # into compiled graphs too (padless.ops.common.carried)


def _template(pm: PairMaps, a: NestedTensor, b: NestedTensor) -> NestedTensor:
    """The pair structure ``(N_i, M_i, *static)`` of ``a = (N_i, 1, *S)`` and ``b = (1, M_i, *S')``,
    with its caches (row ids, cu_seqlens, groups over either pair dim) filled."""
    dev = a._values.device
    static = [max(a._env[d], b._env[d]) for d in range(2, a.sample_dim)]
    env = [a._env[0], b._env[1], *static]
    hs, hs_i, hs_j, sizes = pm.host_sizes, pm.host_sizes_i, pm.host_sizes_j, pm.sizes
    if static != hs[0, 2:].tolist() and hs.shape[0]:  # another static shape than the field's own
        fill = torch.tensor(static, dtype=torch.int64)
        hs, hs_i, hs_j = (_with_static(h, fill) for h in (hs, hs_i, hs_j))
        sizes = hs.to(dev, non_blocking=True)
    placeholder = torch.zeros((), dtype=a.dtype, device=dev).expand(pm.rows_i.shape[0], *static)
    template = NestedTensor(placeholder, pm.offsets, sizes, (0, 1), env, StructureMeta(hs, pm.host_offsets))
    t = template._meta.derived
    t[("cu_seqlens", dev)] = pm.cu_seqlens
    n_x, n_y = pm.counts_i.shape[0], pm.counts_j.shape[0]
    col = LazyCoords(lambda: pm.rows_j - b._offsets[:-1].index_select(0, template.row_sample_ids()))
    row = LazyCoords(lambda: pm.rows_i - a._offsets[:-1].index_select(0, template.row_sample_ids()))
    t[("groups_obj", (1,), dev)] = Groups(pm.rows_i, n_x, pm.counts_i, hs_i, col, pm.empty_i)
    t[("groups_obj", (0,), dev)] = Groups(pm.rows_j, n_y, pm.counts_j, hs_j, row, pm.empty_j)
    return template


class LazyCoords(tuple):
    """``Groups.local`` of a pair reduction: each pair row's coordinate along the reduced dim,
    computed on first read (only arg-reductions and ragged cumsum read it), from the pair maps."""

    def __new__(cls, compute):
        self = super().__new__(cls, (None,))
        self._compute = compute
        self._value = None
        return self

    def _get(self) -> tuple:
        if self._value is None:
            self._value = (self._compute(),)
        return self._value

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())


def _with_static(h: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[:, 2:] = fill
    return out


def collated_plan(opname: str, nts: Sequence[NestedTensor]) -> Plan | None:
    """A broadcast plan from collated pair maps, for ``plan()`` to use on a cache miss.

    Recognises ``u(x).unsqueeze(2) + v(y).unsqueeze(1)`` (either order) where ``x``
    and ``y`` are collated fields with pair maps: every structure derived from a
    field shares its host offsets, which is how the maps are found. Returns None
    for anything else.
    """
    if len(nts) != 2 or nts[0].sample_dim != nts[1].sample_dim or nts[0].sample_dim < 2:
        return None
    for a, b in ((nts[0], nts[1]), (nts[1], nts[0])):
        if a._ragged != (0,) or b._ragged != (1,) or a._env[1] != 1 or b._env[0] != 1:
            continue
        ho_a, ho_b = a._meta.host_offsets, b._meta.host_offsets
        hit = getattr(ho_a, _PAIRS_ATTR, {}).get(id(ho_b))
        if hit is None or hit[0] is not ho_b or hit[1].rows_i.device != a._values.device:
            continue
        pm = hit[1]
        rows = [pm.rows_i, pm.rows_j] if a is nts[0] else [pm.rows_j, pm.rows_i]
        return Plan(_template(pm, a, b), rows, [(1,), (1,)], keepalive=(nts[0]._meta, nts[1]._meta))
    return None
