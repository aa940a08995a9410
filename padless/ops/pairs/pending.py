"""Deferred attention scores: ``softmax(q @ k^T * c + bias + mask) @ v`` as one bucketed node.

Attention written by hand (boltz's ``AttentionPairBias``, AlphaFold-style code) runs
``einsum``/``@`` for the scores, a few elementwise ops (scale, ``+ bias``, ``+ mask``), a
softmax over the last ragged dim and a second contraction. Run op by op, each elementwise op
is a pass over a ``(H, N_i, N_i)`` score tensor with its autograd node, and the scores are
gathered out of the contraction's padded buckets and back into the softmax's and the second
contraction's. Here they are not computed until something needs them:

* a bucketed contraction whose result's last dim is ragged (:func:`contract`) returns
  :class:`Pending` rows: a tensor with shape and dtype but no data, holding a recipe
  ``alpha * (a . b) + sum(coef * term)`` (an autograd node whose backward is the
  contraction's own);
* elementwise ``*``/``/`` by a number and ``+``/``-`` of a tensor that broadcasts to the rows
  (a bias on the same rows, a key mask read onto them), out of place or in place
  (``s += bias``), extend the recipe (:meth:`Pending.__torch_dispatch__`; autograd records
  these ops as usual, above it); a NestedTensor term whose extent-1 dims broadcast over the
  scores (a triangle bias ``(1, H, N_i, N_i)`` over the query rows) enters the recipe at its
  own size, not read onto the scores' rows (:func:`spread_shift`, :mod:`padless.ops.pairs.spread`);
* the bucketed softmax over the last ragged dim of such rows (:func:`softmax`) is pending too;
* a contraction that sums that dim of the pending softmax (``attn @ v``,
  ``einsum("bhij,bjhd->bihd", attn, v)``; :func:`attention`) runs everything in the first
  contraction's buckets as one node (:class:`padless.ops.pairs.attend.Attention`): per
  bucket one ``baddbmm`` for the scores plus the terms (one gathered buffer, padded places a
  large negative number; without terms, a key mask of a few numbers per slot), a dense
  softmax, one ``bmm`` with ``v``; its backward makes the
  gradients of ``a``, ``b``, ``v`` and every term in the same buckets. Nothing in between runs.

Any other use of pending rows (another op, printing, ``.values()`` read by an op that is not
one of the above) computes them (the recipe in buckets, below autograd), so results never
depend on whether the deferral happened. An in-place op other than a scale or a shift, or a
view of the rows (which could be written through), ends the recipe: the rows are computed
and are from then on ordinary rows; a softmax taken of a recipe is computed before the
recipe changes in place. A tensor that entered a recipe (an operand, a term) and is changed
in place before the recipe runs makes it raise (its old values are gone).

Gradients: autograd records the elementwise ops and the softmax on the pending rows as for
any tensor, so every use other than the fused contraction differentiates normally. The
fused node takes ``a``, ``b`` and the terms as inputs when each term's history is known (it
entered the recipe at the level autograd records, it is the rows of a NestedTensor operand
of an op recorded on NestedTensors, or it needs no gradient); when a term was read onto the
scores' rows from a NestedTensor that needs a gradient (a broadcast ``+``), the node takes
the softmax's input instead and hands its gradient to the recorded ops. ``torch.baddbmm(bias,
q, k^T, alpha=c)`` on NestedTensors is ``matmul``, a scale and a sum here (:func:`baddbmm`),
so it takes the same path. Not deferred: under
autocast (its casts sit between the ops) and under ``torch.compile`` (the bucketed path is
eager only), and under ``torch.inference_mode()`` (a recipe is guarded by the version
counters of what entered it, and inference tensors have none). ``ENABLED = False`` turns deferral off (A/B timing).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from padless.ops.common.engine import NESTED_OP, SHIFT_HOOKS, zero_constant
from padless.ops.common.structure import call
from padless.ops.kernels import softmax as _softmax_kernels
from padless.ops.kernels.layout import read_rows
from padless.ops.kernels.segment import twin_reduce
from padless.ops.pairs import attend, spread
from padless.ops.pairs.bucket_nodes import (
    _buckets,
    _flatten,
    _packed,
    _Plan,
    contract_backward,
)
from padless.tensor.core import NestedTensor, _apply, values_of
from padless.tensor.registry import implements

aten = torch.ops.aten


class _Thunk:
    """A recipe and, once computed, its value. ``kind``: ``"affine"`` (``alpha * (a . b) +
    sum(coef * term)``) or ``"softmax"`` (of an affine thunk along runs of rows)."""

    __slots__ = ("kind", "plan", "a", "b", "alpha", "terms", "versions", "grad_ok", "src", "groups",
                 "x", "shape", "dtype", "device", "value", "value_version", "dependents", "__weakref__")

    def __init__(self, kind: str, shape, dtype, device) -> None:
        self.kind, self.shape, self.dtype, self.device = kind, tuple(shape), dtype, device
        self.plan = self.a = self.b = self.src = self.groups = self.x = self.value = self.value_version = None
        self.alpha, self.terms, self.versions, self.grad_ok = 1.0, (), (), True
        self.dependents: list = []

    def fresh(self) -> bool:
        """Whether the recipe still stands: not changed in place (computed or not)."""
        return self.kind != "done" and (self.value is None or self.value._version == self.value_version)

    def check(self) -> None:
        for t, v in zip((self.a, self.b, *(t for _, t, _ in self.terms)), self.versions):
            if t is not None and t._version != v:
                raise RuntimeError(
                    "padless: a tensor that deferred attention scores were built from (an operand of "
                    "the contraction, or a term added to its result) was changed in place before the "
                    "scores were used; change it out of place (x = x + y) or use the scores first")

    def compute(self) -> Tensor:
        if self.value is not None:
            return self.value
        if self.kind == "done":
            raise RuntimeError("padless internal: a deferred value was dropped")
        self.check()
        with torch.no_grad():
            if self.kind == "affine":
                bufs = [read_rows(_flatten(v.detach(), fl), to_buf, 0.0)
                        for v, (to_buf, _), fl in zip((self.a, self.b), self.plan.pads, self.plan.flat)]
                out = _packed(self.plan, _buckets(self.plan, bufs)).view(self.shape)
                if self.alpha != 1.0:
                    out.mul_(self.alpha)
                for coef, t, _ in self.terms:
                    out.add_(t.rows() if isinstance(t, spread.Spread) else t.detach(), alpha=coef)
            else:
                out = _softmax_kernels.twin_softmax(self.src.compute(), self.groups, False)
        self.value, self.value_version = out, out._version
        return out

    def materialize_dependents(self) -> None:
        """Before this recipe changes (in place, or ends): compute every live softmax taken of
        it (an affine recipe built on it holds its own copy and stands)."""
        for ref in self.dependents:
            d = ref()
            if d is not None and d.kind == "softmax":
                d.compute()
                d.kind, d.src, d.x = "done", None, None
        self.dependents = [ref for ref in self.dependents if ref() is not None and ref().kind == "affine"]


def _derive(src: _Thunk, kind: str) -> _Thunk:
    t = _Thunk(kind, src.shape, src.dtype, src.device)
    src.dependents.append(weakref.ref(t))
    return t


class Pending(Tensor):
    """Rows whose values are a recipe (see the module docstring); computed on first use."""

    _thunk: _Thunk
    padless_deferred = True  # NestedTensor.values() hands out the computed rows, a plain tensor

    @staticmethod
    def __new__(cls, thunk: _Thunk, requires_grad: bool = False) -> Pending:
        r = Tensor._make_wrapper_subclass(cls, thunk.shape, dtype=thunk.dtype, device=thunk.device,
                                          requires_grad=requires_grad)
        r._thunk = thunk
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *args, **kwargs) -> str:  # type: ignore[override]
        return f"Pending({self._thunk.compute()!r})"

    def data_ptr(self) -> int:  # type: ignore[override]
        return self._thunk.compute().data_ptr()

    def __reduce_ex__(self, proto):  # pickled as the computed rows
        return self._thunk.compute().__reduce_ex__(proto)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES and isinstance(args[0], Pending):
            return Pending(args[0]._thunk)
        out = _extend(func, args, kwargs)
        if out is not None:
            return out
        if func in _IN_PLACE and isinstance(args[0], Pending) and _in_place(func, args, kwargs):
            return args[0]
        if func in _READS_META and isinstance(args[0], Pending):  # new_zeros, empty_like...: no values read
            th = args[0]._thunk
            return func(torch.empty(th.shape, dtype=th.dtype, device=th.device), *args[1:], **kwargs)
        writes, aliases = _effects(func)
        if (writes or aliases) and isinstance(args[0], Pending):
            # changed in place, or a view of its values handed out (which may be changed): the
            # recipe ends here, and every recipe built on it is computed first
            th = args[0]._thunk
            th.materialize_dependents()
            th.compute()
            th.kind = "done"
            th.a = th.b = th.src = th.x = None
            th.terms = ()
        real, rk = tree_map(_computed, (args, kwargs))
        res = func(*real, **rk)
        return args[0] if writes and isinstance(args[0], Pending) else res


def _computed(a: Any) -> Any:
    return a._thunk.compute() if isinstance(a, Pending) else a


_ALIASES = {aten.detach.default, aten.alias.default}
_EFFECTS: dict = {}
_IN_PLACE = {aten.add_.Tensor: aten.add.Tensor, aten.sub_.Tensor: aten.sub.Tensor, aten.add_.Scalar: aten.add.Scalar,
             aten.sub_.Scalar: aten.sub.Scalar, aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
             aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar}


def _in_place(func, args, kwargs) -> bool:
    """``s += bias`` / ``s *= c`` on pending rows (boltz's triangle attention adds its biases so):
    the recipe itself changes (every alias sees it); recipes built on the old one are
    computed first. False (nothing done) when the op is not a scale or a shift."""
    th = _affine(args[0])
    if th is None:
        return False
    th.materialize_dependents()
    # a computed value is only ever handed out as new tensors (a view ends the recipe): drop it
    th.value = th.value_version = None
    new = _extend(_IN_PLACE[func], (Pending(th), *args[1:]), kwargs)
    if new is None:
        return False
    _take_recipe(th, new._thunk)
    return True


def _take_recipe(th: _Thunk, t: _Thunk) -> None:
    """``th`` (changed in place) becomes the recipe ``t`` derived from it."""
    th.dependents = [ref for ref in th.dependents if ref() is not t]
    th.plan, th.a, th.b, th.alpha, th.terms, th.versions, th.grad_ok = t.plan, t.a, t.b, t.alpha, t.terms, t.versions, t.grad_ok


def _effects(func) -> tuple[bool, bool]:
    """Whether ``func`` writes its first argument, and whether its result aliases it (a view)."""
    hit = _EFFECTS.get(func)
    if hit is None:
        sa, sr = func._schema.arguments, func._schema.returns
        writes = bool(sa and sa[0].alias_info is not None and sa[0].alias_info.is_write)
        aliases = bool(not writes and sr and sr[0].alias_info is not None)
        hit = _EFFECTS[func] = (writes, aliases)
    return hit


_READS_META = {aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default,
               aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_empty_strided.default}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_SHIFT = {aten.add.Tensor: 1.0, aten.sub.Tensor: -1.0, aten.add.Scalar: 1.0, aten.sub.Scalar: -1.0}


def _number(x: Any) -> float | None:
    """``x`` as a Python float when it is a number or a 0-d host tensor (no device read)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, Tensor) and not isinstance(x, Pending) and x.dim() == 0 and x.device.type == "cpu" \
            and x.is_floating_point() and not x.requires_grad:
        return float(x)
    return None


