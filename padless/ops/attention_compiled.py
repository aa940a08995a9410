"""Per-sample attention as one opaque op, so ``torch.compile`` traces attention without a break.

The CPU attention path (``per_sample`` in :mod:`padless.ops.attention`) slices every
sample's rows with host offsets, which a compiled graph cannot do (the offsets are
runtime data there). Under tracing, attention without masks, mods or dropout calls
``padless::packed_sdpa`` instead: a ``torch.library`` custom op over the packed rows and
their offsets. Its fake implementation only says "output rows = query rows", so the
compiler never needs the offsets' values; its real implementation runs torch's SDPA on
each sample's rows (the same kernel as eager), reading the offsets as ordinary host
data at run time. The backward is a second custom op that recomputes each sample's
attention's softmax and applies the SDPA gradient formulas (no score matrix is
kept between the passes).

Layout (rows of ``(..., L_i, E)`` samples, the sequence dim ragged)::

    q        (Tq, *lead, E)      rows of all samples' queries, lead = e.g. (H,)
    k, v     (Tk, *lead, E/Ev)   rows of all samples' keys / values
    offsets  (B+1,) int64        row offsets of each sample (query and key side)
    output   (Tq, *lead, Ev)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _sample_view(rows: Tensor) -> Tensor:
    """``(L, *lead, E)`` rows of one sample as a 4-D ``(1, H, L, E)`` SDPA operand."""
    x = rows.movedim(0, -2)
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _sample_rows(out: Tensor, like: Tensor) -> Tensor:
    """Inverse of :func:`_sample_view` for an output of ``like``'s rows."""
    return out.reshape(like.shape[1:-1] + (like.shape[0], out.shape[-1])).movedim(-2, 0)


def _bounds(q_offsets: Tensor, k_offsets: Tensor) -> list[tuple[int, int, int, int]]:
    qo, ko = q_offsets.tolist(), k_offsets.tolist()  # real (host) data: this runs at run time
    return [(qo[i], qo[i + 1], ko[i], ko[i + 1]) for i in range(len(qo) - 1)]


@torch.library.custom_op("padless::packed_sdpa", mutates_args=())
def packed_sdpa(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, is_causal: bool, scale: float | None
) -> Tensor:
    """SDPA of every sample's rows (see module docstring); output rows follow ``q``."""
    out = q.new_empty((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    for qs, qe, ks, ke in _bounds(q_offsets, k_offsets):
        if qe == qs:
            continue
        qi = q[qs:qe]
        o = F.scaled_dot_product_attention(
            _sample_view(qi), _sample_view(k[ks:ke]), _sample_view(v[ks:ke]), is_causal=is_causal, scale=scale
        )
        out[qs:qe] = _sample_rows(o, qi)
    return out


@packed_sdpa.register_fake
def _packed_sdpa_fake(q, k, v, q_offsets, k_offsets, is_causal, scale):
    return q.new_empty((q.shape[0], *q.shape[1:-1], v.shape[-1]))


@torch.library.custom_op("padless::packed_sdpa_backward", mutates_args=())
def packed_sdpa_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    is_causal: bool, scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`packed_sdpa` for ``q``, ``k``, ``v`` (each sample recomputed)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _bounds(q_offsets, k_offsets):
        if qe == qs or ke == ks:
            continue  # no queries, or no keys (the output was zeros): zero gradients
        qi, ki, vi = (_sample_view(t).float() for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        gi = _sample_view(grad[qs:qe]).float()
        c = scale if scale is not None else qi.shape[-1] ** -0.5
        s = (qi @ ki.transpose(-1, -2)) * c
        if is_causal:
            lq, lk = s.shape[-2:]
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        dp = gi @ vi.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[qs:qe] = _sample_rows(ds @ ki * c, q[qs:qe]).to(q.dtype)
        dk[ks:ke] = _sample_rows(ds.transpose(-1, -2) @ qi * c, k[ks:ke]).to(k.dtype)
        dv[ks:ke] = _sample_rows(p.transpose(-1, -2) @ gi, v[ks:ke]).to(v.dtype)
    return dq, dk, dv


@packed_sdpa_backward.register_fake
def _packed_sdpa_backward_fake(grad, q, k, v, q_offsets, k_offsets, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, q_offsets, k_offsets, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    q, k, v, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = packed_sdpa_backward(grad.contiguous(), q, k, v, q_offsets, k_offsets, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


packed_sdpa.register_autograd(_backward, setup_context=_setup)


def traceable(masks, dropout_p: float, mask_mod, score_mod, enable_gqa: bool) -> bool:
    """Whether :func:`packed_sdpa` can stand in for the per-sample path (no masks, mods,
    dropout or grouped-query heads: these still need the eager per-sample path)."""
    return masks is None and mask_mod is None and score_mod is None and dropout_p == 0.0 and not enable_gqa
