"""Any image geometry under ``torch.compile(fullgraph=True)``, with no preparation call.

Floor and ceil pooling, any stride, padding and dilation, reflect / replicate / circular
padding, and ``F.interpolate`` to every image's own size (``size=skip.shape[2:]``, a per-image
list, a CPU size tensor) compile into one graph over batches whose image sizes and batch size
change: output sizes are computed in the graph from the host sides the batch carries, and
row counts are unbacked symbols (:mod:`padless.ops.vision.compiled`). Every test compares the
compiled outputs and gradients with each image run alone through the dense module, and
counts graphs with ``CompileCounterWithBackend`` (aot_eager: compiles are slow on a 2-core CPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.testing import assert_close_samples
from padless.testing.vision import image_batch

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")
# make test runs one padding mode of the tiny-image test; PADLESS_COMPILE_LONG=1 runs all three
LONG = os.environ.get("PADLESS_COMPILE_LONG", "") not in ("", "0")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _block(cin: int, cout: int, mode: str) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, padding_mode=mode), nn.GroupNorm(2, cout), nn.ReLU())


class UNet(nn.Module):
    """A small U-Net: reflect-padded convs, MaxPool2d(2) (floor), ceil-mode pooling, a strided
    conv with a strided 1x1 shortcut (a residual add of two paths to one size), and bilinear
    upsampling to each skip's size read from its shape, as smp's decoder does."""

    def __init__(self, c: int = 3, w: int = 4, mode: str = "reflect", classes: int = 2):
        super().__init__()
        self.enc1 = _block(c, w, mode)
        self.pool1 = nn.MaxPool2d(2)
        self.enc2 = _block(w, 2 * w, mode)
        self.pool2 = nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)
        self.down = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)
        self.short = nn.Conv2d(2 * w, 2 * w, 1, stride=2)
        self.mid = _block(2 * w, 2 * w, mode)
        self.dec2 = _block(4 * w, w, mode)
        self.dec1 = _block(2 * w, w, mode)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x):
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool1(s1))
        m = self.pool2(s2)
        m = self.mid(m)
        r = F.relu(self.down(s2) + self.short(s2))  # strided conv + strided 1x1 shortcut: one size
        m = m + F.interpolate(r, size=m.shape[2:], mode="nearest")
        u2 = F.interpolate(m, size=s2.shape[2:], mode="bilinear", align_corners=False)
        d2 = self.dec2(torch.cat([u2, s2], 1))
        u1 = F.interpolate(d2, size=s1.shape[2:], mode="bilinear", align_corners=False)
        return self.head(self.dec1(torch.cat([u1, s1], 1)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    """Touches every output value with a different weight (gradients are not uniform)."""
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * w).sum() + 0.1 * out.square().sum()


def _check(model: nn.Module, fn, batches, channels: int = 3, backend: str = "aot_eager") -> CompileCounterWithBackend:
    """Compiled ``fn`` on each batch against ``fn`` on every image alone (values, input and
    parameter gradients); returns the graph counter."""
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    params = list(model.parameters())
    for sizes, seed in batches:
        x, dense = image_batch(sizes, channels, seed=seed, dtype=torch.float64, requires_grad=True)
        out = cfn(x)
        refs = [fn(d[None])[0] for d in dense]
        assert out.sizes().tolist() == [list(r.shape) for r in refs]
        assert_close_samples(out, refs, atol=1e-9, rtol=1e-9)
        # the same weights per pixel on both sides: the loss of each image over its own rows
        total = sum(_loss(v) for v in out.unbind())
        g = torch.autograd.grad(total, [x, *params])
        g_ref = torch.autograd.grad(sum(_loss(r) for r in refs), [*dense, *params])
        assert_close_samples(g[0], list(g_ref[: len(dense)]), atol=1e-9, rtol=1e-9)
        for a, b in zip(g[1:], g_ref[len(dense):]):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    return cnt


def _batches(bs, lo, hi, seed=0):
    out = []
    for i, b in enumerate(bs):
        rng = random.Random(100 * seed + i)
        out.append(([(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(b)], i))
    return out


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if INDUCTOR else []))
def test_unet_compiles_any_geometry_in_one_graph_without_preparation(backend):
    """The issue's target: floor and ceil pooling, reflect padding, upsampling to each skip's
    size, over 4 batches (6 with PADLESS_COMPILE_LONG=1) of changing sizes and batch sizes: at most 2 graphs, no preparation.
    ``PADLESS_COMPILE_INDUCTOR=1`` adds inductor."""
    torch.manual_seed(0)
    model = UNet().double()
    sizes = [3, 5, 2, 7, 4, 6] if LONG else [3, 5, 2, 7]  # PADLESS_COMPILE_LONG=1: six batches
    cnt = _check(model, model, _batches(sizes, 8, 30), backend=backend)
    assert cnt.frame_count <= 2, f"{cnt.frame_count} graphs over {len(sizes)} batches"
    assert cnt.frame_count == 1


@pytest.mark.parametrize("mode", ["replicate"] + (["circular", "zeros"] if INDUCTOR or LONG else []))
def test_tiny_images_and_one_image_batches(mode):
    """1-pixel-ish images (sides 1..6 where the layers allow them) and one-image batches."""
    torch.manual_seed(1)
    lo = 1 if mode in ("replicate", "zeros") else 2
    w = 4
    net = nn.ModuleDict({
        "a": _block(3, w, mode),
        "pool": nn.MaxPool2d(2, ceil_mode=True),
        "b": _block(w, w, mode),
        "avg": nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False),
        "dil": nn.Conv2d(w, w, 3, padding=2, dilation=2),
    }).double()

    def fn(x):
        s = net["a"](x)
        y = net["b"](net["pool"](s))
        z = net["dil"](net["avg"](y))
        return s + F.interpolate(y + F.interpolate(z, size=y.shape[2:], mode="nearest"), size=s.shape[2:], mode="bilinear")

    if mode == "circular":
        lo = 2  # circular padding needs a side of at least the pad at every level; keep it simple
        hi = 6
    else:
        hi = 6
    batches = _batches([2, 1, 4, 3, 1, 5], lo, hi, seed=7)
    if mode == "circular":
        batches = [([(max(h, 4), max(w_, 4)) for h, w_ in s], i) for s, i in batches]
    cnt = _check(net, fn, batches)
    assert cnt.frame_count <= 2, f"{cnt.frame_count} graphs over 6 batches"


def test_strides_paddings_dilations_and_floor_sizes_without_preparation():
    """Layers whose sizes used to need a prepared level: stride 3, unpadded kernels, floor
    pooling, kernel == stride, rectangular strides and a transposed-free 5x5 dilated conv."""
    torch.manual_seed(2)
    layers = nn.ModuleList([
        nn.Conv2d(3, 4, 3, stride=3, padding=1),
        nn.Conv2d(3, 4, 3),
        nn.Conv2d(3, 4, 4, stride=4),
        nn.Conv2d(3, 4, (3, 5), stride=(2, 3), padding=(0, 2), dilation=(1, 2)),
        nn.MaxPool2d(2),
        nn.MaxPool2d(3, 3, ceil_mode=True),
        nn.AvgPool2d((2, 3), (1, 2), ceil_mode=True),
    ]).double()

    def fn(x):
        return torch.cat([F.adaptive_avg_pool2d(m(x), 1) for m in layers], 1)  # dense (B, C, 1, 1)

    cnt = CompileCounterWithBackend("aot_eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for sizes, seed in _batches([2, 5, 3, 6] if LONG else [2, 5, 3], 8, 24, seed=3):
        x, dense = image_batch(sizes, 3, seed=seed, dtype=torch.float64, requires_grad=True)
        out = cfn(x)
        ref = torch.cat([fn(d[None]) for d in dense], 0)
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
        per_layer = [m(x) for m in layers]  # eager padless: the per-layer sizes too
        for m, e in zip(layers, per_layer):
            c = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
            assert c.sizes().tolist() == e.sizes().tolist() and tuple(c.shape) == tuple(e.shape)
    assert cnt.frame_count == 1


def test_learned_upsampling_pixel_shuffles_and_pads_in_one_graph():
    """ConvTranspose2d (output_padding, dilation, groups), pixel shuffle / unshuffle, constant
    and cropping pads: sizes a transposed layer or a shuffle makes, compiled with the rest."""
    torch.manual_seed(3)
    mods = nn.ModuleDict({
        "down": nn.Conv2d(3, 8, 3, stride=2, padding=1),
        "up": nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        "up2": nn.ConvTranspose2d(8, 8, (2, 3), stride=(1, 2), dilation=(2, 1), groups=2),
        "mix": nn.Conv2d(16, 8, 1),
    }).double()

    def fn(x):
        y = mods["down"](x)
        a = mods["up"](y)  # back to 2 * ceil(n / 2): even sides
        b = F.pixel_shuffle(mods["mix"](F.pixel_unshuffle(a, 2)), 2)  # 4 -> 16 -> 8 -> 2 channels
        c = F.pad(mods["up2"](y), (1, -1, 2, 0), value=0.25)
        return a.sum() + b.sum() + c.square().sum(), F.pad(b, (0, 1, 1, 0))

    cnt = CompileCounterWithBackend("aot_eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    params = list(mods.parameters())
    for sizes, seed in _batches([3, 2, 5, 4], 4, 17, seed=5):
        x, dense = image_batch(sizes, 3, seed=seed, dtype=torch.float64, requires_grad=True)
        total, img = cfn(x)
        refs = [fn(d[None]) for d in dense]
        torch.testing.assert_close(total, sum(r[0] for r in refs), atol=1e-9, rtol=1e-9)
        assert_close_samples(img, [r[1][0] for r in refs], atol=1e-9, rtol=1e-9)
        g = torch.autograd.grad(total + sum(_loss(v) for v in img.unbind()), [x, *params])
        g_ref = torch.autograd.grad(sum(r[0] + _loss(r[1][0]) for r in refs), [*dense, *params])
        assert_close_samples(g[0], list(g_ref[: len(dense)]), atol=1e-9, rtol=1e-9)
        for a, b in zip(g[1:], g_ref[len(dense):]):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    assert cnt.frame_count == 1


def test_interpolate_to_per_image_lists():
    """Per-image targets given as a list (constants of the graph); a CPU size tensor is refused:
    the graph cannot know its largest entry, the output's envelope."""
    x, dense = image_batch([(5, 7), (3, 4), (6, 2)], 3, dtype=torch.float64)
    targets = [(2, 3), (7, 7), (1, 5)]
    out = torch.compile(lambda t: F.interpolate(t, size=targets, mode="bilinear"), backend="aot_eager", fullgraph=True)(x)
    assert_close_samples(out, [F.interpolate(d[None], size=s, mode="bilinear")[0] for d, s in zip(dense, targets)])
    assert out.sizes().tolist() == [[3, *s] for s in targets] and tuple(out.shape) == (3, 3, 7, 7)
    with pytest.raises(Exception, match=r"a size tensor is data whose largest entry \(the envelope\) the graph cannot know"):
        torch.compile(lambda t, s: F.interpolate(t, size=s), backend="eager", fullgraph=True)(x, torch.tensor(targets))


