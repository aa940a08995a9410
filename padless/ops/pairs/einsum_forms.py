"""Two forms of ``einsum`` that real code writes, brought to the contraction path of ``contract``.

* **Ellipsis** (``"... i k d, ... j k d -> ... i j d"``, what einops emits for any pattern
  with ``...``): every operand's rank is known (a NestedTensor's is ``1 + sample rank``), so
  ``...`` is spelled out in fresh letters, right-aligned as einsum aligns it; a dense
  operand's ellipsis dim of extent 1 facing a larger extent broadcasts (it is squeezed out).
* **Dense operands** beside one NestedTensor (``"b l d, d e -> b l e"``, ``"... h d, h d ->
  ... h"``): a dense operand is the same for every sample, or holds one slice per sample
  when it carries the batch letter (``(B, d)`` for ``"b l d, b d -> b l"``). The contraction
  runs once on the packed rows: the rows letter stands for the NestedTensor's ragged letters,
  a per-sample dense operand is gathered to the rows. Ragged letters the output drops are
  summed afterwards per sample. A dense operand that indexes a ragged letter is refused
  (which coordinates would it mean?).
"""

from __future__ import annotations

import string
from typing import Sequence

import torch
from torch import Tensor

from padless.ops.common.structure import RAGGED, STATIC, call, restructure, static_dims
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError

_ELLIPSIS = "..."


def _fresh(equation: str, n: int) -> list[str]:
    used = set(equation)
    free = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    if len(free) < n:
        raise ValueError(f"einsum(): {equation!r} leaves too few free letters to spell out its ellipsis")
    return free[:n]


def expand_ellipsis(equation: str, operands: Sequence[Tensor]) -> tuple[str, tuple[Tensor, ...]]:
    """``equation`` with every ``...`` spelled out, and the operands (a dense operand's
    broadcast extents of 1 squeezed). Equations without an ellipsis come back unchanged."""
    eq = equation.replace(" ", "")
    if _ELLIPSIS not in eq:
        return equation, tuple(operands)
    if "->" not in eq:
        raise ValueError(
            f"einsum(): {equation!r}: give the output explicitly (an equation with '->', e.g. '...ij->...i')"
        )
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != len(operands):
        raise ValueError(f"einsum(): equation {equation!r} has {len(ins)} operands, got {len(operands)}")
    spans = []
    for k, (s, o) in enumerate(zip(ins, operands)):
        if s.count(_ELLIPSIS) > 1 or "." in s.replace(_ELLIPSIS, ""):
            raise ValueError(f"einsum(): operand {k} ({s!r}) of {equation!r} has a malformed ellipsis")
        named = len(s) - 3 if _ELLIPSIS in s else len(s)
        span = o.dim() - named if _ELLIPSIS in s else 0
        if span < 0:
            raise StructureError(
                f"einsum(): operand {k} ({s!r}) names {named} dims but has {o.dim()}"
                + (" (a NestedTensor's dims count its batch dim)" if isinstance(o, NestedTensor) else "")
            )
        spans.append(span)
    if out.count(_ELLIPSIS) > 1:
        raise ValueError(f"einsum(): the output of {equation!r} has a malformed ellipsis")
    letters = _fresh(eq, max(spans))
    # how many operands carry each ellipsis letter (right-aligned spans)
    carriers = {c: sum(1 for s, span in zip(ins, spans) if _ELLIPSIS in s and j >= len(letters) - span)
                for j, c in enumerate(letters)}
    new_ins, new_ops = [], []
    for s, o, span in zip(ins, operands, spans):
        if _ELLIPSIS not in s:
            new_ins.append(s)
            new_ops.append(o)
            continue
        at = s.index(_ELLIPSIS)
        mine = letters[len(letters) - span :]
        keep = []
        for c in mine:
            if not isinstance(o, NestedTensor) and o.shape[at + len(keep)] == 1 and carriers[c] > 1:
                # einsum broadcasts an ellipsis extent of 1: the letter's extent comes from the others
                o = o.squeeze(at + len(keep))
            else:
                keep.append(c)
        new_ins.append(s.replace(_ELLIPSIS, "".join(keep)))
        new_ops.append(o)
    new_out = out.replace(_ELLIPSIS, "".join(letters))
    return ",".join(new_ins) + "->" + new_out, tuple(new_ops)


def einsum_with_dense(ins: list[str], out: str, operands: Sequence[Tensor], equation: str) -> NestedTensor:
    """One NestedTensor and dense operands: the contraction on the packed rows (see module doc)."""
    nested = [k for k, o in enumerate(operands) if isinstance(o, NestedTensor)]
    if len(nested) != 1:
        raise TypeError(
            f"einsum(): {equation!r}: dense operands are taken beside exactly one NestedTensor operand "
            f"(got {len(nested)}); contract NestedTensors with each other first, or move the dense weights "
            "into linear/matmul"
        )
    k = nested[0]
    nt, s = operands[k], ins[k]
    if len(s) != nt.dim():
        raise StructureError(f"einsum(): operand {s!r} has {len(s)} indices but the NestedTensor has {nt.dim()} dims")
    batch = s[0]
    if not out or out[0] != batch or batch in out[1:]:
        raise ValueError(f"einsum(): {equation!r}: the output must start with the batch index {batch!r} of the NestedTensor")
    if len(set(s)) != len(s):
        raise StructureError(f"einsum(): {equation!r}: a repeated index in the NestedTensor operand {s!r} (a diagonal) is not supported")
    ragged = [s[1 + d] for d in nt._ragged]  # storage order
    static = [s[1 + d] for d in static_dims(nt)]
    (rows,) = _fresh(equation + "".join(ins) + out, 1)
    terms, tensors = [rows + "".join(static)], [values_of(nt)]
    for j, (t, o) in enumerate(zip(ins, operands)):
        if j == k:
            continue
        if len(t) != o.dim():
            raise StructureError(f"einsum(): dense operand {j} ({t!r}) has {o.dim()} dims, its subscripts name {len(t)}")
        bad = [c for c in t if c in ragged]
        if bad:
            raise StructureError(
                f"einsum(): {equation!r}: dense operand {j} ({t!r}) indexes {bad[0]!r}, a ragged dim of the "
                "NestedTensor (its extent differs per sample); give that operand as a NestedTensor of the same "
                "structure, or index only the static dims"
            )
        if batch in t:
            at = t.index(batch)
            if o.shape[at] not in (1, nt.batch_size):
                raise StructureError(
                    f"einsum(): dense operand {j} ({t!r}) has extent {o.shape[at]} at the batch index {batch!r}, "
                    f"the batch holds {nt.batch_size} samples"
                )
            if o.shape[at] == 1:
                o, t = o.squeeze(at), t.replace(batch, "")
            else:  # one slice per sample: gathered to that sample's rows
                o = o.movedim(at, 0).index_select(0, nt.row_sample_ids())
                t = rows + t.replace(batch, "")
        terms.append(t)
        tensors.append(o)
    keep = [c for c in out[1:]] + [c for c in ragged if c not in out]
    result = torch.einsum(",".join(terms) + "->" + rows + "".join(c for c in keep if c not in ragged), *tensors)
    sizes = iter(result.shape[1:])
    spec = [(RAGGED, s.index(c) - 1) if c in ragged else (STATIC, next(sizes)) for c in keep]
    y = restructure(nt, result, spec)
    dropped = tuple(1 + i for i, c in enumerate(keep) if i >= len(out) - 1)
    return call(torch.sum, y, dim=dropped) if dropped else y
