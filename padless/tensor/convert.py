"""Interoperability views: samples, padded tensors, masks, torch.nested, batch indexing.

None of these is used by the op layer's hot path; they exist for users and tests.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, split_rows, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.dynamo import _TRACED_TYPES, _is_traced, mark_dynamic
from padless.tensor.errors import StructureError
from padless.tensor.registry import lend, lent
from padless.tensor.structure import StructureMeta, envelope_from_sizes, static_change
from padless.tensor.traced import select_sample
from padless.tensor.validate import norm_ragged_dims
from padless.tensor.views import as_view, put_view, writes_matter


def _sample_view(nt: NestedTensor, rows: Tensor, shape: Sequence[int]) -> Tensor:
    """Rows of one sample viewed with that sample's dense shape (sample dim order)."""
    return layout.sample_view(rows, shape, nt.storage_order)


@lend("unbind_samples")  # NestedTensor.__repr__ calls it; core cannot import this module
def unbind_samples(nt: NestedTensor, differentiable: bool = True) -> tuple[Tensor, ...]:
    """Every sample as a dense tensor (views of ``values`` when the layout allows).

    Uses host metadata (see :meth:`NestedTensor.host_sizes`).
    """
    vals = values_of(nt) if differentiable else nt._values
    hs = nt.host_sizes().tolist()
    parts = split_rows(vals, nt.host_offsets().tolist())  # backward: one concatenation, O(T)
    return tuple(_sample_view(nt, p, s) for p, s in zip(parts, hs))


def _padded_index(nt: NestedTensor, env: Sequence[int]) -> Tensor:
    """Cached flat index of every row in the padded ragged grid (on the values' device)."""
    m = nt._meta
    total = nt._values.shape[0]
    if _is_traced(nt._values):  # symbolic extents: from device sizes, not cached (keys must hash)
        return layout.padded_row_index(nt._sizes, nt._offsets, nt._ragged, total, env)
    key = ("padded_idx", nt._values.device, tuple(env))
    hit = m.derived.get(key)
    if hit is not None:
        return hit
    if m.host_sizes is not None:
        idx = layout.padded_row_index(m.host_sizes, nt.host_offsets(), nt._ragged, total, env)
        idx = idx.to(nt._values.device, non_blocking=True)
    else:
        idx = layout.padded_row_index(nt._sizes, nt._offsets, nt._ragged, total, env)
    m.derived[key] = idx
    return idx


PADDED_GRID_KERNELS: list[Callable[[NestedTensor, Tensor, Sequence[int], float], Tensor | None]] = []
"""Registered by the op layer (``padless.ops.kernels.layout``): each may return the flat padded
grid ``(B * prod(target[ragged]), *static)`` built by a kernel, or None for the ``index_copy`` path."""


def to_padded(nt: NestedTensor, value: float = 0.0, output_size: Sequence[int] | None = None) -> Tensor:
    """Dense ``(B, *envelope)`` copy with ``value`` in padded positions. Differentiable; no sync
    when the batch carries host metadata (collated and locally built batches do).

    Args:
        nt: the NestedTensor.
        value: the fill of padded positions.
        output_size: a larger envelope ``(B, *sizes)`` to pad to (each entry at least the
            batch's own), e.g. a fixed length for a model that wants one.

    Returns:
        A new dense tensor; ``nt.mask()`` says which positions are real.

    >>> import torch, padless
    >>> x = padless.from_list([torch.tensor([1., 2.]), torch.tensor([3.])])
    >>> padless.to_padded(x, -1.0).tolist(), padless.to_padded(x, 0.0, (2, 4)).shape
    ([[1.0, 2.0], [3.0, -1.0]], torch.Size([2, 4]))

    Under ``torch.compile`` the envelope is the NestedTensor's outer size, so the result is
    ``(B, max N, ...)`` with symbolic ``B`` and ``max N``; the call goes through
    ``Tensor.to_padded_tensor`` (a torch function the graph records) to :func:`padded_copy`.
    """
    if torch.compiler.is_compiling():
        return torch.Tensor.to_padded_tensor(nt, value, output_size)
    return padded_copy(nt, value, output_size)


