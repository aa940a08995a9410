"""A pair model's bucket plans, built in the worker: ``Field(pair_plans=recipe)``.

``recipe = padless.pair_plan_recipe(model, *example_inputs)`` learns which bucket plans one step
of a pair model builds (attention scores, ``softmax(...) @ v`` on the scores' buckets, triangle
products; :mod:`padless.ops.pairs.recipe`) relative to a token field's lengths. The Collator
replays the recipe on every batch's lengths here, in its worker, and the batch carries the
plans in the field's metadata as a :class:`PairPlans`: every index tensor in two buffers that
move with the batch (int64 and int32) and the plans' host sizes in one host buffer. The main
process puts them in its content cache (``padless.collation.opcache.install``), where the
contractions look for them: the first step of a new batch builds no plan. The cache holds views of
a copy of the three buffers (views of the batch's own would keep all its metadata alive), each
entry counted at the bytes of its views.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from padless.collation.arena import in_worker
from padless.collation.metadata import HOST
from padless.tensor.core import NestedTensor

__all__ = ["PairPlans", "pair_plans", "install_pair_plans"]


@dataclasses.dataclass
class PairPlans:
    """Every plan a recipe builds on one batch, flattened (see the module docstring):

    ``index``  int64, moves with the batch: holes of the maps, the plans' result offsets and sizes
    ``small``  int32, moves with the batch: the maps' source rows
    ``host``   int64, host-only: the plans' result host sizes and offsets
    ``table``  Python leaves (a dict, so the batch's metadata walk does not enter it): the recipe,
               and per plan its content key (device-free), where its tensors lie, its fields
    """

    index: Tensor
    small: Tensor
    host: Tensor = dataclasses.field(metadata=HOST)
    table: dict = dataclasses.field(default_factory=dict)


class _Flat:
    """int64 and int32 tensors laid end to end: ``ref(t)`` says where ``t`` lies."""

    def __init__(self) -> None:
        self.parts: dict[torch.dtype, list[Tensor]] = {torch.int64: [], torch.int32: []}
        self.n = {torch.int64: 0, torch.int32: 0}

    def ref(self, t: Tensor | None) -> Any:
        if t is None:
            return None
        if t.dtype not in self.parts:
            raise RuntimeError(f"padless internal: a pair plan holds a {t.dtype} tensor; plans hold int64 and int32 maps")
        start = self.n[t.dtype]
        self.parts[t.dtype].append(t.reshape(-1))
        self.n[t.dtype] += t.numel()
        return (t.dtype == torch.int32, start, tuple(t.shape))

    def buffer(self, dtype: torch.dtype) -> Tensor:
        parts = self.parts[dtype]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _deref(r: Any, index: Tensor, small: Tensor) -> Tensor | None:
    if r is None:
        return None
    is_small, start, shape = r
    n = 1
    for d in shape:
        n *= d
    return (small if is_small else index)[start: start + n].view(shape)


def pair_plans(recipe: Any, lengths: Tensor) -> PairPlans:
    """Replay ``recipe`` on a batch's field ``lengths`` (host work, in the worker) and flatten it."""
    from padless.ops.pairs import recipe as rc

    dev, host = _Flat(), _Flat()
    entries = []
    for key, plan in rc.replay(recipe, lengths):
        d, h, fields = rc.export(plan)
        entries.append((key, [dev.ref(t) for t in d], [host.ref(t) for t in h], fields))
    return PairPlans(dev.buffer(torch.int64), dev.buffer(torch.int32), host.buffer(torch.int64),
                     {"recipe": recipe, "entries": entries})


def install_pair_plans(nt: NestedTensor, plans: PairPlans) -> None:
    """Put a batch's carried plans into this process's content cache, for its device (not in a
    DataLoader worker: the main process installs them when the batch arrives)."""
    from padless.ops.pairs import recipe as rc

    if in_worker():
        return
    dev = nt._values.device
    index, small, host = plans.index.clone(), plans.small.clone(), plans.host.clone()  # see the module docstring
    entries = [(key, [_deref(r, index, small) for r in d], [_deref(r, host, host) for r in h], f)
               for key, d, h, f in plans.table["entries"]]
    rc.install(plans.table["recipe"], nt._meta.host_sizes[:, 0], entries, dev)
