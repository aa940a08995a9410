"""Elementwise ops with a gradient on the packed rows (padless.tensor.fast_grad) and the rows a
NestedTensor remembers from the op that built it (tensor.autograd._keep_rows): gradients
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
