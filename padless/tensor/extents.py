"""Envelope extents that remember every sample's own size.

``x.shape`` of a NestedTensor is the padded envelope ``(B, max n_0, ...)``, so that code
reading shapes keeps working. Model code often hands such a size on: smp's U-Net decoder
reads ``skip.shape[2:]`` and later calls ``F.interpolate(x, size=(h, w))`` to bring ``x``
to its skip's size. Dense, that is "to the padded envelope"; per sample, it means "to this
sample's own skip size". To tell the two apart, the entries of ``x.shape`` (and
``x.size()``, ``x.size(d)``) at ragged dims are :class:`Extent` ints: plain ints (equal to
the envelope extent, usable anywhere an int is) that also remember every sample's own size
along that dim. Ops that take a size and can apply one per sample (``F.interpolate``,
``reshape``/``view``, ``unflatten``) read it; every other use sees an int.

Integer arithmetic keeps both readings (``height // 4`` is the padded ``H // 4`` and every
sample's ``h_i // 4``); ``int(h)`` is the plain padded int. An Extent pickles and copies as a
plain int (``torch.save({"shape": x.shape})`` loads with ``weights_only=True``). Under
``torch.compile`` shapes are the plain (symbolic) sizes.

**What an Extent holds.** An Extent object is the int alone (no instance dict): its state
lives in a module table keyed by its id, removed when it dies (``Extent.__del__``). The state
is one tuple ``(origin, s_0, ..., s_{B-1})``: every sample's own size (host ints) and where it
was read from (``origin``: a weak reference to its batch's lineage
(:mod:`padless.tensor.lineage`), or, rarely, also one to the structure). Equal sizes of one
read are one object (the two ragged dims of a square pair). A kept ``x.shape`` of a 4-sample
batch costs about 130 bytes per ragged dim (the int, its table entry, its sizes) besides the
``torch.Size``, never the batch, its metadata or its caches. A device batch built without host
metadata has no host sizes yet: its extents read them on first use (one sync, as
:meth:`NestedTensor.host_sizes` does) while the batch lives, and refuse after.

**Which batch.** An op applies an Extent per sample only to a tensor of the same batch of
samples (the same lineage: the batch it was read from, or anything ops made from it); a size
kept from another batch of as many samples is refused (:func:`check_extent`), naming the
rewrite.

**Folded batches.** A batch folded from this one (``z.reshape(B * N, N, d)``: sample ``(b, i)``
is row ``i`` of sample ``b``) has a lineage derived from it (:class:`padless.tensor.lineage.Fold`).
A size read from the parent applies to it through that relation, every folded sample taking
its parent sample's size (:func:`for_batch`), as the padded code's ``N`` does
(``q.view(B * N, N, H, d)``); the reverse (a folded batch's size applied to its parent) is
refused as sizes of another batch.

**Comparisons.** ``max(h, w)`` and ``min(h, w)`` return one of their operands, so its
per-sample sizes: right only when every sample orders ``h_i, w_i`` as the envelope does.
Ordering comparisons (``<``, ``<=``, ``>``, ``>=``) between two extents of one batch check
that, and raise when samples disagree, naming :func:`extent_max` / :func:`extent_min`, which
give each sample its own max/min. Comparisons with plain ints (``if L > max_len``) and
equality are the plain int comparisons.
"""

from __future__ import annotations

import copyreg
import operator
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from padless.tensor.errors import StructureError
from padless.tensor.lineage import TAKEN_ENTRIES, Fold, Lineage

__all__ = [
    "Extent",
    "check_extent",
    "envelope_shape",
    "envelope_size",
    "extent_max",
    "extent_min",
    "applies_to",
    "for_batch",
    "per_sample_extents",
    "sample_columns",
]

_MIXED = "mixed"  # the lineage of an extent computed from sizes of two different batches


