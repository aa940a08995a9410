"""``softmax(alpha * (a . b) + sum(coef * term)) . v`` as one autograd node in padded buckets.

The node :mod:`padless.ops.pairs.pending` builds when a contraction sums the softmax dim of
pending scores. Both contractions use the first one's buckets (the second one's plan is
built on the same samples), so per bucket the scores, the terms, the softmax and the second
contraction are dense tensors of one layout: nothing is gathered between them.

Forward, per bucket: ``X = T + alpha * (A @ B)`` (``baddbmm``: ``T`` is the terms' buffer,
one gather of their sum, a large negative number at padded places), ``P = softmax(X)``,
``O = P @ V``. Backward: ``dP = dO @ V^T``, ``dV = P^T @ dO``, ``dX = P * (dP - sum(dP * P))``,
``dA = alpha * dX @ B^T``, ``dB = alpha * A^T @ dX``, and every term's gradient is ``coef *
dX`` gathered once to the scores' rows (summed to the term's shape). Every operand goes in
once and every result out once.

When both contractions are batched matmuls of the usual form (the scores' letters are
``batch, m, n`` in that order, the softmax over ``n``, the weights the left operand of the
second one summing ``n``: ``bihd,bjhd->bhij`` then ``bhij,bjhd->bihd``, or ``q @ k^T`` then
``@ v``), each bucket is a handful of 3-d calls (:class:`_Fast`); other equations run through
the generic dense einsum of :mod:`padless.ops.pairs.bucket_nodes`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from padless.ops.kernels.layout import read_rows
from padless.ops.pairs import spread
from padless.ops.pairs.bucket_nodes import (
    _BATCH,
    _dense,
    _einsum,
    _flatten,
    _join,
    _matmul_form,
    _packed,
    _Plan,
    gather_back,
)
from padless.tensor import layout


class Spec:
    """What one fused attention needs besides its tensors: the scores' plan ``p1``, the
    second contraction's plan ``p2`` on the same buckets, the weights' operand position
    ``j`` in it, the softmax dim (of a bucket's dense scores), the scale and the terms'
    coefficients, and the fast per-bucket layout when it applies. ``spreads``: per term, its
    bucket maps when it is a broadcast term kept at its size (:mod:`padless.ops.pairs.spread`:
    the term is then that NestedTensor's rows), else None."""

    __slots__ = ("p1", "p2", "j", "dim", "alpha", "coefs", "fast", "spreads")

    def __init__(self, p1: _Plan, p2: _Plan, j: int, dim: int, alpha: float, coefs: tuple, fast,
                 spreads: tuple = ()) -> None:
        self.p1, self.p2, self.j, self.dim, self.alpha, self.coefs, self.fast = p1, p2, j, dim, alpha, coefs, fast
        self.spreads = spreads if any(m is not None for m in spreads) else (None,) * len(coefs)


def spec(p1: _Plan, p2: _Plan, j: int, dim: int, alpha: float, coefs: tuple, spreads: tuple = ()) -> Spec:
    key = ("fast", id(p2), j, dim)
    if key not in p1.cache:
        p1.cache[key] = (_Fast.build(p1, p2, j, dim), p2)
    return Spec(p1, p2, j, dim, alpha, coefs, p1.cache[key][0], spreads)


def _pieces(plan: _Plan, buf: Tensor) -> list[Tensor]:
    """A buffer laid out like ``plan``'s result, as one dense tensor per bucket (sample order)."""
    per = 1 if plan.flat[-1] else math.prod(plan.out_static)
    inv = layout.inverse_order(plan.out_perm)
    parts = buf.split([math.prod(shape) // per for shape in plan.out_shapes])
    return [p.view(shape).permute(inv) for p, shape in zip(parts, plan.out_shapes)]


def _operand_pieces(plan: _Plan, j: int, buf: Tensor) -> list[Tensor]:
    out = []
    for k, piece in enumerate(buf.split(plan.splits[j])):
        shape, perm = plan.views[k][j]
        x = piece.view(shape)
        out.append(x.permute(perm) if perm is not None else x)
    return out


def _to_rows(plan: _Plan, parts: Sequence[Tensor], perm: bool = True) -> Tensor:
    """Per-bucket dense results (sample order; storage order when not ``perm``) as the
    result's packed rows."""
    if perm:
        parts = [p.permute(plan.out_perm) for p in parts]
    static = () if plan.flat[-1] else plan.out_static
    if torch.is_grad_enabled():
        parts = [p.reshape(-1, *static) for p in parts]
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
    else:
        buf = _join(parts, static)
    return _packed(plan, buf)


def _neg_pad(plan: _Plan, dtype: torch.dtype, device) -> Tensor:
    """The scores' bucket buffer of zeros with a large negative number at padded places (made
    from every sample's extents, one fill per sample: no element maps)."""
    key = ("neg_pad", dtype, device)
    hit = plan.cache.get(key)
    if hit is None:
        per = 1 if plan.flat[-1] else math.prod(plan.out_static)
        rows = sum(math.prod(shape) for shape in plan.out_shapes) // per
        buf = torch.full((rows,) if plan.flat[-1] else (rows, *plan.out_static), torch.finfo(dtype).min,
                         dtype=dtype, device=device)
        meta = plan.structure[3]
        hs = (meta.host_sizes if hasattr(meta, "host_sizes") else meta[0]).tolist()
        env = plan.structure[2]
        for piece, ids in zip(_pieces(plan, buf), plan.groups):
            for q, s in enumerate(ids):
                ext = [hs[s][d] if d in plan.out_ragged else int(env[d]) for d in range(len(hs[s]))]
                piece[(q, *(slice(0, e) for e in ext))] = 0
        hit = plan.cache[key] = buf
    return hit


def _terms_buffer(sp: Spec, x: Tensor | None, terms: Sequence[Tensor], like: Tensor) -> Tensor:
    """The terms' sum (or the softmax's input ``x``) in the scores' buckets, padded places a
    large negative number (so they weigh 0 and the scores there, zeros, change nothing)."""
    p1 = sp.p1
    neg = torch.finfo(like.dtype).min
    if x is not None:
        return read_rows(_flatten(x, p1.flat[-1]), p1.packs[0], neg)
    tsum = None
    for coef, t, m in zip(sp.coefs, terms, sp.spreads):
        if t.dim() == 0 or m is not None:  # a constant: the softmax does not see it; spreads: below
            continue
        u = t * coef if coef != 1.0 else t
        tsum = u if tsum is None else tsum + u
    if tsum is None:
        buf = _neg_pad(p1, like.dtype, like.device)
    else:
        tsum = tsum.expand(p1.out_rows, *p1.out_static)
        if tsum.shape[1:] != () and not tsum.is_contiguous():
            tsum = tsum.contiguous()
        buf = read_rows(_flatten(tsum, p1.flat[-1]), p1.packs[0], neg)
    return _add_spreads(sp, buf, terms, own=tsum is not None)


def _add_spreads(sp: Spec, buf: Tensor, terms: Sequence[Tensor], own: bool) -> Tensor:
    """``buf`` (the scores' buckets) plus every broadcast term, each read once into the buckets
    at its own size and added by broadcasting (``own``: ``buf`` may be written in place)."""
    adds: list[Tensor] | None = None
    for coef, t, m in zip(sp.coefs, terms, sp.spreads):
        if m is None:
            continue
        parts = spread.read(m, t if coef == 1.0 else t * coef)
        adds = parts if adds is None else [a + p for a, p in zip(adds, parts)]
    if adds is None:
        return buf
    if torch.is_grad_enabled():  # double backward: differentiable, out of place
        return _bucket_buffer(sp.p1, [p + a for p, a in zip(_pieces(sp.p1, buf), adds)])
    out = buf if own else torch.empty_like(buf)
    for src, dst, a in zip(_pieces(sp.p1, buf), _pieces(sp.p1, out), adds):
        torch.add(src, a, out=dst)
    return out


def _bucket_buffer(plan: _Plan, parts: Sequence[Tensor]) -> Tensor:
    """Per-bucket dense results (sample order) as one buffer in the buckets' layout (the
    inverse of :func:`_pieces`)."""
    static = () if plan.flat[-1] else plan.out_static
    parts = [p.permute(plan.out_perm).reshape(-1, *static) for p in parts]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _gather_in(plan: _Plan, j: int, v: Tensor) -> Tensor:
    return read_rows(_flatten(v, plan.flat[j]), plan.pads[j][0], 0.0)


# ---------------------------------------------------------------------------- generic path


def _attend(sp: Spec, a, b, v, x, terms):
    """The forward in buckets, any equations: the packed result and, per bucket, the weights,
    ``v``'s dense piece and the scores' operands. From the recipe (``a``, ``b``, ``terms``),
    or, given ``x`` (double backward of the node from the softmax's input), from ``x``."""
    p1, p2, j = sp.p1, sp.p2, sp.j
    tb = _terms_buffer(sp, x, terms, v)
    scores = None if x is not None else _dense(p1, [_gather_in(p1, 0, a), _gather_in(p1, 1, b)])
    vs = _operand_pieces(p2, 1 - j, _gather_in(p2, 1 - j, v))
    weights, outs = [], []
    for k, tk in enumerate(_pieces(p1, tb)):
        xk = tk if scores is None else torch.add(tk, _einsum(p1.equation, *scores[k]), alpha=sp.alpha)
        pk = xk.softmax(sp.dim)
        weights.append(pk)
        outs.append(_einsum(p2.equation, *((pk, vs[k]) if j == 0 else (vs[k], pk))))
    return _to_rows(p2, outs), weights, vs, scores


def _backward_generic(ctx, sp: Spec, a, b, v, x, terms, g, need):
    p1, p2, j = sp.p1, sp.p2, sp.j
    gb = read_rows(_flatten(g.contiguous(), p2.flat[-1]), p2.packs[0], 0.0)
    dv_parts, dx_parts = [], []
    for k, gk in enumerate(_pieces(p2, gb)):
        pk, vk = ctx.weights[k], ctx.vs[k]
        dp = _einsum(p2.grad_equations[j], gk, vk)
        if need[3]:
            dv = _einsum(p2.grad_equations[1 - j], gk, pk)
            _, perm = p2.views[k][1 - j]
            dv_parts.append(dv.permute(layout.inverse_order(perm)) if perm is not None else dv)
        dx_parts.append(torch._softmax_backward_data(dp.contiguous(), pk, sp.dim, pk.dtype))
    dv = gather_back(p2, 1 - j, dv_parts, v) if need[3] else None
    da = db = None
    if x is None and (need[1] or need[2]):
        grads: list[list[Tensor]] = [[], []]
        for k, dk in enumerate(dx_parts):
            for q in (0, 1):
                if need[1 + q]:
                    gq = _einsum(p1.grad_equations[q], dk, ctx.scores[k][1 - q])
                    if sp.alpha != 1.0:
                        gq = gq * sp.alpha
                    _, perm = p1.views[k][q]
                    grads[q].append(gq.permute(layout.inverse_order(perm)) if perm is not None else gq)
        da = gather_back(p1, 0, grads[0], a) if grads[0] else None
        db = gather_back(p1, 1, grads[1], b) if grads[1] else None
    rows = _to_rows(p1, dx_parts) if _need_rows(sp, need) else None
    return da, db, dv, rows, dx_parts


# ---------------------------------------------------------------------------- fast path


def _compose(perm: Sequence[int] | None, then: Sequence[int]) -> list[int]:
    """``x.permute(perm).permute(then)`` as one permutation of ``x``."""
    return list(then) if perm is None else [perm[i] for i in then]


class _Fast:
    """Per bucket, how every operand's buffer piece views as the 3-d operand of a ``bmm``
    (``(batch, m, k)``), and how each 3-d result views back (module docstring)."""

    __slots__ = ("a", "b", "v", "t", "o", "da", "db", "dv", "dt")

    @staticmethod
    def build(p1: _Plan, p2: _Plan, j: int, dim: int) -> _Fast | None:
        f1, f2 = _matmul_form(p1.equation), _matmul_form(p2.equation)
        if f1 is None or f2 is None or j != 0 or not p1.flat[-1]:
            return None
        pa1, pb1, nb1, nm1, nn1, po1 = f1
        pa2, pb2, nb2, nm2, nn2, po2 = f2
        n_out1 = len(po1)
        if po1 != list(range(n_out1)) or nn1 != 1 or dim != n_out1 - 1:
            return None  # scores not (batch, m, n) with the softmax over n
        if pa2 != list(range(len(pa2))) or nb2 != nb1 or nm2 != nm1:
            return None  # the weights not read as (batch, m, n) with n summed
        fast = _Fast()
        fast.a, fast.b, fast.v, fast.t, fast.o = [], [], [], [], []
        fast.da, fast.db, fast.dv, fast.dt = [], [], [], []
        for k in range(len(p1.buckets)):
            out_shape = p1.out_shapes[k]  # sample order (flat)
            bt = math.prod(out_shape[:nb1])
            mm = math.prod(out_shape[nb1:nb1 + nm1])
            nt = math.prod(out_shape[nb1 + nm1:])
            for plan, q, form_perm, nb, lead, tail, store, grad in (
                    (p1, 0, pa1, nb1, nm1, None, fast.a, fast.da), (p1, 1, pb1, nb1, None, nn1, fast.b, fast.db),
                    (p2, 1, pb2, nb2, None, nn2, fast.v, fast.dv)):
                shape, perm = plan.views[k][q]
                sample = [shape[p] for p in perm] if perm is not None else list(shape)
                formed = [sample[p] for p in form_perm]
                # (batch, m, k) for a left operand (``lead`` m letters), (batch, k, n) for a right one
                mid = math.prod(formed[nb:nb + lead]) if lead is not None else math.prod(formed[nb:len(formed) - tail])
                store.append((shape, _compose(perm, form_perm), (bt, mid, math.prod(formed) // (bt * mid))))
                # the gradient (same form) back to the piece's storage order
                inv_form = layout.inverse_order(form_perm)
                grad.append((formed, inv_form if perm is None else [inv_form[i] for i in layout.inverse_order(perm)]))
            fast.t.append((bt, mm, nt))
            # the result (batch, m, n2) -> its storage order
            count, ext = p2.buckets[k]
            o_full = [count if c == _BATCH else ext[c] for c in _form_letters(p2.equation)]
            fast.o.append((o_full, _compose(po2, p2.out_perm)))
            fast.dt.append(out_shape)
        return fast


def _form_letters(equation: str) -> list[str]:
    """The letters of a matmul-form result ``(batch, m, n)`` of ``equation``."""
    lhs, out = equation.split("->")
    a, b = lhs.split(",")
    batch = [c for c in out if c in a and c in b]
    return batch + [c for c in out if c in a and c not in b] + [c for c in out if c in b and c not in a]


def _three(piece: Tensor, view) -> Tensor:
    shape, comp, dims = view
    return piece.view(shape).permute(comp).reshape(dims)


def _attend_fast(sp: Spec, a, b, v, terms):
    p1, p2, f = sp.p1, sp.p2, sp.fast
    tb = _terms_buffer(sp, None, terms, v)
    ap = _gather_in(p1, 0, a).split(p1.splits[0])
    bp = _gather_in(p1, 1, b).split(p1.splits[1])
    vp = _gather_in(p2, 1, v).split(p2.splits[1])
    tp = tb.split([math.prod(d) for d in f.t])
    saved, outs = [], []
    for k in range(len(f.t)):
        a3, b3, v3 = _three(ap[k], f.a[k]), _three(bp[k], f.b[k]), _three(vp[k], f.v[k])
        p3 = torch.baddbmm(tp[k].view(f.t[k]), a3, b3, alpha=sp.alpha).softmax(-1)
        saved.append((a3, b3, v3, p3))
        o_full, perm = f.o[k]
        outs.append(torch.bmm(p3, v3).view(o_full).permute(perm))
    return _to_rows(p2, outs, perm=False), saved


def _backward_fast(ctx, sp: Spec, a, b, v, terms, g, need):
    p1, p2, f = sp.p1, sp.p2, sp.fast
    gp = read_rows(_flatten(g.contiguous(), p2.flat[-1]), p2.packs[0], 0.0)
    per = 1 if p2.flat[-1] else math.prod(p2.out_static)
    gparts = gp.split([math.prod(s) // per for s in p2.out_shapes])
    da, db, dv, dx = [], [], [], []
    for k, (a3, b3, v3, p3) in enumerate(ctx.saved):
        perm = f.o[k][1]
        g3 = gparts[k].view(p2.out_shapes[k]).permute(layout.inverse_order(perm)).reshape(p3.shape[0], p3.shape[1], -1)
        if need[3]:
            formed, back = f.dv[k]
            dv.append(torch.bmm(p3.transpose(1, 2), g3).view(formed).permute(back))
        d3 = torch._softmax_backward_data(torch.bmm(g3, v3.transpose(1, 2)), p3, 2, p3.dtype)
        dx.append(d3)
        if need[1]:
            formed, back = f.da[k]
            ga = torch.bmm(d3, b3.transpose(1, 2))
            da.append((ga.mul_(sp.alpha) if sp.alpha != 1.0 else ga).view(formed).permute(back))
        if need[2]:
            formed, back = f.db[k]
            gb = torch.bmm(a3.transpose(1, 2), d3)
            db.append((gb.mul_(sp.alpha) if sp.alpha != 1.0 else gb).view(formed).permute(back))
    dx = [d.view(s) for d, s in zip(dx, f.dt)]
    rows = _to_rows(p1, dx, perm=False) if _need_rows(sp, need) else None
    return (gather_back(p1, 0, da, a) if da else None, gather_back(p1, 1, db, b) if db else None,
            gather_back(p2, 1, dv, v) if dv else None, rows, dx)


def _need_rows(sp: Spec, need: Sequence[bool]) -> bool:
    """Whether the scores' gradient is needed as rows: for ``x`` or a term read on their rows."""
    return need[4] or any(n and m is None for n, m in zip(need[5:], sp.spreads))


# ---------------------------------------------------------------------------- the node


class Attention(torch.autograd.Function):
    """``softmax(alpha * (a . b) + sum(coef * term)) . v`` in the first contraction's buckets
    (module docstring). ``x``: the softmax's input, given when a term's history is unknown:
    the forward still runs from the recipe (``a``, ``b`` and the terms, detached), the
    backward hands ``x`` its gradient. Double backward recomputes the forward with
    differentiable ops (from ``x`` when given)."""

    @staticmethod
    def forward(ctx, sp: Spec, a, b, v, x, *terms):
        ctx.sp = sp
        ctx.save_for_backward(a, b, v, x, *terms)
        if sp.fast is not None:
            out, ctx.saved = _attend_fast(sp, a, b, v, terms)
        else:
            out, ctx.weights, ctx.vs, ctx.scores = _attend(sp, a, b, v, None, terms)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        sp = ctx.sp
        a, b, v, x, *terms = ctx.saved_tensors
        need = ctx.needs_input_grad
        inputs = (a, b, v, x, *terms)
        if torch.is_grad_enabled():  # double backward: the forward again, differentiable
            want = [t for t, n in zip(inputs, need[1:]) if t is not None and n]
            out = _attend(sp, a, b, v, x, terms)[0]
            got = iter(torch.autograd.grad(out, want, g, create_graph=True, allow_unused=True))
            return (None, *[next(got) if t is not None and n else None for t, n in zip(inputs, need[1:])])
        if sp.fast is not None:
            da, db, dv, rows, dparts = _backward_fast(ctx, sp, a, b, v, terms, g, need)
        else:
            da, db, dv, rows, dparts = _backward_generic(ctx, sp, a, b, v, x, terms, g, need)
        dx = rows.view(x.shape) if need[4] else None
        dterms = []
        for coef, t, n, m in zip(sp.coefs, terms, need[5:], sp.spreads):
            if not n:
                d = None
            elif m is not None:  # a broadcast term at its size: summed in the buckets, read back
                d = spread.grad(m, dparts, t)
                d = d * coef if coef != 1.0 else d
            else:
                d = (rows * coef if coef != 1.0 else rows).sum_to_size(t.shape)
            dterms.append(d)
        return (None, da, db, dv, dx, *dterms)
