"""The op layer: handlers registered into NestedTensor's two dispatch tables.

Importing this package registers every handler. ``python -m padless.ops`` prints
the coverage table.
"""

from padless.ops import linear_norm, pointwise, reduce  # noqa: F401

__all__ = ["linear_norm", "pointwise", "reduce"]
