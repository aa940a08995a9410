"""``nn.MultiheadAttention`` and the Transformer layers on NestedTensors, module code unchanged.

``nn.MultiheadAttention`` (``batch_first`` True or False), ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer`` and ``nn.TransformerEncoder`` all reach
``F.multi_head_attention_forward``, which is handled here on packed rows: one
in-projection GEMM over all rows, attention through
:func:`padless.ops.attention.attention`, one out-projection GEMM.

A NestedTensor has no padded "sequence-first" layout, but ``batch_first=True``
modules transpose their inputs with ``x.transpose(1, 0)`` before the attention
call. That transpose returns a :class:`SeqFirstView`: a thin wrapper that only
supports being transposed back and being passed to the attention call (anything
else raises). With ``batch_first=False`` pass NestedTensors as they are: a
NestedTensor's batch dim is never ambiguous.

``key_padding_mask`` is neither needed nor accepted: the structure says which keys
exist. ``attn_mask`` is a NestedTensor of per-sample ``(L_i, S_i)`` masks; with
``is_causal=True`` a dense causal mask (as the Transformer layers build it) is
replaced by per-sample top-left causal attention.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.attention.sdpa import attention
from padless.ops.common.structure import RAGGED, STATIC, restructure
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.convert import unbind_samples
from padless.tensor.core import NestedTensor, _is_traced
from padless.ops.common.seq_first import SeqFirstView, unwrap_seq_first as _unwrap
from padless.tensor.registry import implements


def _heads(nt: NestedTensor, rows: Tensor, num_heads: int) -> NestedTensor:
    """Rows ``(T, H*D)`` of a ``(L_i, E)`` NestedTensor as ``(H, L_i, D)`` samples (a view)."""
    t = rows.shape[0]
    hd = rows.shape[1] // num_heads
    return restructure(nt, rows.reshape(t, num_heads, hd), [(STATIC, num_heads), (RAGGED, 0), (STATIC, hd)])


def _explicit_weights(q, k, v, masks, dropout_p, is_causal, average: bool):
    """Per-sample softmax weights (returned by need_weights=True) and the matching output rows."""
    outs, weights = [], []
    qs, ks, vs = unbind_samples(q), unbind_samples(k), unbind_samples(v)
    scale = q.shape[-1] ** -0.5
    for i, (qi, ki, vi) in enumerate(zip(qs, ks, vs)):
        s = (qi * scale) @ ki.transpose(-1, -2)
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        if masks is not None:
            m = masks[i]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        w = torch.softmax(s, dim=-1)
        if dropout_p > 0:
            w = F.dropout(w, dropout_p)
        outs.append((w @ vi).transpose(0, 1))  # (L, H, D)
        weights.append(w.mean(0) if average else w)
    out = torch.cat(outs) if outs else values_of(q).new_empty((0, q.shape[1], v.shape[-1]))
    return out, weights


@implements(F.multi_head_attention_forward, accepts="packed (or SeqFirstView) query, key, value; dense weights")
def multi_head_attention_forward(
    func, query, key, value, embed_dim_to_check: int, num_heads: int, in_proj_weight, in_proj_bias,
    bias_k, bias_v, add_zero_attn: bool, dropout_p: float, out_proj_weight, out_proj_bias,
    training: bool = True, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
    use_separate_proj_weight: bool = False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
    static_k=None, static_v=None, average_attn_weights: bool = True, is_causal: bool = False,
):
    """The attention of ``nn.MultiheadAttention`` on packed rows (see module docstring)."""
    op = "multi_head_attention_forward"
    seq_first = isinstance(query, SeqFirstView)
    q, k, v = _unwrap(query), _unwrap(key), _unwrap(value)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, NestedTensor) or t.sample_dim != 2 or t._ragged != (0,):
            raise ValueError(f"{op}(): {name} must be a NestedTensor of (L_i, E) samples")
    if q.shape[-1] != embed_dim_to_check:
        raise ValueError(f"{op}(): query has embed dim {q.shape[-1]}, the module expects {embed_dim_to_check}")
    for what, x in (("bias_k/bias_v", bias_k if bias_k is not None else bias_v), ("static_k/static_v", static_k if static_k is not None else static_v)):
        if x is not None:
            raise NotImplementedError(f"{op}(): {what} is not supported with NestedTensor inputs")
    if add_zero_attn:
        raise NotImplementedError(f"{op}(): add_zero_attn is not supported with NestedTensor inputs")
    if key_padding_mask is not None:
        raise ValueError(
            f"{op}(): key_padding_mask is not needed with NestedTensor inputs (the structure says which keys "
            "exist) and is refused so that a padded mask cannot silently disagree with it"
        )
    mask_nt = None
    if attn_mask is not None:
        if isinstance(attn_mask, NestedTensor):
            mask_nt = attn_mask
        elif not is_causal:
            raise ValueError(
                f"{op}(): a dense attn_mask of shape {tuple(attn_mask.shape)} has no per-sample meaning; pass a "
                "NestedTensor of (L_i, S_i) masks, or is_causal=True for causal attention"
            )
    if not use_separate_proj_weight:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = q_proj_weight, k_proj_weight, v_proj_weight
    b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    qv = values_of(q)
    if q is k and k is v and not use_separate_proj_weight:
        qp, kp, vp = F.linear(qv, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    else:
        kv_rows = values_of(k)
        qp = F.linear(qv, w_q, b_q)
        kp = F.linear(kv_rows, w_k, b_k)
        vp = F.linear(values_of(v) if v is not k else kv_rows, w_v, b_v)
    qh, kh, vh = _heads(q, qp, num_heads), _heads(k, kp, num_heads), _heads(v if v is not k else k, vp, num_heads)
    p = dropout_p if training else 0.0
    weights = None
    if need_weights and _is_traced(qv):
        raise NotImplementedError(
            f"{op}(): need_weights=True does not run under torch.compile: the per-sample (L_i, S_i) weights "
            "have sum(L_i*S_i) rows, a count the graph cannot know. Call the module with need_weights=False "
            "(nn.TransformerEncoderLayer/DecoderLayer already do), or compute the weights outside the compiled region."
        )
    if need_weights:
        masks = None if mask_nt is None else unbind_samples(mask_nt)
        rows, w_list = _explicit_weights(qh, kh, vh, masks, p, is_causal, average_attn_weights)
        if w_list:
            weights = _pack(w_list, ragged=(0, 1) if average_attn_weights else (1, 2))
        out_rows = rows.reshape(rows.shape[0], -1)
    else:
        o = attention(qh, kh, vh, attn_mask=mask_nt, dropout_p=p, is_causal=is_causal)
        out_rows = values_of(o).reshape(o._values.shape[0], -1)
    out = rewrap(F.linear(out_rows, out_proj_weight, out_proj_bias), q)
    return (SeqFirstView(out) if seq_first else out), weights


def _pack(samples: list[Tensor], ragged: tuple[int, ...]) -> NestedTensor:
    from padless.tensor.construct import from_list

    return from_list(samples, ragged_dims=ragged, keep_history=True)
