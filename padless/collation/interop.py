"""What attention kernels and model libraries take, read from a collated batch.

For ``ids`` samples of lengths ``2, 0, 3`` (``T = 5``)::

    flash_attn_kwargs("ids")  cu_seqlens_q = cu_seqlens_k = [0, 2, 2, 5] (int32), max_seqlen_q/k = 3
    hf_kwargs("ids")          input_ids (1, 5), position_ids (1, 5) = [[0, 1, 0, 1, 2]],
                              cu_seq_lens_q/k (int32), max_length_q/k = 3 (python ints)
    padded("ids")             (B, 3) tensor and (B, 3) bool mask, True on real tokens

Every value comes from metadata computed in the worker: no host sync, no
structure computation in the training loop.

One structure, three naming schemes::

    padless                          flash-attn varlen            Hugging Face transformers
    x.values()  (T, *static)         q, k, v  (T, H, D)           input_ids (1, T) / inputs_embeds (1, T, C)
    x.cu_seqlens()  int32 (B+1,)     cu_seqlens_q, cu_seqlens_k   cu_seq_lens_q, cu_seq_lens_k
    x.max_seqlen()  python int       max_seqlen_q, max_seqlen_k   max_length_q, max_length_k
    Field(position_ids="pos")        (rotary positions: yours)    position_ids (1, T)
    Field(seq_idx="seq_idx") int32   -                            seq_idx (1, T) int32
    Field(labels="labels")           -                            labels (1, T), -100 at sample starts
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from padless.collation.opcache import field_meta
from padless.tensor.convert import _padded_index
from padless.tensor.core import NestedTensor


class BatchLike(Protocol):
    """What these functions read from a batch: its fields by name. A
    :class:`padless.collation.batch.Batch` is one; ``Batch`` imports this module (its
    ``flash_attn_kwargs``/``hf_kwargs``/``padded`` methods call these), never the reverse."""

    def __getitem__(self, field: str) -> Any: ...


def _ragged(batch: BatchLike, field: str, op: str, one_dim: bool) -> NestedTensor:
    x = batch[field]
    if not isinstance(x, NestedTensor):
        raise TypeError(
            f"Batch.{op}(): field {field!r} is a {type(x).__name__}, not a NestedTensor; "
            "declare it ragged (Collator(fields={..: Field(ragged=0)}))"
        )
    if one_dim and x._ragged != (0,):
        raise ValueError(
            f"Batch.{op}(): field {field!r} has ragged dims {x.ragged_dims}; {op} needs samples "
            "ragged along their first dim only (token sequences)"
        )
    return x


def flash_attn_kwargs(batch: BatchLike, field: str, key_field: str | None = None) -> dict[str, Any]:
    """``cu_seqlens_q/k`` (int32, on the batch's device) and ``max_seqlen_q/k`` (python ints)
    for ``flash_attn_varlen_func``; ``key_field`` for cross-attention (default: ``field``)."""
    q = _ragged(batch, field, "flash_attn_kwargs", True)
    k = q if key_field is None else _ragged(batch, key_field, "flash_attn_kwargs", True)
    return {
        "cu_seqlens_q": q.cu_seqlens(),
        "cu_seqlens_k": k.cu_seqlens(),
        "max_seqlen_q": int(q.max_seqlen()),
        "max_seqlen_k": int(k.max_seqlen()),
    }


def hf_kwargs(
    batch: BatchLike,
    field: str,
    *,
    causal: bool = True,
    block_mask: bool = False,
    mask_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Keyword arguments of Hugging Face transformers' padding-free path: ``model(**kwargs)``.

    ``input_ids`` ``(1, T)`` (``inputs_embeds`` ``(1, T, C)`` for a float field),
    ``position_ids`` ``(1, T)`` (the field's declared ``position_ids`` output, else
    0-based positions from its row maps), ``cu_seq_lens_q/k`` (int32),
    ``max_length_q/k`` (python ints), ``labels`` ``(1, T)`` when the field declares a
    ``labels`` output, and ``use_cache=False`` for a causal model (``causal=True``, the
    default): transformers only splits a packed row into its samples when no cache exists.

    Which models keep the samples apart (checked against each sample run alone in
    ``tests/collation/test_hf_transformers.py``, transformers 5.x):

    * decoders (Llama and models built like it) with ``eager``, ``sdpa`` or
      ``flex_attention``: yes, from ``position_ids`` when ``use_cache=False``;
      ``flash_attention_2/3`` (CUDA): yes, from ``cu_seq_lens_q/k``;
    * encoders (BERT-style) with ``eager`` or ``sdpa``: **no**, they attend across samples;
      pass ``block_mask=True`` to add a ``(1, 1, T, T)`` additive ``attention_mask`` of
      ``mask_dtype`` (0 inside a sample, the dtype's minimum elsewhere; causal too when
      ``causal=True``). It costs ``T * T`` elements: for long packed rows use flash-attention.
    """
    x = _ragged(batch, field, "hf_kwargs", True)
    fm = field_meta(x)
    outputs = fm.outputs if fm is not None else {}
    key = "inputs_embeds" if x.dtype.is_floating_point else "input_ids"
    out: dict[str, Any] = {key: x.values().unsqueeze(0)}
    if "position_ids" in outputs:
        out["position_ids"] = batch[outputs["position_ids"]].values().unsqueeze(0)
    elif fm is not None and fm.rows is not None:
        out["position_ids"] = fm.rows.coords[0].unsqueeze(0)
    else:  # computed on the device from cached row ids: no sync
        t = x._values.shape[0]
        pos = torch.arange(t, device=x.device) - x.offsets()[:-1].index_select(0, x.row_sample_ids())
        out["position_ids"] = pos.unsqueeze(0)
    cu = x.cu_seqlens()
    m = int(x.max_seqlen())
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
    if "labels" in outputs:
        out["labels"] = batch[outputs["labels"]].values().unsqueeze(0)
    if block_mask:
        out["attention_mask"] = sample_block_mask(x, causal, mask_dtype)
    if causal:
        out["use_cache"] = False
    return out


def sample_block_mask(x: NestedTensor, causal: bool, dtype: torch.dtype) -> Tensor:
    """``(1, 1, T, T)`` additive mask over the packed rows of ``x``: 0 where query and key rows
    belong to one sample (and, when ``causal``, the key does not follow the query), the dtype's
    minimum elsewhere."""
    sid = x.row_sample_ids()
    keep = sid[:, None] == sid[None, :]
    if causal:
        keep = torch.tril(keep)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=x.device)
    return torch.where(keep, zero, low)[None, None]


def padded(batch: BatchLike, field: str, value: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(padded, mask)``: the field as a dense ``(B, *envelope)`` tensor with ``value`` in the
    padding, and a bool mask over its ragged dims (``(B, L)`` for ``(L_i, C)`` samples,
    ``(B, H, W)`` for ``(C, H_i, W_i)`` images), True on real positions."""
    x = _ragged(batch, field, "padded", False)
    return x.to_padded(value), ragged_mask(x)


def ragged_mask(x: NestedTensor) -> Tensor:
    """Bool ``(B, *envelope of the ragged dims)`` (ascending dims), True on real positions."""
    env = list(x._env)
    idx = _padded_index(x, env)
    store = x._ragged
    b = x.batch_size
    grid = torch.zeros(b * math.prod(env[d] for d in store), dtype=torch.bool, device=x.device)
    grid = grid.index_fill_(0, idx, True).reshape(b, *[env[d] for d in store])
    return grid.permute(0, *[1 + store.index(d) for d in sorted(store)])
