"""Compiled max pooling and strided 1x1 projections checked against each image alone.

Under ``torch.compile`` a max pool is an index island (the input row of every maximum) and a
gather in the graph, whose backward is a scatter (no recompute of the pool); a strided 1x1
convolution runs its eager body (the rows of its pixels times the flat weight) and its
backward is two matmuls and an ``index_copy`` (no canvas). Values and gradients are checked
per image against the dense op on that image, one graph over changing batches (and a one-image
batch), with aot_eager and inductor. (Torch refuses these layers on an empty image, eagerly too.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.testing import assert_close_samples

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# the one-image batch last: a batch of one is a graph of its own (torch specialises sizes 0 and 1)
SHAPES = [[(9, 7), (5, 11), (1, 1)], [(6, 6), (1, 4), (8, 13), (2, 5)], [(7, 9), (10, 4), (3, 3)], [(12, 3)]]
POOL_SHAPES = [[(9, 7), (5, 11), (3, 3)], [(6, 6), (8, 13), (4, 5)], [(7, 9), (10, 4), (3, 7)], [(12, 3)]]  # torch refuses windows larger than an image


def _dense_or_empty(fn, d: torch.Tensor, channels: int) -> torch.Tensor:
    if d.shape[1] * d.shape[2] == 0:
        return d.new_zeros((channels, 0, 0))
    return fn(d[None])[0]


def _run(fn, channels_out: int, params: list[torch.Tensor], backend: str, shapes: list, c: int = 3) -> None:
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for k, sizes in enumerate(shapes):
        if len(sizes) == 1:
            assert cnt.frame_count == 1, f"{cnt.frame_count} graphs over {k} batches"
        g = torch.Generator().manual_seed(k)
        dense = [torch.randn((c, h, w), generator=g, dtype=torch.float64) for h, w in sizes]
        x = padless.from_list([d.clone() for d in dense], ragged_dims=(1, 2), requires_grad=True)
        out = cfn(x)
        refs = [_dense_or_empty(fn, d, channels_out) for d in dense]
        assert_close_samples(out, refs)
        wv = torch.linspace(0.5, 1.5, out.values().numel(), dtype=out.dtype).view(out.values().shape)
        (out.values() * wv).sum().backward()
        grads_c = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        leaves = [d.clone().requires_grad_(True) for d in dense]
        total = 0.0
        start = 0
        for d, r in zip(leaves, refs):
            if d.shape[1] * d.shape[2] == 0:
                continue
            y = fn(d[None])[0]
            n = y.shape[1] * y.shape[2]
            w = wv[start : start + n].reshape(y.shape[1], y.shape[2], -1).permute(2, 0, 1)
            total = total + (y * w).sum()
            start += n
        total.backward()
        gx = [d.grad if d.grad is not None else torch.zeros_like(d) for d in leaves]
        assert_close_samples(x.grad, gx, what="input gradient")
        for a, p in zip(grads_c, params):
            torch.testing.assert_close(a, p.grad)
            p.grad = None
    assert cnt.frame_count <= 2, f"{cnt.frame_count} graphs over {len(shapes)} batches"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("geometry", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2), dict(kernel_size=3, stride=3, ceil_mode=True), dict(kernel_size=2, stride=2, dilation=2)])
def test_compiled_max_pool_per_image(backend, geometry):
    if backend == "inductor" and geometry != dict(kernel_size=3, stride=2, padding=1):
        pytest.skip("inductor: one geometry (compiles are slow on a 2-core CPU)")
    conv = nn.Conv2d(3, 4, 1).double()  # a matmul on the rows: the empty image passes
    pool = nn.MaxPool2d(**geometry)
    fn = lambda t: pool(F.relu(conv(t)) - 0.5)  # noqa: E731  negative values: the gaps' -inf matters
    _run(fn, 4, list(conv.parameters()), backend, POOL_SHAPES)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("stride", [2, (2, 3)])
def test_compiled_strided_projection_per_image(backend, stride):
    if backend == "inductor" and (stride != 2 or not INDUCTOR):
        pytest.skip("inductor: one stride, with PADLESS_COMPILE_INDUCTOR=1 (compiles are slow on a 2-core CPU; "
                    "test_compiled_max_pool_per_image keeps one inductor run in make test)")
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 1).double()
    proj = nn.Conv2d(5, 6, 1, stride=stride).double()
    fn = lambda t: proj(F.relu(conv(t)))  # noqa: E731
    _run(fn, 6, [*conv.parameters(), *proj.parameters()], backend, SHAPES)
