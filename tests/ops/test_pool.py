"""Pooling of packed images (padless/ops/vision/pool.py), image by image against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.vision.batch_dense import BatchDense
from padless.testing.vision import IMAGE_VARIANTS, check_layer, image_batch

D = torch.float64
SIZES = {name: [s[1:] for s in v.shapes] for name, v in IMAGE_VARIANTS.items()}


@pytest.mark.parametrize("variant", sorted(SIZES))
@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        dict(kernel_size=2, ceil_mode=True),
        dict(kernel_size=3, stride=1, padding=1, dilation=2),
        dict(kernel_size=(3, 2), stride=(3, 1), padding=(1, 0), ceil_mode=True),
    ],
    ids=["3s2p1", "ceil", "2ceil", "dil2", "asym"],
)
def test_max_pool2d_each_image_alone(variant, kw):
    x, dense = image_batch(SIZES[variant], seed=1, dtype=D, requires_grad=True)
    check_layer(nn.MaxPool2d(**kw), x, dense)


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        dict(kernel_size=2, ceil_mode=True, count_include_pad=False),
        dict(kernel_size=3, stride=1, padding=1, divisor_override=4),
    ],
    ids=["3s2p1", "ceil", "ceil_nopad", "2ceil_nopad", "divisor"],
)
@pytest.mark.parametrize("variant", ["odd_sizes", "tall_and_wide"])
def test_avg_pool2d_each_image_alone(variant, kw):
    x, dense = image_batch(SIZES[variant], seed=2, dtype=D, requires_grad=True)
    check_layer(nn.AvgPool2d(**kw), x, dense)


@pytest.mark.parametrize("size", [1, (2, 3), 4])
@pytest.mark.parametrize("layer", [nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d])
def test_adaptive_pool2d_dense_output(layer, size):
    x, dense = image_batch(SIZES["odd_sizes"] + [(1, 1)], seed=3, dtype=D, requires_grad=True)
    out = check_layer(layer(size), x, dense)
    oh, ow = (size, size) if isinstance(size, int) else size
    # dense; a map of several cells remembers its batch (padless.ops.vision.batch_dense)
    assert type(out) is (torch.Tensor if oh * ow == 1 else BatchDense) and out.shape == (5, 3, oh, ow)


def test_adaptive_avg_pool2d_one_image_and_many():
    for sizes in ([(6, 9)], [(3, 2)] * 70):  # a batch of one; more images than the per-image path takes
        x, dense = image_batch(sizes, seed=4, dtype=D, requires_grad=True)
        check_layer(nn.AdaptiveAvgPool2d(1), x, dense)


def test_gradcheck_pools():
    sizes = torch.tensor([[2, 3, 4], [2, 1, 2], [2, 5, 3]])
    v = torch.randn(int((sizes[:, 1] * sizes[:, 2]).sum()), 2, dtype=D, requires_grad=True)

    def f(v):
        x = padless.from_values(v, sizes=sizes, ragged_dims=(1, 2))
        a = F.max_pool2d(x, 2, 1, 1).values()
        b = F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False).values()
        c = F.adaptive_avg_pool2d(x, (2, 2))
        return a, b, c

    assert torch.autograd.gradcheck(f, (v,), fast_mode=True)


def test_pool_errors():
    x = padless.from_list([torch.randn(3, 9, 9), torch.randn(3, 2, 2)])
    with pytest.raises(RuntimeError, match=r"max_pool2d\(\): image 1 of shape \(3, 2, 2\) is too small for this layer: .*Output size is too small"):
        F.max_pool2d(x, 3, 2)
    with pytest.raises(RuntimeError, match=r"max_pool2d\(\): pad should be at most half of effective kernel size"):
        F.max_pool2d(x, 2, 2, 2)
    with pytest.raises(NotImplementedError, match=r"max_pool2d\(\): return_indices=True is not supported"):
        F.max_pool2d(x, 2, return_indices=True)
    with pytest.raises(NotImplementedError, match=r"adaptive_max_pool2d\(\): return_indices=True is not supported"):
        F.adaptive_max_pool2d(x, 1, return_indices=True)
    with pytest.raises(ValueError, match=r"adaptive_avg_pool2d\(\): output_size must be one positive int or a pair .*None would keep"):
        F.adaptive_avg_pool2d(x, (None, 2))
    with pytest.raises(ValueError, match=r"max_pool2d\(\): kernel_size must be an int >= 1"):
        F.max_pool2d(x, 0)
    with pytest.raises(padless.StructureError, match=r"avg_pool2d\(\): expected a NestedTensor of images \(C, H_i, W_i\), got samples of rank 2"):
        F.avg_pool2d(padless.from_list([torch.randn(3, 4)], ragged_dims=(1,)), 2)
    empty = padless.from_list([torch.randn(3, 4, 4), torch.randn(3, 0, 4)], ragged_dims=(1, 2))
    with pytest.raises(RuntimeError, match=r"adaptive_max_pool2d\(\): image 1 of shape \(3, 0, 4\): .*non-zero size"):
        F.adaptive_max_pool2d(empty, 1)
    same_width = padless.from_list([torch.randn(3, 4, 4), torch.randn(3, 2, 4)])  # infers ragged dims (1,)
    with pytest.raises(padless.StructureError, match=r"max_pool2d\(\): expected images .* ragged_dims=\(1, 2\)"):
        F.max_pool2d(same_width, 2)


@pytest.mark.parametrize("size", [1, 2, (2, 3), 3])
@pytest.mark.parametrize("values", ["zeros", "two_levels", "nan"])
@pytest.mark.parametrize("shapes", [[(2, 4, 1), (2, 1, 2), (2, 3, 3)], [(2, 4, 1)]], ids=["three", "one_image"])
def test_adaptive_max_pool2d_ties_give_the_gradient_to_torchs_pixel(shapes, values, size):
    """A window whose maximum is held by several pixels (zeros after a ReLU, quantized values,
    NaN): the gradient goes to the pixel torch's kernel picks (the first maximum, the last NaN),
    as each image alone gives, not shared between the ties (seed 302880 of the long fuzz run:
    an operand equal to the input made every pixel 0)."""
    g = torch.Generator().manual_seed(3)
    dense = []
    for s in shapes:
        t = torch.randint(0, 2, s, generator=g).to(torch.float64)
        if values == "zeros":
            t = t * 0
        elif values == "nan":
            t = torch.where(torch.rand(s, generator=g) < 0.3, float("nan"), t)
        dense.append(t.requires_grad_())
    x = padless.from_list([d.detach().clone() for d in dense], ragged_dims=(1, 2)).requires_grad_()
    y = F.adaptive_max_pool2d(x, size)
    cot = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(cot)
    for i, d in enumerate(dense):
        yi = F.adaptive_max_pool2d(d[None], size)
        torch.testing.assert_close(y[i], yi[0], equal_nan=True)
        yi.backward(cot[i : i + 1])
        torch.testing.assert_close(x.grad.unbind()[i], d.grad)
