"""nn.MultiheadAttention and Transformer layers on NestedTensors, module code unchanged."""

import pytest
import torch
import torch.nn as nn

import padless
from padless.testing import assert_close_samples

LENS = [3, 5, 1, 4]


def _batch(lens=LENS, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, d, generator=g) for n in lens]
    return padless.from_list(xs, requires_grad=True), [x.clone().requires_grad_() for x in xs]


def _per_sample(module, xs, *extra_lists, batch_first=True, **kw):
    outs = []
    for i, x in enumerate(xs):
        args = [x.unsqueeze(0 if batch_first else 1)] + [e[i].unsqueeze(0 if batch_first else 1) for e in extra_lists]
        o = module(*args, **kw)
        o = o[0] if isinstance(o, tuple) else o
        outs.append(o.squeeze(0 if batch_first else 1))
    return outs


def _grads_match(nt, dense, out, refs):
    cot = [torch.randn_like(r) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims))
    torch.autograd.backward(refs, cot)
    assert_close_samples(nt.grad, [d.grad for d in dense], what="gradient", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_self(batch_first, need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    x, xs = _batch()
    out, w = mha(x, x, x, need_weights=need_weights)
    refs = _per_sample(lambda a: mha(a, a, a, need_weights=need_weights), xs, batch_first=batch_first)
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)
    if need_weights:
        wrefs = [mha(s.unsqueeze(0), s.unsqueeze(0), s.unsqueeze(0))[1].squeeze(0) for s in xs] if batch_first else [
            mha(s.unsqueeze(1), s.unsqueeze(1), s.unsqueeze(1))[1].squeeze(0) for s in xs
        ]
        assert_close_samples(w, wrefs, atol=1e-5, rtol=1e-5)
    else:
        assert w is None
    _grads_match(x, xs, out, refs)


def test_multihead_attention_cross_with_kdim_vdim_and_mask():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
    q, qs = _batch()
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(n, 6, generator=g) for n in (2, 0, 3, 4)]
    vs = [torch.randn(n, 5, generator=g) for n in (2, 0, 3, 4)]
    masks = [torch.rand(a, b, generator=g) < 0.3 for a, b in zip(LENS, (2, 0, 3, 4))]  # True = blocked (torch MHA)
    for mm in masks:
        if mm.numel():
            mm[:, 0] = False  # no row fully blocked (torch would give NaN there)
    k, v = padless.from_list(ks), padless.from_list(vs)
    m = padless.from_list(masks, ragged_dims=(0, 1))
    out, _ = mha(q, k, v, attn_mask=m, need_weights=False)
    refs = [
        mha(a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0), attn_mask=mm, need_weights=False)[0].squeeze(0)
        if mm.numel() else torch.zeros(a.shape[0], 8)
        for a, b, c, mm in zip(qs, ks, vs, masks)
    ]
    # Bool masks keep each API's convention: True = blocked for nn.MultiheadAttention (as here),
    # True = may attend for F.scaled_dot_product_attention. A sample with no key attends to nothing:
    # zeros through out_proj, i.e. its bias.
    refs[1] = mha.out_proj(torch.zeros(LENS[1], 8))
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("train", [True, False])
def test_transformer_encoder_layer(norm_first, train):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first)
    layer.train(train)
    x, xs = _batch()
    with torch.set_grad_enabled(train):
        out = layer(x)
        refs = _per_sample(layer, xs)
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)
    if train:
        _grads_match(x, xs, out, refs)


def test_transformer_encoder_and_causal_decoder():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
    x, xs = _batch()
    out = enc(x)
    refs = _per_sample(enc, xs)
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)
    _grads_match(x, xs, out, refs)
    dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    mem, mems = _batch([2, 6, 3, 4], seed=5)
    y = dec(x, mem, tgt_is_causal=True, tgt_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))
    yrefs = [
        dec(a.unsqueeze(0), m.unsqueeze(0), tgt_is_causal=True, tgt_mask=nn.Transformer.generate_square_subsequent_mask(a.shape[0])).squeeze(0)
        for a, m in zip(xs, mems)
    ]
    assert_close_samples(y, yrefs, atol=1e-5, rtol=1e-5)


def test_errors():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x, _ = _batch()
    with pytest.raises(ValueError, match="key_padding_mask is not needed with NestedTensor inputs"):
        mha(x, x, x, key_padding_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a dense attn_mask of shape \(5, 5\) has no per-sample meaning"):
        mha(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"flip\(\) on a sequence-first view of a NestedTensor .* has no rule"):
        x.transpose(0, 1).flip(0)  # row-wise ops run on the view (tests/ops/test_seq_first.py); flips do not
