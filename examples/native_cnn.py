"""Native-resolution CNNs from the image stream: classification and segmentation, no padding.

    python examples/native_cnn.py          (for `make demo`: about 12 s of CPU time on 2 cores)

For each task:

1. tar shards of PNG/JPEG images of varied sizes are written here (webdataset layout; the
   segmentation shards also hold a per-pixel mask ``{key}.mask.npy``);
2. ``WebDatasetReader`` decodes them at their native size and normalises them in the
   DataLoader worker (``transform=``), ``StreamingBucketer`` + ``PixelBudget`` groups
   them into batches of about the same pixel count, and ``padless.Collator`` packs them
   into ``(C, H_i, W_i)`` NestedTensors, building the stem convolution's spatial plan
   there too (``Field(spatial_plan=...)``);
3. a small ResNet written with plain ``torch.nn`` (7x7/2 stem, BatchNorm2d, ReLU,
   MaxPool2d, a residual block with a strided 1x1 projection, AdaptiveAvgPool2d, Linear)
   trains on the packed batch as it is. Batch norm takes its statistics over the real
   pixels of all images. The segmenter is the same trunk with a 1x1 classifier,
   ``F.interpolate(logits, size=images)`` back to each image's own size, and a
   per-pixel cross-entropy over real pixels only.

It checks one batch against the same model run on each image alone (eval mode) and
prints the pixels computed against the padded batch a dense pipeline would have built.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

import padless
from padless.loaders import BucketedStream, Normalize, PixelBudget, StreamingBucketer, WebDatasetReader
from padless.loaders.synthetic import write_shards
from padless.testing.vision import BasicBlock  # two 3x3 convs + batch norm, a strided 1x1 projection: plain torch.nn

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]
STEM = dict(kernel_size=7, stride=2, padding=3)  # the first layer's geometry, planned in the workers
SEG_CLASSES = 3  # background, rectangle, ellipse


# ------------------------------------------------------------------------------------ model


class SmallResNet(nn.Module):
    """Plain torch.nn: the same code runs on a dense (B, C, H, W) batch or on packed images."""

    def __init__(self, classes: int, widths: tuple[int, int] = (16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], **STEM, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.block = BasicBlock(widths[0], widths[1], stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[1], classes)

    def features(self, x: Tensor) -> Tensor:  # stride 8
        return self.block(self.stem(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))  # (B, classes): every image pooled alone


class FCN(nn.Module):
    """The trunk, a 1x1 classifier, and bilinear upsampling back to every image's own size."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.trunk = SmallResNet(classes)
        self.classifier = nn.Conv2d(self.trunk.fc.in_features, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.classifier(self.trunk.features(x))
        size = x if isinstance(x, padless.NestedTensor) else x.shape[-2:]
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


# ------------------------------------------------------------------------------------ data


def image_hw(sample: dict) -> tuple[int, int]:
    return tuple(sample["image"].shape[1:])


def write_segmentation_shards(root: str, *, num_shards: int, per_shard: int, low: int, high: int, seed: int = 0) -> list[str]:
    """Shards of ``{key}.png`` (RGB) and ``{key}.mask.npy`` ((H, W) int64 classes): a noisy
    background with a rectangle (class 1) and an ellipse (class 2) of their own colours."""
    from PIL import Image

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(num_shards):
        path = os.path.join(root, f"seg-{s:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_shard):
                h, w = (int(v) for v in rng.integers(low, high + 1, size=2))
                mask = np.zeros((h, w), dtype=np.int64)
                y0, x0 = rng.integers(0, h // 2), rng.integers(0, w // 2)
                mask[y0 : y0 + h // 3 + 1, x0 : x0 + w // 3 + 1] = 1
                yy, xx = np.mgrid[:h, :w]
                cy, cx, ry, rx = rng.uniform(0, h), rng.uniform(0, w), h / 5 + 1, w / 5 + 1
                mask[((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1] = 2
                colours = np.array([[40, 40, 40], [220, 60, 60], [60, 60, 220]], dtype=np.float64)
                img = colours[mask] + rng.normal(0, 20, size=(h, w, 3))
                png, npy = io.BytesIO(), io.BytesIO()
                Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(png, "PNG")
                np.save(npy, mask)
                for name, data in ((f"{s:03d}{i:05d}.png", png.getvalue()), (f"{s:03d}{i:05d}.mask.npy", npy.getvalue())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 0
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def loader(shards: list[str], fields: dict[str, str], collator: padless.Collator, *, steps: int, pixels: int,
           num_workers: int) -> DataLoader:
    """shards -> native-size decode + normalise (worker) -> pixel-budget buckets -> Collator (worker)."""
    reader = WebDatasetReader(shards, fields=fields, transform={"image": Normalize(MEAN, STD)}, shuffle_buffer=8)
    bucketer = StreamingBucketer(image_hw, PixelBudget(pixels), boundaries=[32 * 32, 56 * 56], buffer_size=32)
    # epoch_batches counts steps, not images: `steps` batches may end before every image was seen, or
    # re-read the shards and repeat some; main() prints how many distinct images the run covered.
    stream = BucketedStream(reader, bucketer, epoch_batches=steps, collate_fn=collator)
    return DataLoader(stream, batch_size=None, num_workers=num_workers)


# ------------------------------------------------------------------------------------ runs


def check_each_image(model: nn.Module, images: padless.NestedTensor) -> float:
    """Largest difference between the packed output and the model on each image alone (eval mode;
    the first four images)."""
    model.eval()
    with torch.no_grad():
        packed = model(images)
        rows = packed.unbind() if isinstance(packed, padless.NestedTensor) else packed
        err = max(float((model(img[None])[0] - row).abs().max()) for img, row in zip(images.unbind()[:4], rows))
    model.train()
    return err


def train(model: nn.Module, batches, target: str, lr: float) -> dict[str, Any]:
    """The ordinary loop: cross-entropy of the model's output against ``batch[target]``.

    For classification the output is ``(B, classes)``; for segmentation it is
    ``(classes, H_i, W_i)`` per image, and the mean runs over the real pixels of the batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stats: dict[str, Any] = {"losses": [], "real": 0, "padded": 0, "images": 0, "distinct": set()}
    for batch in batches:
        images = batch.image
        if "max_err" not in stats:
            stats["max_err"] = check_each_image(model, images)
        loss = F.cross_entropy(model(images), batch[target])
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats["losses"].append(loss.item())
        stats["real"] += images.numel()
        stats["padded"] += images.padded_numel()
        stats["images"] += len(batch)
        stats["distinct"].update(zip(batch["__shard__"], batch["__key__"]))
    return stats


def classify(root: str, *, steps: int, per_shard: int, low: int, high: int, pixels: int, num_workers: int) -> dict[str, Any]:
    shards = write_shards(os.path.join(root, "cls"), num_shards=2, per_shard=per_shard, low=low, high=high)
    collator = padless.Collator({"image": padless.Field(ragged=(1, 2), spatial_plan=STEM), "label": padless.Field()})
    batches = loader(shards, {"image": "jpg;png", "label": "cls"}, collator, steps=steps, pixels=pixels,
                     num_workers=num_workers)
    return train(SmallResNet(classes=3), batches, "label", lr=3e-3)


def segment(root: str, *, steps: int, per_shard: int, low: int, high: int, pixels: int, num_workers: int) -> dict[str, Any]:
    shards = write_segmentation_shards(os.path.join(root, "seg"), num_shards=2, per_shard=per_shard, low=low, high=high)
    collator = padless.Collator({
        "image": padless.Field(ragged=(1, 2), spatial_plan=STEM),
        "mask": padless.Field(ragged=(0, 1)),  # (H_i, W_i) class per pixel
    })
    batches = loader(shards, {"image": "png", "mask": "mask.npy"}, collator, steps=steps, pixels=pixels,
                     num_workers=num_workers)
    return train(FCN(SEG_CLASSES), batches, "mask", lr=1e-2)


def main(steps: int = 8, per_shard: int = 16, low: int = 16, high: int = 80, pixels: int = 16_000,
         num_workers: int = 2) -> dict[str, dict[str, Any]]:
    """Train both tasks for ``steps`` batches each; returns their statistics."""
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for name, run in (("classification", classify), ("segmentation", segment)):
            t0 = time.perf_counter()
            s = run(root, steps=steps, per_shard=per_shard, low=low, high=high, pixels=pixels, num_workers=num_workers)
            s["seconds"] = time.perf_counter() - t0
            out[name] = s
    print("padless native-resolution CNNs: shards -> native-size decode -> pixel-budget buckets -> Collator -> ResNet")
    for name, s in out.items():
        print(f"  {name}: {len(s['losses'])} steps (epoch_batches), {s['images']} images "
              f"({len(s['distinct'])} of the {2 * per_shard} distinct ones) in {s['seconds']:.1f} s, "
              f"loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}; "
              f"packed vs each image alone: max |diff| {s['max_err']:.1e}")
        print(f"    input pixels computed {s['real']:,}; a padded batch would have held {s['padded']:,} "
              f"({s['padded'] / s['real']:.2f}x, occupancy {s['real'] / s['padded']:.2f})")
    print("  (classification labels are random: the pipeline is the point; the segmentation masks are learnable)")
    return out


if __name__ == "__main__":
    main()
