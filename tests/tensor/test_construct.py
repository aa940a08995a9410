"""Constructors and their errors."""

import pytest
import torch

import padless
from padless import NestedTensor


def test_from_list_infers_ragged_dims_and_layout():
    x = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 6)])
    assert isinstance(x, NestedTensor)
    assert x.ragged_dims == (1, 2)
    assert x.shape == (2, 3, 4, 6)
    assert x.values().shape == (4 * 5 + 2 * 6, 3)  # (sum H_i W_i, C): ragged dims first
    assert x.offsets().tolist() == [0, 20, 32]
    assert x.sizes().tolist() == [[3, 4, 5], [3, 2, 6]]
    assert x.storage_order == (1, 2, 0)


def test_layout_of_docstring_example():
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    x = padless.from_list([a, torch.empty(0, 2), b])
    assert x.values().tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    assert x.offsets().tolist() == [0, 2, 2, 5]
    assert x.sizes().tolist() == [[2, 2], [0, 2], [3, 2]]
    assert x.shape == (3, 3, 2)


def test_pair_state_rows():
    p = padless.from_list([torch.randn(3, 3, 8), torch.randn(5, 5, 8)])
    assert p.ragged_dims == (0, 1)
    assert p.values().shape == (9 + 25, 8)
    lvl0, lvl1 = p.partitions()
    assert lvl0.tolist() == [0, 3, 8]
    assert lvl1.shape == (1 + 3 + 5,)
    assert lvl1.tolist() == [0, 3, 6, 9, 14, 19, 24, 29, 34]


def test_declared_ragged_dims_stay_ragged():
    x = padless.from_list([torch.randn(4, 3), torch.randn(4, 3)], ragged_dims=(0,))
    assert x.ragged_dims == (0,)
    y = padless.from_list([torch.randn(2, 4, 4), torch.randn(2, 4, 4)], ragged_dims=(1, 2))
    assert y.ragged_dims == (1, 2)
    assert y.values().shape == (32, 2)


def test_equal_sizes_default_to_leading_ragged_dim():
    x = padless.from_list([torch.randn(4, 3), torch.randn(4, 3)])
    assert x.ragged_dims == (0,)


def test_from_nested_python_lists_and_numpy():
    import numpy as np

    x = padless.from_list([[1, 2, 3], [4], []], dtype=torch.float32)
    assert x.dtype == torch.float32
    assert x.tolist() == [[1.0, 2.0, 3.0], [4.0], []]
    y = padless.from_list([np.ones((2, 3)), np.zeros((1, 3))])
    assert y.dtype == torch.float64 and y.shape == (2, 2, 3)


def test_dtype_promotion_and_cast():
    x = padless.from_list([torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.float32)])
    assert x.dtype == torch.float32
    y = padless.from_list([torch.ones(2), torch.ones(3)], dtype=torch.float64)
    assert y.dtype == torch.float64


def test_requires_grad_leaf_receives_grad():
    x = padless.from_list([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
    assert x.is_leaf and x.requires_grad
    (x * 3).sum().backward()
    assert isinstance(x.grad, NestedTensor)
    assert x.grad.same_structure(x)
    torch.testing.assert_close(x.grad.values(), torch.full((6, 3), 3.0))


def test_keep_history_reaches_samples():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 3, requires_grad=True)
    x = padless.from_list([a, b], keep_history=True)
    assert not x.is_leaf
    (x ** 2).sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach())
    torch.testing.assert_close(b.grad, 2 * b.detach())


def test_empty_list():
    x = padless.from_list([], dtype=torch.float32, sample_shape=(None, 8))
    assert x.batch_size == 0 and x.shape == (0, 0, 8) and x.values().shape == (0, 8)
    assert x.tolist() == []
    assert (x + 1).shape == (0, 0, 8)


def test_from_padded_lengths():
    p = torch.arange(24.0).view(2, 4, 3)
    x = padless.from_padded(p, torch.tensor([3, 1]))
    assert x.sizes().tolist() == [[3, 3], [1, 3]]
    torch.testing.assert_close(x[0], p[0, :3])
    torch.testing.assert_close(x[1], p[1, :1])
    masked = p * torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).view(2, 4, 1)
    torch.testing.assert_close(x.to_padded(), masked[:, :3])  # the envelope is the longest sample
    torch.testing.assert_close(x.to_padded(output_size=(2, 4, 3)), masked)


