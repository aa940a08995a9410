"""Sequence-length schedules: the per-image token budget as a function of the epoch (or step).

Native-resolution ViT recipes (NaViT, FlexiViT-style progressive resizing) train first
on few patches per image, then on more. :class:`BudgetSchedule` says how many patches
an image may have at a given epoch; :meth:`BudgetSchedule.resize` is the reader's
``transform=`` that resizes every image to that budget at its own aspect
(:func:`~padless.loaders.transforms.resize_to_budget`), and
:meth:`BudgetSchedule.sizes` gives a map-style sampler the sizes after that resize
(:func:`~padless.loaders.transforms.budget_sizes`)::

    schedule = BudgetSchedule([(0, 64), (10, 256)])     # 64 patches for epochs 0-9, then 256
    resize = schedule.resize(patch=16)
    reader = WebDatasetReader(shards, fields={"image": "jpg;png", "label": "cls"},
                              transform={"image": resize})
    stream = BucketedStream(reader, StreamingBucketer(image_hw, PixelBudget(64 * 16 * 16 * 8)),
                            collate_fn=collator)
    for epoch in range(20):
        resize.set_epoch(epoch)      # before iter(loader): workers copy the reader then
        stream.set_epoch(epoch)
        for batch in DataLoader(stream, batch_size=None, num_workers=2): ...

With a fixed pixel budget per batch, a small per-image budget gives more images per
batch, so the step count per epoch stays about the same while each step is cheaper.
A step-based schedule is the same object called with the step number.

>>> s = BudgetSchedule([(0, 64), (10, 256)])
>>> s(0), s(9), s(10), s(99)
(64, 64, 256, 256)
>>> BudgetSchedule([(0, 64), (10, 256)], interpolate=True)(5)
160
>>> s.sizes([(480, 640)], patch=16, epoch=0).tolist(), s.sizes([(480, 640)], patch=16, epoch=10).tolist()
([[112, 144]], [[224, 288]])
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np
from torch import Tensor

from padless.loaders.transforms import budget_sizes, resize_to_budget

__all__ = ["BudgetSchedule", "ScheduledResize"]


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class BudgetSchedule:
    """Per-image patch budget by epoch: piecewise constant between milestones, or linear.

    Args:
        milestones: ``[(start, budget), ...]``: from epoch ``start`` on, the budget is
            ``budget`` patches per image. Starts are increasing ints, the first is 0;
            budgets are ints >= 1.
        interpolate: ramp linearly from one milestone's budget to the next (rounded
            down to an int) instead of jumping at each start.
    """

    def __init__(self, milestones: Sequence[tuple[int, int]], *, interpolate: bool = False) -> None:
        points = list(milestones) if isinstance(milestones, (list, tuple)) else None
        if not points:
            raise ValueError(
                f"BudgetSchedule: milestones must be a non-empty list of (start epoch, budget) pairs, got {milestones!r}"
            )
        starts: list[int] = []
        budgets: list[int] = []
        for i, p in enumerate(points):
            if not isinstance(p, (tuple, list)) or len(p) != 2 or not _is_int(p[0]) or not _is_int(p[1]):
                raise ValueError(f"BudgetSchedule: milestone {i} must be a pair of ints (start epoch, budget), got {p!r}")
            start, budget = int(p[0]), int(p[1])
            if budget < 1:
                raise ValueError(f"BudgetSchedule: milestone {i} has budget {budget}; a budget is at least 1 patch")
            if starts and start <= starts[-1]:
                raise ValueError(
                    f"BudgetSchedule: milestone {i} starts at {start}, not after milestone {i - 1} ({starts[-1]}); "
                    "list the milestones in increasing start order"
                )
            starts.append(start)
            budgets.append(budget)
        if starts[0] != 0:
            raise ValueError(
                f"BudgetSchedule: the first milestone starts at {starts[0]}; start it at 0 so every epoch has a "
                f"budget (e.g. [(0, {budgets[0]}), ...])"
            )
        self.starts, self.budgets, self.interpolate = starts, budgets, bool(interpolate)

    def __call__(self, epoch: int) -> int:
        """The per-image patch budget at ``epoch`` (an int >= 0; a step works the same way)."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"BudgetSchedule: epoch must be an int >= 0, got {epoch!r}")
        i = bisect.bisect_right(self.starts, int(epoch)) - 1
        if not self.interpolate or i + 1 == len(self.starts):
            return self.budgets[i]
        s0, s1, b0, b1 = self.starts[i], self.starts[i + 1], self.budgets[i], self.budgets[i + 1]
        return b0 + (b1 - b0) * (int(epoch) - s0) // (s1 - s0)

    def sizes(self, sizes: Any, patch: int, epoch: int, *, max_upsample: float | None = 1.0) -> np.ndarray:
        """``(N, 2)`` sizes after :meth:`resize` at ``epoch``: what a map-style sampler's costs
        should be computed from (``BudgetBatchSampler(schedule.sizes(folder.sizes(), 16, epoch), ...)``)."""
        return budget_sizes(sizes, patch, self(epoch), max_upsample=max_upsample)

    def resize(
        self, patch: int, *, max_upsample: float | None = 1.0, mode: str = "bilinear", antialias: bool = True
    ) -> "ScheduledResize":
        """A picklable ``(C, H, W)`` image transform resizing to this schedule's budget at its
        epoch (set with :meth:`ScheduledResize.set_epoch`)."""
        return ScheduledResize(self, patch, max_upsample=max_upsample, mode=mode, antialias=antialias)

    def __repr__(self) -> str:
        kind = ", interpolate=True" if self.interpolate else ""
        return f"BudgetSchedule({list(zip(self.starts, self.budgets))}{kind})"


class ScheduledResize:
    """``resize_to_budget(img, patch, schedule(epoch))`` with the epoch held here.

    Call :meth:`set_epoch` before each epoch's ``iter(loader)`` (next to the reader's
    ``set_epoch``): DataLoader workers copy the reader, and its transform, when the
    iterator starts, so with ``persistent_workers=True`` a new epoch does not reach them.
    """

    def __init__(
        self, schedule: BudgetSchedule, patch: int, *, max_upsample: float | None = 1.0, mode: str = "bilinear",
        antialias: bool = True,
    ) -> None:
        if not isinstance(schedule, BudgetSchedule):
            raise TypeError(f"ScheduledResize: schedule must be a BudgetSchedule, got {type(schedule).__name__}")
        if not _is_int(patch) or patch < 1:
            raise ValueError(f"ScheduledResize: patch must be an int >= 1, got {patch!r}")
        self.schedule, self.patch, self.max_upsample = schedule, int(patch), max_upsample
        self.mode, self.antialias = mode, antialias
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.schedule(epoch)  # validates
        self.epoch = int(epoch)

    @property
    def max_tokens(self) -> int:
        """The per-image patch budget at the current epoch."""
        return self.schedule(self.epoch)

    def __call__(self, img: Tensor) -> Tensor:
        return resize_to_budget(
            img, self.patch, self.max_tokens, max_upsample=self.max_upsample, mode=self.mode, antialias=self.antialias
        )

    def __repr__(self) -> str:
        return f"ScheduledResize({self.schedule!r}, patch={self.patch}, epoch={self.epoch}, max_tokens={self.max_tokens})"
