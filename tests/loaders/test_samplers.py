"""One suite over every sampler: coverage per epoch across ranks, determinism, resume, pickling, DataLoader."""

from __future__ import annotations

import json
import pickle
from typing import Callable

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

from padless.loaders import (
    BatchSamplerBase,
    BatchSize,
    BucketBatchSampler,
    BudgetBatchSampler,
    CostFn,
    PairBudget,
    RandomBatchSampler,
    TokenBudget,
)
from padless.loaders.synthetic import token_lengths

LENGTHS = token_lengths(103, seed=1, mean=3.0, sigma=0.8, high=120)
IMAGE_SIZES = np.stack([token_lengths(103, seed=2, mean=3.0, high=64), token_lengths(103, seed=3, mean=3.0, high=64)], 1)


def quadratic_plus_one(size: tuple[int, ...]) -> float:
    return size[0] ** 2 + 1.0


Factory = Callable[..., BatchSamplerBase]
SAMPLERS: dict[str, Factory] = {
    "random_batch_size": lambda **kw: RandomBatchSampler(len(LENGTHS), 8, **kw),
    "random_budget": lambda **kw: RandomBatchSampler(LENGTHS, constraint=TokenBudget(256), **kw),
    "bucket_batch_size": lambda **kw: BucketBatchSampler(LENGTHS, 8, num_buckets=4, **kw),
    "bucket_budget_boundaries": lambda **kw: BucketBatchSampler(
        LENGTHS, constraint=TokenBudget(300, max_samples=16), boundaries=[10, 20, 40], **kw
    ),
    "budget_tokens_ffd": lambda **kw: BudgetBatchSampler(LENGTHS, TokenBudget(256), window=40, **kw),
    "budget_pairs_best_fit": lambda **kw: BudgetBatchSampler(LENGTHS, PairBudget(4096), packing="best_fit", **kw),
    "budget_user_cost_bfd": lambda **kw: BudgetBatchSampler(
        LENGTHS, CostFn(quadratic_plus_one, 5000), packing="best_fit_decreasing", **kw
    ),
    "budget_pixels": lambda **kw: BudgetBatchSampler(IMAGE_SIZES, TokenBudget(8192), **kw),
}
NAMES = list(SAMPLERS)


def all_ranks(name: str, world_size: int, **kw) -> list[list[list[int]]]:
    return [list(SAMPLERS[name](rank=r, world_size=world_size, **kw)) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_every_sample_once_per_epoch_across_ranks(name: str, world_size: int) -> None:
    for epoch in (0, 1):
        per_rank = all_ranks(name, world_size) if epoch == 0 else []
        if epoch:
            for r in range(world_size):
                s = SAMPLERS[name](rank=r, world_size=world_size)
                s.set_epoch(epoch)
                per_rank.append(list(s))
        seen = sorted(i for batches in per_rank for b in batches for i in b)
        assert seen == list(range(len(LENGTHS)))
        counts = {len(b) for b in per_rank}
        assert len(counts) == 1, f"ranks got different batch counts: {[len(b) for b in per_rank]}"
        assert all(len(b) > 0 for batches in per_rank for b in batches)


@pytest.mark.parametrize("name", NAMES)
def test_drop_last_keeps_ranks_equal_and_disjoint(name: str) -> None:
    per_rank = all_ranks(name, 4, drop_last=True)
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat))
    assert len({len(b) for b in per_rank}) == 1


@pytest.mark.parametrize("name", NAMES)
def test_len_matches_iteration(name: str) -> None:
    for ws in (1, 3):
        s = SAMPLERS[name](rank=ws - 1, world_size=ws)
        assert len(s) == len(list(s))


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_and_epoch_give_identical_batches(name: str) -> None:
    a, b = SAMPLERS[name](seed=7), SAMPLERS[name](seed=7)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    c = SAMPLERS[name](seed=7)
    c.set_epoch(4)
    assert list(c) != list(a)
    d = SAMPLERS[name](seed=8)
    d.set_epoch(3)
    assert list(d) != list(a)
    assert list(a) == list(a)  # a second pass over the same epoch repeats it


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_resume_from_any_point_gives_the_remaining_batches(name: str, world_size: int) -> None:
    rank = world_size - 1
    ref = SAMPLERS[name](rank=rank, world_size=world_size, seed=5)
    ref.set_epoch(2)
    full = list(ref)
    for k in range(len(full) + 1):
        s = SAMPLERS[name](rank=rank, world_size=world_size, seed=5)
        s.set_epoch(2)
        it = iter(s)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(s.state_dict()))  # plain data
        fresh = SAMPLERS[name](rank=rank, world_size=world_size)  # seed and epoch come from the state
        fresh.load_state_dict(state)
        fresh.set_epoch(2)  # a training loop re-setting the same epoch keeps the resume point
        assert head + list(fresh) == full
        assert list(fresh) == full  # after the resumed pass, the epoch replays in full


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_with_batches_done_from_the_training_loop(name: str) -> None:
    s = SAMPLERS[name]()
    full = list(s)
    state = s.state_dict(batches_done=3)  # the DataLoader prefetched further than the loop got
    t = SAMPLERS[name]()
    t.load_state_dict(state)
    assert list(t) == full[3:]


@pytest.mark.parametrize("name", NAMES)
def test_pickling(name: str) -> None:
    s = SAMPLERS[name](seed=3, rank=1, world_size=2)
    s.set_epoch(1)
    t = pickle.loads(pickle.dumps(s))
    assert list(t) == list(s)


