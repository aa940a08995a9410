"""The one regrouping engine behind ``KeyedTensor.regroup``, ``regroup_kts``,
``permute_multi_embedding`` and ``KTRegroupAsDict``: a host plan and one autograd node.

Which column slices to take is planned once per (keys, widths, key dim, groups) signature
and cached (adjacent keys of one KeyedTensor merged into one slice). The forward is one
``torch.cat`` of column slices, either into one buffer split into the groups (views, as
TorchRec's ``KeyedTensor.regroup`` returns) or one tensor per group (as FBGEMM's
``permute_multi_embedding`` returns). The backward writes each KeyedTensor's gradient as
one buffer: one ``torch.cat`` of the output gradients' slices and zeros for the columns no
group took, plus an in-place add per extra use of a key taken twice. (Autograd through
``narrow`` + ``cat`` would allocate a zero-filled gradient of the whole KeyedTensor per
slice and sum them.)

A key that two KeyedTensors hold (or one holds twice) and that a group names is refused:
TorchRec's functions disagree on which block they take (``KeyedTensor.regroup`` the last
KeyedTensor's, ``regroup_kts`` and ``permute_multi_embedding`` the first's, through
FBGEMM's ``kt_regroup_arguments``; ``KTRegroupAsDict`` the last's at key dim 1 and an
error at other key dims).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

from padless.tensor.errors import StructureError

Slice = tuple[int, int, int]  # (KeyedTensor index, start, width) along the key dim


class Plan(NamedTuple):
    dim: int
    widths: tuple[int, ...]  # each group's width along the key dim
    runs: tuple[tuple[Slice, ...], ...]  # per group, the column slices the forward concatenates
    # per KeyedTensor, None when no group takes a column of it, else
    # (parts, extra): parts tile its key dim in order, each (group, group start, width) or
    # (-1, 0, width) for zeros; extra = (start, width, group, group start) added on top
    grads: tuple[Any, ...]


def _name(i: int, kt: Any) -> str:
    keys = kt.keys()
    shown = repr(keys[:4])[:-1] + (", ...]" if len(keys) > 4 else "]")
    return f"KeyedTensor {i} (keys {shown})"


def _columns(what: str, keyed_tensors: Sequence[Any], groups: Sequence[Sequence[str]]) -> tuple[int, list[list[Slice]]]:
    """``(key_dim, per group [(kt index, start, width), ...])`` on the host."""
    if not keyed_tensors:
        raise ValueError(f"{what}: needs at least one KeyedTensor")
    dims = {kt.key_dim() for kt in keyed_tensors}
    if len(dims) != 1:
        raise ValueError(f"{what}: the KeyedTensors have different key dims {sorted(dims)}")
    where: dict[str, Slice] = {}
    twice: dict[str, list[int]] = {}
    for i, kt in enumerate(keyed_tensors):
        for k, start, width in zip(kt.keys(), kt.offset_per_key(), kt.length_per_key()):
            if k in where:
                twice.setdefault(k, [where[k][0]]).append(i)
            where[k] = (i, start, width)
    out = []
    for g in groups:
        missing = [k for k in g if k not in where]
        if missing:
            raise KeyError(f"{what}: keys {missing} are in no KeyedTensor; available: {list(where)}")
        for k in g:
            if k in twice:
                holders = " and ".join(_name(i, keyed_tensors[i]) for i in twice[k])
                raise StructureError(
                    f"{what}: key {k!r} is held by {holders}: TorchRec's regroup functions disagree on which "
                    "block to take (KeyedTensor.regroup the last, regroup_kts/permute_multi_embedding the first), "
                    "so padless refuses it; rename the key in one KeyedTensor, or pass only the KeyedTensor "
                    "whose block you mean"
                )
        out.append([where[k] for k in g])
    return dims.pop(), out


def _grad_layout(n: int, totals: list[int], runs: list[list[Slice]]) -> tuple[Any, ...]:
    """Per KeyedTensor, how its gradient is assembled from the groups' gradients (see ``Plan``)."""
    pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n)]
    for g, run in enumerate(runs):
        pos = 0
        for i, start, width in run:
            pieces[i].append((start, width, g, pos))
            pos += width
    out: list[Any] = []
    for i in range(n):
        if not pieces[i]:
            out.append(None)
            continue
        parts: list[tuple[int, int, int]] = []
        extra: list[tuple[int, int, int, int]] = []
        pos = 0
        for start, width, g, gpos in sorted(pieces[i]):
            if start < pos:  # a column taken twice: added on top of the first
                extra.append((start, width, g, gpos))
                continue
            if start > pos:
                parts.append((-1, 0, start - pos))
            parts.append((g, gpos, width))
            pos = start + width
        if pos < totals[i]:
            parts.append((-1, 0, totals[i] - pos))
        out.append((tuple(parts), tuple(extra)))
    return tuple(out)


