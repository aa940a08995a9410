"""torch.nested (NJT) behaviours found by running PyTorch's own NJT subclass tests on padless
(``benchmarks/njt_suite.py``), each compared with torch's real NJT sample by sample.

Covered: the gradient a custom ``autograd.Function`` receives for an output nobody used
(autograd makes dense zeros of the envelope shape for padless tensors); mistakes NJT
reports with a ``RuntimeError`` that padless must report with one too (``StructureError``
is both a ``ValueError`` and a ``RuntimeError``); ATen reductions called directly
(``aten.mean.dim``, ``aten.amax``/``amin``), which ran per sample and returned a NestedTensor
where NJT returns a dense tensor.
"""

import pytest
import torch

import padless
from padless import nested
from padless.testing.njt import pair as _pair
from padless.testing.njt import same as _same
from padless.testing.njt import samples as _samples
from padless.testing import check_op

# Ragged (j, 4) samples: an empty sample in the middle, the one-sample batch, and (j, 2, 4).
BATCHES = {"mixed": [(3, 4), (0, 4), (2, 4)], "one": [(5, 4)], "3d": [(2, 2, 4), (4, 2, 4)]}


class _TwoOutputs(torch.autograd.Function):
    """Two outputs of the input (``kind``: both of its shape, both transposed, or the second
    one reduced to ``(..., 1)``); the backward adds both incoming gradients, in the order given."""

    @staticmethod
    def forward(ctx, inp, kind, dense_first):
        ctx.kind, ctx.dense_first = kind, dense_first
        if kind == "transposed":
            return inp.transpose(1, 2) + 1, inp.transpose(1, 2) * 2
        if kind == "reduced":
            return inp + 1, inp.sum(-1, keepdim=True) * 2
        return inp + 1, inp * 2

    @staticmethod
    def backward(ctx, g1, g2):
        g = g2 + g1 if ctx.dense_first else g1 + g2
        return (g.transpose(1, 2) if ctx.kind == "transposed" else g), None, None


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", ["same", "transposed", "reduced"])
@pytest.mark.parametrize("used", [0, 1])
def test_custom_function_unused_output_gets_zero_gradient(batch, kind, used):
    """NJT: only one output of a custom Function is used, so autograd materialises zeros for the
    other one's gradient and the backward adds them. padless receives dense zeros of that
    output's envelope shape there (padless tensors are not C++ nested tensors); during backward
    they are read as a padded batch, so the input gradient equals NJT's, sample by sample. The
    backward code sees NestedTensors at torch level (``transpose`` of a gradient works)."""
    samples = _samples(BATCHES[batch], seed=1)
    pl, njt = _pair(samples, requires_grad=True)
    for x in (pl, njt):
        out = _TwoOutputs.apply(x, kind, used == 1)[used]
        out.backward(out.detach() * 0 + 3)
    _same(pl.grad, njt.grad)


def test_custom_function_unused_output_two_ragged_dims():
    """The same with images (C, H_i, W_i), two ragged dims (NJT has one ragged dim, so the
    reference is the dense Function on each sample)."""
    samples = [torch.randn(2, 3, 5), torch.randn(2, 4, 1), torch.randn(2, 1, 2)]
    x = padless.from_list(samples, ragged_dims=(1, 2)).requires_grad_()
    out = _TwoOutputs.apply(x, "same", True)[0]
    out.backward(out.detach() * 0 + 3)
    for g, s in zip(x.grad.unbind(), samples):
        d = s.clone().requires_grad_()
        _TwoOutputs.apply(d, "same", True)[0].backward(torch.full_like(s, 3.0))
        torch.testing.assert_close(g, d.grad)


def test_dense_envelope_operand_outside_backward_is_read_in_padded_coordinates():
    """Outside a backward pass a dense tensor of the envelope's extent is read in padded
    coordinates too (each sample reads its own corner); the strict switch refuses it."""
    x = nested.nested_tensor(_samples([(3, 4), (2, 4)]))
    d = torch.randn(x.shape)
    for got, s, di in zip((x + d).unbind(), x.unbind(), d):
        torch.testing.assert_close(got, s + di[: s.shape[0]])
    with padless.strict_padded_reads():
        with pytest.raises(padless.StructureError, match=r"add\(\): reads a dense operand of shape \(2, 3, 4\) in padded coordinates"):
            x + d


class _AddsDenseLeaf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp):
        return inp * 2

    @staticmethod
    def backward(ctx, g):
        return g + torch.zeros(g.shape, requires_grad=True)


def test_dense_envelope_operand_requiring_grad_in_backward_is_read():
    """In a backward without create_graph grad mode is off: a padded dense operand that
    requires grad is read in padded coordinates like any other."""
    x = nested.nested_tensor(_samples([(3, 4), (2, 4)]), requires_grad=True)
    out = _AddsDenseLeaf.apply(x)
    out.backward(out.detach())
    for g, o in zip(x.grad.unbind(), out.detach().unbind()):
        torch.testing.assert_close(g, o)


def test_copy_between_different_layouts_raises_runtime_error():
    """NJT: ``a.transpose(1, 2).copy_(b)`` raises a RuntimeError; padless's refusal is one too."""
    samples = _samples([(2, 3), (2, 3)])
    pl, njt = _pair(samples)
    with pytest.raises(RuntimeError):
        njt.clone().transpose(1, 2).copy_(njt)
    with pytest.raises(RuntimeError, match=r"copy_\(\): ragged structures differ: ragged dims differ"):
        pl.clone().transpose(1, 2).copy_(pl)
    dst = pl * 0
    dst.copy_(pl)  # same structure: copies, as NJT does
    _same(dst, njt)