def _affine(x: Any) -> _Thunk | None:
    if isinstance(x, Pending) and x._thunk.kind == "affine" and x._thunk.fresh():
        return x._thunk
    return None


def _scaled(th: _Thunk, c: float) -> _Thunk:
    t = _derive(th, "affine")
    t.plan, t.a, t.b, t.grad_ok = th.plan, th.a, th.b, th.grad_ok
    t.alpha = th.alpha * c
    t.terms = tuple((coef * c, term, owner) for coef, term, owner in th.terms)
    t.versions = th.versions
    return t


def _extend(func, args, kwargs) -> Pending | None:
    """The recipe of ``func(*args)`` when it is a scale or a shift of pending affine rows."""
    if func in _SCALE and len(args) == 2 and not kwargs:
        x, y = args
        th = _affine(x)
        c = _number(y)
        if th is None and func in (aten.mul.Tensor, aten.mul.Scalar):
            th, c = _affine(y), _number(x)
        if th is None or c is None or c == 0.0:
            return None
        return Pending(_scaled(th, 1.0 / c if func in (aten.div.Tensor, aten.div.Scalar) else c))
    sign = _SHIFT.get(func)
    if sign is None or len(args) != 2 or set(kwargs) - {"alpha"}:
        return None
    x, y = args
    alpha = _number(kwargs.get("alpha", 1.0))
    if alpha is None:
        return None
    th = _affine(x)
    if th is not None:
        base, other, coef = th, y, sign * alpha
    else:
        th = _affine(y)
        if th is None:
            return None
        base, other, coef = _scaled(th, sign * alpha), x, 1.0
    if _number(other) is not None:  # a constant: softmax does not see it, the recipe keeps it
        return _with_term(base, torch.tensor(_number(other), dtype=th.dtype), coef)
    if not isinstance(other, Tensor) or isinstance(other, Pending) or other.dtype != th.dtype \
            or other.device != th.device or not _broadcasts(other.shape, th.shape):
        return None
    owner = _owner(other)
    if owner is None and tuple(other.shape) != tuple(th.shape):
        # a broadcast operand that is no batch's rows is the caller's own tensor (a bias, a table
        # row): the dense op reads its values now, and a write through .data moves no version
        # counter. One with a history (a parameter) is added now: below autograd no copy of it
        # keeps that history; one without is copied into the recipe (small: it broadcasts)
        if other.requires_grad:
            return None
        other = other.clone()
    return _with_term(base, other, coef, owner=owner)


