"""torch.fx symbolic tracing of modules that take, build or return the jagged types (no TorchRec needed)."""

import pytest
import torch
from torch.fx import symbolic_trace

import padless
from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor, embedding_bag


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(
        ["a", "b"], torch.arange(1.0, 9.0), torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8]), weights=torch.full((8,), 0.5)
    )


class JaggedOut(torch.nn.Module):
    def forward(self, values: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor) -> JaggedTensor:
        return JaggedTensor(values, weights, lengths)


class JaggedInOut(torch.nn.Module):
    def forward(self, jt: JaggedTensor) -> JaggedTensor:
        return JaggedTensor(jt.values() * 2, jt.weights(), lengths=jt.lengths(), offsets=jt.offsets())


class KeyedInOut(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, int]:
        out = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights(), lengths=kjt.lengths())
        return out, out.stride()


class CreatesInside(torch.nn.Module):
    def forward(self, x: int) -> int:  # built from constants: no trace of it is left in the graph
        jt = JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2]))
        return jt.values().numel() + jt.lengths().numel()


def test_jagged_tensor_as_output_input_and_inside():
    v, w, lengths = torch.arange(8), torch.ones(8), torch.tensor([2, 0, 1, 1, 1, 3])
    gm = symbolic_trace(JaggedOut())
    assert "JaggedTensor(values, weights, lengths, None)" in gm.code and "return jagged_tensor" in gm.code
    out = gm(v, w, lengths)
    assert isinstance(out, JaggedTensor) and out.lengths() is lengths and out.to_dense()[5].tolist() == [5, 6, 7]
    jt = JaggedTensor(v.float(), w, lengths=lengths)
    gm = symbolic_trace(JaggedInOut())
    assert [s in gm.code for s in ("values()", "weights()", "lengths()", "offsets()", "JaggedTensor(")] == [True] * 5
    assert [t.tolist() for t in gm(jt).to_dense()] == [t.tolist() for t in JaggedInOut()(jt).to_dense()]
    gm = symbolic_trace(CreatesInside())
    assert "return 5" in gm.code and "JaggedTensor" not in gm.code and gm(0) == 5


def test_keyed_jagged_tensor_in_and_out_methods_become_nodes():
    gm = symbolic_trace(KeyedInOut())
    assert "KeyedJaggedTensor(keys, values, weights = weights, lengths = lengths)" in gm.code
    assert "keyed_jagged_tensor.stride()" in gm.code  # a method of the traced KJT is a node
    out, stride = gm(_kjt())
    assert stride == 4 and out.keys() == ["a", "b"] and out.length_per_key() == [3, 5]
    assert {k: [t.tolist() for t in j.to_dense()] for k, j in out.to_dict().items()} == {
        k: [t.tolist() for t in j.to_dense()] for k, j in _kjt().to_dict().items()
    }


def test_sync_constructors_in_traced_code():
    class FromOffsets(torch.nn.Module):
        def forward(self, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            kjt = KeyedJaggedTensor.from_offsets_sync(["a", "b"], values, offsets)
            return kjt["a"].offsets()

    gm = symbolic_trace(FromOffsets())
    assert "sync()" in gm.code  # the stand-in's sync() is a node, run with the real KJT
    for offsets, want in (([0, 2, 2], [0, 2]), ([0, 2, 2, 3, 4, 6, 8], [0, 2, 2, 3])):
        assert gm(torch.tensor(offsets), torch.arange(8)).tolist() == want


def test_keyed_tensor_built_from_traced_values():
    class Pooled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kt = KeyedTensor(["a", "b"], [1, 2], x * 2)
            return kt["b"]

    gm = symbolic_trace(Pooled())
    assert "KeyedTensor(['a', 'b'], [1, 2], mul, 1, None, None)" in gm.code
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(gm(x), Pooled()(x)) and gm(x).tolist() == [[2.0, 4.0], [8.0, 10.0]]


def test_static_helpers_are_one_node_each():
    class Helpers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 3))

        def forward(self, parts: list[KeyedJaggedTensor], kts: list[KeyedTensor]) -> tuple:
            cat = KeyedJaggedTensor.concat(parts)
            return embedding_bag(cat.permute([1, 0]), self.table), KeyedTensor.regroup(kts, [["y", "x"]]), KeyedJaggedTensor.empty_like(cat)

    gm = symbolic_trace(Helpers())
    for name in ("concat(", "embedding_bag(", "regroup(", "empty_like(", "permute("):
        assert name in gm.code
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]))
    kts = [KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 1), torch.zeros(2, 2)])]
    pooled, regrouped, empty = gm(kjt.split([1, 1]), kts)
    ref = Helpers()
    ref.table = gm.table
    want = ref(kjt.split([1, 1]), kts)
    assert torch.equal(pooled.values(), want[0].values()) and pooled.keys() == ["b", "a"]
    assert torch.equal(regrouped[0], want[1][0]) and empty.keys() == [] and empty.stride() == 2
    traced = symbolic_trace(JaggedTensor.from_dense_lengths)  # a helper as the traced root
    jt = traced(values=torch.arange(12.0).view(4, 3), lengths=torch.tensor([1, 0, 2, 3]))
    assert jt.values().tolist() == [0.0, 6.0, 7.0, 9.0, 10.0, 11.0]


