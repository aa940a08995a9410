"""Contractions and broadcasting over several ragged dims under ``torch.compile``.

Eagerly, ``q @ k.transpose(-1, -2)`` on ``(N_i, H, N_i, E)`` pair queries gives scores
``(N_i, H, N_i, N_i)`` (three ragged dims, ``sum H N_i**3`` values) whose row count the
handler learns from host sizes, and runs in a few bucketed dense calls planned from them.
Inside a compiled graph the design, in one place:

* **The contraction is an opaque op.** ``padless::nested_island`` runs the eager handler itself
  (``torch.matmul`` / ``torch.einsum`` on NestedTensors: buckets, grouped GEMM, per-sample
  views, the eager structure checks) on NestedTensors rebuilt at run time from the inner
  tensors (host sizes read from the sizes tensors, free on the CPU; their plans cached by
  content), so compiled equals eager. Its fake implementation only states the output rows
  ``(rows, *static)``. Its backward (``padless::nested_island_backward``) runs the gradient
  equations eagerly: both in the buckets of the eager contraction's plan (the forward's,
  cached on the rebuilt structures; the result's gradient gathered once), else as two eager
  contractions (``g @ b^T`` and ``a^T @ g``; for ``einsum`` the two einsums with the output's
  letters), or, where they do not apply (broadcast batch dims), a vector-Jacobian product of
  the eager op recomputed from the saved inputs.
* **Output sizes are tensor arithmetic in the graph** (the contraction's size rule on the
  operands' device sizes); offsets are their cumulative row counts.
* **The row count**: when an operand has the output's layout (same rank, same ragged dims,
  same static extents: ``attn @ v`` has ``v``'s rows), the output takes that operand's
  structure, so later ops on both need no check; the island compares the eager result's
  sizes with it when the graph runs and raises a :class:`StructureError` if they differ.
  Otherwise (scores ``q @ k^T``) the row count is a new unbacked symbol
  (:func:`padless.tensor.traced.traced_sum` of the output's row counts), as are the group
  counts of reducing each of its ragged dims (``drop_count_k`` carriers of
  :mod:`padless.ops.common.carried`), so a softmax over the scores' last dim compiles.
* **Broadcasting onto such a structure** (``scores + mask_bias + pair_bias``) is a traced
  broadcast plan (:func:`traced_plan`, a :data:`padless.ops.common.broadcast.PLAN_PROVIDERS`
  entry): the operand with every ragged dim of the result gives the result's rows, the others
  are gathered through row maps: on the CPU the eager maps, cached
  (``padless::broadcast_rows``, :mod:`padless.ops.pairs.traced_maps`, which also compares
  the ragged extents when the graph runs); elsewhere maps built in the graph
  (``layout.broadcast_rows`` on device sizes) and ``padless::check_same_sizes``.
* **A softmax over a ragged dim of such scores** is an island too
  (:mod:`padless.ops.pairs.traced_softmax`), which keeps its result for its backward.

Layout of ``q (N_i, H, N_i, E) @ k^T (N_i, H, E, N_i)`` for ``N = (2, 1)``, ``H = 1``::

    q rows      sum N_i**2 = 5              ragged (0, 2), static (H, E)
    scores      sizes [[2, 1, 2, 2], [1, 1, 1, 1]] = device arithmetic on q's and k's sizes
                rows u0 = traced_sum([8, 1]) (9 at run time), offsets [0, 8, 9]
                drop_count_2 (softmax over the last dim): u1 = traced_sum([4, 1])
"""

from __future__ import annotations

import ast
import functools
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.ops.common.broadcast import PLAN_PROVIDERS, Plan
from padless.ops.common.carried import DROP_COUNT, MAX_DROP
from padless.ops.common.islands import rebuilt
from padless.ops.pairs.traced_maps import broadcast_rows
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import NestedTensor, StructureMeta, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.traced import autograd_inside_op, total_carrier, traced_sum
from padless.tensor.traced_checks import check_same_sizes

Body = Callable[[list, Any], NestedTensor]
_BODIES: dict[str, Body] = {}


def body(name: str) -> Callable[[Body], Body]:
    """Register ``fn(nested_operands, spec) -> NestedTensor`` as the eager body ``name``."""

    def deco(fn: Body) -> Body:
        _BODIES[name] = fn
        return fn

    return deco


