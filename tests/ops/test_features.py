"""Feature-wise ops (rms_norm, group_norm, glu, normalize, embedding) through the reference harness."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing import Variant, check_op, make_batch

TRAILING_STATIC = ["seq", "empty_sample", "one_sample", "all_equal", "pair", "rect", "three_ragged", "all_empty"]

# Channels-first samples (C, *spatial) for group_norm; C = 4 unless the variant says otherwise.
CHANNELS_FIRST = {
    "channels_first": "channels_first",
    "image": "image",
    "heads_pair": "heads_pair",
    "cf_empty": Variant("cf_empty", ((4, 3), (4, 0), (4, 2)), (1,), "an empty sample"),
    "cf_one": Variant("cf_one", ((4, 5),), (1,), "a batch of one"),
    "cf_all_empty": Variant("cf_all_empty", ((4, 0), (4, 0)), (1,), "every sample empty"),
    "cf_static_tail": Variant("cf_static_tail", ((4, 3, 2), (4, 1, 2), (4, 0, 2)), (1,), "(C, L_i, S)"),
    "cf_one_pixel": Variant("cf_one_pixel", ((4, 1, 1), (4, 2, 3)), (1, 2), "a 1x1 image"),
}
TWO_STATIC = Variant("two_static", ((3, 2, 3), (0, 2, 3), (4, 2, 3)), (0,), "(L_i, 2, 3)")


def _channels(v: Variant | str) -> int:
    nt, _ = make_batch(v)
    return nt.shape[1]


# ---------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("v", TRAILING_STATIC)
def test_rms_norm_module(v):
    nt, _ = make_batch(v)
    norm = torch.nn.RMSNorm(nt.shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    check_op(norm, v)


def test_rms_norm_two_trailing_dims_and_no_weight():
    check_op(lambda x: F.rms_norm(x, (2, 3)), TWO_STATIC)


def test_rms_norm_bf16():
    norm = torch.nn.RMSNorm(4).to(torch.bfloat16)
    check_op(norm, "seq", dtype=torch.bfloat16)


@pytest.mark.parametrize("op", ["rms_norm", "group_norm"])
def test_norms_compiled(op):
    # Under torch.compile F.rms_norm reaches the NestedTensor as torch.rms_norm; both are registered.
    if op == "rms_norm":
        check_op(torch.nn.RMSNorm(4), "seq", compiled=True)
    else:
        check_op(_group_norm(3, 3), "image", compiled=True, atol=1e-5, rtol=1e-4)


def test_rms_norm_weight_gradient_matches_per_sample_sum():
    nt, dense = make_batch("empty_sample")
    norm, ref = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)
    norm(nt).values().pow(2).sum().backward()
    sum(ref(s).pow(2).sum() for s in dense).backward()
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad)


# ---------------------------------------------------------------------------- group_norm


def _group_norm(c: int, groups: int, affine: bool = True) -> torch.nn.GroupNorm:
    gn = torch.nn.GroupNorm(groups, c, affine=affine)
    if affine:
        with torch.no_grad():
            gn.weight.uniform_(0.5, 1.5)
            gn.bias.uniform_(-0.5, 0.5)
    return gn


@pytest.mark.parametrize("groups", ["one", "several"])
@pytest.mark.parametrize("name", list(CHANNELS_FIRST))
def test_group_norm_module(name, groups):
    v = CHANNELS_FIRST[name]
    c = _channels(v)
    g = 1 if groups == "one" else (2 if c % 2 == 0 else c)
    check_op(_group_norm(c, g), v, atol=1e-5, rtol=1e-4)


def test_group_norm_instance_norm_limit_and_no_affine():
    check_op(_group_norm(4, 4, affine=False), CHANNELS_FIRST["cf_static_tail"], atol=1e-5, rtol=1e-4)


def test_group_norm_bf16():
    gn = _group_norm(3, 3).to(torch.bfloat16)
    check_op(gn, "image", dtype=torch.bfloat16, atol=2e-2, rtol=2e-2)


def test_group_norm_affine_gradients_match_per_sample_sum():
    nt, dense = make_batch("image")
    gn, ref = _group_norm(3, 3), _group_norm(3, 3)
    ref.load_state_dict(gn.state_dict())
    gn(nt).values().pow(3).sum().backward()
    sum(ref(s[None]).pow(3).sum() for s in dense).backward()
    torch.testing.assert_close(gn.weight.grad, ref.weight.grad)
    torch.testing.assert_close(gn.bias.grad, ref.bias.grad)


def test_group_norm_statistics_stay_inside_each_sample():
    # A huge value in sample 0 must not change sample 1's output.
    a, b = torch.randn(2, 3), torch.randn(2, 4)
    out1 = F.group_norm(padless.from_list([a, b], ragged_dims=(1,)), 1)
    out2 = F.group_norm(padless.from_list([a * 1e4, b], ragged_dims=(1,)), 1)
    torch.testing.assert_close(out1.unbind()[1], out2.unbind()[1])


def test_group_norm_gradcheck_float64():
    offsets = torch.tensor([0, 3, 3, 5])
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def fn(values, weight, b):
        x = padless.from_values(values, offsets, ragged_dims=(1,))  # samples (C=4, L_i)
        return F.group_norm(x, 2, weight, b).values()

    values = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (values, w, bias))


# ---------------------------------------------------------------------------- glu, normalize


@pytest.mark.parametrize("v", ["seq", "empty_sample", "pair", "all_empty", "three_ragged"])
def test_glu_module_last_dim(v):
    check_op(torch.nn.GLU(), v)


def test_glu_over_leading_static_dim():
    check_op(lambda x: F.glu(x, dim=1), "channels_first")


NORMALIZE_CASES = [("seq", -1), ("empty_sample", 2), ("channels_first", 1), ("image", 1), ("pair", -1)]


@pytest.mark.parametrize("v, dim", NORMALIZE_CASES)
@pytest.mark.parametrize("p", [2.0, 1.0])
def test_normalize(v, dim, p):
    check_op(lambda x: F.normalize(x, p=p, dim=dim), v)


def test_normalize_several_static_dims():
    check_op(lambda x: F.normalize(x, dim=(2, 3)), TWO_STATIC)


# ---------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("v", ["seq_1d", "seq", "empty_sample", "all_empty", "channels_first", "image", "pair"])
def test_embedding_module_any_layout(v):
    emb = torch.nn.Embedding(5, 3, padding_idx=0)
    # make_batch draws integers in [-2, 2); shift them to valid ids.
    out = check_op(lambda ids: emb(ids + 2), v, dtype=torch.int64)
    nt, _ = make_batch(v, dtype=torch.int64)
    assert out.ragged_dims == nt.ragged_dims and out.dim() == nt.dim() + 1 and out.shape[-1] == 3


def test_embedding_weight_gradient_and_padding_idx():
    ids = [torch.tensor([1, 2, 1, 4]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 1])]
    nt = padless.from_list(ids)
    emb, ref = torch.nn.Embedding(5, 3, padding_idx=1), torch.nn.Embedding(5, 3, padding_idx=1)
    ref.load_state_dict(emb.state_dict())
    out = emb(nt)
    torch.testing.assert_close(out.values()[0], emb.weight[1].detach())
    out.values().pow(2).sum().backward()
    sum(ref(i).pow(2).sum() for i in ids).backward()
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad)
    assert bool((emb.weight.grad[1] == 0).all())


def test_embedding_max_norm_renormalises_like_dense():
    ids = [torch.tensor([0, 3]), torch.tensor([3, 2, 2])]
    w = torch.randn(4, 3) * 5
    w_ref = w.clone()
    out = F.embedding(padless.from_list(ids), w, max_norm=1.0)
    refs = [F.embedding(i, w_ref, max_norm=1.0) for i in ids]
    torch.testing.assert_close(w, w_ref)
    for got, want in zip(out.unbind(), refs):
        torch.testing.assert_close(got, want)


def test_embedding_int32_ids():
    nt = padless.from_list([torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)])
    w = torch.randn(3, 2)
    torch.testing.assert_close(F.embedding(nt, w).values(), w[[1, 2, 0]])


# ---------------------------------------------------------------------------- errors


def test_rms_norm_refuses_ragged_last_dim_and_nested_weight():
    nt, _ = make_batch("channels_first")
    with pytest.raises(ValueError, match=r"rms_norm\(\): sample dim 1 is ragged, but rms_norm acts on the last 1"):
        F.rms_norm(nt, (3,))
    seq, _ = make_batch("seq")
    with pytest.raises(TypeError, match=r"rms_norm\(\): weight must be a dense tensor"):
        F.rms_norm(seq, (4,), seq)


def test_group_norm_errors():
    seq, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"group_norm\(\): dim 1 \(the channel dim\) is ragged.*x.transpose\(1, 2\)"):
        F.group_norm(seq, 1)
    img, _ = make_batch("image")
    with pytest.raises(ValueError, match=r"group_norm\(\): num_groups=2 must be a positive divisor of the 3 chan"):
        F.group_norm(img, 2)
    with pytest.raises(ValueError, match=r"group_norm\(\): num_groups=0"):
        F.group_norm(img, 0)
    w = padless.from_list([torch.ones(3), torch.ones(2)])
    with pytest.raises(TypeError, match=r"group_norm\(\): weight must be a dense tensor"):
        F.group_norm(img, 1, w)


def test_glu_errors():
    nt, _ = make_batch("channels_first")
    with pytest.raises(ValueError, match=r"glu\(\): dim -1 is ragged \(sample dim 1\).*static dims are \[1\]"):
        F.glu(nt)
    odd = padless.from_list([torch.randn(2, 3), torch.randn(1, 3)])
    with pytest.raises(ValueError, match=r"glu\(\): dim -1 has size 3; glu halves it, so it must be even"):
        F.glu(odd)
    with pytest.raises(ValueError, match=r"glu\(\): dim 0 is the batch dim"):
        F.glu(odd, 0)


def test_normalize_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"normalize\(\): dim 1 is ragged \(sample dim 0\).*e\.g\. dim=-1"):
        F.normalize(nt)
    with pytest.raises(TypeError, match=r"normalize\(\): out= is not supported"):
        F.normalize(nt, dim=-1, out=torch.empty(3))


def test_embedding_errors():
    nt, _ = make_batch("seq_1d")
    msg = r"embedding\(\): input must be an integer \(int64 or int32\) NestedTensor of ids, got torch.float32"
    with pytest.raises(TypeError, match=msg):
        F.embedding(nt, torch.randn(4, 2))
    w = padless.from_list([torch.randn(3, 2), torch.randn(1, 2)])
    with pytest.raises(TypeError, match=r"embedding\(\): the weight is a NestedTensor; only the input"):
        F.embedding(torch.tensor([0, 1]), w)
    ids = padless.from_list([torch.tensor([0, 1])])
    with pytest.raises(TypeError, match=r"embedding\(\): weight must be a dense tensor"):
        F.embedding(ids, w)
