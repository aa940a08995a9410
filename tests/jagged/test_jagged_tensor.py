import pytest
import torch

import padless
from padless.jagged import JaggedTensor


def _jt(weighted: bool = False) -> JaggedTensor:
    v = torch.arange(1.0, 9.0)
    return JaggedTensor(values=v, weights=v / 10 if weighted else None, lengths=torch.tensor([2, 0, 1, 1, 1, 3]))


def test_accessors_name_their_cost():
    jt = JaggedTensor(values=torch.arange(3.0), lengths=torch.tensor([1, 2]))
    assert jt.offsets_or_none() is None
    assert jt.offsets().tolist() == [0, 1, 3]
    assert jt.offsets_or_none() is jt.offsets()  # computed once, cached
    jt2 = JaggedTensor(values=torch.arange(3.0), offsets=torch.tensor([0, 1, 3]))
    assert jt2.lengths_or_none() is None and jt2.lengths().tolist() == [1, 2]
    assert jt.weights_or_none() is None
    with pytest.raises(ValueError, match="has no weights; use weights_or_none"):
        jt.weights()
    assert jt.device() == torch.device("cpu")
    assert len(jt) == 2


def test_static_dims_and_padding():
    v = torch.arange(10.0).view(5, 2)
    jt = JaggedTensor(values=v, lengths=torch.tensor([3, 0, 2]))
    p = jt.to_padded_dense()
    assert p.shape == (3, 3, 2)
    assert p[0].tolist() == v[:3].tolist() and p[1].abs().sum() == 0 and p[2, 2].tolist() == [0.0, 0.0]
    assert jt.to_padded_dense(1, -1.0)[2].tolist() == [[6.0, 7.0]]
    assert jt.to_padded_dense(0).shape == (3, 0, 2)


def test_empty():
    e = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int64)
    assert e.values().numel() == 0 and e.weights().numel() == 0
    assert e.lengths().tolist() == [] and e.offsets().tolist() == []  # TorchRec's empty offsets
    assert e.to_dense() == [] and e.to_padded_dense().shape == (0, 0)
    assert e.lengths().dtype == torch.int32


def test_nested_tensor_round_trip_is_a_view():
    jt = _jt(weighted=True)
    nt = jt.to_nested()
    assert isinstance(nt, padless.NestedTensor)
    assert nt.values().data_ptr() == jt.values().data_ptr()
    assert [s.tolist() for s in nt.unbind()] == [t.tolist() for t in jt.to_dense()]
    assert [s.tolist() for s in jt.to_nested(weights=True).unbind()] == [t.tolist() for t in jt.to_dense_weights()]
    back = JaggedTensor.from_nested(nt, weights=jt.weights())
    assert back.offsets().tolist() == jt.offsets().tolist()
    assert back.values().data_ptr() == jt.values().data_ptr()
    x = padless.from_list([torch.randn(2, 4), torch.randn(0, 4), torch.randn(5, 4)])
    jx = JaggedTensor.from_nested(x)
    assert jx.lengths().tolist() == [2, 0, 5] and jx.values().shape == (7, 4)
    assert padless.from_values(jx.values(), jx.offsets()).lengths().tolist() == [2, 0, 5]


def test_nested_tensor_autograd_flows():
    v = torch.randn(6, 3, requires_grad=True)
    jt = JaggedTensor(values=v, lengths=torch.tensor([4, 2]))
    nt = jt.to_nested()
    nt.sum(dim=1).sum().backward()
    torch.testing.assert_close(v.grad, torch.ones(6, 3))


def test_from_nested_refuses_other_layouts():
    imgs = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 5)], ragged_dims=(1,))
    with pytest.raises(ValueError, match=r"only ragged dim is the first .* ragged_dims=\(1,\)"):
        JaggedTensor.from_nested(imgs)


def test_to_keeps_host_offsets_so_nothing_syncs():
    jt = _jt(weighted=True).to("meta")  # meta tensors cannot be read: any host read would raise
    assert jt.device() == torch.device("meta")
    assert [t.shape[0] for t in jt.to_dense()] == [2, 0, 1, 1, 1, 3]
    assert [t.shape[0] for t in jt.to_dense_weights()] == [2, 0, 1, 1, 1, 3]


