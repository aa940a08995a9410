"""Pooled embedding lookup over jagged ids: ``F.embedding_bag`` fed with offsets, no padding."""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from padless.jagged import fx
from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.keyed_jagged import KeyedJaggedTensor
from padless.jagged.keyed_tensor import KeyedTensor
from padless.tensor.traced import row_range

Table = Union[Tensor, nn.Module]
_MODES = ("sum", "mean", "max")


def _table(what: str, name: str, t: Table) -> Tensor:
    if isinstance(t, nn.Module):
        w = getattr(t, "weight", None)
        if not isinstance(w, Tensor):
            raise TypeError(f"{what}: table for {name!r} is a {type(t).__name__} without a .weight tensor")
        t = w
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(
            f"{what}: table for {name!r} must be a (num_embeddings, dim) tensor or an nn.Embedding(Bag), "
            f"got {type(t).__name__} {tuple(t.shape) if isinstance(t, Tensor) else ''}"
        )
    return t


def _psw(
    what: str, features: JaggedTensor | KeyedJaggedTensor, per_sample_weights: Tensor | bool | None, mode: str
) -> Tensor | None:
    if per_sample_weights is False:
        return None
    if per_sample_weights is None or per_sample_weights is True:
        w = features.weights_or_none()
        if w is None and per_sample_weights is True:
            raise ValueError(f"{what}: per_sample_weights=True but the features carry no weights")
    else:
        w = per_sample_weights
    if w is None:
        return None
    if mode != "sum":
        raise ValueError(
            f"{what}: per-sample weights need mode='sum' (F.embedding_bag's rule), got mode={mode!r}; "
            "pass per_sample_weights=False to ignore the features' weights"
        )
    if w.shape != features.values().shape:
        raise ValueError(
            f"{what}: per_sample_weights must have the shape of values {tuple(features.values().shape)}, "
            f"got {tuple(w.shape)}"
        )
    return w


def _bag_offsets(features: JaggedTensor | KeyedJaggedTensor) -> Tensor:
    """The bag offsets. Under ``torch.compile`` they come from the tensors the features hold,
    without the host-side structure checks (those read data; validate before compiling)."""
    if not torch.compiler.is_compiling():
        return features.offsets()
    off = features.offsets_or_none()
    if off is not None:
        return off
    lengths = features.lengths_or_none()
    if lengths is None:  # a KJT built with neither: no bags
        return features.values().new_zeros(1, dtype=torch.int64)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _bag(ids: Tensor, offsets: Tensor, table: Tensor, mode: str, psw: Tensor | None) -> Tensor:
    return F.embedding_bag(
        ids, table, offsets.to(ids.dtype), mode=mode, per_sample_weights=psw, include_last_offset=True
    )


