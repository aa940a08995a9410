"""The generic pointwise path, checked sample by sample through the reference harness."""

import pytest
import torch

import padless
from padless.testing import VARIANTS, check_op, make_batch

ALL = sorted(VARIANTS)
FLOAT_VARIANTS = [v for v in ALL if v != "static_zero"]

UNARY = {
    "neg": lambda x: -x,
    "abs": torch.abs,
    "exp": torch.exp,
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "softplus": torch.nn.functional.softplus,
    "square": lambda x: x ** 2,
    "rsqrt_abs": lambda x: (x.abs() + 1).rsqrt(),
    "clamp": lambda x: x.clamp(-0.5, 0.7),
    "clamp_min": lambda x: torch.clamp(x, min=0.1),
    "leaky_relu": torch.nn.functional.leaky_relu,
    "method_chain": lambda x: (x * 3 - 1).sigmoid() / 2 + 0.25,
    "rpow": lambda x: 2.0 ** x,
    "rsub": lambda x: 1 - x,
    "rdiv": lambda x: 1 / (x.abs() + 1),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@pytest.mark.parametrize("v", FLOAT_VARIANTS)
def test_unary(op, v):
    check_op(UNARY[op], v)


@pytest.mark.parametrize("op", ["sigmoid", "method_chain", "gelu", "square"])
@pytest.mark.parametrize("v", ["seq", "image", "pair", "empty_sample"])
def test_unary_bf16(op, v):
    check_op(UNARY[op], v, dtype=torch.bfloat16)


@pytest.mark.parametrize("v", FLOAT_VARIANTS)
def test_binary_same_structure(v):
    """Two NestedTensors built separately from equal shapes combine; gradients reach both."""
    a, da = make_batch(v, seed=1, requires_grad=True)
    b, db = make_batch(v, seed=2, requires_grad=True)
    out = a * b + a / (b.abs() + 1) - torch.maximum(a, b)
    refs = [x * y + x / (y.abs() + 1) - torch.maximum(x, y) for x, y in zip(da, db)]
    padless.testing.assert_close_samples(out, refs)
    cot = [torch.randn_like(r) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims))
    torch.autograd.backward(refs, cot)
    padless.testing.assert_close_samples(a.grad, [x.grad for x in da])
    padless.testing.assert_close_samples(b.grad, [y.grad for y in db])


@pytest.mark.parametrize("v", ["seq", "empty_sample", "image", "pair", "rect", "channels_first"])
def test_dense_static_broadcast(v):
    """A dense tensor broadcasting over the static dims: values and its own gradient."""
    nt, dense = make_batch(v, requires_grad=True)
    shape = [1] * nt.dim()
    static = [d for d in range(nt.sample_dim) if d not in nt.ragged_dims]
    for d in static:
        shape[d + 1] = nt.shape[d + 1]
    w = torch.randn(shape[1:], requires_grad=True)  # drop batch: broadcasting adds it
    w_ref = w.detach().clone().requires_grad_(True)
    out = nt * w + w
    refs = [s * w_ref + w_ref for s in dense]
    padless.testing.assert_close_samples(out, refs)
    cot = [torch.randn_like(r) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims))
    torch.autograd.backward(refs, cot)
    torch.testing.assert_close(w.grad, w_ref.grad)
    padless.testing.assert_close_samples(nt.grad, [s.grad for s in dense])


@pytest.mark.parametrize("v", ["seq", "image", "pair", "one_sample", "empty_sample"])
def test_dense_per_sample_broadcast(v):
    """A dense (B, 1, ..., 1, static) operand is applied per sample; its gradient is per sample."""
    nt, dense = make_batch(v, requires_grad=True)
    b = nt.batch_size
    scale = torch.randn(b, *[1] * nt.sample_dim, requires_grad=True)
    s_ref = scale.detach().clone().requires_grad_(True)
    out = nt * scale
    refs = [x * s_ref[i] for i, x in enumerate(dense)]
    padless.testing.assert_close_samples(out, refs)
    cot = [torch.randn_like(r) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims))
    torch.autograd.backward(refs, cot)
    torch.testing.assert_close(scale.grad, s_ref.grad)


def test_static_dim_grows_through_broadcast():
    nt = padless.from_list([torch.randn(2, 1), torch.randn(3, 1)])
    w = torch.arange(4.0)
    out = nt * w
    assert out.shape == (2, 3, 4)
    assert out.sizes().tolist() == [[2, 4], [3, 4]]
    for o, s in zip(out.unbind(), nt.unbind()):
        torch.testing.assert_close(o, s * w)


@pytest.mark.parametrize("v", ["seq", "image", "pair", "empty_sample"])
def test_comparisons_where_masked_fill(v):
    nt, dense = make_batch(v)
    other, odense = make_batch(v, seed=5)
    m = nt > 0
    assert m.dtype == torch.bool
    padless.testing.assert_close_samples(m, [s > 0 for s in dense])
    padless.testing.assert_close_samples(torch.where(m, nt, other), [torch.where(s > 0, s, o) for s, o in zip(dense, odense)])
    padless.testing.assert_close_samples(torch.where(m, nt, 0.0), [torch.where(s > 0, s, 0.0) for s in dense])
    padless.testing.assert_close_samples(nt.masked_fill(m, -1.0), [s.masked_fill(s > 0, -1.0) for s in dense])
    padless.testing.assert_close_samples(nt.masked_fill(m, torch.tensor(3.0)), [s.masked_fill(s > 0, 3.0) for s in dense])
    padless.testing.assert_close_samples(torch.clamp(nt, min=other), [torch.clamp(s, min=o) for s, o in zip(dense, odense)])
    padless.testing.assert_close_samples((nt > 0) & (other < 0), [(s > 0) & (o < 0) for s, o in zip(dense, odense)])
    padless.testing.assert_close_samples(~m, [~(s > 0) for s in dense])


