"""Constructors: from samples, from a padded tensor, from packed values, from torch.nested."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.tensor import layout, lineage
from padless.tensor.autograd import nested_from_values
from padless.tensor.convert import pack_like, pack_lengths
from padless.tensor.core import NestedTensor
from padless.tensor.dynamo import mark_dynamic
from padless.tensor.errors import StructureError
from padless.tensor.structure import StructureMeta, envelope_from_sizes
from padless.tensor.validate import norm_ragged_dims

# ---------------------------------------------------------------------------- shared pieces


def _finish(
    values: Tensor,
    host_sizes: Tensor,
    ragged: tuple[int, ...],
    device: torch.device | None,
    requires_grad: bool,
    pin_memory: bool,
    keep_history: bool,
) -> NestedTensor:
    """Attach metadata to packed host-side ``values``; move/pin; make a leaf or keep history."""
    host_offsets = layout.offsets_from_counts(layout.row_counts(host_sizes, ragged))
    env = envelope_from_sizes(host_sizes, ragged, values.shape[1:])
    if device is not None and torch.device(device) != values.device:
        values = values.to(device)
    dev = values.device
    if pin_memory:
        values = values.pin_memory()
        host_sizes, host_offsets = host_sizes.pin_memory(), host_offsets.pin_memory()
    if dev.type == "cpu":
        sizes, offsets = host_sizes, host_offsets
    else:
        sizes = host_sizes.to(dev, non_blocking=True)
        offsets = host_offsets.to(dev, non_blocking=True)
    meta = StructureMeta(host_sizes, host_offsets)
    if keep_history:
        out = nested_from_values(values, offsets, sizes, ragged, env, meta)
    else:
        out = NestedTensor(values.detach(), offsets, sizes, ragged, env, meta, requires_grad=requires_grad)
    lineage.start(out)  # a new batch of samples
    return mark_dynamic(out)


def _as_sample(x: Any, i: int, what: str) -> Tensor:
    if isinstance(x, Tensor):
        if isinstance(x, NestedTensor):
            raise TypeError(f"{what}: sample {i} is itself a NestedTensor; pass dense samples")
        return x
    if isinstance(x, (str, bytes)):
        raise TypeError(
            f"{what}: sample {i} is a {type(x).__name__} ({x!r:.40}); a NestedTensor holds numbers. "
            "Keep strings in a plain list (padless.collate does this for you)."
        )
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"{what}: sample {i} of type {type(x).__name__} cannot become a tensor ({e}); "
            "samples must be tensors, numpy arrays, numbers or nested lists of numbers"
        ) from None


def infer_ragged(shapes: Sequence[tuple[int, ...]], ragged_dims, what: str) -> tuple[int, ...]:
    """Ragged dims from sample shapes: the dims that differ, or the declared ones (validated)."""
    ndim = len(shapes[0])
    for i, s in enumerate(shapes):
        if len(s) != ndim:
            raise StructureError(
                f"{what}: samples must share one rank: sample {i} has shape {tuple(s)} "
                f"(rank {len(s)}), sample 0 has shape {tuple(shapes[0])} (rank {ndim})"
            )
    if ragged_dims is None:
        varying = tuple(d for d in range(ndim) if any(s[d] != shapes[0][d] for s in shapes))
        if not varying and ndim > 0:
            varying = (0,)  # a batch of equal-size sequences: the leading dim is the ragged one
        return varying
    ragged = norm_ragged_dims(ragged_dims, ndim, what)
    for d in range(ndim):
        if d in ragged:
            continue
        for i, s in enumerate(shapes):
            if s[d] != shapes[0][d]:
                raise StructureError(
                    f"{what}: sample {i} has size {s[d]} at dim {d}, sample 0 has {shapes[0][d]}; "
                    f"dim {d} is static (declared ragged_dims={ragged}). Declare it ragged "
                    f"(ragged_dims={tuple(sorted(ragged + (d,)))}) or fix sample {i}."
                )
    return ragged


# ---------------------------------------------------------------------------- from samples


def from_list(
    samples: Sequence[Any],
    *,
    ragged_dims: Sequence[int] | int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    requires_grad: bool = False,
    pin_memory: bool = False,
    keep_history: bool = False,
    sample_shape: Sequence[int | None] | None = None,
) -> NestedTensor:
    """Pack a list of samples (tensors, arrays, nested lists) into a NestedTensor.

    Ragged dims are the sample dims whose sizes differ, or ``ragged_dims`` when
    given (a declared dim stays ragged even if every sample agrees on it). A
    batch of equal-size samples with nothing declared is ragged along dim 0.

    ``keep_history=False`` copies and returns a leaf (``requires_grad`` decides
    whether it collects ``.grad``); ``keep_history=True`` keeps the autograd
    link to the samples (``padless.nested.as_nested_tensor``).

    An empty list needs ``dtype`` and ``sample_shape`` (``None`` marks a ragged
    dim), e.g. ``from_list([], dtype=torch.float32, sample_shape=(None, 8))``.

    >>> x = from_list([torch.ones(2, 3), torch.zeros(4, 3)])
    >>> x.shape, x.ragged_dims, x.values().shape
    (torch.Size([2, 4, 3]), (0,), torch.Size([6, 3]))
    """
    what = "NestedTensor.from_list" if not keep_history else "as_nested_tensor"
    if isinstance(samples, Tensor) or not isinstance(samples, (list, tuple)):
        raise TypeError(f"{what}: expected a list or tuple of samples, got {type(samples).__name__}")
    if len(samples) == 0:
        if dtype is None or sample_shape is None:
            raise StructureError(
                f"{what}: an empty list needs dtype= and sample_shape= (None marks a ragged dim), "
                "e.g. sample_shape=(None, 8), dtype=torch.float32"
            )
        ragged = tuple(d for d, s in enumerate(sample_shape) if s is None)
        static = [s for s in sample_shape if s is not None]
        values = torch.empty((0, *static), dtype=dtype)
        sizes = torch.empty((0, len(sample_shape)), dtype=torch.int64)
        return _finish(values, sizes, ragged, device, requires_grad, pin_memory, False)

    ts = [x if type(x) is Tensor else _as_sample(x, i, what) for i, x in enumerate(samples)]
    if device is None:
        dev0 = ts[0].device
        for i, t in enumerate(ts):
            if t.device != dev0:
                raise StructureError(
                    f"{what}: samples are on different devices: sample {i} is on {t.device}, "
                    f"sample 0 on {dev0}; move them to one device or pass device="
                )
    shapes = [tuple(t.shape) for t in ts]
    ragged = infer_ragged(shapes, ragged_dims, what)
    ndim = len(shapes[0])
    order = layout.storage_order(ndim, ragged)
    static_shape = [shapes[0][d] for d in layout.static_dims(ndim, ragged)]
    if dtype is None:
        dtype = ts[0].dtype
        for other in {t.dtype for t in ts}:
            dtype = torch.promote_types(dtype, other)
    host_sizes = torch.tensor(shapes, dtype=torch.int64).reshape(len(ts), ndim)
    identity = order == tuple(range(ndim))
    fast = ragged == (0,) or (not ragged and ndim == 0)  # samples are already (rows, *static)
    rows = None if fast else layout.row_counts(host_sizes, ragged).tolist()

    def pack() -> Tensor:
        if fast:
            parts = ts if ndim else [t.reshape(1) for t in ts]
        else:
            parts = []
            for t, r in zip(ts, rows):
                if not identity:
                    t = t.permute(order)
                parts.append(t.reshape(r, *static_shape))
        if device is not None:
            parts = [p.to(device) for p in parts]
        return torch.cat(parts).to(dtype)

    if keep_history:
        values = pack()
    else:
        with torch.no_grad():
            values = pack()
    return _finish(values, host_sizes, ragged, device, requires_grad, pin_memory, keep_history)


# ---------------------------------------------------------------------------- from padded


def _mask_lengths(mask: Tensor, what: str) -> Tensor:
    """Per-sample lengths along each dim a prefix mask covers; raises if not a prefix mask."""
    b = mask.shape[0]
    k = mask.dim() - 1
    lens = []
    for j in range(k):
        other = [d for d in range(1, k + 1) if d != j + 1]
        along = mask.any(dim=other) if other else mask
        lens.append(along.sum(dim=1))
    lengths = torch.stack(lens, 1) if k else torch.zeros(b, 0, dtype=torch.int64)
    rebuilt = torch.ones_like(mask)
    for j in range(k):
        ar = torch.arange(mask.shape[j + 1], device=mask.device)
        view = [1] * (k + 1)
        view[j + 1] = mask.shape[j + 1]
        rebuilt = rebuilt & (ar.view(view) < lengths[:, j].view([b] + [1] * k))
    bad = (rebuilt != mask).reshape(b, -1).any(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise StructureError(
            f"{what}: mask is not a prefix mask: sample {i} has a True after a False "
            f"(padless packs the leading valid block of every sample; mask shape {tuple(mask.shape)}). "
            "Use padless.nested.masked_select to pack arbitrary selected elements."
        )
    return lengths


def from_padded(
    padded: Tensor,
    lengths: Tensor | Sequence | None = None,
    *,
    mask: Tensor | None = None,
    ragged_dims: Sequence[int] | int | None = None,
    like: NestedTensor | None = None,
) -> NestedTensor:
    """Pack a padded tensor ``(B, *envelope)`` given per-sample ``lengths``, a prefix ``mask``,
    or the structure of a NestedTensor ``like``.

    * ``lengths`` of shape ``(B,)``: one ragged dim (``ragged_dims`` or sample dim 0);
      ``(B, R)``: R ragged dims (``ragged_dims`` or the leading R sample dims).
    * ``mask`` (bool) of shape ``padded.shape[:k+1]``: True where valid, a prefix in
      every covered dim; the covered sample dims ``0..k-1`` become ragged.
    * ``like``: the ragged structure of that NestedTensor (its rows and offsets; static
      extents from ``padded``), e.g. ``from_padded(dense_model(x.to_padded()), like=x)``.
      Under ``torch.compile`` this keeps ``x``'s row count and envelope, so the result
      combines with ``x``; ``lengths`` there give a new, data-dependent row count.

    Differentiable w.r.t. ``padded``. Lengths or masks on a device are read on the host
    (one sync); pass CPU lengths to avoid it.

    >>> x = from_padded(torch.arange(6.).view(2, 3), torch.tensor([3, 1]))
    >>> x.tolist()
    [[0.0, 1.0, 2.0], [3.0]]
    """
    what = "NestedTensor.from_padded"
    if like is not None:
        if lengths is not None or mask is not None or ragged_dims is not None:
            raise StructureError(f"{what}: like= gives the whole structure; pass no lengths, mask or ragged_dims with it")
        return pack_like(padded, like)
    if torch.compiler.is_compiling() and (isinstance(lengths, Tensor) or (lengths is None and isinstance(mask, Tensor))):
        return pack_lengths(padded, lengths, ragged_dims, mask)
    if not isinstance(padded, Tensor) or isinstance(padded, NestedTensor):
        raise TypeError(f"{what}: padded must be a dense tensor, got {type(padded).__name__}")
    if padded.dim() < 2:
        raise StructureError(f"{what}: padded must have a batch dim and at least one sample dim, got shape {tuple(padded.shape)}")
    if (lengths is None) == (mask is None):
        raise StructureError(f"{what}: pass exactly one of lengths= or mask=")
    b, ndim = padded.shape[0], padded.dim() - 1
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"{what}: mask must be bool, got {mask.dtype}")
        if mask.dim() < 2 or tuple(mask.shape) != tuple(padded.shape[: mask.dim()]):
            raise ValueError(
                f"{what}: mask shape {tuple(mask.shape)} must equal the leading dims of padded "
                f"{tuple(padded.shape)} (batch included)"
            )
        lens = _mask_lengths(mask.cpu(), what)
        covered = tuple(range(mask.dim() - 1))
        ragged = covered if ragged_dims is None else norm_ragged_dims(ragged_dims, ndim, what)
        for j, d in enumerate(covered):
            if d not in ragged and bool((lens[:, j] != padded.shape[d + 1]).any()):
                raise StructureError(f"{what}: mask varies along dim {d}, which is not in ragged_dims={ragged}")
        full = torch.tensor(padded.shape[1:], dtype=torch.int64).repeat(b, 1)
        full[:, list(covered)] = lens
    else:
        lens = torch.as_tensor(lengths).cpu()
        if lens.is_floating_point() or lens.dtype == torch.bool:
            raise TypeError(f"{what}: lengths must be integers, got {lens.dtype}")
        lens = lens.to(torch.int64)
        if lens.dim() == 1:
            lens = lens[:, None]
        if lens.dim() != 2 or lens.shape[0] != b:
            raise StructureError(f"{what}: lengths must be (B,) or (B, R) with B={b}, got shape {tuple(lens.shape)}")
        r = lens.shape[1]
        ragged = tuple(range(r)) if ragged_dims is None else norm_ragged_dims(ragged_dims, ndim, what)
        if len(ragged) != r:
            raise StructureError(f"{what}: lengths has {r} column(s) but ragged_dims={ragged} names {len(ragged)} dim(s)")
        full = torch.tensor(padded.shape[1:], dtype=torch.int64).repeat(b, 1)
        full[:, list(ragged)] = lens
    for j, d in enumerate(ragged):
        col = full[:, d]
        over = (col > padded.shape[d + 1]) | (col < 0)
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise StructureError(
                f"{what}: lengths and values disagree: sample {i} has length {int(col[i])} along dim {d}, "
                f"but padded has extent {padded.shape[d + 1]} there"
            )
    order = layout.storage_order(ndim, ragged)
    offsets = layout.offsets_from_counts(layout.row_counts(full, ragged))
    total = int(offsets[-1])
    idx = layout.padded_row_index(full, offsets, ragged, total, padded.shape[1:])
    static = [padded.shape[d + 1] for d in order[len(ragged):]]
    grid = padded.permute(0, *[d + 1 for d in order]).reshape(-1, *static)
    values = grid.index_select(0, idx.to(padded.device))
    return _finish(values, full, ragged, None, False, False, True)


# ---------------------------------------------------------------------------- from packed values


def require_integer(t: Tensor, name: str, what: str) -> None:
    """Refuse float, complex and bool metadata: converting it would truncate (2.9 -> 2)
    or turn NaN into a huge negative number. Names the first offending entry."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        flat = t.detach().reshape(-1).cpu()  # error path only
        bad = ""
        if t.dtype != torch.bool and flat.numel():
            odd = (flat != flat.round()) | ~torch.isfinite(flat) if not t.is_complex() else flat.imag != 0
            if bool(odd.any()):
                j = int(odd.nonzero()[0, 0])
                if t.dim() != 1:
                    where = f"entry {tuple(int(k) for k in torch.unravel_index(torch.tensor(j), t.shape))}"
                else:
                    where = f"{name}[{j}]" if name == "offsets" else f"sample {j}"
                bad = f" ({where} is {flat[j].item()})"
        raise TypeError(f"{what}: {name} must be an integer tensor (int64), got {t.dtype}{bad}")


