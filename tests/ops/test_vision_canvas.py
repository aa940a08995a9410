"""The persistent canvas (padless.ops.vision.canvas): activations that stay on one canvas between
layers. Every check is per image against the dense layer on that image alone, or, for training-mode
batch norm (whose statistics span the batch), against the rows path and the dense batch norm over
the concatenated real pixels. Values and gradients (input and parameters), float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.vision import canvas, pack, spatial
from padless.ops.vision.canvas import CanvasImages, canvas_of
from padless.testing.vision import ResNetish, check_layer, image_batch

SIZES = {
    "odd": [(37, 41), (20, 33), (50, 18), (9, 12)],
    "one_image": [(23, 17)],
    "tall_and_wide": [(41, 7), (6, 45), (12, 12)],
}


@pytest.fixture
def canvas_on(monkeypatch):
    monkeypatch.setattr(canvas, "CANVAS_PERSIST", True)


def _eval_net(widths=(4, 8), blocks=1) -> nn.Module:
    torch.manual_seed(0)
    m = ResNetish(widths=widths, classes=3, blocks=blocks).double().eval()
    g = torch.Generator().manual_seed(1)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):  # non-trivial running statistics and affine parameters
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g, dtype=torch.float64))
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g, dtype=torch.float64) + 0.5)
            mod.weight.data.copy_(torch.randn(mod.num_features, generator=g, dtype=torch.float64))
            mod.bias.data.copy_(torch.randn(mod.num_features, generator=g, dtype=torch.float64))
    return m


@pytest.mark.parametrize("case", list(SIZES))
def test_network_on_the_canvas_matches_each_image_alone(canvas_on, case):
    """Stem, max pool, residual stages (strided convs, 1x1 projections, adds, ReLUs): eval mode,
    so every image's result is the network on that image alone."""
    m = _eval_net(blocks=2)
    nt, dense = image_batch(SIZES[case], dtype=torch.float64, requires_grad=True)
    assert type(m.features(nt)) is CanvasImages  # the activations stayed on the canvas
    check_layer(m.features, nt, dense, params=list(m.parameters()))
    check_layer(m, nt, dense, params=list(m.parameters()), ref=lambda s: m(s.unsqueeze(0)).squeeze(0))


def _train_step(m: nn.Module, sizes, persist: bool, monkeypatch):
    monkeypatch.setattr(canvas, "CANVAS_PERSIST", persist)
    mm = copy.deepcopy(m)
    nt, _ = image_batch(sizes, dtype=torch.float64, requires_grad=True)
    out = mm(nt)
    (out.square().sum() + mm.features(nt).values().sum()).backward()  # a rows read of a canvas tensor too
    return out, nt.grad.values(), [p.grad for p in mm.parameters()], [b.clone() for b in mm.buffers()]


@pytest.mark.parametrize("case", list(SIZES))
def test_training_step_equals_the_rows_path(monkeypatch, case):
    """Training mode: batch statistics over the real pixels of all images; the canvas and the rows
    path (itself checked per image) agree in outputs, all gradients and running statistics."""
    m = _eval_net().train()
    a = _train_step(m, SIZES[case], True, monkeypatch)
    b = _train_step(m, SIZES[case], False, monkeypatch)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], msg=lambda s: f"input gradient: {s}")
    for i, (x, y) in enumerate(zip(a[2], b[2])):
        torch.testing.assert_close(x, y, msg=lambda s: f"parameter {i} gradient: {s}")
    for x, y in zip(a[3], b[3]):
        torch.testing.assert_close(x, y)


