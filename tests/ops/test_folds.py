"""Folds of the batch (padless.ops.rows.folds): ``(b i) j d`` and ``(b h) l d`` and back,
each checked sample by sample against the dense code run on each sample alone (values and
gradients), with empty samples, one-sample batches and samples of length 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.rows import folds
from padless.testing import assert_close_samples
from padless.testing.reference import check_samples, leaves

D, H, DH = 8, 2, 4
PAIRS = {"batch": [3, 0, 2, 1], "one_sample": [4], "length_one": [1, 1, 2], "all_one": [1, 1]}


@pytest.fixture(autouse=True)
def _fresh_registry():
    folds._REGISTRY.clear()  # folds of earlier tests could make plain-int unfolds ambiguous
    yield
    folds._REGISTRY.clear()


class TriangleAttention(nn.Module):
    """AlphaFold's triangle attention as einops-style code writes it: rows folded into the batch."""

    def __init__(self, bias_as: str = "repeat_interleave", sdpa: bool = True, fold_int: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(D, H * DH).double() for _ in range(3))
        self.b, self.o = nn.Linear(D, H, bias=False).double(), nn.Linear(H * DH, D).double()
        self.bias_as, self.sdpa, self.fold_int = bias_as, sdpa, fold_int

    def forward(self, z):
        B, N = z.shape[0], z.shape[1]
        bias = self.b(z).permute(0, 3, 1, 2)  # (B, H, N, N)
        zf = z.reshape(z.shape[0] * z.shape[1], N, D) if self.fold_int else z.reshape(B * N, N, D)
        q, k, v = (lin(zf).view(B * N, N, H, DH).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.bias_as == "repeat_interleave":
            rb = bias.repeat_interleave(N, dim=0)  # einops: repeat(bias, 'b ... -> (b r) ...', r=N)
        else:
            rb = bias.unsqueeze(1).expand(B, N, H, N, N).reshape(B * N, H, N, N)
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=rb)
        else:
            a = (q @ k.transpose(-1, -2)) / math.sqrt(DH) + rb
            o = a.softmax(-1) @ v
        o = self.o(o.transpose(1, 2).reshape(B * N, N, H * DH))
        return o.reshape(B, N, N, D)  # einops: rearrange(o, '(b i) j d -> b i j d', b=B)


def _pairs(ns, seed=0):
    return leaves([(n, n, D) for n in ns], seed=seed, ragged=(0, 1), dtype=torch.float64)


@pytest.mark.parametrize("ns", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("bias_as", ["repeat_interleave", "expand"])
@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "softmax"])
def test_triangle_attention_folded_rows_per_sample(ns, bias_as, sdpa):
    m = TriangleAttention(bias_as, sdpa)
    out = check_samples(m, lambda zi: m(zi[None])[0], [_pairs(ns)])
    assert out.batch_size == len(ns)
    # when every N_i is 1 the folded batch has B samples, and (B, N, N, D) is read as a reshape
    # inside every sample (the same values; the dim of extent 1 static)
    assert out.ragged_dims == ((0,) if max(ns) == 1 else (0, 1))


def test_fold_target_written_with_plain_ints():
    m = TriangleAttention(fold_int=True)
    check_samples(m, lambda zi: m(zi[None])[0], [_pairs(PAIRS["batch"])])


def test_leading_ragged_fold_and_unfold_copy_nothing():
    z, _ = _pairs([3, 0, 2])
    zf = z.reshape(z.shape[0] * z.shape[1], z.shape[1], D)
    assert zf.batch_size == 5 and zf.sizes().tolist() == [[3, D]] * 3 + [[2, D]] * 2
    assert zf.values().data_ptr() == z.values().data_ptr()  # the same rows
    back = zf.reshape(3, z.shape[1], z.shape[1], D)
    assert back.values().data_ptr() == z.values().data_ptr()
    assert back.sizes().tolist() == z.sizes().tolist() and back.ragged_dims == (0, 1)
    assert folds.fold_link(zf).counts == (3, 0, 2)
    assert zf.flatten(0, 1).batch_size == 3 * 3 + 2 * 2  # flatten(0, 1) folds too: every row a sample


def test_transposed_pair_fold_is_one_gather():
    # triangle attention around the ending node: z.transpose(1, 2), then rows folded
    z, zs = _pairs([3, 0, 2])
    zt = z.transpose(1, 2)
    zf = zt.reshape(zt.shape[0] * zt.shape[1], zt.shape[2], D)
    assert zf.values().data_ptr() != z.values().data_ptr()
    assert_close_samples(zf, [r for s in zs for r in s.transpose(0, 1).detach().unbind(0)])


