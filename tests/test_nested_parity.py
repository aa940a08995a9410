"""torch.nested (NJT) parity gaps of issue 14, each run on padless and on torch's own NJT.

Every test builds the same samples as a padless NestedTensor and as an NJT
(``torch.nested.nested_tensor(..., layout=torch.jagged)``) and compares sample by sample.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import padless
from padless import nested
from padless.testing.njt import pair as _pair
from padless.testing.njt import same as _same
from padless.testing.njt import samples as _samples

# Ragged (j, 4) samples: an empty sample in the middle, and the one-sample batch.
BATCHES = {"mixed": [(3, 4), (0, 4), (2, 4)], "one": [(5, 4)]}


@pytest.mark.parametrize("batch", BATCHES)
def test_masked_select_nested_mask(batch):
    """NJT: ``torch.masked_select(nt, nt > 0)`` on ``(B, j)`` gives a ``(B, j')`` NJT whose sample i
    holds sample i's selected elements in order. NJT's backward fails (``aten.size`` on an NJT);
    padless's gradient is checked against the dense per-sample one instead."""
    samples = [s[:, 0].contiguous() for s in _samples(BATCHES[batch])]
    pl, njt = _pair(samples, requires_grad=True)
    out_pl, out_njt = torch.masked_select(pl, pl > 0), torch.masked_select(njt, njt > 0)
    _same(out_pl, out_njt)
    assert out_pl.dim() == 2 and out_pl.ragged_dims == (0,)
    out_pl.values().sum().backward()
    for g, s in zip(pl.grad.unbind(), samples):
        torch.testing.assert_close(g, (s > 0).float())


def test_masked_select_multidim_and_transposed():
    """NJT refuses masks past ``(B, j)`` ("only support 2-D selections"); padless selects each
    sample's elements in row-major order, as ``torch.masked_select`` on the dense sample does."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=1)
    pl = nested.nested_tensor(samples)
    two = nested.nested_tensor(_samples([(2, 3, 4), (3, 1, 4), (0, 2, 4)], seed=1), ragged_dims=(0, 1))
    for x in (pl, pl.transpose(1, 2), two, two.transpose(1, 3)):
        out = x.masked_select(x > 0)
        for o, s in zip(out.unbind(), x.unbind()):
            torch.testing.assert_close(o, torch.masked_select(s, s > 0))


def test_masked_select_errors():
    pl = nested.nested_tensor(_samples([(3,), (2,)]))
    with pytest.raises(TypeError, match=r"masked_select\(nt, mask\): mask must be a NestedTensor"):
        torch.masked_select(pl, torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"masked_select\(input, mask\): a NestedTensor mask needs a NestedTensor input"):
        torch.masked_select(torch.ones(3), pl > 0)
    with pytest.raises(TypeError, match="mask must be a bool NestedTensor"):
        torch.masked_select(pl, pl)
    other = nested.nested_tensor(_samples([(3,), (4,)])) > 0
    with pytest.raises(padless.StructureError, match=r"mask sample 1 has shape \(4,\), input sample 1 has \(2,\)"):
        torch.masked_select(pl, other)


def test_apply_():
    """NJT: ``nt.apply_(fn)`` calls ``fn`` on every element in place (CPU) and returns ``nt``."""
    pl, njt = _pair(_samples(BATCHES["mixed"], seed=2))
    assert pl.apply_(lambda v: v * 2 + 1) is pl
    njt.apply_(lambda v: v * 2 + 1)
    _same(pl, njt)


def test_apply_refuses_cuda_message():
    pl = nested.nested_tensor(_samples([(2,)]))
    with pytest.raises(TypeError, match=r"apply_\(\): only CPU tensors are supported"):
        pl.to("meta").apply_(lambda v: v)


class _NoneForFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a * 2 + b

    @staticmethod
    def backward(ctx, g):
        return None, g


def test_custom_function_none_gradient():
    """NJT: a custom ``autograd.Function`` returning ``None`` for a NestedTensor input leaves that
    input's ``.grad`` None and gives the other input its gradient."""
    samples = _samples(BATCHES["mixed"], seed=3)
    pl, njt = _pair(samples, requires_grad=True)
    pl_b = (pl.detach() * 0 + 1).requires_grad_()
    njt_b = (njt.detach() * 0 + 1).requires_grad_()
    out_pl, out_njt = _NoneForFirst.apply(pl, pl_b), _NoneForFirst.apply(njt, njt_b)
    _same(out_pl, out_njt)
    out_pl.backward(out_pl.detach() * 0 + 1)
    out_njt.backward(out_njt.detach() * 0 + 1)
    assert pl.grad is None and njt.grad is None
    _same(pl_b.grad, njt_b.grad)


def test_unsafe_view():
    """NJT: ``aten._unsafe_view(nt, (B, j, 8))`` on ``(B, j, 4, 2)`` merges the static dims of each
    sample, as ``view`` does; the batch and ragged dims are kept."""
    samples = _samples([(3, 4, 2), (0, 4, 2), (2, 4, 2)], seed=4)
    pl, njt = _pair(samples)
    out_pl = torch.ops.aten._unsafe_view(pl, list(pl.shape[:2]) + [8])
    out_njt = torch.ops.aten._unsafe_view(njt, list(njt.shape[:2]) + [8])
    _same(out_pl, out_njt)


def test_unsafe_view_error():
    pl = nested.nested_tensor(_samples([(3, 4), (2, 4)]))
    with pytest.raises(padless.StructureError, match=r"_unsafe_view\(\)"):
        torch.ops.aten._unsafe_view(pl, [2, 3, 5])


def test_per_sample_fallback_backward_mvlgamma():
    """NJT: ``torch.mvlgamma(nt, p=2)`` and ``out.backward(grad_nt)`` give each sample's dense
    gradient. In padless the forward runs per sample, and the ATen ops of the backward formula
    without a handler (``unsqueeze``) run per sample inside the autograd engine."""
    samples = [s.abs() + 2 for s in _samples([(3, 4), (2, 4)], seed=5)]
    pl, njt = _pair(samples, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_pl = torch.mvlgamma(pl, p=2)
        out_pl.backward(out_pl.detach() * 0 + 1)
    out_njt = torch.mvlgamma(njt, p=2)
    out_njt.backward(out_njt.detach() * 0 + 1)
    _same(out_pl, out_njt)
    _same(pl.grad, njt.grad)


def test_index_put_integer_indices():
    """NJT: ``index_put(nt, (batch, ragged), v)`` writes element ``ragged[k]`` of sample
    ``batch[k]`` (indices into ``values`` are ``offsets[batch] + ragged``); ``index_put_`` in place,
    ``accumulate=True`` adds."""
    samples = _samples([(3, 4), (2, 4)], seed=6)
    bi, ji = torch.tensor([0, 1]), torch.tensor([2, 1])
    v = torch.arange(8.0).view(2, 4)
    pl, njt = _pair(samples)
    _same(torch.index_put(pl, (bi, ji), v), torch.index_put(njt, (bi, ji), v))
    _same(torch.index_put(pl, (bi, ji), v, accumulate=True), torch.index_put(njt, (bi, ji), v, accumulate=True))
    ci = torch.tensor([3, 0])
    assert pl.index_put_((bi, ji, ci), torch.tensor(9.0)) is pl
    njt.index_put_((bi, ji, ci), torch.tensor(9.0))
    _same(pl, njt)


def test_index_put_negative_and_errors():
    """Negative batch / ragged indices count from the end of the batch / of the sample, as on a
    dense sample (NJT adds a negative ragged index to the sample's offset)."""
    pl = nested.nested_tensor(_samples([(3,), (0,), (2,)], seed=7))
    out = torch.index_put(pl, (torch.tensor([-1]), torch.tensor([-1])), torch.tensor(5.0))
    assert out.unbind()[2][-1].item() == 5.0
    with pytest.raises(RuntimeError, match=r"index_put\(\): a ragged index \(index 1\) is out of range"):
        torch.index_put(pl, (torch.tensor([1]), torch.tensor([0])), torch.tensor(5.0))
    with pytest.raises(RuntimeError, match=r"index_put\(\): a batch index \(index 0\) is out of range for 3 samples"):
        torch.index_put(pl, (torch.tensor([3]), torch.tensor([0])), torch.tensor(5.0))
    # batch indices only write whole samples, as NJT (tests/test_nested_parity_binary.py)
    assert torch.index_put(pl, (torch.tensor([0]),), torch.tensor(5.0)).unbind()[0].eq(5.0).all()
    with pytest.raises(TypeError, match=r"index 1 must be an integer tensor"):
        torch.index_put(pl, (torch.tensor([0]), torch.tensor([0.5])), torch.tensor(5.0))


def _same_dense(out, refs):
    _same(out, torch.nested.as_nested_tensor(refs, layout=torch.strided))


def _transposed_pair(shapes, seed, requires_grad=False):
    """The same samples as a padless NestedTensor and an NJT, both ``transpose(1, 2)``-ed, so the
    ragged dim is sample dim 1 (NJT's ``_ragged_idx`` 2) and the storage is not contiguous."""
    samples = _samples(shapes, seed=seed)
    pl, njt = _pair(samples, requires_grad=requires_grad)
    return samples, pl.transpose(1, 2), njt.transpose(1, 2)


@pytest.mark.parametrize("shapes", [[(3, 4), (2, 4)], [(3, 2, 4), (2, 2, 4)]], ids=["2d", "3d"])
def test_index_put_transposed_matches_njt(shapes):
    """NJT on a transposed tensor: indices ``(batch, c, ragged, *rest)`` write element
    ``(c[k], ragged[k], ...)`` of sample ``batch[k]``; out of place, accumulating and in place.
    (NJT compares the ragged index with ``lengths`` elementwise, so its index tensors need B entries.)"""
    _, pl, njt = _transposed_pair(shapes, seed=9)
    idx = (torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 1]))
    v = torch.arange(2.0 * math.prod(shapes[0][2:])).view(2, *shapes[0][2:]) + 100
    assert pl.ragged_dims == (1,) and njt._ragged_idx == 2
    _same(torch.index_put(pl, idx, v), torch.index_put(njt, idx, v))
    _same(torch.index_put(pl, idx, v, accumulate=True), torch.index_put(njt, idx, v, accumulate=True))
    assert pl.index_put_(idx, v) is pl
    njt.index_put_(idx, v)
    _same(pl, njt)


