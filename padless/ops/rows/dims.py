"""Dim bookkeeping ops: unsqueeze, squeeze, transpose, permute, movedim.

Moving a ragged dim is a metadata change (the storage order records it; rows are
not touched). Moving static dims permutes ``values``' trailing dims (a view).
The batch dim always stays dim 0.
"""

from __future__ import annotations

from typing import Sequence

import torch

from padless.ops.common.seq_first import SeqFirstView
from padless.ops.common.structure import STATIC, keep_all, outer_dim, restructure, sample_dim
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor
from padless.tensor.lru import LRU, MiB
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError


@implements(torch.unsqueeze, torch.Tensor.unsqueeze)
def unsqueeze(func, nt: NestedTensor, dim: int) -> NestedTensor:
    """Insert a static dim of extent 1; ``(N_i, C).unsqueeze(2) -> (N_i, 1, C)``."""
    d = outer_dim(nt, dim, "unsqueeze", extra=1)
    if d == 0:
        raise StructureError("unsqueeze(): cannot insert a dim before the batch dim of a NestedTensor")
    p = d - 1
    dims = keep_all(nt)
    vpos = 1 + sum(1 for kind, _ in dims[:p] if kind == STATIC)
    dims.insert(p, (STATIC, 1))
    return restructure(nt, values_of(nt).unsqueeze(vpos), dims)


def _squeeze_dims(nt: NestedTensor, which: Sequence[int]) -> NestedTensor:
    dims = keep_all(nt)
    drop = [p for p in which if dims[p][0] == STATIC and dims[p][1] == 1]
    if not drop:
        return nt
    vals = values_of(nt)
    vdims = []
    k = 0
    for p, (kind, _) in enumerate(dims):
        if kind == STATIC:
            k += 1
            if p in drop:
                vdims.append(k)
    new = [spec for p, spec in enumerate(dims) if p not in drop]
    return restructure(nt, vals.squeeze(tuple(vdims)), new)


@implements(torch.squeeze, torch.Tensor.squeeze)
def squeeze(func, nt: NestedTensor, dim=None) -> NestedTensor:
    """Remove static dims of extent 1. Ragged dims are never squeezed (they are declared
    ragged even when every sample has extent 1), and neither is the batch dim."""
    if dim is None:
        return _squeeze_dims(nt, range(nt.sample_dim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    which = []
    for d in dims:
        o = outer_dim(nt, d, "squeeze")
        if o > 0:
            which.append(o - 1)
    return _squeeze_dims(nt, which)


_PERMUTES = LRU("permute_plans", max_entries=4096, max_bytes=16 * MiB,
                what="what a permute of sample dims needs, by (ragged dims, static extents, permutation)")


def _permute_samples(nt: NestedTensor, perm: Sequence[int]) -> NestedTensor:
    """Reorder sample dims: new sample dim i is old sample dim perm[i]."""
    key = (nt._ragged, tuple(nt._values.shape[1:]), tuple(perm))
    if not all(type(n) is int for n in key[1]):
        key = None  # symbolic static extents (traced): worked out every time
    hit = None if key is None else _PERMUTES.get(key)
    if hit is None:
        old = keep_all(nt)
        new = [old[p] for p in perm]
        static_old = [p for p in range(nt.sample_dim) if old[p][0] == STATIC]
        static_new = [p for p in perm if old[p][0] == STATIC]
        vperm = None if static_new == static_old else (0, *[1 + static_old.index(p) for p in static_new])
        pos = {p: i for i, p in enumerate(perm)}
        hit = (new, vperm, tuple(pos[r] for r in nt._ragged))
        if key is not None and all(type(n) is int for _, n in new):
            _PERMUTES.put(key, hit)
    new, vperm, ragged_order = hit
    vals = values_of(nt)
    if vperm is not None:
        vals = vals.permute(*vperm)
    return restructure(nt, vals, new, ragged_order)


@implements(torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.swapdims, torch.Tensor.swapdims)
def transpose(func, nt: NestedTensor, dim0: int, dim1: int) -> NestedTensor:
    """Swap two sample dims. ``p.transpose(1, 2)`` on pairs only records the new storage order."""
    if {outer_dim(nt, dim0, "transpose"), outer_dim(nt, dim1, "transpose")} == {0, 1}:
        return SeqFirstView(nt)  # what batch_first attention modules do before attending
    a, b = sample_dim(nt, dim0, "transpose"), sample_dim(nt, dim1, "transpose")
    perm = list(range(nt.sample_dim))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute_samples(nt, perm)


@implements(torch.permute, torch.Tensor.permute)
def permute(func, nt: NestedTensor, *dims) -> NestedTensor:
    if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
        dims = tuple(dims[0])
    n = nt.sample_dim + 1
    if len(dims) != n:
        raise StructureError(f"permute(): expected {n} dims (batch included), got {tuple(dims)}")
    outer = [outer_dim(nt, d, "permute") for d in dims]
    if sorted(outer) != list(range(n)):
        raise StructureError(f"permute(): dims {tuple(dims)} are not a permutation of 0..{n - 1}")
    if outer[0] != 0:
        raise StructureError("permute(): the batch dim of a NestedTensor must stay first (dims[0] must be 0)")
    return _permute_samples(nt, [d - 1 for d in outer[1:]])


@implements(torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis)
def movedim(func, nt: NestedTensor, source, destination) -> NestedTensor:
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    if len(src) != len(dst):
        raise StructureError(f"movedim(): source {source} and destination {destination} differ in length")
    s = [sample_dim(nt, d, "movedim") for d in src]
    t = [sample_dim(nt, d, "movedim") for d in dst]
    n = nt.sample_dim
    perm: list[int | None] = [None] * n
    for a, b in zip(s, t):
        perm[b] = a
    rest = iter(p for p in range(n) if p not in s)
    perm = [p if p is not None else next(rest) for p in perm]
    return _permute_samples(nt, perm)

