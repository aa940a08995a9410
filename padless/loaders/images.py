"""Image decoding at native resolution: bytes -> ``(C, H, W)`` uint8 tensor (a channel-last view of the
decoder's pixels), with optional size rules and a pixel limit read from the header."""

from __future__ import annotations

import io
import os
import stat
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from padless.loaders._deps import require

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")
DEFAULT_MAX_PIXELS = 8192 * 8192  # 67,108,864 pixels: 192 MiB as RGB uint8; larger images are refused
# The Pillow formats padless opens: raster formats decoded inside Pillow. Anything else (PostScript, EPS
# and PDF, which Pillow renders by running Ghostscript, and every other plugin) is refused by name.
RASTER_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM", "TIFF", "GIF")


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


def check_max_pixels(max_pixels: int | None, what: str) -> None:
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1):
        raise ValueError(f"{what}: max_pixels must be an int >= 1 or None (no limit), got {max_pixels!r}")


class ImageTooLargeError(ValueError):
    """An image whose header declares more pixels than ``max_pixels`` (refused before decoding)."""


class UnsupportedImageFormatError(ValueError):
    """Image data in a format padless does not open (not in ``RASTER_FORMATS``), e.g. EPS behind a ``.jpg`` name.

    ``format`` is the Pillow format its first bytes match.
    """

    def __init__(self, message: str, format: str) -> None:  # noqa: A002 (Pillow's name for it)
        super().__init__(message)
        self.format = format


class NotARegularFileError(OSError):
    """A path named like an image that is not a regular file (a FIFO, a socket, a device): opening it could block."""


