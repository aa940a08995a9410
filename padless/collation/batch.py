"""``Batch``: what a :class:`padless.Collator` returns.

A dict-like container of fields with attribute access (``batch["ids"]`` or
``batch.ids``) whose tensors share one buffer per dtype. It knows how to move
itself: ``batch.pin_memory()`` (what ``DataLoader(pin_memory=True)`` calls),
``batch.to(device, non_blocking=True)`` (one host-to-device copy per dtype), and
``batch.record_stream(stream)``. ``len(batch)`` is the number of samples, as for
a list of samples (``len(batch.keys())`` counts fields).

It also hands its metadata to attention kernels and model APIs:
``flash_attn_kwargs(field)``, ``hf_kwargs(field)``, ``padded(field)`` and
``pair_maps(field)`` (see :mod:`padless.collation.interop`).
"""

from __future__ import annotations

from typing import Any, ItemsView, Iterator, KeysView, Mapping, ValuesView

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from padless.collation import interop, transfer
from padless.collation.metadata import FieldMeta, PairMaps
from padless.collation.opcache import field_meta, install, install_pair
from padless.tensor import lineage
from padless.tensor.core import NestedTensor, StructureMeta, mark_dynamic
from padless.tensor.errors import StructureError
from padless.tensor.validate import check_structure


