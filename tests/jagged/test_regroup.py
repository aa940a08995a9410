"""regroup_kts, permute_multi_embedding and KTRegroupAsDict against a reference built from
``KeyedTensor.to_dict()`` (and against TorchRec itself where torchrec imports)."""

import importlib.util

import pytest
import torch

import padless.jagged.regroup as regroup_mod
from padless.jagged import KeyedTensor, KTRegroupAsDict, permute_multi_embedding, regroup_kts
from padless.tensor.errors import StructureError

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
FUNCTIONS = {
    "regroup_kts": regroup_kts,
    "permute_multi_embedding": permute_multi_embedding,
    "KeyedTensor.regroup": KeyedTensor.regroup,
}


def _kts(requires_grad=False, key_dim=1, batch=3):
    g = torch.Generator().manual_seed(0)

    def block(width):
        shape = [batch, width] if key_dim == 1 else [width, batch]
        return torch.randn(shape, generator=g)

    kt0 = KeyedTensor.from_tensor_list(["a", "b", "c"], [block(2), block(3), block(1)], key_dim=key_dim, cat_dim=key_dim)
    kt1 = KeyedTensor.from_tensor_list(["d", "e"], [block(4), block(2)], key_dim=key_dim, cat_dim=key_dim)
    for kt in (kt0, kt1):
        kt.values().requires_grad_(requires_grad)
    return [kt0, kt1]


def _reference(kts, groups):
    """Per group, the named keys' blocks from ``to_dict()``, concatenated along the key dim
    (plain torch: narrow + cat, autograd's own backward)."""
    blocks = {}
    for kt in kts:
        blocks.update(kt.to_dict())
    dim = kts[0].key_dim()
    empty = kts[0].values().narrow(dim, 0, 0)
    return [torch.cat([blocks[k] for k in g] or [empty], dim) for g in groups]


GROUPS = {
    "one group per kt": [["a", "b", "c"], ["d", "e"]],
    "mixed order": [["e", "a"], ["c", "d", "b"]],
    "key used twice": [["a", "d"], ["d", "b", "a"], ["c"]],
    "subset": [["b"]],
    "single key per group": [["e"], ["a"], ["c"], ["b"], ["d"]],
}


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("key_dim", [1, 0])
def test_matches_to_dict_reference(fn, groups, key_dim):
    kts = _kts(key_dim=key_dim)
    out = FUNCTIONS[fn](kts, GROUPS[groups])
    ref = _reference(kts, GROUPS[groups])
    assert isinstance(out, list) and len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=0, atol=0)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_gradients_reach_every_keyed_tensor(fn):
    groups = GROUPS["key used twice"]
    kts, kts_ref = _kts(requires_grad=True), _kts(requires_grad=True)
    weights = [torch.randn(r.shape) for r in _reference(kts_ref, groups)]
    sum((o * w).sum() for o, w in zip(FUNCTIONS[fn](kts, groups), weights)).backward()
    sum((o * w).sum() for o, w in zip(_reference(kts_ref, groups), weights)).backward()
    for kt, ref in zip(kts, kts_ref):
        torch.testing.assert_close(kt.values().grad, ref.values().grad)


def test_a_key_held_by_two_keyed_tensors_is_refused():
    """TorchRec disagrees with itself here (KeyedTensor.regroup takes the last KeyedTensor's
    block, regroup_kts/permute_multi_embedding the first's): every path refuses, naming the key."""
    kt0 = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1), torch.ones(2, 1)])
    kt1 = KeyedTensor.from_tensor_list(["a"], [torch.full((2, 2), 7.0)])
    twice = KeyedTensor(["a", "a"], [1, 1], torch.ones(2, 2))
    calls = {**FUNCTIONS, "KTRegroupAsDict": lambda kts, g: list(KTRegroupAsDict(g, ["x"])(kts).values())}
    for name, fn in calls.items():
        with pytest.raises(StructureError, match=rf"{name}: key 'a' is held by KeyedTensor 0 \(keys \['a', 'b'\]\) and KeyedTensor 1 .*rename the key"):
            fn([kt0, kt1], [["b", "a"]])
        with pytest.raises(RuntimeError, match=r"key 'a' is held by KeyedTensor 0 \(keys \['a', 'a'\]\) and KeyedTensor 0"):
            fn([twice], [["a"]])
        (out,) = fn([kt0, kt1], [["b"]])  # a duplicate no group names is no ambiguity
        assert out.tolist() == [[1.0], [1.0]]


