"""Index arithmetic of the packed layout.

A batch of B samples of rank D is stored as one ``values`` tensor ``(T, *static)``.
Sample i holds ``prod(sizes[i, r] for r in ragged)`` rows starting at
``offsets[i]``; its rows enumerate the ragged dims in *storage order*
(row-major over ``ragged``), and each row holds the static dims in sample order.

Every function here is written with tensor ops only (no ``.item()``), so the same
code builds host metadata in eager mode and traces under ``torch.compile``.
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch
from torch import Tensor


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
_COORDS: collections.OrderedDict = collections.OrderedDict()
COORDS_CACHE_ELEMENTS = 1 << 24  # host int64 elements held, all entries together (128 MiB)
_coords_elements = [0]


def _coords_key(sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total) -> tuple | None:
    if (type(sizes) is not Tensor or type(offsets) is not Tensor or sizes.device.type != "cpu"
            or offsets.device.type != "cpu" or not isinstance(total, int) or not ragged):
        return None  # traced, on a device (reading it would sync), or nothing to cache
    ext = sizes[:, list(ragged)]
    return (ext.numpy().tobytes(), tuple(ext.shape), str(ext.dtype), offsets.numpy().tobytes(), total)


def row_coords(
    sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total: int | torch.SymInt
) -> tuple[Tensor, list[Tensor]]:
    """Per row: its sample id and its coordinate along each ragged dim (storage order).

    For host metadata the result is cached by content (the last few distinct batches' rows)
    and shared between callers, who must not write it in place."""
    key = _coords_key(sizes, offsets, ragged, total)
    if key is not None:
        hit = _COORDS.get(key)
        if hit is not None:
            _COORDS.move_to_end(key)
            return hit[0], list(hit[1])
    sid, coords = _row_coords(sizes, offsets, ragged, total)
    n = sid.numel() * (1 + len(coords))
    if key is not None and n <= COORDS_CACHE_ELEMENTS // 4:
        _COORDS[key] = (sid, tuple(coords))
        _coords_elements[0] += n
        while _coords_elements[0] > COORDS_CACHE_ELEMENTS:
            _, (s0, c0) = _COORDS.popitem(last=False)
            _coords_elements[0] -= s0.numel() * (1 + len(c0))
    return sid, coords


def _row_coords(
    sizes: Tensor, offsets: Tensor, ragged: Sequence[int], total: int | torch.SymInt
) -> tuple[Tensor, list[Tensor]]:
    sid = row_sample_ids(offsets, total)
    local = torch.arange(total, device=offsets.device) - offsets[:-1].index_select(0, sid)
    coords: list[Tensor] = []
    for d in reversed(tuple(ragged)):
        n = sizes[:, d].index_select(0, sid)
        coords.append(torch.remainder(local, n.clamp_min(1)))
        local = torch.div(local, n.clamp_min(1), rounding_mode="floor")
    coords.reverse()
    return sid, coords


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
    sid, coords = row_coords(sizes, dst_offsets, dst_ragged, total)
    return dst_offsets, source_rows(sid, dict(zip(dst_ragged, coords)), sizes, offsets, src_ragged)
