"""Small on-disk datasets for tests, examples and the demo: real JPEG/PNG files, tar shards, folders.

Everything is deterministic given ``seed``. Pillow is required (the ``padless[loaders]`` extra).

>>> import tempfile, tarfile
>>> d = tempfile.mkdtemp()
>>> paths = write_shards(d, num_shards=2, per_shard=3, seed=0)
>>> [len(tarfile.open(p).getnames()) for p in paths]
[6, 6]
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Sequence

import numpy as np

from padless.loaders._deps import require


def image_bytes(h: int, w: int, fmt: str = "png", seed: int = 0, mode: str = "RGB") -> bytes:
    """Encode a random-but-smooth ``h x w`` image as JPEG or PNG bytes."""
    Image = require("PIL.Image", "padless.loaders.synthetic")
    rng = np.random.default_rng(seed)
    c = {"RGB": 3, "L": 1}[mode]
    base = rng.integers(0, 256, size=(max(1, h // 4 + 1), max(1, w // 4 + 1), c), dtype=np.uint8)
    arr = np.repeat(np.repeat(base, 4, axis=0), 4, axis=1)[:h, :w]
    img = Image.fromarray(arr[:, :, 0] if mode == "L" else arr, mode=mode)
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG"}[fmt.lower()])
    return buf.getvalue()


def random_sizes(n: int, seed: int = 0, low: int = 8, high: int = 64) -> list[tuple[int, int]]:
    """``n`` image sizes ``(H, W)`` with sides uniform in ``[low, high]``."""
    rng = np.random.default_rng(seed)
    return [(int(h), int(w)) for h, w in rng.integers(low, high + 1, size=(n, 2))]


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tf.addfile(info, io.BytesIO(data))


def write_shards(
    root: str,
    *,
    num_shards: int = 4,
    per_shard: int = 8,
    seed: int = 0,
    low: int = 8,
    high: int = 64,
    corrupt: Sequence[str] = (),
    truncate: Sequence[int] = (),
) -> list[str]:
    """Write webdataset tar shards ``shard-000000.tar`` ...: each sample ``{key}.{jpg|png}``, ``{key}.cls``.

    Keys are ``"{shard:03d}{i:05d}"``; even samples are PNG, odd ones JPEG; the class is ``i % 3``.
    ``corrupt`` lists keys whose image bytes are garbage; ``truncate`` lists shard
    numbers whose last member is cut in half (a truncated tar).
    """
    os.makedirs(root, exist_ok=True)
    paths = []
    sizes = random_sizes(num_shards * per_shard, seed=seed, low=low, high=high)
    for s in range(num_shards):
        path = os.path.join(root, f"shard-{s:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_shard):
                key = f"{s:03d}{i:05d}"
                h, w = sizes[s * per_shard + i]
                ext = "png" if i % 2 == 0 else "jpg"
                data = b"this is not an image" if key in corrupt else image_bytes(h, w, ext, seed=seed * 7919 + s * per_shard + i)
                _add(tf, f"{key}.{ext}", data)
                _add(tf, f"{key}.cls", str(i % 3).encode())
        if s in truncate:
            _truncate_last_member(path)
        paths.append(path)
    return paths


def _truncate_last_member(path: str) -> None:
    with tarfile.open(path) as tf:
        last = tf.getmembers()[-2]  # the last image member (the .cls follows it)
        cut = last.offset_data + max(1, last.size // 2)
    with open(path, "r+b") as f:
        f.truncate(cut)


def write_image_folder(
    root: str,
    classes: Sequence[str] = ("cat", "dog"),
    *,
    per_class: int = 4,
    seed: int = 0,
    low: int = 8,
    high: int = 64,
    corrupt: int = 0,
) -> list[str]:
    """``root/<class>/<i>.{png|jpg}`` images of varied sizes; ``corrupt`` garbage files in the first class."""
    paths = []
    sizes = random_sizes(len(classes) * per_class, seed=seed, low=low, high=high)
    for c, name in enumerate(classes):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(per_class):
            ext = "png" if i % 2 == 0 else "jpg"
            p = os.path.join(root, name, f"{i:04d}.{ext}")
            h, w = sizes[c * per_class + i]
            with open(p, "wb") as f:
                f.write(image_bytes(h, w, ext, seed=seed * 31 + c * per_class + i))
            paths.append(p)
    for j in range(corrupt):
        p = os.path.join(root, classes[0], f"corrupt{j}.jpg")
        with open(p, "wb") as f:
            f.write(b"\xff\xd8 not really a jpeg")
        paths.append(p)
    return paths


def token_lengths(n: int, *, seed: int = 0, mean: float = 4.0, sigma: float = 0.7, low: int = 1, high: int = 512) -> np.ndarray:
    """Long-tailed sequence lengths (lognormal), clipped to ``[low, high]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mean, sigma, size=n)), low, high).astype(np.int64)


def write_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
