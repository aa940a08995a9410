"""Spatial plans (padless/ops/vision/spatial.py): caching, shared structures, layouts, no envelope."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.vision import pack, spatial
from padless.ops.vision.pack import grid_index, grid_sources
from padless.ops.vision.spatial import Geometry, build_spatial_plan, spatial_plan
from padless.testing.vision import check_layer, image_batch

D = torch.float64


def test_plan_is_cached_and_collator_plan_is_used():
    x, _ = image_batch([(20, 30), (9, 7)])
    p = build_spatial_plan(x, 7, 2, 3)  # what a Collator worker does for the stem
    assert p.out_hw.tolist() == [[10, 15], [5, 4]]
    assert spatial_plan("conv2d", x, Geometry((7, 7), (2, 2), (3, 3, 3, 3))) is p
    conv = nn.Conv2d(3, 4, 7, 2, 3)
    y = conv(x)
    assert y.sizes().tolist() == [[4, 10, 15], [4, 5, 4]]


def test_a_new_batch_object_of_the_same_sizes_finds_its_plans(monkeypatch):
    """The next step on the same image sizes (a new ``from_list``, the old batch gone) builds no
    plan: the first layer's, on the input's own sizes, included."""
    import gc

    built = []
    new_plan = spatial._new_plan
    monkeypatch.setattr(spatial, "_new_plan", lambda *a: built.append(a[1]) or new_plan(*a))
    net = nn.Sequential(nn.Conv2d(3, 4, 7, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(4, 4, 3, padding=1))
    imgs = [torch.randn(3, 37, 51), torch.randn(3, 20, 9), torch.randn(3, 64, 30)]
    for step in range(3):
        built.clear()
        x = padless.from_list(imgs, ragged_dims=(1, 2)).requires_grad_()
        net(x).values().sum().backward()
        del x
        gc.collect()
        assert len(built) == (3 if step == 0 else 0), (step, built)


def test_branches_reaching_the_same_sizes_share_one_structure():
    x, _ = image_batch([(13, 9), (6, 11)])
    main = nn.Conv2d(3, 8, 3, 2, 1)(x)
    proj = nn.Conv2d(3, 8, 1, 2)(x)
    assert main._meta is proj._meta  # the residual add is an identity check, not a size comparison
    assert (main + proj).sizes().tolist() == [[8, 7, 5], [8, 3, 6]]


def test_canvas_is_smaller_than_the_padded_envelope():
    x, _ = image_batch([(60, 8), (8, 60), (10, 10)], channels=1)
    p = build_spatial_plan(x, 3, 1, 1)
    n, hb, wb = p.blocks
    assert n * hb * wb < 3 * 60 * 60 / 2
    assert n * hb * wb >= 60 * 8 * 2 + 100


@pytest.mark.parametrize("layout", ["tiles", "canvas"])
def test_layouts_agree_with_each_image_alone(layout, monkeypatch):
    monkeypatch.setattr(spatial, "DEFAULT_LAYOUT", layout)
    torch.manual_seed(0)
    x, dense = image_batch([(11, 19), (3, 4), (8, 8)], seed=1, dtype=D, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3, 2, 1).to(D)
    check_layer(conv, x, dense, params=[conv.weight, conv.bias])
    check_layer(nn.MaxPool2d(3, 2, 1, ceil_mode=True), x, dense)


def test_small_and_empty_windows_on_shared_gaps():
    # boxes share their gaps: a window of one image reads the next image's top/left gap
    torch.manual_seed(0)
    x, dense = image_batch([(1, 2), (5, 3), (2, 4), (4, 4)], seed=2, dtype=D, requires_grad=True)
    conv = nn.Conv2d(3, 2, 3, 1, 1).to(D)
    check_layer(conv, x, dense, params=[conv.weight])
    check_layer(nn.MaxPool2d(2, ceil_mode=True), x, dense)


def test_plan_errors():
    x, _ = image_batch([(5, 5)])
    with pytest.raises(ValueError, match=r"spatial plan: layout must be one of \('canvas', 'tiles'\), got 'rows'"):
        build_spatial_plan(x, 3, layout_name="rows")
    with pytest.raises(ValueError, match=r"build_spatial_plan\(\): kernel must be an int >= 1 or a pair of them, got 0"):
        build_spatial_plan(x, 0)
    with pytest.raises(ValueError, match=r"build_spatial_plan\(\): padding must be an int >= 0 or a pair of them, got -1"):
        build_spatial_plan(x, 3, padding=-1)
    with pytest.raises(TypeError, match=r"build_spatial_plan\(\): expected a NestedTensor of images, got Tensor"):
        build_spatial_plan(torch.zeros(1, 3, 5, 5), 3)
    seq = padless.from_list([torch.randn(2, 5, 4)], ragged_dims=(1,))
    with pytest.raises(padless.StructureError, match=r"max_pool2d\(\): expected images \(C, H_i, W_i\)"):
        F.max_pool2d(seq, 2)


GEOMETRIES = {  # (layer, why): windows that reach past their box into a neighbour's shared gap
    "3x3 pad 1": (lambda: nn.Conv2d(3, 2, 3, 1, 1), "the usual halo"),
    "same, even kernel": (lambda: nn.Conv2d(3, 2, 4, 1, "same"), "asymmetric padding (1 top, 2 bottom)"),
    "dilated": (lambda: nn.Conv2d(3, 2, 3, 1, 2, dilation=2), "halo of 2"),
    "stride 3, pad 2": (lambda: nn.Conv2d(3, 2, 5, 3, 2), "origins aligned to 3"),
    "valid 3x2": (lambda: nn.Conv2d(3, 2, (3, 2)), "no padding, windows inside the image"),
    "max ceil": (lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), "last window past the padded input (-inf gaps)"),
    "avg ceil, no pad count": (lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), "divisors per image"),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_packed_canvas_keeps_images_apart(name):
    """Many images of random sizes (boxes packed next to each other on all sides): every
    image as the dense layer on that image alone, forward and backward."""
    g = torch.Generator().manual_seed(3)
    sizes = [tuple(int(v) for v in torch.randint(3, 14, (2,), generator=g)) for _ in range(14)]
    x, dense = image_batch(sizes, seed=4, dtype=D, requires_grad=True)
    torch.manual_seed(0)
    layer = GEOMETRIES[name][0]().to(D)
    check_layer(layer, x, dense, params=list(layer.parameters()))


def test_pack_places_boxes_without_overlap_and_tightly():
    g = torch.Generator().manual_seed(5)
    boxes = [tuple(int(v) for v in torch.randint(1, 40, (2,), generator=g)) for _ in range(30)] + [(0, 5), (7, 0)]
    for align in ((1, 1), (2, 2), (4, 1)):
        pos, hc, wc = pack.pack_boxes(boxes, align)
        live = [i for i, (h, w) in enumerate(boxes) if h > 0 and w > 0]
        for i in live:
            (y, x), (h, w) = pos[i], boxes[i]
            assert y % align[0] == 0 and x % align[1] == 0 and y + h <= hc and x + w <= wc
            for j in live:
                if j < i:
                    (y2, x2), (h2, w2) = pos[j], boxes[j]
                    assert y + h <= y2 or y2 + h2 <= y or x + w <= x2 or x2 + w2 <= x, (i, j)
        assert hc * wc < 1.5 * sum(pack.align_up(h, align[0]) * pack.align_up(w, align[1]) for h, w in boxes)


def _ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_ops_per_layer_do_not_grow_with_the_batch():
    """A conv + batch norm + relu + max pool + strided projection step runs the same aten ops
    for 3 images as for 30 (gathers with cached indices, no per-image copies)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(4, 4, 1, 2))
    counts = []
    for b in (3, 30):
        g = torch.Generator().manual_seed(b)
        x, _ = image_batch([tuple(int(v) for v in torch.randint(4, 20, (2,), generator=g)) for _ in range(b)], requires_grad=True)
        step = lambda: net(x).values().square().sum().backward()  # noqa: E731
        step()  # plans built and cached
        counts.append(_ops(step))
    assert counts[0] == counts[1], counts