def padded_copy(nt: NestedTensor, value: float = 0.0, output_size: Sequence[int] | None = None) -> Tensor:
    """The body of :func:`to_padded` (what the ``to_padded_tensor`` handler runs): one
    ``index_copy`` of ``values`` into a ``value``-filled grid (or a registered kernel)."""
    env = list(nt._env)
    b = nt.batch_size
    if output_size is not None:
        output_size = list(output_size)
        if len(output_size) != nt.dim():
            raise ValueError(
                f"to_padded(): output_size {tuple(output_size)} must have {nt.dim()} entries (batch included)"
            )
        if output_size[0] != b or any(o < e for o, e in zip(output_size[1:], env)):
            raise RuntimeError(
                "Value in output_size is less than NestedTensor padded size. Truncation is not supported."
            )
        target = output_size[1:]
    else:
        target = env
    ragged = nt._ragged
    order = nt.storage_order
    vals = values_of(nt)
    static = list(vals.shape[1:])
    grid_rows = b
    for d in ragged:
        grid_rows = grid_rows * target[d]
    grid = None
    if not _is_traced(vals):  # kernels read host metadata; traced, the index_copy twin runs
        for kernel in PADDED_GRID_KERNELS:  # a Triton kernel when the op layer's dispatch picks one
            grid = kernel(nt, vals, target, value)
    if grid is None:
        idx = _padded_index(nt, target)
        grid = vals.new_full((grid_rows, *static), value).index_copy(0, idx, vals)
    grid = grid.reshape(b, *[target[d] for d in ragged], *static)
    out = grid.permute(0, *[p + 1 for p in layout.inverse_order(order)])
    static_targets = [target[d] for d in order[len(ragged):]]
    if static_targets != static:
        big = vals.new_full((b, *target), value)
        big[(slice(None), *[slice(0, e) for e in out.shape[1:]])] = out
        return big
    return out.contiguous()


def valid_mask(nt: NestedTensor) -> Tensor:
    """Bool ``(B, *envelope)``, True at real elements. No sync with host metadata."""
    env = list(nt._env)
    b = nt.batch_size
    ragged = nt._ragged
    idx = _padded_index(nt, env)
    grid = torch.zeros(b * math.prod(env[d] for d in ragged), dtype=torch.bool, device=nt.device)
    grid = grid.index_fill(0, idx, True).reshape(b, *[env[d] for d in ragged])
    # Put ragged dims at their sample positions, static dims as broadcast singletons.
    shape = [b] + [1] * nt.sample_dim
    for d in ragged:
        shape[d + 1] = env[d]
    sorted_r = sorted(ragged)
    grid = grid.permute(0, *[1 + ragged.index(d) for d in sorted_r]).reshape(shape)
    return grid.expand(b, *env).contiguous()


def to_njt(nt: NestedTensor) -> Tensor:
    """Convert to a ``torch.nested`` jagged-layout tensor (NJT), for code that needs one.

    The NJT shares ``values`` (no copy) and keeps autograd. torch.nested allows one ragged
    dim, so a batch with several (images ``(C, H_i, W_i)``, pairs ``(N_i, N_i, C)``) is
    refused; flatten them first (``x.flatten(1, 2)``) or keep the padless tensor.

    Args:
        nt: a NestedTensor with exactly one ragged dim.

    Returns:
        ``torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=...)`` with the
        same samples (and the batch's ``max_seqlen``, so no sync).

    Raises:
        StructureError: ``nt`` has more than one ragged dim.

    Example:
        >>> import torch, padless
        >>> x = padless.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> njt = padless.to_njt(x)
        >>> njt.is_nested, njt.values().shape, [t.shape[0] for t in njt.unbind()]
        (True, torch.Size([6, 3]), [2, 4])
        >>> padless.from_njt(njt).shape     # and back
        torch.Size([2, 4, 3])
    """
    if len(nt._ragged) != 1:
        raise StructureError(
            f"to_njt(): torch.nested supports one ragged dim; this NestedTensor has {nt.ragged_dims}. "
            "Flatten the ragged dims first or keep it as a padless.NestedTensor."
        )
    r = nt._ragged[0]
    vals = values_of(nt).movedim(0, r)
    return torch.nested.nested_tensor_from_jagged(
        vals, nt._offsets, jagged_dim=r + 1, max_seqlen=nt.max_seqlen()
    )


# ---------------------------------------------------------------------------- batch indexing