def test_index_put_transposed_matches_dense_samples():
    """Where NJT's check misfires (more index entries than samples, negative indices), and for
    the gradients: the dense op on each sample is the reference."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=10)
    leaf = nested.nested_tensor([s.clone() for s in samples], requires_grad=True)
    pl = leaf.transpose(1, 2)
    b, c, j = torch.tensor([0, 2, 2, -3]), torch.tensor([1, 0, -1, 3]), torch.tensor([-1, 1, 0, 0])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    out = torch.index_put(pl, (b, c, j), v)
    dense = [s.clone().requires_grad_() for s in samples]
    vr = v.detach().clone().requires_grad_()
    refs = [x.t().clone() for x in dense]
    for k in range(len(b)):
        refs[int(b[k])] = refs[int(b[k])].index_put((c[k : k + 1], j[k : k + 1]), vr[k : k + 1])
    _same_dense(out, refs)
    sum((o * o).sum() for o in out.unbind()).backward()
    sum((r * r).sum() for r in refs).backward()
    torch.testing.assert_close(v.grad, vr.grad)
    for got, want in zip(leaf.grad.unbind(), dense):
        torch.testing.assert_close(got, want.grad)
    acc = torch.index_put(pl.detach(), (b, c, j), v.detach(), accumulate=True)
    refs = [s.t().clone() for s in samples]
    for k in range(len(b)):
        refs[int(b[k])] = refs[int(b[k])].index_put((c[k : k + 1], j[k : k + 1]), v[k : k + 1].detach(), accumulate=True)
    _same_dense(acc, refs)
    with pytest.raises(RuntimeError, match=r"index_put\(\): a ragged index \(index 2\) is out of range"):
        torch.index_put(pl.detach(), (torch.tensor([1]), torch.tensor([0]), torch.tensor([0])), torch.tensor(5.0))


def test_index_put_batch_indices_only_transposed():
    """``index_put(nt, [batch], v)`` on a transposed tensor writes every element of the samples
    named, ``v`` broadcasting against a sample with extent 1 along the ragged dim (NJT refuses:
    "only works on contiguous NJTs"); the dense op on each sample is the reference."""
    samples, pl, njt = _transposed_pair([(3, 4), (0, 4), (2, 4)], seed=11)
    with pytest.raises(RuntimeError, match="only works on contiguous NJTs"):
        torch.index_put(njt, [torch.tensor([0])], torch.tensor(1.0))
    v = torch.arange(4.0).view(4, 1)
    for accumulate in (False, True):
        out = torch.index_put(pl, [torch.tensor([0, 2, 2])], v, accumulate=accumulate)
        refs = [s.t() for s in samples]
        refs = [refs[0] + v, refs[1], refs[2] + 2 * v] if accumulate else [v.expand_as(refs[0]), refs[1], v.expand_as(refs[2])]
        _same_dense(out, refs)
    with pytest.raises(padless.StructureError, match=r"values must be the same for every element of a written sample"):
        torch.index_put(pl, [torch.tensor([0])], torch.arange(4.0))  # (4,) runs along the ragged dim


def test_dense_matmul_transposed_nested():
    """NJT: ``w @ nt.transpose(1, 2)`` with ``nt`` ``(B, j, D)`` and ``w`` ``(O, D)`` gives the
    ``(B, O, j)`` NJT of ``w @ sample.T`` per sample; gradients reach ``w`` and ``nt``."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=8)
    pl, njt = _pair(samples, requires_grad=True)
    w1 = torch.randn(5, 4, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    out_pl, out_njt = w1 @ pl.transpose(1, 2), w2 @ njt.transpose(1, 2)
    _same(out_pl, out_njt)
    out_pl.values().sum().backward()
    out_njt.values().sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)
    _same(pl.grad, njt.grad)


