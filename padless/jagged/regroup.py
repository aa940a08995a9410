"""Regrouping pooled embeddings: TorchRec's ``regroup_kts``, ``permute_multi_embedding`` and
``KTRegroupAsDict`` on padless' :class:`~padless.jagged.KeyedTensor`.

Given KeyedTensors (the pooled outputs of several embedding-bag collections) and groups of
keys, each returns one tensor per group: the named keys' blocks concatenated along the key
dim, in group order. A key may appear in several groups; where several KeyedTensors hold a
key, the last one's block is used (TorchRec's rule). Two KeyedTensors over a batch of 2::

    kt0: keys ["a", "b"], length_per_key [1, 2]     kt1: keys ["c"], length_per_key [1]
         values [[a0, b0, b0'],                            values [[c0],
                 [a1, b1, b1']]                                    [c1]]

    regroup_kts([kt0, kt1], [["c", "a"], ["b"]])
        -> [ [[c0, a0], [c1, a1]],   [[b0, b0'], [b1, b1']] ]

Both are vectorised over the batch and make no python work per sample: ``regroup_kts`` is
one ``torch.cat`` of column slices (views) split into the groups (the outputs share one
buffer); ``permute_multi_embedding`` is one ``torch.cat`` per group, each group its own
tensor, as FBGEMM's op returns. Which slices to take (adjacent keys of one KeyedTensor
merged into one slice) is planned once per (keys, widths, groups) and cached, as TorchRec
precomputes its permutes. Both are differentiable and become one node under
``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch
from torch import Tensor

from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from padless.jagged import fx
from padless.jagged.keyed_tensor import KeyedTensor


def _columns(what: str, keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]):
    """``(key_dim, per group [(kt index, start, width), ...])`` on the host."""
    if not keyed_tensors:
        raise ValueError(f"{what}: needs at least one KeyedTensor")
    dims = {kt.key_dim() for kt in keyed_tensors}
    if len(dims) != 1:
        raise ValueError(f"{what}: the KeyedTensors have different key dims {sorted(dims)}")
    where: dict[str, tuple[int, int, int]] = {}
    for i, kt in enumerate(keyed_tensors):
        for k, start, width in zip(kt.keys(), kt.offset_per_key(), kt.length_per_key()):
            where[k] = (i, start, width)  # the last KeyedTensor holding a key wins, as in TorchRec
    out = []
    for g in groups:
        missing = [k for k in g if k not in where]
        if missing:
            raise KeyError(f"{what}: keys {missing} are in no KeyedTensor; available: {list(where)}")
        out.append([where[k] for k in g])
    return dims.pop(), out


def _empty(kt: KeyedTensor, dim: int) -> Tensor:
    v = kt.values()
    return v.new_empty(v.shape[:dim] + (0,) + v.shape[dim + 1 :])


_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLAN_CACHE = 64  # distinct (keys, widths, groups) signatures kept


def _plan(what: str, keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]):
    """``(key_dim, per group [(kt index, start, width), ...])``, adjacent blocks of one
    KeyedTensor merged into one slice; cached by signature (a model's steady state computes
    it once)."""
    if not keyed_tensors:
        _columns(what, keyed_tensors, groups)  # raises the error
    sig = (
        tuple((tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim()) for kt in keyed_tensors),
        tuple(tuple(g) for g in groups),
    )
    hit = _PLANS.get(sig)
    if hit is not None:
        _PLANS.move_to_end(sig)
        return hit
    dim, cols = _columns(what, keyed_tensors, groups)
    runs = []
    for g in cols:
        merged: list[tuple[int, int, int]] = []
        for i, start, width in g:
            if merged and merged[-1][0] == i and merged[-1][1] + merged[-1][2] == start:
                merged[-1] = (i, merged[-1][1], merged[-1][2] + width)
            else:
                merged.append((i, start, width))
        runs.append(merged)
    plan = (dim, runs)
    _PLANS[sig] = plan
    if len(_PLANS) > _PLAN_CACHE:
        _PLANS.popitem(last=False)
    return plan


@fx.leaf
def regroup_kts(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """One tensor per group, the groups' key blocks concatenated along the key dim (TorchRec's
    ``regroup_kts``): one ``torch.cat`` of column slices, split into the groups (views of one buffer).

    >>> kt = KeyedTensor.from_tensor_list(["a", "b", "c"], [torch.zeros(2, 1), torch.ones(2, 2), torch.full((2, 1), 2.0)])
    >>> [t.tolist() for t in regroup_kts([kt], [["c", "a"], ["b"]])]
    [[[2.0, 0.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]
    """
    dim, runs = _plan("regroup_kts", keyed_tensors, groups)
    values = [kt.values() for kt in keyed_tensors]
    parts = [values[i].narrow(dim, start, width) for g in runs for i, start, width in g]
    if not parts:
        return [_empty(keyed_tensors[0], dim) for _ in runs]
    out = torch.cat(parts, dim)
    return list(out.split([sum(w for _, _, w in g) for g in runs], dim))


@fx.leaf
def permute_multi_embedding(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """:func:`regroup_kts` as a permutation of columns into separate outputs (TorchRec's
    ``permute_multi_embedding``): per group one ``torch.cat`` of its column slices (adjacent
    keys merged into one slice, the plan cached); each group is its own tensor.

    >>> kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1), torch.ones(2, 2)])
    >>> [t.shape for t in permute_multi_embedding([kt], [["b", "a"], ["a"]])]
    [torch.Size([2, 3]), torch.Size([2, 1])]
    """
    dim, runs = _plan("permute_multi_embedding", keyed_tensors, groups)
    values = [kt.values() for kt in keyed_tensors]
    return [
        torch.cat([values[i].narrow(dim, start, width) for i, start, width in g], dim) if g else _empty(keyed_tensors[0], dim)
        for g in runs
    ]


class KTRegroupAsDict(torch.nn.Module):
    """``KeyedTensor.regroup_as_dict`` as a module (TorchRec's ``KTRegroupAsDict``): groups of
    keys in, ``{name: tensor}`` out, with the regrouping plan computed on the first batch and
    kept (``clear_cache()`` drops it). ``emb_dtype`` (a ``torch.dtype``) casts the outputs.

    >>> m = KTRegroupAsDict(groups=[["a", "b"], ["c"]], keys=["user", "object"])
    >>> kt = KeyedTensor.from_tensor_list(["a", "b", "c"], [torch.randn(2, 4), torch.randn(2, 8), torch.randn(2, 2)])
    >>> {k: tuple(v.shape) for k, v in m([kt]).items()}
    {'user': (2, 12), 'object': (2, 2)}
    """

    def __init__(
        self, groups: Sequence[Sequence[str]], keys: Sequence[str], emb_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(f"KTRegroupAsDict: groups and keys should have the same length, got {len(groups)} and {len(keys)}")
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        self._emb_dtype = emb_dtype
        self._signature: Any = None

    def forward(self, keyed_tensors: Sequence[KeyedTensor]) -> dict[str, Tensor]:
        if self._signature is None and not is_fx_symbolic_tracing():  # first batch: TorchRec's one-time checks
            if not keyed_tensors:
                raise ValueError("KTRegroupAsDict: empty list of KeyedTensors")
            if len({kt.device() for kt in keyed_tensors}) != 1:
                raise ValueError("KTRegroupAsDict: all KeyedTensors should be on the same device")
            seen: set[str] = set()
            for kt in keyed_tensors:
                for k in kt.keys():
                    if k in seen:
                        raise RuntimeError(f"KTRegroupAsDict: duplicate key {k} found in KeyedTensors, undefined behavior")
                    seen.add(k)
            self._signature = True
        out = permute_multi_embedding(keyed_tensors, self._groups)  # indexed, not iterated: a Proxy under fx
        if self._emb_dtype is None:
            return {k: out[i] for i, k in enumerate(self._keys)}
        return {k: out[i].to(self._emb_dtype) for i, k in enumerate(self._keys)}

    def clear_cache(self) -> None:
        self._signature = None


__all__ = ["KTRegroupAsDict", "permute_multi_embedding", "regroup_kts"]
