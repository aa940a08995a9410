"""Row maps of broadcasts onto attention scores inside a compiled graph, as one cached op.

Adding a mask or a pair bias to scores of several ragged dims (``(N_i, H, N_i, N_i)``:
``sum H N_i**3`` rows) reads the bias through a row map: for every score row, the bias row
holding its element. Built from device sizes in the graph, that map is a sample id, a
division and a remainder per ragged dim on every score row, every step; eagerly it is built
once per batch from host sizes (an ``arange`` per sample and dim) and cached.

:func:`broadcast_rows` is the eager map as an opaque op, ``padless::broadcast_rows``: when
the graph runs it reads the host sizes (free on the CPU), checks the ragged extents the
operands share (the eager broadcasting error, naming the sample), and returns the map of
those sizes, kept by content (the other triangle attention, the next layer, the next step
with the same batch find it). Its fake implementation only states the length (the scores'
rows). Used on the CPU only: on an accelerator reading the sizes would synchronise, and the
graph's map stays.

Map of ``mb (N_i, 1, 1, N_i)`` onto scores ``(N_i, H, N_i, N_i)`` (``H = 1``, ``N = (2,)``)::

    score rows (i, k, j) in storage order (0, 2, 3): 000 001 010 011 100 101 110 111
    mb rows (i, j):                                    0   1   0   1   2   3   2   3
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.lru import LRU, MiB
from padless.tensor.errors import StructureError
from padless.tensor.traced_checks import mismatch_message

_MAPS = LRU("traced_broadcast_rows", max_entries=256, max_bytes=128 * MiB,
             what="row maps of broadcasts onto scores inside compiled graphs, by host sizes and offsets")
"""Maps kept by content (LRU: 256 entries, 128 MiB)."""


def _key(*ts: Tensor) -> tuple:
    return tuple((tuple(t.shape), t.numpy().tobytes()) for t in ts)


def _host_map(hs_out: Tensor, ho_out: Tensor, out_ragged: tuple, hs_src: Tensor, ho_src: Tensor,
              src_ragged: tuple, total: int) -> Tensor:
    key = (out_ragged, src_ragged, total, _key(hs_out, ho_out, hs_src, ho_src))
    hit = _MAPS.get(key)
    if hit is not None:
        return hit
    idx = layout.broadcast_rows(hs_out, ho_out, out_ragged, hs_src, ho_src, src_ragged, total)
    _MAPS.put(key, idx)
    return idx


@torch.library.custom_op("padless::broadcast_rows", mutates_args=())
def broadcast_rows(
    out_sizes: Tensor, out_offsets: Tensor, out_ragged: list[int], src_sizes: Tensor, src_offsets: Tensor,
    src_ragged: list[int], total: int, opname: str,
) -> Tensor:
    """For every row of the layout ``(out_sizes, out_offsets, out_ragged)`` (``total`` rows), the
    row of the source layout holding its element (:func:`padless.tensor.layout.broadcast_rows`
    on host sizes, cached by content); raises the eager :class:`StructureError` when the two
    differ along a ragged dim they share."""
    hs_out, hs_src = out_sizes.cpu(), src_sizes.cpu()
    common = [d for d in src_ragged if d in out_ragged]
    msg = mismatch_message(hs_out.tolist(), hs_src.tolist(), common, opname, True)
    if msg is not None:
        raise StructureError(msg)
    ho_out, ho_src = out_offsets.cpu(), src_offsets.cpu()
    if int(ho_out[-1]) != total:
        raise StructureError(f"{opname}(): under torch.compile the result should have {total} rows, its sizes give {int(ho_out[-1])}")
    idx = _host_map(hs_out, ho_out, tuple(out_ragged), hs_src, ho_src, tuple(src_ragged), total)
    return idx.to(out_sizes.device, copy=True)  # the cached map stays the cache's


@broadcast_rows.register_fake
def _broadcast_rows_fake(out_sizes, out_offsets, out_ragged, src_sizes, src_offsets, src_ragged, total, opname):
    return out_sizes.new_empty((total,))
