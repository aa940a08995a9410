"""What a structure derived together with other structures, kept without keeping them.

A structure caches what it worked out with its partners in an op (a contraction's checked
extents, its result structure, a bucketing plan) under the partners' identities, so a deep
stack meeting the same partners works it out once. An entry holds weak references to the
partners' metadata, never the metadata itself: a hit needs every partner alive and the very
object it was built with (an ``id`` reused by a new structure misses), and a long-lived
structure (a query met by new keys every step) keeps none of its partners, nor their caches,
alive. Each such cache is a least-recently-used map of at most ``size`` entries per structure
(:data:`SIZE` unless the caller says), and entries whose partners died are dropped as new
ones come in.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Sequence

from padless.tensor.structure import StructureMeta

SIZE = 16
"""Entries one structure keeps per cache (its latest partners)."""


def get(meta: StructureMeta, slot: str, key: Any, partners: Sequence[StructureMeta], default: Any = None) -> Any:
    """The value ``meta`` keeps in cache ``slot`` for ``key`` with exactly these ``partners``
    (metadata objects, all alive), else ``default``."""
    cache = meta.derived.get(slot)
    if cache is None:
        return default
    full = (key, tuple(id(p) for p in partners))
    hit = cache.get(full)
    if hit is None:
        return default
    refs, value = hit
    if any(r() is not p for r, p in zip(refs, partners)):  # a partner died, its id was reused
        del cache[full]
        return default
    cache.move_to_end(full)
    return value


def put(meta: StructureMeta, slot: str, key: Any, partners: Sequence[StructureMeta], value: Any, size: int = SIZE) -> None:
    """Keep ``value`` on ``meta`` in cache ``slot`` for ``key`` and ``partners`` (weakly)."""
    cache = meta.derived.get(slot)
    if cache is None:
        cache = meta.derived[slot] = collections.OrderedDict()
    for k in [k for k, (refs, _) in cache.items() if any(r() is None for r in refs)]:
        del cache[k]  # a partner is gone: the entry can never hit again
    cache[(key, tuple(id(p) for p in partners))] = (tuple(weakref.ref(p) for p in partners), value)
    while len(cache) > size:
        cache.popitem(last=False)
