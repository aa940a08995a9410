"""Counting skipped samples where the training loop runs: :class:`SkipStats` and its carrier.

A streaming reader skips what its error handler lets it skip (a corrupt image, a cut
shard). Inside DataLoader workers the handler runs in another process, so the reader
also *carries* its records to the main process with the samples: a worker's sample
``__key__`` is a ``str`` that, when the batch is unpickled in the main process, adds the
skips the worker recorded since its previous sample to the reader's :class:`SkipStats`
(and becomes a plain ``str``). Any collate_fn that keeps the ``__key__`` strings
(``padless.collate``, ``padless.Collator``, torch's ``default_collate``,
``collate_fn=list``) carries them; one that drops ``__key__`` drops the counts with it.
A worker's last sample also says that the worker's pass ended, so the main process
knows when every worker is done and warns once with the epoch's count.

>>> s = SkipStats()
>>> s.add(ValueError("bad header"), shard="a.tar", key="0001")
>>> s.add(ValueError("bad header"), shard="a.tar", key="0007")
>>> s.total, s.counts
(2, {'ValueError': 2})
>>> print(s)
2 sample(s) skipped: ValueError x2 (shard 'a.tar', key '0001': bad header; shard 'a.tar', key '0007': bad header)
"""

from __future__ import annotations

import json
import re
import threading
import uuid
import warnings
import weakref
from typing import Any

from torch.utils.data import get_worker_info

EXAMPLES = 3  # example (shard, key, message) kept per reason
_MESSAGE_CHARS = 300
_REPR = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")


def clean(text: str) -> str:
    """``text`` without object reprs (``<_io.BytesIO object at 0x7f...>``), cut to a few hundred characters."""
    text = _REPR.sub("<data>", text)
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


class SkipStats:
    """Samples skipped in one epoch: a count per reason (the exception's type name) and the
    first few ``(shard, key, message)`` examples of each. ``reader.skipped`` is one; a new
    one starts each epoch."""

    __slots__ = ("counts", "examples")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[tuple[str, str | None, str]]] = {}

    def add(self, exc: BaseException, *, shard: str, key: str | None) -> None:
        """Count one skipped sample (or shard, ``key=None``)."""
        self._add(type(exc).__name__, 1, [(str(shard), None if key is None else str(key), clean(str(exc)))])

    def _add(self, reason: str, n: int, examples: list[Any]) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        kept = self.examples.setdefault(reason, [])
        for e in examples[: EXAMPLES - len(kept)]:
            kept.append(tuple(e))  # type: ignore[arg-type]

    def merge(self, other: "SkipStats") -> "SkipStats":
        for reason, n in other.counts.items():
            self._add(reason, n, other.examples.get(reason, []))
        return self

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        """``{"total": n, "counts": {reason: n}, "examples": {reason: [[shard, key, message], ...]}}``
        (plain values, for a logger)."""
        return {"total": self.total, "counts": dict(self.counts), "examples": {r: [list(e) for e in v] for r, v in self.examples.items()}}

    def _to_json(self) -> str:
        return json.dumps([self.counts, self.examples], separators=(",", ":"))

    @classmethod
    def _from_json(cls, text: str) -> "SkipStats":
        counts, examples = json.loads(text)
        out = cls()
        for reason, n in counts.items():
            out._add(reason, int(n), examples.get(reason, []))
        return out

    def __str__(self) -> str:
        if not self.counts:
            return "no sample skipped"
        parts = []
        for reason, n in self.counts.items():
            ex = "; ".join(
                f"shard {shard!r}" + (f", key {key!r}" if key is not None else "") + f": {msg}"
                for shard, key, msg in self.examples.get(reason, [])
            )
            parts.append(f"{reason} x{n}" + (f" ({ex})" if ex else ""))
        return f"{self.total} sample(s) skipped: " + ", ".join(parts)

    def __repr__(self) -> str:
        return f"SkipStats(total={self.total}, counts={self.counts})"


