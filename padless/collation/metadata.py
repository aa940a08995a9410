"""Metadata a collated field carries, computed in the worker that collates the batch.

For a field of samples ``(L_i, C)`` with ``L = 2, 0, 3``::

    values       (5, C)                         the rows
    offsets      [0, 2, 2, 5]                   int64, device and host copies
    sizes        [[2, C], [0, C], [3, C]]       int64, device and host copies
    cu_seqlens   [0, 2, 2, 5]                   int32 (flash-attention)
    row_ids      [0, 0, 2, 2, 2]                sample of every row         (RowMaps, opt-in)
    coords       ([0, 1, 0, 1, 2],)             row's index in its sample   (RowMaps, opt-in)

and for a square pair field (``Field(pair=True)``, ``L = 2, 1``) the maps that turn
``x.unsqueeze(2) + x.unsqueeze(1)`` into two row gathers::

    pair rows    (0,0) (0,1) (1,0) (1,1) | (0,0)      P = 2*2 + 1*1 = 5 rows
    rows_i       [0, 0, 1, 1, 2]                    row of x for the left operand
    rows_j       [0, 1, 0, 1, 2]                    row of x for the right operand
    offsets      [0, 4, 5]

Every tensor here is tagged device-bound (moves with the batch) or host-only
(stays on the CPU: sizes and offsets that the op layer reads as Python numbers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.errors import StructureError

HOST = {"host": True}


@dataclasses.dataclass
class RowMaps:
    """Per-row structure of a field: which sample, and where inside it."""

    row_ids: Tensor  # (T,) int64
    coords: tuple[Tensor, ...]  # per ragged dim, in storage order: (T,) int64
    counts: Tensor  # (B,) int64 rows per sample
    empty_sample: int  # first sample without rows, or -1


@dataclasses.dataclass
class PairMaps:
    """Row maps of the pair state ``(N_i, M_i, *static)`` built from a field ``(N_i, *static)``
    and its peer ``(M_i, *static)`` (the field itself for square pairs).

    Two int64 per pair row; the pair's row sample ids and coordinates are left to the
    op layer's caches (computed on first use, only by per-sample broadcasting onto the
    pair, arg-reductions and cumsum).
    """

    peer: str | None  # name of the column field; None: the field itself
    rows_i: Tensor  # (P,) int64 row of the field for every pair row
    rows_j: Tensor  # (P,) int64 row of the peer for every pair row
    counts_i: Tensor  # (T_x,) int64: M_i for every row of the field (group sizes of a mean over dim 1)
    counts_j: Tensor  # (T_y,) int64: N_i for every row of the peer (group sizes of a mean over dim 0)
    offsets: Tensor  # (B+1,) int64
    sizes: Tensor  # (B, 2 + S) int64, the pair's sample shapes
    cu_seqlens: Tensor  # (B+1,) int32
    host_offsets: Tensor = dataclasses.field(metadata=HOST)
    host_sizes: Tensor = dataclasses.field(metadata=HOST)
    host_sizes_i: Tensor = dataclasses.field(metadata=HOST)  # host_sizes with dim 1 set to 1
    host_sizes_j: Tensor = dataclasses.field(metadata=HOST)  # host_sizes with dim 0 set to 1
    empty_i: int = -1  # first sample with N_i > 0 and M_i == 0 (an empty group), or -1
    empty_j: int = -1
    owner: str | None = None  # the field these maps belong to


@dataclasses.dataclass
class SpatialMaps:
    """A first-layer spatial plan of an image field (``Field(spatial_plan=...)``), built in the
    worker by :func:`padless.ops.vision.spatial.build_spatial_plan` and carried without its caches.

    ``place``/``gather``/``take`` are the plan's index tensors (they move with the batch);
    ``host`` holds the plan's other fields (host sizes and offsets of the output, block
    shapes, rectangles): a dict, so they stay on the CPU. ``padless.collation.opcache``
    turns it back into the op layer's plan.
    """

    geometry: Any  # padless.ops.vision.spatial.Geometry
    layout: str
    place: Tensor | None
    gather: Tensor | None
    take: Tensor
    host: dict[str, Any]


@dataclasses.dataclass
class FieldMeta:
    """Everything precomputed for one ragged field (see the module docstring)."""

    cu_seqlens: Tensor  # (B+1,) int32
    partitions: tuple[Tensor, ...] = dataclasses.field(metadata=HOST)
    rows: RowMaps | None = None
    pair: PairMaps | None = None
    padded_index: Tensor | None = None  # (T,) int64 flat row index in the padded grid
    dummy: bool = False  # the last sample is the pad_to_multiple dummy segment
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> batch key ("labels", ...)
    spatial: tuple[SpatialMaps, ...] = ()  # first-layer spatial plans (Field(spatial_plan=...))
    pair_plans: Any = None  # a pair model's bucket plans (Field(pair_plans=...), padless.collation.pair_plans)


# ---------------------------------------------------------------------------- tensors of a meta


_LEAVES = (bool, int, float, str, dict, type(None))
_FIELD_TABLE: dict[type, tuple[tuple[str, bool], ...]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, bool], ...]:
    """``(name, host_only)`` of a metadata dataclass's fields, read once per class."""
    table = _FIELD_TABLE.get(cls)
    if table is None:
        table = tuple((f.name, bool(f.metadata.get("host", False))) for f in dataclasses.fields(cls))
        _FIELD_TABLE[cls] = table
    return table


