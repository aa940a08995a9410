"""Dense operands in padded coordinates (padless.ops.common.padded): every element reads the
entry at its own coordinates; the gradient scatters back, zeros at padded positions.

The reference runs the dense op on each sample alone with that sample's window of the dense
operand (``d[i, :L_i]``), forward and backward, gradients of both operands compared."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.common import padded

SEQ = [(3, 4), (0, 4), (5, 4), (1, 4)]
ONE = [(4, 4)]
IMG = [(3, 4, 6), (3, 2, 2), (3, 5, 1)]
PAIR = [(3, 3, 2), (0, 0, 2), (4, 4, 2)]


def _samples(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _window(d: torch.Tensor, i: int, size: list[int], env: list[int], ragged) -> torch.Tensor:
    """Sample i's view of a dense operand in padded coordinates."""
    nd = 1 + len(env)
    a = d.reshape((1,) * (nd - d.dim()) + tuple(d.shape))
    t = a[i if a.shape[0] != 1 else 0]
    idx = [slice(None)] * len(env)
    for j in ragged:
        if t.shape[j] == env[j] and env[j] != 1:
            idx[j] = slice(0, size[j])
    return t[tuple(idx)]


def _check(fn, shapes, d, ragged=(0,), loss=lambda o: (o * o).sum()):
    """fn(nt, d) against fn(sample, window) per sample: values, NT gradient, dense gradient."""
    samples = _samples(shapes)
    nt = padless.from_list([s.clone() for s in samples], ragged_dims=ragged).requires_grad_()
    dn = d.detach().clone().requires_grad_(d.is_floating_point())
    out = fn(nt, dn)
    env = list(nt.shape[1:])
    dr = d.detach().clone().requires_grad_(d.is_floating_point())
    total = 0
    refs, sgrads = [], []
    for i, s in enumerate(samples):
        si = s.clone().requires_grad_()
        o = fn(si, _window(dr, i, list(s.shape), env, ragged))
        refs.append(o)
        total = total + loss(o)
        sgrads.append(si)
    for got, ref in zip(out.unbind(), refs):
        torch.testing.assert_close(got, ref.detach())
    sum(loss(o) for o in out.unbind()).backward()
    total.backward()
    for g, si in zip(nt.grad.unbind(), sgrads):
        torch.testing.assert_close(g, si.grad)
    if dn.requires_grad:
        torch.testing.assert_close(dn.grad, dr.grad)
        return dn.grad
    return None


@pytest.mark.parametrize("shapes", [SEQ, ONE], ids=["seq", "one_sample"])
@pytest.mark.parametrize("dshape", ["BLC", "1LC", "LC", "BL1", "L1"])
@pytest.mark.parametrize("op", ["add", "mul", "sub_r"])
def test_binary_ops_read_padded_coordinates(shapes, dshape, op):
    b, lmax = len(shapes), max(s[0] for s in shapes)
    dims = {"B": b, "L": lmax, "C": 4, "1": 1}
    d = torch.randn(*[dims[c] for c in dshape], dtype=torch.float64)
    fn = {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "sub_r": lambda x, y: y - x}[op]
    grad = _check(fn, shapes, d)
    if dshape.startswith("B"):  # zeros at padded positions
        lens = [s[0] for s in shapes]
        for i, n in enumerate(lens):
            assert torch.count_nonzero(grad[i, n:]) == 0


def test_no_grad_and_dense_without_grad():
    samples = _samples(SEQ)
    nt = padless.from_list(samples)
    d = torch.randn(nt.shape, dtype=torch.float64)
    with torch.no_grad():
        out = nt * d
    for got, s, di in zip(out.unbind(), samples, d):
        torch.testing.assert_close(got, s * di[: s.shape[0]])


def test_where_and_masked_fill_with_padded_masks():
    lens = [s[0] for s in SEQ]
    keep = torch.rand(len(SEQ), max(lens), 1) > 0.5
    _check(lambda x, m: torch.where(m, x, torch.zeros(())), SEQ, keep)
    _check(lambda x, m: x.masked_fill(m, 0.0), SEQ, keep)
    other = torch.randn(len(SEQ), max(lens), 4, dtype=torch.float64)
    _check(lambda x, o: torch.where(x > 0, x, o), SEQ, other)


def test_inplace_reads_padded_coordinates():
    samples = _samples(SEQ)
    nt = padless.from_list(samples)
    d = torch.randn(nt.shape, dtype=torch.float64)
    out = nt.clone()
    out += d
    for got, s, di in zip(out.unbind(), samples, d):
        torch.testing.assert_close(got, s + di[: s.shape[0]])
    x = padless.from_list(samples).requires_grad_()
    y = x * 1
    with pytest.raises(ValueError, match=r"add_\(\): a dense operand of the envelope shape \(4, 5, 4\) that requires grad;.*out of place"):
        y.add_(d.clone().requires_grad_())


