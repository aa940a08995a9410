"""``padless.collate``: a drop-in for ``torch.utils.data.default_collate`` that packs instead of padding.

It walks the samples as ``default_collate`` does (dicts, lists, tuples,
namedtuples, plus dataclasses), and for every field:

* tensors / numpy arrays / PIL images of one shape are stacked into ``(B, *shape)``;
* of differing shapes, packed into a :class:`~padless.NestedTensor` whose ragged
  dims are the dims that differ (no padding, no mask needed);
* numbers become a ``(B,)`` tensor (floats as float64, as ``default_collate``);
* strings and other objects stay a list.

::

    samples = [{"ids": tensor([5, 6]),     "y": 1, "name": "a"},
               {"ids": tensor([7]),        "y": 0, "name": "b"},
               {"ids": tensor([8, 9, 4]),  "y": 1, "name": "c"}]
    batch = padless.collate(samples)
    batch["ids"]   NestedTensor  values [5, 6, 7, 8, 9, 4]   offsets [0, 2, 3, 6]
    batch["y"]     tensor([1, 0, 1])
    batch["name"]  ["a", "b", "c"]

All tensors of one dtype land in one buffer (one shared-memory block per dtype
inside a DataLoader worker), and each NestedTensor carries its host ``sizes`` /
``offsets`` and ``cu_seqlens``, computed here, in the worker. Use
:class:`padless.Collator` to declare ragged dims, casts, pair maps, row maps and
position ids instead of inferring.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
from typing import Any, Sequence

import torch

from padless.collation import samples as sk
from padless.collation.arena import Arena, in_worker
from padless.collation.pack import (
    ContainerPlan,
    FieldPlan,
    ObjectPlan,
    PackOptions,
    RaggedPlan,
    StackPlan,
    TensorPlan,
    as_tensors,
    check_static,
    common_dtype,
    differing_dims,
    shape_table,
)
from padless.collation.samples import field_label


def collate(samples: Sequence[Any]) -> Any:
    """A drop-in for ``torch.utils.data.default_collate`` that packs what varies.

    It walks the samples as ``default_collate`` does (dicts, tuples, lists, namedtuples and
    dataclasses; numbers and strings as ``default_collate`` handles them) and at every
    tensor field: stacks it when every sample has one shape, and packs it into a
    :class:`~padless.NestedTensor` (ragged along the dims that differ) when shapes differ,
    instead of failing or padding. Static dims and dtypes must agree; a mismatch raises a
    :class:`~padless.StructureError` naming the field, the sample and the shapes.

    Two entry points, one result type each:

    * ``padless.collate(samples)`` returns the samples' own container type: a ``dict`` for
      dict samples (as ``default_collate``), a tuple for tuples, ... A drop-in, nothing else.
    * ``padless.Collator(schema)(samples)`` returns a :class:`~padless.Batch` (dict-like, with
      attribute access, ``pin_memory()``, one-copy ``to(device)`` and derived outputs such as
      position ids and labels). Use it when a field must stay ragged whatever one batch holds,
      or to have the workers compute kernel metadata.

    Args:
        samples: the list the DataLoader hands its ``collate_fn``.

    Returns:
        The collated batch, in the samples' structure, with NestedTensors where shapes differ.

    >>> import torch, padless
    >>> b = padless.collate([{"x": torch.ones(2, 3)}, {"x": torch.ones(4, 3)}])
    >>> type(b["x"]).__name__, b["x"].shape, b["x"].values().shape
    ('NestedTensor', torch.Size([2, 4, 3]), torch.Size([6, 3]))
    """
    return build(plan_samples(samples, ""))


def build(plan: FieldPlan) -> Any:
    """Allocate the arena for a planned batch (shared memory in a worker) and fill it."""
    arena = Arena()
    plan.reserve(arena)
    arena.allocate(shared=in_worker())
    return plan.build(arena)


def _child(path: str, key: Any, index: bool = False) -> str:
    if index:
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def plan_samples(samples: Sequence[Any], path: str, opts: PackOptions = PackOptions()) -> FieldPlan:
    """Plan one field of the batch from its samples (recursing into containers)."""
    if isinstance(samples, (str, bytes)) or not isinstance(samples, collections.abc.Sequence):
        raise TypeError(f"collate(): expected a list of samples, got {type(samples).__name__}")
    if len(samples) == 0:
        where = f"field {field_label(path)}" if path else "the batch"
        raise ValueError(f"collate(): empty batch: {where} has no samples (a DataLoader never sends one; "
                         "check the sampler or drop_last)")
    elem = samples[0]
    k0 = sk.kind(elem)
    if k0 == sk.TENSOR:  # as_tensors checks every sample
        return tensor_plan(path, samples, None, None, opts)
    if k0 == sk.SEQUENCE and sk.is_number_list(elem):  # tokenizer output: a list of ids is a tensor
        return tensor_plan(path, samples, None, None, opts)
    t0 = type(elem)
    if sk.kind_of_type(t0) is not None and all(type(x) is t0 for x in samples):
        kinds = None  # one type whose kind the type alone decides: every sample is of kind k0
    else:
        kinds = [sk.kind(x) for x in samples]
    if k0 == sk.NUMBER:
        if kinds is not None:
            _same_kind(path, samples, kinds)
        return TensorPlan(sk.numbers_tensor(samples, path))
    if k0 == sk.NONE and kinds is not None and sk.TENSOR in kinds:
        return tensor_plan(path, samples, None, None, opts)
    if k0 in (sk.STRING, sk.OBJECT, sk.NONE):
        if kinds is not None:
            _no_arrays(path, samples, kinds)
        return ObjectPlan(samples)
    if kinds is not None:
        _same_kind(path, samples, kinds)
    if k0 == sk.MAPPING:
        return _mapping_plan(path, samples, opts)
    if k0 == sk.DATACLASS:
        names = [f.name for f in dataclasses.fields(elem) if f.init]
        children = {n: plan_samples([getattr(s, n) for s in samples], _child(path, n), opts) for n in names}
        return ContainerPlan(children, lambda built: dataclasses.replace(elem, **built))
    n = len(elem)
    for i, s in enumerate(samples):
        if len(s) != n:
            raise ValueError(
                f"collate(): field {field_label(path)}: sample {i} has {len(s)} elements, sample 0 has {n}; "
                "every sample needs the same number of elements"
            )
    children = {i: plan_samples([s[i] for s in samples], _child(path, i, index=True), opts) for i in range(n)}
    if k0 == sk.NAMEDTUPLE:
        return ContainerPlan(children, lambda built: type(elem)(*(built[i] for i in range(n))))
    return ContainerPlan(children, lambda built: _rebuild_sequence(elem, [built[i] for i in range(n)]))


def tensor_plan(
    path: str,
    samples: Sequence[Any],
    ragged: tuple[int, ...] | None,
    cast: torch.dtype | None,
    opts: PackOptions,
) -> FieldPlan:
    """Stack or pack one tensor field. ``ragged=None`` infers: the dims that differ (stack if none)."""
    ts = as_tensors(path, samples)
    sizes = shape_table(path, ts)
    dtype = common_dtype(path, ts, cast)
    if ragged is None:
        ragged = differing_dims(sizes)
    else:
        check_static(path, ts, ragged, sizes)
    if not ragged:
        return StackPlan(ts, dtype)
    # without a cast, common_dtype has checked that every sample has ``dtype``
    return RaggedPlan(path, ts, ragged, dtype, opts, sizes, same_dtype=True if cast is None else None)


def _same_kind(path: str, samples: Sequence[Any], kinds: list[str]) -> None:
    for i, k in enumerate(kinds):
        if k != kinds[0]:
            what = "None" if k == sk.NONE else f"a {type(samples[i]).__name__}"
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} is {what}, sample 0 is a "
                f"{type(samples[0]).__name__}; every sample of a field needs the same kind of value"
            )


def _no_arrays(path: str, samples: Sequence[Any], kinds: list[str]) -> None:
    """A field kept as a list (strings, objects, None) must not hide a tensor or a number."""
    for i, k in enumerate(kinds):
        if k in (sk.TENSOR, sk.NUMBER) or (k == sk.SEQUENCE and sk.is_number_list(samples[i])):
            first = "None" if kinds[0] == sk.NONE else f"a {type(samples[0]).__name__}"
            raise TypeError(
                f"collate(): field {field_label(path)}: sample {i} is a {type(samples[i]).__name__}, "
                f"sample 0 is {first}; every sample of a field needs the same kind of value "
                "(convert the odd ones in the dataset)"
            )


def _mapping_plan(path: str, samples: Sequence[Any], opts: PackOptions) -> FieldPlan:
    elem = samples[0]
    keys = list(elem.keys())
    k0 = elem.keys()
    for i, s in enumerate(samples):
        if s.keys() != k0:
            missing = [k for k in keys if k not in s]
            extra = [k for k in s.keys() if k not in elem]
            what = f"has no key {missing[0]!r}" if missing else f"has key {extra[0]!r} that sample 0 lacks"
            raise KeyError(
                f"collate(): field {field_label(path)}: sample {i} {what} (sample 0 has keys {keys}); "
                "every sample needs the same keys"
            )
    if type(elem) is dict:
        children = {k: plan_samples([s[k] for s in samples], _child(path, k), opts) for k in keys}
        return ContainerPlan(children, dict)
    children = {k: plan_samples([s[k] for s in samples], _child(path, k), opts) for k in keys}
    return ContainerPlan(children, lambda built: _rebuild_mapping(elem, built))


def _rebuild_mapping(elem: Any, built: dict) -> Any:
    """Same mapping type as the samples, as ``default_collate`` does."""
    if isinstance(elem, collections.abc.MutableMapping):
        clone = copy.copy(elem)
        clone.update(built)
        return clone
    try:
        return type(elem)(built)
    except TypeError:
        return built


def _rebuild_sequence(elem: Any, items: list) -> Any:
    """Lists keep their type; tuples become lists (``default_collate``'s rule)."""
    if isinstance(elem, collections.abc.MutableSequence):
        try:
            clone = copy.copy(elem)
            for i, x in enumerate(items):
                clone[i] = x
            return clone
        except TypeError:
            return items
    return items