def map_tensors(obj: Any, fn: Callable[[Tensor, bool], Tensor], host: bool = False) -> Any:
    """Copy of a metadata object with every tensor ``t`` replaced by ``fn(t, is_host)``."""
    if isinstance(obj, Tensor):
        return fn(obj, host)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn, host) for o in obj)
    if isinstance(obj, _LEAVES) or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    out = object.__new__(type(obj))
    state = dict(obj.__dict__)
    for name, h in _fields_of(type(obj)):
        v = state[name]
        if not isinstance(v, _LEAVES):
            state[name] = map_tensors(v, fn, host or h)
    out.__dict__.update(state)
    return out


def iter_tensors(obj: Any, host: bool = False) -> Iterator[tuple[Tensor, bool]]:
    """Every tensor of a metadata object with its residency (True: host-only)."""
    out: list[tuple[Tensor, bool]] = []
    _collect(obj, host, out)
    return iter(out)


def _collect(obj: Any, host: bool, out: list[tuple[Tensor, bool]]) -> None:
    if isinstance(obj, Tensor):
        out.append((obj, host))
    elif isinstance(obj, tuple):
        for o in obj:
            _collect(o, host, out)
    elif not isinstance(obj, _LEAVES) and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = obj.__dict__
        for name, h in _fields_of(type(obj)):
            v = d[name]
            if not isinstance(v, _LEAVES):
                _collect(v, host or h, out)


# ---------------------------------------------------------------------------- worker-side maths


INT32_MAX = 2**31 - 1


def int32_offsets(offsets: np.ndarray, field: str) -> Tensor:
    """``cu_seqlens`` (int32) from int64 row offsets; refuses a row count int32 cannot hold.

    >>> int32_offsets(np.array([0, 2, 5]), "ids").tolist()
    [0, 2, 5]
    """
    rows = int(offsets[-1]) if len(offsets) else 0
    if rows > INT32_MAX:
        raise StructureError(
            f"collate: field {field!r} has {rows} rows in this batch, more than int32 cu_seqlens hold "
            f"({INT32_MAX}); they would wrap around. Use smaller batches (the int64 offsets are exact)"
        )
    return torch.from_numpy(offsets.astype(np.int32))


def repeat_ids(counts: Tensor) -> Tensor:
    """``[0]*counts[0] + [1]*counts[1] + ...`` as int64, from host counts.

    numpy's single-threaded ``repeat`` (~15 us for 16k rows): torch's CPU
    ``repeat_interleave`` goes through the intra-op thread pool and was measured to stall
    for milliseconds when the other cores are busy (torch 2.13, 2 threads).
    """
    return torch.from_numpy(np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts.numpy()))


