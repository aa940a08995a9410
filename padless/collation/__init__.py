"""Collation of variable-size samples into packed batches, computed in the DataLoader worker.

The functions and classes of this package are public as ``padless.collate``, ``padless.Collator``,
``padless.Field``, ``padless.Batch`` and ``padless.FlatteningCollator``; ``padless.collate`` is the
function (this package is ``padless.collation``, so the two names never shadow each other).
The two entry points return different things, on purpose:

=============================  ==============================================================
``padless.collate(samples)``   the samples' own container type (a ``dict`` for dict samples,
                               a tuple for tuples, ...), as ``default_collate``: a drop-in
``padless.Collator(schema)``   a :class:`Batch` (dict-like, attribute access, ``pin_memory()``,
                               one-copy ``to(device)``, derived outputs such as position ids)
=============================  ==============================================================

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

from padless.collation.batch import Batch
from padless.collation.collate import collate
from padless.collation.collator import Collator, Field
from padless.collation.hf import FlatteningCollator
from padless.collation.metadata import FieldMeta, PairMaps, RowMaps
from padless.collation.opcache import collated_plan
from padless.ops.common.broadcast import PLAN_PROVIDERS

if collated_plan not in PLAN_PROVIDERS:  # pair maps made in the worker serve derived fields too
    PLAN_PROVIDERS.append(collated_plan)

__all__ = ["Batch", "Collator", "Field", "FieldMeta", "FlatteningCollator", "PairMaps", "RowMaps", "collate", "collated_plan"]