def test_batched_dense_matmul_transposed_nested():
    """NJT: ``torch.matmul(d, nt.transpose(1, 2))`` with dense ``d`` ``(B, F, E)`` and ``nt``
    ``(B, j, E)`` gives the ``(B, F, j)`` NJT of ``d[i] @ sample_i.T``; gradients reach ``d``
    and ``nt``. (NJT's ``bmm`` refuses this pair; so does padless's.)"""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=9)
    pl, njt = _pair(samples, requires_grad=True)
    d1 = torch.randn(3, 6, 4, requires_grad=True)
    d2 = d1.detach().clone().requires_grad_()
    out_pl, out_njt = torch.matmul(d1, pl.transpose(1, 2)), torch.matmul(d2, njt.transpose(1, 2))
    _same(out_pl, out_njt)
    assert out_pl.ragged_dims == (1,)
    out_pl.values().sum().backward()
    out_njt.values().sum().backward()
    torch.testing.assert_close(d1.grad, d2.grad)
    _same(pl.grad, njt.grad)
    with pytest.raises(padless.StructureError, match=r"matmul\(\): a 3-D dense left operand is batched: its dim 0 \(2\)"):
        torch.matmul(torch.randn(2, 6, 4), pl.transpose(1, 2))


def test_linear_on_transposed_nested():
    """NJT: ``F.linear`` on a transposed (non-contiguous) NJT raises ValueError ("expected input to
    be a contiguous jagged layout NestedTensor"), and torch's OpInfo skips NJTs whose last dim is
    ragged. padless: a transposed NestedTensor whose last dim is static gives each sample's dense
    ``F.linear`` (values and gradients); a ragged last dim raises StructureError, a ValueError
    as NJT's refusal is."""
    samples = _samples([(3, 4, 5), (0, 4, 5), (2, 4, 5)], seed=10)
    pl = nested.nested_tensor(samples, requires_grad=True)
    w, b = torch.randn(6, 5, requires_grad=True), torch.randn(6)
    out = torch.nn.functional.linear(pl.transpose(1, 2), w, b)
    dense = [s.clone().requires_grad_() for s in samples]
    refs = [torch.nn.functional.linear(s.transpose(0, 1), w, b) for s in dense]
    for o, r in zip(out.unbind(), refs):
        torch.testing.assert_close(o, r)
    gw = torch.autograd.grad(out.values().sum(), [w, pl])
    gw_ref = torch.autograd.grad(sum(r.sum() for r in refs), [w, *dense])
    torch.testing.assert_close(gw[0], gw_ref[0])
    for g, r in zip(gw[1].unbind(), gw_ref[1:]):
        torch.testing.assert_close(g, r)
    njt = torch.nested.nested_tensor(samples, layout=torch.jagged)
    with pytest.raises(ValueError, match="contiguous jagged layout"):
        torch.nn.functional.linear(njt.transpose(1, 2), w, b)
    with pytest.raises(ValueError, match=r"linear\(\): sample dim 2 is ragged"):
        torch.nn.functional.linear(pl.transpose(1, 3), torch.randn(6, 3))


