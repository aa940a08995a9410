"""Worker-side collation of sparse features into a KeyedJaggedTensor."""

from __future__ import annotations

from itertools import chain
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from padless.jagged.keyed_jagged import KeyedJaggedTensor


def _is_plain_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x)


def collate_sparse(
    samples: Sequence[Mapping[str, Any]],
    keys: Sequence[str] | None = None,
    *,
    dtype: torch.dtype = torch.int64,
    weights_dtype: torch.dtype = torch.float32,
    lengths_dtype: torch.dtype = torch.int32,
    pin_memory: bool = False,
) -> KeyedJaggedTensor:
    """Turn per-sample ``{feature: ids}`` dicts into one KeyedJaggedTensor, on the host.

    Each value is a 1-D id list (python list, tensor or numpy array) or an ``(ids,
    weights)`` pair for a weighted feature. A feature missing from a sample is an empty
    bag. ``keys`` declares the features and their order (features not listed are left
    out); by default, every feature seen, in order of first appearance. If any entry is
    weighted the KJT is weighted and unweighted entries get weight 1.

    ``length_per_key``/``offset_per_key`` and the host offsets are computed here (in
    the DataLoader worker), so the KJT never syncs after ``to(device)``.
    ``pin_memory=True`` pins every tensor (needs CUDA).

    >>> kjt = collate_sparse([{"a": [1, 2], "b": [7]}, {"a": [], "b": [8, 9]}])
    >>> kjt.keys(), kjt.values().tolist(), kjt.lengths().tolist(), kjt.length_per_key()
    (['a', 'b'], [1, 2, 7, 8, 9], [2, 0, 1, 2], [2, 3])
    """
    what = "collate_sparse"
    if keys is None:
        seen: dict[str, None] = {}
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping):
                raise TypeError(f"{what}: sample {i} must be a mapping {{feature: ids}}, got {type(s).__name__}")
            for k in s:
                seen.setdefault(k, None)
        keys = list(seen)
    keys = list(keys)
    b = len(samples)
    ids_parts: list[Any] = []
    w_parts: list[Any | None] = []
    lengths: list[int] = []
    weighted = False
    for k in keys:
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping):
                raise TypeError(f"{what}: sample {i} must be a mapping {{feature: ids}}, got {type(s).__name__}")
            x = s.get(k)
            w = None
            if x is None:
                x = []
            elif isinstance(x, tuple) and len(x) == 2 and not _is_plain_list(x):
                x, w = x
                weighted = True
            n = len(x) if not isinstance(x, Tensor) else (x.numel() if x.dim() <= 1 else -1)
            if n < 0 or (hasattr(x, "ndim") and x.ndim > 1):
                raise ValueError(f"{what}: sample {i} feature {k!r}: ids must be 1-D, got shape {tuple(x.shape)}")
            if w is not None and len(w) != n:
                raise ValueError(f"{what}: sample {i} feature {k!r}: {n} ids but {len(w)} weights")
            ids_parts.append(x)
            w_parts.append(w)
            lengths.append(n)
    values = None
    if all(type(x) is list for x in ids_parts):
        # the common case (python lists from a dataset): one flat list, one tensor
        try:
            values = torch.tensor(list(chain.from_iterable(ids_parts)), dtype=dtype)
        except (TypeError, ValueError):
            values = None  # nested or odd entries: the per-entry path below names the culprit
        if values is not None and values.dim() != 1:
            values = None
    if values is None:
        parts = []
        for j, x in enumerate(ids_parts):
            t = torch.as_tensor(x, dtype=dtype)
            if t.dim() > 1:
                k, i = keys[j // max(b, 1)], j % max(b, 1)
                raise ValueError(f"{what}: sample {i} feature {k!r}: ids must be 1-D, got shape {tuple(t.shape)}")
            parts.append(t.reshape(-1))
        values = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    weights = None
    if weighted:
        parts = [
            torch.ones(n, dtype=weights_dtype) if w is None else torch.as_tensor(w, dtype=weights_dtype).reshape(-1)
            for w, n in zip(w_parts, lengths)
        ]
        weights = torch.cat(parts)
    kjt = KeyedJaggedTensor(
        keys, values, weights, lengths=torch.tensor(lengths, dtype=lengths_dtype), stride=b
    )
    kjt.validate().host_offsets()  # in the worker: host offsets and per-key lists travel with the batch
    return kjt.pin_memory() if pin_memory else kjt
