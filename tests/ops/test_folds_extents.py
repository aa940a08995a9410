"""Sizes read from a shape on folded batches (padless.tensor.lineage.Fold, padless.tensor.extents.for_batch):
a size read from the batch a fold came from gives every folded sample ``(b, i)`` parent ``b``'s own
size, through one fold or several, and the unfold back rejoins the parent; sizes of any other batch
stay refused. Checked per sample against the dense code on each sample alone."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.rows import folds
from padless.testing import assert_close_samples
from padless.testing.reference import check_samples, leaves

D = 8


@pytest.fixture(autouse=True)
def _fresh_registry():
    folds._REGISTRY.clear()
    yield
    folds._REGISTRY.clear()


def _pairs(ns, seed=0):
    return leaves([(n, n, D) for n in ns], seed=seed, ragged=(0, 1), dtype=torch.float64)


# ---------------------------------------------------------------------------- sizes that apply


# sum N_i == B: the folded batch has as many samples as its parent (the parent's N is not the folded batch's)
AS_MANY = {"two_and_empty": [2, 0], "empty_first": [0, 0, 3], "mixed": [2, 0, 1]}


def _triangle_attention(bias_as: str):
    """Rows folded into the batch, the pair bias repeated per row (tests/ops/test_folds.py's, two heads)."""
    torch.manual_seed(0)
    qkv, lin_b, lin_o = nn.Linear(D, 3 * D).double(), nn.Linear(D, 2, bias=False).double(), nn.Linear(D, D).double()

    def f(z):
        B, N = z.shape[0], z.shape[1]
        bias = lin_b(z).permute(0, 3, 1, 2)  # (B, 2, N, N)
        zf = z.reshape(B * N, N, D)
        q, k, v = (t.view(B * N, N, 2, D // 2).transpose(1, 2) for t in qkv(zf).chunk(3, dim=-1))
        if bias_as == "repeat_interleave":
            rb = bias.repeat_interleave(N, dim=0)
        else:
            rb = bias.unsqueeze(1).expand(B, N, 2, N, N).reshape(B * N, 2, N, N)
        o = ((q @ k.transpose(-1, -2)) + rb).softmax(-1) @ v
        return lin_o(o.transpose(1, 2).reshape(B * N, N, D)).reshape(B, N, N, D)

    return f


@pytest.mark.parametrize("bias_as", ["repeat_interleave", "expand"])
@pytest.mark.parametrize("ns", AS_MANY.values(), ids=AS_MANY.keys())
def test_triangle_attention_when_the_fold_has_as_many_samples_as_the_batch(ns, bias_as):
    f = _triangle_attention(bias_as)
    out = check_samples(f, lambda zi: f(zi[None])[0], [_pairs(ns)])
    assert out.sizes().tolist() == [[n, n, D] for n in ns] and out.ragged_dims == (0, 1)


@pytest.mark.parametrize("ns", [[3, 0, 2, 1], [2, 0], [4]], ids=["batch", "as_many", "one_sample"])
def test_sizes_of_the_parent_apply_through_two_folds(ns):
    heads, dh = 4, 2  # (b i) j d, then heads folded too: ((b i) h) j dh
    torch.manual_seed(0)
    lin = nn.Linear(D, D).double()

    def f(z):
        B, N = z.shape[0], z.shape[1]
        zf = z.reshape(B * N, N, D)
        S = zf.shape[0]
        q = lin(zf).view(B * N, N, heads, dh).transpose(1, 2).reshape(S * heads, N, dh)
        a = q.view(S * heads, N, 2, dh // 2).softmax(-1).view(S * heads, N, dh)  # N read two folds up
        o = a.reshape(S, heads, N, dh).transpose(1, 2).reshape(S, N, D)  # heads unfolded: N one fold up
        return o.reshape(B, N, N, D)

    out = check_samples(f, lambda s: f(s[None])[0], [_pairs(ns)])
    assert out.sizes().tolist() == [[n, n, D] for n in ns]


def test_fold_written_with_minus_one_and_a_size_read_from_the_shape():
    z, zs = _pairs([3, 0, 2])
    zf = z.reshape(-1, z.shape[1], D)  # no sample holds N_i * D elements: the -1 is the fold
    assert_close_samples(zf, [r for s in zs for r in s.detach().unbind(0)])
    assert folds.fold_link(zf).counts == (3, 0, 2)


def test_sizes_of_the_parent_resize_folded_frames():
    x, xs = leaves([(3, 2, h, w) for h, w in ((2, 3), (1, 1), (4, 2))], ragged=(2, 3), dtype=torch.float64)
    B, T, C, Hh, W = x.shape
    up = F.interpolate(x.flatten(0, 1), size=(Hh * 2, W), mode="nearest")  # (b t) c h w: frame (b, t) to b's size
    assert_close_samples(up, [F.interpolate(s.detach(), size=(2 * s.shape[2], s.shape[3]), mode="nearest")[t]
                              for s in xs for t in range(T)])


def test_unfold_rejoins_the_parent_and_folds_of_one_batch_share_a_lineage():
    z, zs = _pairs([3, 0, 2])
    B, N = z.shape[:2]
    zf = z.reshape(B * N, N, D)
    rb = z[..., :1].permute(0, 3, 1, 2).repeat_interleave(N, dim=0)  # sample (b, i) is bias[b]
    assert zf._lineage is not z._lineage and zf._lineage is rb._lineage  # one regrouping of z's samples
    assert zf._lineage.parent is z._lineage and zf._lineage.counts == (3, 0, 2)
    back = (zf * 2).reshape(B, N, N, D)
    assert back._lineage is z._lineage
    out = back.reshape(B, N, N, 2, D // 2)  # z's sizes apply to the unfolded batch
    assert_close_samples(out, [2 * s.detach().view(s.shape[0], s.shape[1], 2, D // 2) for s in zs])


def test_sizes_of_a_freed_parent_apply_while_its_fold_lives():
    z, zs = _pairs([3, 1])
    B, N = z.shape[:2]
    zf = z.reshape(B * N, N, D)
    del z
    gc.collect()
    v = zf.view(B * N, N, 2, D // 2)
    assert_close_samples(v, [r.detach().view(s.shape[1], 2, D // 2) for s in zs for r in s.unbind(0)])


# ---------------------------------------------------------------------------- sizes that stay refused


def test_sizes_of_another_batch_on_a_folded_batch_are_refused():
    z, _ = _pairs([3, 0, 2, 1])
    other, _ = _pairs([3, 0, 2, 1], seed=1)  # as many samples, the very same sizes
    B, N = z.shape[:2]
    zf = z.reshape(B * N, N, D)
    with pytest.raises(padless.StructureError, match=r"view\(\): shape\[1\] = 3 was read from the shape of another batch "
                                                     r"of 4 samples, not from the one this input of 6 samples was folded from"):
        zf.view(B * N, other.shape[1], 2, D // 2)
    gone, _ = _pairs([3, 0, 2, 1], seed=2)
    n_gone = gone.shape[1]
    del gone
    gc.collect()
    with pytest.raises(padless.StructureError, match=r"a batch that no longer exists .*not from the one this input"):
        zf.view(B * N, n_gone, 2, D // 2)
    with pytest.raises(padless.StructureError, match=r"interpolate\(\): size\[0\] = 3 was read from the shape of another batch"):
        F.interpolate(zf.permute(0, 2, 1), size=other.shape[1])


def test_unfold_by_sizes_of_another_batch_is_refused():
    z1, _ = _pairs([2, 0, 0])
    z2, _ = _pairs([0, 2, 0])  # its sizes regroup z1's fold too, into the wrong sample
    f1 = z1.reshape(3 * 2, 2, D)
    with pytest.raises(padless.StructureError, match=r"reshape\(\): shape\[1\] = 2 was read from the shape of another batch "
                                                     r"of 3 samples.*that was folded \(N = z.shape\[1\]"):
        f1.reshape(3, z2.shape[1], 2, D)
    assert f1.reshape(3, z1.shape[1], 2, D).sizes().tolist() == [[2, 2, D], [0, 0, D], [0, 0, D]]


def test_sizes_of_a_folded_batch_on_its_parent_are_refused():
    z, _ = _pairs([3, 0, 2, 1])
    zf = z.reshape(z.shape[0] * z.shape[1], z.shape[1], D)
    with pytest.raises(padless.StructureError, match=r"shape\[1\] = 3 was read from the shape of a batch of 6 samples, and this input has 4"):
        z.reshape(4, zf.shape[1], zf.shape[1], D)


def test_repeats_and_expand_by_sizes_of_another_batch_of_as_many_samples_are_refused():
    x, _ = leaves([(2, D), (0, D), (3, D)], dtype=torch.float64)
    other = padless.from_list([torch.zeros(k) for k in (1, 0, 2)])
    with pytest.raises(padless.StructureError, match=r"repeat_interleave\(\): repeats = 2 was read from the shape of another batch of 3"):
        x.repeat_interleave(other.shape[1], dim=0)
    with pytest.raises(padless.StructureError, match=r"expand\(\): size\[2\] = 2 was read from the shape of another batch of 3"):
        x.unsqueeze(2).expand(3, x.shape[1], other.shape[1], D)


# ---------------------------------------------------------------------------- B * N read from the shape


def _fold_rows_softmax(z):
    B, N, M = z.shape[0], z.shape[1], z.shape[2]
    return z.reshape(B * N, M, D).softmax(1).reshape(B, N, M, D)  # '(b i) j d', over j, back


@pytest.mark.parametrize("ns", [[2, 2], [1, 0], [0, 1, 0], [1], [3, 0, 2, 1]],
                         ids=["equal_sizes", "envelope_1_empty", "empty_around", "one_sample_length_1", "mixed"])
def test_fold_written_as_b_times_n_read_from_the_shape(ns):
    """``z.reshape(B * N, M, d)`` with ``N = z.shape[1]`` is the fold also where a per-sample reading
    of ``B * N`` would fit (samples all of one size, an envelope of 1 with an empty sample), and the
    unfold brings back every sample, empty ones included."""
    folds._REGISTRY.clear()
    out = check_samples(_fold_rows_softmax, lambda s: _fold_rows_softmax(s[None])[0], [_pairs(ns)])
    assert out.sizes().tolist() == [[n, n, D] for n in ns]
    z, _ = _pairs(ns)
    B, N, M = z.shape[0], z.shape[1], z.shape[2]
    assert z.reshape(B * N, M, D).batch_size == sum(ns)


def test_fold_by_b_times_n_is_not_read_as_a_recent_fold_of_another_batch():
    """A recent fold of another batch whose folded samples had this batch's sizes (2 samples of 2
    rows) does not make ``B * N`` of this batch "the folded batch" (the lookup by content is for
    batches that went through a pair product, never for a size read from the batch itself)."""
    other, _ = _pairs([2, 0], seed=5)
    folded = other.reshape(other.shape[0] * other.shape[1], other.shape[2], D)  # 2 samples (2, D): remembered
    assert folded.sizes().tolist() == [[2, D], [2, D]]
    out = check_samples(_fold_rows_softmax, lambda s: _fold_rows_softmax(s[None])[0], [_pairs([2, 2])])
    assert out.sizes().tolist() == [[2, 2, D], [2, 2, D]]


# ---------------------------------------------------------------------------- empty parent samples


def _rect(shapes, seed=0):
    return leaves([(n, m, D) for n, m in shapes], seed=seed, ragged=(0, 1), dtype=torch.float64)


RECT = [(2, 3), (0, 3), (3, 5), (0, 2)]


@pytest.mark.parametrize("how", ["unflatten", "view"])
def test_an_empty_parent_sample_unfolds_with_its_own_extents(how):
    """A parent sample of N_b = 0 gives no samples to the fold, so nothing in the folded batch holds
    its M_b: the fold's link keeps it, and the unfold gives it (0, M_b, d), not (0, 0, d)."""
    nt, dense = _rect(RECT)
    lin = nn.Linear(D, 5).double()
    B, N = nt.shape[0], nt.shape[1]

    def fn(z):
        y = lin(z.flatten(0, 1))
        return y.unflatten(0, (B, N)) if how == "unflatten" else y.view(B, N, y.shape[1], 5)

    out = check_samples(fn, lambda x: lin(x), [(nt, dense)])
    assert [tuple(t.shape) for t in out.unbind()] == [(2, 3, 5), (0, 3, 5), (3, 5, 5), (0, 2, 5)]


def test_an_empty_parent_sample_whose_extents_an_op_changed_is_refused():
    """Scores ``q @ k^T`` of the folded rows: the ragged dims changed since the fold, so an empty
    parent sample's extents are not known from the link: refused, and the rewrite (sizes read from
    the parent's shape) gives every sample its own."""
    nt, dense = _rect(RECT)
    B, N, M = nt.shape[0], nt.shape[1], nt.shape[2]
    f = nt.flatten(0, 1)
    with pytest.raises(padless.StructureError, match=r"parent sample 1 gave no samples to the fold.*M = z.shape\[2\]"):
        (f @ f.transpose(-1, -2)).unflatten(0, (B, N))
    check_samples(lambda z: (lambda f: (f @ f.transpose(-1, -2)).reshape(B, N, M, M))(z.flatten(0, 1)),
                  lambda x: x @ x.transpose(-1, -2), [(nt, dense)])


def test_an_empty_parent_sample_when_the_fold_has_as_many_samples_as_the_parent():
    """Pairs (2, 2), (1, 1), (0, 0): the folded batch has 3 samples, as its parent, and its own
    sizes (2, 2, 1) along j are not the parent's: the empty sample unfolds to (0, 0, d), not (0, 1, d)."""
    nt, dense = _pairs([2, 1, 0])
    B, N = nt.shape[0], nt.shape[1]

    def fn(z):
        f = z.flatten(0, 1)
        return (f - f.mean(1, keepdim=True)).unflatten(0, (B, N))

    out = check_samples(fn, lambda x: x - x.mean(1, keepdim=True), [(nt, dense)])
    assert [tuple(t.shape) for t in out.unbind()] == [(2, 2, D), (1, 1, D), (0, 0, D)]
