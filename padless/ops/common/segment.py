"""Segmented reductions over ragged dims: the rows of ``values`` grouped, never padded.

Reducing a set of ragged dims groups the rows that agree on every *other* ragged
coordinate. Group ids are computed once per (structure, reduced dims) from host
metadata and cached; the reduction itself is one ``index_add`` /
``scatter_reduce`` over all rows of the batch (no Python loop over samples).

Result rule (used by every reduction): reducing some ragged dims leaves a
NestedTensor over the remaining ones; reducing every ragged dim leaves a dense
``(B, ...)`` tensor. ``keepdim=True`` keeps each reduced dim as a static dim of
extent 1 (so ``p - p.mean(2, keepdim=True)`` broadcasts back).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from padless.ops.kernels import segment as kernel_segment
from padless.ops.common import sample_views
from padless.ops.common import content
from padless.ops.common.structure import _to_device, build_nested, derived_tensor
from padless.tensor import layout
from padless.tensor.core import NestedTensor, _is_traced


class Groups:
    """Row -> group map for reducing ``reduced`` ragged dims of one structure.

    ``gid`` (the group of every row, values' device), ``counts`` (rows per group) and ``local``
    (per reduced dim, the row's coordinate along it, for arg-reductions) may be given as a
    function ``lazy() -> (gid, counts, local)`` instead, called on first read: a softmax over
    runs of consecutive rows (attention scores) reads only :meth:`runs`, and the per-row maps
    of a new batch's triangle-attention scores (``sum N_i^3`` rows) are never built for it.
    """

    __slots__ = ("_gid", "n_groups", "_counts", "out_host_sizes", "_local", "empty_group_sample", "source",
                 "cache", "_lazy")

    def __init__(self, gid: Tensor | None, n_groups: int, counts: Tensor | None, out_host_sizes: Tensor | None,
                 local: tuple[Tensor, ...] | None, empty_group_sample: int, source: tuple = (),
                 lazy: Callable[[], tuple] | None = None) -> None:
        self._gid, self._counts, self._local, self._lazy = gid, counts, local, lazy
        self.n_groups = n_groups  # python int (host metadata)
        self.out_host_sizes = out_host_sizes  # (B, D) sizes with reduced dims set to 1 (host) or None when dense
        self.empty_group_sample = empty_group_sample  # first sample holding an empty group, or -1
        # (sizes, offsets, ragged, reduced) on the values' device: what kernels build their plan from
        self.source = source
        self.cache: dict = {}

    def _fill(self) -> None:
        self._gid, self._counts, self._local = self._lazy()  # type: ignore[misc]
        self._lazy = None

    @property
    def gid(self) -> Tensor:
        if self._lazy is not None:
            self._fill()
        return self._gid  # type: ignore[return-value]

    @property
    def counts(self) -> Tensor:
        if self._lazy is not None:
            self._fill()
        return self._counts  # type: ignore[return-value]

    @property
    def local(self) -> tuple[Tensor, ...]:
        if self._lazy is not None:
            self._fill()
        return self._local  # type: ignore[return-value]

    def plan(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Strided-run plan ``(start, count, stride)`` per group for the segment kernels
        (None when the reduced dims are not consecutive); built on first use, then cached."""
        if "plan" not in self.cache:
            from padless.ops.kernels.segment import strided_plan

            sizes, offsets, ragged, reduced = self.source
            self.cache["plan"] = strided_plan(sizes, offsets, ragged, reduced, self.n_groups)
        return self.cache["plan"]

    def runs(self) -> list[tuple[int, int, int]] | None:
        """Per sample ``(first row, end row, count)`` when every group is ``count`` consecutive
        rows (one ragged dim reduced, the last in storage order, host metadata on the CPU),
        else None: then a sample's rows view as ``(groups, count, *static)`` and a dense op
        along dim 1 reduces every group of the sample at once. Host data, cached."""
        if "runs" not in self.cache:
            self.cache["runs"] = None
            if not self.source:  # groups built without their source (e.g. by the Collator's workers)
                return None
            sizes, offsets, ragged, reduced = self.source
            ok = (len(reduced) == 1 and ragged and ragged[-1] == reduced[0] and sizes.device.type == "cpu"
                  and not _is_traced(sizes))
            if ok:
                bounds, counts = offsets.tolist(), sizes[:, reduced[0]].tolist()
                self.cache["runs"] = [(bounds[i], bounds[i + 1], c) for i, c in enumerate(counts)]
        return self.cache["runs"]


def groups(nt: NestedTensor, reduced: Sequence[int]) -> Groups:
    """Group rows for a reduction over ragged sample dims ``reduced`` (cached per structure)."""
    reduced = tuple(sorted(reduced))
    traced = _is_traced(nt._values)
    if traced:  # a compiled pair state: groups from the carried maps (padless.ops.common.carried)
        from padless.ops.common.carried import traced_group_count, traced_pair_groups

        tg = traced_pair_groups(nt, reduced)
        if tg is not None:
            return Groups(*tg)
    obj_key = ("groups_obj", reduced, nt._values.device)
    if not traced:
        hit = nt._meta.derived.get(obj_key)
        if hit is not None:
            return hit
    keep = tuple(d for d in nt._ragged if d not in reduced)
    total = nt._values.shape[0]
    # Under tracing, the group count of one of several ragged dims reduced is a carried size.
    carried = traced_group_count(nt, reduced) if traced else None

    ragged = nt._ragged

    def compute(sizes: Tensor, offsets: Tensor):
        return _group_maps(sizes, offsets, ragged, keep, reduced, total, carried)

    hs = nt._meta.host_sizes
    gid = counts = local = None
    lazy = None
    if hs is not None and not traced:  # the maps wait for a reader, holding no structure object
        lazy = _lazy_maps(hs, nt.host_offsets(), ragged, keep, reduced, total, nt._values.device,
                          (("groups", reduced), nt._values.device, content.structure_key(nt)))
    else:
        gid, _, counts, local = derived_tensor(nt, ("groups", reduced), compute)
    out_hs = None
    if keep and hs is not None:
        out_hs = hs.clone()
        out_hs[:, list(reduced)] = 1
    if not keep:
        n_groups = nt.batch_size  # one group per sample (symbolic under torch.compile)
    elif hs is not None:
        n_groups = int(layout.row_counts(hs, keep).sum())
    elif carried is not None:
        n_groups = carried  # a symbolic size carried into the graph (padless.ops.common.carried)
    else:  # no host metadata: the group count is data (one device read; a graph break when compiled)
        n_groups = int(derived_tensor(nt, ("groups", reduced), compute)[1].cpu()[0])
    if hs is not None:
        empty_sample = _first_empty(hs, keep, reduced)
    elif _is_traced(nt._values):
        empty_sample = -1  # sizes are runtime data while tracing: no check (empty groups give NaN/-inf)
    else:
        empty_sample = _first_empty(nt.host_sizes(), keep, reduced)
    g = Groups(gid, n_groups, counts, out_hs, local, empty_sample, (nt._sizes, nt._offsets, nt._ragged, reduced),
               lazy=lazy)
    if not traced:
        nt._meta.derived[obj_key] = g
    return g


def _group_maps(sizes: Tensor, offsets: Tensor, ragged: tuple[int, ...], keep: tuple[int, ...],
                reduced: tuple[int, ...], total, carried) -> tuple:
    """Per row its group (``gid``), the group count as a one-element tensor, rows per group,
    and per reduced dim the row's coordinate along it."""
    sid, coords = layout.row_coords(sizes, offsets, ragged, total)
    by_dim = dict(zip(ragged, coords))
    if keep:
        out_counts = sizes[:, list(keep)].prod(1)
    else:
        out_counts = torch.ones(sizes.shape[0], dtype=torch.int64, device=sizes.device)
    out_offsets = layout.offsets_from_counts(out_counts)
    local = torch.zeros_like(sid)
    for d in keep:
        local = local * sizes[:, d].index_select(0, sid) + by_dim[d]
    gid = out_offsets[:-1].index_select(0, sid) + local
    per_group = sizes[:, list(reduced)].prod(1) if reduced else torch.ones_like(out_counts)
    counts = torch.repeat_interleave(per_group, out_counts, output_size=carried) if keep else per_group
    return gid, out_offsets[-1:], counts, tuple(by_dim[d] for d in reduced)


def _lazy_maps(hs: Tensor, ho: Tensor, ragged, keep, reduced, total: int, dev, ckey: tuple) -> Callable[[], tuple]:
    """The group maps of host sizes ``hs`` and offsets ``ho``, built on the first call (shared by
    content, as :func:`padless.ops.common.structure.derived_tensor` shares them)."""

    def maps() -> tuple:
        gid, _, counts, local = content.get_or_build(
            ckey, lambda: _to_device(_group_maps(hs, ho, ragged, keep, reduced, total, None), dev))
        return gid, counts, local

    return maps


def _first_empty(hs: Tensor, keep: tuple[int, ...], reduced: tuple[int, ...]) -> int:
    """First sample with extent 0 along a reduced dim. As in torch, this counts even when the
    result is empty too (``torch.empty(0, 0).amax(0)`` raises): the reduced dim is what matters."""
    bad = (hs[:, list(reduced)] == 0).any(1).nonzero()
    return int(bad[0, 0]) if bad.numel() else -1


def finish(
    nt: NestedTensor,
    reduced_values: Tensor,
    reduced: Sequence[int],
    static_reduced: Sequence[int],
    keepdim: bool,
    g: Groups | None = None,
) -> Tensor:
    """Wrap group rows ``(G, *static kept)`` as the reduction's result (see module rule).

    ``reduced``: ragged sample dims reduced; ``static_reduced``: static sample dims reduced
    (already reduced in ``reduced_values``, with keepdim applied or not).
    """
    reduced = tuple(sorted(reduced))
    keep = tuple(d for d in nt._ragged if d not in reduced)
    ndim = nt.sample_dim
    if not keep:
        # Dense (B, ...): reduced_values rows are samples.
        out = reduced_values
        if keepdim:
            shape = [out.shape[0]]
            it = iter(out.shape[1:])
            for d in range(ndim):
                shape.append(1 if d in nt._ragged else next(it))
            out = out.reshape(shape)
        return out
    if keepdim:
        new_dims = list(range(ndim))
        new_ragged = keep
        static_new = [d for d in range(ndim) if d not in keep]
    else:
        gone = set(reduced) | set(static_reduced)
        new_dims = [d for d in range(ndim) if d not in gone]
        remap = {d: i for i, d in enumerate(new_dims)}
        new_ragged = tuple(remap[d] for d in keep)
        static_new = [d for d in new_dims if d not in keep]
    # Values of a keepdim result hold the reduced ragged dims as static extents of 1.
    vals = reduced_values
    if keepdim:
        for pos, d in enumerate(static_new):
            if d in reduced:
                vals = vals.unsqueeze(1 + pos)
    hs = g.out_host_sizes if g is not None else None
    env_old = nt._env
    sizes_dev = nt._sizes
    if not keepdim:
        cols = new_dims
        if hs is not None:
            hs = hs[:, cols]
        sizes_dev = nt._sizes[:, cols]
        env = [env_old[d] for d in cols]
    else:
        sizes_dev = sizes_dev.clone()
        sizes_dev[:, list(reduced)] = 1
        env = [1 if d in reduced else env_old[d] for d in range(ndim)]
    if keepdim:
        for d in static_reduced:
            env[d] = 1
            if hs is not None:
                hs[:, d] = 1
            sizes_dev[:, d] = 1
    key = ("reduced", tuple(reduced), tuple(static_reduced), keepdim)
    return build_nested(vals, nt, hs, sizes_dev, new_ragged, env, cache_key=key)


def segment_sum(values: Tensor, g: Groups) -> Tensor:
    """Sum per group (Triton kernel or its ``index_add`` twin: :mod:`padless.ops.kernels.segment`;
    few large samples on the CPU: a dense sum per sample on a view of its rows)."""
    out = _per_sample(values, g, "sum")
    return out if out is not None else kernel_segment.segment_reduce(values, g, "sum")


def segment_mean(values: Tensor, g: Groups) -> Tensor:
    """Mean per group (as :func:`segment_sum`; an empty group gives nan, as torch's mean)."""
    out = _per_sample(values, g, "mean")
    return out if out is not None else kernel_segment.segment_reduce(values, g, "mean")


def _per_sample(values: Tensor, g: Groups, mode: str) -> Tensor | None:
    """Sum or mean per group, sample by sample on views (:mod:`padless.ops.common.sample_views`):
    a sample's rows view as its ragged extents (storage order) times the static dims, reduced
    over the positions of the reduced dims; groups come out sample-major, the kept ragged dims
    row-major in storage order, as ``gid`` numbers them. None where it does not pay."""
    if not g.source or _is_traced(values):
        return None
    sizes, offsets, ragged, reduced = g.source
    if sizes.device.type != "cpu" or not sample_views.pays(sizes.shape[0], values.shape[0], values.device):
        return None
    hs, ho = sizes.tolist(), offsets.tolist()
    red = [j for j, d in enumerate(ragged) if d in reduced]
    static = list(values.shape[1:])
    parts = []
    for i, row in enumerate(hs):
        ext = [row[d] for d in ragged]
        kept = [e for j, e in enumerate(ext) if j not in red]
        if 0 in kept:
            continue
        v = values[ho[i] : ho[i + 1]].reshape(ext + static)
        r = v.sum(dim=red) if mode == "sum" else v.mean(dim=red)
        parts.append(r.reshape(math.prod(kept), *static))
    out = torch.cat(parts) if parts else values[:0]  # no group: still on the autograd graph
    if out.shape[0] != g.n_groups:
        raise RuntimeError(f"padless internal: per-sample {mode} gave {out.shape[0]} groups, expected {g.n_groups}")
    return out


def segment_extreme(values: Tensor, g: Groups, mode: str) -> Tensor:
    """``mode`` is "amax" or "amin"; ties share the gradient evenly (as torch.amax)."""
    return kernel_segment.segment_reduce(values, g, mode)


def gather_rows(per_group: Tensor, g: Groups) -> Tensor:
    """Broadcast a per-group tensor back to rows."""
    return per_group.index_select(0, g.gid)


def counts_like(g: Groups, values: Tensor) -> Tensor:
    return g.counts.to(values.dtype if values.is_floating_point() else torch.float32).view(
        -1, *([1] * (values.dim() - 1))
    )
