"""Layout conversions: packed <-> padded, the validity mask, transposed-pair re-layout.

Sample ``i`` with ragged extents ``(n0, n1, n2)`` (missing levels are 1) holds
rows ``off[i] + (c0 * n1 + c1) * n2 + c2``; its padded slot is row
``(i * E0 + c0) * E1 * E2 + c1 * E2 + c2`` of the flat ``(B * E0 * E1 * E2, F)``
grid (``E`` the padded envelope). Each program owns a tile of one sample's rows
and derives coordinates from the extents: no per-row index tensor.

* ``packed_to_padded``: one program per tile of *padded* rows, writing the value
  or the fill (every output element written once, no pre-fill pass);
* ``padded_to_packed``: one program per tile of *packed* rows (a gather);
  each is the other's backward;
* ``transpose_pair``: rows ``(a, b)`` of an ``(N_i, M_i, F)`` pair to ``(b, a)``.

The torch **twins** use the cached flat index of every row (``index_copy`` /
``index_select``), as :func:`padless.tensor.convert.to_padded` does.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.ops.kernels import dispatch

FAMILY = "layout"
BLOCK_R = 16
tl: Any = None


@dataclasses.dataclass(frozen=True)
class LayoutMeta:
    """Ragged extents per sample (up to 3 levels), offsets, and the padded envelope."""

    ext: Tensor  # (B, 3) int64 ragged extents, missing levels 1 (device)
    offsets: Tensor  # (B + 1,) int64 (device)
    env: tuple[int, int, int]  # padded extent per level
    max_rows: int  # max rows of one sample (host)

    @staticmethod
    def from_host(sizes: Tensor, ragged: Sequence[int], env: Sequence[int], device: torch.device | str) -> "LayoutMeta":
        """``sizes``: host ``(B, D)``; ``ragged``: ragged sample dims; ``env``: padded extent per sample dim."""
        if len(ragged) > 3:
            raise ValueError(f"layout kernels: at most 3 ragged dims, got {len(ragged)}")
        b = sizes.shape[0]
        ext = torch.ones(b, 3, dtype=torch.int64)
        e = [1, 1, 1]
        for k, d in enumerate(ragged):  # storage order
            ext[:, 3 - len(ragged) + k] = sizes[:, d]
            e[3 - len(ragged) + k] = int(env[d])
        rows = ext.prod(1)
        offsets = torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])
        return LayoutMeta(ext.to(device), offsets.to(device), (e[0], e[1], e[2]), int(rows.max()) if b else 0)

    @property
    def grid_rows_per_sample(self) -> int:
        return self.env[0] * self.env[1] * self.env[2]


def _to_padded_kernel(x_ptr, out_ptr, ext_ptr, off_ptr, fill, F, E0, E1, E2,
                      BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    i = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    n0 = tl.load(ext_ptr + i * 3)
    n1 = tl.load(ext_ptr + i * 3 + 1)
    n2 = tl.load(ext_ptr + i * 3 + 2)
    c2 = p % E2
    c1 = (p // E2) % E1
    c0 = p // (E1 * E2)
    inside = p < E0 * E1 * E2
    valid = inside & (c0 < n0) & (c1 < n1) & (c2 < n2)
    src = tl.load(off_ptr + i) + (c0 * n1 + c1) * n2 + c2
    cmask = cols < F
    v = tl.load(x_ptr + src[:, None] * F + cols[None, :], mask=valid[:, None] & cmask[None, :], other=fill)
    dst = i.to(tl.int64) * (E0 * E1 * E2) + p
    tl.store(out_ptr + dst[:, None] * F + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=inside[:, None] & cmask[None, :])


def _to_packed_kernel(g_ptr, out_ptr, ext_ptr, off_ptr, F, E0, E1, E2,
                      BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    i = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    n0 = tl.load(ext_ptr + i * 3)
    n1 = tl.load(ext_ptr + i * 3 + 1)
    n2 = tl.load(ext_ptr + i * 3 + 2)
    valid = r < n0 * n1 * n2
    n2s = tl.maximum(n2, 1)
    n1s = tl.maximum(n1, 1)
    c2 = r % n2s
    c1 = (r // n2s) % n1s
    c0 = r // (n1s * n2s)
    src = i.to(tl.int64) * (E0 * E1 * E2) + (c0 * E1 + c1) * E2 + c2
    dst = tl.load(off_ptr + i) + r
    msk = valid[:, None] & (cols < F)[None, :]
    v = tl.load(g_ptr + src[:, None] * F + cols[None, :], mask=msk, other=0.0)
    tl.store(out_ptr + dst[:, None] * F + cols[None, :], v, mask=msk)


def _transpose_pair_kernel(x_ptr, out_ptr, n_ptr, m_ptr, off_ptr, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    i = tl.program_id(0)
    q = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # output row (b, a) of the (M, N) result
    cols = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    n = tl.load(n_ptr + i)
    m = tl.load(m_ptr + i)
    valid = q < n * m
    ns = tl.maximum(n, 1)
    b = q // ns
    a = q % ns
    off = tl.load(off_ptr + i)
    msk = valid[:, None] & (cols < F)[None, :]
    v = tl.load(x_ptr + (off + a * m + b)[:, None] * F + cols[None, :], mask=msk, other=0.0)
    tl.store(out_ptr + (off + q)[:, None] * F + cols[None, :], v, mask=msk)


def _build(triton: Any, tl_mod: Any) -> types.SimpleNamespace:
    global tl
    tl = tl_mod
    return types.SimpleNamespace(
        to_padded=triton.jit(_to_padded_kernel), to_packed=triton.jit(_to_packed_kernel),
        transpose=triton.jit(_transpose_pair_kernel),
    )


kernels = dispatch.jit_kernels(_build)


def _bf(f: int) -> int:
    return dispatch.next_pow2(f, lo=16, hi=64)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@torch.library.triton_op("padless::packed_to_padded", mutates_args=())
def packed_to_padded_op(x: Tensor, ext: Tensor, offsets: Tensor, e0: int, e1: int, e2: int, fill: float) -> Tensor:
    """``(T, F)`` packed rows -> ``(B * E0 * E1 * E2, F)`` padded grid with ``fill`` outside samples."""
    b, f = ext.shape[0], x.shape[1]
    per = e0 * e1 * e2
    out = x.new_empty((b * per, f))
    if out.numel():
        bf = _bf(f)
        dispatch.launch(kernels().to_padded, (b, _cdiv(per, BLOCK_R), _cdiv(f, bf)), x, out, ext, offsets,
                        float(fill), f, e0, e1, e2, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return out


@packed_to_padded_op.register_fake
def _packed_to_padded_fake(x, ext, offsets, e0, e1, e2, fill):
    return x.new_empty((ext.shape[0] * e0 * e1 * e2, x.shape[1]))


@torch.library.triton_op("padless::padded_to_packed", mutates_args=())
def padded_to_packed_op(grid: Tensor, ext: Tensor, offsets: Tensor, e0: int, e1: int, e2: int, total: int,
                        max_rows: int) -> Tensor:
    """``(B * E0 * E1 * E2, F)`` padded grid -> ``(T, F)`` packed rows."""
    b, f = ext.shape[0], grid.shape[1]
    out = grid.new_empty((total, f))
    if out.numel():
        bf = _bf(f)
        dispatch.launch(kernels().to_packed, (b, _cdiv(max_rows, BLOCK_R), _cdiv(f, bf)), grid.contiguous(), out,
                        ext, offsets, f, e0, e1, e2, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return out


@padded_to_packed_op.register_fake
def _padded_to_packed_fake(grid, ext, offsets, e0, e1, e2, total, max_rows):
    return grid.new_empty((total, grid.shape[1]))


def _setup_to_padded(ctx, inputs, output):
    x, ext, offsets, e0, e1, e2, fill = inputs
    ctx.save_for_backward(ext, offsets)
    ctx.dims = (e0, e1, e2, x.shape[0])


def _backward_to_padded(ctx, g):
    ext, offsets = ctx.saved_tensors
    e0, e1, e2, total = ctx.dims
    max_rows = e0 * e1 * e2  # an upper bound from the envelope: no device read
    return padded_to_packed_op(g, ext, offsets, e0, e1, e2, total, max_rows), None, None, None, None, None, None


def _setup_to_packed(ctx, inputs, output):
    grid, ext, offsets, e0, e1, e2, total, max_rows = inputs
    ctx.save_for_backward(ext, offsets)
    ctx.dims = (e0, e1, e2)


def _backward_to_packed(ctx, g):
    ext, offsets = ctx.saved_tensors
    e0, e1, e2 = ctx.dims
    return packed_to_padded_op(g, ext, offsets, e0, e1, e2, 0.0), None, None, None, None, None, None, None


packed_to_padded_op.register_autograd(_backward_to_padded, setup_context=_setup_to_padded)
padded_to_packed_op.register_autograd(_backward_to_packed, setup_context=_setup_to_packed)


@torch.library.triton_op("padless::transpose_pair", mutates_args=())
def transpose_pair_op(x: Tensor, n: Tensor, m: Tensor, offsets: Tensor, max_rows: int) -> Tensor:
    """Rows of ``(N_i, M_i, F)`` pairs -> rows of the ``(M_i, N_i, F)`` transposes."""
    out = torch.empty_like(x)
    if x.numel():
        bf = _bf(x.shape[1])
        dispatch.launch(kernels().transpose, (n.shape[0], _cdiv(max_rows, BLOCK_R), _cdiv(x.shape[1], bf)),
                        x, out, n, m, offsets, x.shape[1], BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return out


@transpose_pair_op.register_fake
def _transpose_pair_fake(x, n, m, offsets, max_rows):
    return torch.empty_like(x)


def _setup_transpose(ctx, inputs, output):
    x, n, m, offsets, max_rows = inputs
    ctx.save_for_backward(n, m, offsets)
    ctx.max_rows = max_rows


def _backward_transpose(ctx, g):
    n, m, offsets = ctx.saved_tensors
    return transpose_pair_op(g.contiguous(), m, n, offsets, ctx.max_rows), None, None, None, None


transpose_pair_op.register_autograd(_backward_transpose, setup_context=_setup_transpose)


# ---------------------------------------------------------------------------- twins


def padded_index(meta: LayoutMeta, total: int) -> Tensor:
    """Flat padded-grid row of every packed row (what the twins scatter/gather through)."""
    b = meta.ext.shape[0]
    rows = meta.ext.prod(1)
    sid = torch.repeat_interleave(torch.arange(b, device=rows.device), rows, output_size=total)
    local = torch.arange(total, device=rows.device) - meta.offsets[:-1].index_select(0, sid)
    e0, e1, e2 = meta.env
    n1 = meta.ext[:, 1].clamp_min(1).index_select(0, sid)
    n2 = meta.ext[:, 2].clamp_min(1).index_select(0, sid)
    c2 = torch.remainder(local, n2)
    c1 = torch.remainder(torch.div(local, n2, rounding_mode="floor"), n1)
    c0 = torch.div(local, n1 * n2, rounding_mode="floor")
    return (sid * e0 + c0) * (e1 * e2) + c1 * e2 + c2


def twin_packed_to_padded(x: Tensor, meta: LayoutMeta, fill: float = 0.0) -> Tensor:
    grid = x.new_full((meta.ext.shape[0] * meta.grid_rows_per_sample, *x.shape[1:]), fill)
    return grid.index_copy(0, padded_index(meta, x.shape[0]), x)


def twin_padded_to_packed(grid: Tensor, meta: LayoutMeta, total: int) -> Tensor:
    return grid.index_select(0, padded_index(meta, total))


def twin_transpose_pair(x: Tensor, n: Tensor, m: Tensor, offsets: Tensor) -> Tensor:
    total = x.shape[0]
    rows = n * m
    sid = torch.repeat_interleave(torch.arange(n.shape[0], device=x.device), rows, output_size=total)
    q = torch.arange(total, device=x.device) - offsets[:-1].index_select(0, sid)
    ns = n.clamp_min(1).index_select(0, sid)
    src = offsets[:-1].index_select(0, sid) + torch.remainder(q, ns) * m.index_select(0, sid) + torch.div(q, ns, rounding_mode="floor")
    return x.index_select(0, src)


# ---------------------------------------------------------------------------- size buckets


MAX_BUCKETS = 4
"""Most dense calls a bucketed op makes (so its op count does not grow with the batch)."""


def size_buckets(ext: Tensor, weight: Tensor | None = None, cost: Callable[[Sequence[int]], float] | None = None,
                 overhead: float = 0.0, max_buckets: int = MAX_BUCKETS) -> list[list[int]]:
    """Samples grouped for dense calls padded to each group's largest extents.

    ``ext`` ``(B, L)`` (host int64): every sample's extents along the dims padded together;
    ``weight`` ``(B,)``: independent problems per sample (default 1); ``cost(extents)``: the
    work of one problem (default: the product of the extents). A bucket of samples ``S``
    costs ``sum(weight[S]) * cost(max ext[S])``, and every bucket ``overhead`` more (the
    fixed price of a dense call). Samples are sorted by size and split into at most
    ``max_buckets`` contiguous runs, choosing the count and the splits that minimise the
    total (exactly, by dynamic programming over the sorted order). Host work, done once
    per structure by the callers.

    >>> size_buckets(torch.tensor([[2], [9], [3], [8]]), overhead=1.0)
    [[0, 2], [3, 1]]
    >>> size_buckets(torch.tensor([[2], [9], [3], [8]]), overhead=100.0)
    [[0, 2, 3, 1]]
    """
    b = ext.shape[0]
    if b == 0:
        return []
    cost = cost or (lambda e: float(math.prod(e)))
    w = [1] * b if weight is None else [int(x) for x in weight.tolist()]
    rows = ext.tolist()
    order = sorted(range(b), key=lambda i: (cost(rows[i]), rows[i]))
    # coarsen long batches to at most 64 runs of sorted samples, then split optimally
    step = -(-b // 64)
    units = [order[i:i + step] for i in range(0, b, step)]
    ue = [[max(rows[i][j] for i in u) for j in range(ext.shape[1])] for u in units]
    uw = [sum(w[i] for i in u) for u in units]
    n = len(units)
    pre = [0]
    for x in uw:
        pre.append(pre[-1] + x)
    # span[lo][hi]: one bucket of units lo..hi-1 (plain lists: this runs for every new batch)
    span = [[0.0] * (n + 1) for _ in range(n)]
    for lo in range(n):
        env = ue[lo]
        row = span[lo]
        for hi in range(lo + 1, n + 1):
            env = [max(x, y) for x, y in zip(env, ue[hi - 1])]
            row[hi] = float(pre[hi] - pre[lo]) * cost(env) + overhead
    # prev[hi]: the cheapest split of units 0..hi-1 into k - 1 buckets; back[k][hi] its last cut
    inf = float("inf")
    prev = [0.0] + [inf] * n
    back: list[list[int]] = [[]]
    choice, choice_k = inf, 0
    for k in range(1, min(max_buckets, n) + 1):
        cur = [inf] * (n + 1)
        cut = [0] * (n + 1)
        for hi in range(k, n + 1):
            best, at = inf, 0
            for lo in range(k - 1, hi):
                c = prev[lo] + span[lo][hi]
                if c < best:
                    best, at = c, lo
            cur[hi], cut[hi] = best, at
        back.append(cut)
        if cur[n] < choice:
            choice, choice_k = cur[n], k
        prev = cur
    bounds = [n]
    for k in range(choice_k, 0, -1):
        bounds.append(back[k][bounds[-1]])
    bounds.reverse()
    return [[i for u in units[bounds[j]:bounds[j + 1]] for i in u] for j in range(choice_k)]


class RowMap(NamedTuple):
    """An injective row map ``y[r] = x[safe[r]]``, except at the *holes* (rows of ``y`` no row
    of ``x`` lands on), which read a fill value instead; built once on the host by
    :func:`padding_maps`."""

    safe: Tensor  # the source row of every row of y, holes pointing at row 0 (int32 when it fits)
    holes: Tensor | None  # rows of y that are holes, or None


def padding_maps(index: Tensor | np.ndarray, rows: int, device: torch.device | str) -> tuple[RowMap, RowMap]:
    """Both directions of an injective host map ``index`` from packed rows into ``rows``
    padded rows: ``(to_padded, to_packed)``, the padded rows reading packed rows (holes where
    none lands) and the packed rows reading their padded rows (no holes: every packed row has
    its place). Built with numpy in four passes over the padded rows (a zeroed array, a
    scatter, a covered mask, its holes): element maps of a new batch's attention scores run
    to hundreds of thousands of entries, and are built for every new batch.

    >>> to_padded, to_packed = padding_maps(torch.tensor([3, 0, 1]), 5, "cpu")
    >>> to_padded.safe.tolist(), to_padded.holes.tolist(), to_packed.safe.tolist()
    ([1, 2, 0, 0, 0], [2, 4], [3, 0, 1])
    """
    idx = index.contiguous().numpy() if isinstance(index, Tensor) else np.ascontiguousarray(index, dtype=np.int64)
    m = idx.shape[0]
    small = np.int32 if m < 2 ** 31 else np.int64  # half the index traffic of a gather
    safe = np.zeros(rows, dtype=small)
    safe[idx] = np.arange(m, dtype=small)
    covered = np.zeros(rows, dtype=bool)
    covered[idx] = True
    holes = np.flatnonzero(~covered)
    dev = torch.device(device)

    def on(a: np.ndarray) -> Tensor:
        t = torch.from_numpy(a)
        return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

    back = idx.astype(np.int32) if rows < 2 ** 31 else idx
    return RowMap(on(safe), on(holes) if holes.size else None), RowMap(on(back), None)


GRID_ELEMENTS_PER_SAMPLE = 256
"""Average elements per sample from which :func:`grid_positions` builds sample by sample (a
broadcast ``arange`` per dim) rather than over every element at once (a division and a
remainder per dim): a numpy call costs about as much as a pass over a few hundred elements."""


def grid_positions(ext: np.ndarray, base: np.ndarray, strides: np.ndarray) -> np.ndarray:
    """Where every element of every sample's grid lies, samples in order, each grid row-major.

    Sample ``i`` is the grid of extents ``ext[i]`` (``(B, K)`` int64); its element at
    coordinates ``c`` lies at ``base[i] + sum(c * strides[i])``. Host numpy, int64: the index
    maps of a bucketed contraction (rows or elements into a padded bucket buffer) are this,
    with per-sample bases and per-bucket strides. Few large grids (pair states, attention
    scores) are built grid by grid with broadcast ``arange``s, many small ones all at once.

    >>> grid_positions(np.array([[2, 3], [1, 2]]), np.array([0, 100]), np.array([[10, 1], [10, 1]])).tolist()
    [0, 1, 2, 10, 11, 12, 100, 101]
    """
    b, k = ext.shape
    if k == 0:  # every sample one element, at its base
        return base.astype(np.int64)
    sizes = ext.prod(axis=1)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    if total >= GRID_ELEMENTS_PER_SAMPLE * b:
        ar = np.arange(int(ext.max()), dtype=np.int64)
        out = np.empty(total, dtype=np.int64)
        at = 0
        for e, o, st, n in zip(ext.tolist(), base.tolist(), strides.tolist(), sizes.tolist()):
            if n == 0:
                continue
            pos = np.full((1,) * k, o, dtype=np.int64)
            for d in range(k - 1):  # every dim but the last, broadcast
                shape = [1] * k
                shape[d] = e[d]
                pos = pos + (ar[:e[d]] * st[d]).reshape(shape)
            np.add(pos, ar[:e[-1]] * st[-1], out=out[at:at + n].reshape(e))  # the last one into the result
            at += n
        return out
    starts = np.cumsum(sizes) - sizes
    if k == 1:  # rows of sequences: a run per sample
        st = strides[:, 0]
        return np.repeat(base - starts * st, sizes) + np.arange(total, dtype=np.int64) * np.repeat(st, sizes)
    sid = np.repeat(np.arange(b, dtype=np.int64), sizes)
    local = np.arange(total, dtype=np.int64) - starts[sid]
    pos = base.astype(np.int64)[sid]
    for d in reversed(range(k)):
        n = ext[sid, d]
        pos += (local % n) * strides[sid, d]
        local //= n
    return pos


class _RowGather(torch.autograd.Function):
    """``y = x`` read through ``fwd`` (holes read ``fill``); the backward reads ``dy`` through the
    inverse map ``bwd`` (holes: rows of ``x`` no output reads, zero), so neither direction
    scatters: padding rows into a buffer and packing them back are this one op with the
    maps swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, fwd: RowMap, bwd: RowMap, fill: float) -> Tensor:
        ctx.maps = (fwd, bwd)
        return read_rows(x, fwd, fill)

    @staticmethod
    def backward(ctx, g: Tensor):
        fwd, bwd = ctx.maps
        return _RowGather.apply(g, bwd, fwd, 0.0), None, None, None


