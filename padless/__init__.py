"""padless: remove padding from PyTorch, from the file on disk to the loss."""

from padless.tensor import (
    NestedTensor,
    StructureError,
    from_list,
    from_njt,
    from_padded,
    from_packed_sequence,
    from_values,
    to_njt,
    to_packed_sequence,
    to_padded,
)
from padless import ops as _ops  # noqa: F401  (registers the op layer)
from padless import nested
from padless.ops import patch_grid
from padless.ops.vision import patchify
from padless.ops import unpatchify
from padless.ops.common.carried import prepare_for_compile
from padless.ops.common.padded import padded_reads, strict_padded_reads
from padless.ops.pairs.recipe import pair_plan_recipe
from padless.collation import Batch, Collator, Field, FlatteningCollator, collate  # noqa: F401  (after the op layer)
from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from padless.tensor.extents import extent_max, extent_min
from padless.tensor.lineage import same_batch

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Collator",
    "Field",
    "FlatteningCollator",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "NestedTensor",
    "StructureError",
    "collate",
    "extent_max",
    "extent_min",
    "from_list",
    "from_njt",
    "from_packed_sequence",
    "from_padded",
    "from_values",
    "nested",
    "padded_reads",
    "pair_plan_recipe",
    "patch_grid",
    "patchify",
    "prepare_for_compile",
    "same_batch",
    "strict_padded_reads",
    "to_njt",
    "to_packed_sequence",
    "to_padded",
    "unpatchify",
]
