"""What a KeyedJaggedTensor's constructor normalises without reading its structure.

The per-key-per-rank strides (lists, or TorchRec's int tensor) and the per-key lists a
caller gives (``length_per_key``/``offset_per_key``). Nothing here raises for a structure
TorchRec accepts: given lists that cannot be right are returned as a fault message, which
the KJT records and raises for what reads values through the structure (see
``padless.jagged._checks``). The checks construction defers to first use, which read the
host lengths and offsets, are ``KeyedJaggedBase._check`` (``padless.jagged.kjt_base``).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from padless.jagged import _checks as C

WHAT = "KeyedJaggedTensor"
POSITIONAL = "values(), lengths(), split, permute"  # what addresses a KJT's keys by position


def _negative(names: Sequence[str], given: str, widths: list[int], shown: list[int] | None = None) -> str:
    k = next(i for i, x in enumerate(widths) if x < 0)
    return (
        f"{WHAT}: {given} must give every key >= 0 values, but key {names[k]!r} has {widths[k]} "
        f"({given} {shown if shown is not None else widths})"
    )


def given_lists(
    names: Sequence[str], total: int, length_per_key: Sequence[int] | None, offset_per_key: Sequence[int] | None
) -> tuple[list[int] | None, list[int] | None, str, str | None]:
    """``(length_per_key, offset_per_key, blame, fault)`` from the lists a caller gave.

    They are kept as given (TorchRec keeps them, and returns them from
    ``length_per_key()``), the missing one derived from the other; ``blame`` names the
    given list the deferred check compares with the lengths (``""`` when none was given);
    ``fault`` says what is malformed about them (a count or a sum that cannot be right, a
    negative width, naming its key).
    """
    keys = len(names)
    lpk = opk = None
    blame = ""
    fault = None
    if length_per_key is not None:
        lpk = [int(x) for x in length_per_key]
        if len(lpk) != keys:
            fault = f"{WHAT}: keys and length_per_key disagree: {keys} keys, {len(lpk)} lengths {lpk}"
        elif any(x < 0 for x in lpk):
            fault = _negative(names, "length_per_key", lpk)
        elif sum(lpk) > total:
            fault = f"{WHAT}: length_per_key {lpk} sums to {sum(lpk)} but values has {total} rows"
        blame = "length_per_key"
    if offset_per_key is not None:
        opk = [int(x) for x in offset_per_key]
        if fault is None and (len(opk) != keys + 1 or opk[0] != 0 or opk[-1] > total):
            fault = (
                f"{WHAT}: offset_per_key must have len(keys) + 1 = {keys + 1} entries from 0 to at most "
                f"{total}, got {opk}"
            )
        elif fault is None and any(b < a for a, b in zip(opk[:-1], opk[1:])):
            fault = _negative(names, "offset_per_key", [b - a for a, b in zip(opk[:-1], opk[1:])], opk)
        blame = blame or "offset_per_key"
    if lpk is not None and opk is None:
        opk = C.cumsum_list(lpk)
    elif opk is not None and lpk is None:
        lpk = [b - a for a, b in zip(opk[:-1], opk[1:])]
    return lpk, opk, blame, fault


def spkpr_list(spkpr: Sequence[Sequence[int]] | Tensor | None) -> list[list[int]] | None:
    """Per-key-per-rank strides as lists (TorchRec also passes an int tensor ``(keys, ranks)``)."""
    if spkpr is None:
        return None
    if isinstance(spkpr, Tensor):
        return [[int(s) for s in r] for r in spkpr.tolist()] if spkpr.dim() == 2 else []
    return [[int(s) for s in r] for r in spkpr]
