"""Moving a batch: one pinned staging buffer and one host-to-device copy per dtype.

A batch is a tree of fields whose leaves are tensors; a NestedTensor leaf expands
to its inner tensors (device-bound), its host metadata (host-only) and its
:class:`~padless.collation.metadata.FieldMeta`. To move a batch, the device-bound
leaves of each dtype are found in one contiguous region of one buffer (collated
batches are laid out that way, see :mod:`padless.collation.arena`) or packed into a
fresh staging buffer, copied in one call, and viewed on the device::

    host   float32 [ a | b ]   int64 [ off | sizes | rows ‖ host sizes ... ]
                 |  one copy            |  one copy (device region only)
    device float32 [ a | b ]   int64 [ off | sizes | rows ]    leaves are views
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from padless.collation.metadata import FieldMeta, iter_tensors, map_tensors
from padless.collation.opcache import field_meta, install
from padless.tensor.core import NestedTensor, StructureMeta, mark_dynamic

Leaf = tuple[Tensor, bool]  # (tensor, host_only)


def leaves(fields: dict[str, Any]) -> Iterator[Leaf]:
    """Every tensor of a batch with its residency (a tensor may appear more than once)."""
    for x in tree_flatten(fields)[0]:
        if isinstance(x, NestedTensor):
            yield x._values, False
            yield x._offsets, False
            yield x._sizes, False
            for h in (x._meta.host_sizes, x._meta.host_offsets):
                if h is not None:
                    yield h, True
            fm = field_meta(x)
            if fm is not None:
                yield from iter_tensors(fm)
        elif isinstance(x, Tensor):
            yield x, False


def map_fields(fields: dict[str, Any], fn: Callable[[Tensor, bool], Tensor]) -> dict[str, Any]:
    """The same fields with every tensor replaced by ``fn(tensor, host_only)``.

    NestedTensors are rebuilt around the new tensors (NestedTensors that shared one
    structure still share it) and their op-layer caches refilled from their metadata.
    """
    memo: dict[tuple[int, bool], Tensor] = {}

    def once(t: Tensor, host: bool) -> Tensor:
        key = (id(t), host)
        if key not in memo:
            memo[key] = fn(t, host)
        return memo[key]

    metas: dict[int, StructureMeta] = {}
    flat, spec = tree_flatten(fields)
    out = []
    for x in flat:
        if isinstance(x, NestedTensor):
            out.append(_map_nested(x, once, metas))
        elif isinstance(x, Tensor):
            out.append(once(x, False))
        else:
            out.append(x)
    return tree_unflatten(out, spec)


def _map_nested(nt: NestedTensor, fn: Callable[[Tensor, bool], Tensor], metas: dict[int, StructureMeta]) -> NestedTensor:
    m = nt._meta
    meta = metas.get(id(m))
    if meta is None:
        meta = StructureMeta(
            None if m.host_sizes is None else fn(m.host_sizes, True),
            None if m.host_offsets is None else fn(m.host_offsets, True),
        )
        metas[id(m)] = meta
    out = NestedTensor(
        fn(nt._values, False), fn(nt._offsets, False), fn(nt._sizes, False), nt._ragged, nt._env, meta,
        requires_grad=nt.requires_grad,
    )
    fm = field_meta(nt)
    if fm is not None:
        install(out, map_tensors(fm, fn))
    return mark_dynamic(out)


def field_metas(fields: dict[str, Any]) -> dict[str, FieldMeta]:
    """``{key path: FieldMeta}`` of every collated NestedTensor (what pickling carries)."""
    flat, _ = tree_flatten_with_path(fields)
    return {keystr(p): field_meta(x) for p, x in flat if isinstance(x, NestedTensor) and field_meta(x) is not None}


def attach_metas(fields: dict[str, Any], metas: dict[str, FieldMeta]) -> None:
    for p, x in tree_flatten_with_path(fields)[0]:
        fm = metas.get(keystr(p))
        if fm is not None and isinstance(x, NestedTensor):
            install(x, fm)


# ---------------------------------------------------------------------------- staging


def _extent(t: Tensor) -> tuple[int, int]:
    """``[start, end)`` in elements of ``t``'s storage."""
    start = t.storage_offset()
    if t.numel() == 0:
        return start, start
    return start, start + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def stage(
    ts: list[Tensor], make_buffer: Callable[[torch.dtype, int], Tensor], reuse: bool = True
) -> tuple[Tensor, dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """One 1-D buffer holding all of ``ts`` (one dtype): the region of their common storage
    when they share one (``reuse``), else a fresh ``make_buffer(dtype, numel)`` filled with
    one copy per tensor. Returns the buffer and, per ``id(t)``, ``(offset, shape, stride)``."""
    dtype, dev = ts[0].dtype, ts[0].device
    st = ts[0].untyped_storage()
    if reuse and all(t.untyped_storage().data_ptr() == st.data_ptr() and t.device == dev for t in ts):
        ext = [_extent(t) for t in ts]
        lo, hi = min(e[0] for e in ext), max(e[1] for e in ext)
        region = torch.empty(0, dtype=dtype, device=dev).set_(st, lo, (hi - lo,), (1,))
        return region, {id(t): (t.storage_offset() - lo, tuple(t.shape), t.stride()) for t in ts}
    buf = make_buffer(dtype, sum(t.numel() for t in ts))
    where = {}
    pos = 0
    for t in ts:
        n = t.numel()
        dst = buf[pos : pos + n].view(t.shape)
        dst.copy_(t)
        where[id(t)] = (pos, tuple(t.shape), dst.stride())
        pos += n
    return buf, where


def view_in(buf: Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> Tensor:
    """A tensor of ``shape``/``stride`` at ``offset`` elements into the 1-D ``buf``."""
    return buf.as_strided(shape, stride, buf.storage_offset() + offset)


def transfer_bytes(fields: dict[str, Any], host: bool = False) -> int:
    """Bytes a move copies: per dtype, the region of the shared buffer, or the packed size."""
    groups: dict[torch.dtype, dict[int, Tensor]] = {}
    for t, h in leaves(fields):
        if h == host:
            groups.setdefault(t.dtype, {})[id(t)] = t
    total = 0
    for dtype, by_id in groups.items():
        ts = list(by_id.values())
        ptr = ts[0].untyped_storage().data_ptr()
        if all(t.untyped_storage().data_ptr() == ptr and t.device == ts[0].device for t in ts):
            ext = [_extent(t) for t in ts]
            n = max(e[1] for e in ext) - min(e[0] for e in ext)
        else:
            n = sum(t.numel() for t in ts)
        total += n * ts[0].element_size()
    return total


def relocate(
    fields: dict[str, Any],
    select: Callable[[bool], bool],
    make_buffer: Callable[[torch.dtype, int], Tensor],
    finish: Callable[[Tensor], Tensor],
    repack_rest: Callable[[torch.dtype, int], Tensor] | None = None,
) -> dict[str, Any]:
    """Stage the selected leaves per dtype, ``finish`` each staging buffer (one copy), view.

    ``select(host_only)`` picks the leaves that go through ``finish``; the others stay
    as they are, or are packed into fresh buffers from ``repack_rest`` (so a device batch
    does not keep a large pinned host buffer alive through its small host metadata).
    """
    groups: dict[tuple[bool, torch.dtype], dict[int, Tensor]] = {}
    for t, host in leaves(fields):
        groups.setdefault((select(host), t.dtype), {})[id(t)] = t
    new: dict[tuple[int, bool], Tensor] = {}
    for (selected, _), by_id in groups.items():
        if not selected and repack_rest is None:
            continue  # left where they are
        ts = list(by_id.values())
        if selected:
            buf, where = stage(ts, make_buffer, reuse=True)
            buf = finish(buf)
        else:
            buf, where = stage(ts, repack_rest, reuse=False)
        for t in ts:
            new[(id(t), selected)] = view_in(buf, *where[id(t)])

    def fn(t: Tensor, host: bool) -> Tensor:
        hit = new.get((id(t), select(host)))
        return t if hit is None else hit

    return map_fields(fields, fn)
