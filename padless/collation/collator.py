"""``padless.Collator``: a collate_fn with a schema, returning a :class:`~padless.collation.Batch`.

Inference (``padless.collate``) packs whatever varies. A schema says more: which
dims are ragged (a declared field stays a NestedTensor even when every sample of
a batch has one length), casts, pair maps, position ids, sample ids, shifted
labels, and padding of the packed length to a multiple::

    collator = padless.Collator({
        "input_ids": padless.Field(ragged=0, position_ids="position_ids",
                                   labels="labels", seq_idx="seq_idx"),
        "coords":    padless.Field(ragged=0, dtype=torch.float32, pair=True),
    })
    loader = DataLoader(ds, batch_size=8, collate_fn=collator, num_workers=2, pin_memory=True)

For ``input_ids`` samples ``[5, 6]``, ``[7, 8, 9]``::

    input_ids     values [5, 6, 7, 8, 9]        offsets [0, 2, 5]
    position_ids  values [0, 1, 0, 1, 2]        (position_start=2 gives [2, 3, 2, 3, 4])
    seq_idx       values [0, 0, 1, 1, 1]        int32
    labels        values [-100, 6, -100, 8, 9]  the first token of every sample masked,
                                                so a shifted next-token loss never
                                                predicts across a sample boundary

Fields the schema does not name are collated by inference, as ``padless.collate``.
Everything is computed here, in the DataLoader worker.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from padless.collation import metadata as md
from padless.collation.arena import Arena, in_worker
from padless.collation.batch import Batch
from padless.collation.collate import plan_samples
from padless.collation.pack import (
    FieldPlan,
    PackOptions,
    Placer,
    RaggedPlan,
    StackPlan,
    TensorPlan,
    as_tensors,
    check_static,
    common_dtype,
    differing_dims,
    shape_table,
)
from padless.collation.opcache import install
from padless.collation.pair_plans import pair_plans
from padless.collation import samples as sk
from padless.collation.samples import fmt_shape
from padless.tensor.core import NestedTensor, StructureMeta, mark_dynamic


@dataclasses.dataclass(frozen=True)
class Field:
    """How one field of the samples is collated.

    ragged           sample dims that vary (int or tuple); None: the dims that differ in
                     the batch, or dim 0 when none does; ``()``: stack (every dim static)
    dtype            cast every sample to this dtype (otherwise differing dtypes are an error)
    pair             True: square pair maps ``(N_i, N_i)`` for ``x.unsqueeze(2) + x.unsqueeze(1)``;
                     a field name: rectangular maps ``(N_i, M_i)`` against that field
    position_ids     name of an output holding each row's position in its sample, from
                     ``position_start`` (RoBERTa-style models start at 2)
    seq_idx          name of an output holding each row's sample index (int32)
    labels           name of an output holding the field with ``label_separator`` at each
                     sample's first row (next-token objectives on packed sequences)
    pad_to_multiple  pad the packed length to a multiple with one extra dummy sample of
                     ``pad_value`` rows (always present, possibly empty: the field then has
                     ``len(batch) + 1`` samples, a fixed count for CUDA graphs)
    row_maps         also precompute each row's sample id and position (2 int64 per row):
                     per-sample broadcasting, whole-sample reductions and hf_kwargs'
                     position_ids then use no main-process work. Off by default: without
                     it a field ships O(B) metadata (offsets, sizes, cu_seqlens)
    padded_index     precompute the padded index used by ``batch.padded()`` / ``to_padded()``
    spatial_plan     for images ``(C, H_i, W_i)`` ragged along (1, 2) (or sequences ``(C, L_i)``
                     ragged along 1, with int numbers as ``nn.Conv1d``): the first layer's window
                     geometry, ``dict(kernel_size=7, stride=2, padding=3)`` (also ``dilation``,
                     ``ceil_mode``; ints, pairs, or a ``(top, bottom, left, right)`` padding) or a
                     list of them (several layers reading the field). The worker builds each layer's spatial plan
                     (:func:`padless.ops.vision.spatial.build_spatial_plan`) and a ``Conv2d`` /
                     ``MaxPool2d`` of that geometry on the batch finds it ready. A network plan recipe
                     (:func:`padless.vision.plan_recipe`) builds every layer's plans of the whole
                     network instead (each stage's convolutions, pools, strided projections)
    pair_plans       for tokens ``(N_i, *static)`` ragged along dim 0: a pair plan recipe
                     (:func:`padless.pair_plan_recipe`), the bucket plans one step of a pair model
                     builds on structures of this field's lengths (attention scores and
                     ``softmax(...) @ v``, triangle products). The worker builds them for every batch
                     and the model's first step on it finds them ready (it builds none)

    Example:
        >>> import torch, padless
        >>> coll = padless.Collator({"x": padless.Field(ragged=0, dtype=torch.float64, seq_idx="seq")})
        >>> b = coll([{"x": torch.ones(2, 3)}, {"x": torch.ones(2, 3)}])   # equal lengths: still ragged
        >>> type(b.x).__name__, b.x.dtype, b.seq.values().tolist()
        ('NestedTensor', torch.float64, [0, 0, 1, 1])
    """

    ragged: int | tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    pair: bool | str = False
    position_ids: str | None = None
    position_start: int = 0
    seq_idx: str | None = None
    labels: str | None = None
    label_separator: int = -100
    pad_to_multiple: int | None = None
    pad_value: float = 0.0
    row_maps: bool = False
    padded_index: bool = False
    spatial_plan: Mapping[str, Any] | Sequence[Mapping[str, Any]] | Any | None = None
    pair_plans: Any | None = None

    def outputs(self) -> dict[str, str]:
        roles = {"position_ids": self.position_ids, "seq_idx": self.seq_idx, "labels": self.labels}
        return {role: name for role, name in roles.items() if name is not None}


class Collator:
    """A ``collate_fn`` with a per-field schema; returns a :class:`Batch`.

    Where :func:`padless.collate` infers everything (it packs whatever varies and stacks the
    rest), a ``Collator`` is told: which dims of a field are ragged (a declared field stays a
    NestedTensor even when every sample of one batch has the same length), dtype casts, pair
    maps, position ids, sample ids, shifted labels, padding of the packed length, and the
    spatial plans of an image network's first layers. Everything is computed in the
    DataLoader worker that calls it, so the training step receives a batch whose kernels'
    metadata (offsets, int32 ``cu_seqlens``, python-int ``max_seqlen``, maps) is ready.

    Args:
        fields: field name -> :class:`Field`. Fields the schema does not name are collated by
            inference, as :func:`padless.collate` does. A declared field must be present in
            every sample.

    Returns (when called on a list of samples):
        A :class:`Batch`: dict-like, with attribute access (``batch.input_ids``), ``len(batch)``
        the number of samples, ``pin_memory()`` and ``to(device, non_blocking=True)`` (one copy
        per dtype). Samples may be dicts, tuples or dataclasses; a tuple's fields are named
        ``"0"``, ``"1"``, ... .

    Raises:
        KeyError: a declared field is missing from a sample.
        StructureError: samples disagree on a static dim, a dtype, or the schema's ragged dims.

    Example:
        >>> import torch, padless
        >>> collator = padless.Collator({
        ...     "input_ids": padless.Field(ragged=0, position_ids="position_ids", labels="labels"),
        ... })
        >>> b = collator([{"input_ids": torch.tensor([5, 6])}, {"input_ids": torch.tensor([7, 8, 9])}])
        >>> b.input_ids.values().tolist(), b.input_ids.offsets().tolist()
        ([5, 6, 7, 8, 9], [0, 2, 5])
        >>> b.position_ids.values().tolist(), b.labels.values().tolist()
        ([0, 1, 0, 1, 2], [-100, 6, -100, 8, 9])

        In a DataLoader: ``DataLoader(ds, batch_size=8, collate_fn=collator, num_workers=2,
        pin_memory=True)``. The module docstring of ``padless.collation.collator`` draws the
        layout of every output.
    """

    def __init__(self, fields: Mapping[str, Field] | None = None) -> None:
        self.fields: dict[str, Field] = dict(fields or {})
        _validate_schema(self.fields)
        self._geometries = {name: spatial_geometries(name, f.spatial_plan) for name, f in self.fields.items() if f.spatial_plan is not None}

    def __repr__(self) -> str:
        return f"Collator(fields={self.fields!r})"

    def __call__(self, samples: Sequence[Any]) -> Batch:
        rows = _as_rows(samples)
        keys = list(rows[0].keys())
        for name in self.fields:
            if name not in rows[0]:
                raise KeyError(f"Collator: field {name!r} is declared, but sample 0 has no key {name!r} (keys {keys})")
        _check_keys(rows, keys)
        plans: dict[str, FieldPlan] = {}
        for key in keys:
            col = [r[key] for r in rows]
            spec = self.fields.get(key)
            plans[key] = plan_samples(col, key) if spec is None else _plan_field(key, col, spec)
        outputs = self._plan_outputs(plans, rows)
        self._plan_pairs(plans)
        self._plan_pair_recipes(plans)
        for name, geometries in self._geometries.items():
            _plan_spatial(name, plans[name], geometries)
        arena = Arena()
        for p in (*plans.values(), *outputs.values()):
            p.reserve(arena)
        arena.allocate(shared=in_worker())
        built: dict[str, Any] = {k: p.build(arena) for k, p in plans.items()}
        for name, out in outputs.items():
            built[name] = out.build_for(arena, built[out.parent_name])
        return Batch(built, len(rows))

    def _plan_pairs(self, plans: dict[str, FieldPlan]) -> None:
        for name, spec in self.fields.items():
            if spec.pair is False:
                continue
            peer = None if spec.pair is True or spec.pair == name else spec.pair
            x = _pair_operand(plans, name)
            y = x if peer is None else _pair_operand(plans, peer)
            n, m = x.host_sizes[:, 0], y.host_sizes[:, 0]
            x.meta.pair = md.pair_maps(n, m, x.static, peer, owner=name)

    def _plan_pair_recipes(self, plans: dict[str, FieldPlan]) -> None:
        """Each ``Field(pair_plans=recipe)``'s bucket plans for this batch's lengths, built here."""
        for name, spec in self.fields.items():
            if spec.pair_plans is not None:
                x = _pair_operand(plans, name, "pair_plans")
                x.meta.pair_plans = pair_plans(spec.pair_plans, x.host_sizes[:, 0])

    def _plan_outputs(self, plans: dict[str, FieldPlan], rows: list[Mapping[str, Any]]) -> dict[str, "OutputPlan"]:
        """Plans of the declared per-row outputs. An output named like a key the samples carry
        never overwrites it silently: ``labels`` builds on the samples' own labels (the
        separator goes on top of them), any other role is an error."""
        out: dict[str, OutputPlan] = {}
        for name, spec in self.fields.items():
            plan = plans[name]
            roles = spec.outputs()
            if not roles:
                continue
            if not isinstance(plan, RaggedPlan) or plan.ragged != (0,):
                got = plan.ragged if isinstance(plan, RaggedPlan) else "none (stacked)"
                raise ValueError(
                    f"Collator: field {name!r}: {', '.join(roles)} need samples ragged along dim 0 only "
                    f"(token sequences); this field's ragged dims are {got}"
                )
            plan.meta.outputs = dict(roles)
            for role, key in roles.items():
                own = None
                if key in plans:
                    if role != "labels":
                        raise ValueError(
                            f"Collator: field {name!r}: the {role} output {key!r} would overwrite the samples' own "
                            f"{key!r} field; name the output differently (Field({role}='{key}_') ...) or drop "
                            f"{key!r} from the samples"
                        )
                    own = _own_labels(name, plan, key, [r[key] for r in rows])
                    del plans[key]
                out[key] = OutputPlan(name, plan, role, spec, own)
        return out


def _validate_schema(fields: dict[str, Field]) -> None:
    used: dict[str, str] = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or not isinstance(spec, Field):
            raise TypeError(f"Collator: fields must map names to padless.Field, got {name!r}: {type(spec).__name__}")
        if spec.pad_to_multiple is not None and (not isinstance(spec.pad_to_multiple, int) or spec.pad_to_multiple < 1):
            raise ValueError(f"Collator: field {name!r}: pad_to_multiple must be a positive int, got {spec.pad_to_multiple!r}")
        if spec.pair is not False:
            peer = name if spec.pair is True else spec.pair
            if not isinstance(peer, str) or peer not in fields:
                raise ValueError(
                    f"Collator: field {name!r}: pair={spec.pair!r} must be True or the name of another "
                    f"declared field (declared: {list(fields)})"
                )
            for f in {name, peer}:
                if fields[f].pad_to_multiple is not None:
                    raise ValueError(
                        f"Collator: field {name!r}: pair maps and pad_to_multiple (on {f!r}) do not mix: "
                        "the dummy segment would join the pair state"
                    )
        if spec.pair_plans is not None:
            from padless.ops.pairs.recipe import PairPlanRecipe

            if not isinstance(spec.pair_plans, PairPlanRecipe):
                raise TypeError(
                    f"Collator: field {name!r}: pair_plans must be a recipe from padless.pair_plan_recipe(model, "
                    f"*example_inputs), got {type(spec.pair_plans).__name__}"
                )
            if spec.pad_to_multiple is not None:
                raise ValueError(
                    f"Collator: field {name!r}: pair_plans and pad_to_multiple do not mix: the dummy segment "
                    "would change the lengths the plans are built for"
                )
        for role, key in spec.outputs().items():
            if key in fields or key in used:
                other = f"field {key!r}" if key in fields else f"the {used[key]} output"
                raise ValueError(f"Collator: field {name!r}: {role} output {key!r} collides with {other}")
            used[key] = f"{name}.{role}"


def _as_rows(samples: Sequence[Any]) -> list[Mapping[str, Any]]:
    if isinstance(samples, (str, bytes)) or not isinstance(samples, collections.abc.Sequence):
        raise TypeError(f"Collator: expected a list of samples, got {type(samples).__name__}")
    if len(samples) == 0:
        raise ValueError("Collator: empty batch: no samples to collate (check the sampler or drop_last)")
    if all(type(s) is dict for s in samples):
        return list(samples)
    rows = []
    for i, s in enumerate(samples):
        if isinstance(s, collections.abc.Mapping):
            rows.append(s)
        elif isinstance(s, tuple) and hasattr(s, "_asdict"):
            rows.append(s._asdict())
        elif dataclasses.is_dataclass(s) and not isinstance(s, type):
            rows.append({f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
        else:
            raise TypeError(
                f"Collator: sample {i} is a {type(s).__name__}; a Collator takes dicts, namedtuples or "
                "dataclasses (fields by name). Use padless.collate for other samples."
            )
    return rows


def _check_keys(rows: list[Mapping[str, Any]], keys: list[str]) -> None:
    """Every sample has sample 0's keys, no more, no less."""
    k0 = rows[0].keys()
    for i, r in enumerate(rows):
        if r.keys() == k0:
            continue
        missing = [k for k in keys if k not in r]
        if missing:
            k = missing[0]
            raise KeyError(f"collate(): field {k!r}: sample {i} has no key {k!r} (sample 0 has keys {keys})")
        extra = [k for k in r.keys() if k not in rows[0]]
        raise KeyError(f"collate(): sample {i} has key {extra[0]!r} that sample 0 lacks (sample 0 has keys {keys})")


