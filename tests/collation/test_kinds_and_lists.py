"""What a field may hold: mixed kinds, numbers that do not fit, Python lists of ids, images in
either memory layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import padless
from padless import NestedTensor
from padless.collation.pack import rows_of
from padless.testing import assert_close_samples


# ---------------------------------------------------------------------------- mixed kinds (issue 13 item 7)


@pytest.mark.parametrize(
    "values, sample, first",
    [
        (["abc", torch.ones(2)], 1, "a str"),
        ([torch.ones(2), "abc"], 1, None),
        (["abc", "d", np.ones(2)], 2, "a str"),
        ([None, torch.ones(2)], 0, None),
        (["abc", 3], 1, "a str"),
        ([None, 3], 1, "None"),
        (["abc", [1, 2]], 1, "a str"),
    ],
)
def test_mixed_kinds_raise_in_both_orders_naming_the_field(values, sample, first):
    samples = [{"text": v} for v in values]
    pattern = rf"field 'text': sample {sample} is"
    if first is not None:
        pattern += rf" a \w+, sample 0 is {first}"
    for call in (padless.collate, padless.Collator()):
        with pytest.raises(TypeError, match=pattern):
            call(samples)


def test_strings_and_none_stay_a_list():
    out = padless.collate([{"t": "a"}, {"t": None}, {"t": "c"}])
    assert out["t"] == ["a", None, "c"]


def test_int_beyond_int64_names_field_and_sample():
    with pytest.raises(OverflowError, match=r"field 'n': sample 1 is 1180591620717411303424, which does not fit in int64"):
        padless.collate([{"n": 1}, {"n": 2**70}])
    with pytest.raises(OverflowError, match=r"field <sample>: sample 0 is -1180591620717411303424"):
        padless.collate([-(2**70), 1])
    with pytest.raises(OverflowError, match=r"field 'n': sample 0 is 1180591620717411303424"):
        padless.Collator({"n": padless.Field(dtype=torch.float32)})([{"n": 2**70}])
    assert padless.collate([2**63 - 1, 0]).dtype == torch.int64
    assert padless.collate([1.0, 2**70]).dtype == torch.float64  # a float field holds it, as default_collate


# ---------------------------------------------------------------------------- Python lists (issue 14 item 4)


def test_token_id_lists_pack_like_tensors():
    ids = [[5, 6, 7], [8], [9, 10]]
    b = padless.collate([{"input_ids": x} for x in ids])
    assert isinstance(b["input_ids"], NestedTensor) and b["input_ids"].dtype == torch.int64
    assert_close_samples(b["input_ids"], [torch.tensor(x) for x in ids])
    c = padless.Collator({"input_ids": padless.Field(ragged=0)})([{"input_ids": x} for x in ids])
    assert torch.equal(c.input_ids.values(), b["input_ids"].values())
    assert c.input_ids.offsets().tolist() == [0, 3, 4, 6]


def test_equal_length_lists_stack_or_stay_nested_when_declared():
    samples = [{"input_ids": [1, 2]}, {"input_ids": [3, 4]}]
    assert torch.equal(padless.collate(samples)["input_ids"], torch.tensor([[1, 2], [3, 4]]))
    b = padless.Collator({"input_ids": padless.Field(ragged=0, labels="labels")})(samples)
    assert isinstance(b.input_ids, NestedTensor) and isinstance(b.labels, NestedTensor)
    assert b.labels.values().tolist() == [-100, 2, -100, 4]


def test_empty_list_takes_the_fields_dtype_and_float_lists_work():
    b = padless.collate([{"x": [1, 2]}, {"x": []}, {"x": [3]}])
    assert b["x"].dtype == torch.int64 and b["x"].offsets().tolist() == [0, 2, 2, 3]
    f = padless.collate([[0.5, 1.5], [2.5]])
    assert f.dtype == torch.float32 and f.values().tolist() == [0.5, 1.5, 2.5]
    nested = padless.collate([[[1, 2], [3, 4]], [[5, 6]]])
    assert nested.ragged_dims == (0,) and nested.values().tolist() == [[1, 2], [3, 4], [5, 6]]


def test_bad_lists_name_field_and_sample():
    with pytest.raises(TypeError, match=r"field 'x': sample 1 is a list that cannot form a tensor"):
        padless.collate([{"x": [1, 2]}, {"x": [1, "a"]}])
    with pytest.raises(TypeError, match=r"field 'x': sample 1 has dtype torch.float32 .*sample 0 has torch.int64"):
        padless.collate([{"x": [1, 2]}, {"x": [0.5]}])
    # tuples stay records, as in default_collate
    assert padless.collate([(1, 2), (3, 4)])[0].tolist() == [1, 3]


# ---------------------------------------------------------------------------- images: channels-last views


def _images(channels_last: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for h, w in [(5, 7), (3, 4), (6, 2)]:
        hwc = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
        out.append(hwc.permute(2, 0, 1) if channels_last else hwc.permute(2, 0, 1).contiguous())
    return out


def test_channels_last_views_and_contiguous_images_give_identical_batches():
    views, dense = _images(True), _images(False)
    assert not views[0].is_contiguous() and dense[0].is_contiguous()
    for make in (padless.collate, lambda s: padless.Collator({"image": padless.Field(ragged=(1, 2))})(s)["image"]):
        a = make([{"image": x} for x in views]) if make is not padless.collate else make(views)
        b = make([{"image": x} for x in dense]) if make is not padless.collate else make(dense)
        assert torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
        assert torch.equal(a.sizes(), b.sizes()) and a.values().shape == (35 + 12 + 12, 3)
        assert_close_samples(a, dense)


def test_channels_last_view_is_packed_from_its_own_memory():
    """The decoder's (H, W, C) buffer is already the packed rows: no transpose, one memcpy."""
    (view, *_), (dense, *_) = _images(True), _images(False)
    rows = rows_of(view, (1, 2, 0), 2, [3])
    assert rows is not None and rows.data_ptr() == view.data_ptr() and rows.shape == (35, 3)
    assert rows_of(dense, (1, 2, 0), 2, [3]) is None  # needs the element-wise copy


def test_mixed_layouts_in_one_batch():
    views, dense = _images(True), _images(False)
    mixed = [views[0], dense[1], views[2]]
    assert torch.equal(padless.collate(mixed).values(), padless.collate(dense).values())


def test_cu_seqlens_past_int32_rows_is_refused_naming_the_field():
    """A worker-built cu_seqlens must never wrap (checked on the offsets: no 2**31-row batch is built)."""
    from padless.collation.metadata import INT32_MAX, int32_offsets

    assert int32_offsets(np.array([0, 3, INT32_MAX]), "ids").tolist() == [0, 3, INT32_MAX]
    with pytest.raises(padless.StructureError, match=r"field 'ids' has 2147483651 rows in this batch, more than int32"):
        int32_offsets(np.array([0, 3, 2**31 + 3]), "ids")


def test_numpy_values_of_one_type_but_two_kinds_are_still_refused():
    """Samples of one Python type skip the per-sample kind check only when the type decides the
    kind; a numpy array's kind depends on its dtype (text vs numbers), so it is still checked."""
    samples = [{"x": np.array(["a", "b"])}, {"x": np.array([1, 2])}]
    with pytest.raises(TypeError, match=r"field 'x': sample 1 is a ndarray, sample 0 is a ndarray; every sample of a field needs the same kind"):
        padless.collate(samples)
    out = padless.collate([{"x": np.float32(1.5), "n": 1}, {"x": np.float32(2.5), "n": 2}])
    assert out["x"].dtype == torch.float32 and out["n"].tolist() == [1, 2]
