"""Convolutions on packed images and sequences (padless/ops/vision/conv.py), image by image against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.testing.vision import IMAGE_VARIANTS, check_layer, image_batch

D = torch.float64
SIZES = {name: [s[1:] for s in v.shapes] for name, v in IMAGE_VARIANTS.items()}


def _conv(cin: int, cout: int, k, **kw) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(cin, cout, k, **kw).to(D)


@pytest.mark.parametrize("variant", sorted(SIZES))
@pytest.mark.parametrize(
    "k, kw",
    [
        (3, dict(padding=1)),
        (7, dict(stride=2, padding=3)),
        (3, dict(stride=2, padding=1, bias=False)),
        (1, dict(stride=2)),
        ((3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))),
        (3, dict(padding="same", dilation=2)),
        (2, dict(padding="same")),
        (3, dict(padding="valid")),
        (2, dict(stride=2)),  # kernel == stride: the patch path
        (1, dict()),  # 1x1: a matmul on the pixel rows
    ],
    ids=["3x3p1", "7x7s2p3", "3x3s2nobias", "1x1s2", "asym_dil", "same_dil2", "same_even", "valid", "patch2", "1x1"],
)
def test_conv2d_each_image_alone(variant, k, kw):
    conv = _conv(3, 4, k, **kw)
    sizes = SIZES[variant]
    if variant == "tall_and_wide" and k == 7:
        sizes = [(h + 4, w + 4) for h, w in sizes]
    x, dense = image_batch(sizes, seed=1, dtype=D, requires_grad=True)
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    check_layer(conv, x, dense, params=params)


def test_conv2d_groups_and_depthwise():
    x, dense = image_batch(SIZES["odd_sizes"], channels=4, seed=2, dtype=D, requires_grad=True)
    for conv in (_conv(4, 6, 3, padding=1, groups=2), _conv(4, 4, 3, padding=1, stride=2, groups=4)):
        check_layer(conv, x, dense, params=[conv.weight, conv.bias])


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv2d_padding_modes(mode):
    """nn.Conv2d pads through F.pad first (padless/ops/vision/pixel_layout.py), then convolves."""
    pytest.importorskip("padless.ops.vision.pixel_layout", reason="F.pad of ragged dims is not in this tree")
    conv = _conv(3, 4, 3, padding=1, stride=2, padding_mode=mode)
    x, dense = image_batch(SIZES["odd_sizes"], seed=3, dtype=D, requires_grad=True)
    check_layer(conv, x, dense, params=[conv.weight, conv.bias])


@pytest.mark.parametrize(
    "k, kw",
    [(2, dict(stride=2)), (3, dict(stride=2, padding=1, output_padding=1)), (4, dict(stride=2, padding=1)), (3, dict(dilation=2)), (3, dict(stride=3, groups=3))],
    ids=["up2", "outpad", "k4s2p1", "dil2", "groups"],
)
def test_conv_transpose2d_each_image_alone(k, kw):
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(3, 6, k, **kw).to(D)
    x, dense = image_batch(SIZES["odd_sizes"] + [(1, 1)], seed=4, dtype=D, requires_grad=True)
    check_layer(conv, x, dense, params=[conv.weight, conv.bias])


def _seqs(lengths, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(c, n, generator=g, dtype=D) for n in lengths]
    x = padless.from_list([d.clone() for d in dense], ragged_dims=(1,), requires_grad=True)
    return x, [d.requires_grad_() for d in dense]


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=2, dilation=2), dict(padding="same"), dict(stride=3, groups=2)])
def test_conv1d_each_sequence_alone(kw):
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 6, 3, **kw).to(D)
    x, dense = _seqs([10, 3, 17, 5])
    out = check_layer(conv, x, dense, params=[conv.weight, conv.bias])
    assert out.ragged_dims == (1,)


def test_conv_transpose1d_each_sequence_alone():
    torch.manual_seed(0)
    conv = nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1).to(D)
    x, dense = _seqs([6, 1, 9])
    check_layer(conv, x, dense, params=[conv.weight, conv.bias])


def test_conv2d_one_image_and_bf16():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x, dense = image_batch([(5, 7)], seed=5, requires_grad=True)
    check_layer(conv, x, dense, params=[conv.weight, conv.bias], atol=1e-5, rtol=1e-4)
    xb = x.detach().to(torch.bfloat16)
    yb = conv.to(torch.bfloat16)(xb)
    torch.testing.assert_close(yb.unbind()[0], conv(dense[0].detach().to(torch.bfloat16)[None])[0], atol=2e-2, rtol=2e-2)


def test_gradcheck_conv_family():
    sizes = torch.tensor([[2, 3, 4], [2, 1, 2], [2, 4, 3]])
    n = int((sizes[:, 1] * sizes[:, 2]).sum())
    v = torch.randn(n, 2, dtype=D, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=D, requires_grad=True)
    b = torch.randn(3, dtype=D, requires_grad=True)
    wt = torch.randn(2, 3, 3, 3, dtype=D, requires_grad=True)

    def f(v, w, b, wt):
        x = padless.from_values(v, sizes=sizes, ragged_dims=(1, 2))
        y = F.conv2d(x, w, b, stride=2, padding=1)
        z = F.conv_transpose2d(x, wt, None, stride=2, padding=1, output_padding=1)
        return y.values(), z.values()

    assert torch.autograd.gradcheck(f, (v, w, b, wt), fast_mode=True)


def test_conv_image_too_small_names_the_image():
    x = padless.from_list([torch.randn(3, 9, 9), torch.randn(3, 2, 2)])
    with pytest.raises(RuntimeError, match=r"conv2d\(\): image 1 of shape \(3, 2, 2\) is too small for this layer: .*(Kernel size can't be greater than actual input size|Output size is too small)"):  # torch 2.13 / 2.11
        F.conv2d(x, torch.randn(4, 3, 3, 3))
    with pytest.raises(RuntimeError, match=r"conv2d\(\): image 1 of shape \(3, 2, 2\) is too small"):
        F.conv2d(x, torch.randn(4, 3, 4, 4), stride=4)  # the patch path too
    seq = padless.from_list([torch.randn(2, 5), torch.randn(2, 1)], ragged_dims=(1,))
    with pytest.raises(RuntimeError, match=r"conv1d\(\): image 1 of shape \(2, 1\) is too small"):
        F.conv1d(seq, torch.randn(2, 2, 3))


def test_conv_argument_errors():
    x = padless.from_list([torch.randn(3, 9, 9), torch.randn(3, 5, 6)])
    with pytest.raises(ValueError, match=r"conv2d\(\): padding='same' is not supported for strided convolutions"):
        F.conv2d(x, torch.randn(4, 3, 3, 3), stride=2, padding="same")
    with pytest.raises(ValueError, match=r"conv2d\(\): padding must be 'same', 'valid'"):
        F.conv2d(x, torch.randn(4, 3, 3, 3), padding="full")
    with pytest.raises(ValueError, match=r"conv2d\(\): stride must be an int >= 1"):
        F.conv2d(x, torch.randn(4, 3, 3, 3), stride=0)
    with pytest.raises(ValueError, match=r"conv2d\(\): weight expects 4 input channels \(weight.shape\[1\] \* groups\), the images have 3"):
        F.conv2d(x, torch.randn(4, 2, 3, 3), groups=2)
    with pytest.raises(TypeError, match=r"conv2d\(\): weight and bias must be dense tensors"):
        F.conv2d(x, x)
    with pytest.raises(ValueError, match=r"conv2d\(\): weight must be \(out_channels"):
        F.conv2d(x, torch.randn(4, 3, 3))
    with pytest.raises(padless.StructureError, match=r"conv2d\(\): expected images \(C, H_i, W_i\), got samples of rank 2; use conv1d"):
        F.conv2d(padless.from_list([torch.randn(3, 4)], ragged_dims=(1,)), torch.randn(4, 3, 3, 3))
    with pytest.raises(padless.StructureError, match=r"conv2d\(\): expected images \(C, H_i, W_i\) with ragged sample dims \(1, 2\)"):
        F.conv2d(padless.from_list([torch.randn(4, 4, 3)], ragged_dims=(0, 1)), torch.randn(4, 4, 3, 3))
    with pytest.raises(ValueError, match=r"conv1d\(\): expected sequences \(C, L_i\)"):
        F.conv1d(x, torch.randn(4, 3, 3))
    with pytest.raises(RuntimeError, match=r"conv_transpose2d\(\): .*output padding must be smaller than either stride or dilation"):
        F.conv_transpose2d(x, torch.randn(3, 4, 3, 3), output_padding=1)
