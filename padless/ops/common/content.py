"""Metadata cached by content: index maps shared by every structure with the same rows.

One batch is seen through many structure objects: every linear, transpose or product makes a
new one, and so do the scores of each attention layer and their gradients. Index maps built
from host metadata (reduction groups, padded reads, broadcast plans) depend only on the host
sizes and offsets (and the op's own parameters), so they are cached here by those bytes as
well as on the structure: a new structure with the rows of one already seen costs a lookup,
not a rebuild of its coordinate arithmetic over every row (for triangle-attention scores of
four samples of N <= 48, several milliseconds per map).

Least recently used entries go first; the cache holds at most 256 entries and 128 MiB (keys and
maps together, :class:`padless.tensor.lru.LRU`), and a single map larger than a quarter of that
is not kept. Entries are shared: nobody writes them in place, and they hold tensors and host
metadata only (no structure object, whose own caches would grow unaccounted). Eager only
(traced metadata is never cached).
"""

from __future__ import annotations

from typing import Any

import torch

from padless.tensor.core import NestedTensor
from padless.tensor.lru import LRU, MiB

_CACHE = LRU("content_maps", max_entries=256, max_bytes=128 * MiB,
             what="index maps and plans (reduction groups, padded reads, broadcast and bucketing plans), "
                  "by host sizes and offsets and the op's parameters")


def structure_key(nt: NestedTensor) -> tuple | None:
    """What determines ``nt``'s rows and sample shapes: ragged storage order, host sizes and
    offsets (as bytes), or None without host metadata."""
    hs = nt._meta.host_sizes
    if hs is None:
        return None
    return (nt._ragged, hs.numpy().tobytes(), tuple(hs.shape), str(hs.dtype), nt.host_offsets().numpy().tobytes())


def get(key: tuple) -> Any:
    return _CACHE.get(key)


def get_or_build(key: tuple, build) -> Any:
    """The entry under ``key``, else ``build()``, kept under ``key`` and returned. Built outside
    ``torch.inference_mode()`` even inside the block: entries outlive it, and an inference
    tensor could not be saved for the backward of a later training step."""
    with torch.inference_mode(False):
        return _CACHE.get_or_build(key, build)


def put(key: tuple, value: Any, size: int | None = None) -> None:
    """Keep ``value`` under ``key``; not under ``torch.inference_mode()``, where it was built of
    inference tensors that a later training step could not save for its backward. ``size``: the
    entry's bytes (key included) when the caller counts them itself."""
    if not torch.is_inference_mode_enabled():
        _CACHE.put(key, value, size)


def clear() -> None:
    _CACHE.clear()


def held() -> int:
    """Bytes held now."""
    return _CACHE.held_bytes