def _broadcasts(shape, to) -> bool:
    """Whether ``shape`` broadcasts to ``to`` without growing it."""
    if len(shape) > len(to):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(to)))


def _with_term(th: _Thunk, term: Any, coef: float, owner: Any = None) -> Pending:
    """``th`` plus ``coef * term``; ``owner`` as :func:`_owner` gives it (None: ``term`` itself)."""
    t = _derive(th, "affine")
    t.plan, t.a, t.b, t.alpha = th.plan, th.a, th.b, th.alpha
    t.terms = (*th.terms, (coef, term, owner))
    t.versions = (*th.versions, term._version)
    t.grad_ok = th.grad_ok and owner is not False
    return Pending(t)


def _owner(term: Tensor):
    """Where the fused node gets ``term`` with its autograd history: None when ``term`` is
    it (autograd records this op on plain rows, or nothing needs a gradient); the
    NestedTensor whose rows ``term`` is, inside an op recorded on NestedTensors
    (:data:`padless.ops.common.engine.NESTED_OP`: its rows there carry no history, its
    ``values()`` do); ``(nested, row map, squeezed dims, version)`` when ``term`` is that
    NestedTensor's rows read onto the scores' rows by a broadcast (a triangle bias over the
    query rows: the fused node reads them again, recorded); False when unknown (the fused
    node then takes the softmax's input instead)."""
    nts = getattr(NESTED_OP, "nts", None)
    if term.requires_grad or not nts:
        return None
    read = (getattr(NESTED_OP, "gathers", None) or {}).get(id(term))
    for n in nts:
        if isinstance(n._values, Pending) or not n.requires_grad:
            continue
        if n._values is term:
            return n
        if read is not None and read[0] is n:  # n's rows read onto the scores' rows
            return (*read, n._values._version)
        return False
    return None


