"""KeyedJaggedTensor as a pytree node, flattened as TorchRec flattens it.

Its tensors (values, weights, lengths, offsets, per-key-per-rank strides, inverse
indices) are the children and its keys the context, so ``tree_map``, ``torch.export``
and DataLoader pinning reach the tensors. Registered when ``padless.jagged`` is imported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree
from torch import Tensor
from torch.fx._pytree import register_pytree_flatten_spec

from padless.jagged.keyed_jagged import KeyedJaggedTensor


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[Tensor | None], list[str]]:
    spkpr = kjt._stride_per_key_per_rank
    spkpr_t = None
    if spkpr is not None:
        width = max((len(r) for r in spkpr), default=0)  # ragged ranks pad with 0 (no bags)
        spkpr_t = torch.tensor([r + [0] * (width - len(r)) for r in spkpr], dtype=torch.int32).reshape(len(spkpr), width)
    inv = kjt._inverse_indices
    return [kjt._values, kjt._weights, kjt._lengths, kjt._offsets, spkpr_t, None if inv is None else inv[1]], kjt._keys


def _kjt_flatten_with_keys(kjt: KeyedJaggedTensor) -> tuple[list[tuple[Any, Tensor | None]], list[str]]:
    from torch.utils._pytree import GetAttrKey

    values, keys = _kjt_flatten(kjt)
    return [(GetAttrKey(f), v) for f, v in zip(_KJT_FIELDS, values)], keys


def _kjt_unflatten(values: list[Tensor | None], keys: list[str]) -> KeyedJaggedTensor:
    values = list(values)
    if len(values) > len(_KJT_FIELDS):
        raise ValueError(
            f"KeyedJaggedTensor: pytree unflatten got {len(values)} tensors, at most {len(_KJT_FIELDS)} "
            f"({', '.join(_KJT_FIELDS)})"
        )
    values += [None] * (len(_KJT_FIELDS) - len(values))
    v, w, lengths, offsets, spkpr, inv = values
    return KeyedJaggedTensor(
        keys, v, w, lengths, offsets,  # type: ignore[arg-type]
        stride_per_key_per_rank=spkpr,
        inverse_indices=None if inv is None else (list(keys), inv),
    )


_KJT_FIELDS = ("_values", "_weights", "_lengths", "_offsets", "_stride_per_key_per_rank", "_inverse_indices")
# a pytree node with TorchRec's flattening (tensors as children, keys as context), so
# tree_map, torch.export and DataLoader pinning reach its tensors
torch.utils._pytree.register_pytree_node(
    KeyedJaggedTensor,
    _kjt_flatten,
    _kjt_unflatten,
    flatten_with_keys_fn=_kjt_flatten_with_keys,
    serialized_type_name="padless.jagged.KeyedJaggedTensor",
)
register_pytree_flatten_spec(KeyedJaggedTensor, lambda x, spec: _kjt_flatten(x)[0])
