"""Streaming stages on plain lists: bucketer, fixed length, shuffle; and the optional-dependency message."""

from __future__ import annotations

import random
import sys

import pytest
from torch.utils.data import DataLoader

from padless.loaders import BatchSize, BucketedStream, PairBudget, StreamingBucketer, TokenBudget, fixed_length, shuffle_buffer
from padless.loaders.synthetic import token_lengths

LENGTHS = token_lengths(300, seed=9, mean=3.0, high=100).tolist()


def ident(x: int) -> int:
    return x


def test_bucketer_emits_every_sample_once_within_budget() -> None:
    b = StreamingBucketer(ident, TokenBudget(200), boundaries=[10, 20, 40], buffer_size=50)
    batches = list(b(LENGTHS))
    assert sorted(x for bt in batches for x in bt) == sorted(LENGTHS)
    assert all(sum(bt) <= 200 for bt in batches)


def test_bucketer_groups_similar_lengths() -> None:
    def spread(batches):
        return sum(max(b) - min(b) for b in batches) / len(batches)

    bucketed = list(StreamingBucketer(ident, BatchSize(8), boundaries=[10, 20, 40], buffer_size=64)(LENGTHS))
    plain = [LENGTHS[i : i + 8] for i in range(0, len(LENGTHS), 8)]
    assert spread(bucketed) < 0.5 * spread(plain)


def test_bucketer_oversize_own_batch_or_error() -> None:
    b = StreamingBucketer(ident, PairBudget(100), oversize="own_batch")
    assert list(b([3, 20, 4])) == [[20], [3, 4]]
    b = StreamingBucketer(ident, PairBudget(100), oversize="error")
    with pytest.raises(ValueError, match=r"sample 1 of the stream \(size \(20,\)\) costs 400, over the budget PairBudget\(100\)"):
        list(b([3, 20, 4]))


def test_buffer_limit_bounds_what_waits() -> None:
    b = StreamingBucketer(ident, BatchSize(1000), boundaries=[50], buffer_size=10)
    assert max(len(x) for x in b(LENGTHS)) <= 11


def test_fixed_length_cycles_and_stops() -> None:
    assert list(fixed_length([1, 2], 5)) == [1, 2, 1, 2, 1]
    assert list(fixed_length(range(10), 3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="the source yielded nothing, so it cannot fill 3 item"):
        list(fixed_length([], 3))


def test_shuffle_buffer_is_a_permutation() -> None:
    out = list(shuffle_buffer(range(100), 10, random.Random(0)))
    assert sorted(out) == list(range(100)) and out != list(range(100))


def test_bucketed_stream_gives_epoch_batches_across_workers() -> None:
    stream = BucketedStream(LENGTHS, StreamingBucketer(ident, TokenBudget(300), boundaries=[20]), epoch_batches=41)
    batches = list(DataLoader(stream, batch_size=None, num_workers=2))
    assert len(batches) == 41


def test_missing_optional_package_names_the_extra(monkeypatch) -> None:
    from padless.loaders.images import decode_image

    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match=r"needs the optional package 'pillow'.*pip install 'padless\[loaders\]'"):
        decode_image(b"\x89PNG")
