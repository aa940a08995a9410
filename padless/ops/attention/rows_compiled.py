"""Per-sample attention over any ragged layout, as one opaque op for ``torch.compile``.

:mod:`padless.ops.attention.rows` runs SDPA on each sample of layouts whose ragged
dims are not only the sequence dim (pair states ``(N_i, H, N_i, E)``: every row ``a``
of sample ``i`` is a batch entry of that sample's SDPA call). Eagerly it slices the
samples with host offsets. Inside a compiled graph the offsets and sizes are runtime
tensors, so the same loop runs inside ``padless::ragged_sdpa``, a ``torch.library``
custom op: its fake implementation only says "output rows = query rows", so the row
count (``sum N_i**2`` for a pair state made from a prepared batch, see
:func:`padless.prepare_for_compile`) stays symbolic; its real implementation reads the
offsets and sizes as host data at run time (on CUDA: one copy per call) and runs
torch's SDPA per sample. The backward (``padless::ragged_sdpa_backward``) recomputes
each sample's SDPA under autograd and asks torch for the gradients of the query, key,
value and float mask (the pair bias): the same formulas as eager, one sample's
``(N_i, H, N_i, N_i)`` scores alive at a time.

Every tensor operand is described by its packed rows, offsets, sizes and storage order
(``NestedTensor.storage_order``); a sample is rebuilt as the dense tensor of that
sample (``layout.sample_view``) and its output written back in the query's row order
(``sample_rows``). For a pair state ``(N, N, H, E)`` seen as ``(N, H, N, E)`` (ragged
sample dims 0 and 2) with ``N = 2`` and one head::

    query rows      (a,b) = (0,0) (0,1) (1,0) (1,1)      values (4, 1, E), order (0, 2, 1, 3)
    dense sample    q[a, h, b, :] = values[a * N + b, h, :]
    SDPA            batch a (rows), heads h, sequence b
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.tensor.layout import sample_view
from padless.tensor.traced import autograd_inside_op


def sample_rows(sample: Tensor, order: Sequence[int], n_ragged: int) -> Tensor:
    """Inverse of :func:`~padless.tensor.layout.sample_view`: the sample's rows ``(R, *static)`` in storage order."""
    if tuple(order) != tuple(range(len(order))):
        sample = sample.permute(list(order))
    return sample.reshape((-1, *sample.shape[n_ragged:]))


