"""``softmax(alpha * (a . b) + sum(coef * term)) . v`` as one autograd node in padded buckets.

The node :mod:`padless.ops.pairs.pending` builds when a contraction sums the softmax dim of
pending scores. Both contractions use the first one's buckets (the second one's plan is
built on the same samples), so per bucket the scores, the terms, the softmax and the second
contraction are dense tensors of one layout: nothing is gathered between them.

Forward, per bucket: ``X = T + alpha * (A @ B)`` (``baddbmm``: ``T`` is the terms' buffer,
one gather of their sum, a large negative number at padded places, the scores added into it
in place; without terms of the scores' size, ``T`` is the key mask, a large negative number
where the softmax dim runs past each slot's extent, broadcast over the query rows),
``P = softmax(X)``, ``O = P @ V``. Query rows past a sample's end are computed and dropped:
the output's gradient is zero there, so are theirs.
Backward: ``dP = dO @ V^T``, ``dV = P^T @ dO``, ``dX = P * (dP - sum(dP * P))``,
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
from padless.ops.pairs import attend_direct, spread
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
    gemm_ready,
    result_row_shapes,
    result_rows,
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


def _key_mask(plan: _Plan, dim: int, dtype: torch.dtype, device) -> list[Tensor]:
    """Per bucket, what the softmax over ``dim`` (of a bucket's dense scores, sample order) must
    not weigh: zeros, and a large negative number where ``dim`` runs past a slot's own extent,
    shaped ``(count, 1, .., K, .., 1)`` to broadcast over the bucket's scores. Only the softmax
    dim needs it: at the other padded places (query rows past a sample's end) the rows are
    computed and dropped, and their gradients are zero (the output's gradient is zero there).
    Cached on the plan; a few numbers per slot, not a buffer as large as the scores."""
    key = ("key_mask", dim, dtype, device)
    hit = plan.cache.get(key)
    if hit is None:
        meta = plan.structure[3]
        hs = (meta.host_sizes if hasattr(meta, "host_sizes") else meta[0]).tolist()
        ragged = (dim - 1) in plan.out_ragged
        neg = torch.finfo(dtype).min
        hit = []
        for full, ids in zip(_sample_shapes(plan), plan.groups):
            ext = full[dim]
            rows = torch.zeros((len(ids), ext), dtype=dtype, device=device)
            if ragged:
                for q, s in enumerate(ids):
                    if hs[s][dim - 1] < ext:
                        rows[q, hs[s][dim - 1]:] = neg  # host ints: a fill on the device, no sync
            view = [1] * len(full)
            view[0], view[dim] = len(ids), ext
            hit.append(rows.view(view))
        plan.cache[key] = hit
    return hit


def _terms_pieces(sp: Spec, x: Tensor | None, terms: Sequence[Tensor], like: Tensor) -> tuple[list[Tensor], bool]:
    """Per bucket (sample order), what the scores add before the softmax: the terms' sum (or the
    softmax's input ``x``) with a large negative number at padded places, so those weigh 0 (the
    scores there, zeros, change nothing). Without score-sized terms it is the key mask
    (:func:`_key_mask`), broadcast; with broadcast terms (:mod:`padless.ops.pairs.spread`) a new
    buffer of the scores' size. Returns the pieces and whether they are new, full-size buffers
    (the caller may then write its scores into them)."""
    p1 = sp.p1
    neg = torch.finfo(like.dtype).min
    if x is not None:
        return _read_scores(p1, x, neg), True
    tsum = None
    for coef, t, m in zip(sp.coefs, terms, sp.spreads):
        if t.dim() == 0 or m is not None:  # a constant: the softmax does not see it; spreads: below
            continue
        u = t * coef if coef != 1.0 else t
        tsum = u if tsum is None else tsum + u
    if tsum is None:
        pieces, own = _key_mask(p1, sp.dim, like.dtype, like.device), False
    else:
        tsum = tsum.expand(p1.out_rows, *p1.out_static)
        if tsum.shape[1:] != () and not tsum.is_contiguous():
            tsum = tsum.contiguous()
        if p1.flat[-1]:  # permuted views of the rows read: laid out by the copy that adds the spreads
            return _add_spreads(sp, _read_scores(p1, tsum, neg, False), terms, False, copy=True)
        pieces, own = _read_scores(p1, tsum, neg), True
    return _add_spreads(sp, pieces, terms, own)


def _read_scores(plan: _Plan, x: Tensor, fill: float, lay_out: bool = True) -> list[Tensor]:
    """Rows of the scores' size (a term, the softmax's input) read into the buckets, one new
    contiguous buffer per bucket in sample order, ``fill`` at padded places. Read by rows
    (:func:`padless.ops.pairs.bucket_nodes.result_rows`: a pair bias ``(N_i, N_i, H)`` moves
    ``H`` features per index, its maps are ``H`` times shorter than the element maps a new
    batch would otherwise build), then laid out in sample order by one copy per bucket (not
    ``lay_out``: permuted views, for the caller's own copy)."""
    if not plan.flat[-1]:
        return _pieces(plan, read_rows(x, plan.packs[0], fill))
    buf = read_rows(x, result_rows(plan)[0], fill)
    shapes, perm = result_row_shapes(plan)
    per = math.prod(plan.out_static)
    parts = buf.split([math.prod(shape) // per for shape in shapes])
    views = [p.view(shape).permute(perm) for p, shape in zip(parts, shapes)]
    return [v.contiguous() for v in views] if lay_out else views


def _scores_rows(plan: _Plan, parts: Sequence[Tensor]) -> Tensor:
    """The scores' rows (``(T, *static)``) from per-bucket dense pieces in sample order (the
    inverse of :func:`_read_scores`: by rows where the scores' maps are element maps)."""
    if not plan.flat[-1]:
        return _to_rows(plan, parts)
    shapes, perm = result_row_shapes(plan)
    inv = layout.inverse_order(perm)
    parts = [p.view(shape).permute(inv) for p, shape in zip(parts, ([s[i] for i in perm] for s in shapes))]
    if torch.is_grad_enabled():
        parts = [p.reshape(-1, *plan.out_static) for p in parts]
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
    else:
        buf = _join(parts, plan.out_static)
    return read_rows(buf, result_rows(plan)[1], 0.0)


def _add_spreads(sp: Spec, pieces: list[Tensor], terms: Sequence[Tensor], own: bool,
                 copy: bool = False) -> tuple[list[Tensor], bool]:
    """``pieces`` plus every broadcast term, each read once into the buckets at its own size and
    added by broadcasting, into new full-size buffers unless ``own`` (``pieces`` are then written
    in place). Differentiable and out of place when a gradient is recorded (double backward).
    ``copy``: ``pieces`` are full-size views to copy into new buffers (the copy adds the spreads)."""
    adds: list[Tensor] | None = None
    for coef, t, m in zip(sp.coefs, terms, sp.spreads):
        if m is None:
            continue
        parts = spread.read(m, t if coef == 1.0 else t * coef)
        adds = parts if adds is None else [a + p for a, p in zip(adds, parts)]
    if adds is None:
        return ([p.contiguous() for p in pieces], True) if copy else (pieces, own)
    if torch.is_grad_enabled():  # double backward
        return [p + a for p, a in zip(pieces, adds)], copy
    if own:
        return [p.add_(a) for p, a in zip(pieces, adds)], True
    out = []
    for p, a, shape in zip(pieces, adds, _sample_shapes(sp.p1)):
        dst = p.new_empty(shape)
        out.append(torch.add(p.expand(shape), a.expand(shape), out=dst))
    return out, True


def _sample_shapes(plan: _Plan) -> list[list[int]]:
    """Per bucket, the shape of its dense result in sample order."""
    inv = layout.inverse_order(plan.out_perm)
    return [[shape[i] for i in inv] for shape in plan.out_shapes]


def _gather_in(plan: _Plan, j: int, v: Tensor) -> Tensor:
    return read_rows(_flatten(v, plan.flat[j]), plan.pads[j][0], 0.0)


# ---------------------------------------------------------------------------- generic path


def _attend(sp: Spec, a, b, v, x, terms):
    """The forward in buckets, any equations: the packed result and, per bucket, the weights,
    ``v``'s dense piece and the scores' operands. From the recipe (``a``, ``b``, ``terms``),
    or, given ``x`` (double backward of the node from the softmax's input), from ``x``."""
    p1, p2, j = sp.p1, sp.p2, sp.j
    tb, _ = _terms_pieces(sp, x, terms, v)
    scores = None if x is not None else _dense(p1, [_gather_in(p1, 0, a), _gather_in(p1, 1, b)])
    vs = _operand_pieces(p2, 1 - j, _gather_in(p2, 1 - j, v))
    weights, outs = [], []
    for k, tk in enumerate(tb):
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
    rows = _scores_rows(p1, dx_parts) if _need_rows(sp, need) else None
    return da, db, dv, rows, dx_parts


# ---------------------------------------------------------------------------- fast path


def _compose(perm: Sequence[int] | None, then: Sequence[int]) -> list[int]:
    """``x.permute(perm).permute(then)`` as one permutation of ``x``."""
    return list(then) if perm is None else [perm[i] for i in then]


class _Fast:
    """Per bucket, how every operand's buffer piece views as the 3-d operand of a ``bmm``
    (``(batch, m, k)``), and how each 3-d result views back (module docstring)."""

    __slots__ = ("a", "b", "v", "t", "o", "da", "db", "dv", "dt", "nb")

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
        fast.nb = nb1  # batch letters of the scores (the slot first)
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
                if lead is not None:
                    mid, rest = math.prod(formed[nb:nb + lead]), math.prod(formed[nb + lead:])
                else:
                    mid, rest = math.prod(formed[nb:len(formed) - tail]), math.prod(formed[len(formed) - tail:])
                # the last extent as its own product, not total // (bt * mid): a bucket of empty
                # samples (L = 0) has no element, and its (bt, 0, d) operands must still view
                store.append((shape, _compose(perm, form_perm), (bt, mid, rest)))
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
    return gemm_ready(piece.view(shape).permute(comp).reshape(dims))


def _fast_mask(sp: Spec, k: int, mask: Tensor) -> Tensor:
    """Bucket ``k``'s key mask (:func:`_key_mask`, sample order) as the ``(batch, 1, n)`` input of
    its ``baddbmm`` (the softmax dim is the ``n`` of the fast form), cached on the plan."""
    key = ("fast_mask", sp.dim, k, mask.dtype, mask.device)
    hit = sp.p1.cache.get(key)
    if hit is None:
        bt, _, nt = sp.fast.t[k]
        full = list(mask.shape)
        nb = sp.fast.nb
        full[1:nb] = _sample_shapes(sp.p1)[k][1:nb]  # the batch letters (the m letters stay 1)
        hit = sp.p1.cache[key] = mask.expand(full).reshape(bt, 1, nt)
    return hit


def _attend_fast(sp: Spec, a, b, v, terms):
    p1, p2, f = sp.p1, sp.p2, sp.fast
    tp, own = _terms_pieces(sp, None, terms, v)
    direct = _directs(sp, a, b, v)
    if direct is not None:  # straight into the matmul layout and back (attend_direct)
        a3s, b3s, v3s = (d.read(x) for d, x in zip(direct, (a, b, v)))
        buf, o3s = direct[3].grad_buffer(v)
    else:
        ap = _gather_in(p1, 0, a).split(p1.splits[0])
        bp = _gather_in(p1, 1, b).split(p1.splits[1])
        vp = _gather_in(p2, 1, v).split(p2.splits[1])
        a3s = [_three(ap[k], f.a[k]) for k in range(len(f.t))]
        b3s = [_three(bp[k], f.b[k]) for k in range(len(f.t))]
        v3s = [_three(vp[k], f.v[k]) for k in range(len(f.t))]
    saved, outs = [], []
    for k in range(len(f.t)):
        a3, b3, v3 = a3s[k], b3s[k], v3s[k]
        if own:  # a new buffer of the terms: the scores are added into it in place
            x3 = tp[k].view(f.t[k]).baddbmm_(a3, b3, alpha=sp.alpha)
        else:  # the key mask, broadcast over the query rows
            x3 = torch.baddbmm(_fast_mask(sp, k, tp[k]), a3, b3, alpha=sp.alpha)
        p3 = x3.softmax(-1)
        saved.append((a3, b3, v3, p3))
        if direct is not None:
            _bmm_into(o3s[k], direct[3].trans, p3, v3)
            continue
        o_full, perm = f.o[k]
        outs.append(torch.bmm(p3, v3).view(o_full).permute(perm))
    if direct is not None:
        return direct[3].back(buf, (p2.out_rows, *p2.out_static)), saved
    return _to_rows(p2, outs, perm=False), saved


def _directs(sp: Spec, a: Tensor, b: Tensor, v: Tensor) -> tuple | None:
    """The unit maps of ``a``, ``b`` and ``v`` (:mod:`padless.ops.pairs.attend_direct`), cached on
    the scores' plan by the operands' row shapes; None when one of them does not take them."""
    if not attend_direct.ENABLED:
        return None
    p1, p2, f = sp.p1, sp.p2, sp.fast
    key = ("direct", a.shape[1:], b.shape[1:], v.shape[1:])
    hit = p1.cache.get(key, _NONE)
    if hit is _NONE:
        hit = None
        if not (p1.flat[0] or p1.flat[1] or p2.flat[1] or p2.flat[-1]):  # row maps only
            hit = tuple(attend_direct.build(plan.pads[q], plan.splits[q], views, tuple(x.shape[1:]))
                        for plan, q, views, x in ((p1, 0, f.a, a), (p1, 1, f.b, b), (p2, 1, f.v, v)))
            # the result (and its gradient): (batch, m, n) of every bucket <-> the result's rows
            outs = [(shape, layout.inverse_order(perm), (t[0], t[1], fv[2][2]))
                    for shape, (_, perm), t, fv in zip(p2.out_shapes, f.o, f.t, f.v)]
            hit = (*hit, attend_direct.build((p2.packs[0], p2.packs[1]), [math.prod(o[0]) // max(math.prod(p2.out_static), 1) for o in outs],
                                             outs, tuple(p2.out_static)))
            hit = None if any(d is None for d in hit) else hit
        p1.cache[key] = hit
    return hit


_NONE = object()


def _backward_fast(ctx, sp: Spec, a, b, v, terms, g, need):
    p1, p2, f = sp.p1, sp.p2, sp.fast
    direct = _directs(sp, a, b, v)
    if direct is not None:
        return _backward_direct(ctx, sp, direct, a, b, v, direct[3].read(g), need)
    gp = read_rows(_flatten(g.contiguous(), p2.flat[-1]), p2.packs[0], 0.0)
    per = 1 if p2.flat[-1] else math.prod(p2.out_static)
    gparts = gp.split([math.prod(s) // per for s in p2.out_shapes])
    da, db, dv, dx = [], [], [], []
    for k, (a3, b3, v3, p3) in enumerate(ctx.saved):
        perm = f.o[k][1]
        g3 = gemm_ready(gparts[k].view(p2.out_shapes[k]).permute(layout.inverse_order(perm)).reshape(p3.shape[0], p3.shape[1], v3.shape[2]))
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
    rows = _scores_rows(p1, dx) if _need_rows(sp, need) else None
    return (gather_back(p1, 0, da, a) if da else None, gather_back(p1, 1, db, b) if db else None,
            gather_back(p2, 1, dv, v) if dv else None, rows, dx)


def _backward_direct(ctx, sp: Spec, direct, a, b, v, g3s, need):
    """:func:`_backward_fast` with the operands' gradients written by the ``bmm`` of every bucket
    into one buffer each, in the gathered layout, and read back to rows by one
    ``index_select`` each (:mod:`padless.ops.pairs.attend_direct`)."""
    p1, p2, f = sp.p1, sp.p2, sp.fast
    bufs = [d.grad_buffer(x) if n else (None, None) for d, x, n in zip(direct, (a, b, v), (need[1], need[2], need[3]))]
    dx = []
    for k, (a3, b3, v3, p3) in enumerate(ctx.saved):
        g3 = g3s[k]
        if need[3]:
            _bmm_into(bufs[2][1][k], direct[2].trans, p3.transpose(1, 2), g3)
        d3 = torch._softmax_backward_data(torch.bmm(g3, v3.transpose(1, 2)), p3, 2, p3.dtype)
        dx.append(d3)
        if need[1]:
            _bmm_into(bufs[0][1][k], direct[0].trans, d3, b3.transpose(1, 2))
        if need[2]:
            _bmm_into(bufs[1][1][k], direct[1].trans, a3.transpose(1, 2), d3)
    grads = []
    for q, (d, x, (buf, _)) in enumerate(zip(direct, (a, b, v), bufs)):
        if buf is not None and q < 2 and sp.alpha != 1.0:
            buf.mul_(sp.alpha)
        grads.append(d.back(buf, x) if buf is not None else None)
    dx = [d.view(s) for d, s in zip(dx, f.dt)]
    rows = _scores_rows(p1, dx) if _need_rows(sp, need) else None
    return (*grads, rows, dx)


def _bmm_into(out: Tensor, trans: bool, x: Tensor, y: Tensor) -> None:
    """``x @ y`` written into ``out`` (``(x @ y)^T = y^T @ x^T`` when ``trans``)."""
    if trans:
        torch.bmm(y.transpose(1, 2), x.transpose(1, 2), out=out)
    else:
        torch.bmm(x, y, out=out)


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
        ctx.save_for_backward(a, b, v, x)
        # the terms are not saved tensors: the backward needs only their shapes, as torch's own
        # ``scores + bias`` keeps no bias (a write to a mask after the forward must not fail the
        # backward); only the double backward reads them again, and checks they are unchanged
        ctx.terms = terms
        ctx.term_versions = tuple(None if t.is_inference() else t._version for t in terms)
        if sp.fast is not None:
            out, ctx.saved = _attend_fast(sp, a, b, v, terms)
        else:
            out, ctx.weights, ctx.vs, ctx.scores = _attend(sp, a, b, v, None, terms)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        sp = ctx.sp
        a, b, v, x = ctx.saved_tensors
        terms = ctx.terms
        need = ctx.needs_input_grad
        inputs = (a, b, v, x, *terms)
        if torch.is_grad_enabled():  # double backward: the forward again, differentiable
            _check_terms(ctx)
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


def _check_terms(ctx) -> None:
    """The double backward recomputes the forward from the terms: refuse one written in place
    since (autograd's own error for a saved tensor)."""
    for k, (t, version) in enumerate(zip(ctx.terms, ctx.term_versions)):
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"term {k} added to the attention scores (shape {tuple(t.shape)}) is at version {t._version}; "
                f"expected version {version} instead. padless's fused attention recomputes its forward for a "
                "double backward; change the term out of place, or after the backward"
            )