@body("matmul")
def _matmul_body(nts: list, spec: Any) -> NestedTensor:
    return torch.matmul(nts[0], nts[1])


@body("bmm")
def _bmm_body(nts: list, spec: Any) -> NestedTensor:
    return torch.bmm(nts[0], nts[1])


@body("einsum")
def _einsum_body(nts: list, spec: Any) -> NestedTensor:
    return torch.einsum(spec, *nts)


@functools.lru_cache(maxsize=256)
def _spec(spec: str) -> tuple:
    return ast.literal_eval(spec)


def _eager(v: Tensor, offsets: Tensor, sizes: Tensor, ragged: Sequence[int]) -> NestedTensor:
    """An operand as an eager NestedTensor (host sizes read at run time: free on the CPU, one
    copy on a device); its structure, and every plan cached on it, is kept for the next call
    with the same sizes (the backward, the next step)."""
    return rebuilt(v, offsets, sizes, ragged, sizes.cpu(), offsets.cpu())


def _run(name: str, spec: str, values, offsets, sizes, out_ragged: Sequence[int]) -> NestedTensor:
    """The body on the rebuilt operands, its rows stored in the order ``out_ragged`` (the
    graph's layout of the result; a row gather when the eager result stores them otherwise)."""
    raggeds, user = _spec(spec)
    nts = [_eager(v, o, s, r) for v, o, s, r in zip(values, offsets, sizes, raggeds)]
    out = _BODIES[name](nts, user)
    if tuple(out._ragged) != tuple(out_ragged) and sorted(out._ragged) == sorted(out_ragged):
        hs, ho = out.host_sizes(), out.host_offsets()
        _, idx = layout.relayout_rows(hs, ho, out._ragged, out_ragged, out._values.shape[0])
        vals = values_of(out).index_select(0, idx.to(out._values.device))
        out = nested_from_values(vals, out._offsets, out._sizes, tuple(out_ragged), out._env, StructureMeta(hs, ho))
    return out


@torch.library.custom_op("padless::nested_island", mutates_args=())
def nested_island(
    name: str, spec: str, values: list[Tensor], offsets: list[Tensor], sizes: list[Tensor], out_sizes: Tensor,
    out_ragged: list[int], rows: int, static: list[int],
) -> Tensor:
    """The eager body ``name`` on NestedTensors rebuilt from ``(values, offsets, sizes)``
    (``spec``: their ragged dims and the body's argument): the result's rows ``(rows, *static)``
    in the storage order ``out_ragged``, checked against the sizes the graph assumed (``out_sizes``)."""
    with torch.no_grad():
        out = _run(name, spec, values, offsets, sizes, out_ragged)
    _check_result(name, out, out_sizes, out_ragged, rows, static)
    return _unaliased(out._values, values)


def _unaliased(v: Tensor, inputs: Sequence[Tensor]) -> Tensor:
    """``v`` as a custom op may return it: contiguous and sharing no storage with an input."""
    if type(v) is not Tensor:  # deferred rows (padless.ops.pairs.pending): computed by the copy
        return v.clone(memory_format=torch.contiguous_format)
    try:
        ptr = v.untyped_storage().data_ptr()
        shared = any(ptr == t.untyped_storage().data_ptr() for t in inputs)
    except RuntimeError:  # a tensor without a readable storage (AOTAutograd's runtime checks)
        shared = True
    return v.clone(memory_format=torch.contiguous_format) if shared else v.contiguous()


def _check_result(name: str, out: NestedTensor, out_sizes: Tensor, out_ragged: list[int], rows: int, static: list[int]) -> None:
    got = out.host_sizes()
    want = out_sizes.cpu()
    if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
        bad = next((i for i in range(min(len(got), len(want))) if not torch.equal(got[i], want[i])), 0)
        g = tuple(got[bad].tolist()) if len(got) > bad else ()
        w = tuple(want[bad].tolist()) if len(want) > bad else ()
        raise StructureError(
            f"{name}(): under torch.compile the result was given the structure of an operand with its layout, "
            f"but sample {bad} of the result has shape {g}, that operand {w}; make the operands' extents agree "
            "(or run this op eagerly)"
        )
    if tuple(out._values.shape) != (rows, *static) or tuple(out._ragged) != tuple(out_ragged):
        raise StructureError(
            f"{name}(): under torch.compile the result should have {rows} rows of {tuple(static)} with ragged dims "
            f"{tuple(out_ragged)}, the op made {tuple(out._values.shape)} with ragged dims {out._ragged}"
        )