def read_rows(x: Tensor, m: RowMap, fill: float) -> Tensor:
    """Rows of ``x`` read through ``m``, holes ``fill`` (plain ops: differentiable through
    autograd, but its backward scatters; :func:`gather_rows` is the gather-only version)."""
    y = x.index_select(0, m.safe)
    if m.holes is not None:
        y.index_fill_(0, m.holes, fill)
    return y


def read_elements(x: Tensor, m: RowMap, fill: float, shape: Sequence[int]) -> Tensor:
    """The elements of the flat ``x`` read through ``m`` (holes ``fill``), as a new tensor of
    ``shape`` (not a view: the output of an autograd Function may then be changed in place)."""
    out = x.new_empty(tuple(shape))
    torch.index_select(x, 0, m.safe, out=out.view(-1))
    if m.holes is not None:
        out.view(-1).index_fill_(0, m.holes, fill)
    return out


def gather_rows(x: Tensor, fwd: RowMap, bwd: RowMap, fill: float = 0.0) -> Tensor:
    """Rows of ``x`` read through the injective map ``fwd`` (holes read ``fill``), whose
    inverse ``bwd`` the backward reads the gradient through (see :class:`_RowGather`)."""
    return _RowGather.apply(x, fwd, bwd, fill)


# ---------------------------------------------------------------------------- dispatch