def test_where_gradient():
    check_op(lambda x: torch.where(x > 0, x * 2, x.exp()), "image")
    check_op(lambda x: x.masked_fill(x < 0, 0.5) * x, "pair")


@pytest.mark.parametrize("v", ["seq", "image", "empty_sample", "pair"])
def test_inplace(v):
    nt, dense = make_batch(v)
    other, odense = make_batch(v, seed=3)
    nt.add_(other).mul_(2).clamp_(max=1.5).masked_fill_(nt < -1, 0.0).sigmoid_()
    refs = [((s + o) * 2).clamp(max=1.5) for s, o in zip(dense, odense)]
    refs = [r.masked_fill(r < -1, 0.0).sigmoid() for r in refs]
    padless.testing.assert_close_samples(nt, refs)
    nt.zero_()
    assert float(nt.values().abs().sum()) == 0.0
    nt.fill_(2.5)
    assert bool((nt.values() == 2.5).all())


def test_inplace_on_leaf_requiring_grad_raises():
    nt, _ = make_batch("seq", requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        nt.add_(1)


def test_type_promotion():
    i, idense = make_batch("seq", dtype=torch.int64)
    f, fdense = make_batch("seq", dtype=torch.float32, seed=4)
    assert (i + 1).dtype == torch.int64
    assert (i * 0.5).dtype == torch.float32
    assert (i + f).dtype == torch.float32
    assert (i / 2).dtype == torch.float32
    h = f.half()
    assert (h + f).dtype == torch.float32
    assert (h * 2.0).dtype == torch.float16
    padless.testing.assert_close_samples(i + f, [a + b for a, b in zip(idense, fdense)])
    assert (f + torch.tensor(1.0, dtype=torch.float64)).dtype == torch.float32  # 0-d does not promote


def test_integer_and_bool_ops():
    i, idense = make_batch("image", dtype=torch.int32, low=-5, high=5)
    padless.testing.assert_close_samples(i // 2, [s // 2 for s in idense])
    padless.testing.assert_close_samples(i % 3, [s % 3 for s in idense])
    padless.testing.assert_close_samples(i.bitwise_and(6), [s.bitwise_and(6) for s in idense])
    padless.testing.assert_close_samples(i.abs(), [s.abs() for s in idense])


# ----------------------------------------------------------------------------- errors


def test_mismatched_structures_raise_with_sample_and_shapes():
    a = padless.from_list([torch.randn(2, 6, 8), torch.randn(2, 6, 8)], ragged_dims=(0, 1))
    b = padless.from_list([torch.randn(2, 6, 8), torch.randn(3, 4, 8)], ragged_dims=(0, 1))
    with pytest.raises(ValueError, match=r"add\(\): ragged structures differ: sample 1 has \(2, 6, 8\), other has \(3, 4, 8\)"):
        a + b
    c = padless.from_list([torch.randn(2, 8)])
    with pytest.raises(ValueError, match=r"mul\(\): ragged structures differ: batch sizes differ: 2 vs 1"):
        a * c
    d = padless.from_list([torch.randn(2, 8), torch.randn(3, 8)])
    with pytest.raises(ValueError, match=r"sample ranks differ: 3 vs 2"):
        a - d


def test_dense_operand_spanning_ragged_dim_raises():
    nt = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(ValueError, match=r"mul\(\): a dense operand of shape \(4, 4\) spans ragged dim 1 \(size 4\)"):
        nt * torch.randn(4, 4)  # (3, 4), the envelope's extent, is read in padded coordinates
    with pytest.raises(ValueError, match=r"has 5 entries on the batch dim, the NestedTensor has 2 samples"):
        nt * torch.randn(5, 1, 4)
    with pytest.raises(ValueError, match="more dims than the NestedTensor"):
        nt + torch.randn(1, 2, 1, 4)


def test_inplace_dense_with_nested_operand_raises():
    nt = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises((ValueError, RuntimeError)):
        torch.zeros(4).add_(nt)


def test_unsupported_aten_op_names_op_and_types():
    nt = padless.from_list([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(NotImplementedError, match=r"aten\.cumsum\.default is not supported on NestedTensor \(called with NestedTensor\(ragged_dims=\(0,\)"):
        torch.ops.aten.cumsum.default(nt, 0)


def test_fast_path_and_aten_path_agree():
    """No-grad calls take the torch-level fast path; grad calls go through ATen. Same values."""
    nt, dense = make_batch("image")
    other, _ = make_batch("image", seed=9)
    fns = [
        lambda x, y: x * 2 + y, lambda x, y: torch.nn.functional.gelu(x), lambda x, y: torch.where(x > y, x, y),
        lambda x, y: torch.clamp(x, min=-0.5) ** 2, lambda x, y: x.masked_fill(y > 0, 1.0), lambda x, y: 1 / (x.abs() + 1),
    ]
    for f in fns:
        with torch.no_grad():
            fast = f(nt, other)
        slow = f(nt.detach().requires_grad_(), other)
        torch.testing.assert_close(fast.values(), slow.values().detach())


def test_functional_inplace_flag_is_respected():
    nt, dense = make_batch("seq")
    out = torch.nn.functional.relu(nt, inplace=True)
    assert out is nt
    padless.testing.assert_close_samples(nt, [d.relu() for d in dense])


def test_inplace_bumps_version_so_autograd_catches_it():
    w = torch.randn(4, requires_grad=True)
    nt, _ = make_batch("seq")
    e = nt.exp()
    y = e * w
    e.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_where_single_argument_is_not_elementwise():
    nt, _ = make_batch("seq")
    with pytest.raises(NotImplementedError, match="nonzero"):
        torch.where(nt > 0)
