"""Sequence-length schedules: the per-image patch budget by epoch, the scheduled resize and
the sampler sizes it implies."""

from __future__ import annotations

import doctest
import pickle

import numpy as np
import pytest
import torch

import padless.loaders.schedules as schedules
from padless.loaders import BudgetSchedule, ScheduledResize, WebDatasetReader, budget_size, resize_to_budget
from padless.loaders.synthetic import write_shards


def test_docstring_examples():
    assert doctest.testmod(schedules, optionflags=doctest.ELLIPSIS).failed == 0


def test_piecewise_constant_and_linear():
    s = BudgetSchedule([(0, 16), (3, 64), (6, 256)])
    assert [s(e) for e in range(8)] == [16, 16, 16, 64, 64, 64, 256, 256]
    lin = BudgetSchedule([(0, 16), (4, 64)], interpolate=True)
    assert [lin(e) for e in range(6)] == [16, 28, 40, 52, 64, 64]
    assert BudgetSchedule([(0, 7)])(10**6) == 7
    assert "interpolate=True" in repr(lin) and "(4, 64)" in repr(lin)


def test_sizes_follow_budget_sizes():
    s = BudgetSchedule([(0, 16), (2, 100)])
    raw = [(480, 640), (33, 20), (16, 16)]
    for epoch in range(4):
        want = [budget_size(h, w, 8, s(epoch)) for h, w in raw]
        assert s.sizes(raw, 8, epoch).tolist() == [list(x) for x in want]


def test_scheduled_resize_changes_with_the_epoch_and_pickles():
    r = BudgetSchedule([(0, 4), (1, 64)]).resize(8)
    img = torch.rand(3, 120, 90)
    assert r.max_tokens == 4 and r(img).shape == resize_to_budget(img, 8, 4).shape
    r2 = pickle.loads(pickle.dumps(r))
    r2.set_epoch(1)
    assert r2.max_tokens == 64 and torch.equal(r2(img), resize_to_budget(img, 8, 64))
    assert r.epoch == 0 and "max_tokens=64" in repr(r2)


def test_scheduled_resize_in_a_reader(tmp_path):
    """The reader's worker copy sees the epoch set before the iterator starts."""
    shards = write_shards(str(tmp_path), num_shards=1, per_shard=4, low=40, high=80)
    resize = BudgetSchedule([(0, 4), (1, 36)]).resize(8)
    reader = WebDatasetReader(shards, fields={"image": "png;jpg"}, transform={"image": resize}, shuffle_shards=False)
    for epoch, budget in ((0, 4), (1, 36)):
        resize.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=1)
        shapes = [tuple(s["image"].shape[1:]) for s in loader]
        assert len(shapes) == 4 and all(h % 8 == 0 and w % 8 == 0 for h, w in shapes)
        grids = [(h // 8) * (w // 8) for h, w in shapes]
        assert max(grids) <= budget and (budget == 4 or max(grids) > 4)


@pytest.mark.parametrize(
    "milestones, match",
    [
        ([], "non-empty list of \\(start epoch, budget\\) pairs"),
        ("64", "non-empty list"),
        ([(0, 64, 1)], "milestone 0 must be a pair of ints"),
        ([(0, 1.5)], "milestone 0 must be a pair of ints"),
        ([(0, 0)], "milestone 0 has budget 0; a budget is at least 1 patch"),
        ([(0, 8), (5, 16), (5, 32)], "milestone 2 starts at 5, not after milestone 1 \\(5\\)"),
        ([(2, 8)], "first milestone starts at 2; start it at 0 .*\\[\\(0, 8\\)"),
    ],
)
def test_bad_milestones(milestones, match):
    with pytest.raises(ValueError, match=match):
        BudgetSchedule(milestones)


def test_bad_epoch_and_resize_arguments():
    s = BudgetSchedule([(0, 8)])
    with pytest.raises(ValueError, match="BudgetSchedule: epoch must be an int >= 0, got -1"):
        s(-1)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got 1.0"):
        s.resize(8).set_epoch(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ScheduledResize: patch must be an int >= 1, got 0"):
        s.resize(0)
    with pytest.raises(TypeError, match="ScheduledResize: schedule must be a BudgetSchedule, got dict"):
        ScheduledResize({0: 8}, 8)  # type: ignore[arg-type]
    assert isinstance(s(np.int64(3)), int)
