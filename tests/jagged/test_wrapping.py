"""Jagged structures whose offsets wrap int64 or whose strides are negative are refused (issue 25, item 4).

TorchRec accepts them at construction; ``validate()`` and every reader (``to_dense``,
``to_dict``, ...) raise a ``StructureError`` naming the key and the sample.
"""

from __future__ import annotations

import pytest
import torch

import padless
from padless.jagged import JaggedTensor, KeyedJaggedTensor

BIG = 2**62


def test_kjt_offsets_that_wrap_are_refused() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.zeros(0), offsets=torch.tensor([0, 2**63 - 1, -(2**63) + 5, 0]))
    msg = r"offsets must not decrease, but offsets\[1\] = 9223372036854775807 > offsets\[2\] = -9223372036854775803 \(key 'a', sample 1\)"
    with pytest.raises(padless.StructureError, match=msg):
        kjt.validate()
    with pytest.raises(padless.StructureError, match=msg):
        kjt.to_dict()


def test_jt_offsets_that_wrap_are_refused() -> None:
    jt = JaggedTensor(values=torch.zeros(0), offsets=torch.tensor([0, 2**63 - 1, -(2**63) + 5, 0]))
    with pytest.raises(padless.StructureError, match=r"offsets must not decrease, .* \(sample 1\)"):
        jt.to_dense()


def test_jt_lengths_whose_cumsum_passes_int64_are_refused() -> None:
    jt = JaggedTensor(values=torch.zeros(0), lengths=torch.tensor([BIG] * 4))
    msg = (
        r"JaggedTensor: the lengths' cumulative sum passes the int64 range at lengths\[1\] = 4611686018427387904 "
        r"\(sample 1\): the offsets would wrap around"
    )
    with pytest.raises(padless.StructureError, match=msg):
        jt.to_dense()
    with pytest.raises(padless.StructureError, match=msg):
        jt.validate()


@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable-batch"])
def test_kjt_lengths_whose_cumsum_passes_int64_are_refused(variable) -> None:
    extra = {"stride_per_key_per_rank": [[1, 1], [2]]} if variable else {}
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(0), lengths=torch.tensor([0, 0, BIG, BIG]), **extra)
    msg = r"KeyedJaggedTensor: the lengths' cumulative sum passes the int64 range at lengths\[3\] = 4611686018427387904 \(key 'b', sample 1\)"
    with pytest.raises(padless.StructureError, match=msg):
        kjt.validate()
    with pytest.raises(padless.StructureError, match=msg):
        kjt.to_dict()


def test_negative_strides_are_refused() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(2), lengths=torch.tensor([1, 1]), stride_per_key_per_rank=[[-1], [3]])
    msg = r"KeyedJaggedTensor: stride_per_key_per_rank must be >= 0, but key 'a' has stride -1 on rank 0 \(stride_per_key_per_rank \[\[-1\], \[3\]\]\)"
    assert kjt.stride_per_key_per_rank() == [[-1], [3]]  # kept as given, as in TorchRec
    with pytest.raises(padless.StructureError, match=msg):
        kjt.validate()
    with pytest.raises(padless.StructureError, match=msg):
        kjt.to_dict()


def test_large_but_sound_lengths_still_pass() -> None:
    ln = torch.tensor([2**61, 2**61, 2**61, 0])  # sums to 3 * 2**61 < 2**63: no wrap, only too few values
    with pytest.raises(padless.StructureError, match=r"the lengths cover 6917529027641081856 rows but values has only 0"):
        JaggedTensor(values=torch.zeros(0), lengths=ln).validate()
    ok = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(4.0), lengths=torch.tensor([1, 1, 2, 0])).validate()
    assert ok.offset_per_key() == [0, 2, 4]
