"""Host-side structure of a batch: row counts for ops that make new rows, and reshape targets.

Shared by the families that build new structures (shape ops, pixel layout, patches,
spatial plans, NJT parity).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
from torch import Tensor

from padless.ops.common.structure import RAGGED, STATIC, DimSpec, keep_all
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values
from padless.tensor.core import NestedTensor, StructureMeta, _is_traced, envelope_from_sizes
from padless.tensor.errors import StructureError
from padless.tensor.lru import LRU, MiB


def host_structure(nt: NestedTensor, op: str) -> tuple[Tensor, Tensor]:
    """``nt``'s host sizes and offsets, for ops that must know how many rows they make.

    Syncs once for a device batch built without host metadata (see
    :meth:`NestedTensor.host_sizes`); refused under ``torch.compile``, where sizes are
    runtime data and a row count cannot be read.
    """
    if nt._meta.host_sizes is None and _is_traced(nt._sizes):
        raise NotImplementedError(
            f"{op}(): this op builds a new ragged structure (row counts, envelope) from the batch's host "
            "metadata; it is not available inside torch.compile yet. Run it outside the compiled region."
        )
    return nt.host_sizes(), nt.host_offsets()


def from_host_structure(
    values: Tensor,
    host_sizes: Tensor,
    ragged: tuple[int, ...],
    like: NestedTensor,
    host_offsets: Tensor | None = None,
    device_offsets: Tensor | None = None,
) -> NestedTensor:
    """A NestedTensor around ``values`` (autograd kept) with new host sizes, on ``like``'s device.

    ``host_offsets`` default to the row counts of ``host_sizes``; ``device_offsets`` can be
    passed when the rows did not change, to skip a host-to-device copy.
    """
    if host_offsets is None:
        host_offsets = layout.offsets_from_counts(layout.row_counts(host_sizes, ragged))
    dev = like._offsets.device
    on_cpu = dev.type == "cpu"
    sizes = host_sizes if on_cpu else host_sizes.to(dev, non_blocking=True)
    if device_offsets is None:
        device_offsets = host_offsets if on_cpu else host_offsets.to(dev, non_blocking=True)
    env = envelope_from_sizes(host_sizes, ragged, values.shape[1:])
    return nested_from_values(values, device_offsets, sizes, ragged, env, StructureMeta(host_sizes, host_offsets))


def int_entries(op: str, what: str, shape: Sequence[Any]) -> list[int]:
    if all(type(s) is int for s in shape):  # the common case: plain ints
        return list(shape)
    out = []
    for s in shape:
        if isinstance(s, torch.SymInt):
            out.append(s)
            continue
        try:
            if isinstance(s, (Tensor, bool)):
                raise TypeError
            out.append(operator.index(s))
        except TypeError:
            raise TypeError(f"{op}(): {what} entries must be ints, got {s!r}") from None
    return out


def shape_arg(args: tuple) -> list[Any]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return list(args[0])
    return list(args)


def static_changed(nt: NestedTensor, sdim: int, extent: int) -> list[DimSpec]:
    """``nt``'s dims with static sample dim ``sdim`` given a new extent."""
    dims = keep_all(nt)
    dims[sdim] = (STATIC, extent)
    return dims


def ragged_error(op: str, nt: NestedTensor, odim: int, why: str) -> StructureError:
    """A structure error (both ValueError and RuntimeError, as torch.nested code expects)."""
    return StructureError(
        f"{op}(): dim {odim} is ragged; {why} (ragged outer dims: {tuple(r + 1 for r in nt.ragged_dims)})"
    )




def fit_run(entries: Sequence[int], numel: int) -> list[int] | None:
    """``entries`` as a static run of ``numel`` elements (one -1 inferred), or None."""
    holes = [i for i, e in enumerate(entries) if e == -1]
    known = math.prod(e for e in entries if e != -1)
    if len(holes) > 1:
        return None
    if holes:
        if known == 0 or numel % known:
            return None
        out = list(entries)
        out[holes[0]] = numel // known
        return out
    return list(entries) if known == numel else None


def _is_extent(entry: Any, extent: Any, guard: bool) -> bool:
    """Whether a reshape target ``entry`` stands for a ragged dim of envelope ``extent``: -1, or
    equal to it (``guard`` False: only when known without a guard on a symbolic extent)."""
    symbolic = isinstance(entry, torch.SymInt) or isinstance(extent, torch.SymInt)
    if not isinstance(entry, torch.SymInt) and entry == -1:
        return True
    if guard or not symbolic:
        return bool(entry == extent)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(entry == extent))


# match_target's answers for plain-int targets and envelopes: a model reshapes the same way at
# every layer (``q.view(B, -1, H, D)``), so the search runs once per (target, envelope) pair
_MATCHED = LRU("reshape_targets", max_entries=4096, max_bytes=16 * MiB,
               what="reshape/view answers, by (batch size, ragged dims, envelope, target) as plain ints")


def match_target(nt: NestedTensor, target: list[int], op: str) -> list[DimSpec]:
    """New sample dims for ``reshape``/``view`` (see :func:`padless.ops.rows.shape.reshape` for the rule)."""
    b = nt._sizes.shape[0]
    if type(b) is not int or any(not isinstance(e, int) or isinstance(e, bool) for e in (*nt._env, *target)):
        return _match_target(nt, target, op)  # a symbolic extent: search every time
    # plain ints in the key: an Extent read from x.shape would keep its batch's structure alive
    key = (b, nt._ragged, tuple(int(e) for e in nt._env), tuple(int(t) for t in target))
    hit = _MATCHED.get(key)
    if hit is None:
        hit = tuple(_match_target(nt, target, op))
        _MATCHED.put(key, hit)
    return list(hit)


