"""torch.nested (NJT) OpInfo samples padless got wrong, each compared sample by sample with
torch's real NJT where NJT runs the op, else with the dense op on each sample (the reference
NJT's own OpInfo tests use).

Covered: ``rsub`` / ``complex`` / ``polar`` with a dense operand carrying a batch dim (the
per-sample fallback handed the whole ``(B, 1, C)`` tensor to every sample; NJT has no kernel
for these three); zero gradients autograd builds as dense envelope tensors (``copysign`` and
``nextafter`` w.r.t. ``other``, ``sgn``: NJT's backward fails on all three); ``torch.max(a, b)``
/ ``torch.min(a, b)`` without an autograd graph; ``matmul`` / ``bmm`` with a batched dense
right operand; ``F.embedding_bag`` of a NestedTensor of ids; ``index_put`` with batch indices
only. Batches: ``(j, 4)`` samples with an empty sample, and a one-sample batch.
"""

import pytest
import torch
import torch.nn.functional as F

import padless
from padless import nested

BATCHES = {"mixed": [(3, 4), (0, 4), (2, 4)], "one": [(5, 4)]}


def _samples(shapes, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g) for s in shapes]
    return [x.abs() + 0.1 for x in out] if positive else out


def _pl(samples, requires_grad=False):
    return nested.nested_tensor([s.clone() for s in samples], requires_grad=requires_grad)


def _njt(samples, requires_grad=False):
    return torch.nested.nested_tensor([s.clone() for s in samples], layout=torch.jagged, requires_grad=requires_grad)


def _same(out, refs):
    got = list(out.unbind())
    assert len(got) == len(refs)
    for x, y in zip(got, refs):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y)


def _dense_operand(kind, b, seed=5):
    g = torch.Generator().manual_seed(seed)
    shape = {"batch": (b, 1, 4), "batch_1": (b, 1, 1), "all_1": (1, 1, 1), "static": (4,), "scalar": ()}[kind]
    return torch.randn(shape, generator=g)


def _per_sample(t, i):
    """The dense operand as sample ``i`` sees it (the NJT reference's slicing)."""
    if t.dim() == 3:
        return t[i] if t.shape[0] > 1 else t[0]
    return t


BINARY = {
    "rsub": torch.rsub,
    "copysign": torch.copysign,
    "nextafter": torch.nextafter,
    "max": torch.max,
    "min": torch.min,
    "maximum": torch.maximum,
}


def _differentiable(op) -> bool:
    """Whether this torch differentiates ``op`` on dense tensors (``nextafter``'s derivative
    arrived in torch 2.12): the padless and the per-sample reference gradients need it."""
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    try:
        torch.autograd.grad(op(a, b).sum(), [a, b], allow_unused=True)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _check_binary(op, batch, kind, nested_first, grad):
    if grad and not _differentiable(op):
        pytest.skip(f"this torch ({torch.__version__}) has no derivative for {op.__name__}")
    samples = _samples(BATCHES[batch], seed=1)
    x = _pl(samples, requires_grad=grad)
    t = _dense_operand(kind, len(samples)).requires_grad_(grad)
    out = op(x, t) if nested_first else op(t, x)
    xs = [s.clone().requires_grad_(grad) for s in samples]
    ts = t.detach().clone().requires_grad_(grad)
    refs = [op(s, _per_sample(ts, i)) if nested_first else op(_per_sample(ts, i), s) for i, s in enumerate(xs)]
    _same(out, [r.detach() for r in refs])
    if not grad:
        return
    assert out.requires_grad
    g = torch.Generator().manual_seed(9)
    cot = [torch.randn(r.shape, generator=g) for r in refs]
    (out.values() * torch.cat(cot)).sum().backward()
    sum((r * c).sum() for r, c in zip(refs, cot)).backward()
    assert isinstance(x.grad, padless.NestedTensor)  # not dense zeros of the envelope
    _same(x.grad, [s.grad for s in xs])
    torch.testing.assert_close(t.grad, ts.grad)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", ["batch", "batch_1", "all_1", "static", "scalar"])
@pytest.mark.parametrize("nested_first", [True, False])
@pytest.mark.parametrize("name", BINARY)
def test_binary_with_dense_operand_matches_each_sample(name, batch, kind, nested_first):
    """Values and both gradients per sample; a ``(B, 1, C)`` operand gives sample ``i`` its row ``i``."""
    _check_binary(BINARY[name], batch, kind, nested_first, grad=True)


@pytest.mark.parametrize("name", ["copysign", "nextafter", "maximum"])
@pytest.mark.parametrize("kind", ["batch", "static", "scalar"])
def test_binary_forward_matches_njt(name, kind):
    """Where NJT runs the op, padless gives NJT's samples."""
    samples = _samples(BATCHES["mixed"], seed=2)
    t = _dense_operand(kind, len(samples))
    _same(BINARY[name](_pl(samples), t), list(BINARY[name](_njt(samples), t).unbind()))


