"""Per-sample attention as one opaque op, so ``torch.compile`` traces attention without a break.

The CPU attention path (``per_sample`` in :mod:`padless.ops.attention.sdpa`) slices every
sample's rows with host offsets, which a compiled graph cannot do (the offsets are
runtime data there). Under tracing, attention calls a ``torch.library`` custom op over
the packed rows and their offsets instead (:func:`traced_attention` picks it):
``padless::packed_sdpa_fwd`` without masks, dropout or grouped-query heads (below), and
``padless::packed_sdpa_general_fwd`` with them (see "masks, dropout, GQA" further down:
per-sample masks travel as packed rows + offsets, dropout draws what eager draws under
the same seed, the backward recomputes each sample), except dropout on the CPU in
float32/float64: ``padless::packed_sdpa_dropout_fwd`` makes eager's math-path calls and
saves the attention weights, so its backward recomputes nothing ("dropout on the CPU"
below). ``mask_mod``/``score_mod`` are refused under compile with an error naming the fix
(build the mask as a NestedTensor).

The first op's fake implementation only says "output rows = query rows", so the
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

from padless.tensor.errors import StructureError
from padless.tensor.traced import autograd_inside_op


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


# ---------------------------------------------------------------------------- masks, dropout, GQA
#
# The general op runs exactly the per-sample SDPA calls of the eager path (same views,
# same order, so dropout draws the same random numbers under the same seed), with each
# sample's mask cut from the mask's packed rows. Its backward recomputes each sample
# with autograd under the generator state saved at the forward (as activation
# checkpointing does), so no dropout mask or score matrix is kept between the passes.
#
# Mask layout (a NestedTensor of (*static, L_i, S_i) samples, both last dims ragged):
#
#     mask         (sum L_i*S_i, *static)  sample i's rows are its (L_i, S_i) grid, row-major
#     mask_offsets (B+1,)                  row offsets per sample
#     mask_sizes   (B, D)                  each sample's exact shape (checked at run time)

_RNG_BYTES: dict[str, int] = {}


def _rng_state(device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _rng_bytes(device: torch.device, dropout_p: float) -> int:
    """Size of the saved generator state (0 without dropout); real, also inside a fake impl."""
    if dropout_p == 0.0:
        return 0
    if device.type not in _RNG_BYTES:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            _RNG_BYTES[device.type] = _rng_state(device).numel()
    return _RNG_BYTES[device.type]


_MASK_MSG = "scaled_dot_product_attention(): attn_mask sample {i} has shape {shape}, expected (..., {lq}, {lk}) (query length x key length of that sample)"


def _mask_view(rows: Tensor, shape: list[int], i: int, lq: int, lk: int) -> Tensor:
    """Sample ``i``'s packed mask rows ``(L_i*S_i, *static)`` as its ``(*static, L_i, S_i)`` mask."""
    if shape[-2:] != [lq, lk]:
        raise StructureError(_MASK_MSG.format(i=i, shape=tuple(shape), lq=lq, lk=lk))
    return rows.reshape(lq, lk, *rows.shape[1:]).permute(*range(2, len(shape)), 0, 1)


def _mask_parts(mask: Tensor | None, mask_offsets: Tensor | None, mask_sizes: Tensor | None, lengths) -> list:
    """Each sample's mask as a view of the packed rows (``None`` each without a mask; run time)."""
    if mask is None:
        return [None] * len(lengths)
    mo, ms = mask_offsets.tolist(), mask_sizes.tolist()  # real (host) data at run time
    return [_mask_view(mask[mo[i]:mo[i + 1]], ms[i], i, lq, lk) for i, (lq, lk) in enumerate(lengths)]


def _general_bounds(q_offsets: Tensor, k_offsets: Tensor):
    b = _bounds(q_offsets, k_offsets)
    return b, [(qe - qs, ke - ks) for qs, qe, ks, ke in b]


