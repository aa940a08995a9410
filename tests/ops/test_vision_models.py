"""Plain torch.nn vision models on packed images, against the same model on each image alone:
a ResNet-style classifier (eval, and training-mode batch norm against batch statistics over the
real pixels of all images), an FCN-style segmenter and a small U-Net."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from padless.testing import assert_close_samples
from padless.testing.vision import BasicBlock, ResNetish, check_layer, image_batch

D = torch.float64
# sides not multiples of the total stride (32), images smaller than the stem's 7x7 window
SIZES = [(23, 17), (9, 30), (5, 6), (16, 16)]


def _model(**kw) -> ResNetish:
    torch.manual_seed(0)
    m = ResNetish(widths=(4, 8, 8), classes=5, **kw).to(D)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.1)
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("sizes", [SIZES, [(13, 11)]], ids=["four", "one_image"])
def test_resnet_eval_each_image_alone(sizes):
    model = _model().eval()
    x, dense = image_batch(sizes, seed=1, dtype=D, requires_grad=True)
    out = check_layer(model, x, dense, params=list(model.parameters()), atol=1e-9, rtol=1e-7)
    assert type(out) is torch.Tensor and out.shape == (len(sizes), 5)


# ---------------------------------------------------------------- training-mode reference
def _each(f, xs):
    return [f(x[None])[0] for x in xs]


def _bn_batch(bn: nn.BatchNorm2d, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Training batch norm by definition: statistics over the real pixels of every image."""
    pix = torch.cat([x.flatten(1) for x in xs], 1)
    mean, var = pix.mean(1), pix.var(1, unbiased=False)
    with torch.no_grad():
        bn.running_mean.mul_(1 - bn.momentum).add_(bn.momentum * mean)
        bn.running_var.mul_(1 - bn.momentum).add_(bn.momentum * pix.var(1, unbiased=True))
        bn.num_batches_tracked += 1
    s = (-1, 1, 1)
    return [(x - mean.view(s)) / torch.sqrt(var.view(s) + bn.eps) * bn.weight.view(s) + bn.bias.view(s) for x in xs]


def _block_ref(b: BasicBlock, xs):
    y = [torch.relu(t) for t in _bn_batch(b.bn1, _each(b.conv1, xs))]
    y = _bn_batch(b.bn2, _each(b.conv2, y))
    skip = xs if b.proj is None else _bn_batch(b.proj[1], _each(b.proj[0], xs))
    return [torch.relu(u + v) for u, v in zip(y, skip)]


def _resnet_ref(m: ResNetish, xs):
    conv, bn, _, pool = m.stem
    y = _each(pool, [torch.relu(t) for t in _bn_batch(bn, _each(conv, xs))])
    for b in m.stages:
        y = _block_ref(b, y)
    return m.fc(torch.stack([t.mean((1, 2)) for t in y]))


def test_resnet_training_batch_norm_over_real_pixels():
    model = _model().train()
    ref = copy.deepcopy(model)
    x, dense = image_batch(SIZES, seed=2, dtype=D, requires_grad=True)
    out = model(x)
    want = _resnet_ref(ref, dense)
    torch.testing.assert_close(out, want)
    g = torch.randn(out.shape, dtype=D, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((out * g).sum(), [x, *model.parameters()])
    exp = torch.autograd.grad((want * g).sum(), [*dense, *ref.parameters()])
    assert_close_samples(got[0], exp[: len(dense)], what="input gradient")
    for (name, _), a, b in zip(model.named_parameters(), got[1:], exp[len(dense):]):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    for (name, a), b in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")  # running stats, updated once per batch


# ---------------------------------------------------------------- FCN segmenter and U-Net
class FCN(nn.Module):
    """The ResNet trunk, a 1x1 classifier, bilinear upsampling back to each image's own size."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.trunk = _model()
        self.head = nn.Conv2d(8, classes, 1).to(D)

    def forward(self, x, size):
        return F.interpolate(self.head(self.trunk.features(x)), size=size, mode="bilinear", align_corners=False)


def test_fcn_segmenter_per_pixel_loss_over_real_pixels():
    model = FCN().eval()
    x, dense = image_batch(SIZES, seed=4, dtype=D, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    labels = [torch.randint(0, 3, (h, w), generator=g) for h, w in SIZES]
    logits = model(x, x)  # a NestedTensor size: every image back to its own (H_i, W_i)
    assert [tuple(t.shape) for t in logits.unbind()] == [(3, h, w) for h, w in SIZES]
    target = torch.cat([lab.flatten() for lab in labels])  # packed like the pixel rows
    loss = F.cross_entropy(logits.values(), target, reduction="sum")
    ref = sum(F.cross_entropy(model(d[None], d.shape[-2:]), lab[None], reduction="sum") for d, lab in zip(dense, labels))
    torch.testing.assert_close(loss, ref)
    params = [p for n, p in model.named_parameters() if not n.startswith("trunk.fc")]  # the classifier is unused
    got = torch.autograd.grad(loss, [x, *params])
    exp = torch.autograd.grad(ref, [*dense, *params])
    assert_close_samples(got[0], exp[: len(dense)], what="input gradient")
    for a, b in zip(got[1:], exp[len(dense):]):
        torch.testing.assert_close(a, b)


class UNet(nn.Module):
    """One level: conv, strided conv down, conv_transpose2d up, channel concatenation of the skip."""

    def __init__(self, c: int = 3, w: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(c, w, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.InstanceNorm2d(2 * w), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * w, w, 3, padding=1), nn.GroupNorm(2, w), nn.ReLU(), nn.Conv2d(w, classes, 1))

    def forward(self, x):
        skip = self.enc(x)
        return self.dec(torch.cat([self.up(self.down(skip)), skip], dim=1))


def test_unet_each_image_alone():
    torch.manual_seed(0)
    model = UNet().to(D)
    x, dense = image_batch([(8, 6), (2, 10), (12, 12)], seed=6, dtype=D, requires_grad=True)  # even sides
    check_layer(model, x, dense, params=list(model.parameters()))
