"""Pair plan recipes: the bucket plans a model builds, learned once, built for any batch.

A pair model's contractions (attention scores ``q @ k^T``, ``softmax(...) @ v``, triangle
products) run in padded buckets on a *plan* (:mod:`padless.ops.pairs.bucketed`): which samples
share a bucket, and index maps of every operand into its bucket buffers. A plan depends on the
operands' rows only (host sizes and offsets, found by content), so every layer of a stack shares
it, but a new batch builds it again. For a token field of lengths ``N_i``, every operand of such a
model is ``N_i`` along each ragged dim, with static extents the model fixes (heads, head width)::

    q (N_i, H, D)  k (N_i, H, D)    ->  scores (H, N_i, N_i)       plan 0 (buckets chosen)
    weights (H, N_i, N_i)  v (N_i, H, D)  ->  out (N_i, H, D)      plan 1 (on plan 0's buckets)

:func:`record` runs one step of the model on an example and keeps every plan built as a
:class:`Step` relative to the example's lengths; :func:`replay` builds the same plans for other
lengths (a Collator's worker does it for every batch, ``Field(pair_plans=recipe)``);
:func:`export` and :func:`install` carry them to the main process's content cache, where the
contractions find them: the first step of a new batch builds no plan. A plan the recipe did not
record (another equation, other static extents) is built on first use, as without a recipe.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.ops.common import content
from padless.ops.common.dry_run import model_step, traceless
from padless.ops.kernels.layout import RowMap
from padless.ops.pairs import bucketed
from padless.ops.pairs.bucket_nodes import _Plan
from padless.ops.pairs.pending import Pending
from padless.tensor import layout
from padless.tensor.core import NestedTensor, StructureMeta
from padless.tensor.lru import LRU

__all__ = ["Operand", "Step", "PairPlanRecipe", "pair_plan_recipe", "record", "replay", "export", "install"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of a recorded contraction: its rank, ragged dims (storage order; each one
    the field's ``N_i``), the extents of its static dims, and whether it was pending
    (deferred attention weights)."""

    rank: int
    ragged: tuple[int, ...]
    static: tuple[tuple[int, int], ...]  # (dim, extent)
    pending: bool


@dataclasses.dataclass(frozen=True)
class Step:
    """One plan: the contraction's letters, its operands, dtype, the device type whose prices
    chose it, the step whose buckets it reuses (``on``, a fused attention's second contraction)
    with its unread operand, and whether the step read the plan's result maps, and its result's
    row maps (:func:`padless.ops.pairs.bucket_nodes.result_rows`: a pair bias read onto the
    scores), each then built too."""

    ins: tuple[str, ...]
    out: str
    operands: tuple[Operand, ...]
    dtype: torch.dtype
    device_type: str
    on: int | None = None
    unread: int | None = None
    result_maps: bool = False
    result_rows: bool = False


@dataclasses.dataclass(frozen=True)
class PairPlanRecipe:
    """The bucket plans of one step of a model (see the module docstring); ``skipped``: plans the
    step built whose rows were not the field's lengths (another field's, a reshaped state), which
    a batch builds on first use."""

    steps: tuple[Step, ...]
    skipped: int = 0

    def __repr__(self) -> str:
        eqs = ", ".join(f"{','.join(s.ins)}->{s.out}" for s in self.steps)
        return f"PairPlanRecipe({len(self.steps)} plans: {eqs}; {self.skipped} skipped)"


# ------------------------------------------------------------------ record


def _operand(o: NestedTensor, lengths: Tensor) -> Operand | None:
    """``o`` relative to the field's ``lengths``, or None when its rows are not the field's."""
    hs = o._meta.host_sizes
    if hs is None or hs.shape[0] != lengths.shape[0]:
        return None
    if any(not torch.equal(hs[:, d], lengths) for d in o._ragged):
        return None
    if not torch.equal(o.host_offsets(), layout.offsets_from_counts(layout.row_counts(hs, o._ragged))):
        return None
    static = tuple((d, int(o._env[d])) for d in range(o.sample_dim) if d not in o._ragged)
    return Operand(o.sample_dim, tuple(o._ragged), static, isinstance(o._values, Pending))


