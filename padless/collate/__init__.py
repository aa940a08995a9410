"""Collation of variable-size samples into packed batches, computed in the DataLoader worker.

* :func:`collate`: a drop-in for ``torch.utils.data.default_collate`` that packs
  fields of differing shapes into NestedTensors instead of failing or padding;
* :class:`Collator` with :class:`Field`: a schema (ragged dims, casts, pair maps,
  position ids, sample ids, labels, pad-to-multiple), returning a :class:`Batch`;
* :class:`Batch`: dict-like with attribute access; ``pin_memory()``,
  ``to(device, non_blocking=True)`` in one copy per dtype, ``record_stream()``,
  and ``flash_attn_kwargs`` / ``hf_kwargs`` / ``padded`` for kernels and models;
* :class:`FlatteningCollator`: a Hugging Face ``Trainer`` ``data_collator`` (tokenizer
  output in, ``model(**batch)`` keyword arguments out).
"""

from padless.collate.batch import Batch
from padless.collate.collate import collate
from padless.collate.collator import Collator, Field
from padless.collate.hf import FlatteningCollator
from padless.collate.metadata import FieldMeta, PairMaps, RowMaps
from padless.collate.opcache import collated_plan
from padless.ops.common.broadcast import PLAN_PROVIDERS

if collated_plan not in PLAN_PROVIDERS:  # pair maps made in the worker serve derived fields too
    PLAN_PROVIDERS.append(collated_plan)

__all__ = ["Batch", "Collator", "Field", "FieldMeta", "FlatteningCollator", "PairMaps", "RowMaps", "collate", "collated_plan"]
