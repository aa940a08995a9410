"""Reliability, third round (issue 25): sizes and offsets that wrap int64 (item 5), accessors that
hand out internal state (item 7), loading on the meta device (item 9)."""

from __future__ import annotations

import io

import pytest
import torch

import padless
from padless import StructureError
from padless.tensor.core import _rebuild_nested

BIG = 2**62


# ---------------------------------------------------------------------------------------- 5. wrapping sizes


def test_lengths_whose_sum_wraps_are_refused() -> None:
    with pytest.raises(
        StructureError,
        match=r"from_values: the row counts' cumulative sum passes the int64 range at sample 1, which has 4611686018427387904 rows",
    ):
        padless.from_values(torch.zeros(0, 2), lengths=torch.tensor([BIG] * 4))


def test_sizes_whose_product_wraps_are_refused() -> None:
    with pytest.raises(
        StructureError,
        match=r"from_values: sample 0 has shape \(4294967296, 4294967296, 2\), whose 18446744073709551616 rows .* pass the int64 range",
    ):
        padless.from_values(torch.zeros(0, 2), sizes=torch.tensor([[2**32, 2**32, 2]]))


def test_sizes_whose_row_counts_sum_past_int64_are_refused() -> None:
    with pytest.raises(StructureError, match=r"cumulative sum passes the int64 range at sample 1 \(shape \(4611686018427387904, 2\)\)"):
        padless.from_values(torch.zeros(0, 2), sizes=torch.tensor([[BIG, 2]] * 4))


def test_offsets_that_wrap_are_refused() -> None:
    with pytest.raises(StructureError, match=r"offsets must be non-decreasing: offsets\[1\]=4611686018427387904 > offsets\[2\]=-9223372036854775808"):
        padless.from_values(torch.zeros(0, 2), torch.tensor([0, BIG, -(2**63), -BIG, 0]))


def test_an_envelope_past_int64_is_refused() -> None:
    values = torch.zeros(1, 2).expand(2**41, 2)  # no memory: every sample fits, the padded envelope does not
    with pytest.raises(StructureError, match=r"the padded envelope \(2, 1099511627776, 1099511627776, 2\) has \d+ elements, past the int64 range"):
        padless.from_values(values, sizes=torch.tensor([[2**40, 1, 2], [1, 2**40, 2]]))


class _Forged:
    def __init__(self, *parts):
        self.parts = parts

    def __reduce_ex__(self, protocol):
        return (_rebuild_nested, self.parts)


def _load(obj, **kw):
    buf = io.BytesIO()
    torch.save({"x": obj}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True, **kw)["x"]


def test_a_forged_file_with_wrapping_offsets_fails_the_load_check() -> None:
    # every step (differences wrap) equals the sample's 2**62 rows, and the offsets end at len(values) = 0
    forged = _Forged(torch.zeros(0), torch.tensor([0, BIG, -(2**63), -BIG, 0]), torch.tensor([[BIG]] * 4), (0,), (BIG,), None, None, False, None)
    with pytest.raises(StructureError, match=r"NestedTensor \(unpickled\): offsets decrease at sample 1: offsets\[1\]=4611686018427387904 > offsets\[2\]=-9223372036854775808"):
        _load(forged)


# ---------------------------------------------------------------------------------------- 7. accessors


def _batch(device: str = "cpu"):
    return padless.from_values(torch.arange(10.0, device=device).view(5, 2), torch.tensor([0, 2, 2, 5], device=device))


@pytest.mark.parametrize("accessor, index", [
    ("offsets", (1,)), ("lengths", (0,)), ("sizes", (1, 0)), ("host_offsets", (1,)), ("host_sizes", (0, 0)),
])
def test_writing_into_an_accessor_leaves_the_tensor_intact(accessor, index) -> None:
    z = _batch()
    want = z.sum(dim=1)
    before = getattr(z, accessor)().clone()
    getattr(z, accessor)()[index] = 1 if accessor != "lengths" else 9
    torch.testing.assert_close(z.sum(dim=1), want)
    assert torch.equal(getattr(z, accessor)(), before)  # the next call hands out a fresh copy
    assert [tuple(s.shape) for s in z.unbind()] == [(2, 2), (0, 2), (3, 2)]
    assert torch.equal(z.offsets(), torch.tensor([0, 2, 2, 5])) and z.lengths().tolist() == [2, 0, 3]


def test_accessors_copy_once_per_structure() -> None:
    z = _batch()
    y = z * 2  # the same structure
    assert z.offsets() is z.offsets() is y.offsets() and z.sizes() is y.sizes()
    assert z.offsets() is not z._offsets and z.host_offsets() is not z._meta.host_offsets
    assert z.offsets().data_ptr() != z._offsets.data_ptr()


# ---------------------------------------------------------------------------------------- 9. meta


def test_loading_on_meta_is_refused_clearly() -> None:
    z = _batch()
    with pytest.raises(NotImplementedError, match=r"loading on the meta device \(map_location='meta'\) is not supported: .* Load it on 'cpu' \(then \.to\('meta'\)"):
        _load(z, map_location="meta")
    assert _load(z).to("meta").shape == z.shape
