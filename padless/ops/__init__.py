"""The op layer: handlers registered into NestedTensor's two dispatch tables.

Importing this package registers every handler. ``python -m padless.ops`` prints
the coverage table.
"""

from padless.ops import attention, attention_modules, contract, dims, features, linear_norm, loss, pointwise, reduce, shape, shape_rows  # noqa: F401
# The image functions; `padless.ops.patchify` is the function, not the module.
from padless.ops.patchify import patch_grid, patchify, unpatchify
from padless.ops import resample  # noqa: F401  (F.interpolate on images at their own size)
from padless.ops import pixel_layout  # noqa: F401  (F.pad of ragged dims, pixel_shuffle/unshuffle, F.unfold)
from padless.ops import conv  # noqa: F401  (F.conv1d/conv2d/conv_transpose* on packed images, via padless.ops.spatial plans)
from padless.ops import pool  # noqa: F401  (max/avg/adaptive pooling of packed images)
from padless.ops import norm2d  # noqa: F401  (F.batch_norm over real pixels, F.instance_norm)
from padless.ops import nested_compat  # noqa: F401  (nt.to_padded_tensor(), torch.select(nt, 0, i))
from padless.ops import nested_parity  # noqa: F401  (masked_select, apply_, _unsafe_view, index_put as NJT)
from padless.jagged.pooling import embedding_bag  # pooled lookups of JaggedTensor / KeyedJaggedTensor

__all__ = ["attention", "attention_modules", "contract", "dims", "embedding_bag", "features", "linear_norm", "loss", "patch_grid", "patchify", "pointwise", "reduce", "shape", "shape_rows", "unpatchify"]
from padless.ops.attention_rows import row_attention  # SDPA with ragged batch dims; row attention over pair states
from padless.ops import reduce_aten  # noqa: F401  (aten.sum / mean.dim / amax / amin called directly: the torch-level reductions)
from padless.ops import reduce_nan  # noqa: F401  (nansum, nanmean, count_nonzero: sums that skip NaNs / zeros)
from padless.ops import nested_binary  # noqa: F401  (rsub/complex/polar on rows, zero grads of copysign/nextafter/sgn, F.embedding_bag of a NestedTensor)
from padless.ops import nested_index  # noqa: F401  (torch.index_put(nt, [batch], v): whole samples, as NJT)
