"""Vision: convolution, pooling, normalisation, resampling and patches on images at
their own sizes, each image computed as the dense op on that image alone.

Every spatial op shares one *spatial plan* per image structure and layer geometry
(:mod:`padless.ops.vision.spatial`); :mod:`~padless.ops.vision.traced` and
:mod:`~padless.ops.vision.compiled` are the same ops inside ``torch.compile``.
"""

from padless.ops.vision import spatial, conv, pool, norm2d, resample, pixel_layout  # noqa: F401
from padless.ops.vision.patchify import patch_grid, patchify, unpatchify
from padless.ops.vision.spatial import build_spatial_plan

__all__ = ["build_spatial_plan", "patch_grid", "patchify", "unpatchify"]