def test_setitem_nested_mask():
    """NJT: ``nt[nt > 0] = v`` raises ValueError ("expected input to be a jagged layout
    NestedTensor"). padless writes ``v`` at the selected elements, as ``x[mask] = v`` on each dense
    sample (a scalar, or one value per selected element in sample order)."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=11)
    njt = torch.nested.nested_tensor(samples, layout=torch.jagged)
    with pytest.raises(ValueError, match="expected input to be a jagged layout NestedTensor"):
        njt[njt > 0] = 0.0
    pl = nested.nested_tensor(samples)
    pl[pl > 0] = 0.0
    for o, s in zip(pl.unbind(), samples):
        torch.testing.assert_close(o, s.clamp(max=0))
    pl = nested.nested_tensor(samples)
    mask = pl < 0
    n = sum(int((s < 0).sum()) for s in samples)
    pl[mask] = torch.arange(float(n))
    start = 0
    for o, s in zip(pl.unbind(), samples):
        ref = s.clone()
        k = int((s < 0).sum())
        ref[s < 0] = torch.arange(float(start), float(start + k))
        start += k
        torch.testing.assert_close(o, ref)
    with pytest.raises(padless.StructureError, match=r"index_put_\(nt, \(mask,\), v\): mask sample 0 has shape \(2, 4\)"):
        pl[nested.nested_tensor(_samples([(2, 4), (0, 4), (2, 4)])) > 0] = 1.0
    with pytest.raises(NotImplementedError, match=r"index_put_\(\): a NestedTensor mask needs input and mask stored"):
        t = pl.transpose(1, 2)
        t[t > 0] = 1.0


def test_index_put_and_unsafe_view_gradients():
    """Gradients of ``index_put`` (input: zero at the written elements; values: gathered from the
    output gradient) and of ``aten._unsafe_view`` (the gradient viewed back) match the dense
    per-sample ones; a one-sample batch of an empty sample selects nothing."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=12)
    pl = nested.nested_tensor(samples, requires_grad=True)
    v = torch.randn(2, 4, requires_grad=True)
    out = torch.index_put(pl, (torch.tensor([0, 2]), torch.tensor([1, 0])), v)
    (out.values() * torch.arange(20.0).view(5, 4)).sum().backward()
    keep = [torch.tensor([1.0, 0.0, 1.0]), torch.ones(0), torch.tensor([0.0, 1.0])]
    weights = torch.arange(20.0).view(5, 4).split([3, 0, 2])
    for g, k, wt in zip(pl.grad.unbind(), keep, weights):
        torch.testing.assert_close(g, wt * k[:, None])
    torch.testing.assert_close(v.grad, torch.stack([weights[0][1], weights[2][0]]))
    pl = nested.nested_tensor(_samples([(3, 4, 2), (1, 4, 2)], seed=13), requires_grad=True)
    out = torch.ops.aten._unsafe_view(pl, [2, 3, 8])
    out.values().pow(2).sum().backward()
    for g, s in zip(pl.grad.unbind(), pl.detach().unbind()):
        torch.testing.assert_close(g, 2 * s)
    empty = nested.nested_tensor([torch.randn(0)])
    assert [tuple(s.shape) for s in torch.masked_select(empty, empty > 0).unbind()] == [(0,)]