@fx.leaf  # under torch.fx: one node when the features (or tables) are traced
def embedding_bag(
    features: JaggedTensor | KeyedJaggedTensor,
    weight: Table | Mapping[str, Table] | Sequence[Table],
    *,
    mode: str = "sum",
    per_sample_weights: Tensor | bool | None = None,
    key: str = "embedding",
) -> KeyedTensor:
    """Pool each bag of ids into one embedding: a ``KeyedTensor`` of ``(B, sum of dims)``.

    ``features`` is a JaggedTensor (one table, output key ``key``) or a
    KeyedJaggedTensor (one table per key: a tensor shared by every key, a
    ``{key: table}`` mapping or ``nn.ModuleDict``, or a sequence in key order; tables are ``(N, D_k)``
    tensors or ``nn.Embedding``/``nn.EmbeddingBag`` modules). Each key runs one
    ``F.embedding_bag`` on its slice of the packed ids with its offsets (a shared table:
    one call for all keys), so autograd reaches the tables and nothing is padded.

    ``per_sample_weights``: None uses the features' weights when they have some, True
    requires them, False ignores them, a tensor (shape of values) overrides them;
    weights need ``mode="sum"``. Empty bags pool to zeros.

    ids ``[[1, 2], [], [3]]`` for "f" (offsets ``[0, 2, 2, 3]``), table ``W`` of dim D::

        embedding_bag(kjt, {"f": W})["f"] == [W[1] + W[2], 0, W[3]]      (3, D)
    """
    what = "embedding_bag"
    if mode not in _MODES:
        raise ValueError(f"{what}: mode must be one of {_MODES}, got {mode!r}")
    if not torch.compiler.is_compiling() and isinstance(features, (JaggedTensor, KeyedJaggedTensor)):
        # pooling reads ids through the structure: a fault raises here (keys are positional: a
        # KJT permuted with a repeated key pools each copy)
        features._readable() if isinstance(features, KeyedJaggedTensor) else features.validate()
    psw = _psw(what, features, per_sample_weights, mode)
    ids = features.values()
    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: ids must be a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if isinstance(features, JaggedTensor):
        if isinstance(weight, Mapping) or isinstance(weight, (list, tuple)):
            raise TypeError(f"{what}: a JaggedTensor takes one table, got a {type(weight).__name__}")
        t = _table(what, key, weight)  # type: ignore[arg-type]
        out = _bag(ids, _bag_offsets(features), t, mode, psw)
        return KeyedTensor([key], [t.shape[1]], out, key_dim=1)
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{what}: features must be a JaggedTensor or KeyedJaggedTensor, got {type(features).__name__}")
    kjt = features
    keys = kjt.keys()
    if kjt.variable_stride_per_key():
        raise ValueError(
            f"{what}: keys have different batch sizes {kjt.stride_per_key()}; a KeyedTensor needs one batch "
            "(pool each key's JaggedTensor from to_dict() instead)"
        )
    offsets = _bag_offsets(kjt)
    compiling = torch.compiler.is_compiling()
    # compiled: the batch size from a tensor size (symbolic), not the python int stride()
    b = (offsets.shape[0] - 1) // max(len(keys), 1) if compiling else kjt.stride()
    if isinstance(weight, nn.ModuleDict):  # {key: nn.Embedding} as a module: a mapping of tables
        weight = dict(weight.items())
    if isinstance(weight, (Tensor, nn.Module)):
        t = _table(what, "every key", weight)
        pooled = _bag(ids, offsets, t, mode, psw)  # (K*B, D), key-major
        d = t.shape[1]
        values = pooled.view(len(keys), b, d).transpose(0, 1).reshape(b, len(keys) * d)
        return KeyedTensor(keys, [d] * len(keys), values, key_dim=1)
    if isinstance(weight, Mapping):
        missing = [k for k in keys if k not in weight]
        if missing:
            raise KeyError(f"{what}: no table for keys {missing}; tables given for {list(weight)}")
        tables = [_table(what, k, weight[k]) for k in keys]
    else:
        if len(weight) != len(keys):
            raise ValueError(f"{what}: {len(weight)} tables for {len(keys)} keys {keys}")
        tables = [_table(what, k, w) for k, w in zip(keys, weight)]
    outs = []
    if compiling:  # each key's ids are a data-dependent range: an unbacked size in the graph
        for i, t in enumerate(tables):
            rows = row_range(offsets, i * b, (i + 1) * b)
            off = offsets[i * b : (i + 1) * b + 1]
            outs.append(
                _bag(ids.index_select(0, rows), off - off[:1], t, mode, None if psw is None else psw.index_select(0, rows))
            )
    else:
        opk = kjt.offset_per_key()
        lop = kjt.lengths_offset_per_key()
        for i, t in enumerate(tables):
            s, e = opk[i], opk[i + 1]
            outs.append(
                _bag(ids[s:e], offsets[lop[i] : lop[i + 1] + 1] - s, t, mode, None if psw is None else psw[s:e])
            )
    values = torch.cat(outs, dim=1) if outs else ids.new_zeros((b, 0), dtype=torch.float32)
    return KeyedTensor(keys, [t.shape[1] for t in tables], values, key_dim=1)