@nested_island.register_fake
def _nested_island_fake(name, spec, values, offsets, sizes, out_sizes, out_ragged, rows, static):
    return values[0].new_empty((rows, *static))


Grad = Callable[[list, NestedTensor, Any, list, "NestedTensor | None"], list]
_GRADS: dict[str, Grad] = {}
_SAVES_OUTPUT: set[str] = set()


def gradient(name: str, output: bool = False) -> Callable[[Grad], Grad]:
    """Register ``fn(nested_operands, grad, spec, needs, out) -> [grad of each operand]``
    (NestedTensors, or None: not needed, or left to the vector-Jacobian product) as the gradient
    equations of body ``name``; ``output``: the island keeps its result for them (``out``; None
    otherwise: a contraction's result is not kept alive for its backward)."""

    def deco(fn: Grad) -> Grad:
        _GRADS[name] = fn
        if output:
            _SAVES_OUTPUT.add(name)
        return fn

    return deco


def _bucketed_grads(ins: list[str], out: str, a: NestedTensor, b: NestedTensor, g: NestedTensor, needs: list) -> list | None:
    """Both gradients of the contraction ``ins -> out`` (sample letters) of ``a`` and ``b`` from
    the buckets of the eager contraction's plan (cached on the rebuilt operands' structure: the
    forward's), ``g`` gathered into them once; None where that plan does not apply (the two
    gradient contractions then run as in eager)."""
    from padless.ops.pairs import bucket_nodes, bucketed

    if not a.batch_size or not a._values.dtype == b._values.dtype == g._values.dtype or any(len(set(t)) != len(t) for t in (*ins, out)):
        return None
    if any(_is_traced(x._values) or x._meta.host_sizes is None for x in (a, b)):
        return None
    if any(not set(t) <= set(bucketed._LETTERS) for t in (*ins, out)):
        ins, out = bucketed._rename(ins, out)
    plan = bucketed._plan(list(ins), out, [a, b])
    if plan is None or plan.grad_equations is None or tuple(plan.out_ragged) != tuple(g._ragged):
        return None
    ga, gb = bucket_nodes.contract_backward(plan, values_of(a), values_of(b), [], values_of(g), needs)
    return [None if x is None else nested_from_values(x, o._offsets, o._sizes, o._ragged, o._env, o._meta)
            for x, o in ((ga, a), (gb, b))]


def _matmul_letters(r: int) -> tuple[list[str], str] | None:
    from padless.ops.pairs.bucketed import _LETTERS

    if r < 2 or r + 2 > len(_LETTERS):
        return None
    batch, (m, k, n) = _LETTERS[: r - 2], _LETTERS[r - 2: r + 1]
    return [batch + m + k, batch + k + n], batch + m + n


@gradient("matmul")
@gradient("bmm")
def _matmul_grads(nts: list, g: NestedTensor, spec: Any, needs: list, out: NestedTensor | None) -> list:
    a, b = nts
    if a.sample_dim != b.sample_dim:
        return [None, None]  # batch dims broadcast: the vector-Jacobian product reduces them
    letters = _matmul_letters(a.sample_dim)
    fused = None if letters is None else _bucketed_grads(*letters, a, b, g, needs)
    if fused is not None:
        return fused
    return [torch.matmul(g, b.transpose(-1, -2)) if needs[0] else None,
            torch.matmul(a.transpose(-1, -2), g) if needs[1] else None]


@gradient("einsum")
def _einsum_grads(nts: list, g: NestedTensor, spec: Any, needs: list, out: NestedTensor | None) -> list:
    lhs, o = spec.split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or any(len(set(t)) != len(t) for t in (*ins, o)):
        return [None, None]
    x, y = ins
    if any(c not in o and c not in other for t, other in ((x, y), (y, x)) for c in t):
        return [None, None]  # a letter summed within one operand: its gradient is not of this form
    fused = _bucketed_grads([x[1:], y[1:]], o[1:], nts[0], nts[1], g, needs)
    if fused is not None:
        return fused
    return [torch.einsum(f"{o},{y}->{x}", g, nts[1]) if needs[0] else None,
            torch.einsum(f"{o},{x}->{y}", g, nts[0]) if needs[1] else None]