def _live_terms(th: _Thunk) -> list[Tensor]:
    """The recipe's terms with their autograd history (see :func:`_owner`): a broadcast
    operand's rows are read onto the scores' rows again, recorded (its gradient sums back)."""
    out = []
    for _, term, owner in th.terms:
        if isinstance(term, spread.Spread):  # its own rows, with their history (the node reads them)
            out.append(values_of(term.src))
        elif owner is None:
            out.append(term)
        elif isinstance(owner, tuple):
            n, rows, sq, version = owner
            if n._values._version != version:
                raise RuntimeError(
                    "padless: a tensor that deferred attention scores were built from (a term added "
                    "to them) was changed in place before the scores were used; change it out of "
                    "place (x = x + y) or use the scores first")
            out.append(_apply(_ReadAgain, values_of(n), term, rows, sq))
        else:
            out.append(values_of(owner))
    return out


class _ReadAgain(torch.autograd.Function):
    """``broadcast.align(src, rows, sq)`` with its result already made (``done``, the term the
    recipe holds, read without history): the forward hands ``done`` out, the backward sums
    the gradient back onto ``src``'s rows. Saves reading the rows a second time."""

    @staticmethod
    def forward(ctx, src: Tensor, done: Tensor, rows: Tensor | None, sq: tuple) -> Tensor:
        ctx.rows, ctx.shape = rows, src.shape
        ctx.squeezed = src.squeeze(sq).shape if sq else src.shape
        return done.view_as(done)

    @staticmethod
    def backward(ctx, g: Tensor):
        if ctx.rows is not None:
            g = g.new_zeros(ctx.squeezed).index_add(0, ctx.rows, g)
        return g.reshape(ctx.shape), None, None, None


# ---------------------------------------------------------------------------- entry points


ENABLED = True
"""Whether contractions defer their scores (off: every op runs as it is called; A/B timing)."""