def test_batch_norm_statistics_over_the_real_pixels(canvas_on):
    """conv -> train-mode batch norm on the canvas against the dense batch norm of all real pixels
    concatenated; the gaps count nowhere (the canvas plane is larger than the pixels)."""
    conv = nn.Conv2d(3, 5, 3, padding=1).double()
    bn = nn.BatchNorm2d(5).double().train()
    bn.weight.data.uniform_(0.5, 2.0)
    bn.bias.data.normal_()
    ref_bn = copy.deepcopy(bn)
    nt, dense = image_batch(SIZES["odd"], dtype=torch.float64, requires_grad=True)
    y = bn(conv(nt))
    xc, lay = canvas_of(y)
    assert lay.P > lay.N
    assert torch.all(xc[lay.indices(xc.device)[2]] == 0)  # zero gaps between layers
    feats = [conv(d[None]) for d in dense]
    flat = torch.cat([f.flatten(2) for f in feats], 2)  # (1, C, N) of the real pixels
    want = F.batch_norm(flat, ref_bn.running_mean, ref_bn.running_var, ref_bn.weight, ref_bn.bias, True, 0.1, ref_bn.eps)
    splits = torch.split(want, [f.shape[2] * f.shape[3] for f in feats], 2)
    refs = [s.reshape(f.shape)[0] for s, f in zip(splits, feats)]
    for i, (got, r) in enumerate(zip(y.unbind(), refs)):
        torch.testing.assert_close(got, r, msg=lambda s: f"image {i}: {s}")
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    g = torch.Generator().manual_seed(3)
    cot = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in refs]
    got = torch.autograd.grad((y.values() * padless.from_list(cot, ragged_dims=(1, 2)).values()).sum(), [nt, conv.weight, bn.weight, bn.bias])
    want_g = torch.autograd.grad(sum((r * c).sum() for r, c in zip(refs, cot)), [*dense, conv.weight, ref_bn.weight, ref_bn.bias])
    for i, (a, b) in enumerate(zip(got[0].unbind(), want_g[: len(dense)])):
        torch.testing.assert_close(a, b, msg=lambda s: f"image {i} gradient: {s}")
    for a, b in zip(got[1:], want_g[len(dense):]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("persist", [True, False])
def test_empty_image_is_named_as_torch_refuses_it(monkeypatch, persist):
    """An empty image (no pixels) among others: torch refuses a window on it; both paths raise
    torch's error naming the image, before any canvas is built."""
    monkeypatch.setattr(canvas, "CANVAS_PERSIST", persist)
    nt, _ = image_batch([(13, 9), (0, 7), (8, 15)], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"image 1 of shape \((3, 0, 7|\d+, 0, \d+)\)"):  # torch 2.11's conv passes it on, its max pool refuses
        _eval_net()(nt)


def test_in_place_op_leaves_the_canvas(canvas_on):
    """An in-place op on a canvas tensor gathers its rows first and drops the canvas: the next
    layer reads the modified rows."""
    conv1 = nn.Conv2d(3, 4, 3, padding=1).double()
    conv2 = nn.Conv2d(4, 2, 3, padding=1).double()

    def layer(x):
        y = conv1(x)
        y.mul_(2.0)
        y = F.relu(y, inplace=True)
        return conv2(y)

    nt, dense = image_batch(SIZES["odd"], dtype=torch.float64, requires_grad=True)
    check_layer(layer, nt, dense, params=[conv1.weight, conv2.weight, conv2.bias])


@pytest.mark.parametrize("kernel,stride,padding", [(3, 2, 1), (2, 2, 0), (3, 1, 1), (1, 2, 0)])
def test_max_pool_on_the_canvas(canvas_on, kernel, stride, padding):
    """Max pooling of a canvas that is a ReLU's output (zero gaps read as they are) and of one that
    is not (gaps set to -inf), strided (re-laid) or not."""
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    for act in (torch.relu, lambda t: t):
        layer = lambda x, act=act: F.max_pool2d(act(conv(x)), kernel, stride, padding)
        nt, dense = image_batch(SIZES["tall_and_wide"], dtype=torch.float64, requires_grad=True)
        check_layer(layer, nt, dense, params=[conv.weight, conv.bias])


@pytest.mark.parametrize("groups,dilation,bias", [(1, 1, True), (2, 1, False), (1, 2, True)])
def test_convolution_chain_on_the_canvas(canvas_on, groups, dilation, bias):
    """A chain of convolutions (same, strided, 1x1 with bias, grouped, dilated) kept on the canvas,
    with an add of two canvas branches."""
    c1 = nn.Conv2d(3, 4, 3, padding=dilation, dilation=dilation, bias=bias).double()
    c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=groups, bias=bias).double()
    c3 = nn.Conv2d(4, 4, 1, bias=True).double()
    c4 = nn.Conv2d(4, 4, 1, stride=2, bias=bias).double()
    c5 = nn.Conv2d(4, 4, 3, padding=1, bias=bias).double()

    def layer(x):
        y = torch.relu(c1(x))
        z = c2(y)
        return torch.relu(c3(z) + c4(y) + c5(z))  # c5 reads a convolution's output: gaps' gradient

    nt, dense = image_batch(SIZES["odd"], dtype=torch.float64, requires_grad=True)
    assert type(layer(nt)) is CanvasImages
    check_layer(layer, nt, dense, params=[p for c in (c1, c2, c3, c4, c5) for p in c.parameters()])
    c6 = nn.Conv2d(4, 4, 3, padding=1, bias=bias).double()
    same = lambda x: c5(c6(torch.relu(c1(x))))  # a same-layout conv reads a conv's output
    check_layer(same, nt, dense, params=[p for c in (c1, c5, c6) for p in c.parameters()])


def test_canvas_mixed_with_rows(canvas_on):
    """A canvas tensor plus a rows tensor of the same images, and a row-wise op after the canvas:
    the rows are gathered once and the results are the dense ones."""
    conv = nn.Conv2d(3, 3, 3, padding=1).double()

    def layer(x):
        y = conv(x) + x  # canvas + rows: no canvas rule, the rows path
        return torch.sigmoid(torch.relu(conv(y)))

    nt, dense = image_batch(SIZES["odd"], dtype=torch.float64, requires_grad=True)
    check_layer(layer, nt, dense, params=list(conv.parameters()))