def row_maps(host_sizes: Tensor, host_offsets: Tensor, ragged: tuple[int, ...], total: int) -> RowMaps:
    """Sample id and per-ragged-dim coordinate of every row (host tensors); the same values as
    :func:`padless.tensor.layout.row_coords`."""
    counts = host_offsets[1:] - host_offsets[:-1]
    sid = repeat_ids(counts)
    local = torch.arange(total) - host_offsets[:-1].index_select(0, sid)
    coords: list[Tensor] = []
    for d in reversed(ragged):
        n = host_sizes[:, d].index_select(0, sid).clamp_min(1) if len(ragged) > 1 else None
        if n is None:  # one ragged dim: the coordinate is the row's index in its sample
            coords.append(local)
            break
        coords.append(torch.remainder(local, n))
        local = torch.div(local, n, rounding_mode="floor")
    coords.reverse()
    empty = (counts == 0).nonzero()
    return RowMaps(sid, tuple(coords), counts, int(empty[0, 0]) if empty.numel() else -1)


def partitions(host_sizes: Tensor, ragged: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Row splits per ragged level; the same values as :func:`padless.tensor.layout.partitions`."""
    groups = torch.ones(host_sizes.shape[0], dtype=torch.int64)
    out = []
    for d in ragged:
        n = host_sizes[:, d]
        out.append(layout.offsets_from_counts(n.index_select(0, repeat_ids(groups))))
        groups = groups * n
    return tuple(out)


def padded_index(rows: RowMaps, ragged: tuple[int, ...], envelope: list[int]) -> Tensor:
    """Flat index of every row in the padded ``(B, *envelope[ragged])`` grid (as
    :func:`padless.tensor.layout.padded_row_index`)."""
    flat = rows.row_ids
    for d, c in zip(ragged, rows.coords):
        flat = flat * envelope[d] + c
    return flat


def pair_maps(n: Tensor, m: Tensor, static: list[int], peer: str | None, owner: str | None = None) -> PairMaps:
    """Pair rows of ``(N_i, 1, *S) + (1, M_i, *S)`` from the host lengths ``n`` and ``m`` of the
    two operands (each stored as ``N_i`` / ``M_i`` rows)."""
    b = n.shape[0]
    offsets = layout.offsets_from_counts(n * m)
    # Pair rows enumerate (r, c) row-major per sample: x's row r is repeated M_i times.
    sid_x = repeat_ids(n)
    counts_i = m.index_select(0, sid_x)  # (T_x,) M_i per row of x
    rows_i = repeat_ids(counts_i)  # (P,) x's (global) row of every pair row
    block = layout.offsets_from_counts(counts_i)[:-1]  # first pair row of each x row
    off_y = layout.offsets_from_counts(m)
    shift = off_y[:-1].index_select(0, sid_x) - block
    rows_j = torch.arange(offsets[-1].item()) + shift.index_select(0, rows_i)
    sizes = torch.empty(b, 2 + len(static), dtype=torch.int64)
    sizes[:, 0], sizes[:, 1] = n, m
    if static:
        sizes[:, 2:] = torch.tensor(static, dtype=torch.int64)
    si, sj = sizes.clone(), sizes.clone()
    si[:, 1] = 1
    sj[:, 0] = 1
    bad_i = ((m == 0) & (n > 0)).nonzero()
    bad_j = ((n == 0) & (m > 0)).nonzero()
    return PairMaps(
        peer=peer,
        rows_i=rows_i,
        rows_j=rows_j,
        counts_i=counts_i,
        counts_j=n.index_select(0, repeat_ids(m)),
        offsets=offsets,
        sizes=sizes,
        cu_seqlens=offsets.to(torch.int32),
        host_offsets=offsets,
        host_sizes=sizes,
        host_sizes_i=si,
        host_sizes_j=sj,
        empty_i=int(bad_i[0, 0]) if bad_i.numel() else -1,
        empty_j=int(bad_j[0, 0]) if bad_j.numel() else -1,
        owner=owner,
    )
