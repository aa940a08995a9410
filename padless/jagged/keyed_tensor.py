"""KeyedTensor: dense per-key blocks (pooled embeddings) concatenated along one dim."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree
from torch import Tensor
from torch.fx._pytree import register_pytree_flatten_spec

from padless.jagged import _checks as C
from padless.jagged import _regroup, _torchrec, fx
from padless.tensor.errors import StructureError


class KeyedTensor:
    """Dense blocks, one per key, concatenated along ``key_dim``.

    Three keys over a batch of 3, ``key_dim=1``::

                          sample 0    sample 1    sample 2
        "Embedding A"     [1,1]       [1,1]       [1,1]
        "Embedding B"     [2,1,2]     [2,1,2]     [2,1,2]
        "Embedding C"     [3,1,2,3]   [3,1,2,3]   [3,1,2,3]

        values         = [[1, 1, 2, 1, 2, 3, 1, 2, 3]] * 3     (3, 9)
        length_per_key = [2, 3, 4]                            widths along key_dim
        offset_per_key = [0, 2, 5, 9]

    ``kt["Embedding B"]`` is ``values[:, 2:5]``, a view.
    """

    __slots__ = ("_keys", "_length_per_key", "_values", "_key_dim", "_offset_per_key", "_index_per_key")

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: Tensor,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: Mapping[str, int] | None = None,
    ) -> None:
        if not isinstance(values, Tensor) and fx.stand_in(
            self, type(self), (keys, length_per_key, values, key_dim, offset_per_key, index_per_key), {}
        ):
            return  # built from traced tensors under torch.fx: stands in for the graph node
        what = "KeyedTensor"
        keys = list(keys)
        lpk = [int(x) for x in length_per_key]
        if not isinstance(values, Tensor):
            raise TypeError(f"{what}: values must be a tensor, got {type(values).__name__}")
        if len(lpk) != len(keys):
            raise ValueError(f"{what}: keys and length_per_key disagree: {len(keys)} keys, length_per_key {lpk}")
        if not keys and values.numel() == 0 and values.dim() <= key_dim:
            key_dim = values.dim()  # no keys, no values (TorchRec's ``KeyedTensor([], [], torch.Tensor())``)
        elif not -values.dim() <= key_dim < values.dim():
            raise ValueError(f"{what}: key_dim {key_dim} is out of range for values of shape {tuple(values.shape)}")
        key_dim %= max(values.dim(), key_dim + 1)
        bad = next((i for i, x in enumerate(lpk) if x < 0), None)
        if bad is not None:
            raise StructureError(
                f"{what}: length_per_key must be >= 0, but key {keys[bad]!r} has {lpk[bad]} (length_per_key {lpk})"
            )
        if keys and sum(lpk) != values.shape[key_dim]:
            raise ValueError(
                f"{what}: length_per_key {lpk} sums to {sum(lpk)} but values has {values.shape[key_dim]} "
                f"entries along key_dim {key_dim}"
            )
        self._keys = keys
        self._length_per_key = lpk
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = list(offset_per_key) if offset_per_key is not None else C.cumsum_list(lpk)
        self._index_per_key = dict(index_per_key) if index_per_key is not None else None

    @staticmethod
    @fx.leaf
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> "KeyedTensor":
        """Concatenate one tensor per key along ``cat_dim``; each key's width is its size along ``key_dim``.

        >>> kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(2, 1), torch.zeros(2, 3)])
        >>> kt.values().shape, kt.length_per_key()
        (torch.Size([2, 4]), [1, 3])
        """
        if len(keys) != len(tensors):
            raise ValueError(f"KeyedTensor.from_tensor_list: {len(keys)} keys but {len(tensors)} tensors")
        return KeyedTensor(
            keys=keys,
            length_per_key=[t.shape[key_dim] for t in tensors],
            values=torch.cat(list(tensors), dim=cat_dim),
            key_dim=key_dim,
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return self._offset_per_key

    def index_per_key(self) -> dict[str, int]:
        """``{key: position}``; repeated keys have no one position and are refused, naming the key."""
        if self._index_per_key is None:
            C.unique_keys("KeyedTensor.index_per_key()", self._keys, "values(), offset_per_key()")
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def _key_indices(self) -> dict[str, int]:
        """``index_per_key()`` under TorchRec's private name, which TorchRec's own regroup
        helpers call on the KeyedTensors they are given."""
        return self.index_per_key()

    def __getitem__(self, key: str) -> Tensor:
        """One key's block, a view of ``values`` along ``key_dim``."""
        i = self.index_per_key().get(key)
        if i is None:
            raise KeyError(f"KeyedTensor: no key {key!r}; keys are {self._keys}")
        return self._values.narrow(self._key_dim, self._offset_per_key[i], self._length_per_key[i])

    def to_dict(self) -> dict[str, Tensor]:
        if self._index_per_key is None:  # a dict would drop a repeated key silently
            C.unique_keys("KeyedTensor.to_dict()", self._keys, "values(), offset_per_key()")
        return {k: self[k] for k in self._keys}

    @staticmethod
    @fx.leaf
    def regroup(keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]]) -> list[Tensor]:
        """One tensor per group: the named keys' blocks, from any of ``keyed_tensors``,
        concatenated along their key dim (which must agree); the groups are views of one
        buffer, as in TorchRec. An empty group gives a ``(B, 0)`` tensor. A key that a group
        names and two KeyedTensors hold is refused (TorchRec's regroup functions disagree on
        which block to take), as are KeyedTensors over different batches. One autograd node:
        the backward writes each KeyedTensor's gradient as one buffer.

        >>> kt0 = KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1), torch.ones(2, 2)])
        >>> kt1 = KeyedTensor.from_tensor_list(["c"], [torch.full((2, 1), 2.0)])
        >>> [tuple(t.shape) for t in KeyedTensor.regroup([kt0, kt1], [["c", "a"], [], ["b"]])]
        [(2, 2), (2, 0), (2, 2)]
        """
        return _regroup.regroup("KeyedTensor.regroup", keyed_tensors, groups, one_buffer=True)

    @staticmethod
    @fx.leaf
    def regroup_as_dict(
        keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, Tensor]:
        """``regroup`` with one name per group."""
        if len(groups) != len(keys):
            raise ValueError(f"KeyedTensor.regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(
            self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking), self._key_dim,
            self._offset_per_key, self._index_per_key,
        )

    def pin_memory(self) -> "KeyedTensor":
        return KeyedTensor(
            self._keys, self._length_per_key, self._values.pin_memory(), self._key_dim,
            self._offset_per_key, self._index_per_key,
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        C.record(self._values, stream)

    def to_torchrec(self) -> Any:
        """TorchRec's KeyedTensor over the same values (needs the torchrec package)."""
        return _torchrec.module().KeyedTensor(**_torchrec.kt_kwargs(self))

    @staticmethod
    def from_torchrec(kt: Any) -> "KeyedTensor":
        return KeyedTensor(**_torchrec.kt_kwargs(kt))

    def size_in_bytes(self) -> int:
        """Bytes held by the values (as TorchRec counts them)."""
        return C.nbytes(self._values)

    def __str__(self) -> str:
        """Every key's block, one list per sample, printed as TorchRec prints them."""
        if not self._keys:
            return "KeyedTensor()\n"
        parts = [f'    "{k}": ' + C.values_string(self[k], 0, self[k].shape[0], max_dims=3) for k in self._keys]
        return "KeyedTensor({\n" + ",\n".join(parts) + "\n})\n"

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, key_dim={self._key_dim}, "
            f"values={tuple(self._values.shape)}, dtype={self._values.dtype}, device={self.device()})"
        )


def _kt_flatten(kt: KeyedTensor) -> tuple[list[Tensor], tuple[list[str], list[int], int]]:
    return [kt._values], (kt._keys, kt._length_per_key, kt._key_dim)


def _kt_unflatten(values: list[Tensor], context: tuple[list[str], list[int], int]) -> KeyedTensor:
    keys, lpk, key_dim = context
    return KeyedTensor(keys, lpk, values[0], key_dim=key_dim)


def _kt_flatten_spec(kt: KeyedTensor, spec: Any) -> list[Tensor]:
    """Values in the key order the spec was made with (an exported program's KeyedTensor
    input may arrive with its keys in another order)."""
    keys = spec.context[0]
    if kt.keys() == list(keys):
        return [kt.values()]
    return KeyedTensor.regroup([kt], [keys])


# a pytree node (values as the child; keys, widths and key dim as context), as TorchRec registers it
torch.utils._pytree.register_pytree_node(
    KeyedTensor, _kt_flatten, _kt_unflatten, serialized_type_name="padless.jagged.KeyedTensor"
)
register_pytree_flatten_spec(KeyedTensor, _kt_flatten_spec)
