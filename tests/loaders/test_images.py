"""Image decoding: decompression bombs refused from the header, JPEG draft decoding, channel-last views
that the collator packs exactly like contiguous images (issues 13 item 8 and 15 item 3)."""

from __future__ import annotations

import io
import struct
import tarfile
import warnings
import zlib

import numpy as np
import pytest
import torch

import padless
from padless.collation import Collator, Field, collate
from padless.loaders import DEFAULT_MAX_PIXELS, ImageFolder, ImageTooLargeError, WebDatasetReader, decode_image
from padless.loaders.synthetic import image_bytes, random_sizes, write_shards

Image = pytest.importorskip("PIL.Image")


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header declares ``w x h`` RGB pixels but holds almost no data (decoding it would fail)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_bomb_is_refused_from_its_header_before_decoding() -> None:
    bomb = png_header_only(12000, 12000)  # 144 Mpixels: 412 MiB once decoded, 1.7 GiB peak in the audit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no DecompressionBombWarning from Pillow: ours is the stricter limit
        with pytest.raises(ImageTooLargeError, match=r"the image is 12000x12000 \(144000000 pixels\) by its header, over max_pixels=67108864; nothing was decoded"):
            decode_image(bomb)
    assert DEFAULT_MAX_PIXELS == 8192 * 8192
    with pytest.raises(ImageTooLargeError, match="over max_pixels=599"):
        decode_image(image_bytes(20, 30, "png"), max_pixels=599)
    assert decode_image(image_bytes(20, 30, "png"), max_pixels=600).shape == (3, 20, 30)


def test_readers_send_bombs_to_the_handler(tmp_path) -> None:
    path = str(tmp_path / "bomb.tar")
    with tarfile.open(path, "w") as tf:
        for key, data in (("0000", image_bytes(10, 12, "png")), ("0001", png_header_only(12000, 12000)), ("0002", image_bytes(9, 7, "png"))):
            info = tarfile.TarInfo(f"{key}.png")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    seen = []
    got = list(WebDatasetReader(path, handler=lambda e, *, shard, key: seen.append((key, type(e).__name__))))
    assert [s["__key__"] for s in got] == ["0000", "0002"] and seen == [("0001", "ImageTooLargeError")]
    folder = tmp_path / "folder" / "a"
    folder.mkdir(parents=True)
    (folder / "big.png").write_bytes(png_header_only(10000, 10000))
    (folder / "small.png").write_bytes(image_bytes(10, 12, "png"))
    seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning included
        ds = ImageFolder(tmp_path / "folder", handler=lambda e, *, shard, key: seen.append((key, str(e))))
    assert [p.rsplit("/", 1)[1] for p in ds.paths] == ["small.png"]
    assert seen[0][0] == "a/big.png" and "ImageFolder: the image is 10000x10000 (100000000 pixels) by its header" in seen[0][1]
    assert len(ImageFolder(tmp_path / "folder", max_pixels=None, handler=lambda *a, **k: None)) == 2


def test_max_pixels_argument_errors(tmp_path) -> None:
    shards = write_shards(str(tmp_path), num_shards=1, per_shard=1)
    with pytest.raises(ValueError, match=r"WebDatasetReader: max_pixels must be an int >= 1 or None \(no limit\), got 0"):
        WebDatasetReader(shards, max_pixels=0)
    with pytest.raises(ValueError, match=r"ImageFolder: max_pixels must be an int >= 1 or None \(no limit\), got 1.5"):
        ImageFolder(tmp_path, max_pixels=1.5)  # type: ignore[arg-type]


def test_large_jpegs_are_decoded_at_a_reduced_scale(monkeypatch) -> None:
    from PIL import JpegImagePlugin

    drafted = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        out = original(self, mode, size)
        drafted.append(self.size)
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    yy, xx = np.mgrid[0:960, 0:1280]
    smooth = np.stack([xx * 255 // 1280, yy * 255 // 960, (np.sin(xx / 90.0) * np.cos(yy / 70.0) * 120 + 128)], -1)
    buf = io.BytesIO()
    Image.fromarray(smooth.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    img = decode_image(data, max_side=160)
    assert img.shape == (3, 120, 160)
    assert drafted == [(160, 120)]  # decoded at 1/8 scale (not 1280 x 960): no resize needed
    with Image.open(io.BytesIO(data)) as full:  # close to a full decode followed by the same resize
        ref = torch.from_numpy(np.array(full.convert("RGB").resize((160, 120), Image.Resampling.BICUBIC)))
    assert (img.permute(1, 2, 0).float() - ref.float()).abs().mean() < 2
    drafted.clear()
    assert decode_image(image_bytes(60, 80, "jpg"), max_side=50).shape == (3, 38, 50)
    assert drafted == [(80, 60)]  # less than 2x smaller: decoded at full scale


def test_decoded_images_are_channel_last_views_of_the_pixels() -> None:
    data = image_bytes(21, 34, "png", seed=1)
    img = decode_image(data)
    with Image.open(io.BytesIO(data)) as ref_img:
        hwc = torch.from_numpy(np.array(ref_img.convert("RGB")))
    assert img.shape == (3, 21, 34) and img.stride() == (1, 34 * 3, 3)
    assert img.permute(1, 2, 0).is_contiguous() and torch.equal(img.permute(1, 2, 0), hwc)
    gray = decode_image(image_bytes(5, 6, "png", mode="L"), mode=None)
    assert gray.shape == (1, 5, 6) and gray.permute(1, 2, 0).is_contiguous()
    img[0, 0, 0] = 7  # writable, owns its memory
    assert img[0, 0, 0] == 7


def samples(channel_last: bool) -> list[dict]:
    out = []
    for i, (h, w) in enumerate(random_sizes(7, seed=5, low=1, high=40)):
        img = decode_image(image_bytes(h, w, "png", seed=i))
        out.append({"image": img if channel_last else img.contiguous(), "label": i % 3})
    out.append({"image": torch.zeros(3, 0, 5, dtype=torch.uint8), "label": 0})  # an empty image
    return out


@pytest.mark.parametrize("how", ["collate", "Collator", "from_list"])
def test_collating_channel_last_views_equals_collating_contiguous_images(how) -> None:
    views, contiguous = samples(True), samples(False)
    assert views[0]["image"].stride(0) == 1 and contiguous[0]["image"].is_contiguous()
    if how == "from_list":
        a = padless.from_list([s["image"] for s in views], ragged_dims=(1, 2))
        b = padless.from_list([s["image"] for s in contiguous], ragged_dims=(1, 2))
    else:
        fn = collate if how == "collate" else Collator({"image": Field(ragged=(1, 2))})
        ba, bb = fn(views), fn(contiguous)
        assert torch.equal(ba["label"], bb["label"])
        a, b = ba["image"], bb["image"]
    assert torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets()) and torch.equal(a.sizes(), b.sizes())
    assert a.ragged_dims == b.ragged_dims == (1, 2)
    for t, s in zip(a.unbind(), contiguous):
        assert torch.equal(t, s["image"])
    one = padless.from_list([views[1]["image"]], ragged_dims=(1, 2))  # a one-image batch
    assert torch.equal(one.unbind()[0], contiguous[1]["image"])