def test_rectangular_pair_fold_per_sample():
    x, xs = leaves([(3, 2, D), (0, 4, D), (2, 5, D)], ragged=(0, 1), dtype=torch.float64)
    lin = nn.Linear(D, D).double()

    def f(t):
        b, n, m = t.shape[:3]
        return lin(t.reshape(b * n, m, D)).softmax(1).reshape(b, n, m, D)

    out = check_samples(f, lambda s: f(s[None])[0], [(x, xs)])
    assert out.sizes()[:, :2].tolist() == [[3, 2], [0, 4], [2, 5]]  # the empty sample keeps its (0, 4)


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [4], [1, 1]], ids=["batch", "one_sample", "length_one"])
def test_heads_folded_into_the_batch(lengths):
    # x.view(B, L, H, d).transpose(1, 2).reshape(B * H, L, d), bmm attention, and back
    torch.manual_seed(0)
    lin = nn.Linear(D, 3 * D).double()

    def block(x):
        B, L, _ = x.shape

        def heads(t):
            return t.view(B, L, H, DH).transpose(1, 2).reshape(B * H, L, DH)

        q, k, v = (heads(t) for t in lin(x).chunk(3, dim=-1))
        a = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(DH)
        o = torch.bmm(a.softmax(-1), v)
        return o.view(B, H, L, DH).transpose(1, 2).reshape(B, L, D)

    x = leaves([(n, D) for n in lengths], dtype=torch.float64)
    check_samples(block, lambda s: block(s[None])[0], [x])


def test_static_fold_is_a_gather_and_flatten_unflatten_round_trip():
    x, xs = leaves([(H, n, DH) for n in (3, 0, 2)], ragged=(1,), dtype=torch.float64)
    xf = x.flatten(0, 1)
    assert xf.batch_size == 3 * H and xf.values().data_ptr() != x.values().data_ptr()
    assert_close_samples(xf, [h for s in xs for h in s.detach().unbind(0)])
    back = (xf * 2).unflatten(0, (3, H))
    assert_close_samples(back, [2 * s.detach() for s in xs])
    back.values().sum().backward()
    assert_close_samples(x.grad, [torch.full_like(s, 2.0) for s in xs])


def test_unfold_after_a_pair_product_reads_sizes_from_the_shape():
    z, _ = _pairs([2, 0, 3])
    B, N = z.shape[:2]
    q = z.reshape(B * N, N, D)
    o = (q @ q.transpose(1, 2)).softmax(-1) @ q  # a new structure: the fold link is found by content
    assert folds.fold_link(o) is not None
    assert o.reshape(B, N, N, D).sizes().tolist() == z.sizes().tolist()
    assert o.reshape(int(B), int(N), int(N), D).sizes().tolist() == z.sizes().tolist()


def test_unfold_with_ambiguous_plain_ints_is_refused():
    # two batches whose folds have the same sample sizes, (2, D) twice, from different parents
    z1, _ = _pairs([2, 0, 0])
    z2, _ = _pairs([0, 2, 0])
    f1, f2 = (z.reshape(3 * 2, 2, D) for z in (z1, z2))
    o = (f1 @ f1.transpose(1, 2)) @ f1  # a new structure: its link is found by content, twice
    with pytest.raises(padless.StructureError, match=r"could unfold this batch of 2 samples in 2 ways"):
        o.reshape(3, 2, 2, D)
    assert o.reshape(3, z1.shape[1], 2, D).sizes().tolist() == [[2, 2, D], [0, 0, D], [0, 0, D]]  # sizes read from z1
    assert f2.reshape(3, 2, 2, D).sizes().tolist() == [[0, 0, D], [2, 2, D], [0, 0, D]]  # its own link


def test_unfold_errors():
    z, _ = _pairs([3, 0, 2])
    zf = z.reshape(3 * 3, 3, D)
    with pytest.raises(padless.StructureError, match=r"was folded from 3 samples \(a ragged dim of envelope 3\); the target \(3, 2, 3, 8\) does not unfold it"):
        zf.reshape(3, 2, 3, D)
    other, _ = _pairs([1, 1, 1])
    with pytest.raises(padless.StructureError, match=r"regroups this batch of 5 samples into 3 samples of \(1, 1, 1\) each"):
        zf.reshape(3, other.shape[1], 3, D)
    with pytest.raises(padless.StructureError, match=r"folds dim 1 of envelope \(3, 3, 3, 8\) into the batch"):
        z.reshape(9, 5, D)
    x, _ = leaves([(2, D), (3, D)])
    with pytest.raises(padless.StructureError, match=r"the samples of one group must have one shape"):
        two = padless.from_list([torch.zeros(2)]).shape[1]  # read from a batch of one sample of size 2
        x.reshape(1, two, 3, D)  # (2, D) and (3, D) cannot become one (2, 3, D) sample
    with pytest.raises(padless.StructureError, match=r"read from the shape of a batch of 3 samples and this batch has 2"):
        x.repeat_interleave(z.shape[1], dim=0)