def test_from_padded_two_ragged_dims_and_gradient():
    p = torch.randn(2, 3, 4, 5, requires_grad=True)
    x = padless.from_padded(p, torch.tensor([[2, 4], [3, 1]]))
    assert x.ragged_dims == (0, 1)
    torch.testing.assert_close(x[0], p[0, :2, :4])
    torch.testing.assert_close(x[1], p[1, :3, :1])
    x.sum().backward()
    want = torch.zeros_like(p)
    want[0, :2, :4] = 1
    want[1, :3, :1] = 1
    torch.testing.assert_close(p.grad, want)


def test_from_padded_non_leading_ragged_dim():
    p = torch.randn(2, 3, 5)  # (B, C, L)
    x = padless.from_padded(p, torch.tensor([5, 2]), ragged_dims=(1,))
    assert x.ragged_dims == (1,) and x.sizes().tolist() == [[3, 5], [3, 2]]
    torch.testing.assert_close(x[1], p[1, :, :2])


def test_from_padded_mask():
    p = torch.randn(3, 4, 2)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    x = padless.from_padded(p, mask=m)
    assert x.sizes()[:, 0].tolist() == [2, 4, 0]
    torch.testing.assert_close(x.mask()[..., 0], m[:, :4])
    img = torch.randn(2, 3, 4)
    m2 = torch.zeros(2, 3, 4, dtype=torch.bool)
    m2[0, :2, :3] = True
    m2[1, :3, :1] = True
    y = padless.from_padded(img, mask=m2)
    assert y.sizes().tolist() == [[2, 3], [3, 1]]


def test_from_values_offsets_and_lengths():
    v = torch.arange(10.0).view(5, 2)
    x = padless.from_values(v, torch.tensor([0, 2, 2, 5]))
    assert [tuple(s.shape) for s in x.unbind()] == [(2, 2), (0, 2), (3, 2)]
    assert x.values().data_ptr() == v.data_ptr()  # a view, no copy
    y = padless.from_values(v, lengths=torch.tensor([2, 0, 3]))
    assert y.same_structure(x)


def test_from_values_multi_ragged_sizes():
    v = torch.randn(4 * 5 + 2 * 6, 3)
    sizes = torch.tensor([[4, 5, 3], [2, 6, 3]])
    x = padless.from_values(v, sizes=sizes)
    assert x.ragged_dims == (0, 1) and x.shape == (2, 4, 6, 3)
    img = padless.from_values(v, sizes=torch.tensor([[3, 4, 5], [3, 2, 6]]), ragged_dims=(1, 2))
    assert img.shape == (2, 3, 4, 6)
    torch.testing.assert_close(img[0], v[:20].view(4, 5, 3).permute(2, 0, 1))


def test_from_values_keeps_history():
    v = torch.randn(5, 2, requires_grad=True)
    x = padless.from_values(v, torch.tensor([0, 2, 5]))
    (x * x).sum().backward()
    torch.testing.assert_close(v.grad, 2 * v.detach())


def test_njt_round_trip():
    njt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(5, 3)], layout=torch.jagged)
    x = padless.from_njt(njt)
    assert x.shape == (2, 5, 3)
    for a, b in zip(x.unbind(), njt.unbind()):
        torch.testing.assert_close(a, b)
    back = x.to_njt()
    assert back.is_nested and back.layout == torch.jagged
    for a, b in zip(back.unbind(), njt.unbind()):
        torch.testing.assert_close(a, b)


def test_njt_with_holes_and_transposed():
    values = torch.randn(6, 5)
    njt = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 3, 6]), torch.tensor([1, 1, 2]))
    x = padless.from_njt(njt)
    for a, b in zip(x.unbind(), njt.unbind()):
        torch.testing.assert_close(a, b)
    t = torch.nested.nested_tensor([torch.randn(2, 4, 3), torch.randn(5, 4, 3)], layout=torch.jagged).transpose(1, 2)
    y = padless.from_njt(t)
    assert y.ragged_dims == (1,)
    for a, b in zip(y.unbind(), t.unbind()):
        torch.testing.assert_close(a, b)
    for a, b in zip(y.to_njt().unbind(), t.unbind()):
        torch.testing.assert_close(a, b)


