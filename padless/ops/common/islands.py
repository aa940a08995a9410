"""NestedTensors rebuilt inside opaque ops when a compiled graph runs.

Opaque ops (``padless::nested_island`` for contractions, ``padless::image_island`` for
spatial ops) get their operands as inner tensors and run the eager handler on NestedTensors
rebuilt from them. The structure of such a rebuild is kept, keyed by the host sizes and
offsets, so the next call with the same sizes (the backward, the next step, the next layer)
finds every plan the eager handler cached on it."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from padless.tensor.autograd import nested_from_values
from padless.tensor.core import NestedTensor, StructureMeta
from padless.tensor.lru import LRU, MiB
from padless.tensor.structure import envelope_from_sizes

TRACED_SOFTMAX: list = []
"""``fn(nt, dim, log) -> NestedTensor | None`` asked first for a softmax along a ragged dim of a
traced NestedTensor with several ragged dims (registered by :mod:`padless.ops.pairs.traced`)."""

_METAS = LRU("island_structures", max_entries=64, max_bytes=64 * MiB,
              what="structures rebuilt inside compiled opaque ops, by host sizes and offsets (bytes counted "
                   "when kept: host metadata; each structure's own caches are bounded per structure)")
"""Structures kept (LRU: 64 entries, 64 MiB of keys and host metadata)."""


def rebuilt(v: Tensor, offsets: Tensor, sizes: Tensor, ragged: Sequence[int], hs: Tensor, ho: Tensor) -> NestedTensor:
    """The NestedTensor of rows ``v`` with device ``offsets``/``sizes`` and their host copies
    ``hs``/``ho`` (CPU int64), sharing its structure with earlier rebuilds of the same sizes."""
    ragged = tuple(ragged)
    key = (ragged, hs.numpy().tobytes(), tuple(hs.shape), ho.numpy().tobytes(), v.device)
    meta = _METAS.get(key)
    if meta is None:
        meta = StructureMeta(hs, ho)
        _METAS.put(key, meta)
    return nested_from_values(v, offsets, sizes, ragged, envelope_from_sizes(hs, ragged, v.shape[1:]), meta)
