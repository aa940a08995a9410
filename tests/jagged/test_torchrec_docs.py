"""Every example of TorchRec's data-types documentation (torchrec.sparse.jagged_tensor
docstrings), run with the padless types: same calls, same values."""

import torch

from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def _jt_doc() -> JaggedTensor:
    values = torch.Tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    offsets = torch.IntTensor([0, 2, 2, 3, 4, 5, 8])
    return JaggedTensor(values=values, offsets=offsets)


def test_jagged_tensor_to_dense():
    dense = _jt_doc().to_dense()
    assert [t.tolist() for t in dense] == [[1.0, 2.0], [], [3.0], [4.0], [5.0], [6.0, 7.0, 8.0]]


def test_jagged_tensor_to_padded_dense_truncates():
    out = _jt_doc().to_padded_dense(desired_length=2, padding_value=10.0)
    assert out.tolist() == [[1.0, 2.0], [10.0, 10.0], [3.0, 10.0], [4.0, 10.0], [5.0, 10.0], [6.0, 7.0]]


def test_jagged_tensor_to_dense_weights():
    values = torch.Tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    weights = torch.Tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    offsets = torch.IntTensor([0, 2, 2, 3, 4, 5, 8])
    jt = JaggedTensor(values=values, weights=weights, offsets=offsets)
    dw = jt.to_dense_weights()
    assert dw is not None
    torch.testing.assert_close(torch.cat(dw), weights)
    assert [len(t) for t in dw] == [2, 0, 1, 1, 1, 3]
    torch.testing.assert_close(dw[5], torch.tensor([0.6, 0.7, 0.8]))


def test_jagged_tensor_to_padded_dense_weights():
    values = torch.Tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    weights = torch.Tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    offsets = torch.IntTensor([0, 2, 2, 3, 4, 5, 8])
    jt = JaggedTensor(values=values, weights=weights, offsets=offsets)
    out = jt.to_padded_dense_weights(desired_length=2, padding_value=1.0)
    expected = torch.tensor([[0.1, 0.2], [1.0, 1.0], [0.3, 1.0], [0.4, 1.0], [0.5, 1.0], [0.6, 0.7]])
    torch.testing.assert_close(out, expected)


def test_jagged_tensor_from_dense():
    values = [torch.Tensor([1.0]), torch.Tensor(), torch.Tensor([7.0, 8.0]), torch.Tensor([10.0, 11.0, 12.0])]
    weights = [torch.Tensor([1.0]), torch.Tensor(), torch.Tensor([7.0, 8.0]), torch.Tensor([10.0, 11.0, 12.0])]
    j1 = JaggedTensor.from_dense(values=values, weights=weights)
    # (the TorchRec docstring's comment misprints this as [[1.0], [], [7.0], [8.0], [10.0, 11.0, 12.0]])
    assert [t.tolist() for t in j1.to_dense()] == [[1.0], [], [7.0, 8.0], [10.0, 11.0, 12.0]]
    assert j1.lengths().tolist() == [1, 0, 2, 3]
    assert j1.lengths().dtype == torch.int32
    assert [t.tolist() for t in j1.to_dense_weights()] == [[1.0], [], [7.0, 8.0], [10.0, 11.0, 12.0]]


def test_jagged_tensor_from_dense_lengths():
    values = torch.Tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0]])
    lengths = torch.IntTensor([2, 1, 3])
    jt = JaggedTensor.from_dense_lengths(values, lengths)
    assert jt.values().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [t.tolist() for t in jt.to_dense()] == [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]]


def _kjt_doc(weighted: bool = True) -> KeyedJaggedTensor:
    #              0       1        2  <-- dim_1
    # "Feature0"   [V0,V1] None    [V2]
    # "Feature1"   [V3]    [V4]    [V5,V6,V7]
    values = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])  # V0..V7
    weights = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) if weighted else None
    return KeyedJaggedTensor(
        keys=["Feature0", "Feature1"], values=values, weights=weights, lengths=torch.tensor([2, 0, 1, 1, 1, 3])
    )


