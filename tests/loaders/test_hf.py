"""The Hugging Face datasets reader on arrow datasets built here (in memory and on disk)."""

from __future__ import annotations

import glob
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import padless
from padless.loaders import BudgetBatchSampler, HFDatasetReader, TokenBudget
from padless.loaders.synthetic import token_lengths

datasets = pytest.importorskip("datasets")

LENGTHS = token_lengths(60, seed=4, mean=2.5, high=40)


def token_rows() -> list[list[int]]:
    return [list(range(i, i + n)) for i, n in enumerate(LENGTHS.tolist())]


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": token_rows(),
            "label": [i % 5 for i in range(len(LENGTHS))],
            "pairs": [np.full((n, 2), i, dtype=np.float32).tolist() for i, n in enumerate(LENGTHS.tolist())],
            "text": [f"s{i}" for i in range(len(LENGTHS))],
        }
    )
    path = str(tmp_path_factory.mktemp("arrow") / "ds")
    ds.save_to_disk(path)
    return datasets.load_from_disk(path)


def test_batched_read_gives_tensors_numbers_and_strings(on_disk) -> None:
    r = HFDatasetReader(on_disk, dtypes={"input_ids": torch.int64})
    rows = token_rows()
    got = r.__getitems__([5, 0, 17])
    for s, i in zip(got, [5, 0, 17]):
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].tolist() == rows[i]
        assert s["pairs"].shape == (LENGTHS[i], 2) and bool((s["pairs"] == i).all())
        assert s["label"] == i % 5 and s["text"] == f"s{i}"
    assert r[17]["input_ids"].tolist() == rows[17]


def test_lengths_are_computed_once_and_cached_beside_the_dataset(on_disk) -> None:
    r = HFDatasetReader(on_disk)
    assert r.lengths().tolist() == LENGTHS.tolist()
    files = glob.glob(on_disk.cache_files[0]["filename"].rsplit("/", 1)[0] + "/padless-lengths-*.npy")
    assert len(files) == 1
    again = HFDatasetReader(on_disk)
    assert again.lengths().tolist() == LENGTHS.tolist()


def test_a_length_column_is_read_as_is() -> None:
    ds = datasets.Dataset.from_dict({"x": [[1.0], [2.0, 3.0]], "length": [7, 9]})
    assert HFDatasetReader(ds).lengths().tolist() == [7, 9]
    assert HFDatasetReader(ds, length_column=None).lengths().tolist() == [1, 2]


def collate_tokens(samples: list[dict]) -> tuple:
    return padless.from_list([s["input_ids"] for s in samples]), [s["text"] for s in samples]


def test_dataloader_with_two_workers_and_a_budget_sampler(on_disk) -> None:
    r = HFDatasetReader(on_disk, columns=["input_ids", "text"])
    sampler = BudgetBatchSampler(r.lengths(), TokenBudget(64), seed=1)
    rows = token_rows()
    seen = []
    expected = list(sampler)
    loader = DataLoader(r, batch_sampler=sampler, num_workers=2, collate_fn=collate_tokens)
    for (nt, texts), idx in zip(loader, expected, strict=True):
        assert nt.values().numel() <= 64 or len(idx) == 1
        assert [t.tolist() for t in nt.unbind()] == [rows[i] for i in idx]
        assert texts == [f"s{i}" for i in idx]
        seen += idx
    assert sorted(seen) == list(range(len(LENGTHS)))


def test_reader_pickles(on_disk) -> None:
    r = pickle.loads(pickle.dumps(HFDatasetReader(on_disk)))
    assert r[3]["input_ids"].tolist() == token_rows()[3]


def test_errors_name_the_fix(on_disk) -> None:
    with pytest.raises(TypeError, match="got a DatasetDict with splits \\['train'\\]; pass one split"):
        HFDatasetReader(datasets.DatasetDict({"train": on_disk}))
    with pytest.raises(KeyError, match="column 'tokens' is not in the dataset"):
        HFDatasetReader(on_disk, columns=["tokens"])
    with pytest.raises(ValueError, match="no list column among \\['label'\\] and no length column; pass lengths_of="):
        HFDatasetReader(on_disk, columns=["label"]).lengths()
    with pytest.raises(IndexError, match="index 60 is out of range for 60 samples"):
        HFDatasetReader(on_disk)[60]
    ragged = datasets.Dataset.from_dict({"m": [[[1]], [[1, 2], [3]]]})
    with pytest.raises(ValueError, match="column 'm' in sample 1 is a ragged nested list"):
        HFDatasetReader(ragged)[1]
    holes = datasets.Dataset.from_dict({"x": [[1], None, [2]]})
    with pytest.raises(ValueError, match="column 'x' is null in sample 1; fill or filter the nulls first"):
        HFDatasetReader(holes).__getitems__([0, 1])
    with pytest.raises(TypeError, match="index must be an int, got list; use __getitems__ for a batch"):
        HFDatasetReader(on_disk)[[1, 2]]  # type: ignore[index]
    with pytest.raises(TypeError, match="expected a datasets.Dataset, got dict"):
        HFDatasetReader({"x": [1]})


def test_a_corrupt_lengths_cache_is_ignored_and_rewritten(tmp_path) -> None:
    """Issue 13: a cache file holding [9, 9] was returned for a 5-sample dataset."""
    ds = datasets.Dataset.from_dict({"ids": [[1] * n for n in (3, 1, 4, 1, 5)]})
    ds.save_to_disk(str(tmp_path / "five"))
    ds = datasets.load_from_disk(str(tmp_path / "five"))
    reader = HFDatasetReader(ds)
    path = reader._cache_path("ids")
    assert path is not None and f"-{ds._fingerprint}-5-" in path
    for bad in (np.array([9, 9]), np.array([3, 1, 4, 1, 5], dtype=np.int32), np.array([3, 1, -4, 1, 5])):
        np.save(path, bad)
        assert HFDatasetReader(ds).lengths().tolist() == [3, 1, 4, 1, 5]
        assert np.load(path).tolist() == [3, 1, 4, 1, 5]  # rewritten
    with open(path, "wb") as f:
        f.write(b"not a numpy file")
    assert HFDatasetReader(ds).lengths().tolist() == [3, 1, 4, 1, 5]
