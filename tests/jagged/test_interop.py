"""TorchRec conversion, only when torchrec is importable (padless never requires it)."""

import importlib.util

import pytest
import torch

from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None


@pytest.mark.skipif(HAS_TORCHREC, reason="torchrec is installed")
def test_clear_error_without_torchrec():
    with pytest.raises(ImportError, match="needs the torchrec package"):
        JaggedTensor(values=torch.arange(2), lengths=torch.tensor([2])).to_torchrec()


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")
def test_round_trip_through_torchrec():
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(8), torch.rand(8), lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    trc = kjt.to_torchrec()
    assert trc.offset_per_key() == [0, 3, 8]
    back = KeyedJaggedTensor.from_torchrec(trc)
    assert back.keys() == kjt.keys() and torch.equal(back.values(), kjt.values())
    assert [t.tolist() for t in back["b"].to_dense()] == [[3], [4], [5, 6, 7]]
    jt = kjt["a"]
    assert [t.tolist() for t in JaggedTensor.from_torchrec(jt.to_torchrec()).to_dense()] == [[0, 1], [], [2]]
    kt = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 1), torch.zeros(2, 2)])
    assert KeyedTensor.from_torchrec(kt.to_torchrec()).length_per_key() == [1, 2]


def _vbe_kjt():
    """A variable-batch KJT: f1 has 2 bags, f2 has 1; the full batch has 3 samples."""
    inv = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2"], values=torch.tensor([5, 6, 7, 1, 2, 3]), lengths=torch.tensor([3, 1, 2]),
        stride_per_key_per_rank=[[2], [1]], inverse_indices=(["f1", "f2"], inv),
    )
    return kjt, inv


def test_vbe_inverse_indices_survive_conversion_with_a_stand_in(monkeypatch):
    """Without torchrec: a stand-in for TorchRec's module whose KeyedJaggedTensor records the
    constructor keywords ``to_torchrec()`` passes (TorchRec's signature and accessors)."""
    import types

    from padless.jagged import _torchrec

    passed = {}

    class StandInKJT(KeyedJaggedTensor):
        def __init__(self, **kwargs):
            passed.update(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(_torchrec, "module", lambda: types.SimpleNamespace(KeyedJaggedTensor=StandInKJT))
    kjt, inv = _vbe_kjt()
    theirs = kjt.to_torchrec()
    assert isinstance(theirs, StandInKJT)
    assert passed["inverse_indices"][0] == ["f1", "f2"] and passed["inverse_indices"][1] is inv
    assert passed["stride"] is None and passed["stride_per_key_per_rank"] == [[2], [1]]
    assert theirs.inverse_indices()[1] is inv and theirs.stride() == 3
    back = KeyedJaggedTensor.from_torchrec(theirs)
    assert type(back) is KeyedJaggedTensor and back.inverse_indices()[1] is inv
    assert back.stride() == 3 and back.stride_per_key() == [2, 1]
    plain = KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([1, 1]))
    plain.to_torchrec()
    assert passed["inverse_indices"] is None and passed["stride"] == 2


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")
def test_vbe_inverse_indices_survive_torchrec():
    kjt, inv = _vbe_kjt()
    theirs = kjt.to_torchrec()
    assert theirs.variable_stride_per_key() and theirs.inverse_indices()[0] == ["f1", "f2"]
    assert torch.equal(theirs.inverse_indices()[1], inv) and theirs.stride() == 3
    back = KeyedJaggedTensor.from_torchrec(theirs)
    assert back.inverse_indices()[0] == ["f1", "f2"] and torch.equal(back.inverse_indices()[1], inv)
    assert back.stride_per_key_per_rank() == [[2], [1]]