def test_batch_size_mismatch_names_the_keyed_tensors():
    kt0 = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(3, 1), torch.ones(3, 1)])
    kt1 = KeyedTensor.from_tensor_list(["c"], [torch.zeros(2, 2)])
    calls = {**FUNCTIONS, "KTRegroupAsDict": lambda kts, g: list(KTRegroupAsDict(g, ["x"])(kts).values())}
    for name, fn in calls.items():
        with pytest.raises(
            StructureError,
            match=rf"{name}: the KeyedTensors disagree on the batch: KeyedTensor 0 \(keys \['a', 'b'\]\) has values "
            r"of shape \(3, 2\), KeyedTensor 1 \(keys \['c'\]\) \(2, 2\); only key dim 1 may differ",
        ):
            fn([kt0, kt1], [["a", "c"]])


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("key_dim", [1, 0])
def test_gradients_with_unused_twice_taken_and_empty_keys(fn, key_dim):
    """Against plain narrow + cat: keys taken twice (in one group and across groups, in runs that
    overlap), keys no group takes, a zero-width key, an empty group, a KeyedTensor nothing takes."""
    def make():
        g = torch.Generator().manual_seed(1)
        shape = (lambda w: (4, w)) if key_dim == 1 else (lambda w: (w, 4))
        kt0 = KeyedTensor.from_tensor_list(
            ["a", "b", "z", "c", "d"], [torch.randn(shape(w), generator=g) for w in (2, 3, 0, 1, 2)], key_dim, key_dim
        )
        kt1 = KeyedTensor.from_tensor_list(["e", "f"], [torch.randn(shape(w), generator=g) for w in (1, 2)], key_dim, key_dim)
        kt2 = KeyedTensor.from_tensor_list(["u"], [torch.randn(shape(3), generator=g)], key_dim, key_dim)
        for kt in (kt0, kt1, kt2):
            kt.values().requires_grad_(True)
        return [kt0, kt1, kt2]

    groups = [["a", "b", "z"], ["b", "c", "f", "a"], [], ["c", "c"], ["z"]]
    kts, kts_ref = make(), make()
    out, ref = FUNCTIONS[fn](kts, groups), _reference(kts_ref, groups)
    weights = [torch.randn(r.shape, generator=torch.Generator().manual_seed(2)) for r in ref]
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    for kt, kr in zip(kts[:2], kts_ref[:2]):
        torch.testing.assert_close(kt.values().grad, kr.values().grad)
    assert kts[2].values().grad is None and kts_ref[2].values().grad is None


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_backward_is_one_node_over_the_keyed_tensors(fn):
    """The outputs' autograd node feeds each KeyedTensor's values directly (one gradient buffer
    per KeyedTensor), not a zero-filled slice-backward per key."""
    kts = _kts(requires_grad=True)
    out = FUNCTIONS[fn](kts, GROUPS["mixed order"])
    node = out[0].grad_fn
    while "Regroup" not in node.name():  # views of one buffer: a split view node first
        (node, _), = [(n, i) for n, i in node.next_functions if n is not None]
    assert [type(n).__name__ for n, _ in node.next_functions] == ["AccumulateGrad", "AccumulateGrad"]


def test_one_pass_each():
    """regroup_kts: views of one concatenated buffer; permute_multi_embedding: a tensor per group;
    which column slices to take is planned once per signature (cached)."""
    kts = _kts()
    groups = GROUPS["mixed order"]
    a, b = regroup_kts(kts, groups)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    regroup_mod._PLANS.clear()
    x, y = permute_multi_embedding(kts, groups)
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert len(regroup_mod._PLANS) == 1
    permute_multi_embedding(_kts(), groups)  # same keys, widths and groups: the cached plan
    assert len(regroup_mod._PLANS) == 1


def test_empty_groups_and_errors():
    kts = _kts()
    for fn in FUNCTIONS.values():
        out = fn(kts, [[], ["a"]])  # an empty group is (B, 0)
        assert out[0].shape == (3, 0) and out[1].shape == (3, 2)
        assert fn(kts, []) == []
        with pytest.raises(KeyError, match=r"keys \['zz'\] are in no KeyedTensor"):
            fn(kts, [["a", "zz"]])
        with pytest.raises(ValueError, match="needs at least one KeyedTensor"):
            fn([], [["a"]])
        assert [o.shape for o in fn(kts, [[], []])] == [(3, 0), (3, 0)]
        with pytest.raises(ValueError, match=r"different key dims \[0, 1\]"):
            fn([_kts()[0], _kts(key_dim=0)[1]], [["a", "d"]])