def _batch_indices(index: Any, b: int) -> list[int]:
    if isinstance(index, slice):
        return list(range(b))[index]
    if isinstance(index, Tensor):
        if index.dtype == torch.bool:
            if index.shape != (b,):
                raise IndexError(f"boolean batch index must have shape ({b},), got {tuple(index.shape)}")
            return index.cpu().nonzero().flatten().tolist()
        if index.is_floating_point() or index.dim() != 1:
            raise IndexError(f"batch index tensor must be 1-D integer or bool, got {index.dtype} {tuple(index.shape)}")
        index = index.cpu().tolist()
    out = []
    for j in index:
        if not isinstance(j, int) or isinstance(j, bool):
            raise IndexError(f"batch index entries must be ints, got {j!r}")
        if not -b <= j < b:
            raise IndexError(f"index {j} is out of range for a batch of {b} samples")
        out.append(j % b)
    return out


def select_samples(nt: NestedTensor, index: Any) -> NestedTensor:
    """Sub-batch ``nt[index]`` for a slice, an index list, an int tensor or a bool mask.

    A unit-step slice is a view of ``values``; other indices gather rows. Differentiable.
    """
    b = nt.batch_size
    if nt._meta.host_offsets is None and _is_traced(nt._values) and isinstance(index, slice) and index.step in (None, 1):
        return _select_slice_traced(nt, index)
    hs, ho = nt.host_sizes(), nt.host_offsets()
    vals = values_of(nt)
    if isinstance(index, slice) and index.step in (None, 1):
        start, stop, _ = index.indices(b)
        stop = max(start, stop)
        lo, hi = int(ho[start]), int(ho[stop])
        sub_vals = vals[lo:hi]
        sub_sizes = hs[start:stop]
        sub_offsets = ho[start : stop + 1] - lo
    else:
        idx = _batch_indices(index, b)
        sel = torch.tensor(idx, dtype=torch.int64)
        counts = (ho[1:] - ho[:-1]).index_select(0, sel)
        sub_offsets = layout.offsets_from_counts(counts)
        total = int(sub_offsets[-1])
        sid = layout.row_sample_ids(sub_offsets, total)
        rows = ho[:-1].index_select(0, sel).index_select(0, sid) + torch.arange(total) - sub_offsets[:-1].index_select(0, sid)
        sub_vals = vals.index_select(0, rows.to(vals.device))
        sub_sizes = hs.index_select(0, sel)
    env = envelope_from_sizes(sub_sizes, nt._ragged, vals.shape[1:])
    meta = StructureMeta(sub_sizes, sub_offsets)
    dev = nt._offsets.device
    out = mark_dynamic(nested_from_values(
        sub_vals, sub_offsets.to(dev, non_blocking=True), sub_sizes.to(dev, non_blocking=True), nt._ragged, env, meta
    ))
    if isinstance(index, slice) and index.step in (None, 1) and writes_matter(nt):  # a view: writes reach nt
        out = as_view(out, nt, put_view(lambda r: r[lo:hi]))
    return out


def _select_slice_traced(nt: NestedTensor, index: slice) -> NestedTensor:
    """``nt[start:stop]`` inside a compiled graph: the sub-batch's rows and its envelope are
    new sizes (:mod:`padless.tensor.traced`), the rows one ``index_select`` of ``values``."""
    from padless.tensor.traced import row_range, traced_max

    b = nt.batch_size  # symbolic: ``slice.indices(b)`` would make it a constant of the graph
    start = 0 if index.start is None else index.start
    stop = b if index.stop is None else index.stop
    start = torch.sym_max(start + b, 0) if start < 0 else torch.sym_min(start, b)
    stop = torch.sym_max(stop + b, 0) if stop < 0 else torch.sym_min(stop, b)
    stop = torch.sym_max(start, stop)
    rows = row_range(nt._offsets, start, stop)
    sizes = nt._sizes[start:stop]
    offsets = nt._offsets[start : stop + 1] - nt._offsets[start : start + 1]
    meta = StructureMeta()
    env = list(nt._env)
    for d in nt._ragged:
        env[d] = traced_max(sizes[:, d], meta, d)
    return nested_from_values(values_of(nt).index_select(0, rows), offsets, sizes, nt._ragged, env, meta)


def _expand_index(index: tuple, ndim: int) -> list[Any]:
    """``index`` with its Ellipsis replaced by full slices: one entry per outer dim, plus Nones."""
    if sum(1 for e in index if e is Ellipsis) > 1:
        raise IndexError("NestedTensor indexing: an index can only have a single ellipsis ('...')")
    used = sum(1 for e in index if e is not None and e is not Ellipsis)
    if used > ndim:
        raise IndexError(f"NestedTensor indexing: too many indices ({used}) for a NestedTensor of {ndim} dims")
    out: list[Any] = []
    for e in index:
        out.extend([slice(None)] * (ndim - used) if e is Ellipsis else [e])
    has_ellipsis = any(e is Ellipsis for e in index)
    return out + ([] if has_ellipsis else [slice(None)] * (ndim - used))