def _plan_field(name: str, col: list[Any], spec: Field) -> FieldPlan:
    if all(sk.kind(x) == sk.NUMBER for x in col):  # numbers: a (B,) tensor, cast if declared
        t = sk.numbers_tensor(col, name)
        return TensorPlan(t if spec.dtype is None else t.to(spec.dtype))
    ts = as_tensors(name, col)
    sizes = shape_table(name, ts)
    dtype = common_dtype(name, ts, spec.dtype)
    ndim = ts[0].dim()
    if spec.ragged is None:
        ragged = differing_dims(sizes) or ((0,) if ndim else ())
    else:
        raw = (spec.ragged,) if isinstance(spec.ragged, int) else tuple(spec.ragged)
        for d in raw:
            if not -ndim <= d < ndim:
                raise ValueError(
                    f"Collator: field {name!r}: ragged dim {d} is out of range for samples of shape "
                    f"{fmt_shape(ts[0].shape)} (rank {ndim}; dims count sample dims, batch excluded)"
                )
        ragged = tuple(sorted({d % ndim for d in raw}))
        check_static(name, ts, ragged, sizes)
    if not ragged:
        return StackPlan(ts, dtype)
    opts = PackOptions(spec.row_maps, spec.padded_index, spec.pad_to_multiple, spec.pad_value)
    return RaggedPlan(name, ts, ragged, dtype, opts, sizes)


