"""TorchRec's semantics for the jagged types, checked without TorchRec (issue 14's list).

Every expected value here was read off TorchRec 1.9 (``tests/jagged/test_torchrec_parity.py``
compares the two side by side where torchrec is installed).
"""

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx._pytree import tree_flatten_spec

import padless
from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def _dense(kjt: KeyedJaggedTensor) -> dict[str, list[list[int]]]:
    return {k: [t.tolist() for t in jt.to_dense()] for k, jt in kjt.to_dict().items()}


def _vbe(**kw) -> KeyedJaggedTensor:
    # f1: 2 bags, f2: 1 bag; the full batch has 3 samples (inverse indices' width)
    return KeyedJaggedTensor(
        keys=["f1", "f2"], values=torch.tensor([5, 6, 7, 1, 2, 3]), lengths=torch.tensor([3, 1, 2]),
        stride_per_key_per_rank=[[2], [1]], **kw,
    )


def test_inverse_indices_and_vbe_stride():
    inv = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = _vbe(inverse_indices=(["f1", "f2"], inv))
    assert kjt.stride() == 3 and kjt.stride_per_key() == [2, 1]  # stride: the inverse indices' width
    assert kjt.inverse_indices()[0] == ["f1", "f2"] and kjt.inverse_indices()[1] is inv
    assert _vbe().stride() == 2  # without them: the largest per-key batch
    with pytest.raises(ValueError, match=r"has no inverse indices; pass inverse_indices= .* inverse_indices_or_none"):
        _vbe().inverse_indices()
    # stride_per_key_per_rank may be shorter than the keys (the keys past it have no bags)
    short = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"], values=torch.tensor([5, 6, 7, 1, 2, 3, 0, 1]), lengths=torch.tensor([3, 3, 2]),
        stride_per_key_per_rank=[[2], [1]], inverse_indices=(["f1", "f2"], inv),
    )
    assert short.stride() == 3 and short.stride_per_key() == [2, 1, 0]
    assert _dense(short) == {"f1": [[5, 6, 7], [1, 2, 3]], "f2": [[0, 1]], "f3": []}
    # an int tensor (keys, ranks) is accepted, as TorchRec stores it
    t = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0]), stride_per_key_per_rank=torch.tensor([[1], [2]]))
    assert t.stride_per_key_per_rank() == [[1], [2]] and t.stride() == 2


def test_vbe_split_and_permute_keep_the_parent_stride():
    kjt = KeyedJaggedTensor(
        ["a", "b", "c", "d"], torch.arange(1.0, 11.0), lengths=torch.tensor([2, 0, 1, 1, 1, 3, 0, 2], dtype=torch.int32),
        stride_per_key_per_rank=[[3], [0], [1], [4]],
    )
    parts = kjt.split([0, 3, 0, 1])
    assert [p.stride() for p in parts] == [4, 4, 4, 4]
    assert [p.keys() for p in parts] == [[], ["a", "b", "c"], [], ["d"]]
    assert parts[1].lengths().tolist() == [2, 0, 1, 1] and parts[3].values().tolist() == [5.0, 6, 7, 8, 9, 10]
    assert parts[3].stride_per_key_per_rank() == [[4]] and parts[0].stride_per_key_per_rank() == []
    assert kjt.permute([0]).stride() == 4
    assert kjt.stride_per_key_per_rank() == [[3], [0], [1], [4]]
    fixed = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    assert fixed.stride_per_key_per_rank() == [] and not fixed.variable_stride_per_key()


def test_size_in_bytes_and_clear_storage():
    jt = JaggedTensor(torch.arange(3.0), torch.ones(3), lengths=torch.tensor([1, 2]))
    assert jt.size_in_bytes() == 3 * 4 + 3 * 4 + 2 * 8
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0, 0]))
    assert kjt.size_in_bytes() == 3 * 8 + 4 * 8
    vb = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0]), stride_per_key_per_rank=[[1], [2]])
    assert vb.size_in_bytes() == 3 * 8 + 3 * 8 + 2 * 4  # + the int32 per-key-per-rank strides
    kt = KeyedTensor(["a"], [2], torch.ones(3, 2))
    assert kt.size_in_bytes() == 6 * 4
    assert kjt.clear_storage() == 56
    assert kjt.values().untyped_storage().size() == 0 and kjt.lengths().numel() * kjt.lengths().untyped_storage().size() == 0