def check_envelope_reading(nt: NestedTensor, target: list[int], dims: Sequence[DimSpec], op: str) -> None:
    """A ragged dim written as a plain int (its envelope extent) is kept as the ragged dim; refuse
    where a sample alone reads the same plain ints as another shape (``(B, -1, 1)`` of a sample
    of size 0 where the envelope is 1: alone it gives ``(0, 1)``, kept it would be ``(3, 0)``).
    Where a sample alone cannot take the target at all, keeping the ragged dim is the only
    reading and stands. A size read from the shape is each sample's own: not checked here."""
    if not any(spec[0] == RAGGED and type(t) is int and t != -1 for t, spec in zip(target[1:], dims)):
        return
    hs = nt._meta.host_sizes
    if hs is None:
        return  # sizes on the device only (or traced): nothing is read here
    rest = [int(t) for t in target[1:]]
    known = math.prod(t for t in rest if t != -1)
    holes = rest.count(-1)
    for i, sizes in enumerate(hs.tolist()):
        numel = math.prod(sizes)
        if holes == 1:
            if known == 0 or numel % known:
                continue
            own = [numel // known if t == -1 else t for t in rest]
        elif holes == 0 and known == numel:
            own = rest
        else:
            continue
        keep = [sizes[spec[1]] if spec[0] == RAGGED else spec[1] for spec in dims]
        if own != keep:
            d = next(j for j, (t, spec) in enumerate(zip(target[1:], dims)) if spec[0] == RAGGED and type(t) is int and t != -1)
            raise StructureError(
                f"{op}(): the target {tuple(int(t) for t in target)} writes ragged dim {dims[d][1] + 1} as the plain "
                f"int {rest[d]} (its envelope extent), but sample {i} of shape {tuple(sizes)} alone reads these ints as "
                f"{tuple(own)}, not {tuple(keep)}: the plain int is ambiguous there. Write that dim as a size read from "
                f"the shape (x.shape[{dims[d][1] + 1}]) or as -1"
            )


_LOST_LINK = (
    ". Under torch.compile, the unfold (B, N, ...) of a folded batch finds its parent through the fold "
    "in the same graph: a graph break between the fold and the unfold (torch._dynamo.graph_break(), an op "
    "that runs eagerly) loses that link. Keep the fold and its unfold in one graph, or unfold eagerly"
)


def _match_target(nt: NestedTensor, target: list[int], op: str) -> list[DimSpec]:
    b, d = nt.batch_size, nt.sample_dim
    if len(target) == 0 or target[0] not in (-1, b):
        raise StructureError(
            f"{op}(): the target shape {tuple(target)} must keep the batch dim first "
            f"(as {b} or -1); a NestedTensor's samples cannot be merged or split"
            + (_LOST_LINK if nt._meta.host_sizes is None and _is_traced(nt._sizes) else "")
        )
    rest = target[1:]
    if any(e < -1 for e in rest):
        raise StructureError(f"{op}(): invalid target shape {tuple(target)}")
    rag = sorted(nt._ragged)
    runs, cur = [], 1
    for s in range(d):
        if s in rag:
            runs.append(cur)
            cur = 1
        else:
            cur *= nt._env[s]
    runs.append(cur)
    found: list[tuple[tuple[int, bool], list[DimSpec]]] = []

    def search(a: int, start: int, dims: list[DimSpec], at_hole: int, same: bool, guard: bool) -> None:
        if a == len(rag):
            run = fit_run(rest[start:], runs[a])
            if run is not None:
                found.append(((at_hole, same), dims + [(STATIC, n) for n in run]))
            return
        for j in range(start, len(rest)):
            if _is_extent(rest[j], nt._env[rag[a]], guard):
                run = fit_run(rest[start:j], runs[a])
                if run is not None:
                    new = dims + [(STATIC, n) for n in run] + [(RAGGED, rag[a])]
                    search(a + 1, j + 1, new, at_hole + (rest[j] == -1), same and j == rag[a], guard)

    # Under tracing the envelope is symbolic: comparing a target entry with it would add a guard
    # (a head dim equal to this batch's longest sample specialises the envelope). Readings that
    # need no guard come first; only when there is none is the envelope compared (guarded).
    search(0, 0, [], 0, True, False)
    if not found:
        search(0, 0, [], 0, True, True)
    if not found:
        raise StructureError(
            f"{op}(): cannot reshape a NestedTensor of envelope {tuple(nt.shape)} with ragged outer dims "
            f"{tuple(r + 1 for r in rag)} to {tuple(target)}: the batch dim and every ragged dim must stay, "
            f"in order, written as -1 or their envelope extent, and each run of static dims between "
            f"them must keep its number of elements (static runs hold {tuple(runs)} elements); "
            "only static dims can be reshaped"
        )
    best = max(score for score, _ in found)
    picks = [dims for score, dims in found if score == best]
    if len(picks) > 1:
        raise StructureError(
            f"{op}(): target shape {tuple(target)} is ambiguous for ragged outer dims "
            f"{tuple(r + 1 for r in rag)} of envelope {tuple(nt.shape)}; write each ragged dim as -1"
        )
    return picks[0]
