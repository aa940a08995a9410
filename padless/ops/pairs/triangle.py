"""Triangle multiplication on pair states as one opaque op, so ``torch.compile`` traces it.

``einsum("bikc,bjkc->bijc", a, b)`` ("outgoing") and ``einsum("bkic,bkjc->bijc", a, b)``
("incoming") contract one pair axis of two ``(N_i, N_i, C)`` pair states. Eagerly they run
per sample (:mod:`padless.ops.pairs.contract`), slicing every sample with host offsets, which a
compiled graph cannot do. Under tracing they call ``padless::pair_einsum`` instead: a
``torch.library`` custom op over the packed rows, whose fake implementation only says
"output rows = input rows" (every pair axis of a sample has the same extent ``N_i``), and
whose real implementation runs ``torch.einsum`` on each sample's ``(N_i, N_i, *static)``
view, reading offsets and sizes as ordinary host data at run time. Its backward is the
same op with the equations of the two gradients.

Layout (rows of ``(N_i, N_i, *static)`` samples, both pair dims ragged, stored row-major)::

    a, b      (P, *static)   P = sum N_i**2 rows of both operands' pair states
    offsets   (B+1,) int64   row offsets of every sample (a's structure)
    sizes     (B, D) int64   a's sample shapes; sizes_b: b's, checked at run time
    output    (P, *static_out)
"""

from __future__ import annotations

import torch
from torch import Tensor

from padless.ops.common.structure import RAGGED, STATIC, restructure
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor, _fmt_shape
from padless.tensor.errors import StructureError


def _sample_eq(equation: str) -> tuple[str, str, str]:
    lhs, out = equation.split("->")
    x, y = lhs.split(",")
    return x, y, out


def _out_static(equation: str, a: Tensor, b: Tensor) -> list[int]:
    """Static extents of the output (letters after the two pair letters)."""
    x, y, out = _sample_eq(equation)
    ext: dict[str, int] = {}
    for letters, t in ((x, a), (y, b)):
        for c, n in zip(letters[2:], t.shape[1:]):
            ext.setdefault(c, n)
    return [ext[c] for c in out[2:]]


@torch.library.custom_op("padless::pair_einsum", mutates_args=())
def pair_einsum(equation: str, a: Tensor, b: Tensor, offsets: Tensor, sizes: Tensor, sizes_b: Tensor) -> Tensor:
    """``torch.einsum(equation, a_i, b_i)`` for every sample's pair rows (see module doc);
    ``equation`` is per sample, each operand and the output starting with two pair letters."""
    bounds = offsets.tolist()  # real (host) data: this runs at run time
    sa, sb = sizes.tolist(), sizes_b.tolist()
    for i, (u, v) in enumerate(zip(sa, sb)):
        if u[:2] != v[:2] or u[0] != u[1]:
            raise StructureError(
                f"einsum(): ragged structures differ: sample {i} has {_fmt_shape(u)}, other has {_fmt_shape(v)} "
                "(triangle products take two (N_i, N_i, ...) pair states of one structure)"
            )
    x, y, o = _sample_eq(equation)
    plan = _bmm_plan(x, y, o) if a.dim() == b.dim() == 2 and a.dtype == b.dtype else None
    if plan is not None:  # channel-major batched matmuls (as eagerly)
        return _bmm_rows(a, b, [u[0] for u in sa], plan)
    out = a.new_empty((a.shape[0], *_out_static(equation, a, b)))
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        n = sa[i][0]
        ai = a[lo:hi].reshape(n, n, *a.shape[1:])
        bi = b[lo:hi].reshape(n, n, *b.shape[1:])
        out[lo:hi] = torch.einsum(equation, ai, bi).reshape(hi - lo, *out.shape[1:])
    return out


@pair_einsum.register_fake
def _pair_einsum_fake(equation: str, a: Tensor, b: Tensor, offsets: Tensor, sizes: Tensor, sizes_b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], *_out_static(equation, a, b)))


def _grad_equations(equation: str) -> tuple[str, str]:
    x, y, out = _sample_eq(equation)
    return f"{out},{y}->{x}", f"{out},{x}->{y}"


def _setup(ctx, inputs, output) -> None:
    equation, a, b, offsets, sizes, sizes_b = inputs
    ctx.equation = equation
    ctx.save_for_backward(a, b, offsets, sizes, sizes_b)


def _backward(ctx, grad: Tensor):
    a, b, offsets, sizes, sizes_b = ctx.saved_tensors
    eq_a, eq_b = _grad_equations(ctx.equation)
    grad = grad.contiguous()
    ga = pair_einsum(eq_a, grad, b, offsets, sizes, sizes_b) if ctx.needs_input_grad[1] else None
    gb = pair_einsum(eq_b, grad, a, offsets, sizes, sizes_b) if ctx.needs_input_grad[2] else None
    return None, ga, gb, None, None, None


pair_einsum.register_autograd(_backward, setup_context=_setup)


