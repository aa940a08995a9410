"""``FlatteningCollator``: one object a Hugging Face ``Trainer`` takes as ``data_collator``.

Tokenizer output in (dicts with ``input_ids`` as Python lists or tensors, optionally
their own ``labels``), the padding-free keyword arguments of transformers out, so that
``model(**batch)`` runs every sample of the batch as one packed row::

    features  {"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": []}
    batch     input_ids     [[5, 6, 7, 8, 9]]           (1, T) int64
              position_ids  [[0, 1, 2, 0, 1]]           (1, T) int64
              labels        [[-100, 6, 7, -100, 9]]     (1, T) int64: separator at each sample start
              cu_seq_lens_q = cu_seq_lens_k = [0, 3, 5] int32
              max_length_q = max_length_k = 3           python ints
              use_cache     False                       (causal models; see below)

The same tensors as ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
(``tests/collation/test_hf_transformers.py`` compares them), plus what padless adds: samples
that carry their own ``labels`` keep them (prompt tokens masked with -100 stay masked; the
separator goes on top), empty samples are dropped as transformers does (they would be
zero-length segments of ``cu_seq_lens``), ``use_cache=False`` for causal models (transformers
only splits a packed row into its samples when no cache exists), and optionally a
block-diagonal ``attention_mask`` for encoders whose eager/sdpa attention would otherwise mix
the samples (``block_mask=True``; see :func:`padless.collation.interop.hf_kwargs`).

Which attention implementation to load the model with: eager, sdpa and flex attention turn
the packed row into a block-diagonal ``T x T`` mask (every cross-sample score computed, then
discarded); ``flash_attention_2`` (GPU, flash-attn) or ``"padless"`` (any device: ``import
padless.hf`` registers it; per-document attention from ``cu_seq_lens_*``, no mask, encoders
need no ``block_mask``) run only the scores inside each sample. See docs/data.md.

Everything is computed in the DataLoader worker that collates the batch. transformers is
not imported here.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Sequence

import torch

from padless.collation.collator import Collator, Field
from padless.collation.samples import NUMBER, TENSOR, kind

_FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class FlatteningCollator:
    """Pack tokenized samples into one ``(1, T)`` row with the metadata transformers needs.

    separator_id              label at each sample's first token (-100: ignored by the loss)
    position_ids_start        first position of every sample (2 for RoBERTa-style models)
    return_position_ids       include ``position_ids`` (needed by eager/sdpa/flex to split samples)
    return_flash_attn_kwargs  include ``cu_seq_lens_q/k`` and ``max_length_q/k``
    return_seq_idx            include ``seq_idx`` ``(1, T)`` int32 (each token's sample index)
    causal                    the model is a decoder: add ``use_cache=False``
    block_mask                add a ``(1, 1, T, T)`` additive ``attention_mask`` of ``mask_dtype``
                              that keeps samples apart in any attention implementation
    field                     the token field of the features (``input_ids``)

    >>> import padless
    >>> c = padless.FlatteningCollator()
    >>> b = c([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["cu_seq_lens_q"].tolist()
    ([[5, 6, 7, 8, 9]], [[-100, 6, 7, -100, 9]], [0, 3, 5])
    """

    def __init__(
        self,
        *,
        separator_id: int = -100,
        position_ids_start: int = 0,
        return_position_ids: bool = True,
        return_flash_attn_kwargs: bool = True,
        return_seq_idx: bool = False,
        causal: bool = True,
        block_mask: bool = False,
        mask_dtype: torch.dtype = torch.float32,
        field: str = "input_ids",
    ) -> None:
        self.separator_id = separator_id
        self.position_ids_start = position_ids_start
        self.return_position_ids = return_position_ids
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.causal = causal
        self.block_mask = block_mask
        self.mask_dtype = mask_dtype
        self.field = field
        self._collators: dict[int, Collator] = {}

    def __repr__(self) -> str:
        return (
            f"FlatteningCollator(separator_id={self.separator_id}, position_ids_start={self.position_ids_start}, "
            f"causal={self.causal}, block_mask={self.block_mask}, field={self.field!r})"
        )

    def _collator(self, separator_id: int) -> Collator:
        c = self._collators.get(separator_id)
        if c is None:
            spec = Field(
                ragged=0,
                dtype=torch.int64,
                position_ids="position_ids",
                position_start=self.position_ids_start,
                labels="labels",
                label_separator=separator_id,
                seq_idx="seq_idx" if self.return_seq_idx else None,
            )
            c = self._collators[separator_id] = Collator({self.field: spec})
        return c

    def __call__(
        self, features: Sequence[Any], return_tensors: str | None = None, separator_id: int | None = None
    ) -> dict[str, Any]:
        """The batch as a dict of ``model(**batch)`` keyword arguments (``return_tensors``: "pt" only)."""
        if return_tensors not in (None, "pt"):
            raise ValueError(f"FlatteningCollator: return_tensors={return_tensors!r}; only 'pt' is supported")
        rows = self._rows(features)
        sep = self.separator_id if separator_id is None else separator_id
        batch = self._collator(sep)(rows)
        out = batch.hf_kwargs(self.field, causal=self.causal, block_mask=self.block_mask, mask_dtype=self.mask_dtype)
        if not self.return_position_ids:
            del out["position_ids"]
        if not self.return_flash_attn_kwargs:
            for k in _FLASH_KEYS:
                del out[k]
        if self.return_seq_idx:
            out["seq_idx"] = batch["seq_idx"].values().unsqueeze(0)
        return out

    def _rows(self, features: Sequence[Any]) -> list[dict[str, Any]]:
        """The token field (and the samples' own labels) of every non-empty feature."""
        if isinstance(features, (str, bytes)) or not isinstance(features, collections.abc.Sequence):
            raise TypeError(f"FlatteningCollator: expected a list of features, got {type(features).__name__}")
        rows = []
        for i, f in enumerate(features):
            if not isinstance(f, collections.abc.Mapping) or self.field not in f:
                what = f"has keys {list(f.keys())}" if isinstance(f, collections.abc.Mapping) else f"is a {type(f).__name__}"
                raise TypeError(
                    f"FlatteningCollator: feature {i} {what}; every feature needs a {self.field!r} key "
                    "(a dict, as a tokenizer returns)"
                )
            ids = f[self.field]
            if _length(ids, self.field, i) == 0:
                continue  # as transformers' DataCollatorWithFlattening: an empty sample is dropped
            row = {self.field: ids}
            if "labels" in f:
                row["labels"] = f["labels"]
            if rows and len(row) != len(rows[0]):
                what = "has 'labels' but earlier features have none" if "labels" in row else (
                    "has no 'labels' but earlier features have them")
                raise KeyError(
                    f"FlatteningCollator: feature {i} {what}; give every feature its labels "
                    "(-100 where no loss applies) or none"
                )
            rows.append(row)
        if not rows:
            raise ValueError(
                f"FlatteningCollator: every feature's {self.field!r} is empty ({len(features)} features); "
                "filter empty samples out of the dataset"
            )
        return rows


def _length(ids: Any, field: str, i: int) -> int:
    k = kind(ids)
    if k == TENSOR and getattr(ids, "ndim", 1) == 1:
        return int(ids.shape[0])
    if isinstance(ids, list) and all(kind(v) == NUMBER for v in ids[:1]):
        return len(ids)
    raise TypeError(
        f"FlatteningCollator: feature {i}'s {field!r} is a {type(ids).__name__}"
        f"{' of shape ' + str(tuple(ids.shape)) if hasattr(ids, 'shape') else ''}; "
        "it needs a list of token ids or a 1-D tensor"
    )
