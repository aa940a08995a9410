"""The op layer: handlers registered into NestedTensor's two dispatch tables.

Importing this package registers every handler; ``python -m padless.ops`` prints the
coverage table. The layer is cut into families, each a package that registers its own
handlers and holds its eager path, its compiled path and its docs together:

========== ==========================================================================
family     what it answers
========== ==========================================================================
rows       feature-wise ops (the generic pointwise path, linear, norms, activations,
           losses), reductions over any dims, and shape ops
pairs      contractions (``@``, ``bmm``, ``einsum``) and triangle products
attention  ``F.scaled_dot_product_attention``, the Transformer modules, row attention
vision     convolution, pooling, batch/instance norm, resampling, patches, pixel layout
recurrent  ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` through the ``PackedSequence`` kernels
nested     ``torch.nested`` (NJT) parity: the calls NJT code makes that NestedTensor
           answers as NJT does
========== ==========================================================================

Below the families sit :mod:`padless.ops.common` (helpers every family may use:
structure building, segmented reductions, broadcast plans, the generic pointwise
engine) and :mod:`padless.ops.kernels` (Triton kernels and their torch twins). Arrows
point one way, ``tensor <- kernels <- common <- families``, and a family never imports
another family; ``lint-imports`` checks that contract (``pyproject.toml``).
"""

from padless.ops import rows, pairs, attention, vision, recurrent, nested  # noqa: F401  (registers every family's handlers)
from padless.ops.attention import row_attention
from padless.ops.vision import patch_grid, patchify, unpatchify
from padless.jagged.pooling import embedding_bag  # pooled lookups of JaggedTensor / KeyedJaggedTensor

#: The op families, in registration order.
FAMILIES = ("rows", "pairs", "attention", "vision", "recurrent", "nested")

__all__ = ["FAMILIES", "attention", "embedding_bag", "nested", "pairs", "patch_grid", "patchify", "recurrent", "row_attention", "rows", "unpatchify", "vision"]
