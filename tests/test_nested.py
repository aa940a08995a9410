"""Every example in the torch.nested documentation, run with padless.nested, plus multi-ragged ones."""

import pytest
import torch

import padless
from padless import NestedTensor, nested


def _samples_equal(a, b):
    ua, ub = list(a.unbind()), list(b.unbind())
    assert len(ua) == len(ub)
    for x, y in zip(ua, ub):
        torch.testing.assert_close(x, y)


def test_doc_as_nested_tensor():
    a = torch.arange(3, dtype=torch.float, requires_grad=True)
    b = torch.arange(5, dtype=torch.float, requires_grad=True)
    nt = nested.as_nested_tensor([a, b])
    assert nt.is_leaf is False
    fake_grad = nested.nested_tensor([torch.ones_like(a), torch.zeros_like(b)])
    nt.backward(fake_grad)
    assert a.grad.tolist() == [1.0, 1.0, 1.0]
    assert b.grad.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    c = torch.randn(3, 5, requires_grad=True)
    nt2 = nested.as_nested_tensor(c)
    ref = torch.nested.as_nested_tensor(c, layout=torch.jagged)
    _samples_equal(nt2, ref)
    nt2.sum().backward()
    torch.testing.assert_close(c.grad, torch.ones(3, 5))


def test_doc_as_nested_tensor_passthrough_and_errors():
    x = nested.nested_tensor([torch.randn(2), torch.randn(3)])
    assert nested.as_nested_tensor(x) is x
    assert nested.as_nested_tensor(x, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(RuntimeError, match=r"Expected tensor argument to have dim\(\) > 1"):
        nested.as_nested_tensor(torch.randn(3))
    with pytest.raises(TypeError, match="Expected first argument to be a tensor or a list / tuple of tensors"):
        nested.as_nested_tensor([1, 2])


def test_doc_nested_tensor():
    a = torch.arange(3, dtype=torch.float, requires_grad=True)
    b = torch.arange(5, dtype=torch.float, requires_grad=True)
    nt = nested.nested_tensor([a, b], requires_grad=True)
    assert nt.is_leaf is True
    ref = torch.nested.nested_tensor([a, b], layout=torch.jagged)
    _samples_equal(nt, ref)


def test_doc_to_padded_tensor():
    torch.manual_seed(1)
    samples = [torch.randn((2, 5)), torch.randn((3, 4))]
    nt = nested.nested_tensor(samples)  # two ragged dims: torch.nested's jagged layout refuses this
    ref = torch.nested.nested_tensor(samples)  # strided layout, the one the doc example uses
    torch.testing.assert_close(nested.to_padded_tensor(nt, 0.0), torch.nested.to_padded_tensor(ref, 0.0))
    torch.testing.assert_close(
        nested.to_padded_tensor(nt, 1.0, (2, 4, 6)), torch.nested.to_padded_tensor(ref, 1.0, (2, 4, 6))
    )
    with pytest.raises(RuntimeError, match="Value in output_size is less than NestedTensor padded size. Truncation is not supported."):
        nested.to_padded_tensor(nt, 2.0, (2, 2, 2))


def test_doc_narrow():
    starts = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64)
    lengths = torch.tensor([3, 2, 2, 1, 5], dtype=torch.int64)
    narrow_base = torch.randn(5, 10, 20)
    nt_narrowed = nested.narrow(narrow_base, 1, starts, lengths, layout=torch.jagged)
    ref = torch.nested.narrow(narrow_base, 1, starts, lengths, layout=torch.jagged)
    _samples_equal(nt_narrowed, ref)
    # torch's jagged narrow is a strided view with holes (is_contiguous() False); padless packs a copy.
    assert nt_narrowed.is_contiguous() is True
    fixed = nested.narrow(narrow_base, 2, 3, 4)
    assert fixed.shape == (5, 10, 4)
    for s, base in zip(fixed, narrow_base):
        torch.testing.assert_close(s, base[:, 3:7])
    with pytest.raises(ValueError, match=r"sample 4 asks for \[4, 9\) along dim 1 of size 8"):
        nested.narrow(torch.randn(5, 8, 2), 1, starts, lengths)