def test_empty_and_empty_like():
    e = JaggedTensor.empty()
    assert e.offsets().tolist() == [] and e.offsets().dtype == torch.int32 and e.lengths().tolist() == []
    assert len(e) == 0 and e.to_dense() == [] and e.to_padded_dense().shape == (0, 0)
    jt = JaggedTensor(torch.arange(3.0), torch.ones(3, dtype=torch.float64), lengths=torch.tensor([1, 2]))
    el = JaggedTensor.empty_like(jt)
    assert el.values().numel() == 0 and el.weights().dtype == torch.float64 and el.lengths().dtype == torch.int64
    assert el.offsets_or_none() is None and len(el) == 0
    moved = JaggedTensor.empty_like(jt, device="meta")  # TorchRec's device copy: same shapes, new storage
    assert moved.values().shape == (3,) and moved.device().type == "meta" and moved.lengths().shape == (2,)
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0, 0]))
    ek = KeyedJaggedTensor.empty_like(kjt)
    assert ek.keys() == [] and ek.stride() == 2 and ek.to_dict() == {} and str(ek) == "KeyedJaggedTensor()\n"


def test_to_dict_compute_offsets():
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0, 0]))
    d = kjt.to_dict()
    assert d["a"].offsets_or_none().tolist() == [0, 1, 3] and d["b"].offsets_or_none().tolist() == [0, 0, 0]
    assert d["a"].offsets_or_none().dtype == kjt.lengths().dtype
    lazy = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0, 0])).to_dict(compute_offsets=False)
    assert all(j.offsets_or_none() is None for j in lazy.values())
    assert [t.tolist() for t in lazy["a"].to_dense()] == [[0], [1, 2]]
    vb = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0]), stride_per_key_per_rank=[[1], [2]])
    assert [j.offsets().tolist() for j in vb.to_dict().values()] == [[0, 1], [0, 2, 2]]


def test_from_jt_dict_force_variable_stride():
    jts = {"a": JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2])), "b": JaggedTensor(torch.arange(2), lengths=torch.tensor([1, 1]))}
    k = KeyedJaggedTensor.from_jt_dict(jts, force_variable_stride=True)
    assert k.variable_stride_per_key() and k.stride_per_key_per_rank() == [[2], [2]] and k.stride() == 2
    k = KeyedJaggedTensor.from_jt_dict(jts)
    assert not k.variable_stride_per_key() and k.stride() == 2 and k.length_per_key() == [3, 2]


def test_values_longer_than_the_lengths_are_accepted_tail_ignored():
    jt = JaggedTensor(torch.arange(5.0), lengths=torch.tensor([1, 2]))
    assert [t.tolist() for t in jt.to_dense()] == [[0.0], [1.0, 2.0]]
    assert jt.to_padded_dense().tolist() == [[0.0, 0.0], [1.0, 2.0]]
    assert [s.tolist() for s in jt.to_nested().unbind()] == [[0.0], [1.0, 2.0]]
    assert JaggedTensor(torch.arange(5.0), offsets=torch.tensor([0, 1, 3])).to_dense()[1].tolist() == [1.0, 2.0]
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(9), torch.tensor([1, 2, 0, 1]))
    assert kjt.length_per_key() == [3, 1] and _dense(kjt) == {"a": [[0], [1, 2]], "b": [[], [3]]}
    cat = KeyedJaggedTensor.concat([kjt, KeyedJaggedTensor(["c"], torch.arange(10, 12), lengths=torch.tensor([1, 1]))])
    assert _dense(cat)["c"] == [[10], [11]]  # the first KJT's tail is dropped, not shifted into "c"
    rt = KeyedJaggedTensor.from_jt_dict({"x": JaggedTensor(torch.arange(4), lengths=torch.tensor([1])), "y": JaggedTensor(torch.arange(2), lengths=torch.tensor([2]))})
    assert _dense(rt) == {"x": [[0]], "y": [[0, 1]]}
    assert _dense(kjt.permute([1, 0])) == {"b": [[], [3]], "a": [[0], [1, 2]]}


def test_per_row_weights_with_2d_values():
    jt = JaggedTensor(torch.ones(3, 2), torch.tensor([1.0, 2, 3]), lengths=torch.tensor([1, 2]))
    assert [w.tolist() for w in jt.to_dense_weights()] == [[1.0], [2.0, 3.0]]
    assert jt.to_padded_dense_weights().tolist() == [[1.0, 0.0], [2.0, 3.0]]
    k = KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.ones(8, 3), torch.tensor([0, 2, 2, 3, 4, 5, 8]), weights=torch.arange(8.0))
    assert k["a"].weights().tolist() == [0.0, 1.0, 2.0] and k["a"].values().shape == (3, 3)