def _flat(x: Tensor) -> tuple[Tensor, int]:
    f = math.prod(x.shape[1:])
    return x.reshape(x.shape[0], f).contiguous(), f


def packed_to_padded(x: Tensor, meta: LayoutMeta, fill: float = 0.0) -> Tensor:
    """Packed rows ``(T, *static)`` -> flat padded grid ``(B * E0 * E1 * E2, *static)``."""
    if not dispatch.use_kernel(FAMILY, x, unsupported=None if x.dtype != torch.bool else "dtype torch.bool"):
        return twin_packed_to_padded(x, meta, fill)
    flat, _ = _flat(x)
    out = packed_to_padded_op(flat, meta.ext, meta.offsets, *meta.env, float(fill))
    return out.reshape(out.shape[0], *x.shape[1:])


def padded_to_packed(grid: Tensor, meta: LayoutMeta, total: int) -> Tensor:
    """Flat padded grid ``(B * E0 * E1 * E2, *static)`` -> packed rows ``(total, *static)``."""
    if not dispatch.use_kernel(FAMILY, grid, unsupported=None if grid.dtype != torch.bool else "dtype torch.bool"):
        return twin_padded_to_packed(grid, meta, total)
    flat, _ = _flat(grid)
    out = padded_to_packed_op(flat, meta.ext, meta.offsets, *meta.env, total, meta.max_rows)
    return out.reshape(total, *grid.shape[1:])