def _rows_like(x: NestedTensor | None, like: NestedTensor) -> Tensor | None:
    """``x``'s values in ``like``'s row layout (None unless ``x`` has ``like``'s sizes)."""
    if x is None or sorted(x._ragged) != sorted(like._ragged) or not torch.equal(x.host_sizes(), like.host_sizes()):
        return None
    if x._ragged != like._ragged:
        _, idx = layout.relayout_rows(x.host_sizes(), x.host_offsets(), x._ragged, like._ragged, x._values.shape[0])
        return x._values.index_select(0, idx.to(x._values.device))
    return x._values


@torch.library.custom_op("padless::nested_island_backward", mutates_args=())
def nested_island_backward(
    name: str, spec: str, grad: Tensor, values: list[Tensor], offsets: list[Tensor], sizes: list[Tensor],
    out_sizes: Tensor, out_ragged: list[int], needs: list[bool], output: Tensor | None = None,
) -> list[Tensor]:
    """Gradients of :func:`nested_island` for ``values`` (zeros where not needed): the body's
    gradient equations run eagerly (two contractions for a matmul or an einsum; a softmax's on
    its kept result ``output``), else the vector-Jacobian product of the eager body, recomputed
    from the inputs."""
    got: list[Tensor | None] = [None] * len(values)
    rule = _GRADS.get(name)
    if rule is not None:
        raggeds, user = _spec(spec)
        with torch.no_grad():
            nts = [_eager(v, o, s, r) for v, o, s, r in zip(values, offsets, sizes, raggeds)]
            out_offsets = layout.offsets_from_counts(layout.row_counts(out_sizes, out_ragged))
            g = _eager(grad, out_offsets, out_sizes, out_ragged)
            y = None if output is None else _eager(output, out_offsets, out_sizes, out_ragged)
            got = [_rows_like(x, nt) if need else None for x, nt, need in zip(rule(nts, g, user, needs, y), nts, needs)]
    if any(need and x is None for x, need in zip(got, needs)):
        with autograd_inside_op():
            leaves = [v.detach().requires_grad_(n) for v, n in zip(values, needs)]
            out = values_of(_run(name, spec, leaves, offsets, sizes, out_ragged))
            want = [t for t, n in zip(leaves, needs) if n]
            gs = iter(torch.autograd.grad(out, want, grad, allow_unused=True) if want and out.requires_grad else [None] * len(want))
            got = [next(gs) if n else None for n in needs]
    return [torch.zeros_like(v) if x is None else _unaliased(x, [*values, grad]) for v, x in zip(values, got)]


@nested_island_backward.register_fake
def _nested_island_backward_fake(name, spec, grad, values, offsets, sizes, out_sizes, out_ragged, needs, output=None):
    return [torch.empty_like(v) for v in values]


def _setup(ctx, inputs, output) -> None:
    name, spec, values, offsets, sizes, out_sizes, out_ragged, _, _ = inputs
    kept = [output] if name in _SAVES_OUTPUT else []
    ctx.save_for_backward(*values, *offsets, *sizes, out_sizes, *kept)
    ctx.args = (name, spec, len(values), list(out_ragged))
    ctx.needs = [v.requires_grad for v in values]


def _backward(ctx, grad):
    name, spec, n, out_ragged = ctx.args
    saved = ctx.saved_tensors
    values, offsets, sizes, out_sizes = list(saved[:n]), list(saved[n : 2 * n]), list(saved[2 * n : 3 * n]), saved[3 * n]
    output = saved[3 * n + 1] if len(saved) > 3 * n + 1 else None
    if not any(ctx.needs):
        gs = [None] * n
    else:
        gs = nested_island_backward(
            name, spec, grad.contiguous(), values, offsets, sizes, out_sizes, out_ragged, ctx.needs, output
        )
        gs = [g if need else None for g, need in zip(gs, ctx.needs)]
    return None, None, gs, [None] * n, [None] * n, None, None, None, None


nested_island.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------- structures