_SPATIAL_KEYS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")


def spatial_geometries(name: str, spec: Any) -> Any:
    """The window geometries of ``Field(spatial_plan=...)`` (one dict or a list of dicts), validated:
    per layer ``(geometry on images, geometry on sequences (C, L_i) or None)``; the second
    exists when every number is one int, as ``nn.Conv1d`` takes them. A
    :class:`~padless.ops.vision.recipe.PlanRecipe` is returned as it is."""
    from padless.ops.vision.recipe import PlanRecipe
    from padless.ops.vision.spatial import Geometry, to_pair, to_padding

    if isinstance(spec, PlanRecipe):  # a whole network's plans (padless.vision.plan_recipe)
        return spec
    layers = [spec] if isinstance(spec, Mapping) else list(spec) if isinstance(spec, (list, tuple)) else None
    if not layers or not all(isinstance(d, Mapping) for d in layers):
        raise TypeError(
            f"Collator: field {name!r}: spatial_plan must be a dict like dict(kernel_size=7, stride=2, padding=3) "
            f"or a non-empty list of them, got {spec!r}"
        )
    out = []
    for i, d in enumerate(layers):
        where = f"Collator: field {name!r}: spatial_plan[{i}]" if len(layers) > 1 or not isinstance(spec, Mapping) else f"Collator: field {name!r}: spatial_plan"
        unknown = sorted(set(d) - set(_SPATIAL_KEYS))
        if unknown or "kernel_size" not in d:
            what = f"unknown key(s) {unknown}" if unknown else "no kernel_size"
            raise ValueError(f"{where} has {what}; the keys are {list(_SPATIAL_KEYS)} (kernel_size required)")
        op = where  # to_pair's messages read "{where}(): kernel_size must be ..."
        if isinstance(d.get("padding"), str):
            raise ValueError(f"{where}: padding {d['padding']!r} is not supported here; give the numbers (e.g. padding=3 for 'same' with a 7x7 kernel)")
        ceil = d.get("ceil_mode", False)
        if not isinstance(ceil, bool):
            raise ValueError(f"{where}: ceil_mode must be a bool, got {ceil!r}")
        k, st = to_pair(op, "kernel_size", d["kernel_size"]), to_pair(op, "stride", d.get("stride", 1))
        pad, dil = to_padding(op, d.get("padding", 0)), to_pair(op, "dilation", d.get("dilation", 1))
        ints = all(isinstance(d.get(key, 0), int) for key in ("kernel_size", "stride", "padding", "dilation"))
        seq = Geometry((1, k[1]), (1, st[1]), (0, 0, pad[2], pad[3]), (1, dil[1]), ceil) if ints else None
        out.append((Geometry(k, st, pad, dil, ceil), seq))
    return tuple(out)


