"""Segmentation models in plain torch.nn on packed images, against each image alone: an FCN
(ResNet trunk, 1x1 classifier, F.interpolate back to every image's own size, per-pixel
cross-entropy over real pixels) and a small U-Net (strided down convs, conv_transpose2d up,
channel concatenation of the skips)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import padless
from padless.testing.vision import ResNetish, check_layer, image_batch

# sides that are not multiples of the total stride (8), an image smaller than the stem's
# receptive field, a repeated size
SIZES = [(19, 23), (9, 14), (5, 4), (19, 23)]


def _eval_trunk(seed: int = 0) -> ResNetish:
    """Batch norm in eval mode, with random running statistics (a per-image reference exists)."""
    torch.manual_seed(seed)
    m = ResNetish(widths=(8, 16), classes=5)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


class FCN(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.trunk = _eval_trunk()
        self.classifier = nn.Conv2d(16, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.classifier(self.trunk.features(x))
        size = x if isinstance(x, padless.NestedTensor) else x.shape[-2:]  # every image back to its own size
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


@pytest.mark.parametrize("sizes", [SIZES, [(9, 7)]], ids=["batch", "one_image"])
def test_fcn_logits_and_gradients(sizes):
    model = FCN()
    x, dense = image_batch(sizes, requires_grad=True)
    params = [p for n, p in model.named_parameters() if not n.startswith("trunk.fc")]
    check_layer(model, x, dense, params=params, atol=1e-5, rtol=1e-4)


def test_unet_image_too_small_for_reflect_names_it():
    torch.manual_seed(1)
    x, _ = image_batch([(8, 6), (2, 2)])
    with pytest.raises(RuntimeError, match=r"sample 1 .*Padding size should be less than the corresponding input dimension"):
        TinyUNet()(x)


def test_fcn_pixel_cross_entropy_over_real_pixels():
    model = FCN()
    x, dense = image_batch(SIZES, requires_grad=True)
    g = torch.Generator().manual_seed(3)
    labels = [torch.randint(0, 5, (h, w), generator=g) for h, w in SIZES]
    loss = F.cross_entropy(model(x), padless.from_list(labels))
    params = [p for n, p in model.named_parameters() if not n.startswith("trunk.fc")]  # the trunk's head is unused
    got = torch.autograd.grad(loss, [x, *params])
    total = sum(h * w for h, w in SIZES)
    want_loss = sum(F.cross_entropy(model(d[None]), t[None], reduction="sum") for d, t in zip(dense, labels)) / total
    want = torch.autograd.grad(want_loss, [*dense, *params])
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    for gi, wi in zip(got[0].unbind(), want[: len(dense)]):
        torch.testing.assert_close(gi, wi, atol=1e-6, rtol=1e-4)
    for gp, wp in zip(got[1:], want[len(dense):]):
        torch.testing.assert_close(gp, wp, atol=1e-6, rtol=1e-4)


class TinyUNet(nn.Module):
    """Two levels: conv, strided conv down, conv_transpose2d up, cat with the skip, conv, 1x1 head."""

    def __init__(self, cin: int = 3, w: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(cin, w, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(2 * w, 2 * w, 3, padding=1, padding_mode="reflect"), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * w, w, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.enc(x)
        up = self.up(self.down(skip))
        return self.head(self.dec(torch.cat([up, skip], 1)))


def test_unet_even_sizes():
    torch.manual_seed(1)
    model = TinyUNet()
    x, dense = image_batch([(8, 6), (4, 10), (4, 4), (8, 6)], requires_grad=True)
    check_layer(model, x, dense, params=list(model.parameters()), atol=1e-5, rtol=1e-4)


def test_unet_odd_sizes_resample_to_the_skip():
    """Odd sides: the up path is one pixel too large; resize it to each skip's own size."""

    class Resized(TinyUNet):
        def forward(self, x: Tensor) -> Tensor:
            skip = self.enc(x)
            up = self.up(self.down(skip))
            size = skip if isinstance(skip, padless.NestedTensor) else skip.shape[-2:]
            return self.head(self.dec(torch.cat([F.interpolate(up, size=size, mode="nearest"), skip], 1)))

    torch.manual_seed(2)
    model = Resized()
    x, dense = image_batch([(7, 5), (4, 9), (3, 3)], requires_grad=True)
    check_layer(model, x, dense, params=list(model.parameters()), atol=1e-5, rtol=1e-4)