# --------------------------------------------------------------- construction inside torch.compile


def _where_in_graph(mod):
    """NJT's own test: build from (values, offsets) in the graph, then torch.where with a scalar
    on either side."""

    def f(values, offsets):
        nt = mod.nested_tensor_from_jagged(values, offsets)
        cond = nt > 0.0
        return torch.where(cond, 1.0, torch.zeros_like(nt)) * nt + torch.where(cond, torch.ones_like(nt), 0.0)

    return f


@pytest.fixture
def _capture_scalars():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield
    torch._dynamo.reset()


def test_from_jagged_built_in_compiled_graph_then_where(_capture_scalars):
    """An NJT built inside a compiled graph followed by ``torch.where`` (issue 14): padless builds
    one graph over batches of changing size and lengths (an empty sample included); values and
    gradients equal eager padless sample by sample, and values equal torch's NJT."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("aot_eager")
    f_pl = torch.compile(_where_in_graph(nested), backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for k, lengths in enumerate(([2, 3, 2, 3], [4, 0, 5], [1, 6, 2, 3, 2])):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        values = torch.randn(int(offsets[-1]), 5, generator=g, requires_grad=True)
        out = f_pl(values, offsets)
        assert isinstance(out, padless.NestedTensor) and out.shape[:2] == (len(lengths), max(lengths))
        ref = _where_in_graph(nested)(values, offsets)
        _same(out, ref)
        if k == 0:
            _same(out, _where_in_graph(torch.nested)(values, offsets))
        (grad,) = torch.autograd.grad(out.values().sum(), values)
        (grad_ref,) = torch.autograd.grad(ref.values().sum(), values)
        torch.testing.assert_close(grad, grad_ref)
    assert cnt.frame_count <= 2, f"{cnt.frame_count} graphs for 3 batches (dense inputs: static, then dynamic)"


def test_from_lengths_jagged_dim_and_max_seqlen_in_compiled_graph(_capture_scalars):
    """``lengths=``, ``jagged_dim=2`` and a ``max_seqlen`` hint inside a compiled graph give NJT's
    samples; ``as_nested_tensor`` of a dense batch too."""
    lengths = torch.tensor([3, 1, 4])
    values = torch.randn(2, 8, 6)  # jagged_dim=2: the ragged rows are values' dim 1

    def f(mod, v, ln):
        a = mod.nested_tensor_from_jagged(v, lengths=ln, jagged_dim=2, max_seqlen=4)
        b = mod.nested_tensor_from_jagged(v.transpose(0, 1).contiguous(), lengths=ln)
        return a.sin() + 1, b * 2, mod.as_nested_tensor(v.transpose(0, 1)[:4].contiguous(), layout=torch.jagged).cos()

    got = torch.compile(lambda v, ln: f(nested, v, ln), backend="aot_eager", fullgraph=True)(values, lengths)
    ref = f(torch.nested, values, lengths)
    for g, r in zip(got, ref):
        _same(g, r)
    assert got[0].shape == (3, 2, 4, 6) and got[0].ragged_dims == (1,)


def test_from_jagged_with_holes_in_compiled_graph_refused(_capture_scalars):
    offsets, lengths = torch.tensor([0, 3, 5]), torch.tensor([2, 1])
    f = torch.compile(lambda v: nested.nested_tensor_from_jagged(v, offsets, lengths) * 2, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"nested_tensor_from_jagged\(\): offsets together with lengths \(holes\) inside torch.compile"):
        f(torch.randn(5, 3))


@pytest.mark.parametrize("call", ["chunk", "split", "split_sections"])
def test_splitting_the_ragged_dim_raises_runtime_error_like_njt(call):
    """NJT refuses to split its ragged dim with a RuntimeError; code catching that must catch
    padless's refusal too (a StructureError is both a ValueError and a RuntimeError)."""
    samples = [torch.randn(3, 4), torch.randn(5, 4)]
    ops = {
        "chunk": lambda t: t.chunk(2, dim=1),
        "split": lambda t: t.split(2, dim=1),
        "split_sections": lambda t: torch.split(t, [1, 2], dim=1),
    }
    njt = torch.nested.nested_tensor(samples, layout=torch.jagged)
    with pytest.raises(RuntimeError):
        ops[call](njt)
    nt = nested.nested_tensor(samples, layout=torch.jagged)
    with pytest.raises(padless.StructureError, match=r"dim 1 is ragged.*use narrow\(1, start, length\)"):
        ops[call](nt)