def _plan_spatial(name: str, plan: FieldPlan, geometries: tuple[Any, ...]) -> None:
    """Build the field's first-layer spatial plans here (in the worker) and add them to its metadata."""
    from padless.collation.opcache import spatial_maps
    from padless.ops.vision.spatial import build_spatial_plan

    rank = plan.host_sizes.shape[1] if isinstance(plan, RaggedPlan) else -1
    if not isinstance(geometries, tuple):  # a network plan recipe: every layer's plans, replayed here
        from padless.collation.network import check_recipe, network_plans

        ragged = plan.ragged if isinstance(plan, RaggedPlan) else "none (stacked)"
        check_recipe(name, geometries, ragged, rank, plan.static[0] if isinstance(plan, RaggedPlan) and plan.static else None)
        plan.meta.spatial = (network_plans(_placeholder(plan), geometries),)
        return
    images = isinstance(plan, RaggedPlan) and rank == 3 and plan.ragged == (1, 2)
    sequences = isinstance(plan, RaggedPlan) and rank == 2 and plan.ragged == (1,)
    if not (images or sequences):
        got = plan.ragged if isinstance(plan, RaggedPlan) else "none (stacked)"
        raise ValueError(
            f"Collator: field {name!r}: spatial_plan needs images (C, H_i, W_i) ragged along dims (1, 2) or sequences "
            f"(C, L_i) ragged along dim 1; this field's ragged dims are {got} (declare Field(ragged=(1, 2)) and "
            "decode images channels-first)"
        )
    if sequences and any(seq is None for _, seq in geometries):
        raise ValueError(
            f"Collator: field {name!r}: spatial_plan on sequences (C, L_i) takes one int per number "
            "(kernel_size, stride, padding, dilation), as nn.Conv1d does"
        )
    packed = _placeholder(plan)
    plan.meta.spatial = tuple(
        spatial_maps(build_spatial_plan(packed, g.kernel, g.stride, g.padding, g.dilation, ceil_mode=g.ceil_mode))
        for g in (seq if sequences else img for img, seq in geometries)
    )