def record(run: Callable[[], Any], lengths: Tensor) -> PairPlanRecipe:
    """Every bucket plan ``run()`` builds, relative to the field's ``lengths`` (host int64
    ``(B,)``). Plans are found by content, so the step runs on a private content cache: what was
    built before on the same sizes is recorded too."""
    built: list[tuple] = []

    def tell(ins, out, operands, plan, on) -> None:
        built.append((ins, out, operands, plan, on))

    saved = content._CACHE
    content._CACHE = LRU("pair_plan_recipe", max_entries=saved.max_entries, max_bytes=saved.max_bytes,
                         what="a recipe's private content cache", register=False)
    bucketed.BUILT.append(tell)
    try:
        run()
    finally:
        bucketed.BUILT.remove(tell)
        content._CACHE = saved
    steps: list[Step] = []
    groups: list[tuple] = []  # per step, its plan's buckets
    skipped = 0
    for ins, out, operands, plan, on in built:
        ops = [_operand(o, lengths) for o in operands]
        src = None
        if on is not None:  # the plan whose buckets these are (the very tuple, else an equal one)
            src = next((i for i, g in enumerate(groups) if g is on[0]), None)
            if src is None:
                want = tuple(tuple(ids) for ids in on[0])
                src = next((i for i, g in enumerate(groups) if g == want), None)
        if any(o is None for o in ops) or (on is not None and src is None):
            skipped += 1
            continue
        v = operands[0]._values
        read = plan is not None and _built(plan.packs)
        rows = plan is not None and plan.rows is not None and _built(plan.rows)
        steps.append(Step(tuple(ins), out, tuple(ops), v.dtype, v.device.type, src, None if on is None else on[1], read,
                          rows))
        groups.append(None if plan is None else plan.groups)
    return PairPlanRecipe(tuple(steps), skipped)


def _built(maps: Any) -> bool:
    """Whether a plan's lazy maps were built (carried maps are)."""
    return not isinstance(maps, bucketed.LazyMaps) or maps._maps is not None


# ------------------------------------------------------------------ replay


def _placeholder(op: Operand, lengths: Tensor, dtype: torch.dtype) -> NestedTensor:
    """A structure with ``op``'s rows for ``lengths``, around values that are never read."""
    b = lengths.shape[0]
    hs = torch.empty(b, op.rank, dtype=torch.int64)
    for d in op.ragged:
        hs[:, d] = lengths
    for d, n in op.static:
        hs[:, d] = n
    ho = layout.offsets_from_counts(layout.row_counts(hs, op.ragged))
    static = [n for _, n in op.static]
    values = torch.zeros((), dtype=dtype).expand(int(ho[-1]), *static)
    env = [0] * op.rank
    for d in op.ragged:
        env[d] = int(lengths.max()) if b else 0
    for d, n in op.static:
        env[d] = n
    return NestedTensor(values, ho, hs, op.ragged, env, StructureMeta(hs, ho))


def replay(recipe: PairPlanRecipe, lengths: Tensor) -> list[tuple[tuple, _Plan | None]]:
    """The recipe's plans for ``lengths`` (host int64 ``(B,)``), built on the host at the prices of
    the device type each was recorded on: per step, the device-free part of its content key
    (:func:`padless.ops.pairs.bucketed.plan_key` without the device) and the plan."""
    out: list[tuple[tuple, _Plan | None]] = []
    for st in recipe.steps:
        ops = [_placeholder(op, lengths, st.dtype) for op in st.operands]
        forced = None
        if st.on is not None:
            first = out[st.on][1]
            if first is None:  # declined buckets: no second plan on them
                out.append(((), None))
                continue
            forced = first.groups
        pend = [op.pending for op in st.operands]
        plan = bucketed._build(list(st.ins), st.out, ops, forced, st.unread, torch.device(st.device_type), pend)
        if plan is not None and st.result_maps:
            plan.packs[0]  # built here, not on the batch's first step
        if plan is not None and st.result_rows and plan.rows is not None:
            plan.rows[0]
        keys = tuple(content.structure_key(o) for o in ops)
        out.append(((st.ins, st.out, st.dtype, keys, tuple(pend), forced, st.unread), plan))
    return out