def test_permute_wrong_number_of_dims_raises_value_and_runtime_error():
    """``permute`` with too few dims: NJT raises a ValueError, dense torch a RuntimeError;
    padless's StructureError is caught by either clause."""
    pl, njt = _pair(_samples([(2, 3, 4), (1, 3, 4)]))
    with pytest.raises(ValueError):
        njt.permute(0, 2, 1)
    with pytest.raises(RuntimeError):
        torch.randn(2, 3, 3, 4).permute(0, 2, 1)
    msg = r"permute\(\): expected 4 dims \(batch included\), got \(0, 2, 1\)"
    for err in (ValueError, RuntimeError):
        with pytest.raises(err, match=msg):
            pl.permute(0, 2, 1)


aten = torch.ops.aten

# (name, padless/NJT call, per-sample reference): ATen reductions NJT code calls directly.
ATEN_REDUCTIONS = {
    "sum_ragged": (lambda t: aten.sum.dim_IntList(t, [1]), lambda s: s.sum(0)),
    "sum_static_keepdim": (lambda t: aten.sum.dim_IntList(t, [2], True), lambda s: s.sum(1, keepdim=True)),
    "mean_ragged": (lambda t: aten.mean.dim(t, [1]), lambda s: s.mean(0)),
    "mean_ragged_keepdim": (lambda t: aten.mean.dim(t, [1], True), lambda s: s.mean(0, keepdim=True)),
    "mean_static": (lambda t: aten.mean.dim(t, [-1]), lambda s: s.mean(-1)),
    "amax_ragged": (lambda t: aten.amax.default(t, [1]), lambda s: s.amax(0)),
    "amin_static_keepdim": (lambda t: aten.amin.default(t, [2], True), lambda s: s.amin(1, keepdim=True)),
}


@pytest.mark.parametrize("variant", ["seq", "one_sample", "empty_sample"])
@pytest.mark.parametrize("name", ATEN_REDUCTIONS)
def test_aten_reductions_per_sample(name, variant):
    """``torch.ops.aten.mean.dim`` / ``amax`` / ``amin`` on a NestedTensor: the packed
    torch-level reduction (dense ``(B, ...)`` over a ragged dim), values and gradients per sample."""
    fn, ref = ATEN_REDUCTIONS[name]
    if variant == "empty_sample" and name.startswith("amax"):
        pytest.skip("amax over an empty sample is undefined (padless raises, as torch does)")
    check_op(fn, variant, ref=ref)


@pytest.mark.parametrize("name", ATEN_REDUCTIONS)
def test_aten_reductions_match_njt(name):
    """Forward results and output kinds (dense or nested) equal NJT's."""
    fn, _ = ATEN_REDUCTIONS[name]
    pl, njt = _pair(_samples([(3, 4), (5, 4), (1, 4)], seed=2))
    a, b = fn(pl), fn(njt)
    assert isinstance(a, padless.NestedTensor) == b.is_nested
    if b.is_nested:
        _same(a, b)
    else:
        torch.testing.assert_close(a, b)


def test_aten_mean_over_the_batch_dim_alone_is_refused():
    """NJT refuses ``aten.mean.dim(nt, [0])`` with a RuntimeError; padless too, naming the rule."""
    pl, njt = _pair(_samples([(3, 4), (2, 4)]))
    with pytest.raises(RuntimeError):
        aten.mean.dim(njt, [0], True)
    with pytest.raises(RuntimeError, match=r"mean\(\): dim 0 is the batch dim of a NestedTensor"):
        aten.mean.dim(pl, [0], True)


def test_is_contiguous_answers_whether_contiguous_has_work_to_do():
    """On purpose unlike NJT: a transposed batch with one ragged dim is contiguous in padless
    (samples are stored ragged dim first whatever the dim order: ``contiguous()`` returns it
    unchanged), and ``narrow`` / ``lengths=`` results are packed copies. NJT answers False for
    all three (strided views, holes). A transposed pair is not contiguous in either sense."""
    samples = _samples([(3, 4), (2, 4)])
    pl, njt = _pair(samples)
    t = pl.transpose(1, 2)
    assert not njt.transpose(1, 2).is_contiguous()
    assert t.is_contiguous() and t.contiguous() is t
    _same(t, njt.transpose(1, 2))
    base = torch.randn(3, 6, 2)
    starts, lengths = torch.tensor([0, 2, 1]), torch.tensor([3, 1, 4])
    pl_n = nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    njt_n = torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    assert pl_n.is_contiguous() and not njt_n.is_contiguous()
    _same(pl_n, njt_n)
    pair = padless.from_list([torch.randn(3, 3, 2), torch.randn(2, 2, 2)], ragged_dims=(0, 1)).transpose(1, 2)
    assert not pair.is_contiguous() and pair.contiguous().is_contiguous()


def test_aten_sum_default_gradient_is_per_sample():
    """``torch.ops.aten.sum.default(nt)``: the sum of every real element, and a NestedTensor
    gradient of ones (ATen's own formula would give a dense gradient of the padded envelope)."""
    samples = _samples([(3, 4), (0, 4), (2, 4)], seed=6)
    pl, njt = _pair(samples, requires_grad=True)
    out = aten.sum.default(pl)
    torch.testing.assert_close(out, aten.sum.default(njt))
    out.backward()
    assert isinstance(pl.grad, padless.NestedTensor)
    _same(pl.grad, torch.nested.nested_tensor([torch.ones_like(s) for s in samples], layout=torch.jagged))
    keep = aten.sum.dim_IntList(pl.detach(), [], True)
    assert keep.shape == (1, 1, 1)
    torch.testing.assert_close(keep.reshape(()), out.detach())