#: Every live Extent's state, by ``id``: ``(origin, s_0, ..., s_{B-1})`` once its per-sample
#: sizes are known, else a :class:`_Pending`. ``Extent.__del__`` removes the entry.
_STATE: dict[int, Any] = {}


class _Origin:
    """Where an extent was read, when more than its lineage must be known: ``src`` (a weak
    reference to the structure, or None) and ``lin`` (a weak reference to the lineage, None, or
    ``_MIXED``). The usual origin is the lineage's weak reference alone (:func:`_origin`)."""

    __slots__ = ("src", "lin")

    def __init__(self, src: weakref.ref | None, lin: Any) -> None:
        self.src, self.lin = src, lin


class _Pending:
    """The state of an extent whose per-sample sizes are read or computed on first use."""

    __slots__ = ("batch", "origin", "compute")

    def __init__(self, batch: int, origin: Any, compute: Callable[[], Any]) -> None:
        self.batch, self.origin, self.compute = batch, origin, compute


def _origin(src: weakref.ref | None, lin: Any) -> Any:
    return lin if src is None and (lin is None or type(lin) is weakref.ref) else _Origin(src, lin)


def _where(origin: Any) -> tuple[Any, Any]:
    """``(src, lin)`` of an origin."""
    return (origin.src, origin.lin) if type(origin) is _Origin else (None, origin)


def _new(value: int, state: Any) -> "Extent":
    e = int.__new__(Extent, value)
    _STATE[id(e)] = state
    return e


def _state(e: "Extent") -> Any:
    try:
        return _STATE[id(e)]
    except KeyError:
        raise TypeError("padless internal: an Extent made without its per-sample sizes") from None


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

    __slots__ = ()  # the int alone: the state is in _STATE (a kept shape costs a few bytes per dim)

    def __new__(cls, *args: Any, **kwargs: Any) -> "Extent":
        raise TypeError("Extent is read from a NestedTensor's shape (x.shape, x.size(d)); it is not built directly")

    def __del__(self) -> None:
        try:
            _STATE.pop(id(self), None)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the table may be gone already
            pass

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__

    def __reduce__(self):  # copies, pickles and deep-copies as the plain int
        return (int, (int(self),))

    @property
    def batch_size(self) -> int:
        """Samples of the batch this extent was read from."""
        return self._batch

    @property
    def _batch(self) -> int:
        st = _state(self)
        return len(st) - 1 if type(st) is tuple else st.batch

    @property
    def _src(self) -> weakref.ref | None:  # the structure it was read from (weak), when needed
        st = _state(self)
        return _where(st[0] if type(st) is tuple else st.origin)[0]

    @property
    def _lin(self) -> Any:  # weakref to its batch's Lineage; None when unknown; _MIXED for two batches
        st = _state(self)
        return _where(st[0] if type(st) is tuple else st.origin)[1]

    def per_sample(self) -> list[int]:
        """Every sample's own value (host ints; reading a device batch built without host
        metadata syncs once, as :meth:`NestedTensor.host_sizes` does)."""
        return list(self._values())

    def _values(self) -> tuple[int, ...]:
        st = _state(self)
        if type(st) is tuple:
            return st[1:]
        cols = tuple(st.compute())
        _STATE[id(self)] = (st.origin, *cols)
        return cols

    def _known(self) -> tuple[int, ...] | None:
        """The per-sample sizes when known without computing or reading them."""
        st = _state(self)
        return st[1:] if type(st) is tuple else None

    def read_from(self, nt: Any) -> bool:
        """True when this extent was read straight from the shape of ``nt``'s structure."""
        src = self._src
        return src is not None and src() is getattr(nt, "_meta", None)


def _token(e: Extent) -> Any:
    lin = e._lin
    return lin() if isinstance(lin, weakref.ref) else lin


def _combined_lineage(a: Extent, b: Extent) -> Any:
    if a._lin is None and b._lin is None:
        return None
    ta, tb = _token(a), _token(b)
    return a._lin if ta is tb and ta is not None else _MIXED


