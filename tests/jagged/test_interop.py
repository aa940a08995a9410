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
