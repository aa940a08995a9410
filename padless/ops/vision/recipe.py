"""Network plan recipes: every spatial plan a network asks for, learned once, rebuilt for any batch.

A convolutional network meets a chain of image structures: the batch's sizes, the stem's output
sizes, the pool's, each stage's. Every spatial op caches what it builds on the structure it reads
(:class:`~padless.ops.vision.spatial.SpatialCache`, found by content), so after one step of a model
on an example batch the caches *are* the network's plan, as a graph::

    node 0 (the batch)  --conv 7x7/2-->  node 1  --max pool 3x3/2-->  node 2  --conv 3x3-->  node 2
                                                                       |--conv 3x3/2--> node 3
                                                                       '--1x1/2 subsample--> node 3

:func:`record` walks that graph from the example's structure into a :class:`PlanRecipe` (device-free
steps: ``(node read, what is built, node of its output, derived indices)``). :func:`replay` builds
the same steps on another batch's structure (the Collator does it in its workers,
``Field(spatial_plan=recipe)``), :func:`export` flattens what it built into tensors and Python
leaves for the trip to the main process, and :func:`install` puts them in that process's caches,
where the layers look for them by content. A batch whose geometry differs from the recipe's loses
nothing but time: a plan the recipe did not build is built on first use, as without a recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from padless.ops.vision import conv, pool, resample
from padless.ops.vision import spatial as sp
from padless.tensor.core import NestedTensor

__all__ = ["PlanRecipe", "Step", "record", "replay", "export", "install"]

_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Step:
    """One thing a network builds on one structure.

    ``key``: ``("plan", Geometry, layout)`` (a convolution or pooling plan),
    ``("subsample", (sh, sw))`` (a strided 1x1 projection's rows), ``("nearest", (kh, kw))``
    (nearest upsampling by powers of two) or ``("adaptive", oh, ow)`` (adaptive pooling cells); ``dst``: the node of its output structure (None: a dense output);
    ``derived``: the plan's indices built on first use (backward gathers, gap lists), device-free."""

    src: int
    key: tuple
    dst: int | None
    derived: tuple = ()


@dataclasses.dataclass(frozen=True)
class PlanRecipe:
    """The spatial plans of a network, as steps from the input structure (node 0).

    ``ragged`` and ``channels`` are the layout of the example it was recorded on: images
    ``(C, H_i, W_i)`` ragged along ``(1, 2)``, or sequences ``(C, L_i)`` ragged along ``(1,)``."""

    ragged: tuple[int, ...]
    channels: int
    nodes: int
    steps: tuple[Step, ...]

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.steps:
            kinds[s.key[0]] = kinds.get(s.key[0], 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in kinds.items())
        return f"PlanRecipe({len(self.steps)} steps over {self.nodes} structures: {what}; inputs of {self.channels} channels, ragged {self.ragged})"


# ------------------------------------------------------------------ record


def _derived_key(key: Any) -> tuple | None:
    """A plan's derived-index key without its device (None: not an index to carry)."""
    if not isinstance(key, tuple) or not key or not isinstance(key[-1], torch.device):
        return None
    head = key[0]
    if head == "place":
        return ("place",)
    if head in ("row_of", "sources"):
        return (head, key[1])
    if isinstance(head, bool) and len(key) == 3:  # avg_divisor(include_pad, dtype, device)
        return ("avg", head, key[1])
    return None


def _step_key(key: Any) -> tuple | None:
    """A cache entry's key without its device (None: an entry a recipe does not rebuild)."""
    if not isinstance(key, tuple) or not key:
        return None
    if isinstance(key[0], sp.Geometry) and len(key) == 3:
        return ("plan", key[0], key[1])
    if key[0] == "subsample" and len(key) == 3:
        return ("subsample", key[1])
    if key[0] == "adaptive" and len(key) == 4:
        return ("adaptive", key[1], key[2])
    if key[0] == "nearest" and len(key) == 3:
        return ("nearest", key[1])
    return None


def record(example: NestedTensor, run: Callable[[], Any]) -> PlanRecipe:
    """Run ``run()`` (one step of a model on ``example``) and read off every spatial plan it built,
    from ``example``'s structure on. Plans built before on the same sizes count too: the caches
    are found by content, so record on an example batch of sizes no other model has met."""
    sp.image_hw("plan_recipe", example)  # the layout check, naming the op
    root = sp._cache_of("plan_recipe", example)
    run()
    ids = {id(root): 0}
    order = [root]
    steps: list[Step] = []
    seen: set = set()
    for cache in order:  # breadth first: a node's producers come before its readers
        src = ids[id(cache)]
        for key, entry in list(cache.plans.items()):
            sk = _step_key(key)
            if sk is None or (src, sk) in seen:
                continue
            seen.add((src, sk))
            out = entry.cache if sk[0] == "plan" else entry[1] if sk[0] == "subsample" else entry[4] if sk[0] == "nearest" else None
            dst = None
            if out is not None:
                if id(out) not in ids:
                    ids[id(out)] = len(order)
                    order.append(out)
                dst = ids[id(out)]
            derived = ()
            if sk[0] == "plan":
                derived = tuple(dict.fromkeys(d for d in map(_derived_key, entry._divisors) if d is not None and d[0] in ("place", "avg")))
                derived += tuple(("row_of", side) for side in ("in", "out") if ("used", side) in entry._divisors)
                for side in ("in", "out"):  # rows <-> canvas moves: which index depends on the rows' size
                    derived += tuple(("gather", side, c) for c in sorted(entry._divisors.get(("width", side), ())))
            steps.append(Step(src, sk, dst, derived))
    return PlanRecipe(tuple(example._ragged), int(example._values.shape[1]), len(order), tuple(steps))


# ------------------------------------------------------------------ replay (in the worker)


def _build(cache: sp.SpatialCache, step: Step, dev: torch.device) -> Any:
    """Build one step on ``cache`` (host work; a hit when it exists); returns its output cache or None."""
    kind = step.key[0]
    if kind == "subsample":
        return conv.subsample_of(cache, step.key[1], dev)[1]
    if kind == "adaptive":
        pool.adaptive_of(cache, step.key[1], step.key[2], dev)
        return None
    if kind == "nearest":
        return resample.nearest_of(cache, step.key[1], dev)[4]
    g, lay = step.key[1], step.key[2]
    plan = cache.plans.get((g, lay, dev))
    if plan is None:
        plan = sp._new_plan(cache, g, lay, dev)
        cache.plans[(g, lay, dev)] = plan
    for d in step.derived:
        if d[0] == "place":
            plan.placement(dev)
        elif d[0] == "row_of":
            plan._row_of(d[1], dev)
        elif d[0] == "gather":  # the index SpatialPlan._gather_filled will use on rows of d[2] channels
            side, rows = d[1], int(plan.in_hw.prod(1).sum()) if d[1] == "in" else int(plan.out_offsets[-1])
            n, h, w = plan.blocks if side == "in" else plan.out_blocks
            if rows == 0 or n * h * w == 0:
                continue
            if rows * d[2] < sp._FILL_AFTER or plan.grids is None:
                plan._row_of(side, dev)
            else:
                plan._sources(side, dev, n * h * w)
        else:
            plan.avg_divisor(d[1], d[2], dev)
    return plan.cache


def replay(recipe: PlanRecipe, root: sp.SpatialCache, dev: torch.device = _CPU) -> list[tuple[sp.SpatialCache, Step]]:
    """Build every step of ``recipe`` from ``root`` (the batch's structure) on; returns the
    ``(structure, step)`` pairs built. A node that two steps reach with different sizes here (they
    agreed on the example) has its steps built on both."""
    by_src: dict[int, list[Step]] = {}
    for s in recipe.steps:
        by_src.setdefault(s.src, []).append(s)
    todo = [(0, root)]
    seen = {(0, id(root))}
    built = []
    while todo:
        node, cache = todo.pop(0)
        for step in by_src.get(node, ()):
            out = _build(cache, step, dev)
            built.append((cache, step))
            if out is not None and (step.dst, id(out)) not in seen:
                seen.add((step.dst, id(out)))
                todo.append((step.dst, out))
    return built


# ------------------------------------------------------------------ the trip to the main process


def export(built: list[tuple[sp.SpatialCache, Step]], root: sp.SpatialCache, dev: torch.device = _CPU) -> tuple[list, list]:
    """What :func:`replay` built as ``(structures, entries)``: ``structures[k] = (hw, offsets)``
    host tensors (``0``: ``root``); ``entries[j] = (src, dst, key, tensors, info, derived keys,
    derived tensors)``, ``tensors`` the index tensors that move with the batch, ``info`` Python leaves."""
    ids = {id(root): 0}
    nodes = [(root.hw, root.host_offsets)]

    def node(c: sp.SpatialCache) -> int:
        if id(c) not in ids:
            ids[id(c)] = len(nodes)
            nodes.append((c.hw, c.host_offsets))
        return ids[id(c)]

    entries = []
    for cache, step in built:
        src, kind = node(cache), step.key[0]
        if kind == "plan":
            plan = cache.plans[(step.key[1], step.key[2], dev)]
            keys, vals = [], []
            for k, v in plan._divisors.items():
                d = _derived_key(k)
                if d is not None and k[-1] == dev:
                    keys.append(d)
                    vals.append(v)
            info = dict(too_small=list(plan.too_small), blocks=plan.blocks, out_blocks=plan.out_blocks, grids=plan.grids)
            entries.append((src, node(plan.cache), step.key, (plan.place, plan.gather, plan.take), info, tuple(keys), tuple(vals)))
        elif kind == "subsample":
            idx, out = cache.plans[("subsample", step.key[1], dev)]
            entries.append((src, node(out), step.key, (idx,), {}, (), ()))
        elif kind == "nearest":
            src_rows, kids, _, _, out = cache.plans[("nearest", step.key[1], dev)]
            entries.append((src, node(out), step.key, (src_rows, kids), {}, (), ()))
        else:
            hit = cache.plans[("adaptive", step.key[1], step.key[2], dev)]
            entries.append((src, None, step.key, tuple(hit), {}, (), ()))
    return nodes, entries


def install(root: sp.SpatialCache, nodes: list, entries: list, dev: torch.device) -> None:
    """Put exported entries into this process's caches for a batch on ``dev`` (entries already
    there are kept: the layers may have built them on an earlier batch of the same sizes)."""
    caches = [root] + [sp._cache_for(hw, off, root.ragged) for hw, off in nodes[1:]]
    for src, dst, key, tensors, info, dkeys, dvals in entries:
        cache = caches[src]
        kind = key[0]
        if kind == "plan":
            ck = (key[1], key[2], dev)
            if ck in cache.plans:
                continue
            out = caches[dst]
            place, gather, take = tensors
            plan = sp.SpatialPlan(key[1], key[2], cache.hw, out.hw, out.host_offsets, info["too_small"], info["blocks"],
                                  info["out_blocks"], place, gather, take, out, info["grids"])
            for d, v in zip(dkeys, dvals):
                plan._divisors[_with_device(d, dev)] = v
            cache.plans[ck] = plan
        elif kind == "subsample":
            cache.plans.setdefault(("subsample", key[1], dev), (tensors[0], caches[dst]))
        elif kind == "nearest":
            out = caches[dst]
            cache.plans.setdefault(("nearest", key[1], dev), (*tensors, out.hw, out.host_offsets, out))
        else:
            cache.plans.setdefault(("adaptive", key[1], key[2], dev), tuple(tensors))


def _with_device(d: tuple, dev: torch.device) -> tuple:
    if d[0] == "place":
        return ("place", dev)
    if d[0] in ("row_of", "sources"):
        return (d[0], d[1], dev)
    return (d[1], d[2], dev)  # avg divisor
