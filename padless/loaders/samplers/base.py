"""What every batch sampler shares: epochs, ranks, resumption, and the packing helpers.

A sampler computes the *global* list of batches of an epoch from ``(seed, epoch)``
alone, so every rank computes the same list; rank ``r`` of ``W`` takes batches
``r, r + W, r + 2W, ...``. Before that split the batch count is made a multiple
of ``W`` so every rank runs the same number of steps (DDP hangs otherwise):

* ``drop_last=False`` (default): the largest batches are split in two until the
  count divides; every sample still appears exactly once per epoch.
* ``drop_last=True``: the last ``count % W`` batches are dropped (and, for a
  fixed batch size, the short last batch).

Resumption: ``state_dict()`` records the epoch and how many of this rank's
batches were handed out; a sampler built with the same arguments that loads it
yields exactly the remaining batches on its next ``iter()``; later passes (and
every ``iter()`` of a sampler that loaded nothing) start the epoch from its
first batch. ``set_epoch`` with the epoch already loaded keeps the resume point,
so a training loop may call it unconditionally. A DataLoader asks its sampler for batches
ahead of the training loop (``prefetch_factor * num_workers``), so pass the
number of batches your loop actually finished: ``state_dict(batches_done=step)``.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from padless.loaders.constraints import Constraint, as_sizes, check_constraint, check_costs
from padless.loaders.distributed import rank_and_world_size

OVERSIZE = ("own_batch", "error")


class BatchSamplerBase(Sampler[list[int]]):
    """Deterministic, rank-aware, resumable batch sampler; subclasses build one epoch's batches."""

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        name = type(self).__name__
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{name}: seed must be an int, got {seed!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.epoch = 0
        self._done = 0
        self._restart_on_iter = True
        self._cache: tuple[int, list[list[int]]] | None = None
        self._global_cache: tuple[int, list[list[int]]] | None = None

    # ------------------------------------------------------------------ subclass hook

    def epoch_batches(self, rng: np.random.Generator) -> list[list[int]]:
        """All batches of one epoch, for all ranks, in order (deterministic given ``rng``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ public API

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (reshuffles). Setting the current epoch again keeps a loaded resume point."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"{type(self).__name__}.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch = epoch
            self._done = 0
            self._restart_on_iter = True

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches of ``epoch`` (default: the current one), cached per epoch."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        mine = [[int(i) for i in b] for b in self.global_batches(epoch)[self.rank :: self.world_size]]
        self._cache = (epoch, mine)
        return mine

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's batches of ``epoch``, interleaved: step ``s`` of rank ``r`` is entry ``s * world_size + r``.

        Every rank computes the same list from ``(seed, epoch)`` alone, with no
        communication; this is what lets a rank know the other ranks' batches (see
        :meth:`step_batches`)."""
        epoch = self.epoch if epoch is None else epoch
        if self._global_cache is not None and self._global_cache[0] == epoch:
            return self._global_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        glob = _balance(self.epoch_batches(rng), self.world_size, self.drop_last, type(self).__name__)
        self._global_cache = (epoch, glob)
        return glob

    def step_batches(self, step: int, epoch: int | None = None) -> list[list[int]]:
        """The batch every rank takes at ``step`` of ``epoch`` (rank order), computed locally.

        >>> from padless.loaders import BudgetBatchSampler, TokenBudget
        >>> r0 = BudgetBatchSampler([5, 3, 8, 2], TokenBudget(8), shuffle=False, rank=0, world_size=2)
        >>> r1 = BudgetBatchSampler([5, 3, 8, 2], TokenBudget(8), shuffle=False, rank=1, world_size=2)
        >>> r0.step_batches(0) == [r0.batches()[0], r1.batches()[0]]
        True
        """
        glob = self.global_batches(epoch)
        steps = len(glob) // self.world_size
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < steps:
            raise ValueError(f"{type(self).__name__}.step_batches: step must be an int in [0, {steps}), got {step!r}")
        return [[int(i) for i in b] for b in glob[step * self.world_size : (step + 1) * self.world_size]]

    def __len__(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        start = 0 if self._restart_on_iter else self._done  # a loaded state resumes once
        self._restart_on_iter = True
        for i in range(start, len(batches)):
            self._done = i + 1
            yield list(batches[i])

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """The resume point: epoch, seed and batches handed out on this rank (or ``batches_done``)."""
        done = self._done if batches_done is None else batches_done
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= len(self):
            raise ValueError(
                f"{type(self).__name__}.state_dict: batches_done must be an int in [0, {len(self)}], got {done!r}"
            )
        return {
            "sampler": type(self).__name__,
            "epoch": self.epoch,
            "seed": self.seed,
            "batches_done": done,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the batches after ``state['batches_done']``."""
        name = type(self).__name__
        missing = [k for k in ("epoch", "seed", "batches_done", "num_samples", "world_size") if k not in state]
        if missing:
            raise KeyError(f"{name}.load_state_dict: the state lacks {missing}; pass what state_dict() returned")
        for field, mine in (("sampler", name), ("num_samples", self.num_samples), ("world_size", self.world_size)):
            if field in state and state[field] != mine:
                raise ValueError(
                    f"{name}.load_state_dict: the state was saved with {field}={state[field]!r}, "
                    f"this sampler has {field}={mine!r}; build the sampler with the same data and arguments"
                )
        self.seed = int(state["seed"])
        self._cache = None
        self._global_cache = None
        self.epoch = int(state["epoch"])
        done = int(state["batches_done"])
        if not 0 <= done <= len(self):
            raise ValueError(f"{name}.load_state_dict: batches_done={done} is outside [0, {len(self)}] for epoch {self.epoch}")
        self._done = done
        self._restart_on_iter = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.world_size})"
        )


class SizedSamplerBase(BatchSamplerBase):
    """A sampler that knows every sample's size and cost under a constraint."""

    def __init__(self, sizes: Any, constraint: Constraint, *, oversize: str = "own_batch", **kw: Any) -> None:
        name = type(self).__name__
        check_constraint(constraint, name)
        if oversize not in OVERSIZE:
            raise ValueError(f"{name}: oversize must be one of {OVERSIZE}, got {oversize!r}")
        self.sizes = as_sizes(sizes, f"{name}: sizes")
        super().__init__(len(self.sizes), **kw)
        self.constraint = constraint
        self.oversize = oversize
        self.costs = constraint.costs(self.sizes).astype(np.float64)
        check_costs(self.costs, constraint, name)
        over = np.flatnonzero(self.costs > constraint.max_cost)
        if len(over) and oversize == "error":
            i = int(over[0])
            raise ValueError(
                f"{name}: sample {i} (size {tuple(self.sizes[i].tolist())}) costs {self.costs[i]:g}, over the budget "
                f"{constraint!r} ({len(over)} sample(s) are over); raise the budget, filter the sample out, "
                f"or pass oversize='own_batch' to give each its own batch"
            )

    def global_tokens(self, steps: int | Sequence[int], epoch: int | None = None) -> int:
        """Real elements (the product of each sample's size: tokens, pixels) in every rank's
        batches at ``steps`` (one step, or the micro-steps of one accumulated update).

        This is the denominator of a loss averaged over all real tokens of a data-parallel
        step, known on every rank without an all-reduce: see ``padless.distributed``.

        >>> from padless.loaders import BudgetBatchSampler, TokenBudget
        >>> lengths = [5, 3, 8, 2]
        >>> s = BudgetBatchSampler(lengths, TokenBudget(8), shuffle=False, rank=0, world_size=2)
        >>> s.global_tokens(0) == sum(lengths[i] for b in s.step_batches(0) for i in b)
        True
        """
        steps = [steps] if isinstance(steps, int) else list(steps)
        elements = self.sizes.prod(axis=1)
        return int(sum(int(elements[i]) for s in steps for b in self.step_batches(s, epoch) for i in b))


def next_fit(order: np.ndarray, costs: np.ndarray, constraint: Constraint) -> list[list[int]]:
    """Fill batches in ``order``; start a new one when the next sample does not fit.

    A sample over the budget gets a batch of its own (never dropped).

    >>> from padless.loaders.constraints import TokenBudget
    >>> next_fit(np.arange(4), np.array([3.0, 3.0, 9.0, 1.0]), TokenBudget(6))
    [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    cost = 0.0
    for i in order.tolist():
        c = float(costs[i])
        if cur and not constraint.fits(cost, len(cur), c):
            out.append(cur)
            cur, cost = [], 0.0
        cur.append(i)
        cost += c
    if cur:
        out.append(cur)
    return out


def _balance(batches: list[list[int]], world_size: int, drop_last: bool, name: str) -> list[list[int]]:
    """Make the batch count a multiple of ``world_size`` (see the module docstring)."""
    if world_size == 1 or len(batches) % world_size == 0:
        return batches
    if drop_last:
        return batches[: len(batches) - len(batches) % world_size]
    batches = [list(b) for b in batches]
    while len(batches) % world_size:
        j = max(range(len(batches)), key=lambda k: (len(batches[k]), -k))
        b = batches[j]
        if len(b) < 2:
            n = sum(len(x) for x in batches)
            raise ValueError(
                f"{name}: {n} sample(s) cannot fill {world_size} ranks with the same number of batches; "
                f"use fewer ranks, more data, or drop_last=True"
            )
        h = (len(b) + 1) // 2
        batches[j : j + 1] = [b[:h], b[h:]]
    return batches