class SkipLedger:
    """The main process's side: the current epoch's :class:`SkipStats` of one reader, fed by
    the reader itself (no workers) or by the notes its workers' samples carry.

    An epoch ends (its count is warned once, if anything was skipped and ``warn`` is set: the
    reader's handler is one that warns) when every worker has
    ended its pass, when an iteration in this process ends, or at ``set_epoch``; the next
    epoch starts with a fresh ``SkipStats`` at ``set_epoch``, or (for a reader whose
    ``set_epoch`` is never called) with the first record after the end.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.stats = SkipStats()
        self.reported = 0  # skips of ``stats`` already warned about
        self.ended: set[int] = set()  # workers whose pass ended in this epoch
        self.done = False  # every worker ended (or this process's iteration did)
        self.explicit = False  # set_epoch() delimits epochs
        self.warn = True  # warn the epoch's count (off for a handler that skips silently)
        self.lock = threading.Lock()

    def new_epoch(self, explicit: bool = False) -> None:
        with self.lock:
            self._report()
            self.explicit = self.explicit or explicit
            self.stats, self.reported, self.ended, self.done = SkipStats(), 0, set(), False

    def start(self) -> None:
        """An iteration in this process starts (a new epoch unless ``set_epoch`` delimits them)."""
        if not self.explicit:
            self.new_epoch()

    def record(self, exc: BaseException, shard: str, key: str | None) -> None:
        with self.lock:
            self._reopen()
            self.stats.add(exc, shard=shard, key=key)

    def finish(self) -> None:
        """An iteration in this process ended."""
        with self.lock:
            self.done = True
            self._report()

    def receive(self, worker: int, num_workers: int, end: bool, payload: str) -> None:
        with self.lock:
            self._reopen()
            if payload:
                self.stats.merge(SkipStats._from_json(payload))
            if end:
                self.ended.add(worker)
                if len(self.ended) >= num_workers:
                    self.done = True
                    self._report()

    def _reopen(self) -> None:
        if self.done and not self.explicit:  # the epoch ended: this record starts the next one
            self.stats, self.reported, self.ended, self.done = SkipStats(), 0, set(), False

    def _report(self) -> None:
        if self.warn and self.stats.total > self.reported:
            warnings.warn(
                f"padless.loaders: {self.what}: {self.stats} (this epoch, counted in the main process; "
                f"reader.skipped has the counts; pass handler=padless.loaders.raise_error to stop instead)",
                RuntimeWarning,
                stacklevel=3,
            )
            self.reported = self.stats.total


_LEDGERS: "weakref.WeakValueDictionary[str, SkipLedger]" = weakref.WeakValueDictionary()
_LEDGERS_LOCK = threading.Lock()


def new_token() -> str:
    return uuid.uuid4().hex


def ledger_for(token: str, what: str) -> SkipLedger:
    """This process's ledger of a reader (by its token), made on first use."""
    with _LEDGERS_LOCK:
        led = _LEDGERS.get(token)
        if led is None:
            led = SkipLedger(what)
            _LEDGERS[token] = led
        return led


class _NotedKey(str):
    """A worker's sample key carrying a note: ``(token, worker, num_workers, end, payload)``."""

    note: tuple[str, int, int, bool, str]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrive, (str(self), self.note))


def _noted(key: str, note: tuple[str, int, int, bool, str]) -> _NotedKey:
    out = _NotedKey(key)
    out.note = note
    return out


def _arrive(key: str, note: tuple[str, int, int, bool, str]) -> str:
    """Unpickling a noted key: in the main process, hand the note to the reader's ledger and
    become a plain ``str``; inside a worker (a copy made there), keep carrying it."""
    if get_worker_info() is not None:
        return _noted(key, note)
    token, worker, num_workers, end, payload = note
    with _LEDGERS_LOCK:
        led = _LEDGERS.get(token)
    if led is not None:  # else the reader is gone: nobody can read the counts
        led.receive(worker, num_workers, end, payload)
    return key


def carry(stream: Any, pending: SkipStats, token: str, worker: int, num_workers: int) -> Any:
    """A worker's samples, each sample's ``__key__`` carrying the skips recorded (into
    ``pending``) since the previous one, the last one also the end of the pass. One sample is
    held back, so the last knows it is the last. Samples that are not dicts with a ``str``
    ``__key__`` carry nothing (their skips go with a later sample); a worker that yields no
    sample carries nothing (its handler's own warnings are all that is seen)."""

    def attach(sample: Any, end: bool) -> Any:
        if not (pending.counts or end):
            return sample
        if not isinstance(sample, dict) or not isinstance(sample.get("__key__"), str):
            return sample
        payload = pending._to_json() if pending.counts else ""
        sample["__key__"] = _noted(str(sample["__key__"]), (token, worker, num_workers, end, payload))
        pending.counts.clear()
        pending.examples.clear()
        return sample

    held: Any = None
    have = False
    for s in stream:
        if have:
            yield attach(held, False)
        held, have = s, True
    if have:
        yield attach(held, True)


__all__ = ["SkipStats"]