def test_repeat_interleave_along_the_batch():
    x, xs = leaves([(2, D), (0, D), (3, D)], dtype=torch.float64)
    assert_close_samples(x.repeat_interleave(2, dim=0), [s.detach() for s in xs for _ in range(2)])
    r = x.repeat_interleave(torch.tensor([1, 2, 0]), dim=0)
    assert_close_samples(r, [xs[0].detach(), xs[1].detach(), xs[1].detach()])
    n = (x.shape[1] + 1) // 2  # sizes read from x's shape: (1, 0, 2)
    per = x.repeat_interleave(n, dim=0)
    assert_close_samples(per, [xs[0].detach(), xs[2].detach(), xs[2].detach()])
    per.values().sum().backward()
    assert_close_samples(x.grad, [torch.ones_like(xs[0]), torch.zeros_like(xs[1]), torch.full_like(xs[2], 2.0)])
    assert x.repeat_interleave(1, dim=0).sizes().tolist() == x.sizes().tolist()


def test_expand_static_one_to_sizes_read_from_a_shape():
    # s.unsqueeze(2).expand(B, N, N, C): every sample expanded to its own (N_i, N_i, C)
    s, ss = leaves([(2, D), (0, D), (3, D)], dtype=torch.float64)
    B, N = s.shape[:2]
    p = s.unsqueeze(2).expand(B, N, N, D)
    assert p.ragged_dims == (0, 1)
    assert_close_samples(p, [t.detach().unsqueeze(1).expand(-1, t.shape[0], -1) for t in ss])
    p.values().sum().backward()
    assert_close_samples(s.grad, [torch.full_like(t, t.shape[0]) for t in ss])


@pytest.mark.parametrize("ns", [(1, 0), (1,), (1, 1, 0)])
def test_repeat_by_a_size_of_envelope_one_repeats_every_sample_by_its_own(ns):
    """``bias.repeat_interleave(N, dim=0)`` with ``N`` read from a batch whose envelope is 1
    (samples of length 1 and 0): sample b repeated N_b times, as folding gives, never the
    int 1's copy of the whole batch (a silent wrong structure found by the long fuzz run,
    seed 301935)."""
    xs = [torch.randn(n, n, 2) for n in ns]
    x = padless.from_list(xs, ragged_dims=(0, 1))
    n = x.shape[1]
    r = x[..., 0].unsqueeze(1).repeat_interleave(n, dim=0)
    want = [d[..., 0].unsqueeze(0) for d in xs for _ in range(d.shape[0])]
    assert r.batch_size == len(want)
    for got, w in zip(r.unbind(), want):
        torch.testing.assert_close(got, w)
    q = x.reshape(x.shape[0] * n, n, 2).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=r).squeeze(1).reshape(x.shape[0], n, n, 2)
    for got, d in zip(out.unbind(), xs):
        dq = d.unsqueeze(1)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(dq, dq, dq, attn_mask=d[..., 0][None, None]).squeeze(1))


def test_a_mask_of_another_batch_size_is_refused_by_name():
    x = padless.from_list([torch.randn(n, n, 2) for n in (2, 1)], ragged_dims=(0, 1))
    q = x.reshape(-1, x.shape[2], 2).unsqueeze(1)  # 3 folded samples
    with pytest.raises(padless.StructureError, match="attn_mask is a batch of 2 samples and the query a batch of 3"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=x[..., 0].unsqueeze(1))


def test_folded_attention_of_a_batch_of_empty_samples_keeps_the_graph():
    """Every sample empty: the fold has no sample, and attention over it gives the empty result
    on the input's graph (each dense sample's SDPA does), so a gradient can be asked for
    (long fuzz run, seed 314699)."""
    x = padless.from_list([torch.randn(0, 0, 2)], ragged_dims=(0, 1), requires_grad=True)
    b, n = x.shape[0], x.shape[1]
    q = x.reshape(b * n, n, 2).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=x[..., 0].unsqueeze(1).repeat_interleave(n, dim=0))
    out = out.squeeze(1).reshape(b, n, n, 2)
    assert out.requires_grad and out.shape[0] == 1
    (g,) = torch.autograd.grad(out.values().sum(), [x])
    assert g.unbind()[0].shape == (0, 0, 2)
