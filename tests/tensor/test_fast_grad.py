"""Elementwise ops with a gradient on the packed rows (padless.tensor.fast_grad) and the rows a
NestedTensor remembers from the op that built it (tensor.autograd._with_history): gradients
against the dense computation on each sample, including the cases that must not take the
shortcut (an in-place write in between, a retained gradient, a hook)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless

LENGTHS = [3, 0, 5, 1]


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in LENGTHS]
    return xs, padless.from_list([x.clone() for x in xs]).requires_grad_()


def _grads(fn, seed=0):
    xs, x = _leaves(seed)
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 4).double()
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = fn(x, lin, w)
    out.values().pow(2).sum().backward()
    got = (x.grad.values().clone(), w.grad.clone(), lin.weight.grad.clone())
    w.grad = None
    lin.zero_grad()
    leaves = [a.clone().requires_grad_() for a in xs]
    sum(fn(a, lin, w).pow(2).sum() for a in leaves).backward()
    want = (torch.cat([a.grad for a in leaves]), w.grad, lin.weight.grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_chain_of_row_ops():
    _grads(lambda x, lin, w: F.layer_norm(torch.tanh(F.gelu(lin(x)) * w + x) * 2 - x, (4,)))


def test_inplace_write_between_ops_is_seen():
    def fn(x, lin, w):
        y = lin(x)
        y.mul_(w)  # an in-place write after y was built from its rows
        return y * 3 + x

    _grads(fn)


def test_retained_gradient_and_hook_of_an_intermediate():
    xs, x = _leaves()
    lin = torch.nn.Linear(4, 4).double()
    y = lin(x)
    y.retain_grad()
    seen = []
    z = F.gelu(y) * 2
    z.register_hook(lambda g: seen.append(g))
    (z.values().sum() + (y * y).values().sum()).backward()
    ys = [lin(a) for a in xs]
    want = [torch.autograd.functional.vjp(lambda t: F.gelu(t) * 2, t, torch.ones_like(t))[1] + 2 * t for t in ys]
    torch.testing.assert_close(y.grad.values(), torch.cat(want).detach())
    assert len(seen) == 1 and isinstance(seen[0], padless.NestedTensor)


def test_dense_operand_over_ragged_dims_takes_the_general_path():
    xs, x = _leaves()
    dense = torch.randn(4, 5, 4, dtype=torch.float64, requires_grad=True)  # padded coordinates
    out = x * dense
    out.values().sum().backward()
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(dense.grad[i, :n], xs[i])
        assert dense.grad[i, n:].abs().sum() == 0


@pytest.mark.parametrize("op", [torch.sigmoid, torch.exp, torch.tanh])
def test_saved_output_then_inplace_raises_like_dense(op):
    """these ops save their output; writing it in place breaks their backward, as in dense code"""
    _, x = _leaves()
    y = op(x * 1.0)
    z = y * 2
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.values().sum().backward()


def test_rows_with_static_broadcast_rms_norm():
    """Llama's RMSNorm: ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``: two NestedTensors
    on the same rows whose static extents broadcast (C against 1)."""
    _grads(lambda x, lin, w: w * (x * torch.rsqrt(lin(x).pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_heads_before_the_ragged_dim_rotary():
    """Llama's rotary on ``(H, L_i, D)`` (heads before the ragged dim): ``q * cos`` with a
    dense ``(D,)`` operand and ``cat`` of halves; a dense ``(H, D)`` operand would reach the
    ragged dim and must not broadcast on the values' ``(T, H, D)``."""

    def rot(x, lin, w):
        q = lin(x).unflatten(-1, (2, 2)).transpose(0, 1) if x.dim() == 2 else lin(x).unflatten(-1, (2, 2)).transpose(1, 2)
        half = torch.cat((-q[..., 1:], q[..., :1]), dim=-1)
        return (q * w[:2] + half * w[2:]).transpose(-3, -2).flatten(-2)

    _grads(rot)
    xs, x = _leaves()
    q = x.unflatten(-1, (2, 2)).transpose(1, 2)  # (2, L_i, 2)
    with pytest.raises(padless.StructureError):
        q * torch.ones(2, 2, dtype=torch.float64)  # (H, D) against (H, L_i, D): L_i is ragged