def test_grid_index_is_each_pixels_canvas_position():
    g = torch.Generator().manual_seed(6)
    hw = torch.randint(0, 9, (17, 2), generator=g)  # empty rows and columns included
    base = torch.randint(0, 1000, (17,), generator=g)
    _, sid, a, b = spatial._coords(hw)
    place = torch.from_numpy(grid_index(base.tolist(), hw.tolist(), 23))
    assert torch.equal(place, base[sid] + a * 23 + b)


def test_grid_sources_invert_the_placement():
    g = torch.Generator().manual_seed(7)
    hw = torch.randint(0, 6, (9, 2), generator=g)
    base = [i * 6 * 23 + int(x) for i, x in enumerate(torch.randint(0, 17, (9,), generator=g))]  # disjoint grids
    place = torch.from_numpy(grid_index(base, hw.tolist(), 23))
    total = 9 * 6 * 23 + 5
    want = torch.full((total,), -1, dtype=torch.int64).index_copy_(0, place, torch.arange(place.shape[0]))
    assert torch.equal(torch.from_numpy(grid_sources(base, hw.tolist(), 23, total, [True] * 9)), want)


@pytest.mark.parametrize("fill_after", [0, 1 << 40], ids=["gather_then_fill", "fill_row_appended"])
def test_both_ways_of_filling_the_gaps_agree_with_each_image_alone(fill_after, monkeypatch):
    # large canvases gather the rows and fill the gaps in place; small ones append a fill row
    monkeypatch.setattr(spatial, "_FILL_AFTER", fill_after)
    torch.manual_seed(0)
    x, dense = image_batch([(9, 13), (5, 4), (12, 7), (1, 1)], seed=3, dtype=D, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3, 1, 1).to(D)
    check_layer(conv, x, dense, params=[conv.weight, conv.bias])
    check_layer(nn.Conv2d(3, 2, 3, 2, 1).to(D), x, dense)
    check_layer(nn.MaxPool2d(3, 2, 1), x, dense)  # gaps -inf
    tconv = nn.ConvTranspose2d(3, 2, 3, 2, 1, output_padding=1).to(D)
    check_layer(tconv, x, dense, params=[tconv.weight])