@pytest.mark.parametrize(
    "shapes", [[(3, 4), (0, 4), (5, 4)], [(3, 2, 4), (5, 2, 4)], [(6, 4)]], ids=["with_empty", "3d", "one_sample"]
)
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_over_the_ragged_dim_normalises_each_sample(shapes, affine):
    """``F.layer_norm(nt, nt.shape[1:])`` normalises every whole sample, as NJT does; values and
    gradients equal ``F.layer_norm`` on each dense sample (weight/bias act on the last dim)."""
    torch.manual_seed(0)
    samples = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    w = torch.randn(4, dtype=torch.float64, requires_grad=True) if affine else None
    b = torch.randn(4, dtype=torch.float64, requires_grad=True) if affine else None
    nt = nested.as_nested_tensor(samples, layout=torch.jagged)
    out = F.layer_norm(nt, nt.shape[1:], w, b)
    assert isinstance(out, padless.NestedTensor) and out.sizes().tolist() == nt.sizes().tolist()
    refs = []
    for s in samples:
        r = F.layer_norm(s, s.shape) if s.numel() else s * 1.0
        refs.append(r * w + b if affine else r)
    for got, want in zip(out.unbind(), refs):
        torch.testing.assert_close(got, want)
    grad = torch.randn_like(out.values())
    leaves = samples + ([w, b] if affine else [])
    got_g = torch.autograd.grad(out.values(), leaves, grad, allow_unused=True)
    want_g = torch.autograd.grad(torch.cat([r.reshape(-1) for r in refs]), leaves, grad.reshape(-1), allow_unused=True)
    for g, e in zip(got_g, want_g):
        torch.testing.assert_close(g, e)
    if len(shapes[0]) == 2 and not any(s[0] == 0 for s in shapes):  # NJT on the same input (no empty samples)
        njt = torch.nested.as_nested_tensor([s.detach() for s in samples], layout=torch.jagged)
        ref = F.layer_norm(njt, njt.shape[-2:], None if w is None else w.detach(), None if b is None else b.detach())
        # NJT (torch 2.13) silently drops weight and bias here; padless applies them (pinned)
        plain = F.layer_norm(nt.detach(), nt.shape[1:])
        for got, want in zip(plain.unbind(), ref.unbind()):
            torch.testing.assert_close(got, want)


def test_layer_norm_over_the_ragged_dim_errors():
    nt = nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], layout=torch.jagged)
    with pytest.raises(padless.StructureError, match=r"sample dim 1 \(static\) has envelope extent 4, normalized_shape gives 3"):
        F.layer_norm(nt, (5, 3))
    with pytest.raises(padless.StructureError, match=r"weight of shape \(5, 4\) must match the trailing static dims \(4,\)"):
        F.layer_norm(nt, nt.shape[1:], torch.ones(5, 4))