def _placeholder(plan: RaggedPlan) -> NestedTensor:
    """The field's structure around values that are never read (plans read sizes only)."""
    placeholder = torch.zeros((), dtype=plan.dtype).expand(plan.total, plan.static[0])
    return NestedTensor(placeholder, plan.host_offsets, plan.host_sizes, plan.ragged, plan.env,
                        StructureMeta(plan.host_sizes, plan.host_offsets))


def _pair_operand(plans: dict[str, FieldPlan], name: str, what: str = "pair maps") -> RaggedPlan:
    p = plans[name]
    if not isinstance(p, RaggedPlan) or p.ragged != (0,):
        got = p.ragged if isinstance(p, RaggedPlan) else "none (stacked)"
        raise ValueError(
            f"Collator: field {name!r}: {what} need samples (N_i, *static) ragged along dim 0 only; "
            f"this field's ragged dims are {got}"
        )
    return p


class OutputPlan(FieldPlan):
    """A per-row output of a ragged field (positions, sample ids or labels) with its structure."""

    def __init__(
        self, parent_name: str, parent: RaggedPlan, role: str, spec: Field, source: list[Tensor] | None = None
    ) -> None:
        self.parent_name, self.parent, self.role = parent_name, parent, role
        self.own_sizes = None
        if role == "labels":
            self.t = _labels(parent, spec.label_separator, source)
        else:
            rows = parent.meta.rows or md.row_maps(parent.host_sizes, parent.host_offsets, parent.ragged, parent.total)
            if role == "position_ids":
                self.t = rows.coords[0] + spec.position_start if spec.position_start else rows.coords[0]
            else:
                self.t = rows.row_ids.to(torch.int32)
            if parent.static:  # (L_i, C) field: the output is (L_i,)
                self.own_sizes = parent.host_sizes[:, :1].contiguous()
        self.placer = Placer()

    def reserve(self, arena: Arena) -> None:
        self.placer.add(self.t, False)
        if self.own_sizes is not None:
            self.placer.add(self.own_sizes, False)
        self.placer.reserve(arena)

    def build_for(self, arena: Arena, parent: NestedTensor) -> NestedTensor:
        self.placer.build(arena)
        vals = self.placer.get(self.t)
        if self.own_sizes is None:
            out = NestedTensor(vals, parent._offsets, parent._sizes, parent._ragged, parent._env, parent._meta)
            return mark_dynamic(out)
        sizes = self.placer.get(self.own_sizes)
        meta = StructureMeta(sizes, parent._meta.host_offsets)
        out = mark_dynamic(NestedTensor(vals, parent._offsets, sizes, (0,), parent._env[:1], meta))
        fm = parent._meta.derived.get("collate_field_meta")
        if fm is not None:
            install(out, dataclasses.replace(fm, pair=None, outputs={}, padded_index=None, pair_plans=None))
        return out


