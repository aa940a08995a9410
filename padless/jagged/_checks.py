"""Shared structure helpers for the jagged types: offsets <-> lengths, validation, moves.

Validation runs only on host (CPU) tensors, where it costs no device sync; a jagged
type built from device tensors is trusted, as in TorchRec.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def is_host(t: Tensor | None) -> bool:
    """True for a CPU tensor (reading it never waits for a device)."""
    return t is not None and t.device.type == "cpu"


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """``[0, cumsum(lengths)...]`` in the dtype and on the device of ``lengths`` (no sync)."""
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


def cumsum_list(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + int(x))
    return out


def check_int(what: str, name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{what}: {name} must be an integer tensor, got {t.dtype}")


def check_lengths(what: str, lengths: Tensor, total: int) -> None:
    """Host-side check that ``lengths`` are >= 0 and sum to the ``total`` rows of values."""
    if not is_host(lengths):
        return
    if lengths.numel() and bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0, 0])
        raise ValueError(f"{what}: lengths must be >= 0, but lengths[{i}] = {int(lengths[i])}")
    s = int(lengths.sum()) if lengths.numel() else 0
    if s != total:
        raise ValueError(f"{what}: lengths sum to {s} but values has {total} rows; they must agree")


def check_offsets(what: str, offsets: Tensor, total: int) -> None:
    """Host-side check: offsets start at 0, never decrease and end at the ``total`` rows."""
    if not is_host(offsets):
        return
    if offsets.numel() == 0:
        raise ValueError(f"{what}: offsets must hold at least one entry (B+1 values starting at 0), got []")
    if int(offsets[0]) != 0:
        raise ValueError(f"{what}: offsets must start at 0, got offsets[0] = {int(offsets[0])}")
    d = offsets[1:] - offsets[:-1]
    if d.numel() and bool((d < 0).any()):
        i = int((d < 0).nonzero()[0, 0])
        raise ValueError(
            f"{what}: offsets must not decrease, but offsets[{i}] = {int(offsets[i])} > "
            f"offsets[{i + 1}] = {int(offsets[i + 1])}"
        )
    if int(offsets[-1]) != total:
        raise ValueError(f"{what}: offsets end at {int(offsets[-1])} but values has {total} rows; they must agree")


def check_weights(what: str, weights: Tensor | None, values: Tensor) -> None:
    """Weights have the shape of values (a shape test: never a sync)."""
    if weights is None:
        return
    if not isinstance(weights, Tensor):
        raise TypeError(f"{what}: weights must be a tensor or None, got {type(weights).__name__}")
    if weights.shape != values.shape:
        raise ValueError(
            f"{what}: weights must have the shape of values, got weights {tuple(weights.shape)} "
            f"and values {tuple(values.shape)}"
        )


def move(t: Tensor | None, device: torch.device | str, non_blocking: bool) -> Tensor | None:
    return None if t is None else t.to(device, non_blocking=non_blocking)


def pin(t: Tensor | None) -> Tensor | None:
    return None if t is None or t.is_pinned() else t.pin_memory()


def record(t: Tensor | None, stream: torch.cuda.Stream) -> None:
    if t is not None and t.device.type != "cpu":
        t.record_stream(stream)
