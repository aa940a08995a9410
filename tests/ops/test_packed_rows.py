"""Rows that leave the batch and come back (padless.ops.rows.packed_rows): ``x.view(-1, C)``,
row-wise work, then ``view`` back to ``x.shape`` with a new last dim, as transformers' GPT-2
``Conv1D`` and OPT's MLP write it. Sample by sample against the dense code on each sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.rows.packed_rows import PackedRows

SEQ = [(3, 8), (0, 8), (5, 8), (1, 8)]
PAIR = [(3, 3, 8), (0, 0, 8), (2, 2, 8)]


def _leaves(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    x = padless.from_list([d.clone() for d in dense]).requires_grad_()
    return x, [d.requires_grad_() for d in dense]


def conv1d(x, w, b):  # transformers.pytorch_utils.Conv1D.forward
    size_out = x.size()[:-1] + (w.shape[1],)
    x = torch.addmm(b, x.view(-1, x.size(-1)), w)
    return x.view(size_out)


def opt_mlp(h, w1, w2):  # OPTDecoderLayer's fully connected part
    shape = h.shape
    h = h.reshape(-1, h.size(-1))
    residual = h
    h = F.linear(F.relu(F.linear(F.layer_norm(h, h.shape[-1:]), w1)), w2)
    return (residual + h).view(shape)


def _check(fn, shapes, *params):
    x, dense = _leaves(shapes)
    ps = [p.detach().clone().requires_grad_() for p in params]
    out = fn(x, *params)
    assert isinstance(out, padless.NestedTensor) and out.sizes()[:, :-1].tolist() == [list(s[:-1]) for s in shapes]
    refs = [fn(d[None], *ps)[0] for d in dense]
    for got, ref in zip(out.unbind(), refs):
        torch.testing.assert_close(got, ref.detach())
    (out.values() ** 2).sum().backward()
    sum((r**2).sum() for r in refs).backward()
    for g, d in zip(x.grad.unbind(), dense):
        torch.testing.assert_close(g, d.grad)
    for p, q in zip(params, ps):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("shapes", [SEQ, [(4, 8)], PAIR], ids=["seq", "one_sample", "pairs"])
def test_conv1d_view_back(shapes):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    _check(conv1d, shapes, w, b)


@pytest.mark.parametrize("shapes", [SEQ, [(4, 8)]], ids=["seq", "one_sample"])
def test_opt_mlp_view_back(shapes):
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(16, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    _check(opt_mlp, shapes, w1, w2)


def test_rows_stay_dense_otherwise():
    x, _ = _leaves(SEQ)
    flat = x.reshape(-1, 8)
    assert isinstance(flat, PackedRows) and flat.shape == (9, 8)
    torch.testing.assert_close(flat.as_subclass(torch.Tensor), x.values())
    assert type(flat.sum(0)) is torch.Tensor  # not T rows any more
    assert type(flat.t()) is torch.Tensor
    assert type(flat * 2) is PackedRows
    # a view that does not start with the batch's envelope is the dense op, with its own error
    with pytest.raises(RuntimeError, match="invalid"):
        flat.view(2, 5, 8)
    assert type(flat.view(3, 3, 8)) is torch.Tensor  # 9 rows as (3, 3): dense, as torch does
    # plain ints equal to the envelope also bring the rows back
    y = flat.view(4, 5, 2, 4)
    assert isinstance(y, padless.NestedTensor) and y.sizes().tolist() == [[3, 2, 4], [0, 2, 4], [5, 2, 4], [1, 2, 4]]


def test_extent_of_another_batch():
    x, _ = _leaves(SEQ)
    same, _ = _leaves(SEQ, seed=3)  # same sizes: the same rows
    other, _ = _leaves([(5, 8), (0, 8), (3, 8), (1, 8)], seed=4)  # same envelope, other sizes
    flat = x.view(-1, 8)
    assert isinstance(flat.view(same.shape), padless.NestedTensor)
    with pytest.raises(RuntimeError):
        flat.view(other.shape)  # 9 rows cannot be another batch's envelope: the dense error


def test_with_a_nested_operand():
    x, _ = _leaves(SEQ)
    flat = x.view(-1, 8)
    y = x + flat.view(x.shape)
    torch.testing.assert_close(y.values(), 2 * x.values())


@pytest.mark.parametrize("op", ["view", "reshape"])
@pytest.mark.parametrize("shapes", [[(0, 1), (2, 1), (0, 1)], [(2, 1)]], ids=["with_empty", "one_sample"])
def test_widened_rows_back_to_the_batch_shape_refused(op, shapes):
    # rows widened from 1 to 3 columns, then viewed as x.shape: 2 * 3 entries happen to fill
    # (3, 2, 1) (or (1, 2, 1) * 3), but no sample alone can take its shape back: refused, not
    # a dense reshape that mixes the samples
    x, dense = _leaves(shapes)
    w = torch.randn(3, 1, dtype=torch.float64)
    rows = F.linear(x.reshape(-1, 1), w)
    for d in dense:
        if d.shape[0]:
            with pytest.raises(RuntimeError, match="invalid"):
                getattr(F.linear(d.reshape(-1, 1), w), op)(d.shape)
    with pytest.raises(padless.StructureError, match=rf"{op}\(\): these 2 rows of \(3,\) are the packed rows of a batch of .* gives every row the shape "
                       r"\(1,\), which does not hold 3 elements \(each sample alone fails the same way\)"):
        getattr(rows, op)(x.shape)
    with pytest.raises(padless.StructureError, match="does not hold 3 elements"):
        getattr(rows, op)(x.shape[0], x.shape[1], -1, 2)  # 3 columns are no whole number of (·, 2)
    back = getattr(rows, op)(x.shape[:-1] + (3,))  # the rows' own width: the batch again
    for got, d in zip(back.unbind(), dense):
        torch.testing.assert_close(got, F.linear(d, w).detach())


def test_rows_of_empty_samples_take_any_row_shape():
    x, dense = _leaves([(0, 2), (0, 2)])
    rows = F.linear(x.reshape(-1, 2), torch.randn(3, 2, dtype=torch.float64))
    y = rows.reshape(x.shape)  # each (0, 3) sample alone reshapes to (0, 2)
    assert isinstance(y, padless.NestedTensor)
    for got, d in zip(y.unbind(), dense):
        assert got.shape == d.shape == (0, 2)


@pytest.mark.parametrize("c", [1, 2])
@pytest.mark.parametrize("sizes", [[(0, 0)], [(1, 1)], [(0, 0), (1, 1)], [(3, 1), (2, 0), (1, 1)]],
                         ids=["one_empty", "one_1x1", "empty_and_1x1", "second_dim_0_or_1"])
def test_rows_of_two_ragged_dims_where_a_fold_would_fit(sizes, c):
    """``x.reshape(-1, C)`` of ``(N_i, M_i, C)`` samples is every real row, also where each
    ``M_i`` is 0 or 1 (a fold of dim 1 into the batch, then every folded ``(M_i, C)`` read as
    ``(C,)``, fits by coincidence): the rows come back with ``.view(x.size()[:-1] + (n,))`` as
    each sample alone gives (the fold was taken: a refusal, or a batch of other samples)."""
    dense = [torch.randn(n, m, c, dtype=torch.float64) for n, m in sizes]
    x = padless.from_list([d.clone() for d in dense], ragged_dims=(0, 1))
    w = torch.randn(3, c, dtype=torch.float64)
    rows = x.reshape(-1, c)
    assert isinstance(rows, PackedRows) and rows.shape == (sum(n * m for n, m in sizes), c)
    y = F.linear(rows, w).view(x.size()[:-1] + (3,))
    assert isinstance(y, padless.NestedTensor) and y.batch_size == len(sizes)
    for got, d in zip(y.unbind(), dense):
        torch.testing.assert_close(got, F.linear(d.reshape(-1, c), w).view(d.size()[:-1] + (3,)))


def test_rows_of_a_transposed_pair_batch():
    """Pairs transposed (ragged dims stored (1, 0)): ``reshape(-1, C)`` is every sample's rows in
    its own (transposed) order, as each sample alone reshapes, and comes back with
    ``.reshape(t.shape)``; ``view(-1, C)`` is refused naming the fix (the rows are not adjacent)."""
    dense = [torch.randn(n, m, 2, dtype=torch.float64) for n, m in [(2, 3), (1, 2), (0, 0)]]
    t = padless.from_list([d.clone() for d in dense], ragged_dims=(0, 1)).transpose(1, 2)
    w = torch.randn(2, 2, dtype=torch.float64)
    rows = t.reshape(-1, 2)
    assert isinstance(rows, PackedRows)
    torch.testing.assert_close(rows.as_subclass(torch.Tensor), torch.cat([d.transpose(0, 1).reshape(-1, 2) for d in dense]))
    y = F.linear(rows, w).reshape(t.shape)
    for got, d in zip(y.unbind(), dense):
        u = d.transpose(0, 1)
        torch.testing.assert_close(got, F.linear(u.reshape(-1, 2), w).reshape(u.shape))
    with pytest.raises(padless.StructureError, match=r"view\(\): this batch stores its ragged dims in another order .*"
                       r"storage order \(1, 0\).*Use reshape .*or \.contiguous\(\) first"):
        t.view(-1, 2)
    assert isinstance(t.contiguous().view(-1, 2), PackedRows)


def test_rows_of_a_transposed_batch_without_elements():
    """A transposed batch whose samples are all empty (``(0, 5, 3)`` read from ``(3, 5, 0)``):
    ``view(-1, C)`` copies nothing, so it is the (empty) rows, and comes back with
    ``.view(t.size()[:-1] + (n,))`` as the sample alone (was read as a fold of 0 samples)."""
    x = padless.from_list([torch.randn(3, 5, 0, dtype=torch.float64)], ragged_dims=(1, 2))
    t = x.permute(0, 3, 2, 1)
    rows = t.view(-1, 3)
    assert isinstance(rows, PackedRows) and rows.shape == (0, 3)
    y = F.linear(rows, torch.randn(2, 3, dtype=torch.float64)).view(t.size()[:-1] + (2,))
    assert isinstance(y, padless.NestedTensor) and y.unbind()[0].shape == (0, 5, 2)


@pytest.mark.parametrize("shapes", [SEQ, [(4, 8)]])
def test_backward_of_rows_with_nested_inputs(shapes):
    """``rows.backward(cot, inputs=[x, h])`` on packed rows reaches the NestedTensors among
    ``inputs`` (it ran below them and left ``h.grad`` and a leaf's rows' gradient empty)."""
    x, dense = _leaves(shapes)
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8).double()
    h = lin(x)
    rows = h.reshape(-1, 8) * 2
    assert isinstance(rows, PackedRows)
    cot = torch.randn(rows.shape, dtype=torch.float64)
    rows.backward(cot, inputs=[x, h])
    start = 0
    for i, d in enumerate(dense):
        hd = lin(d)
        n = d.shape[0]
        want_x, want_h = torch.autograd.grad(hd * 2, [d, hd], cot[start:start + n])
        start += n
        torch.testing.assert_close(x.grad.unbind()[i], want_x)
        torch.testing.assert_close(h.grad.unbind()[i], want_h)
