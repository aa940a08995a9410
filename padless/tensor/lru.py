"""Least-recently-used caches bounded by entries and by bytes, and the list of every one.

padless keeps a few maps beyond the life of one structure (row coordinates and index maps by
content, reshape answers, image grids): each is an :class:`LRU` with a name, an entry bound and
a byte bound, so a run that never meets the same batch twice (10,000 new structures) holds at
most the bound, whatever it does. An entry's bytes are its key's and its value's: tensor storages
(each counted once per entry), numpy arrays, bytes and strings, and the containers and plain
objects holding them. An entry larger than a quarter of the byte bound is not kept (one huge map
would push out everything else). Lookups and inserts hold a lock (a model may run from several
threads). :func:`caches` lists them all (``docs/tensor.md``, "Caches and their bounds", is the
table of them)."""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable, Iterator

import numpy as np
from torch import Tensor

MiB = 1 << 20

_ALL: "dict[str, LRU]" = {}


class LRU:
    """A map that drops its least recently used entries past ``max_entries`` entries or
    ``max_bytes`` bytes (either bound may be changed on the instance, e.g. by a test).

    >>> c = LRU("example", max_entries=2, max_bytes=MiB, what="an example", register=False)
    >>> _ = c.put("a", 1), c.put("b", 2), c.get("a"), c.put("c", 3)
    >>> list(c)   # "b" was the least recently used
    ['a', 'c']
    """

    def __init__(self, name: str, max_entries: int, max_bytes: int, what: str,
                 size: Callable[[Any, Any], int] | None = None, register: bool = True) -> None:
        self.name, self.max_entries, self.max_bytes, self.what = name, max_entries, max_bytes, what
        self._size = size or (lambda k, v: nbytes((k, v)))
        self._data: collections.OrderedDict = collections.OrderedDict()  # key -> (value, bytes)
        self._held = 0
        self._lock = threading.Lock()
        if register:
            if name in _ALL:
                raise RuntimeError(f"padless internal: cache {name!r} declared twice")
            _ALL[name] = self

    def get(self, key: Any, default: Any = None) -> Any:
        """The value under ``key`` (now the most recently used), else ``default``."""
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                return default
            self._data.move_to_end(key)
            return hit[0]

    def put(self, key: Any, value: Any, size: int | None = None) -> bool:
        """Keep ``value`` under ``key``, dropping the least recently used entries past the bounds.
        False (nothing kept) for an entry larger than a quarter of the byte bound. ``size``: the
        entry's bytes when the caller knows them (an entry of many small Python objects is slow
        to walk), else counted here."""
        n = self._size(key, value) if size is None else size
        if n > self.max_bytes // 4:
            return False
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._held -= old[1]
            self._data[key] = (value, n)
            self._held += n
            while self._data and (len(self._data) > self.max_entries or self._held > self.max_bytes):
                _, (_, m) = self._data.popitem(last=False)
                self._held -= m
        return True

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        """The value under ``key``, else ``build()``, kept under ``key`` and returned."""
        out = self.get(key)
        if out is None:
            out = build()
            self.put(key, out)
        return out

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._held = 0

    @property
    def held_bytes(self) -> int:
        """Bytes held by the entries now (as counted when each was kept)."""
        return self._held

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            return iter(list(self._data))

    def values(self) -> list[Any]:
        with self._lock:
            return [v for v, _ in self._data.values()]

    def __repr__(self) -> str:
        return (f"LRU({self.name!r}: {len(self._data)}/{self.max_entries} entries, "
                f"{self._held / MiB:.1f}/{self.max_bytes / MiB:.0f} MiB)")


def caches() -> list[LRU]:
    """Every cache declared with :class:`LRU`, in declaration order (imported modules only)."""
    return list(_ALL.values())


_SCALARS = (bool, int, float, complex, type(None))


def nbytes(obj: Any, _seen: set | None = None, _depth: int = 0) -> int:
    """Memory held by ``obj``: tensor storages (once each), numpy arrays, bytes and strings, and
    the containers and plain objects around them (their Python objects at ``sys.getsizeof``)."""
    if isinstance(obj, _SCALARS):
        return 32
    if isinstance(obj, (str, bytes, bytearray)):
        return sys.getsizeof(obj)
    seen = set() if _seen is None else _seen
    if id(obj) in seen or _depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
            return obj.numel() * obj.element_size() + 128
        if ("storage", st.data_ptr()) in seen:
            return 0
        seen.add(("storage", st.data_ptr()))
        return st.nbytes() + 128
    if isinstance(obj, np.ndarray):
        return obj.nbytes + 112
    if isinstance(obj, type):
        return 0  # classes live anyway
    if isinstance(obj, (tuple, list, set, frozenset)):
        total = sys.getsizeof(obj)
        for o in obj:
            total += 32 if isinstance(o, _SCALARS) else nbytes(o, seen, _depth + 1)
        return total
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(nbytes(k, seen, _depth + 1) + nbytes(v, seen, _depth + 1) for k, v in obj.items())
    total = sys.getsizeof(obj)
    d = getattr(obj, "__dict__", None)
    if d is not None:
        total += nbytes(d, seen, _depth + 1)
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for s in (slots,) if isinstance(slots, str) else slots:
            if s not in ("__weakref__", "__dict__"):
                total += nbytes(getattr(obj, s, None), seen, _depth + 1)
    return total