# checked at construction: types, ranks and counts (no data is read)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(values=torch.arange(4.0), lengths=torch.ones(2, 2, dtype=torch.int64)), r"lengths must be 1-D, got shape \(2, 2\)"),
        (dict(values=torch.arange(4.0)), "pass lengths= or offsets="),
        (dict(values=torch.arange(4.0), lengths=torch.tensor([2.0, 2.0])), "lengths must be an integer tensor"),
        (dict(values=torch.arange(4.0), lengths=torch.tensor([2, 2]), offsets=torch.tensor([0, 4])), r"offsets must have len\(lengths\) \+ 1 = 3 entries, got 2"),
        (dict(values=torch.tensor(1.0), lengths=torch.tensor([1])), "values must have a row dim"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        JaggedTensor(**kwargs)


# the structure of host lengths/offsets and the weights' rows: checked on first read (construction
# is lazy, as in TorchRec); a fault raises in what reads values through the structure
DEFERRED = [
    (dict(values=torch.arange(4.0), weights=torch.ones(3), lengths=torch.tensor([4])), "the lengths cover 4 rows but weights has only 3"),
    (dict(values=torch.arange(3.0), lengths=torch.tensor([2, 2])), "the lengths cover 4 rows but values has only 3"),
    (dict(values=torch.arange(4.0), lengths=torch.tensor([5, -1])), r"lengths must be >= 0, but lengths\[1\] = -1"),
    (dict(values=torch.arange(4.0), offsets=torch.tensor([0, 3, 2, 4])), r"offsets must not decrease, but offsets\[1\] = 3 > offsets\[2\] = 2"),
    (dict(values=torch.arange(4.0), offsets=torch.tensor([1, 2, 4])), r"offsets must start at 0, got offsets\[0\] = 1"),
    (dict(values=torch.arange(4.0), offsets=torch.tensor([0, 2, 5])), "the lengths cover 5 rows but values has only 4"),
    (dict(values=torch.arange(4.0), lengths=torch.tensor([2, 2]), offsets=torch.tensor([0, 1, 4])), "lengths and offsets disagree"),
]
FIRST_USES = {
    "validate": lambda jt: jt.validate(),
    "padless.jagged.validate": padless.jagged.validate,
    "to_dense": lambda jt: jt.to_dense(),
    "to_padded_dense": lambda jt: jt.to_padded_dense(),
    "host_offsets": lambda jt: jt.host_offsets(),
    "to_nested": lambda jt: jt.to_nested(),
    "str": str,
    "embedding_bag": lambda jt: padless.jagged.embedding_bag(
        JaggedTensor(jt.values().long(), jt.weights_or_none(), jt.lengths_or_none(), jt.offsets_or_none()), torch.ones(9, 2)
    ),
    "after to(meta)": lambda jt: jt.to("meta").to_dense(),  # the fault travels with the moved copy
}


@pytest.mark.parametrize("use", list(FIRST_USES))
@pytest.mark.parametrize("kwargs, match", DEFERRED)
def test_structure_errors_on_first_use(kwargs, match, use):
    jt = JaggedTensor(**kwargs)  # lazy: types and shapes only
    for _ in range(2):  # an invalid structure stays invalid: asked again, it raises again
        with pytest.raises(padless.StructureError, match=match):
            FIRST_USES[use](jt)


@pytest.mark.parametrize("kwargs, match", DEFERRED)
def test_a_fault_does_not_stop_what_torchrec_accepts(kwargs, match):
    # TorchRec accepts these JaggedTensors; what only passes the tensors along works on them
    jt = JaggedTensor(**kwargs)
    lengths, offsets = kwargs.get("lengths"), kwargs.get("offsets")
    if lengths is not None:
        assert jt.lengths() is lengths and (offsets is not None or jt.offsets().tolist() == [0, *lengths.cumsum(0).tolist()])
    if offsets is not None:
        assert jt.offsets() is offsets and (lengths is not None or jt.lengths().tolist() == offsets.diff().tolist())
    for moved in (jt.to("cpu"), jt.pin_memory() if torch.cuda.is_available() else jt.to("meta")):
        assert moved.lengths().shape == jt.lengths().shape
        with pytest.raises(padless.StructureError, match=match):  # still unreadable after the move
            moved.validate()
    assert jt.size_in_bytes() > 0 and "JaggedTensor(B=" in repr(jt)


def test_str_of_values_with_more_than_2_dims_raises_as_in_torchrec():
    three_d = JaggedTensor(torch.ones(4, 1, 3), lengths=torch.tensor([1, 0, 2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"str\(\): values of shape \(4, 1, 3\) have more than 2 dims, .* use repr\(\)"):
        str(three_d)
    assert "values=(4, 1, 3)" in repr(three_d)
    assert str(JaggedTensor(torch.ones(0, 1, 3), lengths=torch.tensor([], dtype=torch.int32))) == "JaggedTensor({\n    []\n})\n"


def test_structure_checks_pass_on_a_sound_jagged_tensor():
    ok = JaggedTensor(torch.arange(4.0), lengths=torch.tensor([1, 3]))
    assert ok.validate() is ok and padless.jagged.validate(ok) is ok and ok.offsets().tolist() == [0, 1, 4]
    # tensors on a device are trusted (never read back), as in TorchRec
    meta = JaggedTensor(torch.empty(4, device="meta"), lengths=torch.empty(2, dtype=torch.int64, device="meta"))
    assert meta.validate() is meta


def test_other_errors():
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(1,\) but values\[1\] has \(2,\)"):
        JaggedTensor.from_dense([torch.ones(1), torch.ones(2)], [torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\]"):
        JaggedTensor.from_dense_lengths(torch.ones(2, 2), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="desired_length must be >= 0"):
        _jt().to_padded_dense(-1)
    assert _jt().to_dense_weights() is None and _jt().to_padded_dense_weights() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinning, streams, device moves)")
def test_cuda_pin_move_record_stream():
    jt = _jt(weighted=True).pin_memory()
    assert jt.values().is_pinned() and jt.weights().is_pinned() and jt.lengths().is_pinned()
    g = jt.to("cuda", non_blocking=True)
    g.record_stream(torch.cuda.current_stream())
    assert g.device().type == "cuda"
    assert [t.tolist() for t in g.to_dense()] == [t.tolist() for t in _jt().to_dense()]
    torch.testing.assert_close(g.to_padded_dense(2).cpu(), _jt().to_padded_dense(2))


def test_to_padded_dense_gradient():
    v = torch.arange(1.0, 9.0, requires_grad=True)
    jt = JaggedTensor(values=v, lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    jt.to_padded_dense(desired_length=2).sum().backward()
    assert v.grad.tolist() == [1, 1, 1, 1, 1, 1, 1, 0]  # the truncated value gets no gradient
