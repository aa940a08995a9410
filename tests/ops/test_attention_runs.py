"""Attention over runs of equal-length samples (padless.ops.attention.runs): a pair state folded
into the batch attends once per parent sample on views of its rows, its per-row repeated bias
read from the source. Each case is checked sample by sample against the dense code on each
sample alone (values and gradients), with empty samples, one-sample batches and length 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.attention import runs, sdpa
from padless.ops.common import repeats
from padless.ops.rows import folds
from padless.testing.reference import check_samples, leaves

D, H, DH = 8, 2, 4
# every batch folds into runs of >= runs.MIN_RUN samples on average (the runs path takes it)
PAIRS = {"batch": [5, 0, 4, 6], "one_sample": [5], "length_one": [6, 1, 5], "equal": [4, 4, 4]}


@pytest.fixture(autouse=True)
def _fresh_registry():
    folds._REGISTRY.clear()
    yield
    folds._REGISTRY.clear()


class FoldedAttention(nn.Module):
    """Triangle attention with its rows folded into the batch; ``mask`` says how the bias gets
    there: ``repeat`` (repeat_interleave), ``expand`` (expand + reshape: a mask of its own per
    row), ``scaled`` (the repeat, then scaled: no longer a repeat), ``none``, ``bool`` (a key mask)."""

    def __init__(self, mask: str = "repeat", causal: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(D, H * DH).double() for _ in range(3))
        self.b, self.o = nn.Linear(D, H, bias=False).double(), nn.Linear(H * DH, D).double()
        self.mask, self.causal = mask, causal

    def forward(self, z):
        B, N = z.shape[0], z.shape[1]
        bias = self.b(z).permute(0, 3, 1, 2)  # (B, H, N, N)
        zf = z.reshape(B * N, N, D)
        q, k, v = (lin(zf).view(B * N, N, H, DH).transpose(1, 2) for lin in (self.q, self.k, self.v))
        m = None
        if self.mask == "repeat":
            m = bias.repeat_interleave(N, dim=0)
        elif self.mask == "expand":
            m = bias.unsqueeze(1).expand(B, N, H, N, N).reshape(B * N, H, N, N)
        elif self.mask == "scaled":
            m = bias.repeat_interleave(N, dim=0) * 0.5
        elif self.mask == "bool":
            m = (bias > 0).repeat_interleave(N, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=self.causal)
        return self.o(o.transpose(1, 2).reshape(B * N, N, H * DH)).reshape(B, N, N, D)


def _pairs(ns, seed=0):
    return leaves([(n, n, D) for n in ns], seed=seed, ragged=(0, 1), dtype=torch.float64)


@pytest.mark.parametrize("ns", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("mask", ["repeat", "expand", "scaled", "none", "bool"])
def test_folded_attention_runs_per_sample(ns, mask):
    m = FoldedAttention(mask)
    check_samples(m, lambda zi: m(zi[None])[0], [_pairs(ns)])
    assert sdpa.last_choice.backend == "runs"


@pytest.mark.parametrize("ns", [PAIRS["batch"], PAIRS["length_one"]], ids=["batch", "length_one"])
def test_folded_attention_runs_causal(ns):
    m = FoldedAttention("none", causal=True)  # torch refuses a mask with is_causal
    check_samples(m, lambda zi: m(zi[None])[0], [_pairs(ns)])
    assert sdpa.last_choice.backend == "runs"


def test_folded_attention_without_grad_takes_the_fused_kernel_per_run():
    m = FoldedAttention("repeat")
    z, zs = _pairs(PAIRS["batch"])
    with torch.no_grad():
        out = m(z.detach())
        refs = [m(s.detach()[None])[0] for s in zs]
    for o, r in zip(out.unbind(), refs):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-6)


def test_repeat_record_follows_writes():
    z, _ = _pairs([3, 2])
    bias = z[..., :H].permute(0, 3, 1, 2).detach()
    r = bias.repeat_interleave(z.shape[1], dim=0)
    assert repeats.source_of(r).counts == (3, 2)
    r.add_(1.0)  # written in place: its rows are no longer the source's
    assert repeats.source_of(r) is None
    r2 = bias.repeat_interleave(z.shape[1], dim=0)
    bias.mul_(2.0)  # the source written
    assert repeats.source_of(r2) is None


def test_written_repeat_is_read_as_written():
    # a repeated bias changed in place before attention: the attention reads the changed rows
    m = FoldedAttention("repeat")
    z, zs = _pairs(PAIRS["batch"])

    def f(t):
        B, N = t.shape[0], t.shape[1]
        bias = m.b(t).permute(0, 3, 1, 2)
        tf = t.reshape(B * N, N, D)
        q, k, v = (lin(tf).view(B * N, N, H, DH).transpose(1, 2) for lin in (m.q, m.k, m.v))
        rb = bias.repeat_interleave(N, dim=0)
        rb = rb.clone() if not isinstance(rb, padless.NestedTensor) else rb
        rb.mul_(3.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rb).transpose(1, 2).reshape(B, N, N, H * DH)

    check_samples(f, lambda s: f(s[None])[0], [(z, zs)])


def test_rows_masked_everywhere_give_zeros_as_dense():
    # an additive bias of -inf on every key of some rows: torch's math path gives zeros there
    z, zs = _pairs([4, 5])
    lin = nn.Linear(D, H).double()
    with torch.no_grad():
        lin.bias.copy_(torch.tensor([20.0, -20.0]))  # head 0: every key masked, head 1: none

    def f(t):
        B, N = t.shape[0], t.shape[1]
        bias = lin(t).permute(0, 3, 1, 2)
        bias = torch.where(bias > 0.5, float("-inf"), bias)
        tf = t.reshape(B * N, N, D)
        q = tf[..., :H * DH // 2].reshape(B * N, N, H, DH // 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, attn_mask=bias.repeat_interleave(N, dim=0))
        assert sdpa.last_choice.backend == "runs"
        return o.transpose(1, 2).reshape(B, N, N, H * (DH // 2))

    out = check_samples(f, lambda s: f(s[None])[0], [(z, zs)])
    assert not out.values().isnan().any() and (out.values().view(-1, H, DH // 2)[:, 0] == 0).all()


def test_ordinary_batches_keep_the_per_sample_path():
    q, _ = leaves([(H, n, DH) for n in (3, 5, 2, 7)], ragged=(1,))
    F.scaled_dot_product_attention(q, q, q)
    assert sdpa.last_choice.backend != "runs"


def test_runs_off_gives_the_same():
    m = FoldedAttention("repeat")
    z, _ = _pairs(PAIRS["batch"])
    on = m(z)
    runs.ENABLED = False
    try:
        off = m(z)
        assert sdpa.last_choice.backend == "per_sample"
    finally:
        runs.ENABLED = True
    torch.testing.assert_close(on.values(), off.values())


def test_repeat_interleave_gradient_sums_the_repeats():
    x, xs = leaves([(3, 2), (0, 2), (2, 2)], ragged=(0,), dtype=torch.float64)
    counts = torch.tensor([2, 3, 1])

    def f(t):
        return t.repeat_interleave(counts, dim=0) * math.pi

    out = f(x)
    refs = [s.detach() * math.pi for s, c in zip(xs, counts.tolist()) for _ in range(c)]
    for o, r in zip(out.unbind(), refs):
        torch.testing.assert_close(o, r)
    out.values().square().sum().backward()
    for g, s, c in zip(x.grad.unbind(), xs, counts.tolist()):
        torch.testing.assert_close(g, c * 2 * math.pi ** 2 * s.detach())


def test_folded_attention_under_inference_mode():
    # inference tensors have no version counter: the repeat is not recorded, the rows are read
    m = FoldedAttention("repeat")
    z, zs = _pairs(PAIRS["batch"])
    z = z.detach()
    with torch.inference_mode():
        out = m(z)
        refs = [m(s.detach()[None])[0] for s in zs]
    for o, r in zip(out.unbind(), refs):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_heads", [H, 1], ids=["chunked_qkv", "gqa"])
def test_folded_attention_chunked_projection_and_gqa(kv_heads):
    # q, k, v as chunks of one projection (rows that are not contiguous), and grouped-query heads
    torch.manual_seed(0)
    qkv = nn.Linear(D, (H + 2 * kv_heads) * DH).double()
    lin_b = nn.Linear(D, H, bias=False).double()

    def f(t):
        B, N = t.shape[0], t.shape[1]
        tf = t.reshape(B * N, N, D)
        q, k, v = qkv(tf).split([H * DH, kv_heads * DH, kv_heads * DH], dim=-1)
        q = q.reshape(B * N, N, H, DH).transpose(1, 2)
        k, v = (x.reshape(B * N, N, kv_heads, DH).transpose(1, 2) for x in (k, v))
        bias = lin_b(t).permute(0, 3, 1, 2).repeat_interleave(N, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=kv_heads != H)
        return o.transpose(1, 2).reshape(B, N, N, H * DH)

    check_samples(f, lambda s: f(s[None])[0], [_pairs(PAIRS["batch"])])
    assert sdpa.last_choice.backend == "runs"


def test_runs_read_the_repeated_bias_from_its_source():
    z, _ = _pairs([5, 4])
    B, N = z.shape[0], z.shape[1]
    bias = z[..., :H].permute(0, 3, 1, 2)
    q = z.reshape(B * N, N, D).unflatten(-1, (H, D // H)).transpose(1, 2)
    p = runs.plan(q, q, q, bias.repeat_interleave(N, dim=0))
    assert p.mask is bias and len(p.runs) == 2 and all(r.mask.count == 1 for r in p.runs)
    p = runs.plan(q, q, q, bias.repeat_interleave(N, dim=0) * 1.0)  # no longer a repeat: its own rows
    assert p.mask is not bias and [r.mask.count for r in p.runs] == [5, 4]