def file_kind(mode: int) -> str:
    """What ``os.stat``'s ``st_mode`` describes, for messages ("a FIFO (named pipe)", ...)."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    )
    return next((name for test, name in kinds if test(mode)), f"a special file (mode {oct(mode)})")


def _first_bytes(src: Any, start: int, n: int = 16) -> bytes:
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return f.read(n)
    src.seek(start)
    try:
        return src.read(n)
    finally:
        src.seek(start)


def sniff_format(Image: Any, prefix: bytes) -> str | None:
    """The first Pillow format outside ``RASTER_FORMATS`` whose signature check accepts ``prefix``
    (the checks only compare bytes; nothing is opened or run)."""
    Image.init()
    for fmt, (_, accept) in Image.OPEN.items():
        if fmt in RASTER_FORMATS or accept is None:
            continue
        try:
            ok = accept(prefix)
        except Exception:  # noqa: BLE001 (a check that cannot read this prefix does not match)
            continue
        if ok and not isinstance(ok, str):
            return fmt
    return None


def open_image(src: Any, what: str = "decode_image") -> Any:
    """``PIL.Image.open`` restricted to ``RASTER_FORMATS``: image data that lies about its format
    (EPS in a ``.jpg``) never reaches a plugin that runs an external program (Ghostscript).

    Data in another known format raises :class:`UnsupportedImageFormatError` naming it;
    unknown data raises Pillow's ``UnidentifiedImageError`` naming its first bytes. A path that is not a regular
    file (a FIFO would block the open) raises :class:`NotARegularFileError`.
    """
    Image = require("PIL.Image", "padless.loaders image decoding")
    if isinstance(src, (str, os.PathLike)):
        mode = os.stat(src).st_mode  # never opens it: a FIFO would block the open
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(f"{what}: {os.fspath(src)!r} is {file_kind(mode)}, not a regular file; it was not opened")
    start = 0 if isinstance(src, (str, os.PathLike)) else src.tell()
    try:
        return Image.open(src, formats=RASTER_FORMATS)
    except Image.UnidentifiedImageError as e:
        prefix = _first_bytes(src, start)
        found = sniff_format(Image, prefix)
        if found is None:  # Pillow's message names the stream object (its repr): name the data instead
            which = f"{os.fspath(src)!r}" if isinstance(src, (str, os.PathLike)) else "the image data"
            raise Image.UnidentifiedImageError(
                f"{what}: cannot identify {which} as an image: its first bytes {prefix[:12]!r} are none of "
                f"{', '.join(RASTER_FORMATS)} (not an image, or damaged)"
            ) from None
        raise UnsupportedImageFormatError(
            f"{what}: the image data is in the {found} format by its first bytes, which padless does not open "
            f"(it opens {', '.join(RASTER_FORMATS)}); nothing was decoded or run",
            found,
        ) from e


def pil_to_tensor(img: Any) -> Tensor:
    """A PIL image as a ``(C, H, W)`` tensor that is a view of the decoder's ``(H, W, C)`` pixels.

    The strides are channel-last (``stride(0) == 1``): no transpose copy is made, and
    the collator packs such an image into its ``(H*W, C)`` rows with a plain memory
    copy. 8-bit modes give uint8; 16-bit and float modes keep their dtype.

    >>> from PIL import Image
    >>> t = pil_to_tensor(Image.new("RGB", (4, 2)))
    >>> tuple(t.shape), t.stride(), t.permute(1, 2, 0).is_contiguous()
    ((3, 2, 4), (1, 12, 3), True)
    """
    arr = np.array(img)  # one copy out of Pillow, writable
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1)


def decode_image(
    data: bytes | Any,
    *,
    mode: str | None = "RGB",
    max_side: int | None = None,
    multiple_of: int | None = None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> Tensor:
    """Decode image bytes (or an open file / path) to ``(C, H, W)``, native size unless a rule resizes it.

    The result is a channel-last view of the decoded ``(H, W, C)`` pixels (see
    :func:`pil_to_tensor`); call ``.contiguous()`` for ``(C, H, W)`` strides.

    Decompression bombs: the size is read from the header first, and an image of
    more than ``max_pixels`` pixels (default ``DEFAULT_MAX_PIXELS``, 8192 x 8192,
    192 MiB as RGB) raises :class:`ImageTooLargeError` before any pixel is decoded
    (readers send it to their error handler). ``None`` removes the limit
    (Pillow's own limit, ``PIL.Image.MAX_IMAGE_PIXELS``, still applies).

    Only the raster formats in ``RASTER_FORMATS`` are opened (see :func:`open_image`):
    PostScript, EPS or PDF data raises :class:`UnsupportedImageFormatError` without
    starting Ghostscript, whatever the file is called.

    A JPEG that ``max_side`` shrinks by 2x or more is decoded at a reduced scale
    (1/2, 1/4 or 1/8, Pillow's ``draft``; at least the target size), then resized:
    a large photo never exists in memory at full size. Its pixels differ slightly
    from a full decode followed by the resize.

    >>> from padless.loaders.synthetic import image_bytes
    >>> decode_image(image_bytes(20, 30, "png")).shape
    torch.Size([3, 20, 30])
    >>> decode_image(image_bytes(20, 30, "jpg"), max_side=15, multiple_of=5).shape
    torch.Size([3, 10, 15])
    >>> decode_image(image_bytes(20, 30, "png"), max_pixels=500)
    Traceback (most recent call last):
    ...
    padless.loaders.images.ImageTooLargeError: decode_image: the image is 30x20 (600 pixels) by its header, over max_pixels=500; nothing was decoded (pass a larger max_pixels=, or None for no limit)
    """
    Image = require("PIL.Image", "padless.loaders image decoding")
    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    with warnings.catch_warnings():
        if max_pixels is not None and (Image.MAX_IMAGE_PIXELS is None or max_pixels <= Image.MAX_IMAGE_PIXELS):
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our limit is the stricter one
        opened = open_image(src)
    with opened as img:
        h, w = img.height, img.width  # from the header: nothing is decoded yet
        if max_pixels is not None and h * w > max_pixels:
            raise ImageTooLargeError(
                f"decode_image: the image is {w}x{h} ({h * w} pixels) by its header, over max_pixels={max_pixels}; "
                "nothing was decoded (pass a larger max_pixels=, or None for no limit)"
            )
        th, tw = target_size(h, w, max_side=max_side, multiple_of=multiple_of)
        if (th, tw) != (h, w) and img.format == "JPEG":
            img.draft(None, (tw, th))  # decode at 1/2, 1/4 or 1/8 scale when that still covers the target
        img.load()
        if mode is not None and img.mode != mode:
            img = img.convert(mode)
        if img.size != (tw, th):
            img = img.resize((tw, th), Image.Resampling.BICUBIC)
        return pil_to_tensor(img)


def image_header_size(path: Any) -> tuple[int, int]:
    """``(H, W)`` from the file header, without decoding the pixels (and without Pillow's
    decompression-bomb warning: the caller checks the size against its own limit)."""
    Image = require("PIL.Image", "padless.loaders image sizes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with open_image(path, "image_header_size") as img:
            return img.height, img.width
