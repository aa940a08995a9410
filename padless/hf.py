"""Hugging Face transformers: ``attn_implementation="padless"``, packed attention with no mask.

Importing this module registers an attention function and a mask function under the name
``"padless"`` with transformers' public ``AttentionInterface`` / ``AttentionMaskInterface``
(:func:`register` does it again, idempotently)::

    import padless.hf                       # registers attn_implementation="padless"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="padless")
    # or: model.set_attn_implementation("padless") / config._attn_implementation = "padless"

What the attention function runs, per call:

* **a packed row** from :class:`padless.FlatteningCollator` (``(1, T)`` inputs with
  ``cu_seq_lens_q/k`` in the keyword arguments, or, without them, ``position_ids`` that
  restart at every sample): attention per document on the packed rows through
  :func:`padless.ops.attention.attention` (torch's SDPA per sample and per group of equal
  lengths on the CPU; variable-length flash attention on CUDA in fp16/bf16). The mask
  function returns no mask for it, so no ``T x T`` mask is ever built, for decoders
  (causal within each sample) and encoders (BERT-style) alike: encoders need no
  ``block_mask=True``.
* **a NestedTensor** (``model(inputs_embeds=nt)``): SDPA on the NestedTensor, as ``"sdpa"``.
* **anything else** (a padded batch with an ``attention_mask``, sliding-window or
  chunked masks, decoding with a cache, a position bias, softcapping or attention sinks):
  transformers' own ``"sdpa"`` function and mask, unchanged.

``use_cache=False`` is needed for packed decoder rows without ``cu_seq_lens_*`` (the mask
preprocessing of transformers looks at ``position_ids`` only without a cache);
:class:`padless.FlatteningCollator` adds it.

Requires transformers (``pip install transformers``); padless itself never imports this
module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from padless.ops.attention import attention
from padless.tensor import from_values
from padless.tensor.autograd import rewrap
from padless.tensor.core import NestedTensor

try:
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("padless.hf needs transformers: pip install 'padless[hf]' (or pip install transformers)") from e

NAME = "padless"


def register(name: str = NAME) -> str:
    """Register the attention and mask functions with transformers under ``name``; returns it."""
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.masking_utils.AttentionMaskInterface.register(name, mask)
    return name


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """No mask where the attention function needs none (no padding mask and no local
    window: full or causal attention, packed rows included); otherwise transformers' SDPA mask."""
    if attention_mask is None and local_size is None:
        return None
    args = dict(q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask, local_size=local_size)
    if mask_function is not None:
        args["mask_function"] = mask_function
    return sdpa_mask(batch_size, q_length, kv_length, **args, **kwargs)


# Keyword arguments the packed path does not implement: with any of them the call goes to sdpa.
_NOT_PACKED = ("position_bias", "sliding_window", "softcap", "s_aux")


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: ``(B, H, L, E)`` query/key/value in, ``(B, L, H, E)`` out."""
    plain = all(kwargs.get(k) is None for k in _NOT_PACKED)
    if plain and attention_mask is None and not isinstance(query, NestedTensor) and query.shape[0] == 1:
        structure = _packed(query, key, kwargs)
        if structure is not None:
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            gqa = getattr(module, "num_key_value_groups", 1) > 1
            return _packed_attention(query, key, value, structure, dropout, scaling, bool(causal), gqa), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


# ---------------------------------------------------------------------------- packed rows


class _Structures:
    """One entry per batch: the row structures of the packed row, shared by every layer."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: tuple[NestedTensor, NestedTensor] | None = None  # None: not a packed row


_cache = _Structures()


def _template(cu: Tensor, max_len: int | None, rows: Tensor) -> NestedTensor:
    """A NestedTensor of ``rows``' shape over the samples ``cu`` delimits, holding no data."""
    t, *static = rows.shape
    stub = rows.new_empty((1,) * rows.dim()).expand(t, *static)
    offsets = cu.to(torch.int64)
    return from_values(stub, offsets, max_seqlen=max_len, validate=False)


def _starts(position_ids: Tensor) -> Tensor | None:
    """``cu_seqlens`` of a ``(1, T)`` row whose positions restart at each sample (transformers'
    rule: a sample starts where the position does not follow the previous one); None for one sample."""
    pos = position_ids.reshape(-1)
    if pos.numel() < 2:
        return None
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] - pos[:-1] != 1  # (a chunk continuing a cache is one run: not packed)
    idx = start.nonzero().reshape(-1)
    if idx.numel() < 2:
        return None
    return torch.cat([idx, idx.new_tensor([pos.numel()])])


def _packed(query: Tensor, key: Tensor, kwargs: dict) -> tuple[NestedTensor, NestedTensor] | None:
    """The query and key row structures of a packed ``(1, T)`` call, or None when it is not one."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    pos = kwargs.get("position_ids")
    source = cu_q if cu_q is not None else pos
    if source is None:
        return None
    tq, tk = query.shape[2], key.shape[2]
    ck = (source, cu_k, tq, tk, query.shape[1], key.shape[1], query.shape[3], query.device)
    if _cache.key is not None and all(a is b if isinstance(a, Tensor) else a == b for a, b in zip(_cache.key, ck)):
        return _cache.value
    if cu_q is None:
        cu_q = _starts(pos) if tq == tk and pos.dim() <= 2 and pos.shape[-1] == tq else None
        if cu_q is None:
            _cache.key, _cache.value = ck, None  # one sample: every layer of this call runs dense
            return None
        cu_k, mq, mk = cu_q, None, None
    else:
        if cu_k is None or (cu_k is not cu_q and cu_k.device.type == "cpu" and torch.equal(cu_k, cu_q)):
            cu_k = cu_q  # one structure for queries and keys
        mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q.device.type == "cpu":  # (on a device the collator's metadata is trusted: no sync)
        for name, cu, t in (("cu_seq_lens_q", cu_q, tq), ("cu_seq_lens_k", cu_k, tk)):
            if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != t:
                raise ValueError(
                    f"padless attention: {name} = {cu.tolist()} must run from 0 to the packed row's "
                    f"{t} tokens (as FlatteningCollator makes it)"
                )
    q_rows = query[0].transpose(0, 1)
    k_rows = key[0].transpose(0, 1)
    qs = _template(cu_q, mq, q_rows)
    ks = qs if (cu_k is cu_q and tq == tk and k_rows.shape == q_rows.shape) else _template(cu_k, mk, k_rows)
    _cache.key, _cache.value = ck, (qs, ks)
    return qs, ks


def _on(rows: Tensor, like: NestedTensor) -> NestedTensor:
    """``rows`` ``(T, H, E)`` as ``(H, L_i, E)`` samples over ``like``'s structure."""
    if rows.shape[1:] != like._values.shape[1:]:
        like = _template(like._offsets, None, rows)
    return rewrap(rows, like).transpose(1, 2)


def _packed_attention(query, key, value, structure, dropout, scaling, causal, gqa) -> Tensor:
    qs, ks = structure
    q = _on(query[0].transpose(0, 1), qs)
    k = _on(key[0].transpose(0, 1), ks)
    v = _on(value[0].transpose(0, 1), ks)
    out = attention(q, k, v, dropout_p=dropout, is_causal=causal and query.shape[2] > 1, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).values().unsqueeze(0)


register()