@torch.library.custom_op(
    "padless::packed_sdpa_general_fwd", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def packed_sdpa_general_fwd(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    mask: Tensor | None, mask_offsets: Tensor | None, mask_sizes: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    """SDPA of every sample's rows with its own mask, dropout and grouped-query heads (see the
    section comment); returns the output rows and the generator state dropout started from
    (empty without dropout)."""
    bounds, lengths = _general_bounds(q_offsets, k_offsets)
    masks = _mask_parts(mask, mask_offsets, mask_sizes, lengths)
    rng = _rng_state(q.device).clone() if dropout_p > 0 else torch.empty(0, dtype=torch.uint8)
    out = q.new_zeros((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    for (qs, qe, ks, ke), mi in zip(bounds, masks):
        o = F.scaled_dot_product_attention(
            _sample_view(q[qs:qe]), _sample_view(k[ks:ke]), _sample_view(v[ks:ke]), attn_mask=mi,
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
        out[qs:qe] = _sample_rows(o, q[qs:qe])
    return out, rng


@packed_sdpa_general_fwd.register_fake
def _packed_sdpa_general_fwd_fake(q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, dropout_p, is_causal, scale, enable_gqa):
    out = q.new_empty((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    return out, torch.empty(_rng_bytes(q.device, dropout_p), dtype=torch.uint8)


@torch.library.custom_op("padless::packed_sdpa_general_backward", mutates_args=())
def packed_sdpa_general_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    mask: Tensor | None, mask_offsets: Tensor | None, mask_sizes: Tensor | None, rng: Tensor,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`packed_sdpa_general_fwd` for ``q``, ``k``, ``v`` and (``mask_grad``:
    an additive mask; else an empty tensor) the mask rows: each sample recomputed with
    autograd from the forward's generator state, which is restored afterwards."""
    bounds, lengths = _general_bounds(q_offsets, k_offsets)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dm = torch.zeros_like(mask) if mask_grad and mask is not None else q.new_empty(0)
    mo, ms = (mask_offsets.tolist(), mask_sizes.tolist()) if mask is not None else (None, None)
    now = _rng_state(q.device).clone() if dropout_p > 0 else None
    if now is not None:
        _set_rng_state(q.device, rng)  # replay the forward's dropout draws
    try:
        for i, (qs, qe, ks, ke) in enumerate(bounds):
            leaves = [t.detach().requires_grad_() for t in (q[qs:qe], k[ks:ke], v[ks:ke])]
            with autograd_inside_op():
                mi = None
                if mask is not None:
                    rows = mask[mo[i]:mo[i + 1]].detach()
                    if mask_grad:
                        leaves.append(rows.requires_grad_())
                    mi = _mask_view(rows, ms[i], i, *lengths[i])
                o = F.scaled_dot_product_attention(
                    *(_sample_view(t) for t in leaves[:3]), attn_mask=mi,
                    dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                )
                gs = torch.autograd.grad(o, leaves, _sample_view(grad[qs:qe]), allow_unused=True)
            spans = [(dq, qs, qe), (dk, ks, ke), (dv, ks, ke)] + ([(dm, mo[i], mo[i + 1])] if mask_grad else [])
            for (buf, lo, hi), g in zip(spans, gs):
                if g is not None:
                    buf[lo:hi] = g  # autograd gives each leaf's gradient in its row layout
    finally:
        if now is not None:
            _set_rng_state(q.device, now)
    return dq, dk, dv, dm


@packed_sdpa_general_backward.register_fake
def _packed_sdpa_general_backward_fake(grad, q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, rng, dropout_p, is_causal, scale, enable_gqa, mask_grad):
    dm = torch.empty_like(mask) if mask_grad and mask is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm


def _general_setup(ctx, inputs, output) -> None:
    q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, dropout_p, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, output[1])
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)
    ctx.mask_grad = mask is not None and mask.is_floating_point()


def _general_backward(ctx, grad, _grad_rng):
    q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, rng = ctx.saved_tensors
    mask_grad = ctx.mask_grad and ctx.needs_input_grad[5]
    dq, dk, dv, dm = packed_sdpa_general_backward(
        grad.contiguous(), q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, rng, *ctx.args, mask_grad
    )
    return dq, dk, dv, None, None, dm if mask_grad else None, None, None, None, None, None, None


packed_sdpa_general_fwd.register_autograd(_general_backward, setup_context=_general_setup)


# ---------------------------------------------------------------------------- dropout on the CPU: saved, not recomputed
#
# Eager CPU SDPA with dropout (float32/float64) runs torch's math path: scores
# ``(q*c) @ (k*c)^T`` (c = sqrt(scale)), a causal or user mask added, ``_safe_softmax``, then
# ``dropout``: ``noise = empty_like(p).bernoulli_(1 - dropout_p).div_(1 - dropout_p)``,
# ``out = (p * noise) @ v``. This op makes the same calls per sample (same shapes, same
# order, so the same draws under the same seed) and keeps what eager's autograd keeps, the
# softmax ``p`` and the dropped-out ``a = p * noise``, so its backward runs no forward again:
#
#     dv = a^T @ dout     da = dout @ v^T     t = a * da     ds = t - p * rowsum(t)
#     dq = ds @ k * scale     dk = ds^T @ q * scale     d(additive mask) = ds
#
# Saved layout: ``saved (2, Tq*lead*S_max)``, [0] the samples' ``p``, [1] their ``a``: sample
# i's ``(*lead, L_i, S_i)`` weights are one contiguous block from ``qs*lead*S_max`` (lead:
# the product of the static dims; what follows a block up to the next is never written nor
# read). S_max is the key envelope, a size the graph knows; the exact ``sum L_i*S_i`` would
# be an unbacked size that the NestedTensor output, which alone leaves the traced call,
# cannot bind. The weights are computed in place in their blocks (no copy).


def _saves(q: Tensor, dropout_p: float) -> bool:
    """Dropout on the CPU in float32/float64: eager runs torch's math path, which this op mirrors."""
    return 0.0 < dropout_p < 1.0 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _expand_heads(x: Tensor, heads: int, enable_gqa: bool) -> Tensor:
    return x.repeat_interleave(heads // x.shape[-3], dim=-3) if enable_gqa and x.shape[-3] != heads else x


def _scale_sqrt(e: int, scale: float | None) -> float:
    return (scale if scale is not None else e ** -0.5) ** 0.5


@torch.library.custom_op(
    "padless::packed_sdpa_dropout_fwd", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def packed_sdpa_dropout_fwd(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    mask: Tensor | None, mask_offsets: Tensor | None, mask_sizes: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, k_max: int,
) -> tuple[Tensor, Tensor]:
    """SDPA with dropout of every sample's rows, eager's math path call for call (see the section
    comment); returns the output rows and ``saved`` (2, Tq*lead*k_max): each sample's softmax
    and dropped-out attention weights (``k_max``: at least every key length)."""
    bounds, lengths = _general_bounds(q_offsets, k_offsets)
    masks = _mask_parts(mask, mask_offsets, mask_sizes, lengths)
    out = q.new_zeros((q.shape[0], *q.shape[1:-1], v.shape[-1]))
    saved = q.new_empty((2, _saved_size(q, k_max)))
    lead = q.shape[1:-1].numel()
    c = _scale_sqrt(q.shape[-1], scale)
    for (qs, qe, ks, ke), mi in zip(bounds, masks):
        if ke - ks > k_max:
            raise ValueError(f"packed_sdpa_dropout_fwd(): a sample has {ke - ks} keys, more than k_max={k_max}")
        qi = _sample_view(q[qs:qe])
        ki = _expand_heads(_sample_view(k[ks:ke]), qi.shape[-3], enable_gqa)
        vi = _expand_heads(_sample_view(v[ks:ke]), qi.shape[-3], enable_gqa)
        p, a = _saved_blocks(saved, qi, qs * lead * k_max, ke - ks)
        sc = (qi * c) @ (ki * c).transpose(-2, -1)
        if is_causal:
            lq, lk = sc.shape[-2:]
            sc.masked_fill_(torch.ones(lq, lk, dtype=torch.bool, device=sc.device).triu(1), float("-inf"))
        elif mi is not None:
            sc = sc.masked_fill(mi.logical_not(), float("-inf")) if mi.dtype == torch.bool else sc + mi
        if mi is None:  # no row without keys (causal is top-left): softmax is the safe softmax
            torch.ops.aten._softmax.out(sc, -1, False, out=p)
        else:
            p.copy_(torch.ops.aten._safe_softmax(sc, -1))
        a.bernoulli_(1 - dropout_p).div_(1 - dropout_p).mul_(p)  # eager's draw: noise shaped like p
        out[qs:qe] = _sample_rows(a @ vi, q[qs:qe])
    return out, saved


def _saved_size(q: Tensor, k_max):
    """``Tq*lead*k_max`` as a product of sizes (``Size.numel()`` would specialise symbolic ones)."""
    n = k_max
    for d in q.shape[:-1]:
        n = n * d
    return n


def _saved_blocks(saved: Tensor, qi: Tensor, start: int, lk: int) -> tuple[Tensor, Tensor]:
    """A sample's ``p`` and ``a`` blocks ``(*qi.shape[:-1], lk)`` of ``saved`` from ``start``
    (see the section comment)."""
    shape = torch.Size((*qi.shape[:-1], lk))
    n = shape.numel()
    return saved[0, start:start + n].view(shape), saved[1, start:start + n].view(shape)


@packed_sdpa_dropout_fwd.register_fake
def _packed_sdpa_dropout_fwd_fake(q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, dropout_p, is_causal, scale, enable_gqa, k_max):
    return q.new_empty((q.shape[0], *q.shape[1:-1], v.shape[-1])), q.new_empty((2, _saved_size(q, k_max)))


@torch.library.custom_op("padless::packed_sdpa_dropout_backward", mutates_args=())
def packed_sdpa_dropout_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, saved: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    mask: Tensor | None, mask_offsets: Tensor | None, mask_sizes: Tensor | None,
    scale: float | None, enable_gqa: bool, mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`packed_sdpa_dropout_fwd` for ``q``, ``k``, ``v`` and (``mask_grad``:
    an additive mask; else an empty tensor) the mask rows, from the saved weights (no recompute)."""
    bounds, lengths = _general_bounds(q_offsets, k_offsets)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dm = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if mask_grad else q.new_empty(0)
    mo, ms = (mask_offsets.tolist(), mask_sizes.tolist()) if mask_grad else (None, None)
    c2 = _scale_sqrt(q.shape[-1], scale) ** 2
    lead = q.shape[1:-1].numel()
    k_max = saved.shape[1] // max(q.shape[:-1].numel(), 1)
    for i, (qs, qe, ks, ke) in enumerate(bounds):
        qi, gi = _sample_view(q[qs:qe]), _sample_view(grad[qs:qe])
        ki, vi = _sample_view(k[ks:ke]), _sample_view(v[ks:ke])
        heads = qi.shape[-3]
        kx, vx = _expand_heads(ki, heads, enable_gqa), _expand_heads(vi, heads, enable_gqa)
        p, a = _saved_blocks(saved, qi, qs * lead * k_max, ke - ks)
        gv = a.transpose(-2, -1) @ gi
        t = a * (gi @ vx.transpose(-2, -1))
        ds = t - p * t.sum(-1, keepdim=True)
        gq = ds @ kx * c2
        gk = ds.transpose(-2, -1) @ qi * c2
        if kx is not ki:  # grouped-query heads: each key head's gradient sums over its query heads
            gk = gk.unflatten(-3, (ki.shape[-3], -1)).sum(-3)
            gv = gv.unflatten(-3, (vi.shape[-3], -1)).sum(-3)
        dq[qs:qe] = _sample_rows(gq, q[qs:qe])
        dk[ks:ke] = _sample_rows(gk, k[ks:ke])
        dv[ks:ke] = _sample_rows(gv, v[ks:ke])
        if mask_grad:
            view = _mask_view(dm[mo[i]:mo[i + 1]], ms[i], i, *lengths[i])
            view.copy_(ds.sum_to_size(view.shape))
    return dq, dk, dv, dm


@packed_sdpa_dropout_backward.register_fake
def _packed_sdpa_dropout_backward_fake(grad, q, k, v, saved, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, scale, enable_gqa, mask_grad):
    dm = torch.empty_like(mask) if mask_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm


def _dropout_setup(ctx, inputs, output) -> None:
    q, k, v, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, _dropout_p, _is_causal, scale, enable_gqa, _k_max = inputs
    ctx.save_for_backward(q, k, v, output[1], q_offsets, k_offsets, mask, mask_offsets, mask_sizes)
    ctx.args = (scale, enable_gqa)
    ctx.mask_grad = mask is not None and mask.is_floating_point()


def _dropout_backward(ctx, grad, _grad_saved):
    q, k, v, saved, q_offsets, k_offsets, mask, mask_offsets, mask_sizes = ctx.saved_tensors
    mask_grad = ctx.mask_grad and ctx.needs_input_grad[5]
    dq, dk, dv, dm = packed_sdpa_dropout_backward(
        grad.contiguous(), q, k, v, saved, q_offsets, k_offsets, mask, mask_offsets, mask_sizes, *ctx.args, mask_grad
    )
    return dq, dk, dv, None, None, dm if mask_grad else None, None, None, None, None, None, None, None


packed_sdpa_dropout_fwd.register_autograd(_dropout_backward, setup_context=_dropout_setup)


# ---------------------------------------------------------------------------- entry point


def check_mask_layout(op: str, attn_mask) -> None:
    """Static checks of a NestedTensor ``attn_mask`` under compile (its per-sample shapes are
    runtime data there, checked by the op when it runs)."""
    d = attn_mask.sample_dim
    if d < 2 or attn_mask._ragged != (d - 2, d - 1):
        raise StructureError(
            f"{op}(): under torch.compile attn_mask must be a NestedTensor of (..., L_i, S_i) samples whose "
            f"last two dims are ragged, stored in that order; it has rank {d} and ragged dims "
            f"{tuple(r + 1 for r in attn_mask._ragged)} in storage order. Build it with "
            "padless.from_list(masks, ragged_dims=(D-2, D-1)) (e.g. ragged_dims=(0, 1) for (L_i, S_i) masks)."
        )


def traced_attention(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool) -> Tensor:
    """Packed output rows of SDPA over NestedTensors inside a compiled graph: one opaque op over
    the packed rows (host offsets read when it runs); the fused-kernel op without masks,
    dropout or grouped-query heads, the saving dropout op for dropout on the CPU, the general
    op otherwise."""
    from padless.tensor.autograd import values_of

    q, k, v = values_of(query), values_of(key), values_of(value)
    if attn_mask is None and dropout_p == 0.0 and not enable_gqa:
        return packed_sdpa(q, k, v, query._offsets, key._offsets, is_causal, scale)
    m, mo, ms = (None, None, None) if attn_mask is None else (values_of(attn_mask), attn_mask._offsets, attn_mask._sizes)
    if _saves(q, dropout_p) and not (is_causal and attn_mask is not None):  # (both: the general op raises eager's error)
        return packed_sdpa_dropout_fwd(
            q, k, v, query._offsets, key._offsets, m, mo, ms, float(dropout_p), is_causal, scale, enable_gqa,
            key._env[-2],
        )[0]
    return packed_sdpa_general_fwd(
        q, k, v, query._offsets, key._offsets, m, mo, ms, float(dropout_p), is_causal, scale, enable_gqa
    )[0]