# ------------------------------------------------------------------ carry


def _maps_tensors(m: tuple[RowMap, RowMap] | None) -> list[Tensor | None]:
    if m is None:
        return [None, None, None]
    return [m[0].safe, m[0].holes, m[1].safe]


def _maps_from(ts: Sequence[Tensor | None]) -> tuple[RowMap, RowMap] | None:
    if ts[0] is None:
        return None
    return RowMap(ts[0], ts[1]), RowMap(ts[2], None)


def export(plan: _Plan | None) -> tuple[list[Tensor | None], list[Tensor], dict | None]:
    """A plan as its index tensors (they move with the batch: every operand's maps, the result's
    maps when built, the result's offsets and sizes), its host tensors (the result's host sizes
    and offsets) and its Python fields."""
    if plan is None:
        return [], [], None
    dev: list[Tensor | None] = []
    for p in plan.pads:
        dev += _maps_tensors(p)
    built = _built(plan.packs)
    dev += _maps_tensors((plan.packs[0], plan.packs[1]) if built else None)
    offsets, sizes, env, meta = plan.structure
    dev += [offsets, sizes]
    rows = plan.rows is not None and _built(plan.rows)
    dev += _maps_tensors((plan.rows[0], plan.rows[1]) if rows else None)
    host = [meta.host_sizes, meta.host_offsets] if isinstance(meta, StructureMeta) else list(meta)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
              if f.name not in ("pads", "packs", "structure", "cache", "rows")}
    return dev, host, {"fields": fields, "env": list(env), "operands": len(plan.pads), "packs": built, "rows": rows}


def install(recipe: PairPlanRecipe, lengths: Tensor, entries: Sequence[tuple[tuple, list, list, dict | None]],
            device: torch.device) -> int:
    """Put carried plans into this process's content cache for ``device`` (``entries``: per step
    its key part, its tensors on ``device``, its host tensors and Python fields, as
    :func:`replay` and :func:`export` made them). Plans recorded for another device type are
    not installed (their prices chose for that device). Returns how many were."""
    done = 0
    plans: list[_Plan | None] = []
    for st, (key, dev, host, table) in zip(recipe.steps, entries):
        if st.device_type != device.type or (table is None and not key):
            plans.append(None)
            continue
        ins, out, dtype, keys, pend, groups, unread = key
        ckey = bucketed.plan_key(ins, out, device, dtype, keys, pend, groups, unread)
        if table is None:  # the plan declined the buckets
            plan = None
        else:
            n = table["operands"]
            pads = [_maps_from(dev[3 * i:3 * i + 3]) for i in range(n)]
            packs = _maps_from(dev[3 * n:3 * n + 3]) if table["packs"] else bucketed.LazyMaps(
                _rebuild_packs(recipe, plans, len(plans), lengths, device), _result_bytes(table["fields"]))
            structure = (dev[3 * n + 3], dev[3 * n + 4], table["env"], tuple(host))
            rows = None
            if table["rows"]:
                rows = _maps_from(dev[3 * n + 5:3 * n + 8])
            elif table["fields"]["flat"][-1]:  # built on first use, as the plan would have
                rows = bucketed.LazyMaps(_rebuild_packs(recipe, plans, len(plans), lengths, device, "rows"),
                                         _result_bytes(table["fields"]))
            plan = _Plan(pads=pads, packs=packs, structure=structure, rows=rows, **table["fields"])
        plans.append(plan)
        entry = (plan, plan.pads, plan.packs) if plan is not None else (None,)
        content.put(ckey, entry, bucketed._entry_bytes(ckey, plan))
        done += 1
    return done


