"""Error policies for streaming readers: plain functions (or callables) the reader calls.

A handler is called as ``handler(exc, shard=..., key=...)`` when a sample cannot
be read or decoded. Returning means "skip it and go on"; raising stops the
stream. ``shard`` is the shard (or file) and ``key`` the sample key, or ``None``
when the failure is not tied to one sample (an unreadable shard).

>>> h = SkipAndWarn()
>>> import warnings
>>> with warnings.catch_warnings(record=True):
...     warnings.simplefilter("always")
...     h(ValueError("bad jpeg"), shard="a.tar", key="0001")
...     h(ValueError("bad png"), shard="a.tar", key="0002")
>>> h.counts
{'a.tar': 2}
"""

from __future__ import annotations

import warnings
from typing import Protocol

from padless.loaders.skips import clean


class ErrorHandler(Protocol):
    def __call__(self, exc: BaseException, *, shard: str, key: str | None) -> None: ...


class SampleError(RuntimeError):
    """A sample (or a shard) could not be read; the message names the shard and the key."""

    def __init__(self, message: str, shard: str, key: str | None) -> None:
        super().__init__(message)
        self.shard = shard
        self.key = key


def describe(exc: BaseException, shard: str, key: str | None) -> str:
    """``shard '...', sample key '...': Reason: message``, the message without object reprs."""
    where = f"shard {shard!r}" + (f", sample key {key!r}" if key is not None else "")
    return f"{where}: {type(exc).__name__}: {clean(str(exc))}"


def raise_error(exc: BaseException, *, shard: str, key: str | None) -> None:
    """Stop the stream with a :class:`SampleError` naming the shard and the key."""
    raise SampleError(
        f"{describe(exc, shard, key)} (pass handler=padless.loaders.SkipAndWarn() to skip unreadable samples)",
        shard,
        key,
    ) from exc


class SkipAndWarn:
    """Skip the sample, count it per shard, and warn once per shard (naming the first bad key).

    ``counts`` holds the skips seen by this process (each DataLoader worker has its own
    copy); a reader's ``skipped`` counts them in the main process, workers' included.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, exc: BaseException, *, shard: str, key: str | None) -> None:
        n = self.counts.get(shard, 0)
        self.counts[shard] = n + 1
        if n == 0:
            warnings.warn(
                f"padless.loaders: skipping an unreadable sample: {describe(exc, shard, key)} "
                f"(warned once per shard; pass handler=padless.loaders.raise_error to stop instead)",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def skip_silently(exc: BaseException, *, shard: str, key: str | None) -> None:
    """Skip without a word (counting is the caller's business)."""
    return None