def test_doc_nested_tensor_from_jagged():
    values = torch.randn(12, 5)
    offsets = torch.tensor([0, 3, 5, 6, 10, 12])
    nt = nested.nested_tensor_from_jagged(values, offsets)
    assert nt.dim() == 3 and nt.shape[0] == 5 and nt.shape[2] == 5  # torch prints Size([5, j2, 5])
    assert offsets.diff().tolist() == [3, 2, 1, 4, 2]
    assert nt.offsets().diff().tolist() == [3, 2, 1, 4, 2]
    _samples_equal(nt, torch.nested.nested_tensor_from_jagged(values, offsets))

    values = torch.randn(6, 5)
    offsets = torch.tensor([0, 2, 3, 6])
    lengths = torch.tensor([1, 1, 2])
    nt = nested.nested_tensor_from_jagged(values, offsets, lengths)
    a, b, c = nt.unbind()
    assert torch.equal(a, values[0:1, :])
    assert torch.equal(b, values[2:3, :])
    assert torch.equal(c, values[3:5, :])


def test_nested_tensor_from_jagged_jagged_dim_and_max_seqlen():
    values = torch.randn(4, 7, 3)  # ragged dim of the result is dim 2, stored at values dim 1
    nt = nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 7]), jagged_dim=2, max_seqlen=5)
    ref = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 7]), jagged_dim=2)
    assert nt.ragged_dims == (1,) and nt.max_seqlen() == 5
    _samples_equal(nt, ref)
    with pytest.raises(RuntimeError, match="At least one of offsets or lengths is required"):
        nested.nested_tensor_from_jagged(values)
    with pytest.raises(ValueError, match="Expected jagged_dim >=1, but got 0"):
        nested.nested_tensor_from_jagged(values, torch.tensor([0, 4]), jagged_dim=0)


def test_doc_masked_select():
    tensor = torch.randn(3, 3)
    mask = torch.tensor([[False, False, True], [True, False, True], [False, False, True]])
    nt = nested.masked_select(tensor, mask)
    assert nt.shape[0] == 3
    assert nt.offsets().diff().tolist() == [1, 2, 1]
    _samples_equal(nt, torch.nested.masked_select(tensor, mask))

    tensor = torch.randn(6, 5)
    mask = torch.tensor([False])
    nt = nested.masked_select(tensor, mask)
    assert nt.shape[0] == 6
    assert nt.offsets().diff().tolist() == [0, 0, 0, 0, 0, 0]


# ----------------------------------------------------------------------------- beyond torch.nested


def test_multi_ragged_through_every_function():
    imgs = [torch.randn(3, 4, 5), torch.randn(3, 2, 6)]
    nt = nested.nested_tensor(imgs)
    assert nt.ragged_dims == (1, 2)
    as_nt = nested.as_nested_tensor(imgs)
    _samples_equal(nt, as_nt)
    padded = nested.to_padded_tensor(nt, 0.0)
    assert padded.shape == (2, 3, 4, 6)
    pairs = [torch.randn(n, n, 8) for n in (2, 5, 3)]
    p = nested.nested_tensor(pairs, requires_grad=True)
    assert p.ragged_dims == (0, 1) and p.values().shape == (4 + 25 + 9, 8)
    (p * p).sum().backward()
    for g, s in zip(p.grad, pairs):
        torch.testing.assert_close(g, 2 * s)


def test_binary_ops_between_separately_built_equal_structures():
    a = nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    b = nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    out = a + b  # torch.nested refuses this unless both share one offsets tensor
    for o, x, y in zip(out, a, b):
        torch.testing.assert_close(o, x + y)


def test_returns_padless_tensors():
    assert isinstance(nested.nested_tensor([torch.randn(2)]), NestedTensor)
    assert padless.nested.__all__ == [
        "nested_tensor", "as_nested_tensor", "nested_tensor_from_jagged", "narrow", "to_padded_tensor", "masked_select",
    ]


# ---------------------------------------------------------------------------- NJT parity (issue 14)


def _pair():
    torch.manual_seed(3)
    samples = [torch.randn(3, 4), torch.randn(0, 4), torch.randn(5, 4)]
    return nested.nested_tensor(samples), torch.nested.nested_tensor(samples, layout=torch.jagged)


def test_to_padded_tensor_method_like_njt():
    nt, ref = _pair()
    torch.testing.assert_close(nt.to_padded_tensor(-1.0), ref.to_padded_tensor(-1.0))
    torch.testing.assert_close(nt.to_padded_tensor(0.0, (3, 6, 4)), nested.to_padded_tensor(nt, 0.0, (3, 6, 4)))