def combine_masks(mask: Tensor | None, keep: Tensor | None) -> Tensor | None:
    """One SDPA ``attn_mask`` from an optional bias/mask and an optional boolean keep mask."""
    if keep is None:
        return mask
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def sample_sdpa(
    qi: Tensor, ki: Tensor, vi: Tensor, mask: Tensor | None, keep: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> Tensor:
    """Torch's SDPA on one dense sample. Operands get leading unit dims up to rank 4 and the
    mask up to the query's rank: torch's fused CPU kernel only takes those (else: math)."""
    m = combine_masks(mask, keep)
    lead = max(0, 4 - qi.dim())
    if lead:
        qi, ki, vi = (t.reshape((1,) * lead + tuple(t.shape)) for t in (qi, ki, vi))
    if m is not None and m.dim() < qi.dim():
        m = m.reshape((1,) * (qi.dim() - m.dim()) + tuple(m.shape))
    out = F.scaled_dot_product_attention(
        qi, ki, vi, attn_mask=m, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out.reshape(out.shape[lead:]) if lead else out


class _Operands:
    """Host view of the op's operands: per tensor its offsets, sizes and storage order."""

    def __init__(self, tensors: Sequence[Tensor], offsets: Sequence[Tensor], sizes: Sequence[Tensor], orders: Sequence[int]):
        self.tensors = list(tensors)
        self.offsets = [o.tolist() for o in offsets]  # real (host) data: this runs at run time
        self.sizes = [s.tolist() for s in sizes]
        self.orders, at = [], 0
        for s in sizes:
            self.orders.append(list(orders[at:at + s.shape[1]]))
            at += s.shape[1]

    def sample(self, j: int, i: int, t: Tensor | None = None) -> Tensor:
        o = self.offsets[j]
        src = self.tensors[j] if t is None else t
        return sample_view(src[o[i]:o[i + 1]], self.sizes[j][i], self.orders[j])

    def n_ragged(self, j: int) -> int:
        return len(self.orders[j]) - (self.tensors[j].dim() - 1)


def _operands(q, k, v, mask, keep, offsets, sizes, orders) -> tuple[_Operands, int | None, int | None]:
    ts = [q, k, v] + [t for t in (mask, keep) if t is not None]
    jm = 3 if mask is not None else None
    jk = (4 if mask is not None else 3) if keep is not None else None
    return _Operands(ts, offsets, sizes, orders), jm, jk


@torch.library.custom_op("padless::ragged_sdpa", mutates_args=())
def ragged_sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, keep: Tensor | None,
    offsets: list[Tensor], sizes: list[Tensor], orders: list[int],
    is_causal: bool, scale: float | None, enable_gqa: bool,
) -> Tensor:
    """SDPA of every sample (see module docstring); output rows follow ``q``.

    ``offsets``/``sizes`` list the row offsets and sample sizes of ``q, k, v`` and then of
    ``mask`` and ``keep`` where given; ``orders`` concatenates their storage orders."""
    ops, jm, jk = _operands(q, k, v, mask, keep, offsets, sizes, orders)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    qo = ops.offsets[0]
    for i in range(len(qo) - 1):
        if qo[i + 1] == qo[i]:
            continue
        oi = sample_sdpa(
            ops.sample(0, i), ops.sample(1, i), ops.sample(2, i),
            None if jm is None else ops.sample(jm, i), None if jk is None else ops.sample(jk, i),
            0.0, is_causal, scale, enable_gqa,
        )
        out[qo[i]:qo[i + 1]] = sample_rows(oi, ops.orders[0], ops.n_ragged(0))
    return out


@ragged_sdpa.register_fake
def _ragged_sdpa_fake(q, k, v, mask, keep, offsets, sizes, orders, is_causal, scale, enable_gqa):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("padless::ragged_sdpa_backward", mutates_args=())
def ragged_sdpa_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, keep: Tensor | None,
    offsets: list[Tensor], sizes: list[Tensor], orders: list[int],
    is_causal: bool, scale: float | None, enable_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`ragged_sdpa` for ``q, k, v`` and a float ``mask`` (an empty
    tensor when the mask is absent or boolean): each sample's SDPA recomputed under
    autograd, so the formulas are torch's own."""
    ops, jm, jk = _operands(q, k, v, mask, keep, offsets, sizes, orders)
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    mask_grad = mask is not None and mask.is_floating_point()
    grads.append(torch.zeros_like(mask) if mask_grad else q.new_empty((0,)))
    qo = ops.offsets[0]
    for i in range(len(qo) - 1):
        if qo[i + 1] == qo[i]:
            continue
        leaves = [ops.sample(j, i).detach().requires_grad_() for j in range(3)]
        mi = None if jm is None else ops.sample(jm, i).detach()
        if mask_grad:
            mi.requires_grad_()
        with autograd_inside_op():
            oi = sample_sdpa(*leaves, mi, None if jk is None else ops.sample(jk, i), 0.0, is_causal, scale, enable_gqa)
            wrt = leaves + ([mi] if mask_grad else [])
            gs = torch.autograd.grad(oi, wrt, ops.sample(0, i, grad), allow_unused=True)
        for j, g in enumerate(gs):
            if g is None:
                continue
            jj = jm if j == 3 else j
            o = ops.offsets[jj]
            # += : query, key and value may be one tensor (self-attention), autograd sums them
            grads[j][o[i]:o[i + 1]] += sample_rows(g, ops.orders[jj], ops.n_ragged(jj))
    return tuple(grads)


@ragged_sdpa_backward.register_fake
def _ragged_sdpa_backward_fake(grad, q, k, v, mask, keep, offsets, sizes, orders, is_causal, scale, enable_gqa):
    fm = mask is not None and mask.is_floating_point()
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        torch.empty_like(mask) if fm else q.new_empty((0,)),
    )


def _setup(ctx, inputs, output) -> None:
    q, k, v, mask, keep, offsets, sizes, orders, is_causal, scale, enable_gqa = inputs
    ctx.n = len(offsets)
    ctx.save_for_backward(q, k, v, mask, keep, *offsets, *sizes)
    ctx.static = (list(orders), is_causal, scale, enable_gqa)


def _backward(ctx, grad):
    q, k, v, mask, keep, *rest = ctx.saved_tensors
    offsets, sizes = list(rest[:ctx.n]), list(rest[ctx.n:])
    orders, is_causal, scale, enable_gqa = ctx.static
    dq, dk, dv, dm = ragged_sdpa_backward(
        grad.contiguous(), q, k, v, mask, keep, offsets, sizes, orders, is_causal, scale, enable_gqa
    )
    dmask = dm if mask is not None and mask.is_floating_point() else None
    return dq, dk, dv, dmask, None, [None] * ctx.n, [None] * ctx.n, None, None, None, None


ragged_sdpa.register_autograd(_backward, setup_context=_setup)
