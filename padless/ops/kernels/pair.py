"""Pair construction ``out[i, a, b, :] = x[i, a, :] (+|*) y[i, b, :] (+ z[i, a, b, :])``.

Square (``M_i = N_i``) and rectangular pairs, with an optional third operand ``z``
already in pair layout (a bias), without gather indices: every program owns a
tile of one sample's pair rows and derives ``a = l // M_i``, ``b = l % M_i`` from
the sample's extents. Layout of sample ``i`` in ``out``: rows
``out_off[i] + a * M_i + b``. Backward: ``dz = dout``; ``dx`` is the row sum
``sum_b dout[a, b] (* y[b])``; ``dy`` the column sum ``sum_a dout[a, b] (* x[a])``.

The torch **twin** gathers rows with index tensors (what broadcasting a
``(N_i, 1, C)`` by a ``(1, M_i, C)`` NestedTensor does) and is the reference.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import Tensor

from padless.ops.kernels import dispatch

FAMILY = "pair"
OPS = {"add": 0, "mul": 1}
tl: Any = None


@dataclasses.dataclass(frozen=True)
class PairMeta:
    """Per-sample extents and row offsets (device tensors) plus host maxima for the grid."""

    n: Tensor  # (B,) rows of x per sample
    m: Tensor  # (B,) rows of y per sample
    x_off: Tensor  # (B + 1,)
    y_off: Tensor  # (B + 1,)
    out_off: Tensor  # (B + 1,)
    max_n: int
    max_m: int
    max_rows: int  # max N_i * M_i
    total: int  # sum N_i * M_i

    @staticmethod
    def from_host(n: Tensor, m: Tensor, device: torch.device | str) -> "PairMeta":
        """Build from host ``(B,)`` extents (one small copy per tensor to ``device``)."""
        n, m = n.to(torch.int64).contiguous(), m.to(torch.int64).contiguous()  # kernels index them flat

        def offs(c: Tensor) -> Tensor:
            return torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])

        rows = n * m
        b = n.shape[0]
        return PairMeta(
            n.to(device), m.to(device), offs(n).to(device), offs(m).to(device), offs(rows).to(device),
            int(n.max()) if b else 0, int(m.max()) if b else 0, int(rows.max()) if b else 0, int(rows.sum()),
        )


def _pair_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n_ptr, m_ptr, xo_ptr, yo_ptr, oo_ptr, F,
                 OP: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    i = tl.program_id(0)
    local = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    n = tl.load(n_ptr + i)
    m = tl.load(m_ptr + i)
    rmask = local < n * m
    msk = rmask[:, None] & (cols < F)[None, :]
    msafe = tl.maximum(m, 1)
    a = local // msafe
    b = local % msafe
    xr = tl.load(xo_ptr + i) + a
    yr = tl.load(yo_ptr + i) + b
    orow = tl.load(oo_ptr + i) + local
    xv = tl.load(x_ptr + xr[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    yv = tl.load(y_ptr + yr[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    if OP == 0:
        v = xv + yv
    else:
        v = xv * yv
    if HAS_Z:
        v += tl.load(z_ptr + orow[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    tl.store(out_ptr + orow[:, None] * F + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=msk)


def _pair_bwd_kernel(g_ptr, other_ptr, grad_ptr, n_ptr, m_ptr, own_off_ptr, other_off_ptr, oo_ptr, F,
                     OP: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """ROWS: gradient of x (sum over b for each a); else of y (sum over a for each b)."""
    i = tl.program_id(0)
    own = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    n = tl.load(n_ptr + i)
    m = tl.load(m_ptr + i)
    if ROWS:
        n_own = n
        n_loop = m
    else:
        n_own = m
        n_loop = n
    omask = own < n_own
    msk = omask[:, None] & (cols < F)[None, :]
    oo = tl.load(oo_ptr + i)
    other_off = tl.load(other_off_ptr + i)
    acc = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)
    for j in range(0, n_loop):
        if ROWS:
            grow = oo + own.to(tl.int64) * m + j
        else:
            grow = oo + j * m + own.to(tl.int64)
        gv = tl.load(g_ptr + grow[:, None] * F + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        if OP == 1:
            ov = tl.load(other_ptr + (other_off + j) * F + cols, mask=cols < F, other=0.0).to(tl.float32)
            gv = gv * ov[None, :]
        acc += gv
    rows = tl.load(own_off_ptr + i) + own
    tl.store(grad_ptr + rows[:, None] * F + cols[None, :], acc.to(grad_ptr.dtype.element_ty), mask=msk)


def _build(triton: Any, tl_mod: Any) -> types.SimpleNamespace:
    global tl
    tl = tl_mod
    return types.SimpleNamespace(fwd=triton.jit(_pair_kernel), bwd=triton.jit(_pair_bwd_kernel))


kernels = dispatch.jit_kernels(_build)
BLOCK_R = 16


def _bf(f: int) -> int:
    return dispatch.next_pow2(f, lo=16, hi=64)


@torch.library.triton_op("padless::pair_combine", mutates_args=())
def pair_combine_op(x: Tensor, y: Tensor, z: Tensor | None, n: Tensor, m: Tensor, x_off: Tensor, y_off: Tensor,
                    out_off: Tensor, op: str, max_rows: int, total: int, max_n: int, max_m: int) -> Tensor:
    """``(sum N_i, F)`` and ``(sum M_i, F)`` rows -> ``(sum N_i M_i, F)`` pair rows."""
    f = x.shape[1]
    out = x.new_empty((total, f))
    b = n.shape[0]
    if total and f:
        bf = _bf(f)
        grid = (b, (max_rows + BLOCK_R - 1) // BLOCK_R, (f + bf - 1) // bf)
        dispatch.launch(kernels().fwd, grid, x, y, z if z is not None else out, out, n, m, x_off, y_off, out_off, f,
                        OP=OPS[op], HAS_Z=z is not None, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return out


@pair_combine_op.register_fake
def _pair_combine_fake(x, y, z, n, m, x_off, y_off, out_off, op, max_rows, total, max_n, max_m):
    return x.new_empty((total, x.shape[1]))


@torch.library.triton_op("padless::pair_combine_backward", mutates_args=())
def pair_combine_backward_op(g: Tensor, other: Tensor, own_rows: int, n: Tensor, m: Tensor, own_off: Tensor,
                             other_off: Tensor, out_off: Tensor, op: str, rows: bool, max_own: int) -> Tensor:
    """Gradient of one factor: row sums (``rows=True``, for x) or column sums (for y)."""
    f = g.shape[1]
    grad = g.new_zeros((own_rows, f))
    b = n.shape[0]
    if own_rows and f and max_own:
        bf = _bf(f)
        grid = (b, (max_own + BLOCK_R - 1) // BLOCK_R, (f + bf - 1) // bf)
        dispatch.launch(kernels().bwd, grid, g.contiguous(), other, grad, n, m, own_off, other_off, out_off, f,
                        OP=OPS[op], ROWS=rows, BLOCK_R=BLOCK_R, BLOCK_F=bf)
    return grad


@pair_combine_backward_op.register_fake
def _pair_combine_backward_fake(g, other, own_rows, n, m, own_off, other_off, out_off, op, rows, max_own):
    return g.new_empty((own_rows, g.shape[1]))


def _setup(ctx, inputs, output):
    x, y, z, n, m, x_off, y_off, out_off, op, max_rows, total, max_n, max_m = inputs
    ctx.save_for_backward(x, y, n, m, x_off, y_off, out_off)
    ctx.op, ctx.has_z = op, z is not None
    ctx.max_n, ctx.max_m = max_n, max_m  # host metadata: no device read


def _backward(ctx, g):
    x, y, n, m, x_off, y_off, out_off = ctx.saved_tensors
    dx = pair_combine_backward_op(g, y, x.shape[0], n, m, x_off, y_off, out_off, ctx.op, True, ctx.max_n)
    dy = pair_combine_backward_op(g, x, y.shape[0], n, m, y_off, x_off, out_off, ctx.op, False, ctx.max_m)
    dz = g if ctx.has_z else None
    return dx, dy, dz, None, None, None, None, None, None, None, None, None, None


pair_combine_op.register_autograd(_backward, setup_context=_setup)


def twin_pair(x: Tensor, y: Tensor, op: str, meta: PairMeta, z: Tensor | None = None) -> Tensor:
    """The torch twin: gather rows of x and y through per-row indices, then combine."""
    b = meta.n.shape[0]
    rows = meta.n * meta.m
    sid = torch.repeat_interleave(torch.arange(b, device=rows.device), rows, output_size=meta.total)
    local = torch.arange(meta.total, device=rows.device) - meta.out_off[:-1].index_select(0, sid)
    msafe = meta.m.clamp_min(1).index_select(0, sid)
    xi = meta.x_off[:-1].index_select(0, sid) + torch.div(local, msafe, rounding_mode="floor")
    yi = meta.y_off[:-1].index_select(0, sid) + torch.remainder(local, msafe)
    xs, ys = x.index_select(0, xi), y.index_select(0, yi)
    out = xs + ys if op == "add" else xs * ys
    return out if z is None else out + z


def pair_combine(x: Tensor, y: Tensor, op: str, meta: PairMeta, z: Tensor | None = None) -> Tensor:
    """Pair rows ``(sum N_i M_i, *static)`` from ``x`` ``(sum N_i, *static)`` and ``y`` ``(sum M_i, *static)``."""
    if op not in OPS:
        raise ValueError(f"pair_combine(): op must be 'add' or 'mul', got {op!r}")

    def unsupported() -> str | None:
        if not x.is_floating_point() or x.dtype != y.dtype or (z is not None and z.dtype != x.dtype):
            return f"dtypes {x.dtype}/{y.dtype} (the kernel combines one floating dtype)"
        if x.shape[1:] != y.shape[1:] or (z is not None and z.shape[1:] != x.shape[1:]):
            return "operands' static shapes differ (the kernel does not broadcast features)"
        return None

    if not dispatch.use_kernel(FAMILY, x, unsupported=unsupported):
        return twin_pair(x, y, op, meta, z)
    f = 1
    for s in x.shape[1:]:
        f *= s
    flat = [t.reshape(t.shape[0], f).contiguous() for t in (x, y)]
    zf = z.reshape(z.shape[0], f).contiguous() if z is not None else None
    out = pair_combine_op(flat[0], flat[1], zf, meta.n, meta.m, meta.x_off, meta.y_off, meta.out_off, op,
                          meta.max_rows, meta.total, meta.max_n, meta.max_m)
    return out.reshape(meta.total, *x.shape[1:])


# ---------------------------------------------------------------------------- broadcasting entry point


def _pair_funcs() -> dict[Any, str]:
    aten = torch.ops.aten
    t = torch.Tensor
    return {
        aten.add.Tensor: "add", torch.add: "add", t.add: "add", t.__add__: "add", t.__radd__: "add",
        aten.mul.Tensor: "mul", torch.mul: "mul", t.mul: "mul", t.__mul__: "mul", t.__rmul__: "mul",
    }


_FUNCS: dict[Any, str] = {}


def broadcast_pair(func: Any, nts: list[Any], plan: Any) -> Tensor | None:
    """Values of ``(N_i, 1, C) (+|*) (1, M_i, C)`` (either order) from the pair kernel, or None.

    ``plan`` is the broadcast plan (:func:`padless.ops.common.broadcast.plan`); None means: run the
    generic path (gather through the plan's row maps), which is also this kernel's twin.
    """
    if not dispatch.quick_check(nts[0]._values):
        return None
    if not _FUNCS:
        _FUNCS.update(_pair_funcs())
    op = _FUNCS.get(func)
    t = plan.template
    if op is None or t.sample_dim != 3 or tuple(t._ragged) != (0, 1):
        return None
    by_ragged = {tuple(n._ragged): (n, sq) for n, sq in zip(nts, plan.squeeze)}
    if set(by_ragged) != {(0,), (1,)}:
        return None
    (x, sqx), (y, sqy) = by_ragged[(0,)], by_ragged[(1,)]
    hx, hy = x._meta.host_sizes, y._meta.host_sizes
    if hx is None or hy is None or x._values.dtype != y._values.dtype:
        return None
    if bool((hx[:, 1] != 1).any()) or bool((hy[:, 0] != 1).any()):
        return None
    xv, yv = x._values.squeeze(sqx), y._values.squeeze(sqy)
    if xv.shape[1:] != yv.shape[1:]:
        return None
    key = ("pair_meta", xv.device)
    meta = t._meta.derived.get(key)
    if meta is None:
        meta = PairMeta.from_host(hx[:, 0], hy[:, 1], xv.device)
        t._meta.derived[key] = meta
    return pair_combine(xv, yv, op, meta)
