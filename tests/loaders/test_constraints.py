"""Constraint objects and the argument checks of samplers and streams (each message once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from padless.loaders import (
    BatchSize,
    BucketBatchSampler,
    BucketedStream,
    BudgetBatchSampler,
    Constraint,
    CostFn,
    PairBudget,
    PixelBudget,
    RandomBatchSampler,
    Shuffle,
    StreamingBucketer,
    TokenBudget,
    as_sizes,
)
from padless.loaders.constraints import estimate_boundaries


class FrameBudget(Constraint):
    """A new cost is one class: 100 frames per second of audio."""

    def costs(self, sizes: np.ndarray) -> np.ndarray:
        return sizes[:, 0] * 100.0


def test_costs() -> None:
    sizes = as_sizes([(3, 4), (5, 6)])
    assert TokenBudget(10).costs(sizes).tolist() == [12.0, 30.0]
    assert PixelBudget(10).costs(sizes).tolist() == [12.0, 30.0]
    assert PixelBudget(10, patch_size=4).costs(sizes).tolist() == [1.0, 4.0]
    assert PairBudget(10).costs(as_sizes([3, 5])).tolist() == [9.0, 25.0]
    assert BatchSize(2).costs(sizes).tolist() == [1.0, 1.0]
    s = BudgetBatchSampler([1, 2, 3, 4], FrameBudget(500), shuffle=False)
    assert all(sum((i + 1) * 100 for i in b) <= 500 for b in s)


def test_as_sizes_accepts_tensors_and_arrays() -> None:
    assert as_sizes(torch.tensor([3, 4])).tolist() == [[3], [4]]
    assert as_sizes(np.array([[1, 2]], dtype=np.int32)).dtype == np.int64


def test_constraint_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="every sample needs a size of the same rank"):
        as_sizes([(1, 2), (3,)])
    with pytest.raises(ValueError, match="sizes must be whole numbers"):
        as_sizes([1.5, 2.0])
    with pytest.raises(ValueError, match="expected one length or one shape tuple per sample"):
        as_sizes(np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="PixelBudget: sizes must be \\(H, W\\) per sample, got 1 number"):
        PixelBudget(10).costs(as_sizes([3]))
    with pytest.raises(ValueError, match="PixelBudget: patch_size must be an int >= 1 or None, got 0"):
        PixelBudget(10, patch_size=0)
    with pytest.raises(TypeError, match="CostFn: fn must be callable, got int"):
        CostFn(3, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TokenBudget: max_samples must be an int >= 1 or None, got 0"):
        TokenBudget(10, max_samples=0)
    with pytest.raises(ValueError, match="BatchSize: batch_size must be an int >= 1, got 0"):
        BatchSize(0)
    with pytest.raises(ValueError, match="num_buckets must be an int >= 1, got 0"):
        estimate_boundaries(np.arange(4.0), 0)


def test_sampler_and_stream_argument_errors() -> None:
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        BudgetBatchSampler([1], TokenBudget(4), window=0)
    with pytest.raises(ValueError, match="oversize must be one of \\('own_batch', 'error'\\), got 'drop'"):
        BudgetBatchSampler([1], TokenBudget(4), oversize="drop")
    with pytest.raises(ValueError, match="BucketBatchSampler: pass exactly one of batch_size= or constraint="):
        BucketBatchSampler([1, 2])
    with pytest.raises(ValueError, match="key\\(sizes\\) must return one number per sample"):
        BucketBatchSampler([1, 2], 2, key=lambda s: s[:1, 0])
    with pytest.raises(TypeError, match="seed must be an int"):
        RandomBatchSampler(4, 2, seed="a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batches_done must be an int in \\[0, 2\\], got 5"):
        RandomBatchSampler(4, 2).state_dict(batches_done=5)
    s = RandomBatchSampler(4, 2).state_dict()
    s["batches_done"] = 9
    with pytest.raises(ValueError, match="batches_done=9 is outside \\[0, 2\\] for epoch 0"):
        RandomBatchSampler(4, 2).load_state_dict(s)
    with pytest.raises(TypeError, match="StreamingBucketer: constraint must be a padless.loaders.Constraint"):
        StreamingBucketer(len, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StreamingBucketer: buffer_size must be an int >= 1, got 0"):
        StreamingBucketer(len, TokenBudget(4), buffer_size=0)
    with pytest.raises(ValueError, match="StreamingBucketer: oversize must be 'own_batch' or 'error'"):
        StreamingBucketer(len, TokenBudget(4), oversize="drop")
    with pytest.raises(ValueError, match="BucketedStream: epoch_batches must be an int >= 1 or None, got 0"):
        BucketedStream([], StreamingBucketer(len, TokenBudget(4)), epoch_batches=0)
    with pytest.raises(ValueError, match="Shuffle: size must be an int >= 0, got -1"):
        Shuffle(-1)


def test_bucket_key_can_be_user_defined() -> None:
    sizes = [(2, 50), (50, 2), (3, 3), (4, 4)]
    s = BucketBatchSampler(sizes, 2, boundaries=[10], key=lambda a: a[:, 0])  # bucket by height only
    assert s.bucket_counts() == [3, 1]


def test_costs_that_overflow_int64_are_refused_naming_the_sample() -> None:
    """Issue 13: a size of (2**32, 2**32) once wrapped to a cost of 0 and joined a TokenBudget(20) batch."""
    sizes = [(3, 3), (2**32, 2**32), (2, 2)]
    msg = r"TokenBudget: sample 1 \(size \(4294967296, 4294967296\)\) has 18446744073709551616 elements, past the int64 range"
    with pytest.raises(ValueError, match=msg):
        BudgetBatchSampler(sizes, TokenBudget(20), shuffle=False)
    with pytest.raises(ValueError, match="PairBudget: sample 1 .* past the int64 range"):
        PairBudget(20).costs(as_sizes(sizes))
    with pytest.raises(ValueError, match="PixelBudget: sample 1 .* past the int64 range"):
        PixelBudget(20).costs(as_sizes(sizes))
    with pytest.raises(ValueError, match="bucket key: sample 1 .* past the int64 range"):
        BucketBatchSampler(sizes, 2)
    with pytest.raises(ValueError, match=r"StreamingBucketer: sample 1 of the stream \(size \(1099511627776, 1073741824\)\): .* past the int64 range"):
        list(StreamingBucketer(lambda s: s, TokenBudget(20))([(2, 3), (2**40, 2**30)]))
    # big but representable: a cost of its own, never wrapped
    assert TokenBudget(20).costs(as_sizes([(2**31, 2**31)])).tolist() == [2.0**62]
    assert PairBudget(20).costs(as_sizes([2**40])).tolist() == [2.0**80]


def test_sizes_past_int64_are_refused_not_wrapped() -> None:
    with pytest.raises(ValueError, match=r"sizes: sample 1 has a size \(1180591620717411303424,\) past the int64 range"):
        as_sizes([3, 2**70])
    with pytest.raises(ValueError, match=r"sizes: sample 0 has a size \(1\.1805916207174113e\+21,\) past the int64 range"):
        as_sizes([2.0**70])
    with pytest.raises(ValueError, match=r"sizes: sample 0 has a size \(18446744073709551615,\) past the int64 range"):
        as_sizes(np.array([2**64 - 1], dtype=np.uint64))


def test_a_number_for_a_constraint_names_the_class_to_wrap_it_in():
    msg = r"got the int 64; for a budget of 64 elements per batch pass TokenBudget\(64\).*BatchSize\(64\)"
    with pytest.raises(TypeError, match="BudgetBatchSampler: constraint must be a padless.loaders.Constraint, " + msg):
        BudgetBatchSampler([3, 4], 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RandomBatchSampler: .*" + msg):
        RandomBatchSampler(10, constraint=64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BucketBatchSampler: .*" + msg):
        BucketBatchSampler([3, 4], constraint=64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StreamingBucketer: .*" + msg):
        StreamingBucketer(len, 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the float 64.5; .* pass TokenBudget\(64.5\) .*N_i\^2\)$"):
        BudgetBatchSampler([3, 4], 64.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="constraint must be a padless.loaders.Constraint, got str$"):
        BudgetBatchSampler([3, 4], "64")  # type: ignore[arg-type]