def deferrable(plan: _Plan | None, out: str, vals: Sequence[Tensor]) -> bool:
    """Whether a bucketed contraction's result is returned pending: two operands with
    gradients of the same form, the result's last dim ragged (scores over keys), no
    autocast (its casts sit between the ops), no inference mode (no version counters to
    guard the recipe), no operand pending itself."""
    return (ENABLED and plan is not None and plan.grad_equations is not None and len(vals) == 2
            and bool(plan.out_ragged) and plan.out_ragged[-1] == len(out) - 1
            and not any(isinstance(v, Pending) for v in vals)
            and not torch.is_autocast_enabled(vals[0].device.type)
            and not torch.is_inference_mode_enabled()
            and vals[0].dtype == vals[1].dtype and vals[0].is_floating_point())


def contract(plan: _Plan, a: Tensor, b: Tensor) -> Tensor:
    """The rows of ``a . b`` (``plan``), pending."""
    th = _Thunk("affine", (plan.out_rows, *plan.out_static), a.dtype, a.device)
    th.plan, th.a, th.b, th.versions = plan, a, b, (a._version, b._version)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _apply(_PendingContract, th, a, b)
    return Pending(th)


class _PendingContract(torch.autograd.Function):
    @staticmethod
    def forward(ctx, th: _Thunk, a: Tensor, b: Tensor) -> Tensor:
        ctx.plan = th.plan
        ctx.save_for_backward(a, b)
        return Pending(th)

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b = ctx.saved_tensors
        return (None, *contract_backward(ctx.plan, a, b, (), g, ctx.needs_input_grad[1:]))


def softmax(values: Tensor, g: Any, log: bool) -> Tensor | None:
    """The softmax of pending affine rows over the last ragged dim, pending; else None."""
    th = _affine(values)
    if th is None or log or not hasattr(g, "runs"):
        return None
    runs = g.runs()
    if runs is None or runs != _runs(th.plan):
        return None
    t = _derive(th, "softmax")
    t.src, t.groups, t.x = th, g, values
    if torch.is_grad_enabled() and values.requires_grad:
        return _apply(_PendingSoftmax, t, values)
    return Pending(t)


def _runs(plan: _Plan) -> list:
    """The groups of consecutive rows of the softmax over the result's last ragged dim."""
    hit = plan.cache.get("runs")
    if hit is None:
        meta = plan.structure[3]
        ho, hs = meta.host_offsets.tolist(), meta.host_sizes[:, plan.out_ragged[-1]].tolist()
        hit = plan.cache["runs"] = [(ho[i], ho[i + 1], c) for i, c in enumerate(hs)]
    return hit


class _PendingSoftmax(torch.autograd.Function):
    """The softmax node of pending rows; its backward (run only when the weights are used by
    something other than the fused contraction) is ``y * (dy - sum(dy * y))`` over the runs,
    from the saved output (as torch's softmax: double backward differentiates it)."""

    @staticmethod
    def forward(ctx, t: _Thunk, x: Tensor) -> Tensor:
        ctx.groups = t.groups
        y = Pending(t)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (y,) = ctx.saved_tensors
        if not torch.is_grad_enabled():
            y = y._thunk.compute() if isinstance(y, Pending) else y
        g = ctx.groups
        dyy = dy * y
        return None, dyy - y * twin_reduce(dyy, g, "sum").index_select(0, g.gid)