def test_eager_errors_and_traced_objects_say_what_they_are():
    with pytest.raises(TypeError, match="JaggedTensor: values must be a tensor, got list"):
        JaggedTensor([1, 2], lengths=torch.tensor([2]))  # not traced: the usual error
    with pytest.raises(TypeError, match="KeyedJaggedTensor: values must be a tensor, got list"):
        KeyedJaggedTensor(["a"], [1, 2], lengths=torch.tensor([2]))
    seen = {}

    class Peek(torch.nn.Module):
        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> JaggedTensor:
            jt = JaggedTensor(values, lengths=lengths)
            seen["repr"], seen["is_jt"] = repr(jt), isinstance(jt, JaggedTensor)
            with pytest.raises(TypeError, match=r"len\(\) of a traced JaggedTensor is not known while tracing"):
                len(jt)
            with pytest.raises(TypeError, match="a traced JaggedTensor cannot be iterated while tracing"):
                iter(jt)
            return jt

    symbolic_trace(Peek())
    assert seen == {"repr": "JaggedTensor(traced: jagged_tensor)", "is_jt": True}
    assert isinstance(padless.jagged.fx.leaf(len)([1, 2]), int)  # a leaf runs its function outside tracing


def _kjt_offsets(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return KeyedJaggedTensor(["a"], values, lengths=lengths).offsets()


def _kjt_sync_offsets(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return KeyedJaggedTensor.from_lengths_sync(["a"], values, lengths).offsets()


def _jt_dense(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return JaggedTensor(values, lengths=lengths).to_padded_dense()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.parametrize("fn", [_kjt_offsets, _kjt_sync_offsets, _jt_dense])
def test_jit_trace_is_refused_never_wrong(fn):
    """torch.jit.trace would bake the example batch's host offsets in (traced on lengths [2, 1],
    the KJT answered [0, 2, 3] for lengths [2, 0, 1, 3]): it is refused, naming the supported
    paths; eager code and torch.fx tracing of the same function give the right offsets."""
    with pytest.raises(RuntimeError, match=r"torch.jit.trace is not supported: .* torch.fx.symbolic_trace .* torch.compile"):
        torch.jit.trace(fn, (torch.arange(3), torch.tensor([2, 1])))
    fn(torch.arange(6), torch.tensor([2, 0, 1, 3]))  # eager: unaffected
    assert _kjt_offsets(torch.arange(6), torch.tensor([2, 0, 1, 3])).tolist() == [0, 2, 2, 3, 6]


def test_fx_traces_the_function_jit_trace_refuses():
    class Offsets(torch.nn.Module):
        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return _kjt_offsets(values, lengths)

    gm = symbolic_trace(Offsets())
    assert gm(torch.arange(3), torch.tensor([2, 1])).tolist() == [0, 2, 3]
    assert gm(torch.arange(6), torch.tensor([2, 0, 1, 3])).tolist() == [0, 2, 2, 3, 6]
