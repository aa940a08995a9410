"""Index arithmetic of the packed layout.

A batch of B samples of rank D is stored as one ``values`` tensor ``(T, *static)``.
Sample i holds ``prod(sizes[i, r] for r in ragged)`` rows starting at
``offsets[i]``; its rows enumerate the ragged dims in *storage order*
(row-major over ``ragged``), and each row holds the static dims in sample order.

Every function here is written with tensor ops only (no ``.item()``), so the same
code builds host metadata in eager mode and traces under ``torch.compile``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.tensor.lru import LRU, MiB


def storage_order(ndim: int, ragged: Sequence[int]) -> tuple[int, ...]:
    """Sample dims in storage order: the ragged dims (as stored), then the static ones."""
    rs = tuple(ragged)
    return rs + tuple(d for d in range(ndim) if d not in rs)


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``order``: storage order back to sample dim order."""
    inv = [0] * len(order)
    for i, p in enumerate(order):
        inv[p] = i
    return inv


def sample_view(rows: Tensor, shape: Sequence[int], order: Sequence[int]) -> Tensor:
    """One sample's rows ``(R, *static)``, stored in ``order``, viewed with its dense
    ``shape`` (sample dim order)."""
    t = rows.reshape([int(shape[d]) for d in order])
    if tuple(order) != tuple(range(len(order))):
        t = t.permute(inverse_order(order))
    return t


def static_dims(ndim: int, ragged: Sequence[int]) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d not in ragged)


def row_counts(sizes: Tensor, ragged: Sequence[int]) -> Tensor:
    """Rows per sample: the product of each sample's ragged extents (int64, ``(B,)``)."""
    if len(ragged) == 0:
        return torch.ones(sizes.shape[0], dtype=torch.int64, device=sizes.device)
    return sizes[:, list(ragged)].prod(dim=1)


def offsets_from_counts(counts: Tensor) -> Tensor:
    out = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def row_sample_ids(offsets: Tensor, total: int | torch.SymInt) -> Tensor:
    """Sample index of every row, ``(T,)`` int64, without a host sync."""
    counts = offsets[1:] - offsets[:-1]
    b = counts.shape[0]
    return torch.repeat_interleave(
        torch.arange(b, device=offsets.device), counts, output_size=total
    )


# Row coordinates of host metadata, by content: every structure derived from a batch (a linear
# or a transpose of it, the attention scores of each layer, their gradients) has its own
# metadata objects but the same ragged extents, and its broadcast plans, reductions and padded
# reads all start from these coordinates. Keyed by the ragged extents themselves (a few bytes),
# so a new structure with the same rows costs a lookup instead of a division and a remainder
# per ragged dim over every row. Results are shared: callers never write them in place.
_COORDS = LRU("row_coords", max_entries=256, max_bytes=128 * MiB,
              what="per row: sample id and ragged coordinates, by the ragged extents and offsets (host bytes)")


def _coords_key(sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total) -> tuple | None:
    if not _host(sizes, offsets) or not isinstance(total, int) or not ragged:
        return None  # traced, on a device (reading it would sync), or nothing to cache
    ext = sizes[:, list(ragged)]
    return (ext.numpy().tobytes(), tuple(ext.shape), str(ext.dtype), offsets.numpy().tobytes(), total)


def row_coords(
    sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total: int | torch.SymInt
) -> tuple[Tensor, list[Tensor]]:
    """Per row: its sample id and its coordinate along each ragged dim (storage order).

    For host metadata the result is cached by content (the row-coordinate cache: at most 256
    distinct batches' rows and 128 MiB, least recently used first) and shared between callers,
    who must not write it in place."""
    key = _coords_key(sizes, offsets, ragged, total)
    if key is not None:
        hit = _COORDS.get(key)
        if hit is not None:
            return hit[0], list(hit[1])
    sid, coords = _row_coords(sizes, offsets, ragged, total)
    if key is not None:
        _COORDS.put(key, (sid, tuple(coords)))
    return sid, coords


# Host metadata with many rows per sample (pair states, triangle scores, images) builds its maps
# sample by sample: each coordinate is an ``arange`` broadcast over the sample's grid (one copy
# per row) instead of a division and a remainder per ragged dim over every row (about a third
# of the passes, and no integer division). Below this many rows per sample the per-sample
# calls cost more than they save.
PER_SAMPLE_ROWS = 2048


def _host(*ts: Tensor) -> bool:
    return all(type(t) is Tensor and t.device.type == "cpu" for t in ts)


def _per_sample_grids(sizes: Tensor, ragged: Sequence[int], total) -> list[list[int]] | None:
    """Every sample's extents along ``ragged`` (storage order) when the per-sample build pays."""
    if not ragged or not isinstance(total, int) or total < PER_SAMPLE_ROWS * max(1, sizes.shape[0]):
        return None
    return sizes[:, list(ragged)].tolist()


def _row_coords(
    sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total: int | torch.SymInt
) -> tuple[Tensor, list[Tensor]]:
    grids = _per_sample_grids(sizes, ragged, total) if _host(sizes, offsets) else None
    if grids is not None:
        return _row_coords_per_sample(offsets, grids, total)
    sid = row_sample_ids(offsets, total)
    local = torch.arange(total, device=offsets.device) - offsets[:-1].index_select(0, sid)
    coords: list[Tensor] = []
    for d in reversed(tuple(ragged)):
        n = sizes[:, d].index_select(0, sid)
        coords.append(torch.remainder(local, n.clamp_min(1)))
        local = torch.div(local, n.clamp_min(1), rounding_mode="floor")
    coords.reverse()
    return sid, coords


