"""Short paths for the common idioms along static dims: indexing (and ``select``, which indexes), ``cat``, ``stack``.

Along a static dim each of these is the dense op on ``values`` with the structure's static
extents changed, and the general handlers compute exactly that, after walking their rules
(windows of ragged dims, dense operands, ragged concatenation, batch joins). A model's rotary
embedding writes ``x[..., :h]``, ``x[..., h:]`` and ``torch.cat((-x2, x1), dim=-1)`` for every
query and key of every layer, on one structure per layer. Here the outcome of those rules is
remembered per structure (``StructureMeta.derived``) and per index form: which ``values``
index to take (or which ``values`` dim to join along) and the new dims, host data only; the
new structure itself comes from :func:`padless.ops.common.structure.restructure`'s cache.
Nothing about a tensor's values is cached.

Each structure keeps at most :data:`MAX_FORMS` index forms (a few ints each); a structure
that sees more (a loop over ``x[..., i]``) starts over.

Only forms the general path answers this way take the short path: every entry at the batch
and ragged dims a full ``:``, static dims taken by ints and slices of plain ints, ``None``
and ``...``; ``cat``/``stack`` of NestedTensors of one structure (the same ``StructureMeta``)
along a static dim. Everything else, and every error, is the general handlers'.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.structure import STATIC, keep_all, restructure, static_dims
from padless.tensor.autograd import values_of
from padless.tensor.convert import _expand_index
from padless.tensor.core import NestedTensor
from padless.tensor.registry import lend
from padless.tensor.views import as_view, put_view, writes_matter

MAX_FORMS = 64
_KEY = "static_dim_forms"
_NO = ()  # remembered: this form takes the general path
_FULL = slice(None)


def _forms(nt: NestedTensor) -> dict:
    d = nt._meta.derived
    forms = d.get(_KEY)
    if forms is None or len(forms) >= MAX_FORMS:
        forms = d[_KEY] = {}
    return forms


def _index_key(index: tuple) -> tuple | None:
    """A hashable key for an index of ints, slices of plain ints (or None), None and ``...``
    (slices are unhashable before Python 3.12); None for any other entry."""
    key = []
    for e in index:
        t = type(e)
        if t is slice:
            a, b, c = e.start, e.stop, e.step
            if (a is not None and type(a) is not int) or (b is not None and type(b) is not int) or (
                    c is not None and type(c) is not int):
                return None
            key.append((a, b, c))
        elif t is int or e is None or e is Ellipsis:
            key.append(e)
        else:
            return None
    return tuple(key)


def _remembered(nt: NestedTensor, key: tuple, build) -> Any:
    """The form remembered under ``key`` for ``nt``'s structure (built by ``build()`` the first
    time); :data:`_NO` where the general path answers (also for traced extents, which do not hash)."""
    forms = _forms(nt)
    try:
        hit = forms.get(key)
    except TypeError:  # traced extents (SymInts) do not hash: the general path
        return _NO
    if hit is None:
        hit = forms[key] = build()
    return hit


@lend("index_static_dims")  # NestedTensor.__getitem__ (padless.tensor.convert) asks first
def index_static_dims(nt: NestedTensor, index: Any) -> NestedTensor | None:
    """``nt[index]`` when it indexes static dims only (module docstring), else None."""
    if type(index) is not tuple or len(index) < 2 or torch.compiler.is_compiling():
        return None
    key = _index_key(index)
    if key is None:
        return None
    hit = _remembered(nt, (nt._ragged, nt._values.shape, key), lambda: _index_form(nt, index))
    if hit is _NO:
        return None
    vidx, dims = hit
    out = restructure(nt, values_of(nt)[vidx], dims)
    if writes_matter(nt):  # in-place ops on it write through to nt (padless.tensor.views), as the general path
        out = as_view(out, nt, put_view(lambda r: r[vidx]))
    return out


def _index_form(nt: NestedTensor, index: tuple) -> tuple:
    """``(values index, new dims)`` of an index that takes static dims only, or :data:`_NO`
    (anything else, an out-of-range int or a step that is not positive: the general path
    answers, or raises its error)."""
    if sum(1 for e in index if e is Ellipsis) > 1 or sum(1 for e in index if e is not None and e is not Ellipsis) > nt.dim():
        return _NO
    full = _expand_index(index, nt.dim())
    if full[0] != _FULL:
        return _NO
    dims = keep_all(nt)
    new: list = []
    vidx: list = [_FULL]
    p = 0
    for e in full[1:]:
        if e is None:
            new.append((STATIC, 1))
            vidx.append(None)
            continue
        kind, n = dims[p]
        if kind != STATIC:
            if e != _FULL:
                return _NO  # a window of a ragged dim, or an error: the general path
            new.append(dims[p])
        elif type(e) is slice:
            if e.step is not None and e.step <= 0:
                return _NO
            new.append((STATIC, len(range(n)[e])))
            vidx.append(e)
        else:
            if not -n <= e < n:
                return _NO
            vidx.append(e)
        p += 1
    if new == dims and all(e == _FULL for e in full[1:]):
        return _NO  # nothing taken: the general path hands nt back
    return tuple(vidx), new


def join_static(op: str, tensors: Sequence[Tensor], dim: Any) -> NestedTensor | None:
    """``torch.cat``/``torch.stack`` of NestedTensors of one structure along a static dim:
    a cat/stack of their rows; None for anything else (the general handler answers)."""
    if type(dim) is not int or type(tensors) not in (list, tuple) or len(tensors) < 2:
        return None
    t0 = tensors[0]
    if not isinstance(t0, NestedTensor):
        return None
    m = t0._meta
    for t in tensors:
        if not isinstance(t, NestedTensor) or t._meta is not m or t._ragged != t0._ragged or t._values.shape != t0._values.shape:
            return None
    if torch.compiler.is_compiling():
        return None
    hit = _remembered(t0, (op, len(tensors), dim, t0._ragged, t0._values.shape), lambda: _join_form(op, t0, len(tensors), dim))
    if hit is _NO:
        return None
    vd, dims = hit
    join = torch.cat if op == "cat" else torch.stack
    return restructure(t0, join([values_of(t) for t in tensors], vd), dims)


def _join_form(op: str, t0: NestedTensor, n: int, dim: int) -> tuple:
    """``(values dim, new dims)`` of a cat/stack of ``n`` inputs like ``t0`` along ``dim``, or
    :data:`_NO` (the batch dim, a ragged dim, a dim out of range: the general path)."""
    k = t0.sample_dim + (2 if op == "stack" else 1)
    if not -k <= dim < k or dim % k == 0:
        return _NO
    p = dim % k - 1
    dims = keep_all(t0)
    if op == "cat":
        if p in t0._ragged:
            return _NO
        dims[p] = (STATIC, dims[p][1] * n)
        return 1 + static_dims(t0).index(p), dims
    vd = 1 + sum(1 for kind, _ in dims[:p] if kind == STATIC)
    dims.insert(p, (STATIC, n))
    return vd, dims
