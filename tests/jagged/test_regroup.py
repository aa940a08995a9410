"""regroup_kts, permute_multi_embedding and KTRegroupAsDict against a reference built from
``KeyedTensor.to_dict()`` (and against TorchRec itself where torchrec imports)."""

import importlib.util

import pytest
import torch

import padless.jagged.regroup as regroup_mod
from padless.jagged import KeyedTensor, KTRegroupAsDict, permute_multi_embedding, regroup_kts

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
FUNCTIONS = {"regroup_kts": regroup_kts, "permute_multi_embedding": permute_multi_embedding}


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
    """Per group, the named keys' blocks from ``to_dict()`` (the last KeyedTensor holding a key
    wins, as in TorchRec), concatenated along the key dim."""
    blocks = {}
    for kt in kts:
        blocks.update(kt.to_dict())
    dim = kts[0].key_dim()
    return [torch.cat([blocks[k] for k in g], dim) for g in groups]


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


def test_last_keyed_tensor_holding_a_key_wins():
    kt0 = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1), torch.ones(2, 1)])
    kt1 = KeyedTensor.from_tensor_list(["a"], [torch.full((2, 2), 7.0)])
    for fn in FUNCTIONS.values():
        (out,) = fn([kt0, kt1], [["b", "a"]])
        assert out.tolist() == [[1.0, 7.0, 7.0]] * 2


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
        out = fn(kts, [[], ["a"]])
        assert out[0].shape == (3, 0) and out[1].shape == (3, 2)
        assert fn(kts, []) == []
        with pytest.raises(KeyError, match=r"keys \['zz'\] are in no KeyedTensor"):
            fn(kts, [["a", "zz"]])
        with pytest.raises(ValueError, match="needs at least one KeyedTensor"):
            fn([], [["a"]])
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
    with pytest.raises(RuntimeError, match="duplicate key a found in KeyedTensors"):
        KTRegroupAsDict(groups=[["a"]], keys=["x"])([kts[0], dup])
    with pytest.raises(ValueError, match="empty list"):
        KTRegroupAsDict(groups=[["a"]], keys=["x"])([])
    m.clear_cache()
    assert m(kts)["object"].shape == (3, 2)


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