def test_plane_sides_come_from_a_ladder(monkeypatch):
    monkeypatch.setattr(pack, "QUANTIZE", True)
    sides = [pack.plane_side(n) for n in range(1, 3000)]
    assert all(s >= n for n, s in zip(range(1, 3000), sides))
    assert all(s <= max(16, n * 9 // 8 + 1) for n, s in zip(range(1, 3000), sides))
    assert len(set(sides[200:400])) <= 16  # sides 201..400: a handful of plane shapes


def test_quantized_and_exact_planes_agree(monkeypatch):
    """The rows path with plane sides rounded up (the default) and with the packed extent."""
    conv = nn.Conv2d(3, 4, 5, stride=2, padding=2).double()
    nt, dense = image_batch(SIZES["odd"], dtype=torch.float64, requires_grad=True)
    for q in (True, False):
        monkeypatch.setattr(pack, "QUANTIZE", q)
        check_layer(conv, nt, dense, params=list(conv.parameters()))


def test_plane_shapes_are_reused_across_batches(monkeypatch):
    """Batches of new image sizes run on plane shapes used before (within REUSE_AREA), with results
    equal to each image alone; the memory of shapes is bounded per layer kind."""
    monkeypatch.setattr(pack, "_PLANES", {})
    monkeypatch.setattr(pack, "REUSE_PLANES", True)
    conv = nn.Conv2d(3, 2, 3, stride=2, padding=1).double()
    g = torch.Generator().manual_seed(5)
    shapes = []
    for b in range(16):  # tight packings are reused less often than loose ones: 16 batches here
        sizes = [tuple(int(v) for v in torch.randint(10, 40, (2,), generator=g)) for _ in range(5)]
        nt, dense = image_batch(sizes, dtype=torch.float64, requires_grad=True, seed=b)
        check_layer(conv, nt, dense, params=list(conv.parameters()))
        (plan,) = [p for p in spatial._cache_of("conv2d", nt).plans.values() if isinstance(p, spatial.SpatialPlan)]
        shapes.append(plan.blocks)
        need = sum((h + 2) * (w + 2) for h, w in sizes)
        assert plan.blocks[1] * plan.blocks[2] >= need
    assert len(set(shapes)) < len(shapes)  # some batch ran on a plane shape an earlier batch made
    assert all(len(v) <= 32 for v in pack._PLANES.values())


def test_reuse_plane_repacks_at_a_known_width():
    """A remembered plane the packed extent does not fit is tried at its own width."""
    boxes = [(10, 30), (10, 30), (10, 30), (10, 30)]
    ext = lambda p: (max(y + 10 for y, _ in p), max(x + 30 for _, x in p))  # noqa: E731
    planes: dict = {}
    key = "k"
    pos, hc, wc = pack.pack_boxes(boxes, (1, 1))
    old = pack._PLANES
    try:
        pack._PLANES = planes
        planes[key] = [(20, 60)]  # 2 x 2 boxes: the same area as 4 in a row, another shape
        got, h2, w2 = pack.reuse_plane(key, boxes, (1, 1), ext, [(0, 0), (0, 30), (0, 60), (0, 90)], 10, 120)
        assert (h2, w2) == (20, 60) and ext(got) == (20, 60)
        assert sorted(got) == [(0, 0), (0, 30), (10, 0), (10, 30)]
        got, h3, w3 = pack.reuse_plane(key, [(10, 100)], (1, 1), lambda p: (10, 100), [(0, 0)], 10, 100)
        assert (h3, w3) == (10, 100) and planes[key][0] == (10, 100)  # too wide for any: a new shape
    finally:
        pack._PLANES = old


def test_reuse_plane_repacks_in_every_box_order():
    """Tallest first, these boxes overflow the remembered 21 x 9 plane; another order fits them."""
    boxes = [(11, 3), (6, 3), (9, 9)]
    ext = lambda p: (max(y + h for (y, _), (h, _) in zip(p, boxes)), max(x + w for (_, x), (_, w) in zip(p, boxes)))  # noqa: E731
    pos, hc, wc = pack.pack_boxes(boxes, (1, 1))
    assert (hc, wc) == (11, 15)
    tallest = pack.skyline(boxes, (1, 1), 9)
    assert ext(tallest[0])[0] > 21
    old = pack._PLANES
    try:
        pack._PLANES = {"k": [(21, 9)]}
        got, h2, w2 = pack.reuse_plane("k", boxes, (1, 1), ext, pos, hc, wc)
        assert (h2, w2) == (21, 9)
        eh, ew = ext(got)
        assert eh <= 21 and ew <= 9
        for i in range(3):  # no overlap
            for j in range(i):
                (y, x), (h, w), (y2, x2), (h2_, w2_) = got[i], boxes[i], got[j], boxes[j]
                assert y + h <= y2 or y2 + h2_ <= y or x + w <= x2 or x2 + w2_ <= x
    finally:
        pack._PLANES = old