def _own_labels(name: str, parent: RaggedPlan, key: str, col: list[Any]) -> list[Tensor]:
    """The samples' own ``key`` column as tensors shaped like the field's samples."""
    ts = as_tensors(key, col)
    for i, (lab, x) in enumerate(zip(ts, parent.ts)):
        if lab.shape != x.shape:
            raise ValueError(
                f"Collator: field {name!r}: sample {i}'s own {key!r} has shape {fmt_shape(lab.shape)}, its {name!r} "
                f"has {fmt_shape(x.shape)}; labels the samples carry need one label per token (mask with -100)"
            )
        if lab.dtype.is_floating_point or lab.dtype.is_complex:
            raise TypeError(
                f"Collator: field {name!r}: sample {i}'s own {key!r} has dtype {lab.dtype}; token labels are integers"
            )
    return ts


def _labels(parent: RaggedPlan, separator: int, source: list[Tensor] | None = None) -> Tensor:
    """``source`` (the samples' own labels; default: the field's values) as int64 with ``separator``
    at each sample's first row (and on dummy rows), as Hugging Face's flattening collator does."""
    lab = torch.full((parent.total, *parent.static), separator, dtype=torch.int64)
    ts = parent.ts if source is None else source
    torch.cat([t.to(torch.int64) for t in ts], 0, out=lab[: parent.real_rows])
    starts = parent.host_offsets[:-1][(parent.host_offsets[1:] - parent.host_offsets[:-1]) > 0]
    lab[starts] = separator
    return lab