def test_kt_regroup_as_dict_module():
    kts = _kts()
    m = KTRegroupAsDict(groups=[["a", "d"], ["e"]], keys=["user", "object"])
    out = m(kts)
    assert list(out) == ["user", "object"]
    for got, want in zip(out.values(), _reference(kts, [["a", "d"], ["e"]])):
        torch.testing.assert_close(got, want)
    half = KTRegroupAsDict(groups=[["b"]], keys=["x"], emb_dtype=torch.float16)(kts)
    assert half["x"].dtype == torch.float16
    with pytest.raises(ValueError, match="groups and keys should have the same length"):
        KTRegroupAsDict(groups=[["a"]], keys=["x", "y"])
    dup = KeyedTensor.from_tensor_list(["a"], [torch.zeros(3, 1)])
    with pytest.raises(RuntimeError, match="KTRegroupAsDict: key 'a' is held by KeyedTensor 0"):
        KTRegroupAsDict(groups=[["a"]], keys=["x"])([kts[0], dup])
    with pytest.raises(ValueError, match="empty list"):
        KTRegroupAsDict(groups=[["a"]], keys=["x"])([])
    m.clear_cache()
    assert m(kts)["object"].shape == (3, 2)


def test_kt_regroup_as_dict_takes_torchrec_signature():
    """TorchRec's (groups, keys, emb_dtype: DataType, multi_device): its DataType enum (or a
    torch.dtype) casts the outputs; multi_device is accepted (a no-op: the plan is host metadata)."""
    import enum

    class DataType(enum.Enum):  # TorchRec's torchrec.types.DataType, by value
        FP32 = "FP32"
        FP16 = "FP16"
        BF16 = "BF16"

    kts = _kts()
    for dt, want in [(DataType.BF16, torch.bfloat16), (DataType.FP16, torch.float16), (torch.float64, torch.float64)]:
        m = KTRegroupAsDict([["a", "d"], ["e"]], ["user", "object"], emb_dtype=dt, multi_device=True)
        out = m(kts)
        for got, ref in zip(out.values(), _reference(kts, [["a", "d"], ["e"]])):
            assert got.dtype == want
            torch.testing.assert_close(got, ref.to(want))
    m = KTRegroupAsDict([["a"]], ["x"], None, False)
    assert m(kts)["x"].dtype == torch.float32
    with pytest.raises(TypeError, match=r"KTRegroupAsDict: emb_dtype must be TorchRec's DataType \(one of \['FP32'"):
        KTRegroupAsDict([["a"]], ["x"], emb_dtype="float16")


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")
def test_kt_regroup_as_dict_takes_torchrecs_data_type():
    from torchrec.types import DataType

    out = KTRegroupAsDict([["a"]], ["x"], emb_dtype=DataType.FP16, multi_device=True)(_kts())
    assert out["x"].dtype == torch.float16


def test_symbolic_trace_records_one_node():
    class M(torch.nn.Module):
        def forward(self, kts):
            return regroup_kts(kts, [["a"], ["d", "b"]]), permute_multi_embedding(kts, [["e"]])

    gm = torch.fx.symbolic_trace(M())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert regroup_kts in targets or any(getattr(t, "__name__", "") == "regroup_kts" for t in targets)
    kts = _kts()
    (a, b), (c,) = gm(kts)
    ref = _reference(kts, [["a"], ["d", "b"], ["e"]])
    for got, want in zip((a, b, c), ref):
        torch.testing.assert_close(got, want)


def test_kt_regroup_as_dict_traces_with_fx():
    gm = torch.fx.symbolic_trace(KTRegroupAsDict(groups=[["a", "d"], ["e"]], keys=["user", "object"], emb_dtype=torch.float64))
    kts = _kts()
    out = gm(kts)
    for got, want in zip(out.values(), _reference(kts, [["a", "d"], ["e"]])):
        torch.testing.assert_close(got, want.double())


@pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec is not installed")
@pytest.mark.parametrize("groups", GROUPS)
def test_matches_torchrec(groups):
    from torchrec.sparse import jagged_tensor as trc

    kts = _kts()
    theirs = [kt.to_torchrec() for kt in kts]
    want = trc.KeyedTensor.regroup(theirs, GROUPS[groups])
    for fn in FUNCTIONS.values():
        for got, w in zip(fn(kts, GROUPS[groups]), want):
            torch.testing.assert_close(got, w)
