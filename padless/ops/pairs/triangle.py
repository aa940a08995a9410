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
