import pytest
import torch

from padless.jagged import KeyedTensor


def _kt() -> KeyedTensor:
    return KeyedTensor.from_tensor_list(["a", "b"], [torch.arange(4.0).view(2, 2), torch.arange(6.0).view(2, 3)])


def test_accessors_and_views():
    kt = _kt()
    assert kt.keys() == ["a", "b"] and kt.key_dim() == 1
    assert kt.length_per_key() == [2, 3] and kt.offset_per_key() == [0, 2, 5]
    assert kt.index_per_key() == {"a": 0, "b": 1}
    assert kt["b"].data_ptr() == kt.values()[:, 2:].data_ptr()
    d = kt.to_dict()
    assert d["a"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and d["b"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(KeyError, match=r"no key 'z'; keys are \['a', 'b'\]"):
        kt["z"]


def test_key_dim_zero():
    kt = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(1, 3), torch.zeros(2, 3)], key_dim=0, cat_dim=0)
    assert kt.values().shape == (3, 3) and kt.length_per_key() == [1, 2]
    assert kt["y"].tolist() == [[0.0] * 3] * 2


def test_regroup_across_keyed_tensors():
    kt1 = _kt()
    kt2 = KeyedTensor.from_tensor_list(["c"], [torch.full((2, 1), 9.0)])
    g = KeyedTensor.regroup([kt1, kt2], [["c", "a"], ["b"]])
    assert g[0].tolist() == [[9.0, 0.0, 1.0], [9.0, 2.0, 3.0]]
    assert torch.equal(g[1], kt1["b"])
    with pytest.raises(KeyError, match=r"keys \['q'\] are in no KeyedTensor"):
        KeyedTensor.regroup([kt1], [["q"]])
    with pytest.raises(ValueError, match="2 groups but 1 keys"):
        KeyedTensor.regroup_as_dict([kt1], [["a"], ["b"]], ["x"])


def test_regroup_keeps_autograd():
    t = torch.randn(2, 5, requires_grad=True)
    kt = KeyedTensor(["a", "b"], [2, 3], t)
    (g,) = KeyedTensor.regroup([kt], [["b", "a"]])
    g.sum().backward()
    torch.testing.assert_close(t.grad, torch.ones(2, 5))


def test_to_moves_values():
    kt = _kt().to("meta")
    assert kt.device() == torch.device("meta") and kt["b"].shape == (2, 3)


@pytest.mark.parametrize(
    "args, match",
    [
        ((["a"], [1, 2], torch.ones(2, 3)), r"keys and length_per_key disagree: 1 keys, length_per_key \[1, 2\]"),
        ((["a", "b"], [1, 1], torch.ones(2, 3)), r"length_per_key \[1, 1\] sums to 2 but values has 3 entries along key_dim 1"),
        ((["a"], [3], torch.ones(2, 3), 2), "key_dim 2 is out of range"),
    ],
)
def test_validation(args, match):
    with pytest.raises(ValueError, match=match):
        KeyedTensor(*args)


def test_negative_length_per_key_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"KeyedTensor: length_per_key must be >= 0, but key 'b' has -1 \(length_per_key \[3, -1\]\)"):
        KeyedTensor(["a", "b"], [3, -1], torch.ones(2, 2))


def test_duplicate_keys_are_refused_where_a_key_addresses_them():
    kt = KeyedTensor(["a", "a"], [1, 1], torch.ones(2, 2))
    assert kt.values().shape == (2, 2) and kt.offset_per_key() == [0, 1, 2]  # positional access works
    with pytest.raises(RuntimeError, match=r"KeyedTensor.to_dict\(\): keys must be unique, but 'a' is keys\[0\] and keys\[1\]"):
        kt.to_dict()
    with pytest.raises(RuntimeError, match=r"KeyedTensor.index_per_key\(\): keys must be unique, but 'a'"):
        kt["a"]


def test_regroup_empty_group_is_batch_by_zero():
    kt = _kt()
    assert [tuple(t.shape) for t in KeyedTensor.regroup([kt], [[], ["b"], []])] == [(2, 0), (2, 3), (2, 0)]
    assert [tuple(t.shape) for t in KeyedTensor.regroup([kt], [[]])] == [(2, 0)]


def test_from_tensor_list_count_mismatch():
    with pytest.raises(ValueError, match="2 keys but 1 tensors"):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(1, 1)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_move_record_stream():
    kt = _kt().pin_memory().to("cuda", non_blocking=True)
    kt.record_stream(torch.cuda.current_stream())
    assert kt["b"].cpu().tolist() == _kt()["b"].tolist()