def _row_coords_per_sample(offsets: Tensor, grids: list[list[int]], total: int) -> tuple[Tensor, list[Tensor]]:
    """:func:`_row_coords` on host metadata, sample by sample (see :data:`PER_SAMPLE_ROWS`)."""
    k = len(grids[0])
    sid = row_sample_ids(offsets, total)
    coords = []
    for j in range(k):
        parts = []
        for ext in grids:
            if 0 in ext:
                continue
            shape = [1] * k
            shape[j] = ext[j]
            parts.append(torch.arange(ext[j]).view(shape).expand(ext).reshape(-1))
        coords.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    return sid, coords


def broadcast_rows(
    out_sizes: Tensor,
    out_offsets: Tensor,
    out_ragged: Sequence[int],
    src_sizes: Tensor,
    src_offsets: Tensor,
    src_ragged: Sequence[int],
    total: int,
) -> Tensor:
    """For every row of the layout ``(out_sizes, out_offsets, out_ragged)``, the row of the
    source layout holding its element (a source extent of 1 broadcasts: coordinate 0).

    The same as :func:`source_rows` on :func:`row_coords` of the output; host metadata with
    many rows per sample is built sample by sample (an offset plus one broadcast ``arange``
    term per source ragged dim)."""
    grids = _per_sample_grids(out_sizes, out_ragged, total) if _host(out_sizes, out_offsets, src_sizes, src_offsets) else None
    if grids is None:
        sid, coords = row_coords(out_sizes, out_offsets, out_ragged, total)
        return source_rows(sid, dict(zip(out_ragged, coords)), src_sizes, src_offsets, src_ragged)
    pos = {d: j for j, d in enumerate(out_ragged)}
    k = len(out_ragged)
    src_ext = src_sizes[:, list(src_ragged)].tolist()
    starts = src_offsets[:-1].tolist()
    parts = []
    for i, ext in enumerate(grids):
        if 0 in ext:
            continue
        acc = torch.full([1] * k, starts[i], dtype=torch.int64)
        stride = 1
        for d, e in zip(reversed(tuple(src_ragged)), reversed(src_ext[i])):
            j = pos[d]
            shape = [1] * k
            shape[j] = ext[j]
            acc = acc + (torch.arange(ext[j]).clamp_(max=max(e - 1, 0)) * stride).view(shape)
            stride *= e
        parts.append(acc.expand(ext).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def padded_row_index(
    sizes: Tensor,
    offsets: Tensor,
    ragged: Sequence[int],
    total: int | torch.SymInt,
    envelope: Sequence[int | torch.SymInt],
) -> Tensor:
    """Flat index of every packed row inside the padded ``(B, *envelope[ragged])`` grid.

    ``envelope`` holds the padded extent of every sample dim (sample order).
    """
    sid, coords = row_coords(sizes, offsets, ragged, total)
    flat = sid
    for d, c in zip(ragged, coords):
        flat = flat * envelope[d] + c
    return flat


def partitions(sizes: Tensor, ragged: Sequence[int]) -> tuple[Tensor, ...]:
    """Row splits per ragged level (storage order), like nested row splits.

    For samples ``(N_i, M_i, C)`` with ragged ``(0, 1)``: level 0 has ``B + 1``
    entries (cumsum of ``N_i``), level 1 has ``1 + sum(N_i)`` entries, each group
    holding ``M_i`` rows. The last level splits rows of ``values``.
    """
    # The group count at level l is sum_i prod_{j<l} n_{i,j}.
    groups_per_sample = torch.ones(sizes.shape[0], dtype=torch.int64, device=sizes.device)
    out = []
    for d in ragged:
        n = sizes[:, d]
        per_group = torch.repeat_interleave(n, groups_per_sample)
        out.append(offsets_from_counts(per_group))
        groups_per_sample = groups_per_sample * n
    return tuple(out)


def source_rows(
    sid: Tensor,
    coord: dict[int, Tensor],
    src_sizes: Tensor,
    src_offsets: Tensor,
    src_ragged: Sequence[int],
) -> Tensor:
    """For target rows given by (sample id, coordinate per ragged dim), the source row holding
    that element in a layout with storage order ``src_ragged``; a source extent of 1
    broadcasts (coordinate 0)."""
    idx = src_offsets[:-1].index_select(0, sid)
    stride = torch.ones_like(sid)
    for d in reversed(tuple(src_ragged)):
        ext = src_sizes[:, d].index_select(0, sid)
        idx = idx + torch.minimum(coord[d], (ext - 1).clamp_min(0)) * stride
        stride = stride * ext
    return idx


def relayout_rows(
    sizes: Tensor, offsets: Tensor, src_ragged: Sequence[int], dst_ragged: Sequence[int], total: int
) -> tuple[Tensor, Tensor]:
    """Rows of the same samples stored in order ``dst_ragged`` instead of ``src_ragged``.

    Returns ``(dst_offsets, index)`` with ``dst_values = src_values[index]``.
    """
    dst_offsets = offsets  # same samples, same row counts
    return dst_offsets, broadcast_rows(sizes, dst_offsets, dst_ragged, sizes, offsets, src_ragged, total)
