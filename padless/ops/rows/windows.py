"""Fixed windows of ragged dims: ``x[:, a:b]``, ``x[:, :2]``, ``z[:, :, 0:1]``, ``x[:, -3:]``.

Code written for padded batches slices a window out of the sequence (the first tokens, the
class token ``x[:, :1]``, a fixed crop). On a NestedTensor the window is taken from every
sample, clamped per sample as Python slicing clamps, so sample i gets exactly what
``x[i][a:b]`` gives: a shorter sample keeps the rows it has (maybe none), and a negative
start or stop counts from that sample's own end. Samples ``(L_i, C)``, ``L = (3, 1, 0)``,
window ``[:2]``::

    sample 0   a0 a1 a2   ->  a0 a1
    sample 1   b0         ->  b0
    sample 2   (empty)    ->  (empty)
    values [a0 a1 | b0], offsets [0, 2, 3, 3], sizes [[2, C], [1, C], [0, C]]

The row index is computed once from the host metadata and cached on the structure with
the result's structure, so the same window in every layer is one ``index_select`` (its
backward scatters the gradient back). Steps other than 1 are refused. ``narrow`` is the
strict form (a sample too short for its window raises). An int on the only ragged dim,
``x[:, 0]``, picks that position of every sample (dense ``(B, ...)``; a sample too short
raises, naming it). A bound or position read from the batch's shape (an
:class:`~padless.tensor.extents.Extent`: ``x[:, :x.shape[1] - 1]``) is every sample's own,
``L_i - 1``, with Python's slice semantics on that sample. Both are views that in-place ops
write through to ``x`` (:mod:`padless.tensor.views`): ``x[:, :1].zero_()``, ``x[:, -1] = t``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure
from padless.ops.common.structure import call
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.extents import Extent, check_extent
from padless.tensor.views import as_view, put_rows


def is_window(e: Any) -> bool:
    """A slice with int (or None) bounds: a window a ragged dim can take."""
    return isinstance(e, slice) and all(
        x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in (e.start, e.stop, e.step)
    )


def window_rows(nt: NestedTensor, hs: Tensor, ho: Tensor, p: int, start: Tensor, length: Tensor | int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of ``nt`` (host sizes ``hs``, offsets ``ho``) in the window ``[start_i, start_i + length_i)``
    of ragged sample dim ``p``: ``(rows on the values' device, result's host sizes, host offsets)``.
    Shared by the windows here and by ``narrow``."""
    out_hs = hs.clone()
    out_hs[:, p] = length
    out_ho = layout.offsets_from_counts(layout.row_counts(out_hs, nt._ragged))
    total = int(out_ho[-1])
    sid, coords = layout.row_coords(out_hs, out_ho, nt._ragged, total)
    q = nt._ragged.index(p)
    coords[q] = coords[q] + start[sid]
    rows = layout.source_rows(sid, dict(zip(nt._ragged, coords)), hs, ho, nt._ragged)
    return rows.to(nt._values.device, non_blocking=True), out_hs, out_ho


def window(nt: NestedTensor, p: int, e: slice) -> NestedTensor:
    """``e`` applied to ragged sample dim ``p`` of every sample (module docstring)."""
    if e.step not in (None, 1):
        raise NotImplementedError(
            f"NestedTensor indexing: dim {p + 1} is ragged; a window of it takes slice step 1 only, got {e.step} "
            "(index samples one by one, x[i][::step], or gather the rows you need)"
        )
    if nt._meta.host_sizes is None and _is_traced(nt._sizes):
        start, stop = e.start or 0, e.stop
        if isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop:
            # compiled: a leading window is narrow's (every sample at least `stop` long; a
            # shorter one fails narrow's runtime check instead of being clamped)
            return call(torch.narrow, nt, p + 1, start, stop - start)
        raise NotImplementedError(
            f"NestedTensor indexing: a window {_fmt(e)} of ragged dim {p + 1} reads the batch's host sizes; "
            "inside torch.compile use x.narrow(dim, start, length) (same window, every sample long enough)"
        )
    lo, hi = _per_sample(nt, e.start, "start"), _per_sample(nt, e.stop, "stop")
    key = ("window", p, _key(lo), _key(hi), nt._values.device)
    hit = nt._meta.derived.get(key)
    vals = values_of(nt)
    if hit is not None:
        if isinstance(hit, str):  # "whole"
            return nt
        rows, offsets, sizes, meta, env = hit
        return as_view(nested_from_values(vals.index_select(0, rows), offsets, sizes, nt._ragged, env, meta), nt, put_rows(rows))
    hs, ho = host_structure(nt, "getitem")
    start, length = bounds(hs[:, p], lo, hi)
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        if bool((start == 0).all()) and bool((length == hs[:, p]).all()):
            nt._meta.derived[key] = "whole"  # every sample's own bounds cover it: x[:, :x.shape[1]]
            return nt
    rows, out_hs, out_ho = window_rows(nt, hs, ho, p, start, length)
    out = from_host_structure(vals.index_select(0, rows), out_hs, nt._ragged, nt, out_ho)
    nt._meta.derived[key] = (rows, out._offsets, out._sizes, out._meta, out._env)
    return as_view(out, nt, put_rows(rows))