def _check_sizes(host_sizes: Tensor, what: str) -> None:
    """Sizes are extents: every entry >= 0 (negative extents would wrap the row counts)."""
    neg = host_sizes < 0
    if bool(neg.any()):
        i, d = (int(k) for k in neg.nonzero()[0])
        raise StructureError(
            f"{what}: sizes must be >= 0: sample {i} has extent {int(host_sizes[i, d])} along dim {d} "
            f"(its shape reads {tuple(host_sizes[i].tolist())})"
        )


INT64_MAX = (1 << 63) - 1


def _check_counts_fit(counts: Tensor, what: str, sizes: Tensor | None = None) -> None:
    """Host row counts (``>= 0``) whose running sum stays in int64: offsets that would wrap
    around raise, naming the sample. One cumsum and one min (a wrapped sum goes negative)."""
    if counts.numel() == 0:
        return
    cs = torch.cumsum(counts, 0)
    if int(cs.min()) < 0:
        i = int((cs < 0).nonzero()[0, 0])
        shape = f" (shape {tuple(sizes[i].tolist())})" if sizes is not None else ""
        raise StructureError(
            f"{what}: the row counts' cumulative sum passes the int64 range at sample {i}{shape}, "
            f"which has {int(counts[i])} rows: the offsets would wrap around"
        )


