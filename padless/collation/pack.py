"""Field plans: how the samples of one field become tensors in the batch's arena.

Collation runs in two passes. Planning reads every sample's shape and dtype,
validates them (errors name the field, the sample and the shapes), computes the
host metadata and reserves arena space; building allocates one buffer per dtype
(:mod:`padless.collation.arena`) and writes each field into its views with one copy
of the sample data.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.collation import metadata as md
from padless.collation.arena import Arena, Slot
from padless.collation.opcache import install
from padless.collation.samples import field_label, fmt_shape, lists_to_tensors, to_tensor
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta


class FieldPlan:
    """A planned field: ``reserve`` arena space, then ``build`` the value from the arena."""

    def reserve(self, arena: Arena) -> None:
        pass

    def build(self, arena: Arena) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """What a ragged field precomputes (see :class:`padless.collation.Field`)."""

    row_maps: bool = False
    padded_index: bool = False
    pad_to_multiple: int | None = None
    pad_value: float = 0.0


class Placer:
    """Reserves arena space for tensors computed while planning and copies them in when building.

    Tensors of one dtype and residency share one slot, written through numpy. A
    tensor added both device-bound and host-only is stored once, device-bound: the
    host leaf is then the same CPU view (a move copies it along; it is tiny metadata).
    """

    def __init__(self) -> None:
        self._host: dict[int, bool] = {}
        self._items: dict[int, Tensor] = {}
        self._views: dict[int, Tensor] = {}
        self._groups: dict[tuple[torch.dtype, bool], tuple[list[Tensor], Slot]] = {}

    def add(self, t: Tensor, host: bool) -> None:
        key = id(t)
        self._items[key] = t
        self._host[key] = self._host.get(key, True) and host

    def reserve(self, arena: Arena) -> None:
        groups: dict[tuple[torch.dtype, bool], list[Tensor]] = {}
        for key, t in self._items.items():
            groups.setdefault((t.dtype, self._host[key]), []).append(t)
        for (dtype, host), ts in groups.items():
            self._groups[(dtype, host)] = (ts, arena.reserve(dtype, sum(t.numel() for t in ts), host=host))

    def build(self, arena: Arena) -> None:
        for (dtype, host), (ts, slot) in self._groups.items():
            flat = arena.numpy(slot)
            pos = 0
            for t in ts:
                n = t.numel()
                flat[pos : pos + n] = t.numpy().reshape(-1)
                self._views[id(t)] = arena.view(slot, t.shape, pos)
                pos += n

    def get(self, t: Tensor) -> Tensor:
        """The arena view of a placed tensor (after :meth:`build`)."""
        return self._views[id(t)]


# ---------------------------------------------------------------------------- validation


def as_tensors(path: str, samples: Sequence[Any]) -> list[Tensor]:
    """Tensors of a tensor field; a None or a non-array sample is an error naming it.

    Tensors pass as they are, numpy arrays and PIL images become tensor views, and
    Python lists of numbers (tokenizer output) become tensors.
    """
    if all(type(x) is Tensor for x in samples):
        return list(samples)
    if any(type(x) is list for x in samples):
        samples = lists_to_tensors(path, samples)
    out = []
    for i, x in enumerate(samples):
        if type(x) is Tensor:
            out.append(x)
            continue
        if x is None:
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} is None, other samples hold tensors; "
                "drop or fill that sample in the dataset (nothing is padded or dropped silently)"
            )
        try:
            out.append(to_tensor(x, path, i))
        except TypeError:
            if isinstance(x, Tensor):
                raise
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} is a {type(x).__name__}, not a tensor; "
                "every sample of a tensor field needs a tensor, numpy array, PIL image or list of numbers"
            ) from None
    return out


def shape_table(path: str, ts: Sequence[Tensor]) -> np.ndarray:
    """Every sample's shape as an int64 ``(B, D)`` array; samples of differing rank are an error."""
    ranks = {t.dim() for t in ts}
    if len(ranks) != 1:
        check_rank(path, ts)
    nd = ranks.pop()
    if nd == 1:  # token sequences: a 1-D tensor's numel is its length (the cheapest tensor call)
        return np.array([t.numel() for t in ts], dtype=np.int64).reshape(len(ts), 1)
    flat = np.fromiter(itertools.chain.from_iterable([t.shape for t in ts]), dtype=np.int64, count=len(ts) * nd)
    return flat.reshape(len(ts), nd)