def _per_sample(nt: NestedTensor, x: Any, what: str) -> int | Tensor | None:
    """A window bound as ``bounds`` takes it: a size read from this batch's shape (an
    :class:`~padless.tensor.extents.Extent`, ``x.shape[1] - 1``) is every sample's own bound,
    a host ``(B,)`` tensor; an int or None is the same bound for every sample."""
    if not isinstance(x, Extent):
        return x
    check_extent(x, nt, "NestedTensor indexing", f"the window's {what}", " (x[:, :x.shape[1] - 1])")
    return torch.tensor(x.per_sample(), dtype=torch.int64)


def _key(x: int | Tensor | None) -> Any:
    return tuple(x.tolist()) if isinstance(x, Tensor) else x  # host bounds (never device data)


def bounds(n: torch.Tensor, start: int | Tensor | None, stop: int | Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample start and length of ``[start:stop]`` on extents ``n`` (Python's clamping);
    a bound is an int, None, or every sample's own bound (a host ``(B,)`` tensor)."""

    def clamp(x: int | Tensor | None, default: torch.Tensor) -> torch.Tensor:
        if x is None:
            return default
        if isinstance(x, Tensor):
            t = torch.where(x < 0, n + x, x)
        else:
            t = n + x if x < 0 else torch.full_like(n, x)
        return torch.minimum(t.clamp_min(0), n)

    s = clamp(start, torch.zeros_like(n))
    t = clamp(stop, n)
    return s, (t - s).clamp_min(0)


def _fmt(e: slice) -> str:
    parts = ["" if x is None else str(x) for x in (e.start, e.stop)]
    return ":".join(parts) + ("" if e.step is None else f":{e.step}")


def take_windows(nt: NestedTensor, entries: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Apply every window slice on a ragged dim in ``entries`` (indexing inside samples: ints,
    slices and None, one per sample dim or inserted dim); those entries become ``slice(None)``.
    An int on the only ragged dim (``x[:, 0]``, the class token) picks that position of every
    sample: the result is dense ``(B, ...)`` and the entry is dropped."""
    out = list(entries)
    p = 0
    for j, e in enumerate(entries):
        if e is None:
            continue
        if p in nt._ragged and is_window(e) and not _whole(e, nt._env[p]):  # Extent bounds: per sample
            nt = window(nt, p, e)
            out[j] = slice(None)
        elif nt._ragged == (p,) and isinstance(e, int) and not isinstance(e, bool):
            return position(nt, p, e), out[:j] + out[j + 1:]
        p += 1
    return nt, out


def position(nt: NestedTensor, p: int, k: int) -> torch.Tensor:
    """Position ``k`` of the only ragged dim ``p`` of every sample, dense ``(B, *static)``
    (``x[i][k]`` for every i; a negative ``k`` counts from each sample's end; a ``k`` read
    from the shape, ``x[:, x.shape[1] - 1]``, is every sample's own position)."""
    ks = _per_sample(nt, k, "index")
    key = ("position", p, _key(ks), nt._values.device)
    rows = nt._meta.derived.get(key)
    if rows is None:
        hs, ho = host_structure(nt, "getitem")
        n = hs[:, p]
        kk = torch.as_tensor(ks, dtype=torch.int64)
        bad = torch.where(kk >= 0, n <= kk, n < -kk).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise IndexError(
                f"NestedTensor indexing: index {int(kk.expand_as(n)[i])} is out of range for sample {i}, of size "
                f"{int(n[i])} along ragged dim {p + 1} (x[:, {k}] picks that position of every sample)"
            )
        rows = ho[:-1] + torch.where(kk >= 0, kk, n + kk)
        rows = nt._meta.derived[key] = rows.to(nt._values.device, non_blocking=True)
    return as_view(values_of(nt).index_select(0, rows), nt, put_rows(rows))


def _whole(e: slice, extent: int) -> bool:
    if isinstance(e.start, Extent) or isinstance(e.stop, Extent):
        return False  # every sample's own bounds: window() tells
    return e.start in (None, 0) and e.step in (None, 1) and (e.stop is None or e.stop >= extent)
