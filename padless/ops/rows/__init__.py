"""Rows: feature-wise ops, reductions and shape ops.

Feature-wise ops (pointwise math, ``linear``, norms, activations, dropout, embedding,
losses) run once on the packed ``values`` and keep the structure; reductions over
ragged dims are segmented sums over rows; shape ops (``unsqueeze``, ``transpose``,
``reshape``, ``cat``, ``narrow``, ...) only rewrite the structure or pick rows.
"""

from padless.ops.rows import pointwise, reduce, reduce_aten, reduce_nan  # noqa: F401
from padless.ops.rows import linear_norm, features, loss  # noqa: F401
from padless.ops.rows import dims, setitem, shape, shape_rows, static_dims  # noqa: F401
