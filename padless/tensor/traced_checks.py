"""Structure checks that a compiled graph runs: separately built batches compared as in eager.

Eagerly, combining two NestedTensors whose structures are different objects compares
their sizes on the host (``add(): ragged structures differ: sample 1 has (3, 8), other
has (2, 8) ...``). Inside a compiled graph sizes are runtime tensors: reading them while
tracing would be a data-dependent ``.item()``, and ``torch._check`` on data would need
the same. Instead the graph calls ``padless::check_same_sizes``, a ``torch.library``
custom op with no output, registered as an *ordered effect* so that no compiler pass
removes or reorders it. When the graph runs it compares the sizes:

* on the CPU it raises the eager error, word for word (a :class:`StructureError`, which
  is a ``ValueError`` as the eager error is);
* on other devices it never syncs: ``torch._assert_async`` fails on the device with the
  op name and "ragged structures differ" (the sample is not named, since that would need
  the sizes on the host).

A compiled op adds the check only for operands whose structures are distinct objects; ops
on one batch's rows share their structure and pay nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._library.effects import EffectType

from padless.tensor.errors import StructureError


def _fmt(row: list[int]) -> str:
    return "(" + ", ".join(str(int(x)) for x in row) + (",)" if len(row) == 1 else ")")


def mismatch_message(a: list[list[int]], b: list[list[int]], ragged: list[int], opname: str, broadcast: bool) -> str | None:
    """The eager error for host sizes ``a`` and ``b`` (None when the ragged extents agree)."""
    if len(a) != len(b):
        return f"{opname}(): ragged structures differ: batch sizes differ: {len(a)} vs {len(b)}"
    differ = [i for i, (u, v) in enumerate(zip(a, b)) if any(u[d] != v[d] for d in ragged)]
    if not differ:
        return None
    if broadcast:  # eager broadcasting names the first sample whose extents clash (neither is 1)
        clash = [i for i in differ if any(x != y and 1 not in (x, y) for x, y in zip(a[i], b[i]))]
        if clash:
            i = clash[0]
            return (
                f"{opname}(): ragged structures differ: sample {i} has {_fmt(a[i])}, other has {_fmt(b[i])} "
                "(extents must agree or be 1 in every dim of every sample)"
            )
        i = differ[0]
        return (
            f"{opname}(): ragged structures differ: sample {i} has {_fmt(a[i])}, other has {_fmt(b[i])} "
            "(an extent of 1 broadcasts against a ragged extent only eagerly: under torch.compile "
            "the operands must have equal ragged extents; expand the operand first)"
        )
    i = differ[0]
    return f"{opname}(): ragged structures differ: sample {i} has {_fmt(a[i])}, other has {_fmt(b[i])}"


@torch.library.custom_op("padless::check_same_sizes", mutates_args=())
def check_same_sizes(a: Tensor, b: Tensor, ragged: list[int], opname: str, broadcast: bool) -> None:
    """Raise when sizes ``a`` and ``b`` (``(B, D)`` int64) differ along the ``ragged`` dims
    (see the module doc); ``broadcast``: word the error as pointwise broadcasting does."""
    if a.device.type == "cpu" and b.device.type == "cpu":
        msg = mismatch_message(a.tolist(), b.tolist(), ragged, opname, broadcast)
        if msg is not None:
            raise StructureError(msg)
        return
    if a.shape[0] != b.shape[0]:
        raise StructureError(f"{opname}(): ragged structures differ: batch sizes differ: {a.shape[0]} vs {b.shape[0]}")
    same = (a[:, ragged] == b.to(a.device)[:, ragged]).all()
    torch._assert_async(same, f"{opname}(): ragged structures differ (sizes compared on the device)")


@check_same_sizes.register_fake
def _check_same_sizes_fake(a: Tensor, b: Tensor, ragged: list[int], opname: str, broadcast: bool) -> None:
    return None


check_same_sizes.register_effect(EffectType.ORDERED)
