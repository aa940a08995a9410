"""The NestedTensor: representation, construction, accessors, conversion and dispatch."""

from padless.tensor import behaviour as _behaviour  # noqa: F401  (registers tensor-behaviour handlers)
from padless.tensor import fallback as _fallback  # noqa: F401  (lends core the per-sample fallback)
from padless.tensor import fast_grad as _fast_grad  # noqa: F401  (lends core elementwise ops with grad on rows)
from padless.tensor import grad_rows as _grad_rows  # noqa: F401  (gradients of intermediates read on their rows)
from padless.tensor.construct import from_list, from_njt, from_padded, from_values
from padless.tensor.convert import to_njt, to_padded, unbind_samples, valid_mask
from padless.tensor.core import NestedTensor, StructureMeta, _rebuild_nested
from padless.tensor.errors import StructureError
from padless.tensor.lineage import Lineage
from padless.tensor.extents import Extent, envelope_shape, envelope_size, extent_max, extent_min
from padless.tensor.packed import from_packed_sequence, to_packed_sequence


def _attach() -> None:
    NestedTensor.from_list = staticmethod(from_list)
    NestedTensor.from_padded = staticmethod(from_padded)
    NestedTensor.from_values = staticmethod(from_values)
    NestedTensor.from_njt = staticmethod(from_njt)
    NestedTensor.from_packed_sequence = staticmethod(from_packed_sequence)

    def to_padded_(self, value: float = 0.0, output_size=None):
        """Dense ``(B, *envelope)`` copy, ``value`` in padded positions. Differentiable.

        Never syncs when the batch carries host metadata."""
        return to_padded(self, value, output_size)

    def mask_(self):
        """Bool ``(B, *envelope)``: True at real elements. Never syncs with host metadata."""
        return valid_mask(self)

    def to_njt_(self):
        """``torch.nested`` jagged tensor with the same samples (one ragged dim). Keeps autograd."""
        return to_njt(self)

    def to_packed_sequence_(self, enforce_sorted: bool = False):
        """``torch.nn.utils.rnn.PackedSequence`` of the samples (one ragged dim, the first; none
        empty). One row gather, no sync with host metadata. Differentiable."""
        return to_packed_sequence(self, enforce_sorted)

    # ``x.shape`` / ``x.size()``: the envelope, whose ragged entries remember each sample's
    # own size (padless.tensor.extents), so ``F.interpolate(x, size=skip.shape[2:])`` works.
    NestedTensor.shape = property(envelope_shape, doc=envelope_shape.__doc__)
    NestedTensor.size = envelope_size
    NestedTensor.to_padded = to_padded_
    NestedTensor.mask = mask_
    NestedTensor.to_njt = to_njt_
    NestedTensor.to_packed_sequence = to_packed_sequence_


_attach()

from padless.tensor import dynamo as _dynamo  # noqa: E402

_dynamo.install()

try:  # torch.load(weights_only=True) must rebuild NestedTensors without user set-up.
    import torch.serialization as _ser

    # ``int``: a size read from a shape (an Extent) pickles as ``int(n)``
    _ser.add_safe_globals([NestedTensor, _rebuild_nested, Lineage, int])
except AttributeError:  # pragma: no cover - torch < 2.4
    pass

__all__ = [
    "Extent",
    "extent_max",
    "extent_min",
    "NestedTensor",
    "StructureMeta",
    "StructureError",
    "from_list",
    "from_padded",
    "from_values",
    "from_njt",
    "from_packed_sequence",
    "to_padded",
    "to_njt",
    "to_packed_sequence",
    "unbind_samples",
    "valid_mask",
]
