"""Error types shared by every layer.

Structure errors (mismatched ragged structures, bad offsets or sizes, an op that
cannot keep samples apart) derive from both :class:`ValueError` and
:class:`RuntimeError`: padless code has always raised ``ValueError`` for bad
input, and code written for ``torch.nested`` catches ``RuntimeError``, which
is what torch raises for the same mistakes. Both ``except`` clauses keep working.
"""

from __future__ import annotations


class StructureError(ValueError, RuntimeError):
    """Bad or incompatible ragged structure; message names the op, argument and sample.

    >>> issubclass(StructureError, ValueError) and issubclass(StructureError, RuntimeError)
    True
    """


__all__ = ["StructureError"]
