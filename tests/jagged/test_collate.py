import pickle

import numpy as np
import pytest
import torch

from padless.jagged import KeyedJaggedTensor, collate_sparse


def test_collate_layout_and_host_metadata():
    kjt = collate_sparse([{"a": [1, 2], "b": [7]}, {"b": [8, 9]}, {"a": [3]}])
    assert kjt.keys() == ["a", "b"] and kjt.stride() == 3
    assert kjt.values().tolist() == [1, 2, 3, 7, 8, 9]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 2, 0]
    assert kjt.length_per_key_or_none() == [3, 3] and kjt.offset_per_key_or_none() == [0, 3, 6]
    assert kjt.lengths().dtype == torch.int32 and kjt.values().dtype == torch.int64
    assert kjt.weights_or_none() is None


def test_declared_keys_order_and_subset():
    kjt = collate_sparse([{"a": [1], "b": [2], "c": [3]}], keys=["c", "a", "z"])
    assert kjt.keys() == ["c", "a", "z"] and kjt.values().tolist() == [3, 1] and kjt.lengths().tolist() == [1, 1, 0]


def test_tensors_arrays_and_weights():
    kjt = collate_sparse(
        [{"a": torch.tensor([1, 2]), "b": (np.array([5]), [0.5])}, {"a": np.array([3]), "b": ([6, 7], [1.0, 2.0])}]
    )
    assert kjt.values().tolist() == [1, 2, 3, 5, 6, 7]
    assert kjt.weights().tolist() == [1.0, 1.0, 1.0, 0.5, 1.0, 2.0]


def test_empty_batch():
    kjt = collate_sparse([], keys=["a"])
    assert kjt.stride() == 0 and kjt.values().numel() == 0 and kjt.length_per_key() == [0]


def test_picklable_for_dataloader_workers():
    kjt = collate_sparse([{"a": [1, 2]}, {"a": [3]}])
    back = pickle.loads(pickle.dumps(kjt))
    assert isinstance(back, KeyedJaggedTensor) and back.length_per_key_or_none() == [3]
    assert [t.tolist() for t in back["a"].to_dense()] == [[1, 2], [3]]


def test_dataloader_collate_fn():
    data = [{"a": list(range(i))} for i in range(6)]
    dl = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=collate_sparse)
    batches = list(dl)
    assert [b.length_per_key() for b in batches] == [[3], [12]]


def test_errors():
    with pytest.raises(TypeError, match=r"sample 1 must be a mapping \{feature: ids\}, got list"):
        collate_sparse([{"a": [1]}, [1]])
    with pytest.raises(ValueError, match=r"sample 0 feature 'a': ids must be 1-D, got shape \(1, 2\)"):
        collate_sparse([{"a": torch.ones(1, 2, dtype=torch.int64)}])
    with pytest.raises(ValueError, match=r"sample 1 feature 'a': ids must be 1-D, got shape \(1, 2\)"):
        collate_sparse([{"a": [1]}, {"a": [[1, 2]]}])
    with pytest.raises(ValueError, match=r"sample 0 feature 'a': 2 ids but 1 weights"):
        collate_sparse([{"a": ([1, 2], [1.0])}])
