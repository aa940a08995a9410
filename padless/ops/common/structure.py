"""Helpers for handler authors: dim bookkeeping and building new structures.

Vocabulary: an *outer* dim counts the batch dim (``x.dim()`` dims, 0 = batch); a
*sample* dim does not (``outer - 1``). Static sample dims live in ``values`` at
``1 + (their rank among static dims)``; ragged sample dims live in the rows.

Everything here is tensor arithmetic on metadata (host tensors when the batch has
them, device tensors otherwise), so it works eagerly and under ``torch.compile``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.ops.common import content
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values
from padless.tensor.core import ROW_LEVEL_KEYS, NestedTensor, StructureMeta, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.registry import FUNCTION_TABLE

RAGGED = "r"
STATIC = "s"
DimSpec = tuple[str, int]  # (RAGGED, old sample dim) or (STATIC, size)

# Derived metadata that depends on rows only (not on the sample shapes), so it can be
# shared by every structure with the same rows.
_ROW_KEYS = ROW_LEVEL_KEYS


def outer_dim(nt: NestedTensor, dim: int, op: str, *, extra: int = 0) -> int:
    """Normalise an outer dim (``extra=1`` for ops that insert a dim, like unsqueeze)."""
    n = nt.sample_dim + 1 + extra
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}(): dim must be an int, got {dim!r}")
    if not -n <= dim < n:
        raise IndexError(f"{op}(): dim {dim} is out of range for a NestedTensor with {n - extra} dims")
    return dim % n


def sample_dim(nt: NestedTensor, dim: int, op: str) -> int:
    """Outer dim -> sample dim; the batch dim is refused with an explanation."""
    d = outer_dim(nt, dim, op)
    if d == 0:
        raise StructureError(
            f"{op}(): dim 0 is the batch dim of a NestedTensor; samples have different shapes, "
            f"so {op} across samples is not defined. Use a dim >= 1 (a dim inside every sample)."
        )
    return d - 1


def static_dims(nt: NestedTensor) -> tuple[int, ...]:
    return layout.static_dims(nt.sample_dim, nt._ragged)


def values_dim(nt: NestedTensor, sdim: int) -> int:
    """Dim of ``values`` holding static sample dim ``sdim``."""
    return 1 + static_dims(nt).index(sdim)


def is_ragged(nt: NestedTensor, sdim: int) -> bool:
    return sdim in nt._ragged


def restructure(
    nt: NestedTensor,
    values: Tensor,
    dims: Sequence[DimSpec],
    ragged_order: Sequence[int] | None = None,
) -> NestedTensor:
    """A NestedTensor on ``nt``'s rows with new sample dims.

    ``dims`` lists the new sample dims in order: ``(RAGGED, d)`` reuses ``nt``'s
    ragged sample dim ``d`` (rows are unchanged), ``(STATIC, n)`` is a static dim of
    extent ``n``. ``values`` must be ``(T, *static extents in new sample order)``.
    ``ragged_order`` gives the storage order of the ragged dims as *new* dim indices;
    by default it follows ``nt``'s storage order. Differentiable w.r.t. ``values``.
    """
    m = nt._meta
    traced = _is_traced(values)
    key = ("restructure", tuple(dims), nt._ragged, None if ragged_order is None else tuple(ragged_order))
    hit = None if traced else m.derived.get(key)  # traced: extents may be SymInts (unhashable)
    if hit is not None and type(hit[1]) is weakref.ref:  # this structure or the one it was made from
        hit = None if hit[1]() is None else (hit[0], hit[1](), *hit[2:])
    if hit is not None:
        sizes, meta, env, ragged, static = hit
        if values.shape[1:] != static:
            raise RuntimeError(f"padless internal: values static shape {tuple(values.shape[1:])} != {static}")
        return nested_from_values(values, nt._offsets, sizes, ragged, env, meta)
    new_pos = {d: i for i, (kind, d) in enumerate(dims) if kind == RAGGED}
    if sorted(new_pos) != sorted(nt._ragged):
        raise RuntimeError(f"padless internal: restructure must keep every ragged dim {nt._ragged}")
    ragged = tuple(ragged_order) if ragged_order is not None else tuple(new_pos[r] for r in nt._ragged)
    static_sizes = [n for kind, n in dims if kind == STATIC]
    if list(values.shape[1:]) != static_sizes and not _is_traced(values):
        raise RuntimeError(
            f"padless internal: values static shape {tuple(values.shape[1:])} != {tuple(static_sizes)}"
        )

    def build(src: Tensor) -> Tensor:
        cols = []
        for kind, d in dims:
            if kind == RAGGED:
                cols.append(src[:, d])
            else:
                cols.append(torch.full((src.shape[0],), d, dtype=src.dtype, device=src.device))
        if not cols:
            return src.new_empty((src.shape[0], 0))
        return torch.stack(cols, 1)

    back = None
    if not traced and ragged == nt._ragged and all(kind == STATIC or d == p for p, (kind, d) in enumerate(dims)) \
            and len(dims) == nt.sample_dim and torch.Size(static_sizes) == nt._values.shape[1:]:
        back = (nt._sizes, m, list(nt._env), ragged, nt._values.shape[1:])  # the same dims: the same structure
    elif not traced:
        back = _round_trip(m, ragged, [nt._env[d] if kind == RAGGED else d for kind, d in dims], static_sizes, build)
    if back is not None:  # this structure, or the one it was made from: their caches serve again
        m.derived[key] = (back[0], weakref.ref(back[1]), *back[2:])  # weakly: no cycle keeps them alive
        sizes, meta, env, ragged, _ = back
        return nested_from_values(values, nt._offsets, sizes, ragged, env, meta)
    meta = StructureMeta()
    if m.host_sizes is not None:
        meta.host_sizes = build(m.host_sizes)
        meta.host_offsets = m.host_offsets
        sizes = meta.host_sizes if nt._sizes.device.type == "cpu" else meta.host_sizes.to(nt._sizes.device, non_blocking=True)
    else:
        sizes = build(nt._sizes)
    for k, v in m.derived.items():
        if isinstance(k, tuple) and k[0] in _ROW_KEYS:
            meta.derived[k] = v
    env = [nt._env[d] if kind == RAGGED else d for kind, d in dims]
    if not traced:
        m.derived[key] = (sizes, meta, env, ragged, torch.Size(static_sizes))
        meta.derived[_MADE_FROM] = (weakref.ref(m), nt._sizes, tuple(nt._env), nt._ragged, nt._values.shape[1:])
    return nested_from_values(values, nt._offsets, sizes, ragged, env, meta)


# restructure() records on a structure it makes the one it made it from (a weak reference, and
# that structure's cache entry), so a round trip (split heads, transpose, attend, transpose back,
# merge heads) comes back to the structure it started from: one structure per layer input
# instead of a new one per layer, and the plans cached on it (attention's sample plan, row maps,
# structure checks by identity) serve every layer.
_MADE_FROM = "restructured_from"


def _round_trip(m: StructureMeta, ragged: tuple, env: list, static_sizes: list, build) -> tuple | None:
    """The cache entry of the structure ``m`` was made from, when the new dims give exactly it
    back (ragged dims in the same storage order, the same envelope, static extents and per-sample
    sizes, on the same rows); None otherwise."""
    up = m.derived.get(_MADE_FROM)
    if up is None or m.host_sizes is None:
        return None
    parent, sizes, penv, pragged, pstatic = up[0](), *up[1:]
    if parent is None or parent.host_sizes is None or parent.host_offsets is not m.host_offsets:
        return None
    if pragged != ragged or tuple(pstatic) != tuple(static_sizes) or len(penv) != len(env):
        return None
    if any(type(a) is not int or type(b) is not int or a != b for a, b in zip(penv, env)):
        return None  # (a symbolic or per-sample extent: not compared)
    if not torch.equal(build(m.host_sizes), parent.host_sizes):
        return None
    return sizes, parent, list(penv), pragged, torch.Size(static_sizes)


def keep_all(nt: NestedTensor) -> list[DimSpec]:
    """The DimSpec list describing ``nt`` itself (a starting point for edits)."""
    vals_static = iter(nt._values.shape[1:])
    return [(RAGGED, d) if d in nt._ragged else (STATIC, next(vals_static)) for d in range(nt.sample_dim)]


def derived_tensor(nt: NestedTensor, key, compute):
    """Cache ``compute(sizes, offsets)`` per structure (host inputs when available).

    ``compute`` receives host metadata in eager mode (results are moved to the values'
    device and cached) and device metadata under tracing (not cached).
    Returns whatever ``compute`` returns, with tensors moved to the values' device.

    Eagerly the result is also cached by content (``key``, device, ragged storage order and
    the host sizes and offsets; :mod:`padless.ops.common.content`): the structures of one batch
    are many objects (every linear, transpose or product makes one; the scores of each
    attention layer and their gradients too) with the same rows, and each would otherwise
    rebuild the same index maps. ``compute`` may therefore read nothing but its arguments,
    ``nt``'s ragged storage order and what ``key`` holds; results are shared and read-only.
    """
    m = nt._meta
    dev = nt._values.device
    full_key = (key, dev)
    try:
        hit = m.derived.get(full_key)
    except TypeError:  # a traced key holding SymInts (unhashable): computed below, not cached
        hit = None
    if hit is not None:
        return hit
    traced = _is_traced(nt._values)
    if m.host_sizes is not None and not traced:
        with torch.inference_mode(False):  # a cached map outlives the block: a normal tensor
            out = content.get_or_build((key, dev, content.structure_key(nt)), 
                                   lambda: _to_device(compute(m.host_sizes, nt.host_offsets()), dev))
        m.derived[full_key] = out
        return out
    return compute(nt._sizes, nt._offsets)


def _to_device(obj, dev):
    if isinstance(obj, Tensor):
        return obj if obj.device == dev else obj.to(dev, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, dev) for o in obj)
    return obj


def build_nested(
    values: Tensor,
    like: NestedTensor,
    host_sizes: Tensor | None,
    sizes: Tensor,
    ragged: tuple[int, ...],
    env: Sequence,
    cache_key=None,
) -> NestedTensor:
    """A NestedTensor with new rows: offsets derive from ``sizes`` (host when given).

    With ``cache_key`` the new structure is cached in ``like``'s metadata, so the same
    op on the same batch reuses it (and everything cached on it) next time.
    """
    traced = _is_traced(like._values)
    if cache_key is not None and not traced:
        hit = like._meta.derived.get(cache_key)
        if hit is not None:
            offsets, sizes, meta = hit
            return nested_from_values(values, offsets, sizes, ragged, env, meta)
    if host_sizes is not None:
        host_offsets = layout.offsets_from_counts(layout.row_counts(host_sizes, ragged))
        dev = like._values.device
        offsets = host_offsets if dev.type == "cpu" else host_offsets.to(dev, non_blocking=True)
        sizes = host_sizes if dev.type == "cpu" else host_sizes.to(dev, non_blocking=True)
        meta = StructureMeta(host_sizes, host_offsets)
    else:
        offsets = layout.offsets_from_counts(layout.row_counts(sizes, ragged))
        meta = StructureMeta()
    if cache_key is not None and not traced:
        like._meta.derived[cache_key] = (offsets, sizes, meta)
    return nested_from_values(values, offsets, sizes, ragged, env, meta)


def call(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run the handler registered for the torch-level ``func``: how one family uses another's op.

    Handlers run with torch-function dispatch off (``torch.transpose(nt, 2, 3)`` inside a
    handler would not reach padless), and a family never imports another family, so an
    op of another family is reached through the registry::

        call(torch.transpose, nt, 2, 3)   # the rows family's transpose, from attention
    """
    return FUNCTION_TABLE[func](func, *args, **kwargs)