def test_kjt_documented_layout():
    kjt = _kjt_doc()
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 8]
    assert kjt.index_per_key() == {"Feature0": 0, "Feature1": 1}
    assert kjt.offset_per_key() == [0, 3, 8]
    assert kjt.length_per_key() == [3, 5]
    assert kjt.stride() == 3
    assert kjt.stride_per_key() == [3, 3]


def test_kjt_to_dict_splits_by_key():
    d = _kjt_doc().to_dict()
    assert list(d) == ["Feature0", "Feature1"]
    assert [t.tolist() for t in d["Feature0"].to_dense()] == [[10, 11], [], [12]]
    assert [t.tolist() for t in d["Feature1"].to_dense()] == [[13], [14], [15, 16, 17]]
    torch.testing.assert_close(d["Feature1"].weights(), torch.tensor([0.3, 0.4, 0.5, 0.6, 0.7]))
    assert d["Feature0"].lengths().tolist() == [2, 0, 1]


def test_kjt_from_offsets_matches_lengths():
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["Feature0", "Feature1"],
        values=torch.tensor([10, 11, 12, 13, 14, 15, 16, 17]),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]),
    )
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert kjt.length_per_key_or_none() == [3, 5]


def test_kjt_from_jt_dict_doc():
    jt_dict = {
        "Feature0": JaggedTensor(values=torch.tensor([10, 11, 12]), lengths=torch.tensor([2, 0, 1])),
        "Feature1": JaggedTensor(values=torch.tensor([13, 14, 15, 16, 17]), lengths=torch.tensor([1, 1, 3])),
    }
    kjt = KeyedJaggedTensor.from_jt_dict(jt_dict)
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 3]
    assert kjt.offset_per_key() == [0, 3, 8]
    assert not kjt.variable_stride_per_key()
    # the documented pitfall: leaving out Feature0's empty bag gives a variable batch size per key
    short = dict(jt_dict, Feature0=JaggedTensor(values=torch.tensor([10, 11, 12]), lengths=torch.tensor([2, 1])))
    vkjt = KeyedJaggedTensor.from_jt_dict(short)
    assert vkjt.lengths().tolist() == [2, 1, 1, 1, 3]
    assert vkjt.variable_stride_per_key()
    assert vkjt.stride_per_key() == [2, 3]


def test_keyed_tensor_from_tensor_list_doc():
    #                         0           1           2
    #     "Embedding A"    [1,1]       [1,1]        [1,1]
    #     "Embedding B"    [2,1,2]     [2,1,2]      [2,1,2]
    #     "Embedding C"    [3,1,2,3]   [3,1,2,3]    [3,1,2,3]
    tensor_list = [
        torch.tensor([[1, 1]] * 3),
        torch.tensor([[2, 1, 2]] * 3),
        torch.tensor([[3, 1, 2, 3]] * 3),
    ]
    keys = ["Embedding A", "Embedding B", "Embedding C"]
    kt = KeyedTensor.from_tensor_list(keys, tensor_list)
    assert kt.values().tolist() == [[1, 1, 2, 1, 2, 3, 1, 2, 3]] * 3
    assert kt["Embedding B"].tolist() == [[2, 1, 2], [2, 1, 2], [2, 1, 2]]
    assert kt.length_per_key() == [2, 3, 4]
    assert kt.offset_per_key() == [0, 2, 5, 9]
    assert kt.keys() == keys


def test_keyed_tensor_regroup_doc():
    kt1 = KeyedTensor.from_tensor_list(["a", "b"], [torch.full((2, 1), 1.0), torch.full((2, 2), 2.0)])
    kt2 = KeyedTensor.from_tensor_list(["c"], [torch.full((2, 3), 3.0)])
    g = KeyedTensor.regroup([kt1, kt2], [["a", "c"], ["b"]])
    assert g[0].tolist() == [[1.0, 3.0, 3.0, 3.0]] * 2
    assert g[1].tolist() == [[2.0, 2.0]] * 2
    d = KeyedTensor.regroup_as_dict([kt1, kt2], [["a", "c"], ["b"]], ["ac", "b"])
    assert list(d) == ["ac", "b"] and torch.equal(d["ac"], g[0])