def _check_traced_sample_index(nt: NestedTensor, rest: tuple) -> None:
    """Under compile, ``nt[i, ...]`` may not drop a ragged dim in the same call: the sample's
    extents are new sizes of one graph node, and each must reach its output."""
    entries = [e for e in _expand_index(rest, nt.sample_dim) if e is not None]
    for d, e in enumerate(entries):
        if d in nt._ragged and not isinstance(e, slice):
            raise NotImplementedError(
                f"NestedTensor indexing: under torch.compile, nt[i, ...] cannot index ragged dim {d + 1} of "
                f"the sample in the same call; take the sample first and index it next: s = nt[i]; s[...]"
            )


def _index_int(e: Any) -> Any:
    """A numpy integer or a 0-d integer CPU tensor as the int it holds (what it means in an
    index); a 0-d integer tensor on a device is refused (reading it is a sync)."""
    if isinstance(e, Tensor):
        if e.dim() != 0 or e.dtype == torch.bool or e.is_floating_point() or e.is_complex() or isinstance(e, NestedTensor):
            return e
        if torch.compiler.is_compiling() or isinstance(e, _TRACED_TYPES):
            return e  # a graph's index: the op decides
        if e.device.type != "cpu":
            raise IndexError(
                f"NestedTensor indexing: a 0-d index tensor on {e.device} would be read on the host (a device sync); "
                "pass int(t) (or a CPU tensor) to index with it"
            )
        return int(e)
    if isinstance(e, numbers.Integral) and not isinstance(e, (int, bool)):  # numpy integers
        return operator.index(e)
    if isinstance(e, slice) and any(x is not None and not isinstance(x, int) for x in (e.start, e.stop, e.step)):
        return slice(_index_int(e.start), _index_int(e.stop), _index_int(e.step))
    return e


def index_ints(index: Any) -> tuple:
    """``index`` as a tuple, numpy integers and 0-d integer CPU tensors read as ints (alone or as
    slice bounds): ``x[:, np.int64(0):np.int64(2)]`` is ``x[:, 0:2]``, ``x[:, torch.tensor(1)]`` is ``x[:, 1]``."""
    return tuple(_index_int(e) for e in (index if isinstance(index, tuple) else (index,)))


_INDEX_STATIC_DIMS = None  # padless.ops.rows.static_dims.index_static_dims, borrowed on first use


def _static_dims_path() -> Callable:
    global _INDEX_STATIC_DIMS
    _INDEX_STATIC_DIMS = lent("index_static_dims")
    return _INDEX_STATIC_DIMS


def getitem(nt: NestedTensor, index: Any) -> Tensor:
    """``nt[i]`` -> dense sample i (``nt[i, ...]`` indexes into it); a slice, list, int tensor
    or bool mask on the batch dim -> sub-batch; then basic indexing inside every sample:
    ``nt[:, :, 1:3]``, ``nt[..., 0]``, ``nt[:, None]`` on static dims (views of ``values``).
    Ragged dims can only be taken whole (use ``narrow`` for a window of every sample)."""
    if type(index) is tuple and len(index) > 1:  # static dims only: remembered per structure
        out = (_INDEX_STATIC_DIMS or _static_dims_path())(nt, index)  # (padless.ops.rows.static_dims)
        if out is not None:
            return out
    b = nt.batch_size
    index = index_ints(index)
    if len(index) == 0:
        return nt
    first = index[0]
    if isinstance(first, int) and not isinstance(first, bool):
        if not -b <= first < b:
            raise IndexError(f"index {first} is out of range for a batch of {b} samples")
        i = first % b
        if nt._meta.host_offsets is None and _is_traced(nt._values):  # compiled: extents are symbols
            if len(index) > 1:
                _check_traced_sample_index(nt, index[1:])
            sample = select_sample(values_of(nt), nt._offsets, nt._sizes, i, list(nt.storage_order))
            return sample[index[1:]] if len(index) > 1 else sample
        ho = nt.host_offsets()
        lo, hi, shape, rest = int(ho[i]), int(ho[i + 1]), nt.host_sizes()[i].tolist(), index[1:]
        sample = _sample_view(nt, values_of(nt)[lo:hi], shape)
        sample = sample[rest] if rest else sample
        if writes_matter(nt):  # in-place ops on it write through to nt (padless.tensor.views)
            sample = as_view(sample, nt, put_view(lambda r: _sample_view(nt, r[lo:hi], shape)[rest]))
        return sample
    full = _expand_index(index, nt.dim())
    if full[0] is None:
        raise IndexError(
            "NestedTensor indexing: None before the batch dim would add a dim in front of the batch; "
            "insert dims inside samples instead (x[:, None])"
        )
    batch, rest = full[0], full[1:]
    whole = all(isinstance(e, slice) and e == slice(None) for e in rest)
    if whole:
        return nt if len(index) == 1 and index[0] is Ellipsis else select_samples(nt, batch)
    sub = nt if isinstance(batch, slice) and batch == slice(None) else select_samples(nt, batch)
    return lent("index_static")(sub, rest)  # basic indexing inside samples, lent by padless.ops.rows.shape


