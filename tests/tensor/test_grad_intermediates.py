"""Gradients with respect to an intermediate NestedTensor (padless.tensor.grad_rows): the row-wise
ops that consume it read its rows directly, and every way of asking for its gradient
(``torch.autograd.grad``, ``backward(inputs=)``, ``retain_grad``, ``register_hook``) still
answers, sample by sample equal to the dense computation on each sample alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.nested import nested_tensor_from_jagged

LENGTHS = [3, 0, 4, 1]
F64 = torch.float64


def _rows(seed=0, c=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, c, generator=g, dtype=F64) for n in LENGTHS]


def _offsets(lengths=LENGTHS):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


torch.manual_seed(0)
_LIN = torch.nn.Linear(3, 3).double()
_W = torch.randn(3, dtype=F64)

UNARY = {
    "cos": torch.cos,
    "times_two": lambda y: y * 2,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "pow": lambda y: y.pow(3),
    "linear": _LIN,
    "layer_norm": lambda y: F.layer_norm(y, (3,)),
    "scale_static": lambda y: y * _W,
}
BINARY = {  # op(y, x): y the intermediate, x another NestedTensor of its structure
    "add_self": lambda y, x: y + y,
    "mul": lambda y, x: y * x,
    "sub": lambda y, x: x - y,
    "maximum": torch.maximum,
    "div": lambda y, x: y / (1 + x.abs()),
    "where": lambda y, x: torch.where(x > 0, y, y * y),
}


def _ref_grad(make_y, op, leaves):
    """Per sample: the dense intermediate and its gradient of ``(op(y) ** 2).sum()``."""
    out = []
    for v in leaves:
        y = make_y(v.clone().requires_grad_())
        (g,) = torch.autograd.grad((op(y) ** 2).sum(), [y])
        out.append(g)
    return out


def _check(nt_grad, refs):
    assert isinstance(nt_grad, padless.NestedTensor)
    got = nt_grad.unbind()
    assert len(got) == len(refs)
    for a, b in zip(got, refs):
        torch.testing.assert_close(a, b)


BUILDS = {
    # an intermediate made by the constructor from values with history
    "constructor": lambda rows: nested_tensor_from_jagged(torch.cat(rows).requires_grad_(), _offsets()),
    # an intermediate made by an elementwise op on a leaf NestedTensor
    "op_on_leaf": lambda rows: padless.from_list(rows).requires_grad_() * 2,
    # an intermediate made by a linear layer
    "linear": lambda rows: _LIN(padless.from_list(rows).requires_grad_()),
}
DENSE_BUILDS = {"constructor": lambda v: v * 1, "op_on_leaf": lambda v: v * 2, "linear": _LIN}


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("name", sorted(UNARY))
def test_autograd_grad_of_an_intermediate_unary(name, build):
    rows = _rows()
    y = BUILDS[build](rows)
    (g,) = torch.autograd.grad((UNARY[name](y) ** 2).sum(), [y])
    # the dense intermediate is op(leaf); its gradient is what flows into it
    _check(g, _ref_grad(DENSE_BUILDS[build], UNARY[name], rows))


@pytest.mark.parametrize("name", sorted(BINARY))
def test_autograd_grad_of_an_intermediate_binary(name):
    rows, others = _rows(0), _rows(1)
    x = padless.from_list(others)
    y = padless.from_list(rows).requires_grad_() * 2
    (g,) = torch.autograd.grad((BINARY[name](y, x) ** 2).sum(), y)
    refs = [_ref_grad(lambda v: v * 2, lambda t, o=o: BINARY[name](t, o), [r])[0] for r, o in zip(rows, others)]
    _check(g, refs)


def test_grad_of_several_intermediates_and_the_leaf():
    rows = _rows()
    x = padless.from_list(rows).requires_grad_()
    y = x * 2
    z = y.sigmoid()
    out = ((z * y).sum(dim=1) ** 2).sum()  # z and y read by a reduction (a handler) and a product
    gx, gy, gz = torch.autograd.grad(out, [x, y, z])
    for i, r in enumerate(rows):
        xd = r.clone().requires_grad_()
        yd = xd * 2
        zd = yd.sigmoid()
        refs = torch.autograd.grad(((zd * yd).sum(0) ** 2).sum(), [xd, yd, zd])
        for got, want in zip((gx, gy, gz), refs):
            torch.testing.assert_close(got.unbind()[i], want)


CONSTRUCTORS = {
    "from_jagged": lambda v: nested_tensor_from_jagged(v, _offsets()),
    "from_values": lambda v: padless.from_values(v, lengths=torch.tensor(LENGTHS)),
    "from_list": lambda v: padless.from_list(list(v.split(LENGTHS)), keep_history=True),
}


@pytest.mark.parametrize("values", ["leaf", "with_history"])
@pytest.mark.parametrize("make", sorted(CONSTRUCTORS))
def test_constructor_values_used_elsewhere_do_not_leak_into_the_gradient(make, values):
    """The values given to the constructor are the caller's: their other uses are not uses of
    the NestedTensor, so they are not part of its gradient."""
    w = torch.cat(_rows()).requires_grad_()
    v = w if values == "leaf" else w * 1
    nt = CONSTRUCTORS[make](v)
    out = nt.cos().sum() + 3 * v.sum()
    (g,) = torch.autograd.grad(out, [nt])
    _check(g, [-r.sin() for r in _rows()])


def test_rows_handed_back_unchanged_belong_to_the_new_tensor_only():
    """A handler that hands its input's rows back unchanged (``rewrap(values_of(y), y)``): the
    gradient of the result is its own consumers', the gradient of ``y`` includes the result's."""
    from padless.tensor.autograd import rewrap, values_of

    rows = _rows()
    y = padless.from_list(rows).requires_grad_() * 2
    z = rewrap(values_of(y), y)
    out = z.cos().sum() + y.exp().sum()
    gz, gy = torch.autograd.grad(out, [z, y])
    _check(gz, [-(2 * r).sin() for r in rows])
    _check(gy, [(2 * r).exp() - (2 * r).sin() for r in rows])


def test_written_in_place_then_the_current_version_is_differentiated():
    rows = _rows()
    y = padless.from_list(rows).requires_grad_() * 2
    early = y.cos()  # read before the write: not a use of y's new version
    y.mul_(3)
    out = (y.sin() ** 2).sum() + early.sum()
    (g,) = torch.autograd.grad(out, [y])
    _check(g, [2 * (6 * r).sin() * (6 * r).cos() for r in rows])


def test_create_graph_double_backward():
    rows = _rows()
    x = padless.from_list(rows).requires_grad_()
    y = x * 2
    (g,) = torch.autograd.grad((y ** 3).sum(), [y], create_graph=True)
    (g * g).sum().backward()
    for i, r in enumerate(rows):
        xd = r.clone().requires_grad_()
        yd = xd * 2
        (gd,) = torch.autograd.grad((yd ** 3).sum(), [yd], create_graph=True)
        (gd * gd).sum().backward()
        torch.testing.assert_close(g.unbind()[i], gd)
        torch.testing.assert_close(x.grad.unbind()[i], xd.grad)


def test_unused_intermediate():
    x = padless.from_list(_rows()).requires_grad_()
    y = x * 2
    out = (x * 3).sum()
    assert torch.autograd.grad(out, [y], allow_unused=True, retain_graph=True) == (None,)
    (g,) = torch.autograd.grad(out, [y], allow_unused=True, materialize_grads=True)
    _check(g, [torch.zeros_like(r) for r in _rows()])


@pytest.mark.parametrize("when", ["before_use", "after_use"])
def test_retain_grad(when):
    rows = _rows()
    x = padless.from_list(rows).requires_grad_()
    y = x * 2
    if when == "before_use":
        y.retain_grad()
    z = y.cos() * y
    if when == "after_use":
        y.retain_grad()
    assert y.retains_grad
    (z ** 2).sum().backward()
    refs = _ref_grad(lambda v: v * 2, lambda t: t.cos() * t, rows)
    _check(y.grad, refs)


def test_retain_grad_accumulates_over_two_backwards():
    rows = _rows()
    y = padless.from_list(rows).requires_grad_() * 2
    y.retain_grad()
    y.cos().sum().backward(retain_graph=True)
    y.sin().sum().backward()
    _check(y.grad, [-(2 * r).sin() + (2 * r).cos() for r in rows])


@pytest.mark.parametrize("when", ["before_use", "after_use"])
def test_register_hook_sees_and_replaces_the_gradient(when):
    rows = _rows()
    x = padless.from_list(rows).requires_grad_()
    y = x * 2
    seen = []

    def hook(g):
        seen.append(g)
        return g * 10

    if when == "before_use":
        y.register_hook(hook)
    out = y.cos().sum()
    if when == "after_use":
        y.register_hook(hook)
    out.backward()
    (g,) = seen
    _check(g, [-(2 * r).sin() for r in rows])
    _check(x.grad, [-20 * (2 * r).sin() for r in rows])


def test_backward_inputs_fills_the_intermediate_grad():
    rows = _rows()
    x = padless.from_list(rows).requires_grad_()
    y = x * 2
    y.cos().sum().backward(inputs=[y])
    assert x.grad is None
    _check(y.grad, [-(2 * r).sin() for r in rows])


def test_one_sample_batch():
    r = torch.randn(5, 3, dtype=F64)
    y = padless.from_list([r]).requires_grad_() * 2
    (g,) = torch.autograd.grad(y.tanh().sum(), [y])
    _check(g, [1 - (2 * r).tanh() ** 2])


def test_gradient_of_an_intermediate_read_through_a_position():
    """``x[:, -1]`` of an intermediate is a dense view: ``autograd.grad(view, [h])`` still reaches
    ``h`` (found by the fuzzer's long run: the view answered the call without NestedTensor)."""
    torch.manual_seed(0)
    xs = [torch.randn(1, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)]
    lin = torch.nn.Linear(2, 3).double()
    x = padless.from_list(xs, requires_grad=True)
    h = lin(x.tanh())
    y = h[:, -1]
    cot = torch.randn(2, 3, dtype=torch.float64)
    gx, gh = torch.autograd.grad(y, [x, h], cot)
    for i, xi in enumerate(xs):
        xi = xi.clone().requires_grad_()
        hi = lin(xi.tanh())
        want_x, want_h = torch.autograd.grad(hi[-1], [xi, hi], cot[i])
        torch.testing.assert_close(gh.unbind()[i], want_h)
        torch.testing.assert_close(gx.unbind()[i], want_x)


@pytest.mark.parametrize("lengths", [[1, 5], [3]])
def test_backward_inputs_through_a_position(lengths):
    """``y[:, -1].backward(cot, inputs=[x, h])``: the dense view's ``Tensor.backward`` reaches the
    NestedTensors among ``inputs`` (it ran below them and left ``h.grad`` empty; found by the
    fuzzer once its gradients were also accumulated)."""
    torch.manual_seed(0)
    xs = [torch.randn(n, 2, dtype=torch.float64) for n in lengths]
    lin = torch.nn.Linear(2, 3).double()
    x = padless.from_list(xs, requires_grad=True)
    h = lin(x.tanh())
    cot = torch.randn(len(xs), 3, dtype=torch.float64)
    h[:, -1].backward(cot, inputs=[x, h])
    for i, xi in enumerate(xs):
        xi = xi.clone().requires_grad_()
        hi = lin(xi.tanh())
        want_x, want_h = torch.autograd.grad(hi[-1], [xi, hi], cot[i])
        torch.testing.assert_close(h.grad.unbind()[i], want_h)
        torch.testing.assert_close(x.grad.unbind()[i], want_x)