def test_position_embedding_from_envelope():
    """``x + pos(arange(x.shape[1]))``: the embedding's gradient reaches only real positions."""
    samples = _samples(SEQ)
    emb = torch.nn.Embedding(8, 4).double()
    x = padless.from_list(samples)
    out = x + emb(torch.arange(x.shape[1]))
    out.values().sum().backward()
    lens = torch.tensor([s.shape[0] for s in samples])
    expect = torch.zeros(8, 4, dtype=torch.float64)
    for p in range(x.shape[1]):
        expect[p] = (lens > p).sum()
    torch.testing.assert_close(emb.weight.grad, expect)
    for got, s in zip(out.unbind(), samples):
        torch.testing.assert_close(got, s + emb.weight[: s.shape[0]])


@pytest.mark.parametrize("dshape", ["B1HW", "11HW", "HW"])
def test_image_maps(dshape):
    b, h, w = len(IMG), max(s[1] for s in IMG), max(s[2] for s in IMG)
    dims = {"B": b, "1": 1, "H": h, "W": w}
    d = torch.randn(*[dims[c] for c in dshape], dtype=torch.float64)
    _check(lambda x, y: x * y, IMG, d, ragged=(1, 2))


def test_pair_masks_and_biases():
    b, n = len(PAIR), max(s[0] for s in PAIR)
    _check(lambda x, y: x + y, PAIR, torch.randn(b, n, n, 1, dtype=torch.float64), ragged=(0, 1))
    scores = [(s[0], s[1]) for s in PAIR]
    _check(lambda x, y: x + y, scores, torch.randn(b, n, n, dtype=torch.float64), ragged=(0, 1))
    m = torch.rand(b, n, n) > 0.3
    _check(lambda x, y: x.masked_fill(y, -1.0), scores, m, ragged=(0, 1))


def test_backward_zeros_of_envelope_shape_still_read():
    """The zeros autograd hands a custom Function's unused output (envelope shape)."""

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 * 2 + g2 * 3

    samples = _samples(SEQ)
    x = padless.from_list(samples).requires_grad_()
    Two.apply(x)[0].values().sum().backward()
    for g, s in zip(x.grad.unbind(), samples):
        torch.testing.assert_close(g, torch.full_like(s, 2.0))


def _sdpa_ref(q, mask, lens, heads):
    out, grads = [], []
    for i, n in enumerate(lens):
        qi = q[i].clone().requires_grad_()
        mi = mask[i if mask.shape[0] != 1 else 0][..., :n, :n] if mask.shape[-1] != 1 else mask[i][..., :n]
        o = F.scaled_dot_product_attention(qi[None], qi[None], qi[None], attn_mask=mi[None])[0]
        out.append(o)
        grads.append(qi)
    return out, grads


@pytest.mark.parametrize("mshape", ["B1LL", "BHLL", "1HLL", "LL"])
def test_sdpa_dense_attn_mask(mshape):
    lens, h, e = [3, 0, 5, 1], 2, 8
    qs = _samples([(h, n, e) for n in lens])
    q = padless.from_list([s.clone() for s in qs], ragged_dims=(1,)).requires_grad_()
    dims = {"B": len(lens), "1": 1, "H": h, "L": max(lens)}
    mask = torch.randn(*[dims[c] for c in mshape], dtype=torch.float64)
    mn, mr = mask.clone().requires_grad_(), mask.clone().requires_grad_()
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mn)
    (out.values() ** 2).sum().backward()
    total = 0
    for i, (s, n) in enumerate(zip(qs, lens)):
        a = mr.reshape((1,) * (4 - mr.dim()) + tuple(mr.shape))
        mi = a[i if a.shape[0] != 1 else 0][..., :n, :n]
        si = s.clone().requires_grad_()
        o = F.scaled_dot_product_attention(si, si, si, attn_mask=mi)
        torch.testing.assert_close(out.unbind()[i], o.detach())
        total = total + (o**2).sum()
        if n:
            torch.autograd.backward((o**2).sum(), inputs=[si], retain_graph=True)
            torch.testing.assert_close(q.grad.unbind()[i], si.grad)
    total.backward()
    torch.testing.assert_close(mn.grad, mr.grad)


def test_sdpa_key_padding_bool_mask():
    lens, h, e = [3, 2, 5], 2, 8
    qs = _samples([(h, n, e) for n in lens])
    q = padless.from_list(qs, ragged_dims=(1,))
    keep = torch.ones(len(lens), 1, 1, max(lens), dtype=torch.bool)
    keep[:, :, :, 0] = False
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    for i, (s, n) in enumerate(zip(qs, lens)):
        ref = F.scaled_dot_product_attention(s, s, s, attn_mask=keep[i][..., :n])
        torch.testing.assert_close(out.unbind()[i], ref)


