"""torch.compile of attention with dropout, masks, grouped-query heads and cross structures.

Every test compiles with ``fullgraph=True`` over 8 batches whose size (2 to 32) and lengths
change (empty samples included), counts graphs with ``CompileCounterWithBackend`` and
compares outputs and every gradient with eager under the same seed (dropout draws the same
random numbers: the compiled op runs the eager path's per-sample SDPA calls in its order).
aot_eager throughout; inductor in the tests named so (the layer one only with
``PADLESS_COMPILE_INDUCTOR=1``: its compile takes ~20 s on a 2-core CPU).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.ops.attention.sdpa_compiled import (
    packed_sdpa_dropout_fwd,
    packed_sdpa_general_fwd,
)
from padless.testing import assert_close_samples

# (batch size, seed) of the 8 batches: B changes from 2 to 32.
BATCHES = [(3, 0), (2, 1), (9, 2), (32, 3), (5, 4), (17, 5), (4, 6), (12, 7)]
TOL = dict(atol=1e-5, rtol=1e-5)
INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _lengths(b: int, seed: int, lo: int = 0, hi: int = 10) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (b,), generator=g).tolist()
    lens[0] = hi  # the envelope is never 0 or 1 (dynamo would specialise those)
    return lens


def _nt(shapes, seed: int, **kw) -> padless.NestedTensor:
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(*s, generator=g) for s in shapes], requires_grad=True, **kw)


def _heads(lens, h: int, seed: int, e: int = 8) -> padless.NestedTensor:
    return _nt([(h, n, e) for n in lens], seed, ragged_dims=(1,))


def _compare(f, make, module: nn.Module | None = None, backend="aot_eager", batches=BATCHES) -> int:
    """Compiled vs eager on every batch (same seed each): outputs, input and parameter grads."""
    cnt = CompileCounterWithBackend(backend)
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    tol = TOL if backend == "aot_eager" else dict(atol=1e-4, rtol=1e-4)  # inductor reorders sums
    params = list(module.parameters()) if module is not None else []
    for i, (b, seed) in enumerate(batches):
        ins, ref_ins = make(b, seed), make(b, seed)
        got = []
        for fn, args in ((cf, ins), (f, ref_ins)):
            torch.manual_seed(100 + i)
            outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            sum((o.values() ** 2).sum() for o in outs).backward()
            got.append((outs, [p.grad.clone() for p in params]))
            for p in params:
                p.grad = None
        (outs, pg), (refs, rpg) = got
        for out, ref in zip(outs, refs):
            assert_close_samples(out, list(ref.unbind()), **tol)
        for a, r in zip(ins, ref_ins):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad.values(), r.grad.values(), **tol)
        for a, r in zip(pg, rpg):
            torch.testing.assert_close(a, r, **tol)
    return cnt.frame_count


# ---------------------------------------------------------------------------- F.scaled_dot_product_attention


def _gqa(b, seed):
    lens = _lengths(b, seed)
    return _heads(lens, 4, seed), _heads(lens, 2, seed + 50)


def _masked(additive: bool):
    def make(b, seed):
        lq, lk = _lengths(b, seed), _lengths(b, seed + 50, lo=0, hi=7)
        g = torch.Generator().manual_seed(seed)
        if additive:
            masks = [torch.randn(a, s, generator=g) for a, s in zip(lq, lk)]
        else:
            masks = [torch.rand(a, s, generator=g) < 0.6 for a, s in zip(lq, lk)]
            for m in masks:
                m[:, :1] = True  # no query row without a key (SDPA would give NaN there)
        m = padless.from_list(masks, ragged_dims=(0, 1), requires_grad=additive)
        return _heads(lq, 2, seed), _heads(lk, 2, seed + 51), m

    return make


def _sdpa_variants(x, q4, k2, q, k, bool_mask, add_mask):
    """Dropout (self); GQA, and GQA + dropout + causal; causal with L_q != L_k (samples
    without keys); a bool mask; an additive mask (its gradient too) with dropout."""
    return (
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.3),
        F.scaled_dot_product_attention(q4, k2, k2, enable_gqa=True)
        + F.scaled_dot_product_attention(q4, k2, k2, dropout_p=0.2, is_causal=True, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, k, is_causal=True)
        + F.scaled_dot_product_attention(q, k, k, attn_mask=bool_mask)
        + F.scaled_dot_product_attention(q, k, k, attn_mask=add_mask, dropout_p=0.2),
    )


def _sdpa_inputs(b, seed):
    q, k, bool_mask = _masked(False)(b, seed)
    return (_heads(_lengths(b, seed + 70), 2, seed + 70), *_gqa(b, seed), q, k, bool_mask, _masked(True)(b, seed)[2])


def test_sdpa_dropout_gqa_masks_and_causal_cross_compile_in_one_graph_equal_to_eager():
    """Every variant in one compiled function, 8 batches (B = 2..32): one graph, outputs and
    gradients (query, key, value, additive mask) equal to eager under the same seed."""
    assert _compare(_sdpa_variants, _sdpa_inputs) == 1


@pytest.mark.parametrize("masked", [False, True])
def test_general_op_matches_dense_sdpa_per_sample(masked):
    """The general op run eagerly, against dense SDPA on each sample (GQA, causal or a per-sample
    additive (H, L_i, S_i) mask, an empty query and an empty key sample): values and gradients."""
    g = torch.Generator().manual_seed(3)
    lq, lk = [3, 0, 4, 2], [5, 2, 4, 0]
    q = torch.randn(sum(lq), 4, 8, generator=g, requires_grad=True)
    k = torch.randn(sum(lk), 2, 8, generator=g, requires_grad=True)
    v = torch.randn(sum(lk), 2, 8, generator=g, requires_grad=True)
    qo, ko = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()]) for x in (lq, lk))
    dense_masks = [torch.randn(4, a, s, generator=g) for a, s in zip(lq, lk)]
    mrows = torch.cat([m.permute(1, 2, 0).reshape(-1, 4) for m in dense_masks]).requires_grad_()
    mo = torch.tensor([0, *torch.tensor([a * s for a, s in zip(lq, lk)]).cumsum(0).tolist()])
    ms = torch.tensor([[4, a, s] for a, s in zip(lq, lk)])
    args = (mrows, mo, ms) if masked else (None, None, None)
    out = packed_sdpa_general_fwd(q, k, v, qo, ko, *args, 0.0, not masked, None, True)[0]
    go = torch.randn(out.shape, generator=g)
    leaves = (q, k, v, mrows) if masked else (q, k, v)
    grads = torch.autograd.grad(out, leaves, go)
    refs, ref_grads = [], [[] for _ in leaves]
    for i in range(len(lq)):
        qi = q.detach()[qo[i]:qo[i + 1]].transpose(0, 1).requires_grad_()
        ki = k.detach()[ko[i]:ko[i + 1]].transpose(0, 1).requires_grad_()
        vi = v.detach()[ko[i]:ko[i + 1]].transpose(0, 1).requires_grad_()
        mi = dense_masks[i].clone().requires_grad_()
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mi if masked else None, is_causal=not masked, enable_gqa=True
        ).transpose(0, 1)
        refs.append(o)
        gs = torch.autograd.grad(o, (qi, ki, vi, mi), go[qo[i]:qo[i + 1]], allow_unused=True)
        gs = [torch.zeros_like(t) if gr is None else gr for t, gr in zip((qi, ki, vi, mi), gs)]
        ref_grads[0].append(gs[0].transpose(0, 1))
        ref_grads[1].append(gs[1].transpose(0, 1))
        ref_grads[2].append(gs[2].transpose(0, 1))
        if masked:
            ref_grads[3].append(gs[3].permute(1, 2, 0).reshape(-1, 4))
    torch.testing.assert_close(out, torch.cat(refs), **TOL)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, torch.cat(ref), **TOL)


@pytest.mark.parametrize("case", ["causal_gqa", "additive_mask", "bool_mask"])
def test_dropout_op_draws_as_dense_sdpa_and_its_saved_backward_matches(case):
    """The CPU dropout op run eagerly, against dense SDPA with dropout on each sample under the
    same seed (it makes eager's draws): values, and the gradients its backward computes from the
    saved weights (query, key, value, an additive mask's rows); empty query and key samples."""
    g = torch.Generator().manual_seed(5)
    lq, lk = ([3, 0, 4, 6], [3, 2, 4, 6]) if case == "causal_gqa" else ([3, 0, 4, 2], [5, 2, 4, 0])
    hk = 2 if case == "causal_gqa" else 4
    q = torch.randn(sum(lq), 4, 8, generator=g, requires_grad=True)
    k = torch.randn(sum(lk), hk, 8, generator=g, requires_grad=True)
    v = torch.randn(sum(lk), hk, 8, generator=g, requires_grad=True)
    qo, ko = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()]) for x in (lq, lk))
    if case == "bool_mask":
        dense_masks = [torch.rand(a, s, generator=g) < 0.7 for a, s in zip(lq, lk)]
        for m in dense_masks:
            m[:, :1] = m.shape[1] > 0
            m[:1] = False  # a row without keys: zeros, as the safe softmax gives
        mrows = torch.cat([m.reshape(-1, 1) for m in dense_masks])
        ms = torch.tensor([[1, a, s] for a, s in zip(lq, lk)])
    else:
        dense_masks = [torch.randn(4, a, s, generator=g) for a, s in zip(lq, lk)]
        mrows = torch.cat([m.permute(1, 2, 0).reshape(-1, 4) for m in dense_masks]).requires_grad_()
        ms = torch.tensor([[4, a, s] for a, s in zip(lq, lk)])
    mo = torch.tensor([0, *torch.tensor([a * s for a, s in zip(lq, lk)]).cumsum(0).tolist()])
    masked, gqa = case != "causal_gqa", case == "causal_gqa"
    args = (mrows, mo, ms) if masked else (None, None, None)
    torch.manual_seed(11)
    out = packed_sdpa_dropout_fwd(q, k, v, qo, ko, *args, 0.3, not masked, None, gqa, max(lk))[0]
    go = torch.randn(out.shape, generator=g)
    leaves = (q, k, v, mrows) if case == "additive_mask" else (q, k, v)
    grads = torch.autograd.grad(out, leaves, go)
    torch.manual_seed(11)
    refs, ref_grads = [], [[] for _ in leaves]
    for i in range(len(lq)):
        qi = q.detach()[qo[i]:qo[i + 1]].transpose(0, 1).unsqueeze(0).requires_grad_()
        ki = k.detach()[ko[i]:ko[i + 1]].transpose(0, 1).unsqueeze(0).requires_grad_()
        vi = v.detach()[ko[i]:ko[i + 1]].transpose(0, 1).unsqueeze(0).requires_grad_()
        mi = dense_masks[i].clone().requires_grad_(case == "additive_mask")
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mi if masked else None, dropout_p=0.3, is_causal=not masked, enable_gqa=gqa
        )[0].transpose(0, 1)
        refs.append(o)
        gs = torch.autograd.grad(o, (qi, ki, vi, mi)[:len(leaves)], go[qo[i]:qo[i + 1]], allow_unused=True)
        gs = [torch.zeros_like(t) if gr is None else gr for t, gr in zip((qi, ki, vi, mi), gs)]
        for j in range(3):
            ref_grads[j].append(gs[j][0].transpose(0, 1))
        if case == "additive_mask":
            ref_grads[3].append(gs[3].permute(1, 2, 0).reshape(-1, 4))
    torch.testing.assert_close(out, torch.cat(refs), **TOL)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, torch.cat(ref), **TOL)


