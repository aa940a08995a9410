"""padless.collate against torch's default_collate, field by field, on the same samples."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import padless
from padless import NestedTensor
from padless.testing import assert_close_samples

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Item:
    feats: torch.Tensor
    label: int
    name: str = "?"


def _same(a, b):
    """Deep equality of two collated structures (types, dtypes, shapes and values)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


EQUAL_SHAPE_CASES = {
    "tensors": [torch.randn(3, 4) for _ in range(5)],
    "dicts": [{"x": torch.randn(2), "y": i, "z": float(i), "s": f"s{i}"} for i in range(4)],
    "nested": [{"a": {"b": [torch.ones(2) * i, i]}, "c": (i, torch.zeros(3))} for i in range(3)],
    "tuples": [(torch.randn(3), i) for i in range(3)],
    "namedtuples": [Point(torch.randn(2), i) for i in range(3)],
    "numpy": [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(3)],
    "numpy_scalars": [np.float32(i) for i in range(4)],
    "ints": [1, 2, 3],
    "floats": [0.5, 1.5],
    "bools": [True, False, True],
    "strings": ["a", "bb", "ccc"],
    "one_sample": [{"x": torch.randn(3)}],
    "lists": [[torch.ones(2), 3] for _ in range(2)],
}


@pytest.mark.parametrize("name", list(EQUAL_SHAPE_CASES))
def test_matches_default_collate_where_shapes_agree(name):
    samples = EQUAL_SHAPE_CASES[name]
    _same(padless.collate(samples), default_collate(samples))


def test_differing_shapes_pack_into_nested_tensors():
    samples = [{"ids": torch.tensor([5, 6]), "y": 1, "name": "a"},
               {"ids": torch.tensor([7]), "y": 0, "name": "b"},
               {"ids": torch.tensor([8, 9, 4]), "y": 1, "name": "c"}]
    b = padless.collate(samples)
    assert isinstance(b["ids"], NestedTensor) and b["ids"].ragged_dims == (0,)
    assert b["ids"].values().tolist() == [5, 6, 7, 8, 9, 4]
    assert b["ids"].offsets().tolist() == [0, 2, 3, 6]
    assert_close_samples(b["ids"], [s["ids"] for s in samples])
    # the other fields are exactly default_collate's
    rest = default_collate([{k: v for k, v in s.items() if k != "ids"} for s in samples])
    _same({k: v for k, v in b.items() if k != "ids"}, rest)


def test_default_collate_fails_where_collate_packs():
    samples = [torch.randn(2, 3), torch.randn(4, 3)]
    with pytest.raises(RuntimeError):
        default_collate(samples)
    out = padless.collate(samples)
    assert_close_samples(out, samples)
    assert out.shape == (2, 4, 3)


def test_ragged_dims_are_the_dims_that_differ():
    imgs = [torch.randn(3, 4, 5), torch.randn(3, 2, 6)]
    out = padless.collate(imgs)
    assert out.ragged_dims == (1, 2) and out.values().shape == (4 * 5 + 2 * 6, 3)
    assert_close_samples(out, imgs)
    chans = [torch.randn(4, 3), torch.randn(4, 5)]
    out = padless.collate(chans)
    assert out.ragged_dims == (1,)
    assert_close_samples(out, chans)


def test_dataclasses_are_walked():
    items = [Item(torch.randn(i + 1, 2), i, f"n{i}") for i in range(3)]
    out = padless.collate(items)
    assert isinstance(out, Item)
    assert isinstance(out.feats, NestedTensor) and out.label.tolist() == [0, 1, 2] and out.name == ["n0", "n1", "n2"]
    assert_close_samples(out.feats, [it.feats for it in items])


def test_numpy_arrays_of_differing_shapes():
    arrs = [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)]
    out = padless.collate(arrs)
    assert out.dtype == torch.int32
    assert_close_samples(out, [torch.from_numpy(a) for a in arrs])


