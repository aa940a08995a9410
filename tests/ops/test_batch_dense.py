"""Pyramid pooling on images at their own sizes (padless.ops.vision.batch_dense): the dense
``(B, C, k, k)`` map of ``F.adaptive_avg_pool2d(x, k)`` remembers its batch, so
``F.interpolate(pooled, size=x.shape[2:])`` brings image i's map to image i's own size, as
smp's PSPNet / UPerNet blocks do, and the concatenation with ``x`` is per image."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.vision.batch_dense import BatchDense

SIZES = [(8, 12), (12, 8), (16, 16), (5, 7)]


class PSPBlock(nn.Module):  # as smp's PSPBlock writes it
    def __init__(self, c: int, k: int) -> None:
        super().__init__()
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Conv2d(c, 2, 1), nn.ReLU())

    def forward(self, x):
        height, width = x.shape[2:]
        x = self.pool(x)
        return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=True)


class PSP(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PSPBlock(c, k) for k in (1, 2, 3, 6))

    def forward(self, x):
        return torch.cat([b(x) for b in self.blocks] + [x], dim=1)


@pytest.mark.parametrize("sizes", [SIZES, SIZES[:1]], ids=["batch", "one_image"])
def test_pyramid_pooling_per_image(sizes):
    torch.manual_seed(0)
    model = PSP(4).double()
    xs = [torch.randn(4, h, w, dtype=torch.float64) for h, w in sizes]
    x = padless.from_list(xs, ragged_dims=(1, 2)).requires_grad_()
    y = model(x)
    assert isinstance(y, padless.NestedTensor) and y.sizes().tolist() == [[12, h, w] for h, w in sizes]
    g = [torch.randn(12, h, w, dtype=torch.float64) for h, w in sizes]
    (y * padless.from_list(g, ragged_dims=(1, 2))).values().sum().backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for i, xi in enumerate(xs):
        xi = xi.clone().requires_grad_()
        ref = model(xi[None])[0]
        torch.testing.assert_close(y.unbind()[i].detach(), ref.detach())
        (ref * g[i]).sum().backward()
        torch.testing.assert_close(x.grad.unbind()[i], xi.grad)
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad)


def test_pooled_map_is_dense_otherwise():
    xs = [torch.randn(3, h, w) for h, w in SIZES]
    x = padless.from_list(xs)
    p = F.adaptive_avg_pool2d(x, 3)
    assert isinstance(p, BatchDense) and p.shape == (4, 3, 3, 3)
    assert type(p.mean()) is torch.Tensor and type(p.flatten(1)) is BatchDense
    # plain ints: every image to that size, dense, as torch does
    assert type(F.interpolate(p, size=(int(x.shape[2]), 5))) is BatchDense
    # global pooling stays a plain tensor (a 1x1 map reads the same in any coordinates)
    assert type(F.adaptive_avg_pool2d(x, 1)) is torch.Tensor
    other = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 2)])
    with pytest.raises(padless.StructureError, match="batch of 2 samples"):
        F.interpolate(p, size=other.shape[2:])
