"""Image decoding at native resolution: bytes -> ``(C, H, W)`` uint8 tensor, with optional size rules."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from torch import Tensor

from padless.loaders._deps import require

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")


def target_size(h: int, w: int, *, max_side: int | None = None, multiple_of: int | None = None) -> tuple[int, int]:
    """The size an ``(h, w)`` image gets: longest side capped at ``max_side`` (aspect kept),
    then each side rounded to the nearest multiple of ``multiple_of`` (at least one multiple).

    >>> target_size(300, 200, max_side=150)
    (150, 100)
    >>> target_size(37, 70, multiple_of=16)
    (32, 64)
    >>> target_size(5, 70, multiple_of=16)
    (16, 64)
    """
    if max_side is not None and max(h, w) > max_side:
        s = max_side / max(h, w)
        h, w = max(1, round(h * s)), max(1, round(w * s))
    if multiple_of is not None:
        h = max(multiple_of, int(round(h / multiple_of)) * multiple_of)
        w = max(multiple_of, int(round(w / multiple_of)) * multiple_of)
    return h, w


def check_size_rules(max_side: int | None, multiple_of: int | None, what: str) -> None:
    for name, v in (("max_side", max_side), ("multiple_of", multiple_of)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{what}: {name} must be an int >= 1 or None, got {v!r}")
    if max_side is not None and multiple_of is not None and max_side < multiple_of:
        raise ValueError(f"{what}: max_side={max_side} is smaller than multiple_of={multiple_of}")


def pil_to_tensor(img: Any) -> Tensor:
    """A PIL image as ``(C, H, W)`` uint8 (16-bit and float modes keep their dtype)."""
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(np.array(arr.transpose(2, 0, 1), order="C", copy=True))


def decode_image(
    data: bytes | Any,
    *,
    mode: str | None = "RGB",
    max_side: int | None = None,
    multiple_of: int | None = None,
) -> Tensor:
    """Decode image bytes (or an open file / path) to ``(C, H, W)``, native size unless a rule resizes it.

    >>> from padless.loaders.synthetic import image_bytes
    >>> decode_image(image_bytes(20, 30, "png")).shape
    torch.Size([3, 20, 30])
    >>> decode_image(image_bytes(20, 30, "jpg"), max_side=15, multiple_of=5).shape
    torch.Size([3, 10, 15])
    """
    Image = require("PIL.Image", "padless.loaders image decoding")
    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    with Image.open(src) as img:
        img.load()
        if mode is not None and img.mode != mode:
            img = img.convert(mode)
        h, w = img.height, img.width
        th, tw = target_size(h, w, max_side=max_side, multiple_of=multiple_of)
        if (th, tw) != (h, w):
            img = img.resize((tw, th), Image.Resampling.BICUBIC)
        return pil_to_tensor(img)


def image_header_size(path: Any) -> tuple[int, int]:
    """``(H, W)`` from the file header, without decoding the pixels."""
    Image = require("PIL.Image", "padless.loaders image sizes")
    with Image.open(path) as img:
        return img.height, img.width