@pytest.mark.parametrize("batch", BATCHES)
def test_nested_pair_zero_gradients_are_nested(batch):
    """``copysign`` / ``nextafter`` w.r.t. ``other`` and real ``sgn``: zero gradients arrive as
    NestedTensors of the operand's structure (autograd builds them dense from the envelope)."""
    samples = _samples(BATCHES[batch], seed=3)
    other = _samples(BATCHES[batch], seed=4)
    for op in (torch.copysign, torch.nextafter, torch.Tensor.copysign):
        if not _differentiable(op):  # nextafter before torch 2.12
            continue
        a, b = _pl(samples, True), _pl(other, True)
        ga, gb = torch.autograd.grad(op(a, b).values().sum(), [a, b])
        refs = [torch.autograd.grad(op(x, y).sum(), [x, y]) for x, y in
                zip((s.clone().requires_grad_() for s in samples), (s.clone().requires_grad_() for s in other))]
        assert isinstance(gb, padless.NestedTensor)
        _same(ga, [r[0] for r in refs])
        _same(gb, [r[1] for r in refs])
    a = _pl(samples, True)
    (g,) = torch.autograd.grad(torch.sgn(a).values().sum(), [a])
    assert isinstance(g, padless.NestedTensor)
    _same(g, [torch.zeros_like(s) for s in samples])


@pytest.mark.parametrize("batch", BATCHES)
def test_complex_and_polar_with_batched_dense_operand(batch):
    """NJT has no ``complex`` / ``polar`` kernel; padless runs them on rows."""
    samples = _samples(BATCHES[batch], seed=6, positive=True)
    t = _dense_operand("batch", len(samples)).abs()
    for op in (torch.complex, torch.polar):
        out = op(_pl(samples), t)
        assert out.dtype == torch.complex64
        _same(out, [op(s, _per_sample(t, i)) for i, s in enumerate(samples)])
        _same(op(t, _pl(samples)), [op(_per_sample(t, i), s) for i, s in enumerate(samples)])


def test_dense_operand_with_wrong_batch_is_refused():
    x = _pl(_samples(BATCHES["mixed"]))
    with pytest.raises(padless.StructureError, match=r"rsub\(\): a dense operand of shape \(2, 1, 4\) has 2 entries on the batch dim"):
        torch.rsub(x, torch.randn(2, 1, 4))


# ---------------------------------------------------------------------------- matmul / bmm


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("call", ["matmul", "bmm", "matmul_kw", "bmm_kw"])
def test_batched_dense_right_operand_matches_njt(batch, call):
    """``(B, j, D) @ (B, D, E)``: sample ``i`` times ``w[i]``, values and gradients as NJT."""
    samples = _samples(BATCHES[batch], seed=7)
    w = torch.randn(len(samples), 4, 6)
    outs, grads = [], []
    for make in (_pl, _njt):
        x = make(samples, requires_grad=True)
        wi = w.clone().requires_grad_()
        fn = {"matmul": lambda: torch.matmul(x, wi), "bmm": lambda: torch.bmm(x, wi),
              "matmul_kw": lambda: torch.matmul(x, other=wi), "bmm_kw": lambda: torch.bmm(x, mat2=wi)}[call]
        out = fn()
        out.values().square().sum().backward()
        outs.append(list(out.unbind()))
        grads.append((list(x.grad.unbind()), wi.grad))
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_batched_dense_right_operand_errors():
    x = _pl(_samples(BATCHES["mixed"]))
    with pytest.raises(padless.StructureError, match=r"matmul\(\): a dense right operand with 3 dims is batched: its dim 0 \(2\)"):
        torch.matmul(x, torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match=r"matmul\(\): a dense right operand must be 1-D, 2-D, or batched"):
        torch.matmul(x, torch.randn(3, 3, 4, 6))
    with pytest.raises(padless.StructureError, match=r"bmm\(\): mat2 must be 3-D"):
        torch.bmm(x, torch.randn(4, 6))


# ---------------------------------------------------------------------------- embedding_bag


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_of_nested_ids_matches_njt(mode, weighted):
    """One bag per sample (an empty sample pools to zeros); gradients reach weight and the
    per-sample weights as with NJT."""
    if weighted and mode != "sum":
        pytest.skip("per_sample_weights need mode='sum'")
    ids = [torch.tensor([1, 4]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 9, 9])]
    psw = [torch.randn(len(i)) for i in ids]
    weight = torch.randn(10, 5)
    res = []
    for lib in (nested, torch.nested):
        x = lib.nested_tensor(ids, layout=torch.jagged)
        w = weight.clone().requires_grad_()
        p = lib.nested_tensor_from_jagged(torch.cat(psw), x.offsets()).requires_grad_() if weighted else None
        out = F.embedding_bag(x, w, mode=mode, per_sample_weights=p)
        out.square().sum().backward()
        res.append((out.detach(), w.grad, p.grad.values() if weighted else None))
    (o1, g1, p1), (o2, g2, p2) = res
    assert not isinstance(o1, padless.NestedTensor) and o1.shape == (3, 5)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(g1, g2)
    if weighted:
        torch.testing.assert_close(p1, p2)