@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_batch_and_ragged_reductions_like_njt(op, keepdim):
    nt, ref = _pair()
    torch.testing.assert_close(getattr(torch, op)(nt, dim=(0, 1), keepdim=keepdim), getattr(torch, op)(ref, dim=(0, 1), keepdim=keepdim))
    full = getattr(torch, op)(nt, dim=(0, 1, 2), keepdim=keepdim)
    torch.testing.assert_close(full, getattr(torch, op)(ref, dim=(0, 1, 2), keepdim=keepdim))
    assert full.shape == ((1, 1, 1) if keepdim else ())


@pytest.mark.parametrize("op", ["all", "any"])
def test_batch_and_ragged_logical_reductions_like_njt(op):
    nt, ref = _pair()
    assert torch.equal(getattr(torch, op)(nt > 0, dim=(0, 1)), getattr(torch, op)(ref > 0, dim=(0, 1)))


def test_batch_and_ragged_reduction_gradient():
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    nested.as_nested_tensor([a, b]).mean(dim=(0, 1)).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2, 3), 1 / 6))
    torch.testing.assert_close(b.grad, torch.full((4, 3), 1 / 6))


def test_argmax_argmin_without_dim_like_njt():
    nt, ref = _pair()
    assert int(torch.argmax(nt)) == int(torch.argmax(ref)) and int(nt.argmin()) == int(ref.argmin())
    assert nt.argmax(keepdim=True).shape == (1, 1, 1)


def test_select_batch_dim_like_njt():
    nt, ref = _pair()
    for i in (0, 1, 2, -1):
        torch.testing.assert_close(torch.select(nt, 0, i), torch.select(ref, 0, i))
        torch.testing.assert_close(nt.select(0, i), ref.select(0, i))
    torch.testing.assert_close(nt.select(2, 1).to_padded_tensor(0.0), nt.to_padded_tensor(0.0)[:, :, 1])
    with pytest.raises(IndexError, match=r"select\(\): index 3 is out of range for a batch of 3 samples"):
        nt.select(0, 3)


def test_keyword_matmul_and_bmm():
    nt, ref = _pair()
    w = torch.randn(4, 2)
    torch.testing.assert_close(torch.matmul(nt, other=w).to_padded_tensor(0.0), torch.matmul(ref, other=w).to_padded_tensor(0.0))
    torch.testing.assert_close(nt.matmul(other=w).to_padded_tensor(0.0), torch.matmul(input=nt, other=w).to_padded_tensor(0.0))
    m2 = nested.nested_tensor([torch.randn(4, 2), torch.randn(4, 2), torch.randn(4, 2)])
    torch.testing.assert_close(torch.bmm(nt, mat2=m2).to_padded_tensor(0.0), torch.bmm(nt, m2).to_padded_tensor(0.0))
    from padless.ops.pairs import contract

    with pytest.raises(TypeError, match=r"matmul\(\): unexpected keyword arguments \['bogus'\]"):
        contract.matmul(torch.matmul, nt, w, bogus=1)  # torch's parser stops such calls before padless
    with pytest.raises(TypeError, match=r"bmm\(\): unexpected keyword arguments \['bogus'\]"):
        contract.bmm(torch.bmm, nt, m2, bogus=1)


def test_structure_errors_are_runtime_errors_like_njt():
    nt, _ = _pair()
    with pytest.raises(RuntimeError, match="batch dim of a NestedTensor"):
        nt.sum(dim=0)
    with pytest.raises(padless.StructureError):
        nt.sum(dim=0)


def test_is_nested_false_on_purpose_so_modules_reach_padless_ops():
    """padless answers ``is_nested`` False and a strided layout on purpose: torch modules branch
    on ``x.is_nested`` before any op runs (``TransformerEncoderLayer``'s inference fast path,
    ``MultiheadAttention``'s nested checks) and would take torch's own nested branches. With
    False, the layer calls the ops padless implements; each sample equals the sample run alone.
    Code that only uses ``padless.nested`` functions and tensor ops behaves as with NJT."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    samples = [torch.randn(n, 8) for n in (3, 1, 5)]
    x = nested.nested_tensor(samples)
    assert not x.is_nested and x.layout == torch.strided
    with torch.no_grad():
        out = layer(x)
        for o, s in zip(out.unbind(), samples):
            torch.testing.assert_close(o, layer(s[None])[0], rtol=1e-5, atol=1e-5)
    # with is_nested True, both would stop in torch: "MultiheadAttention does not support
    # NestedTensor outside of its fast path"
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # training mode
    o, _ = mha(x, x, x, need_weights=False)
    for oi, s in zip(o.unbind(), samples):
        torch.testing.assert_close(oi, mha(s[None], s[None], s[None], need_weights=False)[0][0], rtol=1e-5, atol=1e-5)
