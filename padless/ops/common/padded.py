"""Dense operands in padded coordinates, and the strict switch that refuses them.

``x.shape`` is the padded envelope, so a dense tensor a model builds from it (a padding
mask, a position table indexed by ``arange(x.shape[1])``, an image bias map, a pair
bias) is laid out in padded coordinates. A dense operand whose extent along a ragged dim
equals the envelope's (and is not 1) is read that way: every element takes the entry at
its own coordinates. For samples of lengths 2, 0, 3 (envelope 3) and a dense ``(B, 3, 1)``
operand ``d``::

    sample 0    rows a0 a1        read d[0, 0], d[0, 1]
    sample 1    (empty)
    sample 2    rows c0 c1 c2     read d[2, 0], d[2, 1], d[2, 2]
    index       [0, 1, 6, 7, 8]   one gather into d viewed as (B * 3, 1), cached per structure

The gradient of the read is the gather's: it scatters back, zeros at padded positions.
Only the index is cached (it depends on the structure alone, which never changes); the values
are gathered at every read. A dense operand is the user's to write, and some writes move no
version counter (``p.data.copy_(...)``, ``p.data = new``, ``vector_to_parameters``, an EMA
update through ``.data``), so rows kept from an earlier read could be served stale.
Extent 1 broadcasts as before; any other extent is refused as before. The batch dim may be
B (per sample) or 1 (shared). ``padded_reads(strict=True)`` (or ``PADLESS_STRICT_PADDED=1``
in the environment) refuses every such read with an error naming the op and the operand's
shape, for users who want to find them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Sequence

import torch
from torch import Tensor

from padless.ops.common.structure import derived_tensor
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.registry import lend
from padless.tensor.structure import static_change

_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("padless_strict_padded", default=None)

ENV_VAR = "PADLESS_STRICT_PADDED"


@contextlib.contextmanager
def padded_reads(strict: bool = False) -> Iterator[None]:
    """Inside the block, dense operands in padded coordinates are read (``strict=False``)
    or refused (``strict=True``), whatever ``PADLESS_STRICT_PADDED`` says.

    ::

        x = padless.from_list([torch.ones(2, 4), torch.ones(3, 4)])
        with padless.padded_reads(strict=True):
            x + torch.zeros(x.shape)    # StructureError: add(): reads a dense operand of shape (2, 3, 4) ...
    """
    token = _STRICT.set(bool(strict))
    try:
        yield
    finally:
        _STRICT.reset(token)


def strict_padded_reads() -> contextlib.AbstractContextManager[None]:
    """Refuse dense operands read in padded coordinates, inside a ``with`` block.

    Because ``x.shape`` is the padded envelope, a dense tensor built from it (a padding mask
    ``(B, L)``, a position table ``pos[:, :x.shape[1]]``, a pair bias ``(B, N, N, 1)``) is laid
    out in padded coordinates, and padless reads it that way: each element takes the entry at
    its own coordinates. That is usually what model code means; this switch finds every such
    read, e.g. when porting a model, by making each one raise a :class:`StructureError` that
    names the op and the operand's shape. Same as ``padded_reads(strict=True)``; the
    environment variable ``PADLESS_STRICT_PADDED=1`` turns it on for a whole run.

    Returns:
        A context manager.

    Example:
        >>> import torch, padless
        >>> x = padless.from_list([torch.ones(2, 4), torch.ones(3, 4)])
        >>> with padless.strict_padded_reads():
        ...     try:
        ...         x + torch.zeros(x.shape)
        ...     except padless.StructureError as e:
        ...         print(str(e).split(" in padded")[0])
        add(): reads a dense operand of shape (2, 3, 4)
        >>> (x + torch.zeros(1, 1, 4)).shape   # extent 1 broadcasts: not a padded read
        torch.Size([2, 3, 4])
    """
    return padded_reads(strict=True)


def is_strict() -> bool:
    """Whether padded reads are refused here (the innermost ``padded_reads`` block, else the
    ``PADLESS_STRICT_PADDED`` environment variable)."""
    s = _STRICT.get()
    if s is None:
        return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")
    return s


def check_strict(opname: object, shape: Sequence[int], ref: NestedTensor) -> None:
    """Raise when strict mode is on (the message names the op and the operand's shape)."""
    if is_strict():
        raise StructureError(
            f"{opname}(): reads a dense operand of shape {tuple(shape)} in padded coordinates "
            f"(NestedTensor envelope {tuple(ref.shape)}), refused because strict padded reads are on "
            f"(padless.strict_padded_reads() or {ENV_VAR}=1). Make it a NestedTensor "
            "(padless.from_padded(dense, like=nt)), or give that dim extent 1"
        )


def padded_extents(opname: object, aligned: Sequence[int], ref: NestedTensor, shape: Sequence[int] | None = None) -> bool:
    """True when the dense operand ``aligned`` (outer dims, batch first, rank of ``ref``) is
    read in padded coordinates: some ragged dim at the envelope extent (not 1). Raises
    today's message for any other extent than 1 or the envelope's."""
    padded = False
    for r in ref._ragged:
        n = aligned[1 + r]
        if n == 1:
            continue
        if n == ref._env[r]:
            padded = True
            continue
        raise StructureError(
            f"{opname}(): a dense operand of shape {tuple(aligned if shape is None else shape)} spans ragged dim {r + 1} "
            f"(size {n}); a dense tensor can only broadcast over ragged dims with "
            "size 1. Make it a NestedTensor of the same structure, or reduce that dim."
        )
    return padded


def read_index(ref: NestedTensor, per_sample: bool, extents: tuple[int, ...]) -> Tensor:
    """Row of every packed element in the dense grid ``(b, *extents, ...)`` (ragged dims in
    storage order; an extent of 1 broadcasts); cached on the structure."""
    ragged = ref._ragged
    total = ref._values.shape[0]

    def compute(sizes: Tensor, offsets: Tensor) -> Tensor:
        sid, coords = layout.row_coords(sizes, offsets, ragged, total)
        flat = sid if per_sample else torch.zeros_like(sid)
        for e, c in zip(extents, coords):
            flat = flat * e + (c if e != 1 else 0)
        return flat

    return derived_tensor(ref, ("padded_read", per_sample, extents), compute)


def read_rows(opname: object, d: Tensor, ref: NestedTensor, aligned: Sequence[int]) -> Tensor:
    """The dense operand ``d`` (``aligned``: its shape with leading 1s to ``ref``'s rank) read
    in padded coordinates onto ``ref``'s rows: ``(T, *d's static extents)``. One gather;
    differentiable (its backward scatters back, zeros at padded positions)."""
    check_strict(opname, d.shape, ref)
    b = aligned[0]
    if b not in (1, ref.batch_size):
        raise StructureError(
            f"{opname}(): a dense operand of shape {tuple(d.shape)} has {b} entries on the batch dim, "
            f"the NestedTensor has {ref.batch_size} samples"
        )
    perm, grid_shape, idx = _read_plan(ref, aligned)
    return d.reshape(tuple(aligned)).permute(perm).reshape(grid_shape).index_select(0, idx)


def _read_plan(ref: NestedTensor, aligned: Sequence[int]) -> tuple:
    """``(permutation, grid shape, row index)`` of a padded read of an operand ``aligned``."""
    ragged = ref._ragged
    static = layout.static_dims(ref.sample_dim, ragged)
    perm = (0, *[1 + r for r in ragged], *[1 + s for s in static])
    n = aligned[0]
    for r in ragged:
        n = n * aligned[1 + r]
    grid_shape = (n, *[aligned[1 + s] for s in static])  # (no -1: a static extent 0 leaves it open)
    ext = tuple(aligned[1 + r] if _is_traced(ref._values) else int(aligned[1 + r]) for r in ragged)
    return perm, grid_shape, read_index(ref, aligned[0] != 1, ext)


# padded_rows() remembers, per structure and operand shape, how it read an operand (the
# permutation, grid shape and row index of a padded read, or the shape of a broadcast view):
# index maps only, never an operand's values (module docstring). At most _MAX_PLANS shapes
# per structure (a structure that meets more starts over).
_PLANS = "padded_row_plans"
_MAX_PLANS = 16


def as_nested(opname: object, d: Tensor, ref: NestedTensor, whole: bool = False) -> NestedTensor | None:
    """``d`` read in padded coordinates as a NestedTensor on ``ref``'s rows (static extents
    from ``d``, 1 where it broadcasts), or None when ``d`` is not such an operand.

    ``whole``: ``d`` does not broadcast (``torch.cat``), so a dense ``(B, ...)`` operand of
    extent 1 where the envelope is 1 (a batch of 1x1 images) is that envelope, read the same way."""
    nd = ref.dim()
    if d.dim() > nd or d.dim() <= layout_trailing_static(ref):
        return None
    aligned = (1,) * (nd - d.dim()) + tuple(d.shape)
    if not padded_extents(opname, aligned, ref, d.shape):
        envelope = d.dim() == nd and aligned[0] == ref.batch_size and all(aligned[1 + r] == ref._env[r] for r in ref._ragged)
        if not (whole and envelope):
            return None
    rows = read_rows(opname, d, ref, aligned)
    if rows.shape[1:] == ref._values.shape[1:]:
        sizes, meta, env = ref._sizes, ref._meta, ref._env
    else:
        sizes, meta, env = _static_structure(rows, ref)
    return nested_from_values(rows, ref._offsets, sizes, ref._ragged, env, meta)


def _static_structure(rows: Tensor, ref: NestedTensor):
    """The structure of ``ref``'s rows with ``rows``' static extents, cached on ``ref`` so a
    broadcast plan against it is cached too."""
    key = ("padded_read_static", tuple(rows.shape[1:]))
    hit = ref._meta.derived.get(key)
    if hit is None:
        hit = ref._meta.derived[key] = static_change(rows, ref)
    return hit


def layout_trailing_static(ref: NestedTensor) -> int:
    """How many trailing sample dims are static (a dense operand this short never spans a ragged dim)."""
    return ref.sample_dim - 1 - max(ref._ragged) if ref._ragged else ref.sample_dim


@lend("padded_rows")
def padded_rows(opname: object, d: Tensor, ref: NestedTensor) -> Tensor | None:
    """A dense operand that reaches a ragged dim of ``ref``, as rows that broadcast against
    ``ref.values`` exactly as ``d`` does against the samples: read in padded coordinates
    (:func:`read_rows`, ``(T, *d's static extents)``), or, with extent 1 on every ragged dim
    and on the batch dim, a view of its static extents. None for operands of higher rank than
    ``ref`` or per-sample ones of extent 1 on the ragged dims (the general path takes them).
    Wrong extents raise the usual error. For :mod:`padless.tensor.fast_grad`."""
    key = (d.shape, ref._ragged, ref._values.device)
    plans = ref._meta.derived.get(_PLANS)
    plan = None if plans is None else plans.get(key)
    if plan is not None:  # this structure read an operand of this shape before
        if len(plan) == 4:
            check_strict(opname, d.shape, ref)
            aligned, perm, grid_shape, idx = plan
            return d.reshape(aligned).permute(perm).reshape(grid_shape).index_select(0, idx)
        aligned, perm, view_shape = plan
        return d.reshape(aligned).permute(perm).reshape(view_shape)
    nd = ref.dim()
    if d.dim() > nd:
        return None
    aligned = (1,) * (nd - d.dim()) + tuple(d.shape)
    traced = _is_traced(ref._values) or torch.compiler.is_compiling()
    if padded_extents(opname, aligned, ref, d.shape):
        rows = read_rows(opname, d, ref, aligned)
        if not traced:
            _remember(ref, key, (aligned, *_read_plan(ref, aligned)))
        return rows
    if aligned[0] != 1:
        return None
    static = layout.static_dims(ref.sample_dim, ref._ragged)
    plan = (aligned[1:], (*ref._ragged, *static), (1, *[aligned[1 + s] for s in static]))
    if not traced:
        _remember(ref, key, plan)
    return d.reshape(plan[0]).permute(plan[1]).reshape(plan[2])


def _remember(ref: NestedTensor, key: tuple, plan: tuple) -> None:
    if torch.is_inference_mode_enabled():
        return  # its index may be an inference tensor (StructureMeta.derived keeps none)
    plans = ref._meta.derived.get(_PLANS)
    if plans is None or len(plans) >= _MAX_PLANS:
        plans = ref._meta.derived[_PLANS] = {}
    plans[key] = plan


@lend("padded_operands")
def padded_operands(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Torch-level, with autograd on: dense operands that require grad and are read in padded
    coordinates become NestedTensors on the first NestedTensor's rows (a gather autograd
    records), so their gradient is dense and scatters back. Others are returned as they are."""
    ref = next((a for a in (*args, *kwargs.values()) if isinstance(a, NestedTensor)), None)
    if ref is None:
        return args, kwargs
    name = getattr(func, "__name__", "op").strip("_")

    def conv(a):
        if isinstance(a, Tensor) and not isinstance(a, NestedTensor) and a.requires_grad:
            nt = as_nested(name, a, ref)
            if nt is not None:
                return nt
        return a

    return tuple(conv(a) for a in args), {k: conv(a) for k, a in kwargs.items()}


def dense_samples(
    opname: object,
    what: str,
    d: Tensor,
    extents: list[list[int]],
    envelope: Sequence[int],
    ragged: Sequence[int],
    ref: NestedTensor,
) -> list[Tensor]:
    """Per-sample windows of a dense tensor in padded coordinates (masks and biases of
    per-sample ops such as attention). ``d`` is aligned to ``(B or 1, *envelope)``; sample
    ``i`` takes ``[:extents[i][j]]`` along every dim ``j`` where ``d`` has the envelope extent
    ``envelope[j]`` (not 1). Along the ``ragged`` dims ``d`` must have extent 1 or the
    envelope's. Views of ``d`` (differentiable, no copy)."""
    nd = 1 + len(envelope)
    if d.dim() > nd:
        raise StructureError(
            f"{opname}(): a dense {what} of shape {tuple(d.shape)} has more than {nd} dims (batch, then {tuple(envelope)})"
        )
    aligned = (1,) * (nd - d.dim()) + tuple(d.shape)
    b = len(extents)
    if aligned[0] not in (1, b):
        raise StructureError(
            f"{opname}(): a dense {what} of shape {tuple(d.shape)} has {aligned[0]} entries on the batch dim, "
            f"the NestedTensor has {b} samples"
        )
    window = []
    for j in ragged:
        n = aligned[1 + j]
        if n != 1 and n != envelope[j]:
            raise StructureError(
                f"{opname}(): a dense {what} of shape {tuple(d.shape)} has extent {n} along dim {j - len(envelope)}, "
                f"where the envelope has {envelope[j]}; a dense {what} takes extent 1 there (shared by every "
                "position) or the envelope's (padded coordinates), or pass a NestedTensor of per-sample ones"
            )
        if n != 1:
            window.append(j)
    if window:
        check_strict(opname, d.shape, ref)
    full = d.reshape(aligned)
    out = []
    for i in range(b):
        t = full[i if aligned[0] != 1 else 0]
        idx = [slice(None)] * len(envelope)
        for j in window:
            idx[j] = slice(0, extents[i][j])
        out.append(t[tuple(idx)])
    return out