def check_rank(path: str, ts: Sequence[Tensor]) -> None:
    s0 = tuple(ts[0].shape)
    nd = len(s0)
    if all(t.dim() == nd for t in ts):
        return
    for i, t in enumerate(ts):
        if t.dim() != nd:
            raise ValueError(
                f"collate(): field {field_label(path)}: sample {i} has shape {fmt_shape(t.shape)} "
                f"(rank {t.dim()}), sample 0 has shape {fmt_shape(s0)} (rank {len(s0)}); "
                "every sample of a field needs one rank"
            )


def common_dtype(path: str, ts: Sequence[Tensor], cast: torch.dtype | None) -> torch.dtype:
    if cast is not None:
        return cast
    d0 = ts[0].dtype
    if len({t.dtype for t in ts}) == 1:
        return d0
    for i, t in enumerate(ts):
        if t.dtype != d0:
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} has dtype {t.dtype} "
                f"(shape {fmt_shape(t.shape)}), sample 0 has {d0} (shape {fmt_shape(ts[0].shape)}); "
                f"declare a cast, e.g. Collator(fields={{{path!r}: Field(dtype={d0})}}), or fix sample {i}"
            )
    return d0


def check_static(path: str, ts: Sequence[Tensor], ragged: Sequence[int], sizes: np.ndarray | None = None) -> None:
    """Every non-ragged dim must agree with sample 0."""
    if sizes is None:
        sizes = shape_table(path, ts)
    static = [d for d in range(sizes.shape[1]) if d not in ragged]
    if not static or len(ts) == 0:
        return
    bad = (sizes[:, static] != sizes[0, static]).any(1)
    if not bad.any():
        return
    i = int(np.flatnonzero(bad)[0])
    d = static[int(np.flatnonzero(sizes[i, static] != sizes[0, static])[0])]
    s0, t = tuple(ts[0].shape), ts[i]
    fix = tuple(sorted({*ragged, d}))
    raise ValueError(
        f"collate(): field {field_label(path)}: sample {i} has shape {fmt_shape(t.shape)}, "
        f"sample 0 has {fmt_shape(s0)}: dim {d} differs but is static (ragged={tuple(ragged)}); "
        f"declare it ragged (Field(ragged={fix})) or fix sample {i}"
    )


def differing_dims(sizes: np.ndarray) -> tuple[int, ...]:
    """The sample dims whose extent differs between samples (inferred ragged dims)."""
    if sizes.shape[0] == 0:
        return ()
    lo, hi = sizes.min(0).tolist(), sizes.max(0).tolist()  # two reductions: no per-dim numpy calls
    return tuple(d for d in range(len(lo)) if lo[d] != hi[d])


def rows_of(t: Tensor, order: tuple[int, ...], n_ragged: int, static: Sequence[int]) -> Tensor | None:
    """A sample as its packed rows ``(n_rows, *static)`` *without copying*, or None when its
    memory is not in row order (a ``(C, H, W)`` tensor that is contiguous as ``(C, H, W)``).

    A channels-last view (``hwc.permute(2, 0, 1)``, what image readers return) is already in
    row order: its rows are the decoder's buffer, and packing it is one memcpy.
    """
    p = t if order == tuple(range(len(order))) else t.permute(order)
    if n_ragged == 1:  # already (n_rows, *static): any strides, the copy walks them
        return p
    if p.is_contiguous():
        return p.view(-1, *static)
    return None


# ---------------------------------------------------------------------------- plans


class ObjectPlan(FieldPlan):
    """Strings and other objects: kept as a list."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = list(samples)

    def build(self, arena: Arena) -> list:
        return self.samples


class TensorPlan(FieldPlan):
    """A tensor computed while planning (numbers), copied into the arena."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def reserve(self, arena: Arena) -> None:
        self.slot = arena.reserve(self.t.dtype, self.t.numel())

    def build(self, arena: Arena) -> Tensor:
        out = arena.view(self.slot, self.t.shape)
        if self.t.dtype in _NUMPY_DTYPES:
            arena.numpy(self.slot)[:] = self.t.numpy().reshape(-1)
            return out
        return out.copy_(self.t)


_NUMPY_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                 torch.float32, torch.float16}


