"""BucketBatchSampler: batches of similar sizes, in a random order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from padless.loaders.constraints import (
    Constraint,
    batch_rule,
    bucket_keys,
    estimate_boundaries,
    validate_boundaries,
)
from padless.loaders.samplers.base import SizedSamplerBase, next_fit


class BucketBatchSampler(SizedSamplerBase):
    """Length buckets: samples of similar size share a batch, so the padded envelope stays full.

    Each sample goes to the bucket of its key (default: its number of elements,
    ``prod(size)``; or ``key(sizes) -> (N,)``). ``boundaries`` are the bucket
    edges (bucket ``j`` holds keys in ``[b[j-1], b[j])``); without them
    ``num_buckets`` edges are estimated at the quantiles of the keys, so buckets
    hold about as many samples each. Samples are shuffled inside each bucket,
    cut into batches (``batch_size`` or a ``constraint``), and the batches of all
    buckets are shuffled together, so consecutive steps do not sweep lengths
    (no sawtooth in the loss curve).

    >>> lengths = [1, 2, 3, 50, 51, 52, 4, 53]
    >>> s = BucketBatchSampler(lengths, batch_size=4, num_buckets=2)
    >>> sorted(sorted(lengths[i] for i in b) for b in s)
    [[1, 2, 3, 4], [50, 51, 52, 53]]
    """

    def __init__(
        self,
        sizes: Any,
        batch_size: int | None = None,
        *,
        constraint: Constraint | None = None,
        boundaries: Sequence[float] | None = None,
        num_buckets: int = 8,
        key: Callable[[np.ndarray], np.ndarray] | None = None,
        oversize: str = "own_batch",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        constraint = batch_rule("BucketBatchSampler", batch_size, constraint)
        super().__init__(
            sizes, constraint, oversize=oversize, seed=seed, shuffle=shuffle, drop_last=drop_last,
            rank=rank, world_size=world_size,
        )
        keys = bucket_keys(self.sizes, key)
        if boundaries is None:
            self.boundaries = estimate_boundaries(keys, num_buckets)
        else:
            self.boundaries = validate_boundaries(boundaries)
        self.bucket_ids = np.searchsorted(np.asarray(self.boundaries, dtype=np.float64), keys, side="right")

    def bucket_counts(self) -> list[int]:
        """How many samples each bucket holds (``len(boundaries) + 1`` buckets)."""
        return np.bincount(self.bucket_ids, minlength=len(self.boundaries) + 1).tolist()

    def epoch_batches(self, rng: np.random.Generator) -> list[list[int]]:
        out: list[list[int]] = []
        for b in range(len(self.boundaries) + 1):
            members = np.flatnonzero(self.bucket_ids == b)
            if len(members) == 0:
                continue
            if self.shuffle:
                members = members[rng.permutation(len(members))]
            out.extend(next_fit(members, self.costs, self.constraint))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        return out
