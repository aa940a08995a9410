"""Issue 13 item 4: integer metadata is checked, never silently truncated or wrapped."""

from __future__ import annotations

import pytest
import torch

import padless
import padless.nested as pn
from padless import StructureError


def test_cu_seqlens_past_int32_raises_naming_row_count():
    v = torch.zeros(()).expand(2**31 + 3)  # no memory: an expanded scalar
    x = padless.from_values(v, lengths=torch.tensor([3, 2**31]))
    with pytest.raises(StructureError, match=r"cu_seqlens\(\): the batch has 2147483651 rows.*use offsets\(\) \(int64\)"):
        x.cu_seqlens()
    assert x.offsets().tolist() == [0, 3, 2**31 + 3]  # the int64 offsets are right


def test_cu_seqlens_at_int32_max_is_exact():
    v = torch.zeros(()).expand(2**31 - 1)
    x = padless.from_values(v, lengths=torch.tensor([3, 2**31 - 4]))
    assert x.cu_seqlens().tolist() == [0, 3, 2**31 - 1]


@pytest.mark.parametrize(
    "kwargs, arg, sample",
    [
        (dict(lengths=torch.tensor([2.9, 2.9])), "lengths", r"sample 0 is 2\.9"),
        (dict(lengths=torch.tensor([float("nan"), 4.0])), "lengths", "sample 0 is nan"),
        (dict(sizes=torch.tensor([[2.9], [2.9]])), "sizes", r"entry \(0, 0\) is 2\.9"),
        (dict(offsets=torch.tensor([0.0, 2.5, 4.0])), "offsets", r"offsets\[1\] is 2\.5"),
        (dict(offsets=torch.tensor([0.0, 2.0, 4.0]), validate=False), "offsets", "float32"),
    ],
    ids=["float_lengths", "nan_lengths", "float_sizes", "float_offsets", "float_offsets_unvalidated"],
)
def test_from_values_refuses_non_integer_metadata(kwargs, arg, sample):
    with pytest.raises(TypeError, match=rf"from_values: {arg} must be an integer tensor.*{sample}"):
        padless.from_values(torch.randn(4), **kwargs)


def test_from_values_negative_sizes_name_sample_and_dim():
    with pytest.raises(ValueError, match=r"sizes must be >= 0: sample 1 has extent -2 along dim 0"):
        padless.from_values(torch.randn(4, 3), sizes=torch.tensor([[6, 3], [-2, 3]]))


def test_from_values_negative_lengths_name_sample():
    with pytest.raises(ValueError, match=r"lengths must be >= 0, sample 0 has -1"):
        padless.from_values(torch.randn(4), lengths=torch.tensor([-1, 5]))


def test_max_seqlen_smaller_than_a_sample_raises():
    # Before: shape (2, 1, 2) and a later IndexError
    with pytest.raises(ValueError, match=r"max_seqlen=1 for dim 0 is smaller than sample 0's extent 3"):
        padless.from_values(torch.randn(4, 2), torch.tensor([0, 3, 4]), max_seqlen=1)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_max_seqlen_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=r"max_seqlen must be a non-negative int per ragged dim, got"):
        padless.from_values(torch.randn(4), torch.tensor([0, 2, 4]), max_seqlen=bad)


def test_larger_max_seqlen_gives_the_real_envelope_with_host_offsets():
    x = padless.from_values(torch.randn(4, 2), torch.tensor([0, 3, 4]), max_seqlen=9)
    assert x.shape == (2, 3, 2)
    assert (x + padless.from_list([torch.zeros(3, 2), torch.zeros(1, 2)])).shape == (2, 3, 2)


@pytest.mark.parametrize(
    "offsets, lengths, msg",
    [
        ([0, 2, 4], [2, 4], r"sample 1: its window \[2, 6\) \(offsets\[1\]=2, lengths\[1\]=4\) lies outside values' 5 rows"),
        ([0, 2, 4], [-1, 3], r"sample 0: lengths\[0\]=-1 is negative"),
        ([-3, 2, 4], [1, 1], r"sample 0: its window \[-3, -2\)"),
    ],
    ids=["past_end", "negative_length", "negative_offset"],
)
def test_nested_tensor_from_jagged_holes_out_of_range(offsets, lengths, msg):
    # Before: "index out of range in self", or a heap corruption for a negative length
    with pytest.raises(StructureError, match=rf"nested_tensor_from_jagged\(\): {msg}"):
        pn.nested_tensor_from_jagged(torch.randn(5, 2), torch.tensor(offsets), torch.tensor(lengths))


def test_nested_tensor_from_jagged_holes_refuse_float_and_bad_shapes():
    with pytest.raises(TypeError, match=r"nested_tensor_from_jagged\(\): lengths must be an integer tensor"):
        pn.nested_tensor_from_jagged(torch.randn(5, 2), torch.tensor([0, 2, 4]), torch.tensor([1.0, 1.0]))
    with pytest.raises(StructureError, match=r"offsets must be \(B\+1,\) and lengths \(B,\)"):
        pn.nested_tensor_from_jagged(torch.randn(5, 2), torch.tensor([0, 2, 4]), torch.tensor([1, 1, 1]))


def test_nested_tensor_from_jagged_holes_in_range_still_pack():
    v = torch.arange(10.0).view(5, 2)
    x = pn.nested_tensor_from_jagged(v, torch.tensor([0, 2, 4]), torch.tensor([1, 3]))
    assert [s.tolist() for s in x.unbind()] == [[[0.0, 1.0]], [[4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]]
