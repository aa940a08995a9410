"""One buffer per dtype: where a collated batch lives.

A collate call first *reserves* every tensor it will produce (values, metadata,
stacked fields), then allocates one flat buffer per dtype and hands out views.
Within a buffer, tensors that move to the device come first and host-only
metadata (``host_sizes``, ``host_offsets``, partitions) last, so moving a batch
is one copy per dtype of one contiguous region::

    int64 buffer   [ offsets | sizes | row ids | ... ‖ host sizes | host offsets ]
                     <------ device region ------->   <---- host region ---->
    float32 buffer [ values of field a | values of field b ]

In a DataLoader worker the buffers are allocated in shared memory (as
``default_collate`` does for its stacked tensors), so a batch crosses to the main
process as one shared-memory block per dtype, without a copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from padless.tensor.lineage import Lineage

_ALIGN_BYTES = 64  # every slot starts on a 64-byte boundary (vectorised device loads)


@dataclasses.dataclass
class Slot:
    """A reserved range of one dtype's buffer (``start`` is set by :meth:`Arena.allocate`)."""

    dtype: torch.dtype
    numel: int
    host: bool
    start: int = -1


class Arena:
    """Reserve, then allocate one buffer per dtype, then view.

    >>> a = Arena()
    >>> s = a.reserve(torch.int64, 3)
    >>> a.allocate(shared=False)
    >>> a.view(s, (3,)).shape
    torch.Size([3])
    """

    def __init__(self) -> None:
        self._slots: list[Slot] = []
        self.buffers: dict[torch.dtype, Tensor] = {}
        self._np: dict[torch.dtype, np.ndarray] = {}
        self._base: dict[torch.dtype, int] = {}
        self.lineage = Lineage()  # the NestedTensors of one batch are one batch of samples

    def reserve(self, dtype: torch.dtype, numel: int, *, host: bool = False) -> Slot:
        if self.buffers:
            raise RuntimeError("padless internal: Arena.reserve() after allocate()")
        slot = Slot(dtype, int(numel), host)
        self._slots.append(slot)
        return slot

    def allocate(self, shared: bool) -> None:
        """One buffer per dtype, device slots first; in shared memory when ``shared``."""
        ends: dict[torch.dtype, int] = {}
        for host in (False, True):
            for s in self._slots:
                if s.host is host:
                    step = max(1, _ALIGN_BYTES // _itemsize(s.dtype))
                    start = -(-ends.get(s.dtype, 0) // step) * step
                    s.start = start
                    ends[s.dtype] = start + s.numel
        self.buffers = _carve(ends, shared)
        self._base = {dt: b.storage_offset() for dt, b in self.buffers.items()}

    def view(self, slot: Slot, shape: tuple[int, ...] | list[int], at: int = 0) -> Tensor:
        """The slot (from element ``at`` of it) as a contiguous tensor of ``shape``: one op."""
        return self.buffers[slot.dtype].as_strided(tuple(shape), _strides(shape), self._base[slot.dtype] + slot.start + at)

    def numpy(self, slot: Slot) -> np.ndarray:
        """The slot as a 1-D numpy array sharing memory (integer and bool metadata is written
        through numpy: a fraction of a torch op's overhead)."""
        arr = self._np.get(slot.dtype)
        if arr is None:
            arr = self._np[slot.dtype] = self.buffers[slot.dtype].numpy()
        return arr[slot.start : slot.start + slot.numel]


def _strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _carve(numels: dict[torch.dtype, int], shared: bool) -> dict[torch.dtype, Tensor]:
    """One 1-D buffer per dtype (in shared memory when ``shared``). One storage per dtype, not one
    for the batch: ``torch.save`` refuses storages viewed as several dtypes."""
    return {dt: _empty(dt, n, shared) for dt, n in numels.items()}


def _empty(dtype: torch.dtype, numel: int, shared: bool) -> Tensor:
    if not shared:
        return torch.empty(numel, dtype=dtype)
    nbytes = max(numel, 1) * _itemsize(dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def in_worker() -> bool:
    """True inside a DataLoader worker process (collated batches go to shared memory)."""
    return torch.utils.data.get_worker_info() is not None