def test_empty_lengths_any_dtype_and_2d_and_no_lengths():
    assert JaggedTensor(torch.ones(0), lengths=torch.tensor([])).lengths().tolist() == []
    assert len(JaggedTensor(torch.ones(0), lengths=torch.empty(2, 0))) == 0
    k = KeyedJaggedTensor(["a", "b"], torch.tensor([]), lengths=torch.tensor([[], []]), length_per_key=[0, 0])
    assert k.stride() == 0 and k["a"].lengths().numel() == 0 and k.to_dict()["b"].values().numel() == 0
    k = KeyedJaggedTensor(["a"], torch.tensor([]), offsets=torch.tensor([]))
    assert k.stride() == 0 and k["a"].lengths().numel() == 0
    none = KeyedJaggedTensor(["a"], torch.arange(3))  # neither lengths nor offsets: no bags
    assert str(none) == "KeyedJaggedTensor()\n" and none.stride() == 0 and none.lengths().tolist() == []
    assert str(KeyedJaggedTensor([], torch.Tensor())) == "KeyedJaggedTensor()\n"
    assert str(KeyedTensor([], [], torch.Tensor())) == "KeyedTensor()\n"


def test_sync_on_meta_splits_values_evenly():
    kjt = KeyedJaggedTensor(["a", "b", "c"], torch.empty(10, device="meta"), lengths=torch.empty(6, dtype=torch.int64, device="meta"))
    assert kjt.sync().length_per_key() == [4, 3, 3]
    e = KeyedJaggedTensor.from_lengths_sync([], torch.tensor([], device="meta"), torch.tensor([], device="meta"))
    assert e.length_per_key() == []


def test_str_like_torchrec():
    assert str(JaggedTensor(torch.tensor([1.0, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 0, 2, 3], dtype=torch.int32))) == (
        "JaggedTensor({\n    [[1.0], [], [2.0, 3.0], [4.0, 5.0, 6.0]]\n})\n"
    )
    two_d = JaggedTensor(torch.arange(4.0).view(2, 2), lengths=torch.tensor([1, 1]))
    assert str(two_d) == "JaggedTensor({\n    [[[0.0, 1.0]], [[2.0, 3.0]]]\n})\n"
    w = JaggedTensor(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 1.5]), lengths=torch.tensor([2]))
    assert str(w) == 'JaggedTensor({\n    "values": [[1.0, 2.0]],\n    "weights": [[0.5, 1.5]]\n})\n'
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0, 0]))
    assert str(kjt) == 'KeyedJaggedTensor({\n    "a": [[0], [1, 2]],\n    "b": [[], []]\n})\n'
    kw = KeyedJaggedTensor(["a"], torch.arange(3), torch.ones(3), lengths=torch.tensor([1, 2]))
    assert str(kw) == (
        'KeyedJaggedTensor({\n    "a": {\n        "values": [[0], [1, 2]],\n        "weights": [[1.0], [1.0, 1.0]]\n    }\n})\n'
    )
    kt = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    assert str(kt) == 'KeyedTensor({\n    "a": [[0.0], [3.0]],\n    "b": [[1.0, 2.0], [4.0, 5.0]]\n})\n'
    assert "JaggedTensor(B=" in repr(w)  # repr stays a one-line summary


def test_pytree_nodes():
    jt = JaggedTensor(torch.arange(3.0), lengths=torch.tensor([1, 2]))
    leaves, spec = pytree.tree_flatten(jt)
    assert len(leaves) == 4 and leaves[0] is jt.values() and leaves[1] is None and leaves[3] is None
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, JaggedTensor) and back.lengths().tolist() == [1, 2]
    doubled = pytree.tree_map(lambda t: t * 2 if t is not None and t.is_floating_point() else t, {"x": jt})
    assert doubled["x"].values().tolist() == [0.0, 2.0, 4.0]
    inv = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = _vbe(weights=torch.ones(6), inverse_indices=(["f1", "f2"], inv))
    leaves, spec = pytree.tree_flatten(kjt)
    assert len(leaves) == 6 and leaves[4].tolist() == [[2], [1]] and leaves[5] is inv
    k2 = pytree.tree_unflatten(leaves, spec)
    assert k2.keys() == ["f1", "f2"] and k2.stride_per_key_per_rank() == [[2], [1]] and k2.stride() == 3
    assert torch.equal(k2.inverse_indices()[1], inv) and _dense(k2) == _dense(kjt)
    plain = KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 1, 3]))
    leaves, spec = pytree.tree_flatten(plain)
    short = pytree.TreeSpec(spec.type, spec.context, spec.children()[:4])
    assert pytree.tree_unflatten(leaves[:4], short).offsets().tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="pytree unflatten got 12 tensors, at most 6"):
        pytree.tree_unflatten(leaves + leaves, pytree.TreeSpec(spec.type, spec.context, spec.children() * 2))
    kt = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 1), torch.zeros(2, 2)])
    leaves, spec = pytree.tree_flatten(kt)
    assert len(leaves) == 1 and pytree.tree_unflatten(leaves, spec).length_per_key() == [1, 2]
    swapped = KeyedTensor.from_tensor_list(["y", "x"], [torch.zeros(2, 2), torch.ones(2, 1)])
    assert torch.equal(tree_flatten_spec(swapped, spec)[0], kt.values())  # an export spec's key order wins


