"""Per-sample attention as one opaque op, so ``torch.compile`` traces attention without a break.

The CPU attention path (``per_sample`` in :mod:`padless.ops.attention`) slices every
sample's rows with host offsets, which a compiled graph cannot do (the offsets are
runtime data there). Under tracing, attention without masks, mods or dropout calls
``padless::packed_sdpa`` instead: a ``torch.library`` custom op over the packed rows and
their offsets. Its fake implementation only says "output rows = query rows", so the
compiler never needs the offsets' values; its real implementation runs torch's SDPA on
each sample's rows (the same kernel as eager), reading the offsets as ordinary host
data at run time. The backward is a second custom op: torch's fused CPU flash
backward per sample, from the saved output and logsumexp (other devices and dtypes:
the SDPA gradient formulas on a recomputed softmax); no score matrix is kept between
the passes.

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


def _fused_cpu(q: Tensor, v: Tensor) -> bool:
    """torch's fused CPU flash kernels (forward with logsumexp, and backward) take these inputs."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16) and q.shape[-1] == v.shape[-1]


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("padless::packed_sdpa_fwd", mutates_args=())
def packed_sdpa_fwd(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """SDPA of every sample's rows (see module docstring): output rows follow ``q``, and the
    per-row logsumexp ``(Tq, *lead)`` (float32; float64 for float64) that the fused CPU
    backward reuses (zeros where the fused kernel did not run)."""
    out = q.new_zeros((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    lse = torch.zeros(q.shape[:-1], dtype=_lse_dtype(q), device=q.device)
    fused = _fused_cpu(q, v)
    for qs, qe, ks, ke in _bounds(q_offsets, k_offsets):
        if qe == qs or ke == ks:
            continue  # no queries; or no keys: zeros, as torch's SDPA gives for an empty key set
        qi, ki, vi = _sample_view(q[qs:qe]), _sample_view(k[ks:ke]), _sample_view(v[ks:ke])
        if fused:
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qi, ki, vi, 0.0, is_causal, scale=scale
            )
            lse[qs:qe] = _sample_rows(l.unsqueeze(-1), q[qs:qe]).squeeze(-1).to(lse.dtype)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=is_causal, scale=scale)
        out[qs:qe] = _sample_rows(o, q[qs:qe])
    return out, lse


@packed_sdpa_fwd.register_fake
def _packed_sdpa_fwd_fake(q, k, v, q_offsets, k_offsets, is_causal, scale):
    out = q.new_empty((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    return out, torch.empty(q.shape[:-1], dtype=_lse_dtype(q), device=q.device)


def packed_sdpa(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, is_causal: bool, scale: float | None
) -> Tensor:
    """SDPA of every sample's rows (see module docstring); output rows follow ``q``."""
    return packed_sdpa_fwd(q, k, v, q_offsets, k_offsets, is_causal, scale)[0]


@torch.library.custom_op("padless::packed_sdpa_backward", mutates_args=())
def packed_sdpa_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    is_causal: bool, scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`packed_sdpa` for ``q``, ``k``, ``v``: torch's fused CPU backward per
    sample where it applies, else the SDPA gradient formulas on the recomputed softmax."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fused = _fused_cpu(q, v)
    for qs, qe, ks, ke in _bounds(q_offsets, k_offsets):
        if qe == qs or ke == ks:
            continue  # no queries, or no keys (the output was zeros): zero gradients
        if fused:
            lse_i = _sample_view(lse[qs:qe].unsqueeze(-1)).squeeze(-1)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _sample_view(grad[qs:qe]), _sample_view(q[qs:qe]), _sample_view(k[ks:ke]), _sample_view(v[ks:ke]),
                _sample_view(out[qs:qe]), lse_i,
                0.0, is_causal, scale=scale,
            )
            dq[qs:qe] = _sample_rows(gq, q[qs:qe])
            dk[ks:ke] = _sample_rows(gk, k[ks:ke])
            dv[ks:ke] = _sample_rows(gv, v[ks:ke])
            continue
        qi, ki, vi = (_sample_view(t).float() for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        gi = _sample_view(grad[qs:qe]).float()
        c = scale if scale is not None else qi.shape[-1] ** -0.5
        sc = (qi @ ki.transpose(-1, -2)) * c
        if is_causal:
            lq, lk = sc.shape[-2:]
            sc = sc.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=sc.device).triu(1), float("-inf"))
        p = torch.softmax(sc, dim=-1)
        dp = gi @ vi.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[qs:qe] = _sample_rows(ds @ ki * c, q[qs:qe]).to(q.dtype)
        dk[ks:ke] = _sample_rows(ds.transpose(-1, -2) @ qi * c, k[ks:ke]).to(k.dtype)
        dv[ks:ke] = _sample_rows(p.transpose(-1, -2) @ gi, v[ks:ke]).to(v.dtype)
    return dq, dk, dv


@packed_sdpa_backward.register_fake
def _packed_sdpa_backward_fake(grad, q, k, v, out, lse, q_offsets, k_offsets, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, q_offsets, k_offsets, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = packed_sdpa_backward(
        grad.contiguous(), q, k, v, out, lse, q_offsets, k_offsets, ctx.is_causal, ctx.scale
    )
    return dq, dk, dv, None, None, None, None


packed_sdpa_fwd.register_autograd(_backward, setup_context=_setup)


def traceable(masks, dropout_p: float, mask_mod, score_mod, enable_gqa: bool) -> bool:
    """Whether :func:`packed_sdpa` can stand in for the per-sample path (no masks, mods,
    dropout or grouped-query heads: these still need the eager per-sample path)."""
    return masks is None and mask_mod is None and score_mod is None and dropout_p == 0.0 and not enable_gqa