def _fits(x: str, y: str, out: str) -> bool:
    """Both operands and the output lead with two pair letters of one three-letter set, the
    rest are static letters, and every operand letter reaches the output or the other
    operand (so the gradients are einsums of the same form)."""
    pair = set(x[:2]) | set(y[:2]) | set(out[:2])
    if len(pair) != 3 or any(len(set(s[:2])) != 2 for s in (x, y, out)):
        return False
    static = set(x[2:]) | set(y[2:]) | set(out[2:])
    if static & pair or len(set(x)) != len(x) or len(set(y)) != len(y) or len(set(out)) != len(out):
        return False
    return all(c in out or c in other for s, other in ((x, y), (y, x)) for c in s)


def traced_pair_einsum(ins: list[str], out: str, operands) -> NestedTensor | None:
    """``einsum`` of two pair states under tracing through ``padless::pair_einsum`` (None
    when the equation or the operands are not a triangle-style product of pair states)."""
    if len(operands) != 2:
        return None
    a, b = operands
    x, y, o = ins[0][1:], ins[1][1:], out[1:]
    if a._ragged != (0, 1) or b._ragged != (0, 1) or not _fits(x, y, o):
        return None
    if not len(x) == len(y) == len(o) == a.sample_dim == b.sample_dim:
        return None  # the output keeps a's layout: same rank, pair dims first
    eq = f"{x},{y}->{o}"
    vals = pair_einsum(eq, values_of(a).contiguous(), values_of(b).contiguous(), a._offsets, a._sizes, b._sizes)
    return rewrap(vals, a)


# ---------------------------------------------------------------------------- eager


def _square_pairs(a: NestedTensor, b: NestedTensor) -> list[int] | None:
    """Every sample's ``N_i`` when both are pair states of one structure: three sample dims, two
    of them ragged with extent ``N_i`` (in any logical position and storage order, as a permuted
    ``(N_i, N_i, C)`` state), the same static extent; else None."""
    if len(a._ragged) != 2 or len(b._ragged) != 2 or a.sample_dim != 3 or b.sample_dim != 3:
        return None
    if a.batch_size != b.batch_size or a._values.dtype != b._values.dtype or a._values.shape[1:] != b._values.shape[1:]:
        return None
    ha = a.host_sizes()
    n = ha[:, a._ragged[0]]
    if not bool((ha[:, a._ragged[1]] == n).all()):
        return None
    if a._meta is not b._meta:
        hb = b.host_sizes()
        if not (torch.equal(hb[:, b._ragged[0]], n) and torch.equal(hb[:, b._ragged[1]], n)):
            return None
    return n.tolist()


def _bmm_plan(x: str, y: str, o: str) -> tuple[bool, bool, bool] | None:
    """Which views of the per-sample ``(C, N, N)`` channel-major operands a batched matmul
    transposes for ``x,y->o`` (two pair letters then one channel letter, shared by all three;
    one pair letter contracted), or None outside that pattern."""
    if not (len(x) == len(y) == len(o) == 3) or not (x[2] == y[2] == o[2]) or not _fits(x, y, o):
        return None
    k = [c for c in x[:2] if c in y[:2]]
    if len(k) != 1 or k[0] in o:
        return None
    k = k[0]
    fa, fb = x[1 - x.index(k)], y[1 - y.index(k)]  # the free pair letter of each operand
    if set(o[:2]) != {fa, fb}:
        return None
    return x.index(k) == 0, y.index(k) == 1, o[0] == fb


def _bmm_rows(a: Tensor, b: Tensor, ns: list[int], plan: tuple[bool, bool, bool]) -> Tensor:
    """The product of two packed pair states ``(sum N_i**2, C)`` as one batched matmul per
    sample over their channel-major copies (see :func:`eager_pair_einsum`)."""
    out = _bmm_channels(a.t().contiguous(), b.t().contiguous(), ns, plan)
    return out.t().contiguous() if out.shape[1] else a.new_empty((0, a.shape[1]))


def _mat(t: Tensor, role: str, lo: int, n: int, transposed: bool, views: dict) -> Tensor:
    """One sample's ``(C, n, n)`` matrices of the channel-major ``t`` (``(C, P)``, contiguous),
    starting at column ``lo``, transposed or not: one strided view (no ``view`` then
    ``transpose``), kept in ``views`` under ``role`` so the backward reuses the forward's."""
    key = (role, lo, transposed)
    m = views.get(key)
    if m is None:
        c, p = t.shape
        m = views[key] = t.as_strided((c, n, n), (p, 1, n) if transposed else (p, n, 1), t.storage_offset() + lo)
    return m


