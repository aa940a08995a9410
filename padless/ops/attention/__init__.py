"""Attention: ``F.scaled_dot_product_attention`` and the Transformer modules on NestedTensors.

One public entry, :func:`attention` (SDPA plus masks, ``mask_mod``/``score_mod``, and the
layouts whose ragged dims are batch dims); :func:`explain` says which backend runs and
why; :func:`row_attention` is the pair-state (triangle) attention with a shared bias.

* :mod:`~padless.ops.attention.sdpa`: the SDPA handler and backend choice (varlen flash,
  FlexAttention, the CPU path on views of the rows)
* :mod:`~padless.ops.attention.buckets`: many short samples as a few padded-within-bucket
  SDPA calls (the CPU path where per-sample calls would dominate)
* :mod:`~padless.ops.attention.rows`: ragged dims other than the sequence dim, row attention
* :mod:`~padless.ops.attention.modules`: ``nn.MultiheadAttention`` and Transformer layers
* ``*_compiled``: the same computations as opaque ops for ``torch.compile``
"""

from padless.ops.attention import modules  # noqa: F401  (registers the module-level handlers)
from padless.ops.attention.rows import row_attention
from padless.ops.attention.sdpa import attention, explain

__all__ = ["attention", "explain", "row_attention"]
