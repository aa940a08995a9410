"""Stages for iterable sources: shuffle buffer, streaming bucketer, fixed epoch length.

Each stage is a small picklable object whose ``__call__`` turns an iterable into a
generator, so stages compose by calling (``bucketer(shuffle(reader))``) and
are tested on plain lists.

>>> from padless.loaders.constraints import TokenBudget
>>> b = StreamingBucketer(len, TokenBudget(6), boundaries=[3])
>>> [[len(x) for x in batch] for batch in b(["ab", "abcd", "a", "abc", "b"])]
[[4], [2, 1, 1], [3]]
"""

from __future__ import annotations

import random
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from padless.loaders.constraints import Constraint, as_sizes, bucket_keys, check_constraint, validate_boundaries
from padless.loaders.distributed import worker_id_and_count

T = TypeVar("T")


def shuffle_buffer(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """Approximate shuffle through a buffer of ``size`` items (``size <= 1``: no shuffle).

    >>> sorted(shuffle_buffer(range(10), 4, random.Random(0))) == list(range(10))
    True
    """
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        j = rng.randrange(len(buf))
        buf[j], x = x, buf[j]
        yield x
    rng.shuffle(buf)
    yield from buf


class Shuffle:
    """Shuffle-buffer stage, seeded by ``(seed, epoch, worker)`` so epochs differ and runs repeat."""

    def __init__(self, size: int, seed: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"Shuffle: size must be an int >= 0, got {size!r}")
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        wid, _ = worker_id_and_count()
        return shuffle_buffer(items, self.size, random.Random(f"{self.seed}/{self.epoch}/{wid}"))


class StreamingBucketer:
    """Buffer, bucket, emit: batches of similar-size samples from a stream.

    ``size_fn(sample)`` gives the sample's size (a length or a shape tuple);
    the ``constraint`` prices it and caps each batch; ``boundaries`` split the
    keys (default key: number of elements) into buckets. A bucket is emitted as a
    batch when the next sample would not fit it; when more than ``buffer_size``
    samples wait, the fullest bucket is emitted; the rest is flushed at the end,
    fullest first. An over-budget sample is emitted alone (``oversize="own_batch"``)
    or raises (``"error"``); nothing is dropped.
    """

    def __init__(
        self,
        size_fn: Callable[[Any], Any],
        constraint: Constraint,
        *,
        boundaries: Sequence[float] = (),
        buffer_size: int = 1024,
        key: Callable[[np.ndarray], np.ndarray] | None = None,
        oversize: str = "own_batch",
    ) -> None:
        check_constraint(constraint, "StreamingBucketer")
        if oversize not in ("own_batch", "error"):
            raise ValueError(f"StreamingBucketer: oversize must be 'own_batch' or 'error', got {oversize!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"StreamingBucketer: buffer_size must be an int >= 1, got {buffer_size!r}")
        self.size_fn = size_fn
        self.constraint = constraint
        self.boundaries = np.asarray(validate_boundaries(boundaries), dtype=np.float64)
        self.buffer_size = buffer_size
        self.key = key
        self.oversize = oversize

    def __call__(self, samples: Iterable[T]) -> Iterator[list[T]]:
        nb = len(self.boundaries) + 1
        batches: list[list[T]] = [[] for _ in range(nb)]
        load = [0.0] * nb
        waiting = 0
        for n, s in enumerate(samples):
            size = as_sizes([self.size_fn(s)], f"StreamingBucketer: size_fn(sample {n} of the stream)")
            try:
                cost = float(self.constraint.costs(size)[0])
            except ValueError as e:
                raise ValueError(f"StreamingBucketer: sample {n} of the stream (size {tuple(size[0].tolist())}): {e}") from e
            if cost > self.constraint.max_cost:
                if self.oversize == "error":
                    raise ValueError(
                        f"StreamingBucketer: sample {n} of the stream (size {tuple(size[0].tolist())}) costs {cost:g}, "
                        f"over the budget {self.constraint!r}; raise the budget or pass oversize='own_batch'"
                    )
                yield [s]
                continue
            j = int(np.searchsorted(self.boundaries, bucket_keys(size, self.key)[0], side="right"))
            if batches[j] and not self.constraint.fits(load[j], len(batches[j]), cost):
                waiting -= len(batches[j])
                yield batches[j]
                batches[j], load[j] = [], 0.0
            batches[j].append(s)
            load[j] += cost
            waiting += 1
            if waiting > self.buffer_size:
                k = max(range(nb), key=lambda i: load[i])
                waiting -= len(batches[k])
                yield batches[k]
                batches[k], load[k] = [], 0.0
        for k in sorted(range(nb), key=lambda i: -load[i]):
            if batches[k]:
                yield batches[k]


def fixed_length(source: Iterable[T], n: int, what: str = "fixed_length") -> Iterator[T]:
    """Exactly ``n`` items: stop early, or iterate ``source`` again (a new pass) when it runs dry.

    >>> list(fixed_length([1, 2, 3], 7))
    [1, 2, 3, 1, 2, 3, 1]
    """
    if n <= 0:
        return
    done = 0
    while True:
        got = False
        for x in source:
            got = True
            yield x
            done += 1
            if done >= n:
                return
        if not got:
            raise ValueError(f"{what}: the source yielded nothing, so it cannot fill {n} item(s) per epoch")


def share(total: int, index: int, count: int) -> int:
    """Consumer ``index`` of ``count``'s share of ``total`` (the remainder goes to the first ones).

    >>> [share(10, i, 3) for i in range(3)]
    [4, 3, 3]
    """
    return total // count + (1 if index < total % count else 0)


class BucketedStream(torch.utils.data.IterableDataset, Generic[T]):
    """An iterable dataset of batches: ``source`` samples through a :class:`StreamingBucketer`.

    ``epoch_batches`` fixes the number of batches each *rank* yields per epoch
    (split across DataLoader workers), re-reading the source when it runs dry,
    so every rank runs the same number of steps. ``collate_fn`` (e.g.
    ``padless.collate``) runs in the worker. Use with ``DataLoader(batch_size=None)``.
    ``set_epoch`` is forwarded to the source.
    """

    def __init__(
        self,
        source: Iterable[T],
        bucketer: StreamingBucketer,
        *,
        epoch_batches: int | None = None,
        collate_fn: Callable[[list[T]], Any] | None = None,
    ) -> None:
        if epoch_batches is not None and (isinstance(epoch_batches, bool) or not isinstance(epoch_batches, int) or epoch_batches < 1):
            raise ValueError(f"BucketedStream: epoch_batches must be an int >= 1 or None, got {epoch_batches!r}")
        self.source = source
        self.bucketer = bucketer
        self.epoch_batches = epoch_batches
        self.collate_fn = collate_fn

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        src = _Rebucketed(self.source, self.bucketer)
        it: Iterable[list[T]] = src
        if self.epoch_batches is not None:
            wid, nw = worker_id_and_count()
            it = fixed_length(src, share(self.epoch_batches, wid, nw), "BucketedStream")
        for batch in it:
            yield self.collate_fn(batch) if self.collate_fn is not None else batch


class _Rebucketed:
    """Re-iterable: each pass buckets a new pass over the source."""

    def __init__(self, source: Iterable[Any], bucketer: StreamingBucketer) -> None:
        self.source, self.bucketer = source, bucketer

    def __iter__(self) -> Iterator[list[Any]]:
        return self.bucketer(self.source)