def _bmm_channels(at: Tensor, bt: Tensor, ns: list[int], plan: tuple[bool, bool, bool],
                  roles: tuple[str, str] = ("a", "b"), views: dict | None = None) -> Tensor:
    """:func:`_bmm_rows` on channel-major operands ``(C, sum N_i**2)``, result channel-major.

    Per sample: two strided views, one ``bmm`` and one ``view`` of its contiguous result
    (a result the equation wants transposed is computed as the product of the transposed
    operands in swapped order, so nothing is copied before the ``cat``)."""
    ta, tb, to = plan
    if to:  # (A B)^T = B^T A^T
        at, bt, ta, tb, roles = bt, at, not tb, not ta, roles[::-1]
    views = {} if views is None else views
    c = at.shape[0]
    parts, lo = [], 0
    for n in ns:
        if n:
            r = torch.bmm(_mat(at, roles[0], lo, n, ta, views), _mat(bt, roles[1], lo, n, tb, views))
            parts.append(r.view(c, n * n))
        lo += n * n
    return torch.cat(parts, 1) if parts else at.new_empty((c, 0))


def eager_pair_einsum(ins: list[str], out: str, operands) -> NestedTensor | None:
    """Triangle products of two ``(N_i, N_i, C)`` pair states (``bikc,bjkc->bijc``,
    ``bkic,bkjc->bijc`` and every other equation with two pair letters and one channel
    letter) as one batched matmul per sample over the channel-major copies of the packed rows,
    or None outside that pattern.

    The operands may be permuted pair states (OpenFold's ``a.permute(0, 3, 1, 2) @
    b.permute(0, 3, 2, 1)``, an ``(C, N_i, N_i)`` matmul): the equation is read in their storage
    order, where the channel comes last. The result is stored with its pair dims in order,
    channel last. The channel letter is the batch of every per-sample matmul: ``values.t()`` is
    made contiguous once (``(C, sum N_i**2)``), so each sample's ``(C, N_i, N_i)`` operand is a
    strided view a matmul reads without copying, and the per-sample results are joined with
    one ``cat`` and transposed back once."""
    if len(operands) != 2:
        return None
    a, b = operands
    x, y, o = ins[0][1:], ins[1][1:], out[1:]
    if not len(x) == len(y) == len(o) == 3:
        return None
    ns = _square_pairs(a, b)
    if ns is None:
        return None
    static = [d for d in range(3) if d not in a._ragged][0]
    ch = x[static]
    if ch not in o:
        return None
    pair_pos = [d for d in range(3) if o[d] != ch]  # the result's pair dims, stored in this order
    eq = ("".join(x[d] for d in a.storage_order), "".join(y[d] for d in b.storage_order),
          "".join(o[d] for d in pair_pos) + ch)
    if any(_bmm_plan(*e) is None for e in (eq, (eq[2], eq[1], eq[0]), (eq[2], eq[0], eq[1]))):
        return None
    vals = _PairProduct.apply(values_of(a), values_of(b), tuple(ns), eq)
    if a._ragged == tuple(pair_pos) and o.index(ch) == static:
        return rewrap(vals, a)  # the result is laid out as a
    dims = [(STATIC, a._values.shape[1]) if c == ch else (RAGGED, a._ragged[0]) for c in o]
    dims[pair_pos[1]] = (RAGGED, a._ragged[1])
    return restructure(a, vals, dims, pair_pos)


class _PairProduct(torch.autograd.Function):
    """:func:`_bmm_rows` as one autograd node whose gradients are products of the same form
    (``out,y->x`` and ``out,x->y``), so each runs on channel-major copies too. Plain autograd
    through the batched matmuls would hand them gradients viewed through the output's
    transpose (batch stride 1), which torch's CPU ``bmm`` multiplies one matrix at a time,
    each after a copy."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, ns: tuple, eq: tuple) -> Tensor:
        at, bt = a.t().contiguous(), b.t().contiguous()  # (C, P), kept for the backward
        ctx.save_for_backward(a, b, at, bt)
        ctx.ns, ctx.eq = ns, eq
        ctx.views = {}  # the per-sample views of at and bt, reused by the backward
        out = _bmm_channels(at, bt, list(ns), _bmm_plan(*eq), ("a", "b"), ctx.views)
        return out.t().contiguous() if out.shape[1] else a.new_empty((0, a.shape[1]))

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b, at, bt = ctx.saved_tensors
        x, y, o = ctx.eq
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # double backward: differentiable in g, a and b
            ga = _PairProduct.apply(g, b, ctx.ns, (o, y, x)) if need[0] else None
            gb = _PairProduct.apply(g, a, ctx.ns, (o, x, y)) if need[1] else None
            return ga, gb, None, None
        gt, ns, views = g.t().contiguous(), list(ctx.ns), ctx.views
        ctx.views = {}  # freed with the saved tensors (a second backward makes its own)
        ga = _bmm_channels(gt, bt, ns, _bmm_plan(o, y, x), ("g", "b"), views).t().contiguous() if need[0] else None
        gb = _bmm_channels(gt, at, ns, _bmm_plan(o, x, y), ("g", "a"), views).t().contiguous() if need[1] else None
        return ga, gb, None, None