# ---------------------------------------------------------------------------- from padded, compiled


def pack_like(padded: Tensor, like: NestedTensor) -> NestedTensor:
    """The valid positions of ``padded`` ``(B, *extents)``, packed with ``like``'s ragged
    structure (what ``from_padded(padded, like=nt)`` returns).

    The rows are ``like``'s rows, so the result shares ``like``'s offsets (and, when the
    static extents agree, its whole structure): under ``torch.compile`` the row count and
    the envelope are sizes the graph already has, and ``x + from_padded(f(x.to_padded()),
    like=x)`` adds tensors of one symbolic length. Static dims take ``padded``'s extents (a
    dense layer may have changed them); ragged extents of ``padded`` must cover ``like``'s
    envelope. Differentiable w.r.t. ``padded``.
    """
    what = "from_padded(like=)"
    if not isinstance(like, NestedTensor):
        raise TypeError(f"{what}: like must be a padless NestedTensor, got {type(like).__name__}")
    if not isinstance(padded, Tensor) or isinstance(padded, NestedTensor):
        raise TypeError(f"{what}: padded must be a dense tensor, got {type(padded).__name__}")
    env = like.shape  # the outer size: symbolic under compile (``like._env`` is not, in Dynamo)
    if padded.dim() != len(env) or padded.shape[0] != env[0]:
        raise StructureError(
            f"{what}: padded of shape {tuple(padded.shape)} must have like's batch size {env[0]} "
            f"and rank {len(env)} (like's envelope is {tuple(env)})"
        )
    for d in like._ragged:
        if padded.shape[d + 1] < env[d + 1]:
            raise StructureError(
                f"{what}: padded has extent {padded.shape[d + 1]} along ragged dim {d + 1}, less than like's "
                f"envelope {env[d + 1]} there; pad to at least like.shape"
            )
    if torch.compiler.is_compiling():
        return _pack_like_graph(padded, like)
    return _pack_like(padded, like)


def _pack_like(padded: Tensor, like: NestedTensor) -> NestedTensor:
    order = like.storage_order
    n_ragged = len(like._ragged)
    static = [padded.shape[d + 1] for d in order[n_ragged:]]
    grid = padded.permute(0, *[d + 1 for d in order]).reshape(-1, *static)
    values = grid.index_select(0, _padded_index(like, padded.shape[1:]))
    if list(values.shape[1:]) == list(like._values.shape[1:]):
        sizes, meta, env = like._sizes, like._meta, like._env
    else:
        sizes, meta, env = static_change(values, like)
    return nested_from_values(values, like._offsets, sizes, like._ragged, env, meta)


def pack_lengths(
    padded: Tensor, lengths: Tensor | None, ragged_dims: Sequence[int] | int | None, mask: Tensor | None = None
) -> NestedTensor:
    """``from_padded(padded, lengths)`` (or ``mask=``) inside a compiled graph: lengths are
    runtime data, so the row count and the envelope are new sizes
    (:mod:`padless.tensor.traced`); a length past ``padded``'s extent, or a mask that is not
    a prefix mask, fails at run time (``torch._assert_async``)."""
    what = "NestedTensor.from_padded"
    if mask is not None:
        lengths = _traced_mask_lengths(padded, mask, ragged_dims, what)
        ragged_dims = None
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"{what}: lengths must be integers, got {lengths.dtype}")
    lens = lengths.to(torch.int64)
    lens = lens[:, None] if lens.dim() == 1 else lens
    ndim = padded.dim() - 1
    if lens.dim() != 2 or ndim < 1:
        raise StructureError(f"{what}: lengths must be (B,) or (B, R), got shape {tuple(lengths.shape)}")
    ragged = tuple(range(lens.shape[1])) if ragged_dims is None else norm_ragged_dims(ragged_dims, ndim, what)
    if len(ragged) != lens.shape[1]:
        raise StructureError(f"{what}: lengths has {lens.shape[1]} column(s) but ragged_dims={ragged} names {len(ragged)} dim(s)")
    return _pack_lengths_graph(padded, lens, ragged)


