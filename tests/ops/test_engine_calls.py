"""Gradients asked of padless's other tensor subclasses (padless.tensor.engine_calls): a dense
view ``h[:, -1]``, packed rows ``h.reshape(-1, C)``, a pooled map that remembers its batch
(``BatchDense``) and the sequence-first view ``h.transpose(0, 1)``. Each way of asking
(``out.backward(cot, inputs=...)``, ``torch.autograd.backward([out], [cot], inputs=...)``,
``torch.autograd.grad``) reaches a leaf NestedTensor and an intermediate one among ``inputs``,
sample by sample equal to the dense computation on each sample alone (a pooled map's
``backward(inputs=...)`` left both gradients empty; the sequence-first view refused every call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.common.seq_first import SeqFirstView
from padless.ops.rows.packed_rows import PackedRows
from padless.ops.vision.batch_dense import BatchDense
from padless.tensor.views import DenseView

F64 = torch.float64
C = 3
torch.manual_seed(0)
_LIN = torch.nn.Linear(C, C).double()
_CONV = torch.nn.Conv2d(C, C, 1).double()


def _dense_view(h, o):  # position -1 of every sample (samples not empty)
    return h[:, -1] if o else h[-1]


def _packed_rows(h, o):
    return h.reshape(-1, C) * 2 if o else h * 2


def _pooled(h, o):  # a (B, C, 2, 2) map of images at their own sizes
    return F.adaptive_avg_pool2d(h, 2) * 3 if o else (F.adaptive_avg_pool2d(h[None], 2) * 3)[0]


def _seq_first(h, o):  # (T, B, C)
    return _LIN(h.transpose(0, 1)) if o else _LIN(h)


#: name -> (subclass, the op, the samples' shapes, their ragged dims, the intermediate's layer)
KINDS = {
    "dense_view": (DenseView, _dense_view, [(1, C), (5, C)], (0,), _LIN),
    "packed_rows": (PackedRows, _packed_rows, [(2, C), (0, C), (4, C)], (0,), _LIN),
    "batch_dense": (BatchDense, _pooled, [(C, 4, 6), (C, 6, 4)], (1, 2), _CONV),
    "seq_first": (SeqFirstView, _seq_first, [(2, C), (0, C), (4, C)], (0,), _LIN),
}
ONE_SAMPLE = {"dense_view": [(3, C)], "packed_rows": [(3, C)], "batch_dense": [(C, 5, 3)], "seq_first": [(3, C)]}


def _layer(layer, t, o):
    return layer(t.tanh()) if o or layer is _LIN else layer(t.tanh()[None])[0]


def _cotangents(kind, outs, shapes):
    """The gradient of the batch's output, and each sample's share of it."""
    g = torch.Generator().manual_seed(1)
    per = [torch.randn(o.shape, generator=g, dtype=F64) for o in outs]
    if kind == "dense_view" or kind == "batch_dense":
        return torch.stack(per), per
    if kind == "packed_rows":
        return torch.cat(per), per
    return padless.from_list(per).transpose(0, 1), per


def _ask(how, out, cot, inputs):
    if how == "grad":
        return list(torch.autograd.grad(out, inputs, cot))
    if how == "backward":
        out.backward(cot, inputs=inputs)
    else:
        torch.autograd.backward([out], [cot], inputs=inputs)
    return [t.grad for t in inputs]


@pytest.mark.parametrize("how", ["backward", "autograd.backward", "grad"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch", ["batch", "one_sample"])
def test_gradients_reach_nested_inputs(kind, how, batch):
    cls, op, shapes, ragged, layer = KINDS[kind]
    shapes = shapes if batch == "batch" else ONE_SAMPLE[kind]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    refs = []
    for xi in xs:
        xi = xi.clone().requires_grad_()
        hi = _layer(layer, xi, 0)
        refs.append((xi, hi, op(hi, 0)))
    cot, per = _cotangents(kind, [r[2] for r in refs], shapes)

    x = padless.from_list(xs, ragged_dims=ragged).requires_grad_()
    h = _layer(layer, x, 1)
    out = op(h, 1)
    assert type(out) is cls
    gx, gh = _ask(how, out, cot, [x, h])
    assert isinstance(gx, padless.NestedTensor) and isinstance(gh, padless.NestedTensor)
    for i, (xi, hi, oi) in enumerate(refs):
        want_x, want_h = torch.autograd.grad(oi, [xi, hi], per[i])
        torch.testing.assert_close(gx.unbind()[i], want_x)
        torch.testing.assert_close(gh.unbind()[i], want_h)


def _seq_first_out():
    x = padless.from_list([torch.randn(2, C, dtype=F64), torch.randn(4, C, dtype=F64)], requires_grad=True)
    return x, _LIN(x.transpose(0, 1))


def test_seq_first_gradient_must_be_a_seq_first_view():
    x, y = _seq_first_out()
    with pytest.raises(TypeError, match=r"gradient of a sequence-first view .* is a sequence-first view too, got Tensor"):
        y.backward(torch.ones(y.shape, dtype=F64), inputs=[x])
    g = padless.from_list([torch.ones(2, C, dtype=F64), torch.ones(4, C, dtype=F64)])
    with pytest.raises(TypeError, match=r"got NestedTensor .*pass g.transpose\(0, 1\)"):
        torch.autograd.grad(y, [x], g)  # the batch's gradient, not read sequence-first
    with pytest.raises(TypeError, match=r"sequence-first view \(g.transpose\(0, 1\)\) given as the gradient of a "):
        torch.autograd.grad([y, y.transpose(0, 1)], [x], [y.detach(), g.transpose(0, 1)])


def test_seq_first_view_among_inputs_is_refused():
    x, y = _seq_first_out()
    u = x.transpose(0, 1)
    with pytest.raises(TypeError, match=r"grad\(\): a sequence-first view .* among inputs"):
        torch.autograd.grad(_LIN(u), [u], _LIN(u).detach())


@pytest.mark.parametrize("how", ["autograd.backward", "grad"])
@pytest.mark.parametrize("order", ["batch_first_then_view", "view_then_batch"])
def test_a_batch_and_a_seq_first_view_among_the_outputs(order, how):
    """Outputs ``[a, b]`` with ``a`` a NestedTensor and ``b`` a sequence-first view: NestedTensor
    answers first there and reads the view as its batch too (the view's part of the gradient was
    lost: a silent wrong gradient)."""
    lengths = [2, 0, 4]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, C, generator=g, dtype=F64) for n in lengths]
    cots = [torch.randn(n, C, generator=g, dtype=F64) for n in lengths]
    x = padless.from_list(xs, requires_grad=True)
    h = _LIN(x.tanh())
    a, b = h * 3, _LIN(h.transpose(0, 1))
    ga = padless.from_list(cots)
    outs, grads = ([a, b], [ga, ga.transpose(0, 1)]) if order == "batch_first_then_view" else ([b, a], [ga.transpose(0, 1), ga])
    gh, gx = _ask_many(how, outs, grads, [h, x])
    for i, (xi, ci) in enumerate(zip(xs, cots)):
        xi = xi.clone().requires_grad_()
        hi = _LIN(xi.tanh())
        want_h, want_x = torch.autograd.grad([hi * 3, _LIN(hi)], [hi, xi], [ci, ci])
        torch.testing.assert_close(gh.unbind()[i], want_h)
        torch.testing.assert_close(gx.unbind()[i], want_x)


def _ask_many(how, outs, grads, inputs):
    if how == "grad":
        return list(torch.autograd.grad(outs, inputs, grads))
    torch.autograd.backward(outs, grads, inputs=inputs)
    return [t.grad for t in inputs]
