"""Shared structure helpers for the jagged types: offsets <-> lengths, validation, moves.

Validation runs only on host (CPU) tensors, where it costs no device sync; a jagged
type built from device (or meta) tensors is trusted, as in TorchRec. Host structure is
computed with numpy on zero-copy views of the CPU tensors: one cumsum and one min over
the lengths, a few microseconds, instead of a handful of small torch ops.

What is accepted follows TorchRec: empty lengths/offsets of any dtype and shape (no
slices), ``values`` with more rows than the lengths use (the tail is ignored), and
per-row weights ``(T,)`` next to values ``(T, D)``.

Weights may have any shape with rows (TorchRec slices them by the same offsets as the
values): ``(T,)`` per row, the shape of values, or more rows than the lengths use.

What TorchRec also accepts but cannot be read (lengths that need more rows than the
values or weights hold, negative lengths, offsets that decrease or do not start at 0,
per-key lists that disagree with the lengths) is a *fault*: the checks
return its message instead of raising, the jagged type keeps it, and only what reads
values through the structure (``to_dict``, ``to_dense``, padding, pooling, printing,
``validate()``) raises it as a ``StructureError``. What only passes the tensors along
(``lengths()``, ``offsets()``, the per-key lists, ``sync()``, ``to()``, ``concat``)
works, as in TorchRec.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.tensor.errors import StructureError


INT64_MAX = (1 << 63) - 1
Where = Callable[[int], str]  # names bag i in messages: "sample 3", "key 'a', sample 1"


def sample_where(i: int) -> str:
    return f"sample {i}"


CHECKED = "<checked>"  # a KJT's ``_pending`` state: structure checked, host bag offsets not computed yet


def unique_keys(what: str, keys: Sequence[str], positional: str) -> None:
    """Raise, naming the first key that repeats: a ``{key: ...}`` view would keep only one."""
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k in seen:
            raise StructureError(
                f"{what}: keys must be unique, but {k!r} is keys[{seen[k]}] and keys[{i}] (keys {list(keys)}); "
                f"a dict by key would keep only one of them. Rename one, or address the keys by position ({positional})"
            )
        seen[k] = i


def vbe_stride(spkpr: list[list[int]], inverse_indices: tuple[list[str], Tensor] | None) -> int:
    """A variable-batch KJT's batch size: the inverse indices' width when given (the full
    batch each key's bags are gathered back to), else the largest per-key batch."""
    if inverse_indices is not None and inverse_indices[1].numel() > 0:
        return int(inverse_indices[1].shape[-1])
    return max((sum(r) for r in spkpr), default=0)


def is_host(t: Tensor | None) -> bool:
    """True for a CPU tensor (reading it never waits for a device)."""
    return t is not None and t.device.type == "cpu"


def offsets_dtype(lengths: Tensor) -> torch.dtype:
    """The dtype of offsets derived from ``lengths``: theirs, or int64 for the empty float
    lengths TorchRec accepts (``torch.tensor([[], []])``), so offsets are always integers."""
    return torch.int64 if lengths.is_floating_point() else lengths.dtype


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """``[0, cumsum(lengths)...]`` in the dtype (``offsets_dtype``) and on the device of ``lengths`` (no sync)."""
    lengths = lengths.reshape(-1)
    out = torch.zeros(lengths.numel() + 1, dtype=offsets_dtype(lengths), device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


def cumsum_list(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + int(x))
    return out


def count(t: Tensor | None, *, offsets: bool) -> int:
    """Number of slices described by lengths (``numel``) or offsets (``numel - 1``, 0 when empty)."""
    if t is None:
        return 0
    return max(t.numel() - 1, 0) if offsets else t.numel()


class IntegerTensorError(TypeError, AssertionError):
    """Lengths or offsets that are not integers: a ``TypeError``, and an ``AssertionError``
    as well, which is what TorchRec raises there (code written for TorchRec catches it)."""


def check_int(what: str, name: str, t: Tensor) -> None:
    """A 1-D integer tensor; an empty one may have any dtype and shape (as TorchRec allows)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if t.numel() == 0:
        return
    if t.dim() != 1:
        raise StructureError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise IntegerTensorError(f"{what}: {name} must be an integer tensor, got {t.dtype}")


def _np(t: Tensor) -> np.ndarray:
    return t.numpy() if t.dim() == 1 and not t.requires_grad else t.detach().reshape(-1).numpy()


def host_offsets(
    what: str, lengths: Tensor | None, offsets: Tensor | None, total: int, where: Where = sample_where
) -> tuple[Tensor | None, str | None]:
    """Int64 CPU offsets ``(B+1,)`` from host lengths and/or offsets (None if neither is on
    the host), and the fault found, if any (never raised here: see the module note).

    Sound structure: lengths >= 0, offsets from 0 and never decreasing, both agreeing when
    both are given, at most the ``total`` rows of values used (more rows are allowed and
    ignored, as in TorchRec). Lengths whose cumulative sum passes int64 (offsets that
    would wrap around) are a fault, naming the bag (``where``). With a fault, the offsets
    are still what TorchRec derives (the cumsum of the lengths when given, else the
    offsets as they are).
    """
    host: np.ndarray | None = None
    fault: str | None = None
    if lengths is not None and is_host(lengths):
        ln = _np(lengths) if lengths.numel() else np.zeros(0, np.int64)
        if ln.size and ln.min() < 0:
            fault = _negative(what, ln)
        else:
            fault = _wraps(what, ln, where)
        host = _cumsum(ln)
    if offsets is not None and is_host(offsets):
        of = _np(offsets).astype(np.int64, copy=False) if offsets.numel() else np.zeros(1, np.int64)
        dec = of[1:] < of[:-1]  # compared, not subtracted: a difference of int64 offsets can wrap
        if fault is not None:
            pass
        elif of[0] != 0:
            fault = f"{what}: offsets must start at 0, got offsets[0] = {int(of[0])}"
        elif dec.any():
            i = int(np.flatnonzero(dec)[0])
            fault = (
                f"{what}: offsets must not decrease, but offsets[{i}] = {int(of[i])} > "
                f"offsets[{i + 1}] = {int(of[i + 1])} ({where(i)})"
            )
        elif host is not None and not np.array_equal(of, host):
            fault = f"{what}: lengths and offsets disagree: offsets {of.tolist()}, cumsum of lengths {host.tolist()}"
        if host is None:
            host = of
    if host is None:
        return None, None
    if fault is None and int(host[-1]) > total:
        fault = _too_short(what, int(host[-1]), total)
    return torch.from_numpy(host if host.flags.c_contiguous and host.flags.writeable else host.copy()), fault


def key_offsets(
    what: str, lengths: Tensor, keys: int, stride: int, total: int, where: Where = sample_where
) -> tuple[list[int], str | None]:
    """``offset_per_key`` of a fixed-batch KJT from its host lengths ``(keys * stride,)`` and
    the fault found (as ``host_offsets`` finds them): one min, one max and one row sum, no cumsum."""
    ln = _np(lengths)
    fault = _negative(what, ln) if ln.min() < 0 else _wraps(what, ln, where)
    if fault is not None and ln.min() >= 0:  # the row sums below would wrap: the lists stay as exact as Python makes them
        return cumsum_list(int(x) for x in ln.reshape(keys, stride).sum(1, dtype=object).tolist()), fault
    opk = cumsum_list(ln.reshape(keys, stride).sum(1).tolist())
    if fault is None and opk[-1] > total:
        fault = _too_short(what, opk[-1], total)
    return opk, fault


def cumsum_host(lengths: Tensor) -> Tensor:
    """``[0, cumsum(lengths)...]`` of (already checked) host lengths, int64 on the CPU."""
    return torch.from_numpy(_cumsum(_np(lengths) if lengths.numel() else np.zeros(0, np.int64)))


def _cumsum(ln: np.ndarray) -> np.ndarray:
    host = np.zeros(ln.size + 1, np.int64)
    host[1:] = ln
    np.cumsum(host, out=host)  # in place, int64 (a casting cumsum is much slower)
    return host


def _wraps(what: str, ln: np.ndarray, where: Where) -> str | None:
    """The fault of non-negative lengths whose cumulative sum passes int64 (offsets would wrap
    around to negative values), or None. One ``max``; the exact sum runs only when the max
    times the count could pass int64."""
    if not ln.size or int(ln.max()) * ln.size <= INT64_MAX:
        return None
    run = 0
    for i, x in enumerate(ln.tolist()):
        run += int(x)
        if run > INT64_MAX:
            return (
                f"{what}: the lengths' cumulative sum passes the int64 range at lengths[{i}] = {int(x)} "
                f"({where(i)}): the offsets would wrap around; lengths must sum to at most {INT64_MAX}"
            )
    return None


def _negative(what: str, ln: np.ndarray) -> str:
    i = int(np.flatnonzero(ln < 0)[0])
    return f"{what}: lengths must be >= 0, but lengths[{i}] = {int(ln[i])}"


def _too_short(what: str, covered: int, total: int) -> str:
    return (
        f"{what}: the lengths cover {covered} rows but values has only {total}; "
        "values must hold at least sum(lengths) rows"
    )


def weights_fault(what: str, weights: Tensor | None) -> str | None:
    """The fault of 0-d weights (weights are read by rows, as values are; how many rows
    they need is checked with the structure: ``short_weights``). No tensor raises."""
    if weights is None:
        return None
    if not isinstance(weights, Tensor):
        raise TypeError(f"{what}: weights must be a tensor or None, got {type(weights).__name__}")
    return f"{what}: weights must have a row dim (T, ...), got a 0-d tensor" if weights.dim() == 0 else None


def short_weights(what: str, weights: Tensor | None, used: int) -> str | None:
    """The fault of weights with fewer rows than the ``used`` rows the lengths cover."""
    if weights is None or weights.dim() == 0 or weights.shape[0] >= used:
        return None
    return (
        f"{what}: the lengths cover {used} rows but weights has only {weights.shape[0]}; "
        "weights must hold at least sum(lengths) rows"
    )


def check_weights(what: str, weights: Tensor | None, values: Tensor) -> None:
    """Weights of the shape of values, or one per row ``(T,)``, at once (for the constructors
    that build values and weights together from dense slices)."""
    if weights is None:
        return
    if not isinstance(weights, Tensor):
        raise TypeError(f"{what}: weights must be a tensor or None, got {type(weights).__name__}")
    if weights.shape != values.shape and tuple(weights.shape) != tuple(values.shape[:1]):
        raise StructureError(
            f"{what}: weights must have the shape of values or one weight per row, got weights "
            f"{tuple(weights.shape)} and values {tuple(values.shape)}"
        )


def used(t: Tensor | None, end: int | None) -> Tensor | None:
    """``t`` without the rows past ``end`` (the tail the lengths do not use); no copy."""
    if t is None or end is None or t.shape[0] == end:
        return t
    return t[:end]


def nbytes(*ts: Tensor | None) -> int:
    return sum(t.element_size() * t.numel() for t in ts if t is not None)


def free(t: Tensor | None) -> int:
    """Release ``t``'s storage (``untyped_storage().resize_(0)``); returns the bytes ``t`` held."""
    if t is None:
        return 0
    n = t.element_size() * t.numel()
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:  # a CPU storage numpy has viewed is not resizable: drop this tensor's hold on it
        t.set_()
    return n


def move(t: Tensor | None, device: torch.device | str, non_blocking: bool) -> Tensor | None:
    return None if t is None else t.to(device, non_blocking=non_blocking)


def pin(t: Tensor | None) -> Tensor | None:
    return None if t is None or t.is_pinned() else t.pin_memory()


def record(t: Tensor | None, stream: torch.cuda.Stream) -> None:
    if t is not None and t.device.type != "cpu":
        t.record_stream(stream)


def values_string(values: Tensor, start: int, end: int, max_dims: int = 2) -> str:
    """``[v0, v1, ...]`` of rows ``start:end`` (rows of a 2-D values print as lists), as TorchRec
    prints; values of more than ``max_dims`` dims raise a ``ValueError``, as TorchRec's
    ``str()`` does (2 for the jagged types; a KeyedTensor's blocks print up to 3)."""
    if values.dim() > max_dims:
        raise ValueError(
            f"str(): values of shape {tuple(values.shape)} have more than {max_dims} dims, which are not "
            "printed (as in TorchRec); use repr() for a summary, or to_dense() for the contents"
        )
    return _fmt(values[start:end].tolist())


def jagged_string(values: Tensor, host: Sequence[int], first: int, last: int) -> str:
    """``[[...], [], ...]`` of slices ``first..last-1`` given host offsets."""
    return "[" + ", ".join(values_string(values, host[i], host[i + 1]) for i in range(first, last)) + "]"


def _fmt(x: object) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)
