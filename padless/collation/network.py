"""A whole network's spatial plans, built in the worker: ``Field(spatial_plan=recipe)``.

``recipe = padless.vision.plan_recipe(model, example)`` learns from one step of the model which
plans it builds on which structure (:mod:`padless.ops.vision.recipe`). The Collator replays the
recipe on every batch's image sizes here, in its worker, and the batch carries the result as a
:class:`NetworkPlans` in its field metadata: every index tensor goes into the batch's arena
(shared memory in a worker), the host sizes of every intermediate structure too, and the main
process puts the plans where the layers find them (``padless.collation.opcache.install_spatial``):
the first step of a new batch builds no plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from padless.collation.metadata import HOST
from padless.tensor.core import NestedTensor

__all__ = ["NetworkPlans", "check_recipe", "install_network", "network_plans"]


@dataclasses.dataclass
class NetworkPlans:
    """Every spatial plan a recipe builds on one batch (see the module docstring), flattened so a
    batch carries three tensors whatever the depth of the network (each tensor pickled alone costs
    tens of microseconds to rebuild in the main process; a network has dozens):

    ``index``   int64, moves with the batch: every plan's index tensors, end to end
    ``host``    int64, host-only: every intermediate structure's sizes ``(B, 2)`` and offsets ``(B+1,)``
    ``other``   the few tensors of another dtype (average-pooling divisors)
    ``table``   Python leaves (a dict, so the batch's metadata walk does not enter it): where each
                tensor lies, per entry ``(src, dst, key, tensors, info, derived keys, derived)``
    """

    index: Tensor
    host: Tensor = dataclasses.field(metadata=HOST)
    other: tuple = ()
    table: dict = dataclasses.field(default_factory=dict)


class _Flat:
    """Tensors laid end to end: ``ref(t)`` says where ``t`` lies (``("i", start, shape)`` in the
    int64 buffer, ``("o", k)`` among the others, None for None, ``("t", refs)`` for a tuple)."""

    def __init__(self) -> None:
        self.parts: list[Tensor] = []
        self.n = 0
        self.other: list[Tensor] = []

    def ref(self, t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, tuple):
            return ("t", tuple(self.ref(x) for x in t))
        if t.dtype != torch.int64:
            self.other.append(t)
            return ("o", len(self.other) - 1)
        start = self.n
        self.parts.append(t.reshape(-1))
        self.n += t.numel()
        return ("i", start, tuple(t.shape))

    def tensor(self) -> Tensor:
        return torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.int64)


def _deref(r: Any, flat: Tensor, other: tuple) -> Any:
    if r is None:
        return None
    if r[0] == "i":
        n = 1
        for d in r[2]:
            n *= d
        return flat[r[1]: r[1] + n].view(r[2])
    if r[0] == "o":
        return other[r[1]]
    return tuple(_deref(x, flat, other) for x in r[1])


def check_recipe(name: str, recipe: Any, ragged: tuple[int, ...] | str, rank: int, channels: int | None) -> None:
    """A recipe recorded on another layout than the field's is an error naming the field and the fix."""
    images = rank == 3 and ragged == (1, 2)
    sequences = rank == 2 and ragged == (1,)
    want = "images (C, H_i, W_i) ragged along (1, 2)" if recipe.ragged == (1, 2) else "sequences (C, L_i) ragged along (1,)"
    got = f"samples of rank {rank} ragged along {ragged}" if rank > 0 else "a stacked field"
    if not (images or sequences) or tuple(recipe.ragged) != tuple(ragged) or channels != recipe.channels:
        got += f" with {channels} channels" if channels is not None and (images or sequences) else ""
        raise ValueError(
            f"Collator: field {name!r}: spatial_plan recipe was recorded on {want} with {recipe.channels} channels, "
            f"this field holds {got}; record the recipe on an example of this field "
            f"(padless.vision.plan_recipe(model, collator(samples)[{name!r}])) or declare the field as the recipe's "
            "layout (Field(ragged=(1, 2)) for channels-first images)"
        )


def network_plans(packed: NestedTensor, recipe: Any) -> NetworkPlans:
    """Replay ``recipe`` on ``packed``'s structure (host work, in the worker) and flatten the result."""
    from padless.ops.vision import recipe as rc
    from padless.ops.vision.spatial import _cache_of

    root = _cache_of("Collator", packed)
    nodes, entries = rc.export(rc.replay(recipe, root), root)
    dev, host = _Flat(), _Flat()
    node_refs = [(host.ref(hw), host.ref(off)) for hw, off in nodes[1:]]
    rows = [(src, dst, key, dev.ref(tensors), info, dkeys, dev.ref(dvals)) for src, dst, key, tensors, info, dkeys, dvals in entries]
    return NetworkPlans(dev.tensor(), host.tensor(), tuple(dev.other), {"nodes": node_refs, "entries": rows})


def install_network(nt: NestedTensor, plans: NetworkPlans) -> None:
    """Put a batch's carried network plans into the op layer's caches (by content), for its device."""
    from padless.ops.vision import recipe as rc
    from padless.ops.vision.spatial import _cache_of

    dev: torch.device = nt._values.device
    root = _cache_of("Collator", nt)
    flat, hflat, other = plans.index, plans.host, plans.other
    nodes = [None] + [(_deref(hw, hflat, ()), _deref(off, hflat, ())) for hw, off in plans.table["nodes"]]
    entries = [(src, dst, key, _deref(t, flat, other), info, dkeys, _deref(d, flat, other))
               for src, dst, key, t, info, dkeys, d in plans.table["entries"]]
    rc.install(root, nodes, entries, dev)
