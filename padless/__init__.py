"""padless: remove padding from PyTorch, from the file on disk to the loss."""

from padless.tensor import (
    NestedTensor,
    from_list,
    from_njt,
    from_padded,
    from_values,
    to_njt,
    to_padded,
)
from padless import ops as _ops  # noqa: F401  (registers the op layer)
from padless import nested
from padless.ops import patch_grid, patchify, unpatchify

__version__ = "0.1.0"

__all__ = [
    "NestedTensor",
    "from_list",
    "from_njt",
    "from_padded",
    "from_values",
    "nested",
    "patch_grid",
    "patchify",
    "to_njt",
    "to_padded",
    "unpatchify",
]