def test_structure_errors_are_structure_errors():
    with pytest.raises(padless.StructureError, match=r"lengths must be >= 0, but lengths\[0\] = -1"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([-1, 4])).validate()
    with pytest.raises(RuntimeError, match="keys and lengths disagree"):  # what TorchRec-style code catches
        KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1, 1]))


def test_float_lengths_raise_what_torchrec_code_catches():
    # a TypeError, and the AssertionError TorchRec raises for float lengths/offsets
    for kwargs in (dict(lengths=torch.tensor([3.0, 4.0])), dict(offsets=torch.tensor([0.0, 3.0, 7.0]))):
        with pytest.raises(AssertionError, match="must be an integer tensor, got torch.float32"):
            JaggedTensor(torch.rand(7, 3), **kwargs)
        with pytest.raises(TypeError, match="must be an integer tensor"):
            KeyedJaggedTensor(["a"], torch.rand(7, 3), **kwargs)


def test_offsets_of_empty_float_lengths_are_integers():
    # TorchRec accepts empty float lengths (torch.tensor([[], []])); the offsets derived from them
    # describe zero bags as [0], as TorchRec's do for integer lengths, in an integer dtype
    for k in (
        KeyedJaggedTensor(["a", "b"], torch.tensor([]), lengths=torch.tensor([[], []]), length_per_key=[0, 0]),
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([]), torch.tensor([[], []])),
    ):
        for j in k.to_dict().values():
            assert j.lengths().numel() == 0 and j.offsets().tolist() == [0] and j.offsets().dtype == torch.int64
        assert k.offsets().tolist() == [0] and k.offsets().dtype == torch.int64
    jt = JaggedTensor(torch.ones(0), lengths=torch.tensor([]))
    assert jt.offsets().tolist() == [0] and jt.offsets().dtype == torch.int64
    assert JaggedTensor(jt.values(), offsets=jt.offsets()).validate().lengths().tolist() == []  # usable again


def test_weights_are_read_by_rows_like_values():
    # TorchRec slices weights by the values' offsets: any shape with enough rows is readable
    k = KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.arange(8), torch.tensor([0, 2, 2, 3, 4, 5, 8]), weights=torch.arange(80))
    moved = k.to(torch.device("cpu"))
    assert torch.equal(moved.weights(), torch.arange(80)) and torch.equal(moved.offsets(), k.offsets())
    assert k["a"].weights().tolist() == [0, 1, 2] and k["b"].weights().tolist() == [3, 4, 5, 6, 7]
    jt = JaggedTensor(torch.arange(3.0), torch.ones(3, 2), lengths=torch.tensor([1, 2]))  # (T, 2) weights, (T,) values
    assert jt.to_padded_dense_weights().shape == (2, 2, 2)
    with pytest.raises(padless.StructureError, match=r"weights must have a row dim \(T, \.\.\.\), got a 0-d tensor"):
        JaggedTensor(torch.arange(3.0), torch.tensor(1.0), lengths=torch.tensor([3])).validate()


def test_str_of_keyed_tensor_prints_3d_blocks_and_refuses_4d():
    kt = KeyedTensor(["a"], [1], torch.arange(4.0).view(2, 1, 2))
    assert str(kt) == 'KeyedTensor({\n    "a": [[[0.0, 1.0]], [[2.0, 3.0]]]\n})\n'
    with pytest.raises(ValueError, match=r"str\(\): values of shape \(2, 1, 1, 1\) have more than 3 dims"):
        str(KeyedTensor(["a"], [1], torch.ones(2, 1, 1, 1)))