def test_pil_images_become_chw_uint8():
    Image = pytest.importorskip("PIL.Image")
    rgb = [Image.fromarray(np.full((h, w, 3), i, dtype=np.uint8)) for i, (h, w) in enumerate([(4, 6), (5, 3)])]
    out = padless.collate(rgb)
    assert out.dtype == torch.uint8 and out.ragged_dims == (1, 2)
    assert [tuple(s.shape) for s in out.unbind()] == [(3, 4, 6), (3, 5, 3)]
    assert int(out.unbind()[1][0, 0, 0]) == 1
    gray = [Image.fromarray(np.zeros((4, 4), dtype=np.uint8)), Image.fromarray(np.zeros((4, 4), dtype=np.uint8))]
    dense = padless.collate(gray)
    assert type(dense) is torch.Tensor and dense.shape == (2, 1, 4, 4)


def test_one_buffer_per_dtype():
    samples = [{"a": torch.randn(i + 1, 3), "b": torch.randn(2), "ids": torch.arange(i + 2), "y": i} for i in range(4)]
    out = padless.collate(samples)
    storages = {}
    # the structure's own offsets (offsets() hands out a copy: issue 25, item 7)
    for t in (out["a"].values(), out["a"]._offsets, out["a"].cu_seqlens(), out["b"], out["ids"].values(),
              out["ids"]._offsets, out["ids"].cu_seqlens(), out["y"]):
        storages.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert all(len(s) == 1 for s in storages.values()), storages


def test_metadata_is_precomputed():
    out = padless.collate([torch.randn(2, 3), torch.randn(0, 3), torch.randn(3, 3)])
    d = out._meta.derived
    assert ("cu_seqlens", out.device) in d and ("row_ids", out.device) not in d  # O(B) metadata only
    assert out.cu_seqlens().tolist() == [0, 2, 2, 5] and out.max_seqlen() == 3
    assert out.row_sample_ids().tolist() == [0, 0, 2, 2, 2]


# ---------------------------------------------------------------------------- bad input


def test_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        padless.collate([])


def test_rank_mismatch_names_field_sample_and_shapes():
    with pytest.raises(ValueError, match=r"field 'x': sample 1 has shape \(5,\) \(rank 1\), sample 0 has shape \(2, 3\)"):
        padless.collate([{"x": torch.randn(2, 3)}, {"x": torch.randn(5)}])


def test_dtype_mismatch_names_field_and_sample():
    with pytest.raises(TypeError, match=r"field 'x': sample 1 has dtype torch.int64 .*sample 0 has torch.float32"):
        padless.collate([{"x": torch.randn(2)}, {"x": torch.arange(3)}])


def test_none_in_tensor_field():
    with pytest.raises(TypeError, match=r"field 'x': sample 2 is None"):
        padless.collate([{"x": torch.randn(2)}, {"x": torch.randn(2)}, {"x": None}])
    with pytest.raises(TypeError, match=r"field 'x': sample 0 is None"):
        padless.collate([{"x": None}, {"x": torch.randn(2)}])


def test_missing_and_extra_keys():
    with pytest.raises(KeyError, match=r"sample 1 has no key 'y'"):
        padless.collate([{"x": 1, "y": 2}, {"x": 3}])
    with pytest.raises(KeyError, match=r"sample 1 has key 'z' that sample 0 lacks"):
        padless.collate([{"x": 1}, {"x": 3, "z": 1}])


def test_mixed_kinds_and_lengths():
    with pytest.raises(TypeError, match=r"field '\[1\]': sample 1 is a str, sample 0 is a int"):
        padless.collate([(torch.ones(1), 1), (torch.ones(1), "a")])
    with pytest.raises(ValueError, match=r"sample 1 has 3 elements, sample 0 has 2"):
        padless.collate([(1, 2), (1, 2, 3)])  # tuples are records; lists of numbers are data (packed)
    with pytest.raises(TypeError, match=r"sample 1 is a str, not a tensor"):
        padless.collate([torch.ones(2), "x"])


def test_nested_tensor_samples_are_refused():
    nt = padless.from_list([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match="sample 0 is a NestedTensor"):
        padless.collate([nt, nt])