def _same_layout(operands: Sequence[NestedTensor], out_ragged: tuple[int, ...], out_static: Sequence[Any]) -> NestedTensor | None:
    """An operand whose layout is the output's (same rank, ragged dims and static extents)."""
    for o in operands:
        if sorted(o._ragged) == sorted(out_ragged) and o.sample_dim == len(out_ragged) + len(out_static):
            if all(statically_equal(x, y) for x, y in zip(o._values.shape[1:], out_static)):
                return o
    return None


def _concrete(env: Sequence[Any]) -> tuple:
    """Envelope entries that the compiler has specialised to a constant as plain ints (a
    constant SymInt in an output's outer size cannot be bound when the graph runs)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return tuple(int(e) if isinstance(e, torch.SymInt) and is_concrete_int(e) else e for e in env)


def statically_equal(x: Any, y: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(x == y))


def _fresh_meta(sizes: Tensor, ragged: tuple[int, ...], cols: Sequence[tuple[NestedTensor, int]]) -> StructureMeta:
    """A traced structure's metadata with the group count of reducing each ragged dim carried
    (``drop_count_k``): the rows of the operand that gave every other ragged extent and has
    no other ragged dim (the scores' last dim reduced: the queries' rows), else an unbacked
    symbol computed when the graph runs."""
    meta = StructureMeta()
    if len(ragged) < 2:
        return meta
    for k in range(min(len(ragged), MAX_DROP)):
        keep = [d for d in ragged if d != ragged[k]]
        src = {id(cols[d][0]) for d in keep}
        x = cols[keep[0]][0]
        if len(src) == 1 and sorted(cols[d][1] for d in keep) == sorted(x._ragged):
            v = x._values if x._values.dim() == 1 else x._values.flatten(1)
            if v.dim() == 1 or statically_equal(v.shape[1] > 0, True):
                meta.derived[(DROP_COUNT[k], sizes.device)] = v if v.dim() == 1 else v[:, 0]  # a view: only its length counts
                continue
        meta.derived[(DROP_COUNT[k], sizes.device)] = total_carrier(layout.row_counts(sizes, keep))
    return meta


def run_traced(
    name: str, user_spec: Any, operands: Sequence[NestedTensor], out_sizes: Tensor, out_ragged: tuple[int, ...],
    out_env: Sequence[Any], cols: Sequence[tuple[NestedTensor, int]],
) -> NestedTensor:
    """The eager body ``name`` on ``operands`` inside a compiled graph (see the module doc):
    the result's structure is an operand's (same layout) or a new one from ``out_sizes``."""
    ndim = len(out_env)
    static = [out_env[d] for d in layout.static_dims(ndim, out_ragged)]
    spec = repr((tuple(o._ragged for o in operands), user_spec))
    vals = [values_of(o).contiguous() for o in operands]
    offs = [o._offsets for o in operands]
    szs = [o._sizes for o in operands]
    like = _same_layout(operands, out_ragged, static)
    if like is not None:
        v = nested_island(
            name, spec, vals, offs, szs, like._sizes, list(like._ragged), like._values.shape[0], list(like._values.shape[1:])
        )
        return nested_from_values(v, like._offsets, like._sizes, like._ragged, _concrete(like._env), like._meta)
    counts = layout.row_counts(out_sizes, out_ragged)
    offsets = layout.offsets_from_counts(counts)
    rows = traced_sum(counts)
    v = nested_island(name, spec, vals, offs, szs, out_sizes, list(out_ragged), rows, static)
    return nested_from_values(v, offsets, out_sizes, out_ragged, _concrete(out_env), _fresh_meta(out_sizes, out_ragged, cols))


def _pick(choices: list[tuple[NestedTensor, int]]) -> tuple[NestedTensor, int]:
    """The operand dim an output dim takes its extent from: a ragged one if any, else the
    largest static one (static 1 broadcasts)."""
    for o, d in choices:
        if d in o._ragged:
            return o, d
    best = choices[0]
    for o, d in choices[1:]:
        if not statically_equal(o._env[d], 1):
            best = (o, d)
    return best


def traced_matmul(op: str, a: NestedTensor, b: NestedTensor, out_ragged: tuple[int, ...]) -> NestedTensor:
    """``a @ b`` of two NestedTensors inside a compiled graph (torch's batch broadcasting)."""
    ra, rb = a.sample_dim, b.sample_dim
    n = max(ra, rb)
    cols: list[tuple[NestedTensor, int]] = []
    for d in range(n - 2):
        da, db = d - (n - ra), d - (n - rb)
        choices = ([(a, da)] if da >= 0 else []) + ([(b, db)] if db >= 0 else [])
        cols.append(_pick(choices))
    cols += [(a, ra - 2), (b, rb - 1)]
    sizes = torch.stack([o._sizes[:, d] for o, d in cols], 1)
    env = [o._env[d] for o, d in cols]
    return run_traced(op, None, [a, b], sizes, out_ragged, env, cols)


def traced_einsum(ins: list[str], out: str, operands: Sequence[NestedTensor]) -> NestedTensor:
    """``einsum`` of NestedTensors inside a compiled graph (batch letter first everywhere)."""
    cols = []
    for c in out[1:]:
        cols.append(_pick([(o, s.index(c) - 1) for s, o in zip(ins, operands) if c in s[1:]]))
    sizes = torch.stack([o._sizes[:, d] for o, d in cols], 1)
    env = [o._env[d] for o, d in cols]
    out_ragged = tuple(i for i, (o, d) in enumerate(cols) if d in o._ragged)
    eq = ",".join(ins) + "->" + out
    return run_traced("einsum", eq, operands, sizes, out_ragged, env, cols)


# ---------------------------------------------------------------------------- broadcasting


def traced_plan(opname: str, nts: Sequence[NestedTensor]) -> Plan | None:
    """The broadcast plan of NestedTensors under tracing when one operand has every ragged dim
    of the result (None otherwise, or eagerly): its rows are the result's; the others are
    gathered through maps built in the graph, their ragged extents checked at run time."""
    ref = nts[0]
    if not _is_traced(ref._values) or len(nts) < 2:
        return None
    ndim = ref.sample_dim
    if any(n.sample_dim != ndim for n in nts):
        return None
    out_ragged = tuple(sorted({r for n in nts for r in n._ragged}))
    cover = next((n for n in nts if tuple(sorted(n._ragged)) == out_ragged), None)
    if cover is None or len(out_ragged) < 2:
        return None  # one ragged dim, or pairs made by broadcasting: the carried plans of common.carried
    out_ragged = cover._ragged  # its storage order
    for n in nts:
        for d in out_ragged:
            if d not in n._ragged and not statically_equal(n._env[d], 1):
                return None  # the eager path explains
    total = cover._values.shape[0]
    rows: list[Tensor | None] = []
    squeeze: list[tuple[int, ...]] = []
    for n in nts:
        static = layout.static_dims(ndim, n._ragged)
        squeeze.append(tuple(1 + static.index(d) for d in out_ragged if d not in n._ragged))
        if n is cover or (n._meta is cover._meta and n._ragged == cover._ragged):
            rows.append(None)
            continue
        if cover._sizes.device.type == "cpu":  # the eager map, cached (padless.ops.pairs.traced_maps)
            rows.append(broadcast_rows(cover._sizes, cover._offsets, list(out_ragged), n._sizes, n._offsets,
                                       list(n._ragged), total, str(opname)))
            continue
        common = [d for d in n._ragged if d in out_ragged]
        check_same_sizes(cover._sizes, n._sizes, common, opname, True)
        rows.append(layout.broadcast_rows(cover._sizes, cover._offsets, out_ragged, n._sizes, n._offsets, n._ragged, total))
    env = list(cover._env)
    for d in layout.static_dims(ndim, out_ragged):
        for n in nts:
            if not statically_equal(n._env[d], 1):
                env[d] = n._env[d]
    static_env = [env[d] for d in layout.static_dims(ndim, out_ragged)]
    if all(statically_equal(x, y) for x, y in zip(static_env, cover._values.shape[1:])):
        sizes, meta = cover._sizes, cover._meta
    else:
        sizes = cover._sizes.clone()
        for d in layout.static_dims(ndim, out_ragged):
            sizes[:, d] = env[d]
        meta = StructureMeta()
        meta.derived.update({k: v for k, v in cover._meta.derived.items() if isinstance(k, tuple) and k[0] in DROP_COUNT})
    placeholder = cover._values.new_zeros(()).expand(total, *static_env)
    template = NestedTensor(placeholder, cover._offsets, sizes, out_ragged, _concrete(env), meta)
    return Plan(template, rows, squeeze)


if traced_plan not in PLAN_PROVIDERS:
    PLAN_PROVIDERS.append(traced_plan)
