"""Batch rules: which samples may share one batch.

A constraint gives every sample an additive cost (computed once, vectorised, from
its size) and caps the cost of a batch, and optionally its number of samples.
Samplers only talk to this interface, so a new cost is one small class::

    class FrameBudget(Constraint):
        '''Audio frames at 100 Hz from durations in seconds.'''
        def costs(self, sizes):
            return sizes[:, 0] * 100.0

Sizes are an int64 array ``(N, k)``: one row per sample, e.g. ``(L_i,)`` for
token sequences, ``(H_i, W_i)`` for images, ``(N_i,)`` for pair models.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

INT64_MAX = int(np.iinfo(np.int64).max)


def as_sizes(sizes: Any, what: str = "sizes") -> np.ndarray:
    """Normalise per-sample sizes to an int64 array ``(N, k)``.

    Accepts a sequence of ints (lengths), of tuples (shapes), a numpy array or a tensor.

    >>> as_sizes([3, 5]).tolist()
    [[3], [5]]
    >>> as_sizes([(2, 4), (6, 8)]).shape
    (2, 2)
    """
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.detach().cpu().numpy()
    try:
        arr = np.asarray(sizes)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"{what}: every sample needs a size of the same rank ({e})") from None
    if arr.dtype == object:
        if arr.ndim in (1, 2) and arr.size and all(isinstance(v, (int, np.integer)) for v in arr.flat):
            rows = [tuple(int(v) for v in r) for r in arr.reshape(len(arr), -1)]
            i = next((i for i, r in enumerate(rows) if any(abs(v) > INT64_MAX for v in r)), 0)
            raise ValueError(f"{what}: sample {i} has a size {rows[i]} past the int64 range; the size is likely wrong")
        raise ValueError(f"{what}: every sample needs a size of the same rank (got mixed tuples)")
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError(f"{what}: expected one length or one shape tuple per sample, got an array of shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{what}: sizes must be whole numbers, got dtype {arr.dtype}")
    in_range = arr < 2.0**63 if np.issubdtype(arr.dtype, np.floating) else arr <= INT64_MAX
    if arr.size and not np.all(in_range):
        i = int(np.argwhere(~in_range)[0, 0])
        raise ValueError(f"{what}: sample {i} has a size {tuple(arr[i].tolist())} past the int64 range; the size is likely wrong")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argwhere(arr < 0)[0, 0])
        raise ValueError(f"{what}: sample {i} has a negative size {tuple(arr[i].tolist())}")
    return arr


def element_counts(sizes: np.ndarray, what: str) -> np.ndarray:
    """The number of elements of each sample (the product of its size), int64, refusing a product
    past the int64 range instead of wrapping it into a small number.

    >>> element_counts(as_sizes([(3, 4), (0, 9)]), "TokenBudget").tolist()
    [12, 0]
    >>> element_counts(as_sizes([(2, 3), (2**32, 2**32)]), "TokenBudget")
    Traceback (most recent call last):
    ...
    ValueError: TokenBudget: sample 1 (size (4294967296, 4294967296)) has 18446744073709551616 elements, past the int64 range (2**63 - 1); the size is likely wrong
    """
    approx = sizes.astype(np.float64).prod(axis=1)  # no wrap-around; close enough to find suspects
    for i in np.flatnonzero(approx >= 2.0**62).tolist():
        n = math.prod(sizes[i].tolist())  # exact
        if n > INT64_MAX:
            raise ValueError(
                f"{what}: sample {i} (size {tuple(sizes[i].tolist())}) has {n} elements, past the int64 range "
                "(2**63 - 1); the size is likely wrong"
            )
    return sizes.prod(axis=1)


class Constraint:
    """Additive cost per sample, at most ``max_cost`` per batch and ``max_samples`` samples.

    Subclasses override :meth:`costs`. The default cost is one per sample.

    >>> c = Constraint(max_cost=4)
    >>> c.fits(batch_cost=3.0, batch_count=3, cost=1.0), c.fits(4.0, 4, 1.0)
    (True, False)
    """

    def __init__(self, max_cost: float, *, max_samples: int | None = None) -> None:
        name = type(self).__name__
        if isinstance(max_cost, bool) or not isinstance(max_cost, (int, float)) or not max_cost > 0:
            raise ValueError(f"{name}: the budget must be a positive number, got {max_cost!r}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1):
            raise ValueError(f"{name}: max_samples must be an int >= 1 or None, got {max_samples!r}")
        self.max_cost = float(max_cost)
        self.max_samples = max_samples

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        """The cost of each sample, float64 ``(N,)``, from sizes ``(N, k)``."""
        return np.ones(len(sizes), dtype=np.float64)

    def fits(self, batch_cost: float, batch_count: int, cost: float) -> bool:
        """Whether a sample of ``cost`` may join a batch holding ``batch_count`` samples of ``batch_cost``."""
        if self.max_samples is not None and batch_count + 1 > self.max_samples:
            return False
        return batch_cost + cost <= self.max_cost

    def __repr__(self) -> str:
        extra = f", max_samples={self.max_samples}" if self.max_samples is not None else ""
        return f"{type(self).__name__}({self.max_cost:g}{extra})"


class BatchSize(Constraint):
    """A fixed number of samples per batch.

    >>> BatchSize(2).costs(as_sizes([7, 9, 1])).tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"BatchSize: batch_size must be an int >= 1, got {batch_size!r}")
        super().__init__(batch_size, max_samples=batch_size)


