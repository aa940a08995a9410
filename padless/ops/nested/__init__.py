"""torch.nested parity: calls that code written for NJT makes, answered as NJT does.

``nt.to_padded_tensor()``, ``torch.select(nt, 0, i)``, ``masked_select``, ``_unsafe_view``,
``index_put`` with batch indices, ``rsub``/``complex``/``polar`` on rows, the zero
gradients of ``copysign``/``nextafter``/``sgn``, ``F.embedding_bag`` of a NestedTensor.
"""

from padless.ops.nested import compat, parity, binary, index  # noqa: F401
