"""Which batch of samples a NestedTensor belongs to.

Sizes read from a batch's shape (:mod:`padless.tensor.extents`) mean "each sample's own
size". Applied to a tensor of the *same* samples (the decoder feature of the image whose
skip gave the size, the tokens of the image that gave ``h`` and ``w``), that is the
per-sample meaning; applied to another batch of as many samples (a size kept from the
previous step), it would silently give every sample another sample's size.

A *lineage* tells them apart: a small token shared by every NestedTensor of one batch of
samples. Constructors (``from_list``, ``from_padded``, ``from_values``, ``from_njt``, the
collated :class:`padless.Batch`, unpickling) start a new one; every op's output inherits the
lineage of its first NestedTensor input (:func:`inherit`, called by
``NestedTensor.__torch_function__``). The token holds nothing, and an extent keeps only a
weak reference to it, so keeping a size never keeps a batch alive.

A NestedTensor made outside both (the output of a compiled region, a gradient) has no
lineage (``None``): whether a size belongs to it is unknown, and ops accept sizes whose batch
is still alive there (see :func:`padless.tensor.extents.check_extents`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Lineage", "inherit", "same_batch", "start"]


class Lineage:
    """One batch of samples (an identity only: it holds nothing)."""

    __slots__ = ("__weakref__",)

    def __repr__(self) -> str:
        return f"<batch lineage {id(self):#x}>"

    def __reduce__(self):  # unpickled as a new token (shared by everything pickled with it)
        return (Lineage, ())


def start(*nts: Any) -> Lineage:
    """A new lineage shared by ``nts`` (the fields of one collated batch)."""
    token = Lineage()
    for nt in nts:
        nt._lineage = token
    return token


def same_batch(*nts: Any) -> tuple:
    """Declare NestedTensors built separately (an image batch and its masks, each made with
    ``from_list`` in a custom ``collate_fn``) as one batch of samples, so that a size read from
    one's shape applies to the others (``F.interpolate(logits, size=masks.shape[-2:])``).

    Fields of a :class:`padless.Batch` and of ``padless.collate``'s output already are. Call
    it right after building them: sizes read before keep the batch they were read from.
    Returns ``nts``.

    >>> import torch, padless
    >>> images = [torch.zeros(3, 4, 6), torch.zeros(3, 2, 2)]
    >>> masks = [torch.zeros(1, 4, 6), torch.zeros(1, 2, 2)]
    >>> x, m = padless.same_batch(padless.from_list(images), padless.from_list(masks))
    >>> torch.nn.functional.interpolate(x, size=m.shape[-2:]).shape
    torch.Size([2, 3, 4, 6])
    """
    if len(nts) == 1 and isinstance(nts[0], (list, tuple)):
        nts = tuple(nts[0])
    from padless.tensor.errors import StructureError

    for i, nt in enumerate(nts):
        if not hasattr(type(nt), "_lineage") or not hasattr(nt, "batch_size"):
            raise TypeError(f"same_batch(): argument {i} is a {type(nt).__name__}, not a NestedTensor")
        if nt.batch_size != nts[0].batch_size:
            raise StructureError(
                f"same_batch(): argument {i} has {nt.batch_size} samples, argument 0 has {nts[0].batch_size}; "
                "one batch of samples has one sample count"
            )
    if nts:
        token = nts[0]._lineage or Lineage()
        for nt in nts:
            nt._lineage = token
    return tuple(nts)


def _first(args: Any, cls: type) -> Any:
    for a in args:
        if isinstance(a, cls):
            return a
        if type(a) in (list, tuple):
            for b in a:
                if isinstance(b, cls):
                    return b
    return None


def inherit(out: Any, args: tuple, kwargs: dict, cls: type) -> Any:
    """``out`` (an op's result) given the lineage of the op's first NestedTensor input."""
    t = type(out)
    if t is tuple or t is list:
        for o in out:
            if isinstance(o, cls):
                break
        else:
            return out
    elif not isinstance(out, cls):
        return out
    if torch.compiler.is_compiling():
        return out
    src = args[0] if args and isinstance(args[0], cls) else _first(args, cls)
    if src is None:
        src = _first(kwargs.values(), cls)
    if src is None:
        return out
    token = src._lineage
    if t is tuple or t is list:
        for o in out:
            if isinstance(o, cls) and o is not src:
                o._lineage = token
    elif out is not src:
        out._lineage = token
    return out
