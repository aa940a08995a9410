"""A leaf NestedTensor's rows are the autograd leaf of row-wise ops (padless.tensor.leaf_rows):
``x.grad`` is the sum of what its rows gathered and what consumers on the general path (ATen
handlers) accumulated on ``x`` itself, and every way of asking for it agrees with the dense ops
on each sample alone."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.tensor.core import values_of

LENGTHS = [3, 0, 5, 1]


def _leaf(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in lengths]
    return xs, padless.from_list([x.clone() for x in xs], requires_grad=True)


def _lin():
    torch.manual_seed(1)
    return torch.nn.Linear(4, 4).double()


def _mixed(t, lin):
    """A row-wise read (linear) and a general-path read (a pair broadcast, then a reduction)."""
    if isinstance(t, padless.NestedTensor):
        return lin(t).values().pow(2).sum() + (t.unsqueeze(2) * t.unsqueeze(1)).sum()
    return lin(t).pow(2).sum() + (t.unsqueeze(1) * t.unsqueeze(0)).sum()


def _dense_grads(xs, loss_fn):
    leaves = [a.clone().requires_grad_() for a in xs]
    sum(loss_fn(a) for a in leaves).backward()
    return torch.cat([a.grad for a in leaves])


@pytest.mark.parametrize("lengths", [LENGTHS, [4], [0, 2]])
def test_grad_sums_rows_and_general_path(lengths):
    xs, x = _leaf(lengths)
    lin = _lin()
    _mixed(x, lin).backward()
    want = _dense_grads(xs, lambda a: _mixed(a, lin))
    torch.testing.assert_close(x.grad.values(), want)
    g = x.grad
    _mixed(x, lin).backward()  # accumulates into the same gradient, as torch does
    assert x.grad is g
    torch.testing.assert_close(x.grad.values(), 2 * want)


def test_grad_set_none_forgets_the_rows():
    xs, x = _leaf()
    lin = _lin()
    lin(x).values().sum().backward()
    x.grad = None  # never read: what the rows gathered must not come back
    assert x.grad is None
    lin(x).values().pow(2).sum().backward()
    torch.testing.assert_close(x.grad.values(), _dense_grads(xs, lambda a: lin(a).pow(2).sum()))


def test_autograd_grad_and_backward_inputs():
    xs, x = _leaf()
    lin = _lin()
    want = _dense_grads(xs, lambda a: _mixed(a, lin))
    (g,) = torch.autograd.grad(_mixed(x, lin), [x])
    torch.testing.assert_close(g.values(), want)
    _mixed(x, lin).backward(inputs=[x])
    torch.testing.assert_close(x.grad.values(), want)
    # unused: torch's rule and message, then allow_unused and materialize_grads
    _, other = _leaf(seed=2)
    lin(other)  # its rows were read, but not by this loss
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(_mixed(x, lin), [x, other])
    gx, go = torch.autograd.grad(_mixed(x, lin), [x, other], allow_unused=True)
    assert go is None
    torch.testing.assert_close(gx.values(), want)
    _, go = torch.autograd.grad(_mixed(x, lin), [x, other], materialize_grads=True)
    assert torch.equal(go.values(), torch.zeros_like(other._values))


def test_hook_registered_after_the_read():
    xs, x = _leaf()
    lin = _lin()
    seen = []
    loss = lin(x).values().pow(2).sum()  # the rows were read before the hook
    x.register_hook(lambda g: seen.append(g) or g * 2)
    loss.backward()
    want = _dense_grads(xs, lambda a: lin(a).pow(2).sum())
    assert len(seen) == 1 and isinstance(seen[0], padless.NestedTensor)
    torch.testing.assert_close(seen[0].values(), want)
    torch.testing.assert_close(x.grad.values(), 2 * want)


def test_double_backward():
    xs, x = _leaf()
    (g,) = torch.autograd.grad(x.pow(3).values().sum(), [x], create_graph=True)
    g.values().sum().backward()
    leaves = [a.clone().requires_grad_() for a in xs]
    for a in leaves:
        (ga,) = torch.autograd.grad(a.pow(3).sum(), [a], create_graph=True)
        ga.sum().backward()
    torch.testing.assert_close(x.grad.values(), torch.cat([a.grad for a in leaves]))


def test_optimizer_step_and_values_view():
    xs, x = _leaf()
    lin = _lin()
    opt = torch.optim.SGD([x], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        lin(x).values().pow(2).sum().backward()
        opt.step()
    ref = torch.cat(xs).clone().requires_grad_()
    opt_ref = torch.optim.SGD([ref], lr=0.5)
    for _ in range(2):
        opt_ref.zero_grad()
        lin(ref).pow(2).sum().backward()
        opt_ref.step()
    torch.testing.assert_close(x._values, ref.detach())
    v = x.values()  # handed out as a view of the rows: not a leaf, as before
    assert not v.is_leaf and v.requires_grad and values_of(x).is_leaf
    assert x.is_leaf and x.grad_fn is None
