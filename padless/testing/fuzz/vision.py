"""Steps on images ``(C, H_i, W_i)``: interpolation to sizes read from shapes (and their
arithmetic: ``h // 2``, ``2 * h``, ``max(h, w)``), the skip connection of a U-Net
(``size=skip.shape[2:]``), scale factors, and batch-dense maps (pyramid pooling: a dense
``(B, C, k, k)`` map resized back to every image's own size, :mod:`padless.ops.vision.batch_dense`).

Each step's body is written for a batch ``(B, C, H, W)``: on a sample it runs on ``t[None]``
(:meth:`padless.testing.fuzz.core.Side.apply`), as the dense model runs on one image.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step, seeded
from padless.testing.fuzz.shapes import EXTENT_MINMAX

# tags (see padless.testing.fuzz.known)
IMAGES_TRANSPOSED = "images_transposed"

MODES = (
    ("nearest", {}),
    ("nearest-exact", {}),
    ("bilinear", {"align_corners": False}),
    ("bilinear", {"align_corners": True}),
    ("bicubic", {"align_corners": False}),
    ("area", {}),
)

#: target sizes read from ``(h, w) = u.shape[-2:]``: (label, function, tags)
SIZES: tuple[tuple[str, Callable[[Any, Any], Any], frozenset], ...] = (
    ("(h, w)", lambda h, w: (h, w), frozenset()),
    ("(h // 2, w // 2)", lambda h, w: (h // 2, w // 2), frozenset()),
    ("(2 * h, w + 1)", lambda h, w: (2 * h, w + 1), frozenset()),
    ("(w, h)", lambda h, w: (w, h), frozenset()),
    ("(h, 3)", lambda h, w: (h, 3), frozenset()),
    ("(h * 3 // 2, w - 1)", lambda h, w: (h * 3 // 2, w - 1), frozenset()),
    ("max(h, w) square", lambda h, w: (max(h, w), max(h, w)), frozenset({EXTENT_MINMAX})),
    ("min(h, w) square", lambda h, w: (min(h, w), min(h, w)), frozenset({EXTENT_MINMAX})),
    ("(max(h, w), w)", lambda h, w: (max(h, w), w), frozenset({EXTENT_MINMAX})),
)


def _is_images(x: NestedTensor) -> bool:
    return x.sample_dim == 3 and x.ragged_dims == (1, 2)


def vision_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the interpolation and batch-dense steps (images only)."""
    if not _is_images(x):
        return {}
    ch = int(x.shape[1])
    # images whose rows are stored (W, H) (after a transpose of the spatial dims)
    extra = frozenset({IMAGES_TRANSPOSED}) if tuple(x.storage_order) != (1, 2, 0) else frozenset()

    def resize() -> Step:
        mode, kw = c.choice(MODES)
        form = c.choice(["size", "size", "size", "scale", "skip"])
        if form == "size":
            label, size, tags = c.choice(SIZES)

            def body(u):
                h, w = u.shape[-2:]
                return F.interpolate(u, size=size(h, w), mode=mode, **kw)

            return Step(f"interpolate(size={label}, {mode}{kw or ''})", lambda t, o: o.apply(body, t),
                        family="interpolate", tags=tags | extra)
        if form == "scale":
            sf = c.choice([2, 0.5, (2, 1), 1.5, (0.5, 3)])
            return Step(f"interpolate(scale_factor={sf}, {mode}{kw or ''})",
                        lambda t, o: o.apply(lambda u: F.interpolate(u, scale_factor=sf, mode=mode, **kw), t),
                        family="interpolate", tags=extra)
        pool = c.choice(["avg", "max"])
        add = c.choice([False, True])

        def skip(u):  # a U-Net decoder step: down, then back to the skip's own size
            v = (F.avg_pool2d if pool == "avg" else F.max_pool2d)(u, 2, stride=2, padding=1)
            h, w = u.shape[2:]
            up = F.interpolate(v, size=(h, w), mode=mode, **kw)
            return up + u if add else torch.cat([u, up], dim=1)

        return Step(f"skip({pool}_pool2d, interpolate(size=skip.shape[2:], {mode}), {'add' if add else 'cat'})",
                    lambda t, o: o.apply(skip, t), family="interpolate", tags=extra)


    def pyramid() -> Step:
        k = c.choice([1, 2, 3, (2, 3)])
        pool = c.choice([F.adaptive_avg_pool2d, F.adaptive_max_pool2d])
        inner = c.choice(["none", "relu", "affine", "conv1x1"])
        mode, kw = c.choice([m for m in MODES if m[0] != "area"])
        label, size, tags = SIZES[0]
        join = c.choice(["cat", "add"])
        rg = c.choice([False, True])
        w0 = seeded(seed, (ch, ch, 1, 1), x.dtype)

        def body(u, o):
            h, w = u.shape[-2:]
            p = pool(u, k)
            if inner == "relu":
                p = F.relu(p - 0.1)
            elif inner == "affine":
                p = p * 2.0 + 1.0
            elif inner == "conv1x1":
                p = F.conv2d(p, o.param(f"conv{seed}", lambda: w0.clone().requires_grad_(rg)))
            up = F.interpolate(p, size=size(h, w), mode=mode, **kw)
            return torch.cat([u, up], dim=1) if join == "cat" else u + up

        name = f"pyramid({pool.__name__}({k}), {inner}, interpolate(size={label}, {mode}), {join})"
        return Step(name, lambda t, o: o.apply(lambda u: body(u, o), t), family="batch_dense", tags=tags | extra)

    return {"interpolate": [resize], "batch_dense": [pyramid]}
