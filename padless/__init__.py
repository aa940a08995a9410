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

__version__ = "0.1.0"

__all__ = [
    "NestedTensor",
    "from_list",
    "from_njt",
    "from_padded",
    "from_values",
    "nested",
    "to_njt",
    "to_padded",
]
