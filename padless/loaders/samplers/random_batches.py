"""RandomBatchSampler: shuffle everything, cut into batches of a fixed size or a budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from padless.loaders.constraints import BatchSize, Constraint, batch_rule
from padless.loaders.samplers.base import SizedSamplerBase, next_fit


class RandomBatchSampler(SizedSamplerBase):
    """Random batches: a fixed ``batch_size``, or as many samples as fit a ``constraint``.

    ``data`` is the number of samples (enough for a fixed batch size) or one
    size per sample (a length or a shape tuple), needed for a budget.
    ``drop_last`` also drops the short last batch of a fixed batch size.

    >>> s = RandomBatchSampler(10, batch_size=4, seed=0)
    >>> sorted(len(b) for b in s)
    [2, 4, 4]
    >>> from padless.loaders.constraints import TokenBudget
    >>> s = RandomBatchSampler([5, 3, 8, 2], constraint=TokenBudget(10))
    >>> all(sum([5, 3, 8, 2][i] for i in b) <= 10 for b in s)
    True
    """

    def __init__(
        self,
        data: int | Any,
        batch_size: int | None = None,
        *,
        constraint: Constraint | None = None,
        oversize: str = "own_batch",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        constraint = batch_rule("RandomBatchSampler", batch_size, constraint)
        if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
            if not isinstance(constraint, BatchSize):
                raise ValueError(
                    f"RandomBatchSampler: {constraint!r} needs one size per sample; pass sizes instead of a count"
                )
            data = np.ones(int(data), dtype=np.int64)
        super().__init__(
            data, constraint, oversize=oversize, seed=seed, shuffle=shuffle, drop_last=drop_last,
            rank=rank, world_size=world_size,
        )

    def epoch_batches(self, rng: np.random.Generator) -> list[list[int]]:
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        if isinstance(self.constraint, BatchSize):
            bs = self.constraint.max_samples or 1
            out = [order[i : i + bs].tolist() for i in range(0, self.num_samples, bs)]
            if self.drop_last and out and len(out[-1]) < bs:
                out.pop()
            return out
        return next_fit(order, self.costs, self.constraint)