def _check_products_fit(host_sizes: Tensor, ragged: Sequence[int], what: str) -> None:
    """Every sample's row count (the product of its ragged extents) fits int64: a float screen,
    then an exact product for the samples near the limit."""
    if not ragged or host_sizes.shape[0] == 0:
        return
    ext = host_sizes[:, list(ragged)]
    near = (ext.double().log2().sum(1) > 62.0).nonzero().flatten().tolist()  # log2(0) = -inf: fine
    for i in near:
        n = 1
        for e in ext[i].tolist():
            n *= e
        if n > INT64_MAX:
            raise StructureError(
                f"{what}: sample {i} has shape {tuple(host_sizes[i].tolist())}, whose {n} rows (the product of "
                f"its ragged extents along dims {tuple(ragged)}) pass the int64 range"
            )


def _check_envelope_fits(b: int, env: Sequence[int], what: str) -> None:
    """The padded envelope ``(B, *env)`` has a numel torch can hold (its shape is the tensor's shape)."""
    n = b
    for e in env:
        n *= int(e)
    if n > INT64_MAX:
        raise StructureError(
            f"{what}: the padded envelope {(b, *(int(e) for e in env))} has {n} elements, past the int64 range "
            "torch allows for a tensor's shape"
        )


def _check_offsets(offsets: Tensor, total: int, what: str) -> None:
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise StructureError(f"{what}: offsets must be 1-D with B+1 entries, got shape {tuple(offsets.shape)}")
    require_integer(offsets, "offsets", what)
    o = offsets.cpu()
    if int(o[0]) != 0:
        raise StructureError(f"{what}: offsets must start at 0, got offsets[0]={int(o[0])}")
    dec = o[1:] < o[:-1]  # compared, not subtracted: a difference of int64 offsets can wrap
    if bool(dec.any()):
        i = int(dec.nonzero()[0, 0])
        raise StructureError(
            f"{what}: offsets must be non-decreasing: offsets[{i}]={int(o[i])} > offsets[{i + 1}]={int(o[i + 1])}"
        )
    if int(o[-1]) != total:
        raise StructureError(
            f"{what}: offsets must end at len(values)={total}, but offsets[-1]={int(o[-1])}"
        )


