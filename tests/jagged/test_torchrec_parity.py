"""Side by side with real TorchRec (skipped where torchrec is not installed).

Each case runs the same calls on TorchRec's classes and on padless' and compares what a
user reads back. Run it in an environment with ``torchrec`` and ``fbgemm-gpu-cpu``
(see ``benchmarks/torchrec_suite.py`` for TorchRec's own tests through a shim).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import padless
import padless.jagged as pj
from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="torchrec is not installed")


@pytest.fixture(scope="module")
def trj():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchrec.sparse.jagged_tensor as m
    return m


def _read(x):
    """What a user reads back, as plain python (tensors to lists)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.tolist())
    if isinstance(x, (list, tuple)):
        return [_read(v) for v in x]
    if isinstance(x, dict):
        return {k: _read(v) for k, v in x.items()}
    return x


def _jt_state(j):
    return _read([j.values(), j.weights_or_none(), j.lengths(), j.offsets(), [t for t in j.to_dense()]])


def _kjt_state(k):
    return _read([
        k.keys(), k.values(), k.weights_or_none(), k.lengths(), k.stride(), k.stride_per_key(),
        k.length_per_key(), k.offset_per_key(), {n: _jt_state(j) for n, j in k.to_dict().items()},
    ])


CASES = {
    "vbe": lambda m: m.KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 2, 0]), stride_per_key_per_rank=[[1], [2]]),
    "vbe inverse": lambda m: m.KeyedJaggedTensor(
        ["a", "b"], torch.arange(6), lengths=torch.tensor([3, 1, 2]), stride_per_key_per_rank=[[2], [1]],
        inverse_indices=(["a", "b"], torch.tensor([[0, 1, 0], [0, 0, 0]])),
    ),
    "weighted 2-d rows": lambda m: m.KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.arange(24.0).view(8, 3), torch.tensor([0, 2, 2, 3, 4, 5, 8]), weights=torch.arange(8.0)),
    "empty": lambda m: m.KeyedJaggedTensor.empty(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kjt_reads_the_same(trj, case):
    assert _kjt_state(CASES[case](pj)) == _kjt_state(CASES[case](trj))


@pytest.mark.parametrize("case", [c for c in CASES if c != "empty"])
def test_kjt_methods_agree(trj, case):
    ours, theirs = CASES[case](pj), CASES[case](trj)
    assert ours.size_in_bytes() == theirs.size_in_bytes()  # before str(): TorchRec's str caches offsets
    assert str(ours) == str(theirs)
    assert [p.stride() for p in ours.split([1, 1])] == [p.stride() for p in theirs.split([1, 1])]
    assert ours.permute([1, 0]).stride() == theirs.permute([1, 0]).stride()
    el, et = KeyedJaggedTensor.empty_like(ours), trj.KeyedJaggedTensor.empty_like(theirs)
    assert (el.keys(), el.stride(), el.stride_per_key_per_rank()) == (et.keys(), et.stride(), et.stride_per_key_per_rank())
    assert [j.offsets_or_none() for j in ours.to_dict(compute_offsets=False).values()] == [None, None]
    fo, ft = KeyedJaggedTensor.from_jt_dict(ours.to_dict(), force_variable_stride=True), trj.KeyedJaggedTensor.from_jt_dict(theirs.to_dict(), force_variable_stride=True)
    assert (fo.stride_per_key_per_rank(), fo.stride()) == (ft.stride_per_key_per_rank(), ft.stride())
    lo, lt = pytree.tree_flatten(CASES[case](pj))[0], pytree.tree_flatten(CASES[case](trj))[0]  # fresh: nothing cached
    assert len(lo) == len(lt) and [x is None for x in lo] == [x is None for x in lt]


def test_values_longer_than_lengths(trj):
    ours = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(5), torch.tensor([1, 1, 0, 1]))
    theirs = trj.KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(5), torch.tensor([1, 1, 0, 1]))
    assert ours.length_per_key() == theirs.length_per_key() and ours.offset_per_key() == theirs.offset_per_key()
    assert _read(ours["b"].values()) == _read(theirs["b"].values())  # TorchRec's to_dict() refuses the tail


def test_jagged_tensor_reads_the_same(trj):
    for make in (
        lambda J: J(torch.arange(5.0), lengths=torch.tensor([1, 2])),
        lambda J: J(torch.ones(3, 2), torch.tensor([1.0, 2, 3]), lengths=torch.tensor([1, 2])),
        lambda J: J.empty(),
    ):
        ours, theirs = make(JaggedTensor), make(trj.JaggedTensor)
        assert _read([ours.values(), ours.lengths(), ours.offsets()]) == _read([theirs.values(), theirs.lengths(), theirs.offsets()])
        assert ours.size_in_bytes() == theirs.size_in_bytes() and str(ours) == str(theirs)
        if len(ours):
            assert _read(ours.to_padded_dense()) == _read(theirs.to_padded_dense())
            assert _read(ours.to_padded_dense(1, -1.0)) == _read(theirs.to_padded_dense(1, -1.0))
            if ours.weights_or_none() is not None:
                assert _read(ours.to_padded_dense_weights()) == _read(theirs.to_padded_dense_weights())