class Batch:
    """Fields of a collated batch: NestedTensors, stacked tensors and lists, plus their metadata.

    >>> import torch, padless
    >>> c = padless.Collator({"ids": padless.Field(ragged=0, position_ids="pos")})
    >>> b = c([{"ids": torch.tensor([5, 6])}, {"ids": torch.tensor([7])}])
    >>> len(b), list(b.keys()), b.ids.values().tolist(), b.pos.values().tolist()
    (2, ['ids', 'pos'], [5, 6, 7], [0, 1, 0])
    """

    def __init__(self, fields: Mapping[str, Any] | None = None, num_samples: int | None = None) -> None:
        object.__setattr__(self, "_fields", dict(fields or {}))
        if num_samples is None:
            num_samples = _infer_len(self._fields)
        object.__setattr__(self, "_num_samples", int(num_samples))
        self._install_pairs()
        _one_lineage(self._fields)

    def _install_pairs(self) -> None:
        for name, x in self._fields.items():
            fm = field_meta(x) if isinstance(x, NestedTensor) else None
            if fm is not None and fm.pair is not None and fm.pair.owner in (None, name):
                peer = x if fm.pair.peer is None else self._fields[fm.pair.peer]
                install_pair(x, peer, fm.pair)

    # ------------------------------------------------------------------ mapping
    def __getitem__(self, key: str) -> Any:
        try:
            return self._fields[key]
        except KeyError:
            raise KeyError(f"Batch has no field {key!r}; fields: {list(self._fields)}") from None

    def __setitem__(self, key: str, value: Any) -> None:
        self._fields[key] = value

    def __delitem__(self, key: str) -> None:
        del self._fields[key]

    def __contains__(self, key: object) -> bool:
        return key in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def keys(self) -> KeysView[str]:
        return self._fields.keys()

    def values(self) -> ValuesView[Any]:
        return self._fields.values()

    def items(self) -> ItemsView[str, Any]:
        return self._fields.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields")
        if fields is not None and not name.startswith("_") and name in fields:
            return fields[name]
        raise AttributeError(f"Batch has no attribute or field {name!r}; fields: {list(fields or ())}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            raise AttributeError(f"Batch: cannot set {name!r} (use batch[{name!r}] = ... for a field of that name)")
        self._fields[name] = value

    def __len__(self) -> int:
        """Number of samples (a pad_to_multiple dummy segment is not a sample)."""
        return self._num_samples

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def __repr__(self) -> str:
        parts = []
        for k, v in self._fields.items():
            if isinstance(v, NestedTensor):
                d = f"NestedTensor(envelope={tuple(v.shape)}, ragged_dims={v.ragged_dims}, rows={v._values.shape[0]}, {v.dtype})"
            elif isinstance(v, Tensor):
                d = f"Tensor({tuple(v.shape)}, {v.dtype})"
            else:
                d = type(v).__name__
            parts.append(f"  {k}: {d}")
        return f"Batch(num_samples={len(self)}, device={self.device}\n" + "\n".join(parts) + "\n)"

    # ------------------------------------------------------------------ moves
    @property
    def device(self) -> torch.device:
        """Device of the first tensor field (cpu for a batch without tensors)."""
        for t, host in transfer.leaves(self._fields):
            if not host:
                return t.device
        return torch.device("cpu")

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> "Batch":
        """The batch on ``device``: per dtype, one copy of one staging buffer, then views.

        Host metadata stays on the CPU (copied out of a pinned buffer so the device batch
        does not keep it alive). Returns ``self`` when everything is already there.
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if all(t.device == dev for t, host in transfer.leaves(self._fields) if not host):
            return self
        pin = dev.type == "cuda" and torch.cuda.is_available()

        def staging(dtype: torch.dtype, n: int) -> Tensor:
            return torch.empty(n, dtype=dtype, pin_memory=pin)

        def fresh_host(dtype: torch.dtype, n: int) -> Tensor:
            return torch.empty(n, dtype=dtype)

        with torch.no_grad():
            fields = transfer.relocate(
                self._fields,
                select=lambda host: not host,
                make_buffer=staging,
                finish=lambda buf: buf.to(dev, non_blocking=non_blocking),
                repack_rest=fresh_host if dev.type != "cpu" else None,
            )
        return Batch(fields, self._num_samples)

    def cuda(self, device: int | None = None, non_blocking: bool = False) -> "Batch":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device), non_blocking)

    def cpu(self) -> "Batch":
        return self.to("cpu")

    def pin_memory(self, device: Any = None) -> "Batch":
        """Copy into page-locked memory: one pinned buffer (one copy) per dtype.

        ``DataLoader(pin_memory=True)`` calls this in its pinning thread.
        """

        def pinned(dtype: torch.dtype, n: int) -> Tensor:
            return torch.empty(n, dtype=dtype, pin_memory=True)

        def pin(buf: Tensor) -> Tensor:
            return buf if buf.is_pinned() else buf.pin_memory()

        try:
            with torch.no_grad():
                fields = transfer.relocate(self._fields, lambda host: True, pinned, pin)
        except RuntimeError as e:
            if torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available():
                raise
            raise RuntimeError(
                f"Batch.pin_memory(): pinned memory needs an accelerator and this machine has none ({e})"
            ) from None
        return Batch(fields, self._num_samples)

    def is_pinned(self) -> bool:
        ts = [t for t, _ in transfer.leaves(self._fields)]
        return bool(ts) and all(t.is_pinned() for t in ts)

    def record_stream(self, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses this batch's device buffers."""
        seen: set[int] = set()
        for t, host in transfer.leaves(self._fields):
            if not host and t.is_cuda:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    t.record_stream(stream)

    def nbytes(self, host: bool = False) -> int:
        """Bytes ``.to(device)`` copies (device-bound tensors, alignment gaps included), or
        with ``host=True`` the bytes of the host-only metadata."""
        return transfer.transfer_bytes(self._fields, host)

    # ------------------------------------------------------------------ metadata & interop
    def field_meta(self, field: str) -> FieldMeta | None:
        """The worker-computed metadata of a ragged field (None for other fields)."""
        x = self[field]
        return field_meta(x) if isinstance(x, NestedTensor) else None

    def pair_maps(self, field: str) -> PairMaps:
        """Row maps of the pair state of a ``Field(pair=...)`` field (see :class:`PairMaps`)."""
        fm = self.field_meta(field)
        if fm is None or fm.pair is None:
            raise ValueError(f"Batch.pair_maps(): field {field!r} has no pair maps; declare Field(pair=True)")
        return fm.pair

    def flash_attn_kwargs(self, field: str, key_field: str | None = None) -> dict[str, Any]:
        return interop.flash_attn_kwargs(self, field, key_field)

    def hf_kwargs(
        self, field: str, *, causal: bool = True, block_mask: bool = False, mask_dtype: torch.dtype = torch.float32
    ) -> dict[str, Any]:
        """Hugging Face's padding-free keyword arguments (see :func:`padless.collation.interop.hf_kwargs`)."""
        return interop.hf_kwargs(self, field, causal=causal, block_mask=block_mask, mask_dtype=mask_dtype)

    def padded(self, field: str, value: float = 0.0) -> tuple[Tensor, Tensor]:
        return interop.padded(self, field, value)

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        """Pickled as its tensors and static attributes (what a DataLoader worker sends).

        NestedTensors travel as :class:`_NestedParts`. Unpickling checks every one of them
        with the vectorised O(B) checks that guard ``torch.load``
        (:func:`padless.tensor.validate.check_structure`: offsets from 0, never decreasing,
        stepping by each sample's row count and ending at the rows of ``values``; static
        extents; host copies equal to the tensors they mirror); a device batch is checked on
        its host copies, without a sync. A forged or corrupted pickle
        raises :class:`~padless.StructureError` instead of giving ops a structure that reads
        out of bounds. Fields that shared one structure share it again. The cost is tens of
        microseconds per field (no Python loop over samples).
        """
        metas: dict[int, int] = {}
        parts = tree_map(lambda x: _NestedParts(x, metas) if isinstance(x, NestedTensor) else x, self._fields)
        return (_rebuild_from_parts, (parts, self._num_samples))


def _one_lineage(fields: dict[str, Any]) -> None:
    """Fields of one batch are one batch of samples (:mod:`padless.tensor.lineage`): a size read
    from one field's shape applies to the others. Fields without a lineage (rebuilt, moved,
    derived by the collator) join the one the others share, or a new one."""
    nts = tree_leaves(fields, is_leaf=lambda x: isinstance(x, NestedTensor))
    nts = [x for x in nts if isinstance(x, NestedTensor)]
    orphans = [x for x in nts if x._lineage is None]
    if not orphans:
        return
    tokens = {id(x._lineage): x._lineage for x in nts if x._lineage is not None}
    token = next(iter(tokens.values())) if len(tokens) == 1 else lineage.Lineage()
    for x in orphans:
        x._lineage = token


class _NestedParts:
    """A collated NestedTensor as pickled inside a :class:`Batch` (see ``Batch.__reduce__``)."""

    __slots__ = ("values", "offsets", "sizes", "ragged", "env", "host_sizes", "host_offsets", "meta_key",
                 "field_meta", "requires_grad")

    def __init__(self, nt: NestedTensor, metas: dict[int, int]) -> None:
        self.values, self.offsets, self.sizes = nt._values, nt._offsets, nt._sizes
        self.ragged, self.env, self.requires_grad = nt._ragged, nt._env, nt.requires_grad
        self.host_sizes, self.host_offsets = nt._meta.host_sizes, nt._meta.host_offsets
        self.meta_key = metas.setdefault(id(nt._meta), len(metas))
        self.field_meta = field_meta(nt)

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, a) for a in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for a, v in zip(self.__slots__, state):
            setattr(self, a, v)

    def check(self) -> tuple[int, ...]:
        """The structure checks of ``torch.load`` (O(B), vectorised); returns the envelope from the sizes."""
        on_host = self.offsets.device.type == "cpu" and self.sizes.device.type == "cpu"
        if on_host or self.host_sizes is None or self.host_offsets is None:
            parts = (self.offsets, self.sizes, self.host_sizes, self.host_offsets)
        else:  # device tensors: their host copies are the structure (no sync); shapes must still agree
            if self.offsets.shape != self.host_offsets.shape or self.sizes.shape != self.host_sizes.shape:
                raise StructureError(
                    f"Batch (unpickled): device offsets {tuple(self.offsets.shape)} / sizes {tuple(self.sizes.shape)} "
                    f"disagree with their host copies {tuple(self.host_offsets.shape)} / {tuple(self.host_sizes.shape)}"
                )
            parts = (self.host_offsets, self.host_sizes, None, None)
        _, env, _, _ = check_structure(self.values, parts[0], parts[1], self.ragged, parts[2], parts[3])
        return tuple(env)

    def rebuild(self, metas: dict[int, StructureMeta]) -> NestedTensor:
        env = self.check()  # every field: fields sharing a structure may still differ in values and offsets
        meta = metas.get(self.meta_key)
        if meta is None:
            meta = metas[self.meta_key] = StructureMeta(self.host_sizes, self.host_offsets)
        nt = NestedTensor(self.values, self.offsets, self.sizes, self.ragged, env, meta,
                          requires_grad=self.requires_grad)
        if self.field_meta is not None:
            install(nt, self.field_meta)
        return mark_dynamic(nt)


def _rebuild_from_parts(fields: dict[str, Any], num_samples: int) -> Batch:
    metas: dict[int, StructureMeta] = {}
    return Batch(tree_map(lambda x: x.rebuild(metas) if isinstance(x, _NestedParts) else x, fields), num_samples)


def _rebuild_batch(fields: dict[str, Any], metas: dict[str, FieldMeta], num_samples: int) -> Batch:
    transfer.attach_metas(fields, metas)
    return Batch(fields, num_samples)


def _infer_len(fields: dict[str, Any]) -> int:
    for v in fields.values():
        if isinstance(v, NestedTensor):
            fm = field_meta(v)
            return v.batch_size - (1 if fm is not None and fm.dummy else 0)
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.shape[0]
        if isinstance(v, (list, tuple)):
            return len(v)
    return 0
