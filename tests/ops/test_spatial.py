"""Spatial plans (padless/ops/vision/spatial.py): caching, shared structures, layouts, no envelope."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.vision import spatial
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


def test_many_images_take_the_index_path(monkeypatch):
    monkeypatch.setattr(spatial, "RECT_LIMIT", 2)  # above it, canvas moves are one index op over all rows
    torch.manual_seed(0)
    x, dense = image_batch([(1, 2), (5, 3), (2, 4), (4, 4)], seed=2, dtype=D, requires_grad=True)
    conv = nn.Conv2d(3, 2, 3, 1, 1).to(D)
    check_layer(conv, x, dense, params=[conv.weight])
    check_layer(nn.MaxPool2d(2, ceil_mode=True), x, dense)
    assert spatial_plan("conv2d", x, Geometry((3, 3), (1, 1), (1, 1, 1, 1))).in_rects is None


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
