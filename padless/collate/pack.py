"""Field plans: how the samples of one field become tensors in the batch's arena.

Collation runs in two passes. Planning reads every sample's shape and dtype,
validates them (errors name the field, the sample and the shapes), computes the
host metadata and reserves arena space; building allocates one buffer per dtype
(:mod:`padless.collate.arena`) and writes each field into its views with one copy
of the sample data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.collate import metadata as md
from padless.collate.arena import Arena, Slot
from padless.collate.opcache import install
from padless.collate.samples import field_label, fmt_shape, to_tensor
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta, envelope_from_sizes, mark_dynamic


class FieldPlan:
    """A planned field: ``reserve`` arena space, then ``build`` the value from the arena."""

    def reserve(self, arena: Arena) -> None:
        pass

    def build(self, arena: Arena) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """What a ragged field precomputes (see :class:`padless.collate.Field`)."""

    row_maps: bool = False
    padded_index: bool = False
    pad_to_multiple: int | None = None
    pad_value: float = 0.0


class Placer:
    """Reserves arena space for tensors computed while planning and copies them in when building.

    Tensors of one dtype and residency share one slot, filled by one ``torch.cat``. A
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
            flat = arena.view(slot, (slot.numel,))
            torch.cat([t.reshape(-1) for t in ts], out=flat)
            pos = 0
            for t in ts:
                n = t.numel()
                self._views[id(t)] = flat[pos : pos + n].view(t.shape)
                pos += n

    def get(self, t: Tensor) -> Tensor:
        """The arena view of a placed tensor (after :meth:`build`)."""
        return self._views[id(t)]


# ---------------------------------------------------------------------------- validation


def as_tensors(path: str, samples: Sequence[Any]) -> list[Tensor]:
    """Tensors of a tensor field; a None or a non-array sample is an error naming it."""
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
                "every sample of a tensor field needs a tensor, numpy array or PIL image"
            ) from None
    return out


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
    for i, t in enumerate(ts):
        if t.dtype != d0:
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} has dtype {t.dtype} "
                f"(shape {fmt_shape(t.shape)}), sample 0 has {d0} (shape {fmt_shape(ts[0].shape)}); "
                f"declare a cast, e.g. Collator(fields={{{path!r}: Field(dtype={d0})}}), or fix sample {i}"
            )
    return d0


def check_static(path: str, ts: Sequence[Tensor], ragged: Sequence[int]) -> None:
    """Every non-ragged dim must agree with sample 0."""
    s0 = tuple(ts[0].shape)
    for i, t in enumerate(ts):
        for d in range(len(s0)):
            if d not in ragged and t.shape[d] != s0[d]:
                fix = tuple(sorted({*ragged, d}))
                raise ValueError(
                    f"collate(): field {field_label(path)}: sample {i} has shape {fmt_shape(t.shape)}, "
                    f"sample 0 has {fmt_shape(s0)}: dim {d} differs but is static (ragged={tuple(ragged)}); "
                    f"declare it ragged (Field(ragged={fix})) or fix sample {i}"
                )


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
        return out.copy_(self.t)


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

    ``ragged`` are sample dims (sorted); rows enumerate them in that order.
    """

    def __init__(self, path: str, ts: list[Tensor], ragged: tuple[int, ...], dtype: torch.dtype, opts: PackOptions):
        self.path, self.ts, self.ragged, self.dtype = path, ts, ragged, dtype
        ndim = ts[0].dim()
        self.order = layout.storage_order(ndim, ragged)
        self.static = [int(ts[0].shape[d]) for d in layout.static_dims(ndim, ragged)]
        shapes = [tuple(t.shape) for t in ts]
        if opts.pad_to_multiple is not None:
            real = sum(math.prod(s[d] for d in ragged) for s in shapes)
            pad = (-real) % opts.pad_to_multiple
            dummy = [1 if d in ragged else shapes[0][d] for d in range(ndim)]
            dummy[ragged[0]] = pad
            shapes.append(tuple(dummy))
        sizes = torch.tensor(shapes, dtype=torch.int64).reshape(len(shapes), ndim)
        self.opts = opts
        self.host_sizes = sizes
        self.host_offsets = layout.offsets_from_counts(layout.row_counts(sizes, ragged))
        self.total = int(self.host_offsets[-1])
        self.pad_rows = self.total - int(self.host_offsets[len(ts)]) if opts.pad_to_multiple is not None else 0
        self.real_rows = self.total - self.pad_rows
        self.same_dtype = all(t.dtype == dtype for t in ts)
        self.env = envelope_from_sizes(sizes, ragged, self.static)
        parts = md.partitions(sizes, ragged) if len(ragged) > 1 else (self.host_offsets,)
        rows = md.row_maps(sizes, self.host_offsets, ragged, self.total) if opts.row_maps else None
        padded = None
        if opts.padded_index:
            full = rows if rows is not None else md.row_maps(sizes, self.host_offsets, ragged, self.total)
            padded = md.padded_index(full, ragged, self.env)
        self.meta = md.FieldMeta(
            self.host_offsets.to(torch.int32), parts, rows, None, padded, opts.pad_to_multiple is not None
        )
        self.placer = Placer()

    def reserve(self, arena: Arena) -> None:
        self.v_slot = arena.reserve(self.dtype, self.total * math.prod(self.static))
        self.placer.add(self.host_offsets, False)
        self.placer.add(self.host_sizes, False)
        for t, host in md.iter_tensors(self.meta):
            self.placer.add(t, host)
        self.placer.reserve(arena)

    def build(self, arena: Arena) -> NestedTensor:
        values = arena.view(self.v_slot, (self.total, *self.static))
        self._fill(values)
        p = self.placer
        p.build(arena)
        off, sizes = p.get(self.host_offsets), p.get(self.host_sizes)
        fm = md.map_tensors(self.meta, lambda t, host: p.get(t))
        nt = mark_dynamic(NestedTensor(values, off, sizes, self.ragged, self.env, StructureMeta(sizes, off)))
        install(nt, fm)
        return nt

    def _fill(self, values: Tensor) -> None:
        identity = self.order == tuple(range(len(self.order)))
        with torch.no_grad():
            if identity and self.same_dtype:
                parts = self.ts if len(self.ragged) == 1 else [t.reshape(-1, *self.static) for t in self.ts]
                torch.cat(parts, 0, out=values[: self.real_rows])
            else:
                ho = self.host_offsets.tolist()
                for i, t in enumerate(self.ts):
                    stored = [t.shape[d] for d in self.order]
                    values[ho[i] : ho[i + 1]].view(stored).copy_(t.permute(self.order))
            if self.pad_rows:
                values[self.real_rows :].fill_(self.opts.pad_value)
