"""Who am I? Rank and worker discovery, in one place.

Samplers run in the main process of each rank and only need ``(rank, world_size)``.
Streaming readers run inside DataLoader workers and also need
``(worker_id, num_workers)``; together these give the consumer index that
shards are split by.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def rank_and_world_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the given values, else ``torch.distributed``'s when initialised, else ``(0, 1)``.

    >>> rank_and_world_size()
    (0, 1)
    >>> rank_and_world_size(rank=1, world_size=4)
    (1, 4)
    """
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    return rank, world_size


def worker_id_and_count() -> tuple[int, int]:
    """``(worker_id, num_workers)`` inside a DataLoader worker, ``(0, 1)`` in the main process."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers


@dataclasses.dataclass(frozen=True)
class Consumer:
    """One reader of a stream: a DataLoader worker on one rank.

    ``index`` numbers all ``count = world_size * num_workers`` consumers, rank-major.

    >>> Consumer(rank=1, world_size=2, worker=0, num_workers=3).index
    3
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers


def current_consumer(rank: int | None = None, world_size: int | None = None) -> Consumer:
    """The consumer this code runs as (rank from ``torch.distributed`` when initialised, worker from the DataLoader)."""
    r, w = rank_and_world_size(rank, world_size)
    wid, nw = worker_id_and_count()
    return Consumer(r, w, wid, nw)


def split_for(items: Sequence[T], consumer: Consumer, *, by_node: bool = True, by_worker: bool = True) -> list[T]:
    """The items (shards) this consumer reads: strided by rank, then by worker.

    >>> split_for(list(range(8)), Consumer(rank=1, world_size=2, worker=1, num_workers=2))
    [3, 7]
    """
    out = list(items)
    if by_node:
        out = out[consumer.rank :: consumer.world_size]
    if by_worker:
        out = out[consumer.worker :: consumer.num_workers]
    return out