def _traced_mask_lengths(padded: Tensor, mask: Tensor, ragged_dims: Any, what: str) -> Tensor:
    """Per-sample lengths ``(B, k)`` along the dims a prefix ``mask`` covers, on the device."""
    if mask.dtype != torch.bool:
        raise TypeError(f"{what}: mask must be bool, got {mask.dtype}")
    k = mask.dim() - 1
    if k < 1 or tuple(mask.shape) != tuple(padded.shape[: k + 1]):
        raise ValueError(
            f"{what}: mask shape {tuple(mask.shape)} must equal the leading dims of padded "
            f"{tuple(padded.shape)} (batch included)"
        )
    if ragged_dims is not None and tuple(sorted([ragged_dims] if isinstance(ragged_dims, int) else ragged_dims)) != tuple(range(k)):
        raise NotImplementedError(
            f"{what}: under torch.compile, mask= makes every dim it covers ragged (dims {tuple(range(k))}); "
            "pass ragged_dims=None, or lengths= for other ragged dims"
        )
    b = mask.shape[0]
    lens = []
    for j in range(k):
        other = [d for d in range(1, k + 1) if d != j + 1]
        along = mask.any(dim=other) if other else mask
        lens.append(along.sum(dim=1))
    lengths = torch.stack(lens, 1)
    rebuilt = torch.ones_like(mask)
    for j in range(k):
        view = [1] * (k + 1)
        view[j + 1] = mask.shape[j + 1]
        ar = torch.arange(mask.shape[j + 1], device=mask.device).view(view)
        rebuilt = rebuilt & (ar < lengths[:, j].view([b] + [1] * k))
    torch._assert_async((rebuilt == mask).all(), f"{what}: mask is not a prefix mask (a True after a False in some sample)")
    return lengths


def _pack_lengths(padded: Tensor, lens: Tensor, ragged: tuple[int, ...]) -> NestedTensor:
    from padless.tensor.traced import masked_rows, traced_max

    b, ndim = padded.shape[0], padded.dim() - 1
    dev = padded.device
    lens = lens.to(dev)
    cols = [torch.full((b,), padded.shape[d + 1], dtype=torch.int64, device=dev) for d in range(ndim)]
    for j, d in enumerate(ragged):
        cols[d] = lens[:, j]
    sizes = torch.stack(cols, 1)
    extents = torch.stack([torch.full((b,), padded.shape[d + 1], dtype=torch.int64, device=dev) for d in ragged], 1)
    torch._assert_async(
        ((lens >= 0) & (lens <= extents)).all(),
        "NestedTensor.from_padded: a length is negative or exceeds padded's extent along its ragged dim",
    )
    order = layout.storage_order(ndim, ragged)
    valid = torch.ones((b,) + (1,) * len(ragged), dtype=torch.bool, device=dev)
    for j, d in enumerate(ragged):  # storage order of the ragged dims: ``ragged`` is sorted
        shape = [b] + [1] * len(ragged)
        shape[j + 1] = padded.shape[d + 1]
        ar = torch.arange(padded.shape[d + 1], device=dev).view([1] + shape[1:])
        valid = valid & (ar < lens[:, j].view([b] + [1] * len(ragged)))
    static = [padded.shape[d + 1] for d in order[len(ragged):]]
    grid = padded.permute(0, *[d + 1 for d in order]).reshape(-1, *static)
    values = grid.index_select(0, masked_rows(valid))
    offsets = layout.offsets_from_counts(layout.row_counts(sizes, ragged))
    meta = StructureMeta()
    env = list(padded.shape[1:])
    for d in ragged:
        env[d] = traced_max(sizes[:, d], meta, d)
    return nested_from_values(values, offsets, sizes, ragged, env, meta)


# Graph nodes of their own under Dynamo (built NestedTensors are not Dynamo-traceable objects);
# AOTAutograd traces through them. torch._dynamo is already loaded by padless.tensor.core.
_pack_like_graph = torch._dynamo.allow_in_graph(_pack_like)
_pack_lengths_graph = torch._dynamo.allow_in_graph(_pack_lengths)