def test_stem_without_input_gradient_keeps_its_canvas():
    # the images into the stem need no gradient: the conv saves its input canvas, and the weight
    # gradient is still each image's own (a batch of one per image, summed)
    torch.manual_seed(0)
    x, dense = image_batch([(20, 31), (9, 7), (14, 14)], seed=4, dtype=D)
    stem = nn.Conv2d(3, 5, 7, 2, 3, bias=False).to(D)
    out = stem(x)
    cot = [torch.randn(o.shape, dtype=D) for o in out.unbind()]
    (got,) = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out.unbind(), cot)), [stem.weight])
    (want,) = torch.autograd.grad(sum((stem(d[None])[0] * c).sum() for d, c in zip(dense, cot)), [stem.weight])
    torch.testing.assert_close(got, want)
    for o, d in zip(out.unbind(), dense):
        torch.testing.assert_close(o, stem(d[None])[0])


@pytest.mark.parametrize("layout", ["tiles", "canvas"])
def test_max_pool_gradient_goes_to_each_windows_first_maximum(layout, monkeypatch):
    # ties (a constant patch) and a window of one real pixel next to the gaps: the gradient of every
    # output reaches the pixel torch picks on the image alone
    monkeypatch.setattr(spatial, "DEFAULT_LAYOUT", layout)
    x, dense = image_batch([(6, 7), (3, 3), (4, 9)], seed=5, dtype=D, requires_grad=True)
    with torch.no_grad():
        x._values[:10] = 0.5
        dense[0].view(3, -1).t()[:10] = 0.5
    for kw in (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=1), dict(kernel_size=3, stride=2, dilation=2, padding=1)):
        check_layer(nn.MaxPool2d(**kw), x, dense)
