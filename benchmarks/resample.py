"""F.interpolate on packed images vs a padded batch and a per-image loop (forward + backward).

    python benchmarks/resample.py [--rounds N]

12 images whose sides are uniform in [48, 216] (as in benchmarks/vision.py), one thread:
* FCN head: 5-channel logits at stride 8 resized back to every image's own size (bilinear);
* decoder: 32 channels at half resolution, upsampled x2 (bilinear, then nearest).
"padded" resizes the zero-padded batch to the largest target (one call; its border pixels
mix in padding, so it is a speed reference, not a correct result); "per-image loop" runs
the dense op image by image; padless groups images of equal size into one call (here every
size differs, so it makes one call per image on views of the packed rows). Interleaved
rounds, median of per-round ratios against padded.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

import padless
from padless.testing import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = random.Random(0)
    sizes = [(rng.randint(48, 216), rng.randint(48, 216)) for _ in range(12)]
    cases = [
        ("FCN head: 5 ch, stride 8 -> own size, bilinear", 5, [(h // 8, w // 8) for h, w in sizes], sizes, "bilinear"),
        ("decoder: 32 ch, x2, bilinear", 32, [(h // 2, w // 2) for h, w in sizes], [(h // 2 * 2, w // 2 * 2) for h, w in sizes], "bilinear"),
        ("decoder: 32 ch, x2, nearest", 32, [(h // 2, w // 2) for h, w in sizes], [(h // 2 * 2, w // 2 * 2) for h, w in sizes], "nearest"),
    ]
    rows = []
    for name, c, src, tgt, mode in cases:
        x = padless.from_list([torch.randn(c, h, w) for h, w in src], ragged_dims=(1, 2), requires_grad=True)
        pad = x.to_padded().detach().requires_grad_()
        dense = [s.detach().requires_grad_() for s in x.unbind()]
        big = (max(h for h, _ in tgt), max(w for _, w in tgt))
        occ = sum(h * w for h, w in tgt) / (len(tgt) * big[0] * big[1])

        def padded():
            F.interpolate(pad, size=big, mode=mode).sum().backward()

        def loop():
            sum(F.interpolate(d[None], size=t, mode=mode).sum() for d, t in zip(dense, tgt)).backward()

        def packed():
            F.interpolate(x, size=tgt, mode=mode).values().sum().backward()

        res = bench.interleaved({"padded": padded, "per-image loop": loop, "padless": packed}, baseline="padded", rounds=args.rounds)
        rows += bench.rows_from(f"{name} (occupancy {occ:.2f})", res)
    bench.print_table(rows, "F.interpolate forward + backward, 12 images, 1 thread", "padded")


if __name__ == "__main__":
    main()
