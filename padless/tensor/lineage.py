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

**Regroupings.** An op that regroups the samples (a fold of a sample dim into the batch, a
per-sample repeat along it: :mod:`padless.ops.rows.folds`) makes *another* batch of samples,
related to its input's: its lineage is a :class:`Fold` of the input's (:func:`derive`), which
records how many of its samples each parent sample gave. A size read from the parent's shape
then gives a folded sample ``(b, i)`` parent ``b``'s own size
(:func:`padless.tensor.extents.for_batch`), and the unfold back rejoins the parent's lineage.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["Fold", "Lineage", "derive", "inherit", "same_batch", "start"]


class Lineage:
    """One batch of samples (an identity only: it holds nothing but its regroupings' tokens, weakly)."""

    __slots__ = ("__weakref__", "_folds")

    def __repr__(self) -> str:
        return f"<batch lineage {id(self):#x}>"

    def __reduce__(self):  # unpickled as a new token (shared by everything pickled with it)
        return (Lineage, ())


class Fold(Lineage):
    """A batch of samples regrouped from another: parent sample ``b`` gave ``counts[b]``
    consecutive samples of this batch (sample ``(b, i)``), in order. ``parent`` is the parent's
    token (held: a folded batch keeps its parent's identity alive, never its data), or None
    when the parent's lineage is unknown.

    It also keeps, for the sizes read from its ancestors (:func:`padless.tensor.extents.for_batch`),
    which parent sample each of its samples came from and the last :data:`TAKEN_ENTRIES` columns of
    sizes taken through it: host ints, one per sample, as many as the folded batch's own sizes."""

    __slots__ = ("parent", "counts", "total", "_up", "taken")

    def __init__(self, parent: Lineage | None, counts: tuple[int, ...]) -> None:
        self.parent, self.counts, self.total = parent, counts, sum(counts)
        self._up: list[int] | None = None
        self.taken: dict = {}  # (id(ancestor), ancestor's column) -> this batch's column

    def __repr__(self) -> str:
        return f"<batch lineage {id(self):#x}: {self.total} samples regrouped from {len(self.counts)} of {self.parent!r}>"

    def parent_of(self) -> list[int]:
        """For every sample of this batch, the parent sample it came from (computed once)."""
        if self._up is None:
            self._up = [b for b, c in enumerate(self.counts) for _ in range(c)]
        return self._up


TAKEN_ENTRIES = 4


def derive(parent: Lineage | None, counts: Any) -> Fold:
    """The lineage of a regrouping of ``parent``'s samples, ``counts[b]`` samples from parent
    sample ``b`` (host ints). Two regroupings of one batch with the same counts are one batch of
    samples (``z`` folded row by row and ``bias`` repeated once per row of its sample: sample
    ``(b, i)`` of both), so they share a token."""
    counts = tuple(int(c) for c in counts)
    if parent is None:
        return Fold(None, counts)
    try:
        folds = parent._folds
    except AttributeError:
        folds = parent._folds = weakref.WeakValueDictionary()
    token = folds.get(counts)
    if token is None:
        token = folds[counts] = Fold(parent, counts)
    return token


def _regrouped(have: Any, token: Any) -> bool:
    """``have`` (an op's output's lineage, set by the op) is a regrouping of ``token`` (its
    input's) or what ``token`` was regrouped from (an unfold): the op's own answer stands."""
    if have is None or have is token:
        return False
    return (type(have) is Fold and have.parent is token) or (type(token) is Fold and token.parent is have)


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
    """``out`` (an op's result) given the lineage of the op's first NestedTensor input, unless the
    op regrouped the samples and gave it the lineage of the regrouping (:func:`derive`)."""
    t = type(out)
    if t is not tuple and t is not list and isinstance(out, tuple):
        t = tuple  # a torch.return_types result (max(dim).values, sort, topk...)
    if t is tuple or t is list:
        for o in out:
            if isinstance(o, cls):
                break
        else:
            return out
    elif not isinstance(out, cls):
        return out
    src = args[0] if args and isinstance(args[0], cls) else _first(args, cls)
    if src is None:
        src = _first(kwargs.values(), cls)
    if src is None:
        return out
    token = src._lineage
    if t is not tuple and t is not list and out._lineage is token:
        return out  # nothing to change (a row-wise result of an unbatched input: both None)
    if torch.compiler.is_compiling():
        return out
    if t is tuple or t is list:
        for o in out:
            if isinstance(o, cls) and o is not src and not _regrouped(o._lineage, token):
                o._lineage = token
    elif out is not src and not _regrouped(out._lineage, token):
        out._lineage = token
    return out
