"""Regrouping pooled embeddings: TorchRec's ``regroup_kts``, ``permute_multi_embedding`` and
``KTRegroupAsDict`` on padless' :class:`~padless.jagged.KeyedTensor`.

Given KeyedTensors (the pooled outputs of several embedding-bag collections) and groups of
keys, each returns one tensor per group: the named keys' blocks concatenated along the key
dim, in group order. A key may appear in several groups. A key that a group names and two
KeyedTensors hold (or one holds twice) is refused with an error naming it: TorchRec's own
functions disagree on which block to take (``KeyedTensor.regroup`` and ``KTRegroupAsDict``
the last KeyedTensor's, ``regroup_kts`` and ``permute_multi_embedding`` the first's, through
FBGEMM's ``kt_regroup_arguments``; ``KTRegroupAsDict`` raises at key dims other than 1).
KeyedTensors whose batches differ (their values' shapes outside the key dim) are refused
naming them. Two KeyedTensors over a batch of 2::

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
precomputes its permutes. Both are differentiable (one autograd node whose backward writes
each KeyedTensor's gradient as one buffer, see ``padless.jagged._regroup``) and become one
node under ``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from padless.jagged import _regroup, fx
from padless.jagged._regroup import _PLANS  # noqa: F401 - the plan cache, for tests and inspection
from padless.jagged.keyed_tensor import KeyedTensor


@fx.leaf
def regroup_kts(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """One tensor per group, the groups' key blocks concatenated along the key dim (TorchRec's
    ``regroup_kts``): one ``torch.cat`` of column slices, split into the groups (views of one buffer).

    >>> kt = KeyedTensor.from_tensor_list(["a", "b", "c"], [torch.zeros(2, 1), torch.ones(2, 2), torch.full((2, 1), 2.0)])
    >>> [t.tolist() for t in regroup_kts([kt], [["c", "a"], ["b"]])]
    [[[2.0, 0.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]
    """
    return _regroup.regroup("regroup_kts", keyed_tensors, groups, one_buffer=True)


@fx.leaf
def permute_multi_embedding(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """:func:`regroup_kts` as a permutation of columns into separate outputs (TorchRec's
    ``permute_multi_embedding``): per group one ``torch.cat`` of its column slices (adjacent
    keys merged into one slice, the plan cached); each group is its own tensor.

    >>> kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1), torch.ones(2, 2)])
    >>> [t.shape for t in permute_multi_embedding([kt], [["b", "a"], ["a"]])]
    [torch.Size([2, 3]), torch.Size([2, 1])]
    """
    return _regroup.regroup("permute_multi_embedding", keyed_tensors, groups, one_buffer=False)


@fx.leaf
def _regroup_as_dict_values(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """``permute_multi_embedding`` whose errors name ``KTRegroupAsDict``."""
    return _regroup.regroup("KTRegroupAsDict", keyed_tensors, groups, one_buffer=False)


# TorchRec's ``DataType`` names (``torchrec.types.DataType``, an Enum of these strings) and
# the dtypes TorchRec's ``data_type_to_dtype`` gives them
_DATA_TYPES = {
    "FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16, "NFP8": torch.float8_e4m3fn,
    "INT64": torch.int64, "INT32": torch.int32, "INT8": torch.int8, "UINT8": torch.uint8,
    "INT4": torch.quint4x2, "INT2": torch.quint2x4,
}


def _emb_dtype(emb_dtype: Any) -> torch.dtype | None:
    """A ``torch.dtype`` from TorchRec's ``DataType`` (or a ``torch.dtype``, or None)."""
    if emb_dtype is None or isinstance(emb_dtype, torch.dtype):
        return emb_dtype
    name = getattr(emb_dtype, "value", None)
    if isinstance(name, str) and name in _DATA_TYPES:
        return _DATA_TYPES[name]
    raise TypeError(
        f"KTRegroupAsDict: emb_dtype must be TorchRec's DataType (one of {list(_DATA_TYPES)}), a torch.dtype "
        f"or None, got {emb_dtype!r}"
    )


class KTRegroupAsDict(torch.nn.Module):
    """``KeyedTensor.regroup_as_dict`` as a module (TorchRec's ``KTRegroupAsDict``, same
    signature): groups of keys in, ``{name: tensor}`` out, each group its own tensor, with the
    regrouping plan computed on the first batch and kept (``clear_cache()`` drops it).

    ``emb_dtype`` casts the outputs: TorchRec's ``DataType`` (``DataType.FP16``, ...; any
    object whose ``.value`` is one of its names) or, without torchrec, a ``torch.dtype``.
    ``multi_device`` is accepted and has no effect: TorchRec keeps its permute indices in
    device buffers and, with ``multi_device=True``, moves them to the first input's device
    on every call; padless' plan is host metadata, used on whatever device the values are on.

    >>> m = KTRegroupAsDict(groups=[["a", "b"], ["c"]], keys=["user", "object"])
    >>> kt = KeyedTensor.from_tensor_list(["a", "b", "c"], [torch.randn(2, 4), torch.randn(2, 8), torch.randn(2, 2)])
    >>> {k: tuple(v.shape) for k, v in m([kt]).items()}
    {'user': (2, 12), 'object': (2, 2)}
    """

    def __init__(
        self,
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
        emb_dtype: Any = None,
        multi_device: bool = False,
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(f"KTRegroupAsDict: groups and keys should have the same length, got {len(groups)} and {len(keys)}")
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        self._emb_dtype = emb_dtype
        self._dtype = _emb_dtype(emb_dtype)
        self._multi_device = bool(multi_device)
        self._signature: Any = None

    def forward(self, keyed_tensors: Sequence[KeyedTensor]) -> dict[str, Tensor]:
        if self._signature is None and not is_fx_symbolic_tracing():  # first batch: TorchRec's one-time checks
            if not keyed_tensors:
                raise ValueError("KTRegroupAsDict: empty list of KeyedTensors")
            if len({kt.device() for kt in keyed_tensors}) != 1:
                raise ValueError("KTRegroupAsDict: all KeyedTensors should be on the same device")
            self._signature = True
        out = _regroup_as_dict_values(keyed_tensors, self._groups)  # indexed, not iterated: a Proxy under fx
        if self._dtype is None:
            return {k: out[i] for i, k in enumerate(self._keys)}
        return {k: out[i].to(self._dtype) for i, k in enumerate(self._keys)}

    def clear_cache(self) -> None:
        self._signature = None


__all__ = ["KTRegroupAsDict", "permute_multi_embedding", "regroup_kts"]
