"""Reductions over any dims of a NestedTensor (torch-function level, autograd through ``values``).

Rules, the same for every reduction:

* ``dim=None`` reduces every real element (a 0-d tensor); a mean over zero elements
  is NaN and ``amax`` of nothing raises, as in torch.
* reducing static dims keeps the ragged structure (the dims disappear, or stay as
  extent 1 with ``keepdim``);
* reducing some ragged dims leaves a NestedTensor over the others; reducing every
  ragged dim leaves a dense ``(B, ...)`` tensor (see :mod:`padless.ops.common.segment`);
* the batch dim cannot be reduced alone (samples differ in shape); reducing it together
  with every ragged dim (``dim=(0, 1)`` on ``(B, L_i, C)``) reduces over all rows of
  every sample and gives a dense tensor of the static dims left (as torch.nested);
  listing every dim is the same as ``dim=None``, and ``keepdim=True`` keeps every
  reduced dim (the batch dim included) as extent 1.

Ragged reductions are one segmented kernel over all rows (``index_add`` /
``scatter_reduce``), never padding and never a Python loop over samples.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from padless.ops.common import segment
from padless.ops.kernels import segment as kernel_segment
from padless.ops.kernels.softmax import ragged_softmax
from padless.ops.common.engine import run_on_rows
from padless.ops.common.islands import TRACED_SOFTMAX
from padless.ops.common.structure import STATIC, keep_all, outer_dim, restructure, values_dim
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.layout import inverse_order
from padless.tensor.registry import implements, implements_aten

aten = torch.ops.aten

# ---------------------------------------------------------------------------- dims


def _outer_dims(nt: NestedTensor, dim, op: str) -> list[int] | None:
    """``dim`` (an int, a sequence, or None/empty for every dim) as sorted outer dims."""
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return None
    return sorted({outer_dim(nt, d, op) for d in dims})


def _dims(nt: NestedTensor, dim, op: str) -> list[int] | None:
    """Outer dims -> sorted sample dims; None means every element."""
    outer = _outer_dims(nt, dim, op)
    if outer is None or outer == list(range(nt.sample_dim + 1)):
        return None
    if 0 in outer:
        raise StructureError(
            f"{op}(): dim 0 is the batch dim of a NestedTensor; samples have different shapes, so "
            "reducing across them is only defined together with every ragged dim "
            f"{tuple(r + 1 for r in nt._ragged)} (or over every dim). Got dim={dim!r}."
        )
    return [d - 1 for d in outer]


def _batch_reduced(nt: NestedTensor, dim, op: str) -> list[int] | None:
    """Outer dims when ``dim`` names the batch dim and every ragged dim (the rows of all
    samples pooled together); None otherwise."""
    outer = _outer_dims(nt, dim, op)
    if outer is None or 0 not in outer or any(r + 1 not in outer for r in nt._ragged):
        return None
    return outer


def _keepdim_shape(nt: NestedTensor, outer: list[int], res: Tensor) -> list[int]:
    """``keepdim=True`` shape of a reduction over ``outer`` (batch included): reduced dims are 1,
    the static dims left keep their extents (``res`` holds them in order)."""
    left = iter(res.shape)
    return [1] + [1 if d + 1 in outer else next(left) for d in range(nt.sample_dim)]


def _one_dim(nt: NestedTensor, dim, op: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}(): dim must be one int, got {dim!r}")
    dims = _dims(nt, dim, op)
    if dims is None:  # a single-dim NestedTensor has only the batch dim left
        raise StructureError(f"{op}(): dim must name a dim inside the samples, got {dim}")
    return dims[0]


def _split(nt: NestedTensor, sdims: list[int]) -> tuple[list[int], list[int]]:
    return [d for d in sdims if d in nt._ragged], [d for d in sdims if d not in nt._ragged]


def _static_only(nt: NestedTensor, vals: Tensor, static: list[int], keepdim: bool) -> NestedTensor:
    dims = keep_all(nt)
    if keepdim:
        new = [(STATIC, 1) if p in static else spec for p, spec in enumerate(dims)]
    else:
        new = [spec for p, spec in enumerate(dims) if p not in static]
    return restructure(nt, vals, new)


class EmptyReductionError(StructureError, IndexError):
    """An extreme (``amax``, ``max``, ``argmax``...) over a dim of extent 0 in some sample.

    torch raises ``IndexError`` for this ("Expected reduction dim 0 to have non-zero size");
    padless raises a :class:`StructureError` (a ``ValueError`` and a ``RuntimeError``): every
    one of those ``except`` clauses catches it.
    """


def _check_nonempty(op: str, nt: NestedTensor, g: segment.Groups, ragged: list[int]) -> None:
    if g.empty_group_sample >= 0:
        i = g.empty_group_sample
        raise EmptyReductionError(
            f"{op}(): sample {i} has extent 0 along reduced dim(s) {tuple(d + 1 for d in ragged)}, "
            f"and {op} of nothing is undefined (as in torch); mask or drop empty samples first"
        )


def _reduction(
    op: str,
    nt: NestedTensor,
    dim,
    keepdim: bool,
    on_static: Callable[[Tensor, list[int], bool], Tensor],
    on_segments: Callable[[Tensor, segment.Groups], Tensor],
    on_all: Callable[[Tensor], Tensor],
    needs_nonempty: bool = False,
) -> Tensor:
    """Shared driver: static dims on values, then ragged dims by segments."""
    batch = _batch_reduced(nt, dim, op)
    if batch is not None:  # batch + every ragged dim: all rows together, then the static dims listed
        vals = values_of(nt)
        if needs_nonempty and vals.shape[0] == 0:
            raise StructureError(f"{op}(): the NestedTensor holds no element; {op} of nothing is undefined")
        if len(batch) == nt.sample_dim + 1:
            res = on_all(vals)
        else:
            static = [d - 1 for d in batch if d and d - 1 not in nt._ragged]
            res = on_static(vals, [0] + [values_dim(nt, d) for d in static], False)
        return res.reshape(_keepdim_shape(nt, batch, res)) if keepdim else res
    sdims = _dims(nt, dim, op)
    vals = values_of(nt)
    if sdims is None:
        if needs_nonempty and vals.numel() == 0:
            raise StructureError(f"{op}(): the NestedTensor holds no element; {op} of nothing is undefined")
        return on_all(vals)
    ragged, static = _split(nt, sdims)
    if static:
        vals = on_static(vals, [values_dim(nt, d) for d in static], keepdim)
    if not ragged:
        return _static_only(nt, vals, static, keepdim)
    g = segment.groups(nt, ragged)
    if needs_nonempty:
        _check_nonempty(op, nt, g, ragged)
    return segment.finish(nt, on_segments(vals, g), ragged, static, keepdim, g)


def sum_raw(nt: NestedTensor, sdims: list[int], keepdim: bool, dtype=None) -> Tensor:
    """Sum over sample dims on the raw buffer, for ATen-level callers (below autograd)."""
    ragged, static = _split(nt, sorted(sdims))
    vals = nt._values
    if static:
        vals = vals.sum(dim=[values_dim(nt, d) for d in static], keepdim=keepdim, dtype=dtype)
    elif dtype is not None:
        vals = vals.to(dtype)
    if not ragged:
        return _static_only(nt, vals, static, keepdim)
    g = segment.groups(nt, ragged)
    return segment.finish(nt, segment.segment_sum(vals, g), ragged, static, keepdim, g)


def _mean_segments(vals: Tensor, g: segment.Groups) -> Tensor:
    return segment.segment_mean(vals, g)


# ---------------------------------------------------------------------------- sum / mean / prod


@implements(torch.sum, torch.Tensor.sum)
def sum_(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Sum over real elements: ``x.sum(dim=1)`` on ``(L_i, C)`` gives dense ``(B, C)``."""
    def all_(v):
        return v.sum(dtype=dtype)

    def st(v, d, k):
        return v.sum(dim=d, keepdim=k, dtype=dtype)

    def seg(v, g):
        return segment.segment_sum(v if dtype is None else v.to(dtype), g)

    return _reduction("sum", nt, dim, keepdim, st, seg, all_)