def test_keyed_tensor_reads_the_same(trj):
    ours = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    theirs = trj.KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    assert str(ours) == str(theirs) and ours.size_in_bytes() == theirs.size_in_bytes()
    assert str(KeyedTensor([], [], torch.Tensor())) == str(trj.KeyedTensor([], [], torch.Tensor()))
    assert _read(pytree.tree_flatten(ours)[0]) == _read(pytree.tree_flatten(theirs)[0])


def test_round_trip_with_torchrec_objects(trj):
    k = CASES["vbe"](pj)
    back = KeyedJaggedTensor.from_torchrec(k.to_torchrec())
    assert _kjt_state(back) == _kjt_state(k)
    kt = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    assert torch.equal(trj.KeyedTensor.regroup([kt.to_torchrec()], [["b", "a"]])[0], KeyedTensor.regroup([kt], [["b", "a"]])[0])
    # TorchRec's own regroup helpers accept padless KeyedTensors (they call the private _key_indices)
    assert torch.equal(trj._regroup_keyed_tensors([kt], [["b", "a"]])[0], KeyedTensor.regroup([kt], [["b", "a"]])[0])


# inputs TorchRec accepts though their values cannot be read through the structure: padless accepts
# them too, for everything that only passes the tensors along (values are read only by to_dict & co.)
ACCEPTED = {
    "lengths need more rows": lambda m: m.KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(8.0), torch.arange(1, 9, dtype=torch.int32)),
    "offsets decrease": lambda m: m.KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.arange(8.0), torch.tensor([8, 4, 1, 5, 0, 1, 2, 1, 2], dtype=torch.int32)),
    "weights with more rows": lambda m: m.KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.arange(8), torch.tensor([0, 2, 2, 3, 4, 5, 8]), weights=torch.arange(80)),
    "given per-key lists": lambda m: m.KeyedJaggedTensor(
        ["a", "b"], torch.arange(8.0), offsets=torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8], dtype=torch.int32), length_per_key=[4, 4], offset_per_key=[0, 4],
    ),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepts_what_torchrec_accepts(trj, case):
    def state(k):
        k = k.to(torch.device("cpu"))
        k.sync()
        return _read([k.keys(), k.values(), k.weights_or_none(), k.lengths(), k.offsets(), k.stride(), k.length_per_key(), k.offset_per_key()])

    ours, theirs = ACCEPTED[case](pj), ACCEPTED[case](trj)
    assert state(ours) == state(theirs)
    if case == "weights with more rows":  # readable: weights are sliced by the values' offsets
        assert _jt_state(ours["b"]) == _jt_state(theirs["b"])  # (TorchRec's to_dict() refuses them)
        return
    with pytest.raises(padless.StructureError, match="KeyedJaggedTensor: "):
        ours.validate()  # still refused where values would be read


def test_concat_of_parts_split_off_the_keys(trj):
    values, lengths = torch.arange(1.0, 10.0), torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0, 0, 1, 0], dtype=torch.int32)

    def cat(m):
        return m.KeyedJaggedTensor.concat([
            m.KeyedJaggedTensor.from_lengths_sync(["a"], values[:4], lengths[:4]),
            m.KeyedJaggedTensor.from_lengths_sync(["b", "c"], values[4:], lengths[4:]),
        ])

    assert _kjt_state(cat(pj)) == _kjt_state(cat(trj))


def test_str_of_3d_values_raises_as_in_torchrec(trj):
    for m in (pj, trj):
        with pytest.raises(ValueError):
            str(m.JaggedTensor(torch.ones(4, 1, 3), lengths=torch.tensor([1, 0, 2, 0], dtype=torch.int32)))


def test_torchrec_tracer_traces_padless_types():
    import torchrec.fx as trfx

    class Pool(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 4))

        def forward(self, kjt: KeyedJaggedTensor) -> tuple[KeyedTensor, KeyedJaggedTensor]:
            out = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths())
            return pj.embedding_bag(out, self.table), out

    m = Pool()
    gm = trfx.symbolic_trace(m)
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]))
    (kt, out), (kt_ref, out_ref) = gm(kjt), m(kjt)
    assert torch.equal(kt.values(), kt_ref.values()) and out.length_per_key() == out_ref.length_per_key() == [1, 2]


def test_str_of_keyed_tensor_blocks_up_to_3_dims(trj):
    for shape in ((2, 3), (2, 3, 2)):
        values = torch.arange(float(torch.Size(shape).numel())).view(shape)
        assert str(KeyedTensor(["a", "b"], [1, 2], values)) == str(trj.KeyedTensor(["a", "b"], [1, 2], values))
    four = torch.ones(2, 3, 1, 1)
    for m in (pj, trj):
        with pytest.raises(ValueError):
            str(m.KeyedTensor(["a", "b"], [1, 2], four))