def test_inductor_causal_dropout_backward_draws_nothing_and_equals_eager():
    """Causal self-attention with dropout (the decoder's case) under inductor: same seed, same
    values and gradients as eager; the backward reads the saved weights, so it makes no random
    draw (it used to replay each sample's forward and its dropout)."""
    def f(x):
        return F.scaled_dot_product_attention(x, x, x, dropout_p=0.2, is_causal=True)

    cf = torch.compile(f, backend="inductor", fullgraph=True)
    for b, seed in BATCHES[:3]:
        x, ref_x = _heads(_lengths(b, seed), 2, seed), _heads(_lengths(b, seed), 2, seed)
        torch.manual_seed(seed)
        out = cf(x)
        torch.manual_seed(seed)
        ref = f(ref_x)
        assert_close_samples(out, list(ref.unbind()), atol=1e-5, rtol=1e-5)
        with torch.profiler.profile() as prof:
            (out.values() ** 2).sum().backward()
        assert not [e.name for e in prof.events() if "bernoulli" in e.name]
        (ref.values() ** 2).sum().backward()
        torch.testing.assert_close(x.grad.values(), ref_x.grad.values(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- modules


def _tokens(lo: int = 0, hi: int = 10, shift: int = 0):
    return lambda b, seed: (_nt([(n, 16) for n in _lengths(b, seed + shift, lo, hi)], seed + shift),)


def _tgt_src(b, seed):
    return _tokens()(b, seed) + _tokens(lo=1, hi=7, shift=50)(b, seed)


def test_encoder_decoder_layers_train_in_one_graph():
    """An encoder layer over a source batch, and a decoder layer (causal self-attention over the
    target, cross-attention to the encoded source: another structure), default dropout 0.1 in
    training, as the modules are written (a dense causal tgt_mask); batch_first=True."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)  # dropout=0.1
    dec = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)

    def f(tgt, src):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return dec(tgt, enc(src), tgt_mask=mask, tgt_is_causal=True)

    assert _compare(f, _tgt_src, nn.ModuleList([enc, dec])) == 1


def test_seq_first_decoder_layer_and_multihead_attention_train_in_one_graph():
    """batch_first=False: the decoder layer (causal self-attention, cross-attention to a memory
    batch of another structure), and nn.MultiheadAttention across structures (kdim/vdim,
    dropout 0.1, a per-sample bool mask: True = blocked, made additive by the module;
    samples without keys)."""
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(16, 2, 32)
    mha = nn.MultiheadAttention(16, 4, dropout=0.1, kdim=12, vdim=12)

    def f(tgt, src, mem, mask):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return dec(tgt, src, tgt_mask=causal, tgt_is_causal=True), mha(tgt, mem, mem, attn_mask=mask, need_weights=False)[0]

    def make(b, seed):
        tgt, src = _tgt_src(b, seed)
        lk = _lengths(b, seed + 60, lo=0, hi=7)
        g = torch.Generator().manual_seed(seed)
        masks = [torch.rand(n, s, generator=g) < 0.3 for n, s in zip(tgt.host_sizes()[:, 0].tolist(), lk)]
        for m in masks:
            m[:, :1] = False
        return tgt, src, _nt([(n, 12) for n in lk], seed + 61), padless.from_list(masks, ragged_dims=(0, 1))

    assert _compare(f, make, nn.ModuleList([dec, mha])) == 1


# ---------------------------------------------------------------------------- inductor


@pytest.mark.skipif(not INDUCTOR, reason="inductor compile of a layer: ~20 s; PADLESS_COMPILE_INDUCTOR=1 runs it")
def test_inductor_encoder_layer_with_dropout_equals_eager_under_fallback_random():
    """Inductor with ``fallback_random`` (its random ops draw as eager does): outputs and
    gradients of the training encoder layer (dropout 0.1 in attention and the block)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    with torch._inductor.config.patch(fallback_random=True):
        assert _compare(layer, _tokens(), layer, backend="inductor", batches=BATCHES[:4]) == 1


def test_inductor_sdpa_mask_and_dropout_equal_eager_and_keep_one_minus_p():
    """The op is opaque to inductor, so its dropout draws are eager's without fallback_random.
    With v = 1 each output element is its row's kept attention mass / (1 - p): mean ~1."""
    cnt = CompileCounterWithBackend("inductor")
    f = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.5)  # noqa: E731
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for b, lq, lk in ((16, 20, 30), (9, 25, 17)):
        g = torch.Generator().manual_seed(b)
        q, k = _heads([lq] * b, 2, 0), _heads([lk] * b, 2, 1)
        v = torch.ones_like(k).detach()
        m = padless.from_list([torch.randn(lq, lk, generator=g) for _ in range(b)], ragged_dims=(0, 1))
        torch.manual_seed(b)
        out = cf(q, k, v, m)
        torch.manual_seed(b)
        ref = f(q, k, v, m)
        assert_close_samples(out, list(ref.unbind()), atol=1e-5, rtol=1e-5)
        assert 0.9 < out.values().mean().item() < 1.1
        assert not torch.equal(cf(q, k, v, m).values(), out.values())  # fresh draws each call
    assert cnt.frame_count == 1


# ---------------------------------------------------------------------------- errors


def _compile(f):
    return torch.compile(f, backend="aot_eager", fullgraph=True)


def test_mask_layout_and_per_sample_shape_errors_under_compile():
    q, k = _heads([3, 4], 2, 0), _heads([2, 5], 2, 1)
    # (L_i, 1, S_i) masks: the ragged dims are not the last two
    odd = padless.from_list([torch.ones(3, 1, 2, dtype=torch.bool), torch.ones(4, 1, 5, dtype=torch.bool)], ragged_dims=(0, 2))
    with pytest.raises(Exception, match=r"under torch.compile attn_mask must be a NestedTensor of \(\.\.\., L_i, S_i\) samples"):
        _compile(lambda q, k, m: F.scaled_dot_product_attention(q, k, k, attn_mask=m))(q, k, odd)
    wrong = padless.from_list([torch.ones(3, 2, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool)], ragged_dims=(0, 1))
    with pytest.raises(ValueError, match=r"attn_mask sample 1 has shape \(4, 4\), expected \(\.\.\., 4, 5\)"):
        _compile(lambda q, k, m: F.scaled_dot_product_attention(q, k, k, attn_mask=m))(q, k, wrong)


def test_mods_and_need_weights_under_compile_name_the_fix():
    q = _heads([3, 4], 2, 0)

    def local_window(b, h, qi, ki):
        return (qi - ki).abs() <= 1

    with pytest.raises(Exception, match=r"mask_mod/score_mod on cpu do not run under torch.compile.*pass it as attn_mask"):
        _compile(lambda q: padless.ops.attention.attention(q, q, q, mask_mod=local_window))(q)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    (x,) = _tokens()(3, 0)
    with pytest.raises(Exception, match=r"need_weights=True does not run under torch.compile.*need_weights=False"):
        _compile(lambda x: mha(x, x, x)[0])(x)
