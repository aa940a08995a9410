"""Issue 13 item 2: a NestedTensor read from a file (``torch.load(weights_only=True)``,
pickle) is checked against itself before any op trusts it."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import padless
from padless import StructureError
from padless.tensor.core import _rebuild_nested


class _Forged:
    """Pickles as a NestedTensor built from exactly these parts (what a forged file holds)."""

    def __init__(self, *parts):
        self.parts = parts

    def __reduce_ex__(self, protocol):
        return (_rebuild_nested, self.parts)


def _load(obj):
    buf = io.BytesIO()
    torch.save({"x": obj}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["x"]


def _parts(**change):
    """The parts of a good batch of samples (2, 3) and (4, 3), with ``change`` applied."""
    p = dict(
        values=torch.randn(6, 3),
        offsets=torch.tensor([0, 2, 6]),
        sizes=torch.tensor([[2, 3], [4, 3]]),
        ragged=(0,),
        envelope=(4, 3),
        host_sizes=None,
        host_offsets=None,
        requires_grad=False,
        carried=None,
    )
    p.update(change)
    return _Forged(*p.values())


def test_good_parts_load():
    x = _load(_parts(host_sizes=torch.tensor([[2, 3], [4, 3]]), host_offsets=torch.tensor([0, 2, 6])))
    assert [tuple(s.shape) for s in x.unbind()] == [(2, 3), (4, 3)]


@pytest.mark.parametrize(
    "change, msg",
    [
        (dict(offsets=torch.tensor([1, 3, 6])), r"offsets must start at 0, got offsets\[0\]=1"),
        (dict(offsets=torch.tensor([0, 4, 6])), r"sample 0 spans offsets\[0:2\] = 0\.\.4 \(4 rows\), but its shape \(2, 3\) needs 2"),
        (dict(offsets=torch.tensor([0, 2, 7]), values=torch.randn(7, 3)), r"sample 1 spans .* needs 4"),
        (dict(offsets=torch.tensor([0, 2, 6]), values=torch.randn(8, 3)), r"offsets end at 6, but values has 8 rows"),
        (dict(sizes=torch.tensor([[2, 5], [4, 5]])), r"sample 0 has shape \(2, 5\) but values' static dims \(1,\) have extents \(3,\)"),
        (dict(sizes=torch.tensor([[-2, 3], [8, 3]])), r"sample 0 has extent -2 along dim 0"),
        (dict(sizes=torch.tensor([[2.0, 3.0], [4.0, 3.0]])), r"sizes must be a 2-D int64 tensor, got torch.float32"),
        (dict(offsets=torch.tensor([0, 2])), r"offsets has 2 entries for 2 samples"),
        (dict(ragged=(2,)), r"ragged dims \(2,\) must be distinct sample dims in range\(2\)"),
        (dict(ragged=(0, 0)), r"ragged dims \(0, 0\) must be distinct"),
        (dict(ragged=(1,)), r"sample 0 has shape \(2, 3\) but values' static dims \(0,\)"),
        (dict(host_sizes=torch.tensor([[3, 3], [3, 3]])), r"host_sizes \[\[3, 3\], \[3, 3\]\] differs from sizes"),
        (dict(host_offsets=torch.tensor([0, 3, 6])), r"host_offsets \[0, 3, 6\] differs from offsets \[0, 2, 6\]"),
        (dict(values=torch.randn(0, 3), offsets=torch.tensor([0, 0, 0]), sizes=torch.tensor([[0, 3], [0, 3]])), None),
    ],
    ids=["offsets_start", "offsets_vs_sizes", "sizes_vs_offsets", "offsets_end", "static_vs_values",
         "negative_size", "float_sizes", "short_offsets", "ragged_out_of_range", "ragged_repeated",
         "ragged_wrong_dim", "host_sizes_forged", "host_offsets_forged", "empty_ok"],
)
def test_inconsistent_parts_are_refused(change, msg):
    if msg is None:
        _load(_parts(**change))  # a consistent edge case (all-empty samples) still loads
        return
    with pytest.raises(StructureError, match=rf"NestedTensor \(unpickled\): {msg}"):
        _load(_parts(**change))


def test_sizes_whose_product_overflows_int64_are_refused():
    # 2**32 * 2**32 wraps to 0 rows in int64: offsets [0, 0] would agree with the wrapped product
    parts = _parts(values=torch.randn(0), offsets=torch.tensor([0, 0]), sizes=torch.tensor([[2**32, 2**32]]),
                   ragged=(0, 1), envelope=(2**32, 2**32))
    with pytest.raises(StructureError, match=r"sample 0's extents \(4294967296, 4294967296\) multiply past int64"):
        _load(parts)


def test_forged_envelope_is_recomputed_not_trusted():
    x = _load(_parts(envelope=(1, 99)))
    assert x.shape == (2, 4, 3)


def test_forged_row_ids_are_refused():
    # Before: y + per_sample_dense added sample 1's values to sample 0
    rid = torch.tensor([0, 0, 0, 1, 1, 1])
    with pytest.raises(StructureError, match=r"carried row_ids do not give every row its sample"):
        _load(_parts(carried={"row_ids": rid}))
    with pytest.raises(StructureError, match=r"carried row_ids must be int64 of shape \(6,\)"):
        _load(_parts(carried={"row_ids": torch.zeros(5, dtype=torch.int64)}))
    with pytest.raises(StructureError, match=r"carried row_ids do not give"):
        _load(_parts(carried={"row_ids": torch.tensor([0, 0, 1, 1, 1, 2])}))


def test_forged_cu_seqlens_and_partitions_are_refused():
    with pytest.raises(StructureError, match=r"carried cu_seqlens \[0, 3, 6\] differ from offsets \[0, 2, 6\]"):
        _load(_parts(carried={"cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32)}))
    with pytest.raises(StructureError, match=r"carried cu_seqlens must be int32 of shape \(3,\)"):
        _load(_parts(carried={"cu_seqlens": torch.tensor([0, 2, 6])}))
    with pytest.raises(StructureError, match=r"carried partitions differ from the row splits of sizes"):
        _load(_parts(carried={"partitions": [torch.tensor([0, 3, 6])]}))
    with pytest.raises(StructureError, match=r"carried metadata must be a dict, got list"):
        _load(_parts(carried=[1]))


def test_real_round_trip_keeps_validated_caches():
    x = padless.from_list([torch.randn(2, 3, 2), torch.randn(1, 4, 2), torch.randn(0, 2, 2)], ragged_dims=(0, 1))
    x.row_sample_ids(), x.cu_seqlens(), x.partitions()
    for back in (_load(x), pickle.loads(pickle.dumps(x))):
        m = back._meta.derived
        assert ("row_ids", back.device) in m and ("cu_seqlens", back.device) in m and "partitions" in m
        assert back.row_sample_ids().tolist() == x.row_sample_ids().tolist()
        assert [p.tolist() for p in back.partitions()] == [p.tolist() for p in x.partitions()]
        assert [s.tolist() for s in back.unbind()] == [s.tolist() for s in x.unbind()]


def test_collated_batch_round_trip_still_loads():
    nt = padless.collate([torch.randn(2, 3), torch.randn(4, 3)])
    nt.row_sample_ids()
    back = _load(nt)
    assert back.cu_seqlens().tolist() == [0, 2, 6] and back.row_sample_ids().tolist() == [0, 0, 1, 1, 1, 1]