def valid_mask(meta: LayoutMeta, total: int) -> Tensor:
    """Bool ``(B * E0 * E1 * E2,)``: True at padded rows that hold a packed row (``total`` rows)."""
    ones = torch.ones(total, 1, dtype=torch.float16, device=meta.ext.device)
    if not dispatch.use_kernel(FAMILY, ones):
        grid = torch.zeros(meta.ext.shape[0] * meta.grid_rows_per_sample, dtype=torch.bool, device=ones.device)
        return grid.index_fill(0, padded_index(meta, total), True)
    return packed_to_padded_op(ones, meta.ext, meta.offsets, *meta.env, 0.0)[:, 0] != 0


def transpose_pair(x: Tensor, n: Tensor, m: Tensor, offsets: Tensor, max_rows: int) -> Tensor:
    """Rows of ``(N_i, M_i, *static)`` pairs re-laid out as the ``(M_i, N_i, *static)`` transposes."""
    if not dispatch.use_kernel(FAMILY, x):
        return twin_transpose_pair(x, n, m, offsets)
    flat, _ = _flat(x)
    n, m, offsets = n.contiguous(), m.contiguous(), offsets.contiguous()  # indexed flat by the kernel
    return transpose_pair_op(flat, n, m, offsets, max_rows).reshape(x.shape)