def attention(ins: Sequence[str], out: str, operands: Sequence[Any], vals: Sequence[Tensor],
              grad_equations: bool, plan_like) -> tuple[Tensor, _Plan] | None:
    """``softmax(scores) . other`` as one bucketed node when operand ``j``'s rows are the
    pending softmax of pending scores over the dim this contraction sums: the result's rows
    and the plan they follow; else None. ``grad_equations``: whether the contraction's
    gradients are contractions of its form. ``plan_like(ins, out, operands, groups, unread)``: this
    contraction's plan on given buckets."""
    if not grad_equations or len(vals) != 2:
        return None
    for j in (0, 1):
        y = vals[j]
        if not isinstance(y, Pending) or y._thunk.kind != "softmax" or not y._thunk.fresh():
            continue
        t = y._thunk
        s = t.src
        if s.kind != "affine" or not s.fresh() or isinstance(vals[1 - j], Pending) or vals[1 - j].dtype != y.dtype:
            continue
        o = operands[j]
        p1 = s.plan
        if o._ragged != p1.out_ragged or not _same_rows(o, p1):
            continue
        c = ins[j][o._ragged[-1]]
        if c in out or c not in ins[1 - j]:
            continue
        key = ("attention", tuple(ins), out, j, id(operands[1 - j]._meta))
        hit = p1.cache.get(key)
        if hit is None:
            p2 = plan_like(ins, out, operands, p1.groups, unread=j)  # the weights are made in the node
            if p2 is None or p2.grad_equations is None:
                continue
            hit = p1.cache[key] = (p2, operands[1 - j]._meta)
        s.check()
        coefs = tuple(coef for coef, _, _ in s.terms)
        if s.grad_ok:
            spreads = tuple(spread.maps(p1, term.src) if isinstance(term, spread.Spread) else None for _, term, _ in s.terms)
            sp = attend.spec(p1, hit[0], j, 1 + o._ragged[-1], s.alpha, coefs, spreads)
            return _apply(attend.Attention, sp, s.a, s.b, vals[1 - j], None, *_live_terms(s)), hit[0]
        sp = attend.spec(p1, hit[0], j, 1 + o._ragged[-1], s.alpha, coefs)
        terms = [term.rows() if isinstance(term, spread.Spread) else term.detach() for _, term, _ in s.terms]
        return _apply(attend.Attention, sp, s.a.detach(), s.b.detach(), vals[1 - j], t.x, *terms), hit[0]
    return None


def _same_rows(o: Any, plan: _Plan) -> bool:
    meta = plan.structure[3]
    if o._meta is meta:
        return True
    hs = o._meta.host_sizes
    return hs is not None and meta.host_sizes is not None and torch.equal(hs, meta.host_sizes)


_softmax_kernels.DEFER.append(softmax)  # the bucketed softmax asks here first


def spread_shift(func, args, kwargs, inplace: bool):
    """``scores + y`` (or ``scores += y``, ``-``) on NestedTensors when the scores' rows are
    pending and ``y`` broadcasts onto them (:mod:`padless.ops.pairs.spread`): the recipe takes
    ``y`` itself, not ``y`` read onto the scores' rows. The result's values (pending, the
    scores' structure), ``args[0]`` when in place; None when this does not apply."""
    if len(args) != 2 or set(kwargs) - {"alpha"}:
        return None
    x, y = args
    th = _affine(getattr(x, "_values", None))
    if th is None or th.plan is None or not isinstance(x, NestedTensor):
        return None
    if x._ragged != th.plan.out_ragged or x.sample_dim != len(th.plan.equation.split("->")[1]) - 1:
        return None
    alpha = _number(kwargs.get("alpha", 1.0))
    if alpha is None:
        return None
    coef = alpha * (-1.0 if func in (aten.sub.Tensor, aten.sub_.Tensor) else 1.0)
    if not isinstance(y, NestedTensor):  # a dense term in padded coordinates: its windows
        y = spread.dense(x, y)
        if y is None:
            return None
        c = zero_constant(y._values) if y._values.device.type == "cpu" else None
        if c is not None:  # zero on every real position (a mask of ones): a constant
            return _add_term(x, th, torch.tensor(c, dtype=th.dtype), coef, inplace)
    if not spread.spreads(x, y):
        return None
    return _add_term(x, th, spread.Spread(y, th.plan), coef, inplace)


def _add_term(x, th: _Thunk, term: Any, coef: float, inplace: bool):
    """The recipe ``th`` plus ``coef * term``: new pending rows, or ``x``'s rows changed in place."""
    if not inplace:
        return _with_term(th, term, coef)
    th.materialize_dependents()  # as _in_place: recipes built on the old one are computed first
    th.value = th.value_version = None
    _take_recipe(th, _with_term(th, term, coef)._thunk)
    return x._values


SHIFT_HOOKS.append(spread_shift)  # the engine asks before reading a broadcast term onto the scores' rows


@implements(torch.baddbmm, torch.Tensor.baddbmm, accepts="packed operands (dense input broadcast as for +)")
def baddbmm(func, input=None, batch1=None, batch2=None, *, beta=1, alpha=1, out=None):
    """``beta * input + alpha * (batch1 @ batch2)`` per sample (attention code adds its bias
    so): the product through ``matmul`` (pending scores when its last dim is ragged), then the
    scale and the sum, which extend their recipe."""
    if out is not None:
        raise NotImplementedError("baddbmm(): out= is not supported with NestedTensor operands")
    prod = call(torch.matmul, batch1, batch2)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:  # as torch: input is ignored (its NaNs too)
        return prod
    return prod + (input if beta == 1 else input * beta)