def _derived(value: Any, a: Extent, b: Extent | None, fn: Callable[..., int]) -> Any:
    """The extent ``value`` computed from ``a`` (and ``b``) sample by sample with ``fn``: at
    once when their sizes are known, else on first use."""
    if type(value) is not int:
        return value  # true division, floats, NotImplemented: the plain result
    origin = _origin(a._src, a._lin if b is None else _combined_lineage(a, b))
    va = a._known()
    vb = None if b is None else b._known()
    if va is not None and (b is None or vb is not None):
        try:
            return _new(value, (origin, *(map(fn, va) if b is None else map(fn, va, vb))))
        except ArithmeticError:
            pass  # a sample divides by 0: raised where the per-sample sizes are used, not here

    def compute() -> tuple[int, ...]:
        return tuple(map(fn, a._values()) if b is None else map(fn, a._values(), b._values()))

    return _new(value, _Pending(a._batch, origin, compute))


def _binary(name: str):
    op = getattr(int, name)

    def method(self: Extent, other: Any) -> Any:
        value = op(self, other)
        if isinstance(other, Extent):
            if other._batch != self._batch:
                return value  # two batches: only the padded int is meaningful
            return _derived(value, self, other, op)
        if type(other) is not int:
            return value
        return _derived(value, self, None, lambda x: op(x, other))

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__"):
    setattr(Extent, _name, _binary(_name))


def _neg(self: Extent) -> Any:
    return _derived(-int(self), self, None, operator.neg)


Extent.__neg__ = _neg  # type: ignore[method-assign]