class StackPlan(FieldPlan):
    """Samples of one shape stacked into ``(B, *shape)``, as ``default_collate`` does."""

    def __init__(self, ts: list[Tensor], dtype: torch.dtype) -> None:
        self.ts, self.dtype = ts, dtype
        self.shape = (len(ts), *ts[0].shape)

    def reserve(self, arena: Arena) -> None:
        self.slot = arena.reserve(self.dtype, math.prod(self.shape))

    def build(self, arena: Arena) -> Tensor:
        out = arena.view(self.slot, self.shape)
        with torch.no_grad():
            if all(t.dtype == self.dtype for t in self.ts):
                torch.stack(self.ts, 0, out=out)
            else:
                for i, t in enumerate(self.ts):
                    out[i].copy_(t)
        return out


class ContainerPlan(FieldPlan):
    """A dict/list/tuple/namedtuple/dataclass of plans, rebuilt by ``make`` from built children."""

    def __init__(self, children: dict[Any, FieldPlan], make: Callable[[dict[Any, Any]], Any]) -> None:
        self.children, self.make = children, make

    def reserve(self, arena: Arena) -> None:
        for c in self.children.values():
            c.reserve(arena)

    def build(self, arena: Arena) -> Any:
        return self.make({k: c.build(arena) for k, c in self.children.items()})