def _heads(seed=0):
    """(2, L_i, 2) queries (heads before the ragged dim) as leaves, and their samples."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, n, 2, generator=g, dtype=torch.float64) for n in LENGTHS]
    return xs, padless.from_list([x.clone() for x in xs], ragged_dims=(1,)).requires_grad_()


@pytest.mark.parametrize("table_grad", [False, True])
def test_rotary_table_in_padded_coordinates_runs_on_the_rows(table_grad):
    """Llama's rotary with ``inputs_embeds=nt``: ``cos``/``sin`` are ``(1, 1, L_max, D)`` tables
    built from the envelope (padded coordinates, shared by the batch). They are read onto the
    rows (one cached gather) and the op is plain autograd on the rows: no NestedTensor-level
    backward node, values and gradients equal to each sample's dense computation."""
    xs, q = _heads()
    lmax = max(LENGTHS)
    g = torch.Generator().manual_seed(3)
    cos = torch.randn(1, 1, lmax, 2, generator=g, dtype=torch.float64).requires_grad_(table_grad)
    sin = torch.randn(1, 1, lmax, 2, generator=g, dtype=torch.float64).requires_grad_(table_grad)

    def rot(t, c, s):
        half = torch.cat((-t[..., 1:], t[..., :1]), dim=-1)
        return t * c + half * s

    out = rot(q, cos, sin)
    assert isinstance(out, padless.NestedTensor)
    assert type((q * cos).grad_fn).__name__ != "MulBackward0"  # the rows' autograd, not ATen on NestedTensors
    out.values().pow(2).sum().backward()
    leaves = [a.clone().requires_grad_() for a in xs]
    cos2 = cos.detach().clone().requires_grad_(table_grad)
    sin2 = sin.detach().clone().requires_grad_(table_grad)
    refs = [rot(a[None], cos2[:, :, : a.shape[1]], sin2[:, :, : a.shape[1]])[0] for a in leaves]
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(out.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for got, a in zip(q.grad.unbind(), leaves):
        torch.testing.assert_close(got, a.grad)
    if table_grad:
        torch.testing.assert_close(cos.grad, cos2.grad)
        torch.testing.assert_close(sin.grad, sin2.grad)


def test_per_sample_position_table_and_static_broadcast_on_the_rows():
    """BERT-style ``inputs_embeds + position_embeddings`` with a ``(B, L_max, C)`` dense table
    (per sample) and a ``(1, 2, 1, 1)`` per-head scale (extent 1 on the ragged dim, shared):
    both ride the rows' autograd, gradients equal to the dense computation on each sample."""
    xs, q = _heads(1)
    lmax = max(LENGTHS)
    g = torch.Generator().manual_seed(4)
    table = torch.randn(len(LENGTHS), 1, lmax, 2, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(1, 2, 1, 1, generator=g, dtype=torch.float64, requires_grad=True)
    out = (q + table) * scale
    assert type(out.grad_fn).__name__ != "MulBackward0"
    out.values().pow(2).sum().backward()
    table2, scale2 = table.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    leaves = [a.clone().requires_grad_() for a in xs]
    refs = [((a + table2[i, :, : a.shape[1]]) * scale2[0]) for i, a in enumerate(leaves)]
    sum(r.pow(2).sum() for r in refs).backward()
    for got, want in zip(out.unbind(), refs):
        torch.testing.assert_close(got, want.detach())
    for got, a in zip(q.grad.unbind(), leaves):
        torch.testing.assert_close(got, a.grad)
    torch.testing.assert_close(table.grad, table2.grad)  # zeros at padded positions
    torch.testing.assert_close(scale.grad, scale2.grad)


def test_padded_table_refused_in_strict_mode_and_wrong_extent_named():
    _, q = _heads()
    with padless.strict_padded_reads(), pytest.raises(padless.StructureError, match="strict padded reads"):
        q * torch.ones(1, 1, max(LENGTHS), 2, dtype=torch.float64)
    with pytest.raises(padless.StructureError, match="spans ragged dim 2"):
        q * torch.ones(1, 1, max(LENGTHS) + 1, 2, dtype=torch.float64)