class IndexDataset(Dataset):
    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> int:
        return i


def as_list(batch: list[int]) -> list[int]:
    return list(batch)


@pytest.mark.parametrize("name", NAMES)
def test_dataloader_with_two_workers(name: str) -> None:
    s = SAMPLERS[name](seed=11)
    expected = list(s)
    loader = DataLoader(IndexDataset(), batch_sampler=s, num_workers=2, collate_fn=as_list)
    assert list(loader) == expected


@pytest.mark.parametrize("name", [n for n in NAMES if "batch_size" not in n])
def test_batches_respect_the_budget(name: str) -> None:
    s = SAMPLERS[name]()
    for b in s:
        cost = s.costs[b].sum()
        limit = s.constraint
        assert len(b) == 1 or cost <= limit.max_cost
        assert limit.max_samples is None or len(b) <= limit.max_samples


def test_world_size_from_torch_distributed(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        s = RandomBatchSampler(10, 3)
        assert (s.rank, s.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()


def test_bucketing_narrows_the_spread_of_lengths() -> None:
    def spread(s: BatchSamplerBase) -> float:
        return float(np.mean([LENGTHS[b].max() - LENGTHS[b].min() for b in s if len(b) > 1]))

    assert spread(BucketBatchSampler(LENGTHS, 8, num_buckets=8)) < 0.5 * spread(RandomBatchSampler(len(LENGTHS), 8))


def test_bucket_boundaries_estimated_from_lengths() -> None:
    s = BucketBatchSampler(LENGTHS, 8, num_buckets=4)
    assert len(s.boundaries) == 3
    counts = s.bucket_counts()
    assert sum(counts) == len(LENGTHS) and max(counts) - min(counts) < len(LENGTHS) // 4


def test_budget_packing_is_tight() -> None:
    s = BudgetBatchSampler(LENGTHS, TokenBudget(256), window=len(LENGTHS))
    lower = int(np.ceil(LENGTHS.sum() / 256))
    assert len(s) <= lower + 1


def test_budget_sampler_without_shuffle_is_first_fit_decreasing() -> None:
    lengths = [6, 5, 4, 3, 2, 1, 9]
    s = BudgetBatchSampler(lengths, TokenBudget(10), shuffle=False)
    assert [[lengths[i] for i in b] for b in s] == [[9, 1], [6, 4], [5, 3, 2]]


@pytest.mark.parametrize(
    "make",
    [
        lambda o: BudgetBatchSampler([3, 50, 4], TokenBudget(10), oversize=o),
        lambda o: BucketBatchSampler([3, 50, 4], constraint=TokenBudget(10), oversize=o),
        lambda o: RandomBatchSampler([3, 50, 4], constraint=TokenBudget(10), oversize=o),
    ],
)
def test_over_budget_sample_gets_its_own_batch_or_an_error(make) -> None:
    batches = list(make("own_batch"))
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"sample 1 \(size \(50,\)\) costs 50, over the budget TokenBudget\(10\).*oversize='own_batch'"):
        make("error")


def test_load_state_dict_refuses_a_different_setup() -> None:
    s = RandomBatchSampler(10, 3, world_size=2, rank=0)
    with pytest.raises(ValueError, match="saved with world_size=2, this sampler has world_size=1"):
        RandomBatchSampler(10, 3).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="saved with num_samples=10, this sampler has num_samples=11"):
        RandomBatchSampler(11, 3, world_size=2, rank=0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="saved with sampler='RandomBatchSampler', this sampler has sampler='BudgetBatchSampler'"):
        BudgetBatchSampler([1] * 10, BatchSize(3), world_size=2, rank=0).load_state_dict(s.state_dict())
    with pytest.raises(KeyError, match=r"lacks \['batches_done'\]"):
        RandomBatchSampler(10, 3).load_state_dict({"epoch": 0, "seed": 0, "num_samples": 10, "world_size": 1})


def test_argument_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="exactly one of batch_size= or constraint="):
        RandomBatchSampler(10)
    with pytest.raises(ValueError, match="needs one size per sample; pass sizes instead of a count"):
        RandomBatchSampler(10, constraint=TokenBudget(5))
    with pytest.raises(ValueError, match="packing must be one of"):
        BudgetBatchSampler([1, 2], TokenBudget(5), packing="worst_fit")
    with pytest.raises(ValueError, match="rank must be an int in \\[0, world_size=2\\), got 2"):
        RandomBatchSampler(10, 3, rank=2, world_size=2)
    with pytest.raises(ValueError, match="sample 1 has a negative size"):
        BudgetBatchSampler([1, -2], TokenBudget(5))
    with pytest.raises(ValueError, match="3 sample\\(s\\) cannot fill 4 ranks"):
        list(RandomBatchSampler(3, 2, world_size=4, rank=0))
    with pytest.raises(ValueError, match="boundaries must increase strictly"):
        BucketBatchSampler([1, 2], 2, boundaries=[5, 5])
    with pytest.raises(TypeError, match="constraint must be a padless.loaders.Constraint"):
        BudgetBatchSampler([1, 2], 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the budget must be a positive number, got 0"):
        TokenBudget(0)
    with pytest.raises(ValueError, match="the cost of sample 0 \\(size \\(2,\\)\\) is -1"):
        BudgetBatchSampler([2], CostFn(lambda s: -1.0, 5))
    with pytest.raises(ValueError, match="set_epoch: epoch must be an int >= 0"):
        RandomBatchSampler(4, 2).set_epoch(-1)