def _result_bytes(fields: dict) -> int:
    """What a plan's result maps hold once built (:func:`padless.ops.pairs.bucketed._maps_bytes`)."""
    width = math.prod(fields["out_static"])
    padded = sum(math.prod(shape) for shape in fields["out_shapes"])
    if fields["flat"][-1]:
        return bucketed._maps_bytes(fields["out_rows"] * width, padded)
    return bucketed._maps_bytes(fields["out_rows"], padded // max(width, 1))


def _rebuild_packs(recipe: PairPlanRecipe, plans: list, i: int, lengths: Tensor, device: torch.device,
                   which: str = "packs"):
    """The result maps (``which``: ``"packs"``, or ``"rows"``, its row maps) of step ``i``'s plan,
    when something reads them although the recorded step did not: the step replayed here, its
    maps moved to ``device``."""

    def build():
        st = recipe.steps[i]
        ops = [_placeholder(op, lengths, st.dtype) for op in st.operands]
        forced = plans[st.on].groups if st.on is not None else None
        plan = bucketed._build(list(st.ins), st.out, ops, forced, st.unread, torch.device(st.device_type),
                               [op.pending for op in st.operands])
        to = (lambda t: t if t is None else t.to(device, non_blocking=True))
        maps = getattr(plan, which)
        return tuple(RowMap(to(m.safe), to(m.holes)) for m in (maps[0], maps[1]))

    return build




# ------------------------------------------------------------------ the public entry point


def pair_plan_recipe(model: Callable[..., Any], *inputs: Any, field: NestedTensor | None = None,
                     backward: bool = True, **kwargs: Any) -> PairPlanRecipe:
    """The bucket plans of one step of a pair model, for ``Field(pair_plans=recipe)``: a Collator
    then builds them for every batch in its workers (attention scores and ``softmax(...) @ v`` on
    their buckets, triangle products; the plans' index maps included), and the first step of a
    new batch builds none.

    Learned from one step of ``model(*inputs, **kwargs)``, forward and, with ``backward``, the
    backward of the sum of its outputs, relative to the lengths of ``field`` (tokens ``(N_i,
    *static)`` ragged along dim 0: the field the recipe is declared on; default the first such
    input). Plans whose rows are not that field's lengths (another field's) are left out, and a
    batch builds them on first use, as without a recipe. The step leaves no trace: parameter
    gradients, buffers and the random number generator's state are restored. Plans are priced for
    the device the example is on: record on the device type you train on (plans recorded on
    another are not installed).

    Example::

        recipe = padless.pair_plan_recipe(layer, s, z, mask, pair_mask)   # a small example batch
        collator = padless.Collator({"s": padless.Field(ragged=0, pair_plans=recipe),
                                     "z": padless.Field(ragged=(0, 1)), ...})
    """
    if field is None:
        field = next((x for x in (*inputs, *kwargs.values()) if isinstance(x, NestedTensor) and x._ragged == (0,)), None)
        if field is None:
            raise TypeError("pair_plan_recipe(): no input is a NestedTensor ragged along dim 0 (tokens (N_i, *static)); "
                            "pass the token field as field=")
    if not isinstance(field, NestedTensor) or field._ragged != (0,) or field._meta.host_sizes is None:
        got = f"ragged dims {field._ragged}" if isinstance(field, NestedTensor) else type(field).__name__
        raise ValueError(f"pair_plan_recipe(): field must be tokens (N_i, *static) ragged along dim 0 with host "
                         f"sizes (a collated or from_list batch), got {got}")
    run = model_step(model, backward, *inputs, **kwargs)
    return traceless(model, field._values.device, lambda: record(run, field._meta.host_sizes[:, 0].clone()))
