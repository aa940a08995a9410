"""Attention on NestedTensors against dense SDPA on each sample (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.attention import sdpa as attn
from padless.testing import assert_close_samples, check_samples, leaves


LQ = [3, 5, 0, 1]
LK = [4, 0, 2, 1]


def _qkv(lq=LQ, lk=LK, h=2, e=8, ev=8, hk=None, dtype=torch.float32):
    hk = hk or h
    return (
        leaves([(h, n, e) for n in lq], 1, dtype=dtype),
        leaves([(hk, n, e) for n in lk], 2, dtype=dtype),
        leaves([(hk, n, ev) for n in lk], 3, dtype=dtype),
    )


def test_self_attention():
    q = leaves([(2, n, 8) for n in LQ], 1)
    check_samples(lambda a: F.scaled_dot_product_attention(a, a, a), lambda a: F.scaled_dot_product_attention(a, a, a), [q])


def test_cross_attention_takes_query_structure_and_zero_keys_give_zeros():
    q, k, v = _qkv(ev=6)
    out = check_samples(F.scaled_dot_product_attention, F.scaled_dot_product_attention, [q, k, v])
    assert out.ragged_dims == (1,) and out.shape == (4, 2, 5, 6)
    assert float(out[1].detach().abs().sum()) == 0.0  # sample 1: 5 queries, no key -> zeros (as dense SDPA)


@pytest.mark.parametrize("lk", [LQ, [6, 2, 1, 3]])
def test_causal_is_top_left_aligned(lk):
    q, k, v = _qkv(lk=lk)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    check_samples(f, f, [q, k, v])


def test_scale_and_gqa():
    q, k, v = _qkv(h=4, hk=2)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, scale=0.3, enable_gqa=True)

    check_samples(f, f, [q, k, v])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_per_sample_masks(kind):
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(7)
    if kind == "bool":
        masks = [torch.rand(a, b, generator=g) > 0.3 for a, b in zip(LQ, LK)]
    else:
        masks = [torch.randn(a, b, generator=g) for a, b in zip(LQ, LK)]
    m = padless.from_list(masks, ragged_dims=(0, 1))

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=m)

    def ref(a, b, c, _it=iter(masks)):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=next(_it))

    check_samples(f, ref, [q, k, v])


def test_dropout_matches_per_sample_rng_order():
    (q, _), (k, _), (v, _) = _qkv()
    torch.manual_seed(123)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(123)
    refs = [F.scaled_dot_product_attention(a, b, c, dropout_p=0.5) for a, b, c in zip(q.unbind(), k.unbind(), v.unbind())]
    assert_close_samples(out, refs)


def test_seq_heads_layout_via_transpose():
    q = leaves([(n, 2, 8) for n in LQ], 4, ragged=(0,))
    check_samples(
        lambda a: F.scaled_dot_product_attention(a.transpose(1, 2), a.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2),
        lambda a: F.scaled_dot_product_attention(a.transpose(0, 1), a.transpose(0, 1), a.transpose(0, 1)).transpose(0, 1),
        [q],
    )


def test_single_head_two_dim_samples():
    q = leaves([(n, 8) for n in LQ], 5, ragged=(0,))
    check_samples(lambda a: F.scaled_dot_product_attention(a, a, a), lambda a: F.scaled_dot_product_attention(a, a, a), [q])


def test_bf16():
    q, k, v = _qkv(dtype=torch.bfloat16)
    check_samples(F.scaled_dot_product_attention, F.scaled_dot_product_attention, [q, k, v], atol=2e-2, rtol=2e-2)


def test_flex_backend_with_sample_local_mask_and_score_mods():
    q, k, v = _qkv(lq=[3, 4, 2], lk=[5, 1, 2])

    def window(b, h, qi, ki):
        return (qi - ki).abs() <= 1

    def bias(score, b, h, qi, ki):
        return score + 0.1 * (b + 1) - 0.05 * h

    def f(a, bb, c):
        return attn.attention(a, bb, c, mask_mod=window, score_mod=bias)

    def ref(a, bb, c, _i=iter(range(3))):
        i = next(_i)
        lq, lk = a.shape[1], bb.shape[1]
        keep = (torch.arange(lq)[:, None] - torch.arange(lk)[None, :]).abs() <= 1
        add = 0.1 * (i + 1) - 0.05 * torch.arange(a.shape[0]).view(-1, 1, 1)
        s = (a @ bb.transpose(-1, -2)) * a.shape[-1] ** -0.5 + add
        s = s.masked_fill(~keep, float("-inf"))
        w = torch.softmax(s, -1).nan_to_num(0.0)
        return w @ c

    out = check_samples(f, ref, [q, k, v], atol=1e-4, rtol=1e-4)
    assert attn.last_choice.backend == "per_sample"  # on CPU the mods are materialised per sample
    assert out.ragged_dims == (1,)
    with torch.no_grad():  # the flex backend itself (forward only on CPU, eager reference)
        (qn, _), (kn, _), (vn, _) = q, k, v
        flex = attn._flex(qn, kn, vn, False, None, False, window, bias)
        assert_close_samples(padless.tensor.autograd.rewrap(flex, qn), list(out.detach().unbind()), atol=1e-4, rtol=1e-4)


def test_explain_says_why():
    (q, _), (k, _), (v, _) = _qkv()
    c = attn.explain(q, k, v)
    assert c.backend == "per_sample"
    assert c.skipped["flash_attn"] == "not on CUDA" and c.skipped["varlen"] == "not on CUDA"
    assert "per_sample" in str(c) and "flex: CPU default is per-sample" in str(c)


def test_errors():
    (q, _), (k, _), (v, _) = _qkv()
    with pytest.raises(ValueError, match=r"a dense attn_mask of shape \(6, 4\) has extent 6 along dim -2, where the envelope has 5"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 4, dtype=torch.bool))
    bad = padless.from_list([torch.ones(2, 2, dtype=torch.bool)] * 4, ragged_dims=(0, 1))
    with pytest.raises(ValueError, match=r"attn_mask sample 0 has shape \(2, 2\), expected \(\.\.\., 3, 4\)"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bad)
    img = padless.from_list([torch.randn(2, 3, 4)], ragged_dims=(1, 2))
    with pytest.raises(ValueError, match=r"query must have exactly one ragged dim, the sequence dim 2"):
        F.scaled_dot_product_attention(img, img, img)
    with pytest.raises(TypeError, match=r"key must be a NestedTensor"):
        F.scaled_dot_product_attention(q, torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8))
    k2 = leaves([(2, n, 8) for n in (1, 2)], 9)[0]
    with pytest.raises(ValueError, match=r"batch sizes differ: query 4, key 2, value 4"):
        F.scaled_dot_product_attention(q, k2, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_varlen_backend_matches_per_sample():
    q, k, v = _qkv(lq=[17, 33, 5], lk=[17, 33, 5], dtype=torch.bfloat16)
    qc, kc, vc = (t[0].detach().cuda().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    assert attn.last_choice.backend in ("flash_attn", "varlen")
    refs = [F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in zip(qc.unbind(), kc.unbind(), vc.unbind())]
    assert_close_samples(out, refs, atol=2e-2, rtol=2e-2)