def test_size_arithmetic_on_an_extent_is_refused_under_compile():
    """Eagerly ``skip.shape[-1] // 3`` names every image's own third; the compiled graph cannot
    follow that arithmetic per image, so it says so instead of using the envelope. (Arithmetic
    that gives a size some layer made, ``shape[-1] // 2`` after ``max_pool2d(x, 2)``, names that
    layer's images, which are the same sizes.)"""
    x, dense = image_batch([(8, 12), (6, 6)], dtype=torch.float64)
    with pytest.raises(Exception, match=r"a size computed from an image batch's shape \(.*\) cannot name every image's own size"):
        torch.compile(lambda t: F.interpolate(F.max_pool2d(t, 2), size=(t.shape[2] // 3, t.shape[3] // 3)),
                      backend="eager", fullgraph=True)(x)
    masks = padless.from_list([torch.zeros(8, 12), torch.zeros(6, 6)])  # never seen by a spatial op
    with pytest.raises(Exception, match=r"a size read from the shape of the NestedTensor input L\['m'\], which no spatial op"):
        torch.compile(lambda t, m: F.interpolate(t, size=m.shape[-2:]), backend="eager", fullgraph=True)(x, masks)
    out = torch.compile(lambda t, m: F.interpolate(t, size=m), backend="aot_eager", fullgraph=True)(x, masks)  # the fix
    assert out.sizes().tolist() == [[3, 8, 12], [3, 6, 6]]
    half = torch.compile(lambda t: F.interpolate(F.max_pool2d(t, 2), size=(t.shape[2] // 2, t.shape[3])),
                         backend="aot_eager", fullgraph=True)(x)
    assert_close_samples(half, [F.interpolate(F.max_pool2d(d[None], 2), size=(d.shape[1] // 2, d.shape[2]))[0] for d in dense])


def test_a_batch_without_host_sizes_reads_them_once_in_the_graph():
    """A batch built from device tensors alone (no host sizes) carries nothing; the graph reads
    its sizes at the first spatial op (one read per batch, not per layer) and runs the same."""
    from padless.tensor.core import NestedTensor

    x, dense = image_batch([(9, 12), (5, 7), (6, 6)], dtype=torch.float64)
    bare = NestedTensor(x._values, x._offsets, x._sizes, x._ragged, x._env)
    assert bare._meta.host_sizes is None
    names, _ = bare.__tensor_flatten__()
    assert "_image_host_hw" not in names

    def fn(t):
        y = F.max_pool2d(F.pad(t, (1, 1, 1, 1), mode="reflect"), 2)
        return F.interpolate(F.avg_pool2d(y, 3, 2, ceil_mode=True), size=t.shape[2:], mode="bilinear")

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(bare)
    assert bare._meta.host_sizes is None  # nothing was read outside the graph
    assert_close_samples(out, [fn(d[None])[0] for d in dense], atol=1e-9, rtol=1e-9)