def test_row_attention_dense_pair_bias():
    """Pair layout (N_i, H, N_i, E) with a dense pair bias (B, H, N, N) read per sample."""
    ns, h, e = [3, 0, 4], 2, 4
    zs = _samples([(n, n, h, e) for n in ns])
    z = padless.from_list([s.clone() for s in zs], ragged_dims=(0, 1)).requires_grad_()
    bias = torch.randn(len(ns), h, max(ns), max(ns), dtype=torch.float64)
    bn, br = bias.clone().requires_grad_(), bias.clone().requires_grad_()
    qt = z.transpose(2, 3)
    out = F.scaled_dot_product_attention(qt, qt, qt, attn_mask=bn[:, None])
    (out.values() ** 2).sum().backward()
    total = 0
    for i, (s, n) in enumerate(zip(zs, ns)):
        si = s.clone().requires_grad_()
        st = si.transpose(1, 2)
        o = F.scaled_dot_product_attention(st, st, st, attn_mask=br[i, :, :n, :n])
        torch.testing.assert_close(out.unbind()[i], o.detach())
        total = total + (o**2).sum()
    total.backward()
    torch.testing.assert_close(bn.grad, br.grad)


def test_static_sequence_rows_dense_mask_in_padded_coordinates():
    """Ragged batch dims, static sequence (samples (N_i, L, E)): a (B, N, L, S) mask."""
    ns, l, e = [2, 0, 3], 3, 4
    qs = _samples([(n, l, e) for n in ns])
    q = padless.from_list(qs)
    mask = torch.randn(len(ns), max(ns), l, l, dtype=torch.float64)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    for i, (s, n) in enumerate(zip(qs, ns)):
        torch.testing.assert_close(out.unbind()[i], F.scaled_dot_product_attention(s, s, s, attn_mask=mask[i, :n]))


# ---------------------------------------------------------------------------- refusals and the switch


def test_other_extents_are_refused_as_before():
    nt = padless.from_list(_samples(SEQ))
    with pytest.raises(ValueError, match=r"mul\(\): a dense operand of shape \(4, 4, 4\) spans ragged dim 1 \(size 4\)"):
        nt * torch.randn(4, 4, 4)
    with pytest.raises(ValueError, match=r"has 3 entries on the batch dim, the NestedTensor has 4 samples"):
        nt * torch.randn(3, 5, 4)
    q = padless.from_list(_samples([(2, n, 8) for n in (3, 1)]), ragged_dims=(1,))
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention\(\): a dense attn_mask of shape \(2, 1, 3, 2\) has extent 2 along dim -1"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(2, 1, 3, 2))


def test_strict_switch_context_manager():
    nt = padless.from_list(_samples(SEQ))
    d = torch.randn(nt.shape)
    msg = r"mul\(\): reads a dense operand of shape \(4, 5, 4\) in padded coordinates.*strict padded reads are on"
    with padless.strict_padded_reads():
        with pytest.raises(padless.StructureError, match=msg):
            nt * d
        with pytest.raises(padless.StructureError, match=msg):
            nt.double().requires_grad_() * d.double().requires_grad_()  # the torch-level path too
        nt * torch.randn(1, 1, 4)  # broadcasting is not a padded read
        with padless.padded_reads(strict=False):
            nt * d
    nt * d


def test_strict_switch_environment_variable(monkeypatch):
    nt = padless.from_list(_samples(SEQ))
    q = padless.from_list(_samples([(2, n, 8) for n in (3, 1)]), ragged_dims=(1,))
    monkeypatch.setenv("PADLESS_STRICT_PADDED", "1")
    with pytest.raises(padless.StructureError, match=r"add\(\): reads a dense operand of shape \(5, 4\)"):
        nt + torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(padless.StructureError, match=r"scaled_dot_product_attention\(\): reads a dense operand of shape \(2, 1, 3, 3\)"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(2, 1, 3, 3, dtype=torch.float64))
    with padless.padded_reads(strict=False):
        nt + torch.randn(5, 4, dtype=torch.float64)
    monkeypatch.setenv("PADLESS_STRICT_PADDED", "0")
    nt + torch.randn(5, 4, dtype=torch.float64)


def test_read_index_is_cached_on_the_structure():
    nt = padless.from_list(_samples(SEQ))
    a = padded.read_index(nt, True, (5,))
    assert padded.read_index(nt * 2, True, (5,)) is a
    assert a.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 15]
