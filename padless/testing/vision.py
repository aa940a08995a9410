"""Image builders, the per-image reference for layers with parameters, and the small
vision models shared by the spatial tests, examples and ``benchmarks/vision.py``."""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from padless.tensor.construct import from_list
from padless.tensor.core import NestedTensor
from padless.testing.reference import assert_close_samples
from padless.testing.variants import Variant

__all__ = ["IMAGE_VARIANTS", "ResNetish", "check_layer", "image_batch", "random_image_sizes"]

IMAGE_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("odd_sizes", ((3, 9, 13), (3, 5, 4), (3, 12, 7), (3, 7, 7)), (1, 2), "sides not multiples of the stride"),
        Variant("one_image", ((3, 11, 6),), (1, 2), "a one-image batch"),
        Variant("equal_sizes", ((3, 6, 6), (3, 6, 6)), (1, 2), "declared ragged, sizes agree"),
        Variant("tall_and_wide", ((3, 17, 3), (3, 3, 19), (3, 4, 4)), (1, 2), "extreme aspect ratios"),
    ]
}


def random_image_sizes(rng: random.Random, batch: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """``batch`` image sizes ``(H, W)`` with sides uniform in ``[lo, hi]``."""
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(batch)]


def image_batch(
    sizes: Sequence[tuple[int, int]],
    channels: int = 3,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> tuple[NestedTensor, list[Tensor]]:
    """A packed batch of random images ``(channels, H_i, W_i)`` and the same images as dense
    leaves (the reference side)."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn((channels, h, w), generator=g, dtype=torch.float64).to(dtype) for h, w in sizes]
    nt = from_list([d.clone() for d in dense], ragged_dims=(1, 2), requires_grad=requires_grad)
    return nt, [d.requires_grad_(requires_grad) for d in dense]


def check_layer(
    layer: Callable[[Tensor], Tensor],
    nt: NestedTensor,
    dense: Sequence[Tensor],
    *,
    params: Sequence[Tensor] = (),
    ref: Callable[[Tensor], Tensor] | None = None,
    seed: int = 1,
    **tol,
) -> Tensor:
    """``layer`` on the packed batch against ``ref`` (default: ``layer``) on each image alone,
    as a batch of one: outputs, the gradient of every image and of every parameter in
    ``params`` (for the loss ``sum_i <out_i, cot_i>`` with random cotangents)."""
    ref = ref or (lambda s: layer(s.unsqueeze(0)).squeeze(0))
    out = layer(nt)
    refs = [ref(s) for s in dense]
    assert_close_samples(out, refs, **tol)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.dtype) for r in refs]
    got_p = torch.autograd.grad(
        _pairing(out, cot), [nt, *params], allow_unused=True
    )
    want_p = torch.autograd.grad(sum((r * c).sum() for r, c in zip(refs, cot)), [*dense, *params], allow_unused=True)
    if got_p[0] is not None:
        assert_close_samples(got_p[0], [w if w is not None else torch.zeros_like(d) for w, d in zip(want_p[: len(dense)], dense)], what="input gradient", **tol)
    for j, (gp, wp) in enumerate(zip(got_p[1:], want_p[len(dense):])):
        torch.testing.assert_close(gp, wp, msg=lambda m: f"parameter {j} gradient: {m}", **tol)
    return out


def _pairing(out: Tensor, cot: Sequence[Tensor]) -> Tensor:
    if isinstance(out, NestedTensor):
        return (out.values() * from_list(list(cot), ragged_dims=out.ragged_dims, dtype=out.dtype)._values).sum()
    return (out * torch.stack(list(cot))).sum()


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm; a strided 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.proj is None else self.proj(x)))


class ResNetish(nn.Module):
    """A ResNet-style classifier in plain ``torch.nn``: 7x7/2 stem, BatchNorm2d, ReLU,
    MaxPool2d(3, 2, 1), residual stages (stride-2 downsampling, 1x1 projections),
    AdaptiveAvgPool2d(1), flatten, Linear. Runs unchanged on a dense batch or on packed
    images of any sizes."""

    def __init__(self, widths: Sequence[int] = (16, 32, 64), classes: int = 10, in_channels: int = 3, blocks: int = 1) -> None:
        super().__init__()
        w0 = widths[0]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, w0, 7, 2, 3, bias=False), nn.BatchNorm2d(w0), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = w0
        for i, w in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def features(self, x: Tensor) -> Tensor:
        return self.stages(self.stem(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))