_SYMBOL = {"__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">="}


def _comparison(name: str):
    op = getattr(int, name)
    sym = _SYMBOL[name]

    def method(self: Extent, other: Any) -> Any:
        res = op(self, other)
        if not isinstance(other, Extent) or other is self or other._batch != self._batch:
            return res  # an int, or sizes of another batch: the plain comparison
        if _combined_lineage(self, other) is _MIXED:
            return res
        try:
            a, b = self._values(), other._values()
        except StructureError:
            return res  # the batch is gone and its sizes were never read: only the envelope is known
        for i, (x, y) in enumerate(zip(a, b)):
            if op(x, y) != res and x != y:  # (a tie picks a right operand either way)
                raise StructureError(
                    f"{int(self)} {sym} {int(other)}: these are sizes read from one batch's shape, and their order "
                    f"differs between samples (the padded envelope gives {res}, sample {i} has {x} {sym} {y}). "
                    f"max()/min() of such sizes (e.g. F.interpolate(x, size=max(h, w))) would silently give every "
                    f"sample one operand's sizes. Use padless.extent_max(h, w) / padless.extent_min(h, w) for each "
                    f"sample's own max/min, or compare int(h) {sym} int(w) for the padded envelope"
                )
        return res

    method.__name__ = name
    return method


for _name in _SYMBOL:
    setattr(Extent, _name, _comparison(_name))


def _extreme(fn: Callable, name: str, sizes: tuple) -> Any:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    if not sizes:
        raise TypeError(f"{name}() expects at least one size")
    for s in sizes:
        if isinstance(s, (bool, float)) or not isinstance(s, (int, torch.SymInt)):
            raise TypeError(f"{name}(): sizes must be ints (plain or read from a shape), got {s!r}")
    value = fn(sizes) if not any(isinstance(s, Extent) for s in sizes) else fn(int(s) for s in sizes)
    ext = [s for s in sizes if isinstance(s, Extent)]
    if not ext:
        return value
    first = ext[0]
    for e in ext[1:]:
        if e._batch != first._batch or _combined_lineage(first, e) is _MIXED:
            raise StructureError(
                f"{name}(): sizes {int(first)} and {int(e)} were read from the shapes of two different batches "
                f"({first._batch} and {e._batch} samples); each sample's own {name[7:]} needs sizes of one batch"
            )
    b = first._batch

    def values() -> tuple[int, ...]:
        cols = [s._values() if isinstance(s, Extent) else (int(s),) * b for s in sizes]
        return tuple(fn(c) for c in zip(*cols))

    origin = _origin(first._src, first._lin)  # one lineage (checked)
    if all(s._known() is not None for s in ext):
        return _new(int(value), (origin, *values()))
    return _new(int(value), _Pending(b, origin, values))


def extent_max(*sizes: Any) -> Any:
    """Each sample's own max of sizes read from one batch's shape (and plain ints).

    ``max(h, w)`` returns one operand, so every sample gets that operand's size even where
    its other size is larger; ``padless.extent_max(h, w)`` is ``max(H, W)`` for the padded
    code and ``max(h_i, w_i)`` for sample ``i``. With no extent among ``sizes`` it is ``max``.

    Args:
        sizes: ints, and sizes read from one batch's shape (``h, w = x.shape[-2:]``).

    Returns:
        An extent (an int equal to the padded max, that also knows every sample's own max), or
        a plain int when no size is an extent. Sizes of two batches are refused.

    >>> import torch, padless
    >>> x = padless.from_list([torch.zeros(1, 4, 2), torch.zeros(1, 3, 6)])
    >>> h, w = x.shape[-2:]
    >>> s = padless.extent_max(h, w)
    >>> int(s), s.per_sample()
    (6, [4, 6])
    """
    return _extreme(max, "extent_max", sizes)


def extent_min(*sizes: Any) -> Any:
    """Each sample's own min of sizes read from one batch's shape (see :func:`extent_max`).

    Args:
        sizes: ints, and sizes read from one batch's shape.

    Returns:
        An extent equal to the padded min that knows every sample's own min (a plain int when
        no size is an extent).

    >>> import torch, padless
    >>> x = padless.from_list([torch.zeros(1, 4, 2), torch.zeros(1, 3, 6)])
    >>> h, w = x.shape[-2:]
    >>> padless.extent_min(h, w).per_sample()
    [2, 3]
    """
    return _extreme(min, "extent_min", sizes)


# ---------------------------------------------------------------------------- reading a shape


class _LazyColumn:
    """Host sizes of one dim of a device batch built without host metadata, read on first
    use while the batch lives (weak references: the extent never keeps the batch)."""

    __slots__ = ("meta", "sizes", "dim")

    def __init__(self, meta: weakref.ref, sizes: weakref.ref, dim: int) -> None:
        self.meta, self.sizes, self.dim = meta, sizes, dim

    def __call__(self) -> tuple[int, ...]:
        meta, sizes = self.meta(), self.sizes()
        if meta is None or sizes is None:
            raise StructureError(
                "a size read from the shape of a device batch built without host metadata is used after the batch "
                "was freed: its per-sample sizes were never read and can no longer be. Use the size while the "
                "batch lives, or build the batch with host metadata (padless.collate, or from_values(..., validate=True))"
            )
        if meta.host_sizes is None:
            meta.host_sizes = sizes.cpu()
        return tuple(meta.host_sizes[:, self.dim].tolist())


def sample_columns(nt: Any) -> tuple[tuple[int, ...], ...]:
    """Every sample's size along each sample dim, one tuple of host ints per dim (cached on
    the structure when it has host metadata; one sync otherwise, as :meth:`NestedTensor.host_sizes`)."""
    cols = _columns(nt._meta)
    return cols if cols is not None else tuple(tuple(c) for c in nt.host_sizes().T.tolist())


def _columns(meta: Any) -> tuple[tuple[int, ...], ...] | None:
    """Every sample's size per sample dim (host ints), cached on the structure; None without
    host metadata."""
    hs = meta.host_sizes
    if hs is None:
        return None
    hit = meta.derived.get("extent_columns")
    if hit is None or hit[0] is not hs:
        hit = (hs, tuple(tuple(c) for c in hs.T.tolist()))
        meta.derived["extent_columns"] = hit
    return hit[1]


_tracing = torch._guards.TracingContext.try_get


def _shape(nt: Any) -> torch.Size:
    if torch.compiler.is_compiling() or _tracing() is not None:
        return Tensor.shape.__get__(nt)  # dynamo traces or wraps it: the plain (symbolic) sizes
    lineage = nt._lineage
    cached = nt.__dict__.get("_extent_shape")
    if cached is not None and cached[0] is lineage:
        return cached[1]
    env = nt._env
    if not all(type(v) is int for v in env):
        if not all(isinstance(v, int) for v in env):
            return Tensor.shape.__get__(nt)  # symbolic sizes
        env = tuple(int(v) for v in env)  # a size read from a shape kept as a static extent: its int
    meta, sizes = nt._meta, nt._sizes
    cols = _columns(meta)
    lin = weakref.ref(lineage) if lineage is not None else None
    # the structure's identity is needed only without a lineage or without host sizes
    origin = _origin(weakref.ref(meta) if lin is None or cols is None else None, lin)
    b = len(sizes)
    dims: list[int] = [b, *env]
    same: dict = {}  # equal sizes of this read are one extent (the two ragged dims of a square pair)
    for d in nt._ragged:
        if cols is not None:
            e = same.get((env[d], cols[d]))
            if e is None:
                e = same[env[d], cols[d]] = _new(env[d], (origin, *cols[d]))
        else:
            e = _new(env[d], _Pending(b, origin, _LazyColumn(weakref.ref(meta), weakref.ref(sizes), d)))
        dims[d + 1] = e
    out = torch.Size(dims)
    nt.__dict__["_extent_shape"] = (lineage, out)
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


# ---------------------------------------------------------------------------- applying extents


def _foreign(e: Extent, batch: int, lineage: Lineage | None) -> str | None:
    """Why ``e`` cannot give the samples of a batch of ``batch`` samples and lineage
    ``lineage`` their own sizes (None when it can)."""
    if e._batch != batch:
        if type(lineage) is Fold and e._batch == len(lineage.counts) and lineage.parent is not None:
            why = _foreign(e, e._batch, lineage.parent)  # this input was folded from a batch of as many samples
            if why is not None:
                return f"{why}, not from the one this input of {batch} samples was folded from"
        return f"was read from the shape of a batch of {e._batch} samples, and this input has {batch}"
    if e._lin is _MIXED:
        return "combines sizes read from the shapes of two different batches"
    if e._lin is not None:
        token = e._lin()
        if token is None:
            return "was read from the shape of a batch that no longer exists (a size kept from an earlier batch)"
        if lineage is not None and token is not lineage:
            return f"was read from the shape of another batch of {batch} samples"
        return None
    if e._src is not None and e._src() is None:
        return "was read from the shape of a batch that no longer exists (a size kept from an earlier batch)"
    return None


def for_batch(e: Any, target: Any) -> Any:
    """``e`` as sizes of ``target``'s samples (a NestedTensor, or anything with ``batch_size`` and
    ``_lineage``): an :class:`Extent` read from a batch that ``target``'s batch was folded from
    (its lineage a :class:`~padless.tensor.lineage.Fold` of ``e``'s, through one fold or several)
    becomes an Extent of ``target``'s batch that gives every folded sample ``(b, i)`` parent
    ``b``'s own size. Anything else is returned as it is (:func:`check_extent` judges it)."""
    if not isinstance(e, Extent):
        return e
    batch, lineage = target_batch(target), getattr(target, "_lineage", None)
    if _foreign(e, batch, lineage) is None:
        return e  # target's own batch (or a target of unknown batch: t-extents' rule)
    node, need, index = lineage, batch, None
    while type(node) is Fold:
        if node.total != need:
            return e  # a sub-batch or a reordering of the folded batch: the relation does not hold
        up = node.parent_of()
        index = up if index is None else [up[j] for j in index]
        need, node = len(node.counts), node.parent
        if _foreign(e, need, node) is None:  # read from this ancestor (or, unknown, of its size)
            return _new(int(e), (weakref.ref(lineage), *_taken(lineage, e._values(), node, index)))
    return e


def _taken(fold: Fold, cols: tuple[int, ...], ancestor: Any, index: list[int]) -> tuple[int, ...]:
    """``cols`` (sizes of ``ancestor``'s samples) for every sample of ``fold``'s batch; the last few
    are kept on the fold (the same parent column is read by every view of one layer)."""
    key = (id(ancestor), cols)  # by content: the fold holds its ancestors, so their ids stay theirs
    hit = fold.taken.get(key)
    if hit is not None:
        return hit
    out = tuple(cols[j] for j in index)
    fold.taken[key] = out
    while len(fold.taken) > TAKEN_ENTRIES:
        del fold.taken[next(iter(fold.taken))]
    return out


def applies_to(e: Any, target: Any) -> bool:
    """Whether the :class:`Extent` ``e`` gives the samples of ``target`` (a NestedTensor, or
    anything with ``batch_size`` and ``_lineage``) their own sizes as it is (what
    :func:`check_extent` accepts); True for a plain int."""
    return not isinstance(e, Extent) or _foreign(e, target_batch(target), getattr(target, "_lineage", None)) is None


def check_extent(e: Any, target: Any, op: str, what: str, rewrite: str = "") -> None:
    """Raise unless the :class:`Extent` ``e`` may give the samples of ``target`` (a
    NestedTensor, or anything with ``batch_size`` and ``_lineage``) their own sizes.
    ``rewrite`` names an op's own way to say the same per sample."""
    if not isinstance(e, Extent):
        return
    why = _foreign(e, target_batch(target), getattr(target, "_lineage", None))
    if why is not None:
        raise StructureError(
            f"{op}(): {what} = {int(e)} {why}; a size read from a NestedTensor's shape means each sample's own size, "
            f"so it applies only to that batch of samples and to what ops made from it. Read the size from this "
            f"batch's shape{rewrite}, declare batches built separately from the same samples with "
            f"padless.same_batch(x, y), or pass int(...) to give every sample the envelope size {int(e)}"
        )


def target_batch(target: Any) -> int:
    b = getattr(target, "batch_size", None)
    return b if isinstance(b, int) else target.shape[0]


def per_sample_extents(values: Any, target: Any, op: str, rewrite: str = "") -> list[tuple[int, ...]] | None:
    """Per-sample targets named by a size tuple holding :class:`Extent` entries, else ``None``.

    Each Extent entry gives every sample of ``target`` (a NestedTensor, or anything with
    ``batch_size`` and ``_lineage``) its own size; plain int entries give every sample the
    same size. Extents of another batch are refused, naming the fix (:func:`check_extent`).
    """
    if not isinstance(values, (tuple, list)) or not any(isinstance(v, Extent) for v in values):
        return None
    batch = target_batch(target)
    columns: list[tuple[int, ...]] = []
    for i, v in enumerate(values):
        if isinstance(v, Extent):
            v = for_batch(v, target)  # read from the batch target was folded from: each its parent's
            check_extent(v, target, op, f"size[{i}]", rewrite)
            columns.append(v._values())
        else:
            columns.append((operator.index(v),) * batch)
    return [tuple(c[b] for c in columns) for b in range(batch)]


# ---------------------------------------------------------------------------- pickling

def _reduce_size(size: torch.Size) -> tuple:
    # a shape holding extents pickles as the plain torch.Size of ints, which every loader
    # (torch.load(weights_only=True) included) reads without padless
    return (torch.Size, (tuple(int(v) if isinstance(v, Extent) else v for v in size),))


copyreg.pickle(torch.Size, _reduce_size)