def test_embedding_bag_errors():
    ids = nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])
    w = torch.randn(10, 5)
    with pytest.raises(ValueError, match=r"embedding_bag\(\): offsets must be None when input is a NestedTensor"):
        F.embedding_bag(ids, w, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match=r"embedding_bag\(\): with a NestedTensor input, per_sample_weights must be a NestedTensor"):
        F.embedding_bag(ids, w, mode="sum", per_sample_weights=torch.randn(3))
    other = nested.nested_tensor([torch.randn(1), torch.randn(2)])
    with pytest.raises(padless.StructureError, match=r"embedding_bag\(\): per_sample_weights must have input's structure"):
        F.embedding_bag(ids, w, mode="sum", per_sample_weights=other)
    ids2 = nested.nested_tensor([torch.tensor([[1, 2]]), torch.tensor([[3, 4], [5, 6]])])
    with pytest.raises(padless.StructureError, match=r"embedding_bag\(\): a NestedTensor input holds one bag of ids per sample"):
        F.embedding_bag(ids2, w)


# ---------------------------------------------------------------------------- index_put


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("value_shape", [(), (4,), (1, 4)])
def test_index_put_batch_indices_only_matches_njt(batch, accumulate, value_shape):
    """``index_put(nt, [batch], v)`` writes every element of the named samples (a repeated
    sample accumulates twice); values and the input's gradient as NJT, in place as well. NJT
    cannot differentiate w.r.t. ``v`` here (no ``aten.index``); padless can: checked against
    the dense op on each sample."""
    samples = _samples(BATCHES[batch], seed=8)
    b = len(samples)
    idx = torch.tensor([0, b - 1, b - 1]) if accumulate else torch.tensor([b - 1])
    v0 = torch.randn(value_shape)
    res = []
    for make in (_pl, _njt):
        x = make(samples, requires_grad=True)
        out = torch.index_put(x, [idx], v0, accumulate=accumulate)
        out.values().square().sum().backward()
        y = make(samples)
        y.index_put_([idx], v0, accumulate=accumulate)
        res.append((list(out.detach().unbind()), list(x.grad.unbind()), list(y.unbind())))
    v = v0.clone().requires_grad_()
    torch.index_put(_pl(samples), [idx], v, accumulate=accumulate).values().square().sum().backward()
    vr = v0.clone().requires_grad_()
    count = torch.bincount(idx, minlength=b)
    ref = [s + count[i] * vr if accumulate else (vr.expand(s.shape) if count[i] else s) for i, s in enumerate(samples)]
    sum(r.square().sum() for r in ref).backward()
    torch.testing.assert_close(v.grad, vr.grad)
    for a, b_ in zip(res[0], res[1]):
        if isinstance(a, list):
            assert len(a) == len(b_)
            for p, q in zip(a, b_):
                torch.testing.assert_close(p, q)
        else:
            torch.testing.assert_close(a, b_)


def test_index_put_batch_indices_only_errors():
    x = _pl(_samples(BATCHES["mixed"]))
    with pytest.raises(padless.StructureError, match=r"index_put\(\): with batch indices only, values must be the same"):
        torch.index_put(x, [torch.tensor([0, 2])], torch.randn(2, 1, 4))
    t = nested.nested_tensor([torch.randn(4, 3), torch.randn(4, 2)])  # ragged dim last: written as on each sample
    _same(torch.index_put(t, [torch.tensor([0])], torch.tensor(1.0)), [torch.ones(4, 3), t.unbind()[1]])
    with pytest.raises(padless.StructureError, match=r"index_put\(\): with batch indices only, values must be the same"):
        torch.index_put(t, [torch.tensor([0])], torch.randn(3))  # (3,) runs along the ragged dim
    g = _pl(_samples(BATCHES["mixed"]), requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"index_put_\(\): batch indices only, in place, on tensors that require grad"):
        g.index_put_([torch.tensor([0])], torch.tensor(1.0))


def test_dense_gradient_of_the_envelope_is_read_as_padded():
    """The identity view behind the zero-gradient fix reads any dense envelope-shaped gradient
    as a padded batch (each sample its leading corner), not only autograd's zero tensors."""
    from padless.ops.nested.binary import _PackDenseGrad

    x = _pl(_samples([(3, 2), (0, 2), (1, 2)]), requires_grad=True)
    d = torch.arange(18.0).view(3, 3, 2)
    (g,) = torch.autograd.grad(_PackDenseGrad.apply(x), x, grad_outputs=d)
    assert isinstance(g, padless.NestedTensor)
    _same(g, [d[0], d[1, :0], d[2, :1]])