_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLAN_CACHE = 64  # distinct (keys, widths, key dim, groups) signatures kept


def plan(what: str, keyed_tensors: Sequence[Any], groups: Sequence[Sequence[str]]) -> Plan:
    """The cached plan of a signature (a model's steady state computes it once)."""
    if not keyed_tensors:
        _columns(what, keyed_tensors, groups)  # raises the error
    sig = (
        tuple((tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim()) for kt in keyed_tensors),
        tuple(tuple(g) for g in groups),
    )
    hit = _PLANS.get(sig)
    if hit is not None:
        _PLANS.move_to_end(sig)
        return hit
    dim, cols = _columns(what, keyed_tensors, groups)
    runs: list[list[Slice]] = []
    for g in cols:
        merged: list[Slice] = []
        for i, start, width in g:
            if width == 0:
                continue
            if merged and merged[-1][0] == i and merged[-1][1] + merged[-1][2] == start:
                merged[-1] = (i, merged[-1][1], merged[-1][2] + width)
            else:
                merged.append((i, start, width))
        runs.append(merged)
    totals = [sum(kt.length_per_key()) for kt in keyed_tensors]
    widths = tuple(sum(w for _, _, w in r) for r in runs)
    out = Plan(dim, widths, tuple(tuple(r) for r in runs), _grad_layout(len(keyed_tensors), totals, runs))
    _PLANS[sig] = out
    if len(_PLANS) > _PLAN_CACHE:
        _PLANS.popitem(last=False)
    return out


def _check_batch(what: str, keyed_tensors: Sequence[Any], values: list[Tensor], dim: int) -> None:
    """Every KeyedTensor's values agree outside the key dim (the batch), or a clear error."""
    first = values[0].shape
    for i, v in enumerate(values[1:], 1):
        s = v.shape
        if len(s) != len(first) or s[:dim] != first[:dim] or s[dim + 1 :] != first[dim + 1 :]:
            raise StructureError(
                f"{what}: the KeyedTensors disagree on the batch: {_name(0, keyed_tensors[0])} has values of "
                f"shape {tuple(first)}, {_name(i, keyed_tensors[i])} {tuple(s)}; only key dim {dim} may differ"
            )


def _empty_along(v: Tensor, dim: int, width: int) -> Tensor:
    return v.new_empty(v.shape[:dim] + (width,) + v.shape[dim + 1 :])


class _Regroup(torch.autograd.Function):
    """Forward: the plan's column slices concatenated; backward: one buffer per KeyedTensor."""

    @staticmethod
    def forward(ctx: Any, p: Plan, one_buffer: bool, *values: Tensor) -> tuple[Tensor, ...]:
        dim = p.dim
        ctx.plan = p
        ctx.shapes = [v.shape for v in values]
        if one_buffer:
            parts = [values[i].narrow(dim, s, w) for run in p.runs for i, s, w in run]
            buf = torch.cat(parts, dim) if parts else _empty_along(values[0], dim, 0)
            return tuple(buf.split(list(p.widths), dim))
        return tuple(
            torch.cat([values[i].narrow(dim, s, w) for i, s, w in run], dim) if run else _empty_along(values[0], dim, 0)
            for run in p.runs
        )

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        p: Plan = ctx.plan
        dim = p.dim
        out: list[Tensor | None] = [None, None]
        for i, layout in enumerate(p.grads):
            if layout is None or not ctx.needs_input_grad[2 + i]:
                out.append(None)
                continue
            parts, extra = layout
            shape = ctx.shapes[i]
            zero = None
            pieces = []
            for g, gpos, width in parts:
                if g >= 0:
                    pieces.append(grads[g].narrow(dim, gpos, width))
                else:
                    if zero is None:
                        zero = grads[0].new_zeros(())
                    pieces.append(zero.expand(shape[:dim] + (width,) + shape[dim + 1 :]))
            if len(pieces) == 1 and not extra:
                out.append(pieces[0])  # one slice of one group's gradient: a view, no copy
                continue
            grad = torch.cat(pieces, dim)  # a fresh buffer: the extra uses are added in place
            for start, width, g, gpos in extra:
                grad.narrow(dim, start, width).add_(grads[g].narrow(dim, gpos, width))
            out.append(grad)
        return tuple(out)


def regroup(what: str, keyed_tensors: Sequence[Any], groups: Sequence[Sequence[str]], one_buffer: bool) -> list[Tensor]:
    """One tensor per group; ``one_buffer``: views of one buffer, else a tensor per group."""
    p = plan(what, keyed_tensors, groups)
    values = [kt.values() for kt in keyed_tensors]
    _check_batch(what, keyed_tensors, values, p.dim)
    if not p.runs:
        return []
    return list(_Regroup.apply(p, one_buffer, *values))