def from_values(
    values: Tensor,
    offsets: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    sizes: Tensor | None = None,
    ragged_dims: Sequence[int] | int | None = None,
    max_seqlen: int | Sequence[int] | None = None,
    validate: bool = True,
) -> NestedTensor:
    """View packed ``values`` ``(T, *static)`` as a NestedTensor (no copy; keeps autograd).

    * one ragged dim: give ``offsets`` (B+1) or ``lengths`` (B); samples are
      ``(L_i, *static)``; ``ragged_dims=(d,)`` moves the ragged dim to sample dim d
      (``values`` rows still enumerate it).
    * several ragged dims: give ``sizes`` ``(B, D)``, the exact shape of every sample,
      and ``ragged_dims`` (default: the leading ``D - values.dim() + 1`` dims).

    With ``validate=True`` the metadata is checked on the host (a sync when it lives
    on a device). ``max_seqlen`` (an int per ragged dim) avoids computing the envelope
    from device data.

    >>> x = from_values(torch.arange(10.).view(5, 2), torch.tensor([0, 2, 2, 5]))
    >>> [tuple(s.shape) for s in x.unbind()]
    [(2, 2), (0, 2), (3, 2)]
    """
    what = "NestedTensor.from_values"
    if not isinstance(values, Tensor) or isinstance(values, NestedTensor):
        raise TypeError(f"{what}: values must be a dense tensor, got {type(values).__name__}")
    if values.dim() < 1:
        raise ValueError(f"{what}: values must have a row dim, got a 0-d tensor")
    total = values.shape[0]
    static = list(values.shape[1:])
    dev = values.device
    if sizes is not None:
        if sizes.dim() != 2:
            raise ValueError(f"{what}: sizes must be (B, D), got shape {tuple(sizes.shape)}")
        require_integer(sizes, "sizes", what)
        ndim = sizes.shape[1]
        n_r = ndim - len(static)
        if n_r < 0:
            raise StructureError(f"{what}: sizes has D={ndim} dims but values has {len(static)} static dims")
        ragged = tuple(range(n_r)) if ragged_dims is None else norm_ragged_dims(ragged_dims, ndim, what)
        if len(ragged) != n_r:
            raise StructureError(
                f"{what}: ragged_dims={ragged} leaves {ndim - len(ragged)} static dims, values has {len(static)}"
            )
        sizes = sizes.to(torch.int64)
        host_sizes = sizes.cpu() if validate or max_seqlen is None else None
        if host_sizes is not None:
            _check_sizes(host_sizes, what)
            _check_products_fit(host_sizes, ragged, what)
            _check_counts_fit(layout.row_counts(host_sizes, ragged), what, host_sizes)
            sd = layout.static_dims(ndim, ragged)
            if sd and not bool((host_sizes[:, list(sd)] == torch.tensor(static)).all()):
                bad = int((host_sizes[:, list(sd)] != torch.tensor(static)).any(1).nonzero()[0, 0])
                raise StructureError(
                    f"{what}: sample {bad} has shape {tuple(host_sizes[bad].tolist())} but values' static "
                    f"dims are {tuple(static)} (static sample dims {sd})"
                )
        counts_src = host_sizes if host_sizes is not None else sizes
        derived = layout.offsets_from_counts(layout.row_counts(counts_src, ragged))
        if offsets is None:
            offsets = derived
        elif validate:
            _check_offsets(offsets, total, what)
            if not torch.equal(offsets.cpu().to(torch.int64), derived.cpu()):
                raise StructureError(f"{what}: offsets disagree with sizes (offsets from sizes: {derived.tolist()})")
        if validate:
            _check_offsets(derived.cpu(), total, what)
    else:
        if (offsets is None) == (lengths is None):
            raise StructureError(f"{what}: pass offsets= or lengths= (one ragged dim), or sizes= (several)")
        if lengths is not None:
            if lengths.dim() != 1:
                raise StructureError(f"{what}: lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
            require_integer(lengths, "lengths", what)
            lengths = lengths.to(torch.int64)
            if validate:
                hl = lengths.cpu()
                if bool((hl < 0).any()):
                    i = int((hl < 0).nonzero()[0, 0])
                    raise StructureError(f"{what}: lengths must be >= 0, sample {i} has {int(hl[i])}")
                _check_counts_fit(hl, what)
                if int(hl.sum()) != total:
                    raise StructureError(
                        f"{what}: lengths and values disagree: lengths sum to {int(hl.sum())} "
                        f"but values has {total} rows"
                    )
            offsets = layout.offsets_from_counts(lengths)
        else:
            require_integer(offsets, "offsets", what)
            if validate:
                _check_offsets(offsets, total, what)
            offsets = offsets.to(torch.int64)
            lengths = offsets[1:] - offsets[:-1]
        ndim = 1 + len(static)
        r = 0 if ragged_dims is None else norm_ragged_dims(ragged_dims, ndim, what)
        if isinstance(r, tuple):
            if len(r) != 1:
                raise StructureError(f"{what}: offsets/lengths describe one ragged dim; for several pass sizes=")
            r = r[0]
        ragged = (r,)
        sizes = torch.empty(lengths.shape[0], ndim, dtype=torch.int64, device=lengths.device)
        sizes[:, r] = lengths
        if static:
            static_cols = [d for d in range(ndim) if d != r]
            sizes[:, static_cols] = torch.tensor(static, dtype=torch.int64, device=lengths.device)
        if sizes.device.type == "cpu":
            host_sizes = sizes
        else:
            host_sizes = sizes.cpu() if validate or max_seqlen is None else None
    host_offsets = None
    if host_sizes is not None:
        host_offsets = layout.offsets_from_counts(layout.row_counts(host_sizes, ragged))
    if max_seqlen is not None:
        ms = list(max_seqlen) if isinstance(max_seqlen, (list, tuple)) else [max_seqlen]
        if len(ms) != len(ragged):
            raise StructureError(f"{what}: max_seqlen needs one int per ragged dim {ragged}, got {ms}")
        env = [0] * ndim
        real = envelope_from_sizes(host_sizes, ragged, static) if host_sizes is not None else None
        for d, m in zip(ragged, ms):
            if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or (isinstance(m, int) and m < 0):
                raise StructureError(f"{what}: max_seqlen must be a non-negative int per ragged dim, got {m!r} for dim {d}")
            if real is not None and m < real[d]:
                i = int(host_sizes[:, d].argmax())
                raise StructureError(
                    f"{what}: max_seqlen={m} for dim {d} is smaller than sample {i}'s extent {real[d]} there; "
                    f"pass max_seqlen >= {real[d]} or omit it"
                )
            # With host metadata the envelope is the real maximum (a larger hint would make
            # equal structures disagree on their padded shape); otherwise the hint is trusted.
            env[d] = real[d] if real is not None else int(m)
        for d, s in zip(layout.static_dims(ndim, ragged), static):
            env[d] = s
    else:
        env = envelope_from_sizes(host_sizes, ragged, static)
    if host_sizes is not None:
        _check_envelope_fits(host_sizes.shape[0], env, what)
    meta = StructureMeta(host_sizes, host_offsets)
    offsets_dev = offsets.to(dev, torch.int64)
    sizes_dev = sizes.to(dev)
    out = nested_from_values(values, offsets_dev, sizes_dev, ragged, env, meta, shared=True)
    lineage.start(out)  # a new batch of samples
    return mark_dynamic(out)


# ---------------------------------------------------------------------------- torch.nested interop


def from_njt(njt: Tensor) -> NestedTensor:
    """Convert a ``torch.nested`` jagged-layout tensor (NJT) into a NestedTensor.

    Args:
        njt: a jagged-layout nested tensor (``layout=torch.jagged``); holes (an NJT made
            with ``lengths=``) are allowed: the result packs only the valid rows.

    Returns:
        A NestedTensor with the same samples, ragged along the NJT's jagged dim. It keeps
        autograd history, and reads the NJT's cached max seqlen when present (no sync).

    Raises:
        TypeError: ``njt`` is not a jagged-layout nested tensor.

    Example:
        >>> import torch, padless
        >>> njt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
        >>> x = padless.from_njt(njt)
        >>> x.shape, x.offsets().tolist()
        (torch.Size([2, 4, 3]), [0, 2, 6])
    """
    what = "NestedTensor.from_njt"
    if not (isinstance(njt, Tensor) and njt.is_nested and njt.layout == torch.jagged):
        raise TypeError(f"{what}: expected a torch.nested tensor with layout=torch.jagged")
    vals = njt.values()
    offsets = njt.offsets()
    lengths = njt.lengths()
    r = njt._ragged_idx - 1
    vals = vals.movedim(r, 0)
    if lengths is not None:
        starts = offsets[:-1].to(torch.int64)
        lengths = lengths.to(torch.int64)
        new_off = layout.offsets_from_counts(lengths)
        total = int(new_off[-1])
        sid = layout.row_sample_ids(new_off, total)
        rows = starts.index_select(0, sid) + torch.arange(total, device=sid.device) - new_off[:-1].index_select(0, sid)
        vals = vals.index_select(0, rows)
        offsets = new_off
    max_seqlen = getattr(njt, "_maybe_max_seqlen", None)
    return from_values(vals, offsets.to(torch.int64), ragged_dims=(r,), max_seqlen=max_seqlen, validate=False)
