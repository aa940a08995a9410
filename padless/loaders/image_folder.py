"""A folder of images at native size, labelled by subfolder (``root/<class>/<file>``).

>>> import tempfile
>>> from padless.loaders.synthetic import write_image_folder
>>> root = tempfile.mkdtemp()
>>> _ = write_image_folder(root, ("cat", "dog"), per_class=2)
>>> ds = ImageFolder(root)
>>> ds.classes, len(ds), ds[0]["image"].shape[0], ds[0]["label"], ds[3]["label"]
(['cat', 'dog'], 4, 3, 0, 1)
>>> ds.sizes().shape   # (H, W) per image, for samplers such as BudgetBatchSampler(ds.sizes(), PixelBudget(...))
(4, 2)
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

import numpy as np
import torch

from padless.loaders.errors import ErrorHandler, SkipAndWarn
from padless.loaders.images import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    ImageTooLargeError,
    NotARegularFileError,
    file_kind,
    check_max_pixels,
    check_size_rules,
    decode_image,
    image_header_size,
    target_size,
)
from padless.loaders.transforms import Transform, apply_transform, sample_transform


class ImageFolder(torch.utils.data.Dataset):
    """Map-style dataset: ``{"image": (C, H, W) uint8, "label": int, "path": str}`` per file.

    Files directly under ``root`` (no subfolder) get no ``"label"`` when
    ``labels=False``; with ``labels=True`` (default) each subfolder of ``root`` is
    a class (sorted by name) and files are found recursively inside it.

    Image headers are read once when the dataset is built (cheap: no pixels are
    decoded) to know every size (``sizes()``, after ``max_side``/``multiple_of``);
    a file whose header cannot be read goes to ``handler`` (default: skip it,
    count, warn once) and is left out of the dataset. Only regular files are
    opened: a FIFO, socket or device named like an image goes to the handler
    (:class:`NotARegularFileError`) instead of blocking the reader. A file that fails later,
    while decoding pixels, raises an error naming the file: a map-style dataset
    cannot skip an index the sampler already chose.

    Images are channel-last ``(C, H, W)`` views (see :func:`padless.loaders.decode_image`).
    A file whose header declares more than ``max_pixels`` pixels (default 8192 x 8192;
    ``None``: no limit) goes to the handler when the dataset is built and is left out.
    ``transform`` (a function of the sample dict, or ``{field: function}``) is applied
    to each sample in ``__getitem__``, in the worker; ``sizes()`` are the sizes before it.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        labels: bool = True,
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
        image_mode: str | None = "RGB",
        max_side: int | None = None,
        multiple_of: int | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        transform: Transform | None = None,
        handler: ErrorHandler | Callable[..., None] | None = None,
    ) -> None:
        check_size_rules(max_side, multiple_of, "ImageFolder")
        check_max_pixels(max_pixels, "ImageFolder")
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"ImageFolder: {root!r} is not a directory")
        self.root = root
        self.image_mode = image_mode
        self.max_side = max_side
        self.multiple_of = multiple_of
        self.max_pixels = max_pixels
        self.transform = sample_transform(transform, "ImageFolder")
        self.handler = handler if handler is not None else SkipAndWarn()
        exts = tuple("." + e.lower().lstrip(".") for e in extensions)
        found: list[tuple[str, int]] = []
        if labels:
            self.classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
            if not self.classes:
                raise FileNotFoundError(f"ImageFolder: {root!r} has no subfolders (one per class); pass labels=False")
            for c, name in enumerate(self.classes):
                for p in image_paths(os.path.join(root, name), exts):
                    found.append((p, c))
        else:
            self.classes = []
            found = [(p, -1) for p in image_paths(root, exts)]
        if not found:
            raise FileNotFoundError(f"ImageFolder: no files with extensions {extensions} under {root!r}")
        self.labels = labels
        paths, targets, sizes = [], [], []
        for p, c in found:
            try:
                mode = os.stat(p).st_mode  # follows symlinks; never opens the file
                if not stat.S_ISREG(mode):
                    raise NotARegularFileError(
                        f"ImageFolder: {p!r} is {file_kind(mode)}, not a regular file; it is left out (opening it could block)"
                    )
                h, w = image_header_size(p)
                if max_pixels is not None and h * w > max_pixels:
                    raise ImageTooLargeError(
                        f"ImageFolder: the image is {w}x{h} ({h * w} pixels) by its header, over max_pixels={max_pixels}; "
                        "it is left out (pass a larger max_pixels=, or None for no limit)"
                    )
            except Exception as e:  # noqa: BLE001 (the handler decides)
                self.handler(e, shard=root, key=os.path.relpath(p, root))
                continue
            paths.append(p)
            targets.append(c)
            sizes.append(target_size(h, w, max_side=max_side, multiple_of=multiple_of))
        self.paths = paths
        self.targets = targets
        self._sizes = np.asarray(sizes, dtype=np.int64).reshape(len(sizes), 2)

    def __len__(self) -> int:
        return len(self.paths)

    def sizes(self) -> np.ndarray:
        """``(H, W)`` of every image as it will be returned, int64 ``(N, 2)``."""
        return self._sizes

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not -n <= index < n:
            raise IndexError(f"ImageFolder: index {index!r} is out of range for {n} images")
        p = self.paths[index]
        try:
            img = decode_image(
                p, mode=self.image_mode, max_side=self.max_side, multiple_of=self.multiple_of, max_pixels=self.max_pixels
            )
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"ImageFolder: cannot decode {p!r} (index {index}): {type(e).__name__}: {e}") from e
        out: dict[str, Any] = {"image": img, "path": p}
        if self.labels:
            out["label"] = self.targets[index]
        if self.transform is not None:
            return apply_transform(self.transform, out, f"{p!r} (index {index})")
        return out

    def __repr__(self) -> str:
        return f"ImageFolder({self.root!r}, {len(self)} images, {len(self.classes)} classes)"


def image_paths(top: str, exts: tuple[str, ...]) -> list[str]:
    """Files under ``top`` (recursively, in sorted order) whose names end with one of ``exts``
    (``(".png", ".jpg")``: lower case, with the dot; names are matched in lower case)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for f in sorted(filenames):
            if f.lower().endswith(exts):
                out.append(os.path.join(dirpath, f))
    return out
