"""BudgetBatchSampler: pack samples into batches whose cost stays under a budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from padless.loaders.constraints import Constraint
from padless.loaders.samplers.base import SizedSamplerBase

PACKINGS = ("first_fit_decreasing", "best_fit_decreasing", "best_fit")


class BudgetBatchSampler(SizedSamplerBase):
    """Batches that fill a budget (tokens, pixels, ``sum(N_i^2)``, a user cost).

    Samples are shuffled, then packed window by window (``window`` samples at a
    time, so batches mix lengths from across the epoch while packing stays
    tight):

    * ``"first_fit_decreasing"`` (default): sort the window by cost, largest
      first; each sample joins the first open batch it fits in;
    * ``"best_fit_decreasing"``: same order; each sample joins the batch it
      fills most tightly;
    * ``"best_fit"``: window order as shuffled, tightest batch.

    The batches are then shuffled. A sample over the budget gets a batch of its
    own (``oversize="own_batch"``) or raises when the sampler is built
    (``oversize="error"``); it is never dropped.

    >>> from padless.loaders.constraints import TokenBudget
    >>> lengths = [6, 5, 4, 3, 2, 1, 9]
    >>> s = BudgetBatchSampler(lengths, TokenBudget(10), shuffle=False)
    >>> [[lengths[i] for i in b] for b in s]
    [[9, 1], [6, 4], [5, 3, 2]]
    """

    def __init__(
        self,
        sizes: Any,
        constraint: Constraint,
        *,
        window: int = 1024,
        packing: str = "first_fit_decreasing",
        oversize: str = "own_batch",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"BudgetBatchSampler: packing must be one of {PACKINGS}, got {packing!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"BudgetBatchSampler: window must be an int >= 1, got {window!r}")
        super().__init__(
            sizes, constraint, oversize=oversize, seed=seed, shuffle=shuffle, drop_last=drop_last,
            rank=rank, world_size=world_size,
        )
        self.window = window
        self.packing = packing

    def epoch_batches(self, rng: np.random.Generator) -> list[list[int]]:
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        out: list[list[int]] = []
        for s in range(0, self.num_samples, self.window):
            out.extend(pack_window(order[s : s + self.window], self.costs, self.constraint, self.packing))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        return out


def pack_window(idx: np.ndarray, costs: np.ndarray, constraint: Constraint, packing: str) -> list[list[int]]:
    """Bin-pack the samples ``idx`` under ``constraint``; over-budget samples get their own bin."""
    if packing != "best_fit":
        idx = idx[np.argsort(-costs[idx], kind="stable")]
    best = packing != "first_fit_decreasing"
    bins: list[list[int]] = []
    load: list[float] = []
    out: list[list[int]] = []
    for i in idx.tolist():
        c = float(costs[i])
        if c > constraint.max_cost:
            out.append([i])
            continue
        chosen = -1
        for j in range(len(bins)):
            if constraint.fits(load[j], len(bins[j]), c):
                if not best:
                    chosen = j
                    break
                if chosen < 0 or load[j] > load[chosen]:
                    chosen = j
        if chosen < 0:
            bins.append([i])
            load.append(c)
        else:
            bins[chosen].append(i)
            load[chosen] += c
    return bins + out
