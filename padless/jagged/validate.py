"""``padless.jagged.validate``: run a jagged type's deferred structure checks now."""

from __future__ import annotations

from typing import TypeVar

from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.keyed_jagged import KeyedJaggedTensor

J = TypeVar("J", JaggedTensor, KeyedJaggedTensor)


def validate(x: J) -> J:
    """Check the structure of ``x`` now and return it.

    Building a ``JaggedTensor`` or ``KeyedJaggedTensor`` is lazy, as in TorchRec: the
    constructor checks types, ranks and counts, and the checks that read host lengths
    and offsets (no negative lengths, offsets from 0 that never decrease, lengths and
    offsets agreeing, ``values`` long enough, ``length_per_key`` matching) run the first
    time the structure is needed. ``validate`` runs them at once (on tensors that live on
    a device they are skipped: those are trusted and never read back).

    >>> import torch
    >>> jt = JaggedTensor(torch.arange(3.0), lengths=torch.tensor([2, -1]))  # lazy: no error yet
    >>> validate(jt)
    Traceback (most recent call last):
    ...
    padless.tensor.errors.StructureError: JaggedTensor: lengths must be >= 0, but lengths[1] = -1
    """
    if not isinstance(x, (JaggedTensor, KeyedJaggedTensor)):
        raise TypeError(
            f"padless.jagged.validate: expected a JaggedTensor or KeyedJaggedTensor, got {type(x).__name__}"
        )
    return x.validate()  # type: ignore[return-value]
