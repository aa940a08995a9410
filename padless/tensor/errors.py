"""Error types shared by every layer.

Structure errors (mismatched ragged structures, bad offsets or sizes, an op that
cannot keep samples apart) derive from both :class:`ValueError` and
:class:`RuntimeError`: padless code has always raised ``ValueError`` for bad
input, and code written for ``torch.nested`` catches ``RuntimeError``, which
is what torch raises for the same mistakes. Both ``except`` clauses keep working.
"""

from __future__ import annotations


class StructureError(ValueError, RuntimeError):
    """Bad or incompatible ragged structure; the message names the op, the argument and the sample.

    Raised for mismatched ranks, static dims or dtypes, incompatible ragged structures,
    corrupt offsets or sizes, and any op that cannot keep samples apart; the message
    ends with the rewrite when there is one. It derives from ``ValueError`` and
    ``RuntimeError`` so that code written for ``torch.nested`` keeps catching it.

    >>> import torch, padless
    >>> a = padless.from_list([torch.ones(2, 3), torch.ones(4, 3)])
    >>> b = padless.from_list([torch.ones(3, 3), torch.ones(3, 3)])
    >>> try:
    ...     a + b
    ... except padless.StructureError as e:
    ...     print(type(e).__name__)
    StructureError
    >>> issubclass(StructureError, ValueError) and issubclass(StructureError, RuntimeError)
    True
    """


__all__ = ["StructureError"]
