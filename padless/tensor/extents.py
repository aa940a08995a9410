"""Envelope extents that remember their batch.

``x.shape`` of a NestedTensor is the padded envelope ``(B, max n_0, ...)``, so that code
reading shapes keeps working. Model code often hands such a size on: smp's U-Net decoder
reads ``skip.shape[2:]`` and later calls ``F.interpolate(x, size=(h, w))`` to bring ``x``
to its skip's size. Dense, that is "to the padded envelope"; per sample, it means "to this
sample's own skip size". To tell the two apart, the entries of ``x.shape`` (and
``x.size()``, ``x.size(d)``) at ragged dims are :class:`Extent` ints: plain ints (equal to
the envelope extent, usable anywhere an int is) that also remember every sample's own size
along that dim. Ops that take a size and can apply one per image
(:func:`padless.ops.vision.resample.interpolate`) read it; every other use sees an int.

Integer arithmetic keeps both readings (``height // 4`` is the padded ``H // 4`` and every
sample's ``h_i // 4``); ``int(h)`` is the plain padded int. An Extent pickles and copies as a
plain int. Under ``torch.compile`` shapes are the plain (symbolic) sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Extent", "envelope_shape", "envelope_size", "per_sample_extents"]


class Extent(int):
    """An envelope extent of a ragged dim: an int that also knows each sample's own size.

    Its int value is what the padded code sees (the envelope); :meth:`per_sample` is what
    each sample alone sees. Integer arithmetic keeps both: ``h // 4`` is the padded
    ``H // 4`` and every sample's ``h_i // 4`` (smp's PAN writes
    ``F.interpolate(x, size=(height // 4, width // 4))``); ``h * w`` of two extents of one
    batch multiplies sample by sample.

    >>> h = images.shape[-2]          # an Extent: int(h) is the largest height
    >>> F.interpolate(x, size=(h, w))  # each image of x to its own sample's (h_i, w_i)
    """

    _batch: int
    _src_sizes: Tensor | None  # the batch's sizes when read straight from a shape
    _values: Any  # () -> list[int]

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__

    def __reduce__(self):  # copies, pickles and deep-copies as the plain int
        return (int, (int(self),))

    @property
    def batch_size(self) -> int:
        """Samples of the batch this extent was read from."""
        return self._batch

    def per_sample(self) -> list[int]:
        """Every sample's own value (host ints; reading a device batch built without host
        metadata syncs once, as :meth:`NestedTensor.host_sizes` does)."""
        return self._values()


def _derived(value: Any, batch: int, values: Any) -> Any:
    if type(value) is not int:
        return value  # true division, floats, NotImplemented: the plain result
    e = Extent(value)
    e._batch, e._src_sizes, e._values = batch, None, values
    return e


def _binary(name: str, reflected: bool = False):
    op = getattr(int, name)

    def method(self: Extent, other: Any) -> Any:
        value = op(self, other)
        if isinstance(other, Extent):
            if other._batch != self._batch:
                return value  # two batches: only the padded int is meaningful
            a, b = self._values, other._values
            return _derived(value, self._batch, lambda: [op(x, y) for x, y in zip(a(), b())])
        if type(other) is not int:
            return value
        a = self._values
        return _derived(value, self._batch, lambda: [op(x, other) for x in a()])

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__"):
    setattr(Extent, _name, _binary(_name))


def _neg(self: Extent) -> Any:
    a = self._values
    return _derived(-int(self), self._batch, lambda: [-x for x in a()])


Extent.__neg__ = _neg


def _read_sizes(meta: Any, sizes: Tensor, dim: int):
    def values() -> list[int]:
        if meta.host_sizes is None:
            meta.host_sizes = sizes.cpu()
        return meta.host_sizes[:, dim].tolist()

    return values


_tracing = torch._guards.TracingContext.try_get


def _extent(value: int, meta: Any, sizes: Tensor, dim: int) -> Extent:
    e = Extent(value)
    # the batch's (small) structure, not its values
    e._batch, e._src_sizes, e._values = len(sizes), sizes, _read_sizes(meta, sizes, dim)
    return e


def _shape(nt: Any) -> torch.Size:
    if torch.compiler.is_compiling() or _tracing() is not None:
        return Tensor.shape.__get__(nt)  # dynamo traces or wraps it: the plain (symbolic) sizes
    cached = nt.__dict__.get("_extent_shape")
    if cached is not None:
        return cached
    env = nt._env
    if not all(type(v) is int for v in env):
        return Tensor.shape.__get__(nt)
    meta, sizes = nt._meta, nt._sizes
    dims = [len(sizes), *env]
    for d in nt._ragged:
        dims[d + 1] = _extent(env[d], meta, sizes, d)
    out = torch.Size(dims)
    nt.__dict__["_extent_shape"] = out
    return out


def envelope_shape(nt: Any) -> torch.Size:
    """``nt.shape``: the padded envelope, with :class:`Extent` entries at ragged dims."""
    return _shape(nt)


def envelope_size(nt: Any, dim: int | None = None) -> Any:
    """``nt.size()`` / ``nt.size(dim)``, as :func:`envelope_shape`."""
    shape = _shape(nt)
    if dim is None:
        return shape
    n = len(shape)
    if not isinstance(dim, int) or isinstance(dim, bool):
        return Tensor.size(nt, dim)  # a named dim etc.: torch's own answer (or error)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return shape[dim]


def per_sample_extents(values: Any, batch: int, op: str) -> list[tuple[int, ...]] | None:
    """Per-sample targets named by a size tuple holding :class:`Extent` entries, else ``None``.

    Each Extent entry gives every sample its own size (from the batch it was read from);
    plain int entries give every sample the same size. Extents from a batch of another
    sample count are refused, naming the fix.
    """
    if not isinstance(values, (tuple, list)) or not any(isinstance(v, Extent) for v in values):
        return None
    columns: list[list[int]] = []
    for i, v in enumerate(values):
        if isinstance(v, Extent):
            if v.batch_size != batch:
                from padless.tensor.errors import StructureError

                raise StructureError(
                    f"{op}(): size[{i}] = {int(v)} was read from the shape of a batch of {v.batch_size} samples, "
                    f"and this input has {batch}; a size read from a NestedTensor's shape means each sample's own "
                    f"size. Pass int(...) to give every sample the envelope size {int(v)}"
                )
            columns.append(v.per_sample())
        else:
            columns.append([int(v)] * batch)
    return [tuple(c[b] for c in columns) for b in range(batch)]
