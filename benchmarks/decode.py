"""Decode + collate per batch of images: channel-last views (now) against contiguous (C, H, W) (before).

    python benchmarks/decode.py [--rounds 15] [--batch 32] [--threads 1]

Readers used to return contiguous ``(C, H, W)`` images: a transposing copy of the
decoder's ``(H, W, C)`` pixels, which the collator then transposed back into its
``(H*W, C)`` rows. They now return a ``(C, H, W)`` view of the ``(H, W, C)``
buffer (channel-last strides), so the collator's copy is a plain memory copy.
Rows (one batch of ``--batch`` images, sides uniform in [64, 512], as in
``benchmarks/collate.py``; PNG and JPEG):

* ``decode+collate``: bytes -> ``decode_image`` -> ``padless.collation.collate`` (what a worker does);
* ``collate only``: the same decoded images, the collate call alone;
* ``big JPEG, max_side=512``: one 3072 x 2304 JPEG decoded at reduced scale
  (Pillow ``draft``, now) against a full decode then resize (before).

Timings are interleaved round by round with the shared runner
(``padless.testing.bench``); ratios are medians of per-round ratios
(> 1: the new path is faster). One thread, as in a DataLoader worker.
"""

from __future__ import annotations

import argparse
import io
import os

import numpy as np
import torch

from padless.collation import collate
from padless.loaders import decode_image
from padless.loaders.synthetic import image_bytes, random_sizes
from padless.testing import bench


def decode_contiguous(data: bytes, **kw: object) -> torch.Tensor:
    """The old reader output: a contiguous (C, H, W) copy."""
    return decode_image(data, **kw).contiguous()  # type: ignore[arg-type]


def decode_no_draft(data: bytes, max_side: int) -> torch.Tensor:
    """The old max_side path: decode at full size, then resize (no draft)."""
    from PIL import Image

    from padless.loaders.images import pil_to_tensor, target_size

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        img = img.convert("RGB")
        th, tw = target_size(img.height, img.width, max_side=max_side)
        return pil_to_tensor(img.resize((tw, th), Image.Resampling.BICUBIC)).contiguous()


def smooth_jpeg(h: int, w: int) -> bytes:
    from PIL import Image

    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([xx * 255 // w, yy * 255 // h, np.sin(xx / 90.0) * np.cos(yy / 70.0) * 120 + 128], -1)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows: list[bench.Row] = []
    sizes = random_sizes(args.batch, seed=0, low=64, high=512)
    pixels = sum(h * w for h, w in sizes)
    for fmt in ("png", "jpg"):
        blobs = [image_bytes(h, w, fmt, seed=i) for i, (h, w) in enumerate(sizes)]
        labels = list(range(args.batch))

        def batch(dec, blobs=blobs, labels=labels):  # noqa: ANN001, ANN202
            return collate([{"image": dec(b), "label": y} for b, y in zip(blobs, labels)])

        res = bench.interleaved(
            {"contiguous (C,H,W) (before)": lambda: batch(decode_contiguous), "channel-last view (now)": lambda: batch(decode_image)},
            baseline="contiguous (C,H,W) (before)", rounds=args.rounds, warmup=2,
        )
        rows += bench.rows_from(f"decode+collate {args.batch} {fmt} ({pixels / 1e6:.1f} Mpx)", res)
        views = [{"image": decode_image(b), "label": y} for b, y in zip(blobs, labels)]
        contig = [{"image": s["image"].contiguous(), "label": s["label"]} for s in views]
        assert torch.equal(collate(views)["image"].values(), collate(contig)["image"].values())
        res = bench.interleaved(
            {"contiguous (C,H,W) (before)": lambda: collate(contig), "channel-last view (now)": lambda: collate(views)},
            baseline="contiguous (C,H,W) (before)", rounds=args.rounds * 4, warmup=2,
        )
        rows += bench.rows_from(f"collate only, {args.batch} {fmt}", res)
    big = smooth_jpeg(2304, 3072)
    res = bench.interleaved(
        {"full decode + resize (before)": lambda: decode_no_draft(big, 512), "draft decode + resize (now)": lambda: decode_image(big, max_side=512)},
        baseline="full decode + resize (before)", rounds=args.rounds, warmup=1,
    )
    rows += bench.rows_from("big JPEG 3072x2304, max_side=512", res)
    bench.print_table(rows, f"Image decode + collate, one batch ({args.threads} thread)", "before")


if __name__ == "__main__":
    main()