def test_to_njt_refuses_multi_ragged():
    x = padless.from_list([torch.randn(2, 3), torch.randn(3, 4)])
    with pytest.raises(ValueError, match=r"torch.nested supports one ragged dim; this NestedTensor has \(0, 1\)"):
        x.to_njt()


# ----------------------------------------------------------------------------- bad input


def test_error_rank_mismatch():
    with pytest.raises(ValueError, match=r"sample 1 has shape \(2, 3, 1\) \(rank 3\), sample 0 has shape \(2, 3\) \(rank 2\)"):
        padless.from_list([torch.randn(2, 3), torch.randn(2, 3, 1)])


def test_error_static_dim_differs():
    with pytest.raises(ValueError, match=r"sample 2 has size 5 at dim 1, sample 0 has 4; dim 1 is static \(declared ragged_dims=\(0,\)\). Declare it ragged \(ragged_dims=\(0, 1\)\)"):
        padless.from_list([torch.randn(2, 4), torch.randn(3, 4), torch.randn(1, 5)], ragged_dims=(0,))


def test_error_mixed_devices():
    a = torch.randn(2, 3)
    b = torch.randn(2, 3, device="meta")
    with pytest.raises(ValueError, match=r"sample 1 is on meta, sample 0 on cpu"):
        padless.from_list([a, b])


def test_error_strings():
    with pytest.raises(TypeError, match=r"sample 1 is a str \('hello'\)"):
        padless.from_list([torch.randn(2), "hello"])


def test_error_empty_list():
    with pytest.raises(ValueError, match="an empty list needs dtype= and sample_shape="):
        padless.from_list([])


def test_error_not_a_list():
    with pytest.raises(TypeError, match="expected a list or tuple of samples, got Tensor"):
        padless.from_list(torch.randn(3, 4))


def test_error_ragged_dim_out_of_range():
    with pytest.raises(ValueError, match="ragged dim 2 is out of range for samples of rank 2"):
        padless.from_list([torch.randn(2, 3)], ragged_dims=(2,))


def test_error_offsets_not_monotone():
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing: offsets\[1\]=3 > offsets\[2\]=2"):
        padless.from_values(torch.randn(4, 2), torch.tensor([0, 3, 2, 4]))


def test_error_offsets_wrong_end():
    with pytest.raises(ValueError, match=r"offsets must end at len\(values\)=5, but offsets\[-1\]=4"):
        padless.from_values(torch.randn(5, 2), torch.tensor([0, 2, 4]))


def test_error_offsets_must_start_at_zero():
    with pytest.raises(ValueError, match=r"offsets must start at 0"):
        padless.from_values(torch.randn(5, 2), torch.tensor([1, 2, 5]))


def test_error_lengths_disagree_with_values():
    with pytest.raises(ValueError, match="lengths and values disagree: lengths sum to 4 but values has 5 rows"):
        padless.from_values(torch.randn(5, 2), lengths=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="lengths and values disagree: sample 1 has length 9 along dim 0, but padded has extent 4"):
        padless.from_padded(torch.randn(2, 4, 3), torch.tensor([2, 9]))


def test_error_mask_not_prefix():
    m = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="mask is not a prefix mask: sample 0 has a True after a False"):
        padless.from_padded(torch.randn(2, 3), mask=m)


def test_error_sizes_disagree_with_values():
    with pytest.raises(ValueError, match=r"sample 1 has shape \(2, 6, 4\) but values' static dims are \(3,\)"):
        padless.from_values(torch.randn(32, 3), sizes=torch.tensor([[4, 5, 3], [2, 6, 4]]))


def test_leaf_gradient_accumulates_over_several_backward_calls():
    """The first .grad may come from an expanded buffer (values().sum()); accumulating into it must work."""
    x = padless.from_list([torch.randn(3, 4), torch.randn(5, 4)], requires_grad=True)
    for _ in range(3):
        x.values().sum().backward()
    x.sum().backward()
    (x * 2).sum().backward()
    x.mean(dim=1).sum().backward()
    want = [torch.full((3, 4), 6 + 1 / 3), torch.full((5, 4), 6 + 1 / 5)]
    for g, w in zip(x.grad.unbind(), want):
        torch.testing.assert_close(g, w)
