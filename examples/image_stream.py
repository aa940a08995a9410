"""Images at native resolution, from tar shards to the loss, with no padding anywhere.

    python examples/image_stream.py        (part of `make demo`)

1. writes webdataset tar shards of JPEG/PNG images of varied sizes (made here);
2. streams them with ``WebDatasetReader`` (decoded at native size, sides rounded to
   the patch size), buckets them by pixel budget in the DataLoader workers
   (``StreamingBucketer`` + ``BucketedStream``) and collates them with
   ``padless.Collator`` into ``(C, H_i, W_i)`` NestedTensors;
3. trains a tiny ViT-style classifier: ``F.conv2d`` with kernel == stride (the patch
   embedding, mapped onto ``padless.patchify``), a ragged mean over tokens, a head.

It prints how many pixels a padded batch would have carried.
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import padless
from padless.loaders import BucketedStream, PixelBudget, StreamingBucketer, WebDatasetReader
from padless.loaders.synthetic import write_shards

PATCH = 16


def image_hw(sample: dict) -> tuple[int, int]:
    return tuple(sample["image"].shape[1:])


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, PATCH, stride=PATCH)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.embed(images)  # (dim, H_i/16, W_i/16) per image
        x = x.flatten(2).transpose(1, 2)  # (N_i tokens, dim)
        x = x + self.mlp(x)
        return self.head(x.mean(dim=1))  # (B, classes): a ragged mean over each image's tokens


def main() -> None:
    torch.manual_seed(0)
    collator = padless.Collator({"image": padless.Field(ragged=(1, 2), dtype=torch.float32), "label": padless.Field()})
    model = TinyViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    real = padded = steps = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        shards = write_shards(root, num_shards=4, per_shard=24, low=32, high=160)  # 96 images
        reader = WebDatasetReader(shards, fields={"image": "jpg;png", "label": "cls"}, multiple_of=PATCH, shuffle_buffer=16)
        stream = BucketedStream(
            reader,
            StreamingBucketer(image_hw, PixelBudget(120_000), boundaries=[64 * 64, 112 * 112]),
            # An "epoch" here is 12 batches (steps), not one pass over the 96 images: with other sizes or
            # budgets it can end before every image was seen, or re-read the shards and see some twice.
            # The run prints how many distinct images each epoch covered.
            epoch_batches=12,
            collate_fn=collator,
        )
        losses = []
        covered = []
        for epoch in range(2):
            stream.set_epoch(epoch)
            seen = set()
            for batch in DataLoader(stream, batch_size=None, num_workers=2):
                seen.update(zip(batch["__shard__"], batch["__key__"]))
                images = batch.image / 255.0
                loss = F.cross_entropy(model(images), batch.label)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                real += images.numel()
                padded += images.padded_numel()
                steps += 1
            covered.append(len(seen))
    dt = time.perf_counter() - t0
    print("padless image stream: shards -> native-size decode -> pixel-budget buckets -> Collator -> ViT stem")
    print(f"  {steps} steps in {dt:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f} (random labels: the pipeline is the point)")
    print(f"  an epoch is epoch_batches=12 steps; it covered {' and '.join(map(str, covered))} of the 96 distinct images")
    print(f"  pixels computed {real:,}; a padded batch would have held {padded:,} (occupancy {real / padded:.2f})")


if __name__ == "__main__":
    main()