class TokenBudget(Constraint):
    """Elements per batch: the product of each sample's size (tokens for ``(L_i,)``).

    >>> TokenBudget(100).costs(as_sizes([7, 9])).tolist()
    [7.0, 9.0]
    """

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        return element_counts(sizes, type(self).__name__).astype(np.float64)


class PixelBudget(TokenBudget):
    """Pixels per batch, from ``(H_i, W_i)`` sizes; with ``patch_size`` p, patches ``ceil(H/p)*ceil(W/p)``.

    >>> PixelBudget(1000, patch_size=16).costs(as_sizes([(32, 48)])).tolist()
    [6.0]
    """

    def __init__(self, max_pixels: float, *, patch_size: int | None = None, max_samples: int | None = None) -> None:
        super().__init__(max_pixels, max_samples=max_samples)
        if patch_size is not None and (not isinstance(patch_size, int) or patch_size < 1):
            raise ValueError(f"PixelBudget: patch_size must be an int >= 1 or None, got {patch_size!r}")
        self.patch_size = patch_size

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        if sizes.shape[1] < 2:
            raise ValueError(f"PixelBudget: sizes must be (H, W) per sample, got {sizes.shape[1]} number(s) per sample")
        hw = sizes[:, -2:]
        if self.patch_size:
            hw = -(-hw // self.patch_size)
        return element_counts(hw, "PixelBudget").astype(np.float64)


class PairBudget(Constraint):
    """``sum(N_i^2)`` per batch, for pair models whose state is ``(N_i, N_i, C)``.

    >>> PairBudget(100).costs(as_sizes([3, 5])).tolist()
    [9.0, 25.0]
    """

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        n = element_counts(sizes, "PairBudget").astype(np.float64)
        return n * n


class CostFn(Constraint):
    """A user cost: ``fn(size_tuple) -> float`` for each sample (a module-level function pickles).

    >>> CostFn(lambda s: s[0] * 2 + 1, 50).costs(as_sizes([3, 4])).tolist()
    [7.0, 9.0]
    """

    def __init__(self, fn: Callable[[tuple[int, ...]], float], max_cost: float, *, max_samples: int | None = None) -> None:
        super().__init__(max_cost, max_samples=max_samples)
        if not callable(fn):
            raise TypeError(f"CostFn: fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        out = np.empty(len(sizes), dtype=np.float64)
        for i, row in enumerate(sizes.tolist()):
            c = float(self.fn(tuple(row)))
            if not (c >= 0 and math.isfinite(c)):
                raise ValueError(f"CostFn: the cost of sample {i} (size {tuple(row)}) is {c}; costs must be finite and >= 0")
            out[i] = c
        return out


def batch_rule(owner: str, batch_size: int | None, constraint: Constraint | None) -> Constraint:
    """The constraint a sampler uses: ``BatchSize(batch_size)`` or the given one (exactly one)."""
    if (batch_size is None) == (constraint is None):
        raise ValueError(f"{owner}: pass exactly one of batch_size= or constraint=")
    return check_constraint(constraint, owner) if constraint is not None else BatchSize(batch_size)  # type: ignore[arg-type]


def check_constraint(constraint: Any, owner: str) -> Constraint:
    """``constraint`` if it is a :class:`Constraint`; a number gets a message naming the class to wrap it in.

    >>> check_constraint(64, "BudgetBatchSampler")
    Traceback (most recent call last):
    ...
    TypeError: BudgetBatchSampler: constraint must be a padless.loaders.Constraint, got the int 64; for a budget of 64 elements per batch pass TokenBudget(64) (PixelBudget(64) for pixels, PairBudget(64) for sum N_i^2), or BatchSize(64) for 64 samples per batch
    """
    if isinstance(constraint, Constraint):
        return constraint
    if isinstance(constraint, (int, float, np.integer, np.floating)) and not isinstance(constraint, bool):
        whole = not isinstance(constraint, (float, np.floating))
        n = str(int(constraint)) if whole else f"{constraint:g}"
        count = f", or BatchSize({n}) for {n} samples per batch" if whole else ""
        raise TypeError(
            f"{owner}: constraint must be a padless.loaders.Constraint, got the {type(constraint).__name__} {n}; "
            f"for a budget of {n} elements per batch pass TokenBudget({n}) (PixelBudget({n}) for pixels, "
            f"PairBudget({n}) for sum N_i^2){count}"
        )
    raise TypeError(f"{owner}: constraint must be a padless.loaders.Constraint, got {type(constraint).__name__}")


def check_costs(costs: np.ndarray, constraint: Constraint, what: str) -> None:
    """Reject negative or non-finite costs from a custom constraint."""
    if len(costs) and not (np.all(np.isfinite(costs)) and costs.min() >= 0):
        i = int(np.argwhere(~(np.isfinite(costs) & (costs >= 0)))[0, 0])
        raise ValueError(f"{what}: {constraint!r} gives sample {i} the cost {costs[i]}; costs must be finite and >= 0")


def bucket_keys(sizes: np.ndarray, key: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """The scalar each sample is bucketed by: the number of elements, or ``key(sizes)``."""
    if key is None:
        return element_counts(sizes, "bucket key").astype(np.float64)
    out = np.asarray(key(sizes), dtype=np.float64)
    if out.shape != (len(sizes),):
        raise ValueError(f"bucket key: key(sizes) must return one number per sample, shape ({len(sizes)},); got {out.shape}")
    return out


def estimate_boundaries(keys: np.ndarray, num_buckets: int) -> list[float]:
    """Bucket boundaries at the quantiles of ``keys`` (duplicates removed).

    >>> estimate_boundaries(np.arange(100.0), 4)
    [24.75, 49.5, 74.25]
    """
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets must be an int >= 1, got {num_buckets!r}")
    if len(keys) == 0 or num_buckets == 1:
        return []
    q = np.quantile(keys, np.arange(1, num_buckets) / num_buckets)
    return sorted(set(float(x) for x in q))


def validate_boundaries(boundaries: Sequence[float]) -> list[float]:
    b = [float(x) for x in boundaries]
    for i in range(1, len(b)):
        if not b[i] > b[i - 1]:
            raise ValueError(f"boundaries must increase strictly: boundaries[{i - 1}]={b[i - 1]:g} >= boundaries[{i}]={b[i]:g}")
    return b
