"""Metadata cached by content: index maps shared by every structure with the same rows.

One batch is seen through many structure objects: every linear, transpose or product makes a
new one, and so do the scores of each attention layer and their gradients. Index maps built
from host metadata (reduction groups, padded reads, broadcast plans) depend only on the host
sizes and offsets (and the op's own parameters), so they are cached here by those bytes as
well as on the structure: a new structure with the rows of one already seen costs a lookup,
not a rebuild of its coordinate arithmetic over every row (for triangle-attention scores of
four samples of N <= 48, several milliseconds per map).

Least recently used entries go first; the cache is bounded by the elements of the tensors it
holds (:data:`ELEMENTS`), and a single map larger than a quarter of it is not kept. Entries are
shared: nobody writes them in place, and they hold tensors and host metadata only (no structure
object, whose own caches would grow unaccounted). Eager only (traced metadata is never cached).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from torch import Tensor

from padless.tensor.core import NestedTensor

ELEMENTS = 1 << 24
"""Tensor elements held by all entries together (int64 index maps: 128 MiB)."""
ENTRIES = 256
"""Entries held (many tiny maps cost Python objects rather than elements)."""

_CACHE: collections.OrderedDict = collections.OrderedDict()
_held = [0]
_LOCK = threading.Lock()  # models run from several threads share the cache


def structure_key(nt: NestedTensor) -> tuple | None:
    """What determines ``nt``'s rows and sample shapes: ragged storage order, host sizes and
    offsets (as bytes), or None without host metadata."""
    hs = nt._meta.host_sizes
    if hs is None:
        return None
    return (nt._ragged, hs.numpy().tobytes(), tuple(hs.shape), str(hs.dtype), nt.host_offsets().numpy().tobytes())


def get(key: tuple) -> Any:
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            return None
        _CACHE.move_to_end(key)
        return hit[0]


def get_or_build(key: tuple, build) -> Any:
    """The entry under ``key``, else ``build()``, kept under ``key`` and returned."""
    out = get(key)
    if out is None:
        out = build()
        put(key, out)
    return out


def put(key: tuple, value: Any) -> None:
    n = _numel(value)
    if n > ELEMENTS // 4:
        return  # one huge map would push out everything else: it stays on its structure only
    with _LOCK:
        old = _CACHE.pop(key, None)
        if old is not None:
            _held[0] -= old[1]
        _CACHE[key] = (value, n)
        _held[0] += n
        while (_held[0] > ELEMENTS or len(_CACHE) > ENTRIES) and _CACHE:
            _, (_, m) = _CACHE.popitem(last=False)
            _held[0] -= m


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
        _held[0] = 0


def held() -> int:
    """Elements held now."""
    return _held[0]


def _numel(obj) -> int:
    if isinstance(obj, Tensor):
        return obj.numel()
    if isinstance(obj, (tuple, list)):
        return sum(_numel(o) for o in obj)
    return 0
