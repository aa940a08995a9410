"""A native-resolution ViT on images of different sizes, without padding.

patchify -> linear patch embedding -> + position grid interpolated to every image's patch
grid -> transformer encoder -> mean over each image's tokens -> class head, all on one
packed batch. The logits are compared image by image with the same model run on each
image alone as a dense tensor, and the tokens/pixels computed are compared with a padded
batch (every image zero-padded to the largest height and width). A training step then
drops half of every image's tokens (NaViT-style) and updates the position grid.

Run: ``python examples/native_vit.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import padless
from padless.vision import drop_tokens, grid_sizes, interpolate_pos_embed

PATCH = 8


class NativeViT(nn.Module):
    """A small ViT whose forward takes a NestedTensor of images ``(C, H_i, W_i)``."""

    def __init__(self, channels: int = 3, dim: int = 64, depth: int = 2, heads: int = 4, classes: int = 10, grid: int = 6):
        super().__init__()
        self.embed = nn.Linear(channels * PATCH * PATCH, dim)
        self.pos = nn.Parameter(torch.randn(dim, grid, grid) * 0.02)  # learned at a 6 x 6 grid, resized per image
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: padless.NestedTensor, keep: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
        x = self.embed(padless.patchify(images, PATCH)) + interpolate_pos_embed(self.pos, images, PATCH)
        if keep < 1.0:
            x, _ = drop_tokens(x, keep, generator=generator)
        x = self.encoder(x)
        return self.head(x.mean(dim=1))  # ragged mean: a dense (B, dim) tensor

    def forward_one(self, image: Tensor) -> Tensor:
        """The same model on one dense image ``(C, H, W)``: the reference."""
        tokens = F.unfold(image[None], PATCH, stride=PATCH)[0].t()  # (N, C*p*p), features ordered (C, p, p)
        h, w = image.shape[1] // PATCH, image.shape[2] // PATCH
        pos = F.interpolate(self.pos[None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)
        x = self.embed(tokens) + pos[0].flatten(1).t()
        x = self.encoder(x[None])[0]
        return self.head(x.mean(0))


def make_images(n: int, seed: int = 0) -> list[Tensor]:
    """Images whose sides are multiples of the patch, between 16 and 96 pixels."""
    g = torch.Generator().manual_seed(seed)
    sides = torch.randint(2, 13, (n, 2), generator=g) * PATCH
    return [torch.randn(3, int(h), int(w), generator=g) for h, w in sides]


def _median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    model = NativeViT().eval()
    samples = make_images(12)
    images = padless.from_list(samples, ragged_dims=(1, 2))
    with torch.no_grad():
        logits = model(images)
        alone = torch.stack([model.forward_one(s) for s in samples])
        t_packed = _median_time(lambda: model(images))
        t_loop = _median_time(lambda: [model.forward_one(s) for s in samples])
    err = (logits - alone).abs().max().item()
    print(f"logits vs each image alone: max abs difference {err:.2e} over {len(samples)} images")
    assert err < 1e-4, err

    grids = grid_sizes(images, PATCH)
    tokens = int(grids.prod(1).sum())
    padded_tokens = len(samples) * int(grids[:, 0].max()) * int(grids[:, 1].max())
    pixels = sum(s[0].numel() for s in samples)
    padded_pixels = len(samples) * max(s.shape[1] for s in samples) * max(s.shape[2] for s in samples)
    print(f"tokens computed: {tokens:,} (a padded batch: {padded_tokens:,}, {padded_tokens / tokens:.2f}x)")
    print(f"pixels read:     {pixels:,} (a padded batch: {padded_pixels:,}, {padded_pixels / pixels:.2f}x)")
    print(f"forward time (median of 3): packed batch {t_packed * 1e3:.1f} ms, one image at a time {t_loop * 1e3:.1f} ms")

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.randint(0, 10, (len(samples),), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(images, keep=0.5, generator=torch.Generator().manual_seed(2)), labels)
    loss.backward()
    print(f"training step with half the tokens of every image dropped: loss {loss.item():.3f}, "
          f"position grid gradient norm {model.pos.grad.norm().item():.3e}")
    opt.step()


if __name__ == "__main__":
    main()
