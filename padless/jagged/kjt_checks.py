"""The structure checks a KeyedJaggedTensor defers to first use, and its given per-key lists.

Nothing here raises for a structure TorchRec accepts: a fault (lengths that need more rows
than the values hold, negative lengths, offsets that decrease, given per-key lists that
disagree with the lengths, weights with fewer rows than the lengths use) is recorded on the KJT as a message,
and ``KeyedJaggedTensor._host()``/``validate()`` raise it for what reads values through the
structure (see ``padless.jagged._checks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from padless.jagged import _checks as C

if TYPE_CHECKING:
    from padless.jagged.keyed_jagged import KeyedJaggedTensor

WHAT = "KeyedJaggedTensor"


def given_lists(
    keys: int, total: int, length_per_key: Sequence[int] | None, offset_per_key: Sequence[int] | None
) -> tuple[list[int] | None, list[int] | None, str, str | None]:
    """``(length_per_key, offset_per_key, blame, fault)`` from the lists a caller gave.

    They are kept as given (TorchRec keeps them, and returns them from
    ``length_per_key()``), the missing one derived from the other; ``blame`` names the
    given list the deferred check compares with the lengths (``""`` when none was given);
    ``fault`` says what is malformed about them (a count or a sum that cannot be right).
    """
    lpk = opk = None
    blame = ""
    fault = None
    if length_per_key is not None:
        lpk = [int(x) for x in length_per_key]
        if len(lpk) != keys:
            fault = f"{WHAT}: keys and length_per_key disagree: {keys} keys, {len(lpk)} lengths {lpk}"
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
        blame = blame or "offset_per_key"
    if lpk is not None and opk is None:
        opk = C.cumsum_list(lpk)
    elif opk is not None and lpk is None:
        lpk = [b - a for a, b in zip(opk[:-1], opk[1:])]
    return lpk, opk, blame, fault


def check(kjt: "KeyedJaggedTensor") -> None:
    """The checks ``KeyedJaggedTensor`` construction defers, for a KJT not checked yet.

    Fills ``length_per_key``/``offset_per_key`` as TorchRec derives them (faulty or not;
    given lists stay as given) and records the first fault. Host lengths alone (the common
    case) take one min and one per-key sum, leaving the bag offsets' cumsum to the first
    op that needs them (the ``CHECKED`` state).
    """
    blame = kjt._pending
    lengths, offsets = kjt._lengths, kjt._offsets
    total = kjt._values.shape[0]
    if (
        offsets is None and lengths is not None and kjt._stride_per_key_per_rank is None
        and lengths.numel() and lengths.device.type == "cpu"
    ):
        opk, fault = C.key_offsets(WHAT, lengths, len(kjt._keys), kjt._stride, total)
        host = None
    else:
        if lengths is None and offsets is None:  # no bags
            host, fault = torch.zeros(1, dtype=torch.int64), None
        else:
            host, fault = C.host_offsets(WHAT, lengths, offsets, total)
        hn = None if host is None else host.numpy()
        opk = None if hn is None else (hn[kjt.lengths_offset_per_key()] - hn[0]).tolist()
    if fault is None and opk is not None and kjt._weights is not None:
        fault = C.short_weights(WHAT, kjt._weights, opk[-1])
    if opk is not None:
        if not blame:
            kjt._offset_per_key = opk
            kjt._length_per_key = [b - a for a, b in zip(opk[:-1], opk[1:])]
        elif kjt._offset_per_key != opk and fault is None:
            given = kjt._length_per_key if blame == "length_per_key" else kjt._offset_per_key
            lpk = [b - a for a, b in zip(opk[:-1], opk[1:])]
            fault = f"{WHAT}: {blame} {given} disagrees with lengths (which give {lpk if blame == 'length_per_key' else opk})"
    kjt._fault = kjt._fault or fault
    kjt._host_offsets = host if kjt._fault is None else None
    kjt._pending = C.CHECKED if opk is not None and host is None and kjt._fault is None else None