class RaggedPlan(FieldPlan):
    """Samples of differing shapes packed into a NestedTensor, with their :class:`FieldMeta`.

    ``ragged`` are sample dims (sorted); rows enumerate them in that order. ``sizes`` is the
    samples' ``(B, D)`` shape table when the caller has it (from :func:`shape_table`), and
    ``same_dtype`` whether every sample already has ``dtype`` (checked here when not given).
    Host metadata is computed with numpy: a handful of microseconds per field.
    """

    def __init__(
        self,
        path: str,
        ts: list[Tensor],
        ragged: tuple[int, ...],
        dtype: torch.dtype,
        opts: PackOptions,
        sizes: np.ndarray | None = None,
        same_dtype: bool | None = None,
    ):
        self.path, self.ts, self.ragged, self.dtype = path, ts, ragged, dtype
        if sizes is None:
            sizes = shape_table(path, ts)
        ndim = sizes.shape[1]
        self.order = layout.storage_order(ndim, ragged)
        static_dims = layout.static_dims(ndim, ragged)
        self.static = [int(sizes[0, d]) for d in static_dims]
        if opts.pad_to_multiple is not None:
            real = int(_row_counts(sizes, ragged).sum())
            dummy = np.array([1 if d in ragged else sizes[0, d] for d in range(ndim)], dtype=np.int64)
            dummy[ragged[0]] = (-real) % opts.pad_to_multiple
            sizes = np.concatenate([sizes, dummy[None]])
        n = sizes.shape[0]
        counts = _row_counts(sizes, ragged)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        self.opts = opts
        self.host_sizes = torch.from_numpy(sizes)
        self.host_offsets = torch.from_numpy(offsets)
        self.total = int(offsets[-1])
        self.pad_rows = self.total - int(offsets[len(ts)]) if opts.pad_to_multiple is not None else 0
        self.real_rows = self.total - self.pad_rows
        if same_dtype is None:
            same_dtype = ts[0].dtype == dtype and len({t.dtype for t in ts}) == 1
        self.same_dtype = same_dtype
        maxes = sizes.max(0) if n else np.zeros(ndim, dtype=np.int64)
        self.env = [int(maxes[d]) if d in ragged else int(sizes[0, d]) for d in range(ndim)]
        parts = md.partitions(self.host_sizes, ragged) if len(ragged) > 1 else (self.host_offsets,)
        rows = md.row_maps(self.host_sizes, self.host_offsets, ragged, self.total) if opts.row_maps else None
        padded = None
        if opts.padded_index:
            full = rows if rows is not None else md.row_maps(self.host_sizes, self.host_offsets, ragged, self.total)
            padded = md.padded_index(full, ragged, self.env)
        cu = md.int32_offsets(offsets, path)
        self.meta = md.FieldMeta(cu, parts, rows, None, padded, opts.pad_to_multiple is not None)
        self.placer: Placer | None = None

    def reserve(self, arena: Arena) -> None:
        """Values, then ``[offsets | sizes]`` (int64) and ``cu_seqlens`` (int32) written directly;
        other metadata (partitions, row maps, pair maps) through a :class:`Placer`."""
        n_off = self.host_offsets.shape[0]
        self.v_slot = arena.reserve(self.dtype, self.total * math.prod(self.static))
        self.i_slot = arena.reserve(torch.int64, n_off + self.host_sizes.numel())
        self.c_slot = arena.reserve(torch.int32, n_off)
        m = self.meta
        core = (self.host_offsets, self.host_sizes, m.cu_seqlens)
        plain = (  # the common field: one ragged dim, nothing opted in (no walk over the metadata)
            m.rows is None and m.pair is None and m.padded_index is None and not m.spatial and m.pair_plans is None
            and len(m.partitions) == 1 and m.partitions[0] is self.host_offsets
        )
        extra = [] if plain else [(t, host) for t, host in md.iter_tensors(m) if not any(t is c for c in core)]
        self.placer = None
        if extra:
            self.placer = Placer()
            for t, host in extra:
                self.placer.add(t, host)
            self.placer.reserve(arena)

    def build(self, arena: Arena) -> NestedTensor:
        values = arena.view(self.v_slot, (self.total, *self.static))
        self._fill(values)
        n_off = self.host_offsets.shape[0]
        ints = arena.numpy(self.i_slot)
        ints[:n_off] = self.host_offsets.numpy()
        ints[n_off:] = self.host_sizes.numpy().reshape(-1)
        arena.numpy(self.c_slot)[:] = ints[:n_off]
        off = arena.view(self.i_slot, (n_off,))
        sizes = arena.view(self.i_slot, tuple(self.host_sizes.shape), n_off)
        cu = arena.view(self.c_slot, (n_off,))
        m = self.meta
        if self.placer is None:  # the common case: nothing but the core metadata
            parts = tuple(off for _ in m.partitions)  # one ragged dim: (host offsets,)
            fm = md.FieldMeta(cu, parts, None, None, None, m.dummy, m.outputs)
        else:
            p = self.placer
            p.build(arena)
            swap = {id(self.host_offsets): off, id(self.host_sizes): sizes, id(m.cu_seqlens): cu}
            fm = md.map_tensors(m, lambda t, host: swap.get(id(t)) if id(t) in swap else p.get(t))
        nt = NestedTensor(values, off, sizes, self.ragged, self.env, StructureMeta(sizes, off))  # marked dynamic there
        install(nt, fm)
        nt._lineage = arena.lineage
        return nt

    def _fill(self, values: Tensor) -> None:
        """Copy every sample into its rows: one ``torch.cat`` when every sample's memory is in
        row order (1-D ragged fields, channels-last images), else one copy per sample."""
        with torch.no_grad():
            if self.same_dtype and self.ragged == (0,):  # (L_i, *static) samples are their rows: one cat
                torch.cat(self.ts, 0, out=values if not self.pad_rows else values[: self.real_rows])
                rows = []
            elif self.same_dtype:
                nr = len(self.ragged)
                rows = [rows_of(t, self.order, nr, self.static) for t in self.ts]
                if all(r is not None for r in rows):
                    torch.cat(rows, 0, out=values[: self.real_rows])
                    rows = []
            else:
                rows = [None] * len(self.ts)
            if rows:
                ho = self.host_offsets.tolist()
                channels_first = len(self.static) == 1 and self.order[-1] == 0  # (C, H, W)-style samples
                for i, t in enumerate(self.ts):
                    r = rows[i]
                    dst = values[ho[i] : ho[i + 1]]
                    if r is not None:
                        dst.copy_(r)
                    elif channels_first and t.is_contiguous():
                        # one strided write per channel from contiguous reads: about twice as fast
                        # as copying the permuted view element by element (uint8, C=3)
                        for c in range(self.static[0]):
                            dst[:, c].copy_(t[c].reshape(-1))
                    else:
                        dst.view([t.shape[d] for d in self.order]).copy_(t.permute(self.order))
            if self.pad_rows:
                values[self.real_rows :].fill_(self.opts.pad_value)


def _row_counts(sizes: np.ndarray, ragged: tuple[int, ...]) -> np.ndarray:
    """Rows per sample: the product of its ragged extents."""
    if len(ragged) == 1:
        return sizes[:, ragged[0]]
    return sizes[:, list(ragged)].prod(1)