# ---------------------------------------------------------------------------- NestedTensor.to_padded


def padded_grid(nt: Any, vals: Tensor, target: Sequence[int], value: float) -> Tensor | None:
    """The flat padded grid of ``nt.to_padded()`` from the kernel, or None (the caller's
    ``index_copy`` path is the twin). Registered in ``padless.tensor.convert``."""
    if not dispatch.quick_check(vals):
        return None

    def unsupported() -> str | None:
        if vals.dtype == torch.bool:
            return "dtype torch.bool"
        if len(nt._ragged) > 3:
            return f"{len(nt._ragged)} ragged dims (the kernel handles up to 3)"
        if nt._meta.host_sizes is None:
            return "no host metadata (the grid would need a device read)"
        return None

    if not dispatch.use_kernel(FAMILY, vals, unsupported=unsupported):
        return None
    key = ("layout_meta", vals.device, tuple(target))
    meta = nt._meta.derived.get(key)
    if meta is None:
        meta = LayoutMeta.from_host(nt._meta.host_sizes, nt._ragged, list(target), vals.device)
        nt._meta.derived[key] = meta
    return packed_to_padded(vals, meta, value)


def relayout_transposed_pair(nt: Any, vals: Tensor) -> Tensor | None:
    """Values of a transposed pair (ragged dims stored as ``(d1, d0)``) in canonical order from
    the kernel, or None (the caller's row gather is the twin). Registered in ``behaviour``."""
    if not dispatch.quick_check(vals):
        return None
    hs = nt._meta.host_sizes

    def unsupported() -> str | None:
        if len(nt._ragged) != 2:
            return f"{len(nt._ragged)} ragged dims (the kernel swaps the two levels of a pair)"
        return "no host metadata (the grid would need a device read)" if hs is None else None

    if not dispatch.use_kernel(FAMILY, vals, unsupported=unsupported):
        return None
    key = ("transpose_meta", vals.device)
    hit = nt._meta.derived.get(key)
    if hit is None:
        outer, inner = nt._ragged
        n, m = hs[:, outer].contiguous(), hs[:, inner].contiguous()
        rows = n * m
        offsets = torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])
        hit = (n.to(vals.device), m.to(vals.device), offsets.to(vals.device), int(rows.max()) if rows.numel() else 0)
        nt._meta.derived[key] = hit
    n, m, offsets, max_rows = hit
    return transpose_pair(vals, n, m, offsets, max_rows)


def _register() -> None:
    from padless.tensor import behaviour, convert

    if padded_grid not in convert.PADDED_GRID_KERNELS:
        convert.PADDED_GRID_KERNELS.append(padded_grid)
    if relayout_transposed_pair not in behaviour.RELAYOUT_KERNELS:
        behaviour.RELAYOUT_KERNELS.append(relayout_transposed_pair)


_register()