@implements(torch.mean, torch.Tensor.mean)
def mean(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    """Mean over real elements; over zero elements it is NaN (as torch)."""
    def cast(v):
        return v if dtype is None else v.to(dtype)

    return _reduction(
        "mean", nt, dim, keepdim,
        lambda v, d, k: cast(v).mean(dim=d, keepdim=k),
        lambda v, g: _mean_segments(cast(v), g),
        lambda v: cast(v).mean(),
    )


@implements(torch.prod, torch.Tensor.prod)
def prod(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    def st(v, d, k):
        for x in sorted(d, reverse=True):
            v = v.prod(dim=x, keepdim=k, dtype=dtype)
        return v

    def seg(v, g):
        out = v.new_ones((g.n_groups, *v.shape[1:]))
        idx = g.gid.view(-1, *([1] * (v.dim() - 1))).expand_as(v)
        return out.scatter_reduce(0, idx, v, "prod", include_self=True)

    return _reduction("prod", nt, dim, keepdim, st, seg, lambda v: v.prod(dtype=dtype))


# ---------------------------------------------------------------------------- extremes


@implements(torch.amax, torch.Tensor.amax)
def amax(func, nt: NestedTensor, dim=(), keepdim: bool = False) -> Tensor:
    return _reduction(
        "amax", nt, dim, keepdim, lambda v, d, k: v.amax(dim=d, keepdim=k),
        lambda v, g: segment.segment_extreme(v, g, "amax"), lambda v: v.amax(), needs_nonempty=True,
    )


@implements(torch.amin, torch.Tensor.amin)
def amin(func, nt: NestedTensor, dim=(), keepdim: bool = False) -> Tensor:
    return _reduction(
        "amin", nt, dim, keepdim, lambda v, d, k: v.amin(dim=d, keepdim=k),
        lambda v, g: segment.segment_extreme(v, g, "amin"), lambda v: v.amin(), needs_nonempty=True,
    )


def _arg_extreme(op: str, nt: NestedTensor, dim: int, keepdim: bool, largest: bool):
    """(values, sample-local indices) of the max/min along one dim; gradient to the chosen element."""
    d = _one_dim(nt, dim, op)
    vals = values_of(nt)
    if d not in nt._ragged:
        vd = values_dim(nt, d)
        res = vals.max(dim=vd, keepdim=keepdim) if largest else vals.min(dim=vd, keepdim=keepdim)
        return _static_only(nt, res.values, [d], keepdim), _static_only(nt, res.indices, [d], keepdim)
    g = segment.groups(nt, [d])
    _check_nonempty(op, nt, g, [d])
    with torch.no_grad():
        best = segment.segment_extreme(vals, g, "amax" if largest else "amin")
        ref = segment.gather_rows(best, g)
        hit = (vals == ref) | (vals.isnan() & ref.isnan())  # a NaN wins (as in torch): its first row
        rows = torch.arange(vals.shape[0], device=vals.device).view(-1, *([1] * (vals.dim() - 1)))
        cand = torch.where(hit, rows, vals.shape[0]).expand_as(vals)
        first = torch.full((g.n_groups, *vals.shape[1:]), vals.shape[0], device=vals.device, dtype=torch.int64)
        idx = g.gid.view(-1, *([1] * (vals.dim() - 1))).expand_as(vals)
        arg_row = first.scatter_reduce(0, idx, cand, "amin", include_self=True)
        local = g.local[0].view(-1, *([1] * (vals.dim() - 1))).expand_as(vals)
        arg_local = local.gather(0, arg_row.clamp_max(max(vals.shape[0] - 1, 0)))
    chosen = vals.gather(0, arg_row)
    return (
        segment.finish(nt, chosen, [d], [], keepdim, g),
        segment.finish(nt, arg_local, [d], [], keepdim, g),
    )


def _max_min(op: str, largest: bool):
    def handler(func, nt, dim=None, keepdim: bool = False, **kw):
        if isinstance(dim, Tensor):  # torch.max(a, b): elementwise
            pair = torch.maximum if largest else torch.minimum
            if torch.is_grad_enabled() and (nt.requires_grad or dim.requires_grad):
                return pair(nt, dim)  # through autograd (ATen maximum / minimum on rows)
            return run_on_rows(op, pair, (nt, dim), {}, False)
        if dim is None:
            v = values_of(nt)
            if v.numel() == 0:
                raise StructureError(f"{op}(): the NestedTensor holds no element")
            return v.max() if largest else v.min()
        values, indices = _arg_extreme(op, nt, dim, keepdim, largest)
        ret = torch.return_types.max if largest else torch.return_types.min
        return ret((values, indices))

    handler.__name__ = op
    return handler


implements(torch.max, torch.Tensor.max)(_max_min("max", True))
implements(torch.min, torch.Tensor.min)(_max_min("min", False))


def _arg(op: str, largest: bool):
    def handler(func, nt, dim=None, keepdim: bool = False):
        if dim is None:
            # a flat index into the packed buffer, as torch.nested gives: with one ragged dim,
            # into NJT's buffer layout (the sample dims in their order, the ragged one holding
            # all rows: (C, T) for (C, L_i) samples, where padless stores (T, C)); with several
            # ragged dims (a padless extension), into ``values()`` when they lead every sample
            order = nt.storage_order
            permuted = order != tuple(range(nt.sample_dim))
            if permuted and len(nt._ragged) > 1:
                raise StructureError(
                    f"{op}(): a flat index over this NestedTensor has no meaning (its ragged dims "
                    f"{nt.ragged_dims} are not the leading sample dims, so values are stored permuted); "
                    "pass dim= (a dim inside the samples)"
                )
            v = values_of(nt)
            if v.numel() == 0:
                raise StructureError(f"{op}(): the NestedTensor holds no element")
            if permuted:  # one ragged dim: NJT's layout of the buffer
                v = v.permute(inverse_order(order))
            idx = v.argmax() if largest else v.argmin()
            return idx.reshape([1] * (nt.sample_dim + 1)) if keepdim else idx
        return _arg_extreme(op, nt, dim, keepdim, largest)[1]

    handler.__name__ = op
    return handler


implements(torch.argmax, torch.Tensor.argmax)(_arg("argmax", True))
implements(torch.argmin, torch.Tensor.argmin)(_arg("argmin", False))


# ---------------------------------------------------------------------------- statistics


@implements(torch.logsumexp, torch.Tensor.logsumexp)
def logsumexp(func, nt: NestedTensor, dim, keepdim: bool = False) -> Tensor:
    def seg(v, g):
        return kernel_segment.segment_reduce(v, g, "logsumexp")  # twin: max-shifted exp-sum

    return _reduction("logsumexp", nt, dim, keepdim, lambda v, d, k: v.logsumexp(dim=d, keepdim=k), seg, lambda v: v.logsumexp(dim=tuple(range(v.dim()))))


def _var(op: str, nt: NestedTensor, dim, correction, keepdim: bool, sqrt: bool) -> Tensor:
    corr = 1 if correction is None else correction
    vals = values_of(nt)
    fn = torch.std if sqrt else torch.var
    batch = _batch_reduced(nt, dim, op)
    if batch is not None:  # batch + every ragged dim (+ static dims): one statistic over all rows
        vd = [0] + [values_dim(nt, d - 1) for d in batch if d and d - 1 not in nt._ragged]
        res = fn(vals, dim=vd, correction=corr) if vals.numel() else vals.sum(dim=vd) * float("nan")
        return res.reshape(_keepdim_shape(nt, batch, res)) if keepdim else res
    sdims = _dims(nt, dim, op)
    if sdims is None:
        return fn(vals, correction=corr) if vals.numel() else vals.sum() * float("nan")
    ragged, static = _split(nt, sdims)
    vd = [values_dim(nt, d) for d in static]
    if not ragged:
        return _static_only(nt, fn(vals, dim=vd, correction=corr, keepdim=keepdim), static, keepdim)
    g = segment.groups(nt, ragged)
    if not vd:  # one fused kernel (or its twin, the two-pass code below)
        var = kernel_segment.segment_reduce(vals, g, "var", corr)
        return segment.finish(nt, _safe_sqrt(var) if sqrt else var, ragged, static, keepdim, g)
    per_row = 1
    for d in vd:
        per_row *= vals.shape[d]
    s1 = vals.sum(dim=vd, keepdim=True) if vd else vals
    n = segment.counts_like(g, s1) * per_row
    mu = segment.segment_sum(s1, g) / n
    dev = vals - segment.gather_rows(mu, g)
    s2 = (dev * dev).sum(dim=vd, keepdim=True) if vd else dev * dev
    var = segment.segment_sum(s2, g) / (n - corr).clamp_min(0)
    if vd and not keepdim:
        var = var.squeeze(tuple(vd))
    out = _safe_sqrt(var) if sqrt else var
    return segment.finish(nt, out, ragged, static, keepdim, g)


def _safe_sqrt(v: Tensor) -> Tensor:
    """sqrt whose gradient at 0 is 0 (as torch.std's backward), not NaN."""
    pos = v > 0
    root = torch.where(pos, v, torch.ones_like(v)).sqrt()
    rest = torch.where(torch.isnan(v), v.detach(), torch.zeros_like(v))  # NaN stays NaN (empty groups)
    return torch.where(pos, root, rest)


def _var_args(args, kwargs):
    dim = args[0] if args else kwargs.pop("dim", None)
    unbiased = args[1] if len(args) > 1 else kwargs.pop("unbiased", None)
    correction = kwargs.pop("correction", None)
    if isinstance(dim, bool):  # var(unbiased) overload
        unbiased, dim = dim, None
    if correction is None and unbiased is not None:
        correction = 1 if unbiased else 0
    return dim, correction, kwargs.pop("keepdim", False)


@implements(torch.var, torch.Tensor.var)
def var(func, nt: NestedTensor, *args, **kwargs) -> Tensor:
    dim, corr, keepdim = _var_args(args, dict(kwargs))
    return _var("var", nt, dim, corr, keepdim, sqrt=False)


@implements(torch.std, torch.Tensor.std)
def std(func, nt: NestedTensor, *args, **kwargs) -> Tensor:
    dim, corr, keepdim = _var_args(args, dict(kwargs))
    return _var("std", nt, dim, corr, keepdim, sqrt=True)


# ---------------------------------------------------------------------------- logical, norms


@implements(torch.any, torch.Tensor.any)
def any_(func, nt: NestedTensor, dim=None, keepdim: bool = False) -> Tensor:
    def seg(v, g):
        return segment.segment_sum(v.to(torch.int64), g) > 0

    return _reduction(
        "any", nt, dim, keepdim, lambda v, d, k: v.to(torch.bool).any(dim=tuple(d), keepdim=k),
        lambda v, g: seg(v != 0, g), lambda v: v.any(),
    )


@implements(torch.all, torch.Tensor.all)
def all_(func, nt: NestedTensor, dim=None, keepdim: bool = False) -> Tensor:
    def seg(v, g):
        return segment.segment_sum((v == 0).to(torch.int64), g) == 0

    return _reduction(
        "all", nt, dim, keepdim, lambda v, d, k: v.to(torch.bool).all(dim=tuple(d), keepdim=k),
        seg, lambda v: v.all(),
    )


def _vector_norm(op: str, nt: NestedTensor, ord, dim, keepdim: bool, dtype=None) -> Tensor:
    if dtype is not None:
        nt = nt.to(dtype)
    a = nt.abs()
    if ord in (float("inf"), "inf"):
        return amax(None, a, dim if dim is not None else (), keepdim)
    if ord in (float("-inf"), "-inf"):
        return amin(None, a, dim if dim is not None else (), keepdim)
    if ord == 0:
        return sum_(None, (nt != 0).to(nt.dtype), dim, keepdim)
    if ord == 1:
        return sum_(None, a, dim, keepdim)
    if ord == 2:
        return sum_(None, nt * nt, dim, keepdim).sqrt()
    return sum_(None, a ** ord, dim, keepdim) ** (1.0 / ord)


@implements(torch.linalg.vector_norm)
def vector_norm(func, nt: NestedTensor, ord=2, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
    return _vector_norm("vector_norm", nt, ord, dim, keepdim, dtype)


@implements(torch.norm, torch.Tensor.norm)
def norm(func, nt: NestedTensor, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """``p`` in {"fro", number}: a vector norm over ``dim`` (the Frobenius norm is the 2-norm)."""
    if p == "fro" or p is None:
        p = 2
    if p == "nuc":
        raise NotImplementedError("norm(): the nuclear norm of ragged matrices is not supported")
    return _vector_norm("norm", nt, p, dim, keepdim, dtype)


# ---------------------------------------------------------------------------- softmax, cumsum


def _softmax_impl(op: str, nt: NestedTensor, dim, dtype, log: bool) -> NestedTensor:
    if dim is None:
        raise StructureError(f"{op}(): dim is required for a NestedTensor (no implicit dim choice)")
    d = _one_dim(nt, dim, op)
    vals = values_of(nt)
    if dtype is not None:
        vals = vals.to(dtype)
    if d not in nt._ragged:
        vd = values_dim(nt, d)
        out = torch.log_softmax(vals, vd) if log else torch.softmax(vals, vd)
        return rewrap(out, nt)
    if len(nt._ragged) >= 2 and dtype is None and _is_traced(nt._values):
        for provider in TRACED_SOFTMAX:  # compiled scores of pair attention (padless.ops.pairs.traced)
            out = provider(nt, d, log)
            if out is not None:
                return out
    g = segment.groups(nt, [d])
    return rewrap(ragged_softmax(vals, g, log), nt)


@implements(torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)
def softmax(func, nt: NestedTensor, dim=None, *args, dtype=None, **kwargs) -> NestedTensor:
    """Softmax along any dim; along a ragged dim each group of rows is normalised on its own."""
    if args and isinstance(args[-1], torch.dtype):
        dtype = args[-1]
    return _softmax_impl("softmax", nt, dim, dtype, log=False)


@implements(torch.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax)
def log_softmax(func, nt: NestedTensor, dim=None, *args, dtype=None, **kwargs) -> NestedTensor:
    if args and isinstance(args[-1], torch.dtype):
        dtype = args[-1]
    return _softmax_impl("log_softmax", nt, dim, dtype, log=True)


@implements(torch.cumsum, torch.Tensor.cumsum)
def cumsum(func, nt: NestedTensor, dim: int, *, dtype=None) -> NestedTensor:
    """Cumulative sum along a dim; along a ragged dim it restarts in every sample (and group)."""
    d = _one_dim(nt, dim, "cumsum")
    vals = values_of(nt)
    if dtype is not None:
        vals = vals.to(dtype)
    if d not in nt._ragged:
        return rewrap(vals.cumsum(values_dim(nt, d)), nt)
    g = segment.groups(nt, [d])
    # Order rows by (group, coordinate along d): each group becomes one contiguous run.
    order = _group_order(nt, d, g)
    ordered = vals.index_select(0, order) if order is not None else vals
    pos = g.local[0] if order is None else g.local[0].index_select(0, order)
    out = _run_cumsum(ordered, pos, nt._env[d]).to(ordered.dtype)
    if order is not None:
        out = torch.empty_like(out).index_copy(0, order, out)
    return rewrap(out, nt)


def _run_cumsum(v: Tensor, pos: Tensor, longest) -> Tensor:
    """Inclusive cumsum within contiguous runs of rows; ``pos`` is each row's place in its run.

    A scan in ``ceil(log2(longest))`` vectorised steps (Hillis-Steele): every step adds a
    value only from the same run, so a NaN, an inf or a huge value in one sample never
    reaches another (a global cumsum minus each run's start would leak them). Floats
    accumulate in float64, as torch's CPU cumsum does.
    """
    x = v.to(torch.float64) if v.is_floating_point() else v.to(torch.int64)
    mask_shape = (-1,) + (1,) * (x.dim() - 1)
    s = 1
    while s < longest and s < x.shape[0]:
        shifted = torch.cat([x.new_zeros((s, *x.shape[1:])), x[:-s]])
        x = x + torch.where((pos >= s).view(mask_shape), shifted, torch.zeros_like(shifted))
        s *= 2
    return x


def _group_order(nt: NestedTensor, d: int, g: segment.Groups) -> Tensor | None:
    """Row permutation making each group's rows contiguous and ordered along ``d``, or None."""
    if nt._ragged[-1] == d:
        return None  # d is the innermost stored dim: groups are already contiguous runs
    key = ("cumsum_order", d, nt._values.device)
    hit = nt._meta.derived.get(key)
    if hit is None:
        n = nt._values.shape[0]
        hit = torch.argsort(g.gid * (n + 1) + g.local[0], stable=True)
        nt._meta.derived[key] = hit
    return hit


# ---------------------------------------------------------------------------- ATen sums autograd needs (sum_to_size)


@implements_aten(aten.sum.dim_IntList)
def sum_dim(func, nt: NestedTensor, dim=None, keepdim: bool = False, *, dtype=None):
    """ATen-level ``sum`` over dims of a NestedTensor.

    Autograd's ``sum_to_size`` calls this for operands that were broadcast: reducing
    the batch dim together with every ragged dim (a dense operand broadcast over the
    whole batch), or any dims inside the samples (a per-sample dense operand, or a
    NestedTensor broadcast along a pair axis) through the segmented reductions.
    """
    nd = len(nt._env) + 1
    dims = set(range(nd)) if dim is None or len(dim) == 0 else {d % nd for d in dim}
    ragged_outer = {r + 1 for r in nt._ragged}
    if 0 not in dims:
        return sum_raw(nt, [d - 1 for d in sorted(dims)], keepdim, dtype)
    if not ragged_outer <= dims:
        raise NotImplementedError(
            f"sum(): reducing the batch dim of a NestedTensor needs every ragged dim reduced too "
            f"(ragged dims {sorted(ragged_outer)}, got dims {sorted(dims)})"
        )
    static_outer = sorted(set(range(1, nd)) - ragged_outer)
    red_static = [1 + static_outer.index(d) for d in sorted(dims) if d in static_outer]
    out = nt._values.sum(dim=[0] + red_static, keepdim=True, dtype=dtype)
    full = [1]
    it = iter(out.shape[1:])
    for d in range(1, nd):
        full.append(1 if d in ragged_outer else next(it))
    out = out.reshape(full)
    return out if keepdim else out.squeeze(tuple(sorted(dims)))


@implements_aten(aten.sum.default)
def sum_all(func, nt: NestedTensor, *, dtype=None) -> Tensor:
    """Sum of every real element (padding never counted)."""
    return nt._values.sum(dtype=dtype)
