"""Nearest upsampling by whole powers of two (``F.interpolate(x, scale_factor=2)``, a U-Net decoder's
``size=skip.shape[2:]``) runs as one gather of whole rows with a gather-and-sum gradient; every image
against ``F.interpolate`` on it alone, values and gradients, and the cases that keep the grouped path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.vision import resample
from padless.testing.vision import check_layer, image_batch

SIZES = [(3, 5), (1, 1), (4, 2), (3, 5), (7, 3)]


def _calls(monkeypatch) -> list:
    seen: list = []
    orig = resample._GatherRows.apply

    def spy(*a):
        seen.append(a[2].shape)
        return orig(*a)

    monkeypatch.setattr(resample._GatherRows, "apply", spy)
    return seen


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("kw", [dict(scale_factor=2), dict(scale_factor=(4, 2.0)), dict(scale_factor=1), dict(size=(8, 8))],
                         ids=["x2", "x4x2", "x1", "size"])
def test_nearest_power_of_two_matches_each_image(monkeypatch, mode, kw):
    sizes = SIZES if "size" not in kw else [(4, 2), (1, 8), (8, 8), (2, 4)]
    seen = _calls(monkeypatch)
    x, dense = image_batch(sizes, channels=3, requires_grad=True)
    check_layer(lambda t: F.interpolate(t, mode=mode, **kw), x, dense, atol=1e-6, rtol=1e-6)
    assert seen, "the gather path did not run"


def test_nearest_per_image_targets_uneven_factors(monkeypatch):
    """Per-image targets (another NestedTensor's sizes) with factors that differ between images:
    the gradient's lists of copies are padded with a zero row."""
    seen = _calls(monkeypatch)
    sizes = [(3, 5), (2, 2), (4, 1)]
    targets = [(6, 10), (8, 2), (4, 4)]
    x, dense = image_batch(sizes, channels=2, requires_grad=True)
    like = padless.from_list([torch.zeros(1, h, w) for h, w in targets], ragged_dims=(1, 2))
    out = F.interpolate(x, size=like, mode="nearest")
    refs = [F.interpolate(d[None], size=t, mode="nearest")[0] for d, t in zip(dense, targets)]
    for o, r in zip(out.unbind(), refs):
        torch.testing.assert_close(o, r)
    cot = [torch.randn(r.shape) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=(1, 2)))
    torch.autograd.backward(refs, cot)
    for g, d in zip(x.grad.unbind(), dense):
        torch.testing.assert_close(g, d.grad)
    assert seen


def test_skip_shape_targets_like_a_unet_decoder(monkeypatch):
    """``size=skip.shape[2:]``: every image to its own skip's size (here exactly twice its own)."""
    seen = _calls(monkeypatch)
    small, dense = image_batch([(2, 3), (4, 4), (1, 2)], channels=4, requires_grad=True)
    skip = padless.from_list([torch.zeros(4, 2 * h, 2 * w) for h, w in [(2, 3), (4, 4), (1, 2)]], ragged_dims=(1, 2))
    padless.same_batch(skip, small)  # built separately from the same samples
    out = F.interpolate(small, size=skip.shape[2:], mode="nearest")
    for o, d in zip(out.unbind(), dense):
        torch.testing.assert_close(o, F.interpolate(d[None], scale_factor=2, mode="nearest")[0])
    assert seen


@pytest.mark.parametrize("kw", [dict(scale_factor=3), dict(scale_factor=1.5), dict(scale_factor=0.5), dict(size=(5, 5))],
                         ids=["x3", "x1.5", "down", "size-not-multiple"])
def test_other_factors_keep_the_grouped_path(monkeypatch, kw):
    seen = _calls(monkeypatch)
    x, dense = image_batch([(3, 5), (4, 2), (2, 2)], channels=2, requires_grad=True)
    check_layer(lambda t: F.interpolate(t, mode="nearest", **kw), x, dense, atol=1e-6, rtol=1e-6)
    assert not seen


def test_one_image_and_empty_image():
    x, dense = image_batch([(3, 4)], channels=2, requires_grad=True)
    check_layer(lambda t: F.interpolate(t, scale_factor=2, mode="nearest"), x, dense, atol=1e-6, rtol=1e-6)
    y = padless.from_list([torch.randn(2, 3, 4), torch.randn(2, 0, 3)], ragged_dims=(1, 2))
    with pytest.raises(RuntimeError, match=r"sample 1 .*sizes should be greater than 0"):  # torch's error, as before
        F.interpolate(y, scale_factor=2, mode="nearest")


def test_decoder_step_upsample_cat_conv(monkeypatch):
    """A U-Net decoder step: upsample, concatenate along channels (the gradient reaching the upsampling
    is then a channel slice, not contiguous), convolve; per image, values and gradients."""
    seen = _calls(monkeypatch)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 4, 3, padding=1)

    def step(t):
        up = F.interpolate(t, scale_factor=2, mode="nearest")
        return conv(torch.cat([up, torch.relu(up) * 0.5], dim=1))

    x, dense = image_batch([(3, 5), (2, 2), (4, 3)], channels=3, requires_grad=True)
    check_layer(step, x, dense, params=list(conv.parameters()), atol=1e-5, rtol=1e-5)
    assert seen


def test_dtypes_follow_torch(monkeypatch):
    """uint8 masks take the gather as torch's kernel takes them; an int64 batch keeps torch's error."""
    seen = _calls(monkeypatch)
    masks = [torch.randint(0, 255, (1, 3, 2), dtype=torch.uint8), torch.randint(0, 255, (1, 1, 4), dtype=torch.uint8)]
    out = F.interpolate(padless.from_list(masks, ragged_dims=(1, 2)), scale_factor=2, mode="nearest")
    for o, m in zip(out.unbind(), masks):
        assert torch.equal(o, F.interpolate(m[None], scale_factor=2, mode="nearest")[0])
    assert seen
    with pytest.raises(RuntimeError, match="not implemented"):
        F.interpolate(padless.from_list([torch.zeros(1, 3, 2, dtype=torch.long)], ragged_dims=(1, 2)), scale_factor=2, mode="nearest")
