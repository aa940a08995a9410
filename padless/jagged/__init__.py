"""TorchRec-style sparse-feature types on padless' packed layout.

``JaggedTensor`` (one ragged axis), ``KeyedJaggedTensor`` (several features,
key-major), ``KeyedTensor`` (dense per-key blocks), ``embedding_bag`` (pooled lookup
into a KeyedTensor) and ``collate_sparse`` (per-sample ``{feature: ids}`` dicts into a
KeyedJaggedTensor, host metadata precomputed), ``regroup_kts`` / ``permute_multi_embedding``
/ ``KTRegroupAsDict`` (pooled embeddings regrouped by key). Same method names and semantics as
TorchRec; TorchRec itself is optional (``to_torchrec()``/``from_torchrec()``).
"""

from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.keyed_jagged import KeyedJaggedTensor
from padless.jagged import kjt_pytree as _kjt_pytree  # noqa: F401  (registers KeyedJaggedTensor as a pytree node)
from padless.jagged.keyed_tensor import KeyedTensor
from padless.jagged.pooling import embedding_bag
from padless.jagged.collate import collate_sparse
from padless.jagged.validate import validate
from padless.jagged.regroup import KTRegroupAsDict, permute_multi_embedding, regroup_kts

__all__ = [
    "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "KTRegroupAsDict", "collate_sparse", "embedding_bag",
    "permute_multi_embedding", "regroup_kts", "validate",
]
