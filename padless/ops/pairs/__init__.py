"""Pairs: contractions (``@``, ``bmm``, ``einsum``) and triangle products on pair states.

Broadcasting that creates pair axes (``x[:, :, None] + x[:, None]``) is the generic
pointwise path of :mod:`padless.ops.rows` on the plans of :mod:`padless.ops.common.broadcast`.
"""

from padless.ops.pairs import contract, triangle  # noqa: F401
