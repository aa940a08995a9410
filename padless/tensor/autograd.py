"""Autograd bridge between a NestedTensor and its packed ``values``.

Structure-aware handlers compute on ``values`` with ordinary torch ops. Two
autograd functions connect the NestedTensor to that buffer in both directions:

* :func:`values_of` (NestedTensor -> values): the backward wraps the incoming dense
  gradient into a NestedTensor of the same structure (defined in
  :mod:`padless.tensor.core`, since ``NestedTensor.values()`` calls it; re-exported here);
* :func:`nested_from_values` (values -> NestedTensor): the backward hands the
  NestedTensor gradient's ``values`` to the buffer.

Both are no-ops (no autograd node, no cost) when no gradient is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.core import NestedTensor, _apply, values_of  # values_of, _apply: also imported from here
from padless.tensor.dynamo import _is_traced
from padless.tensor.registry import lend, lent
from padless.tensor.structure import StructureMeta, _structure_mismatch, static_change


def _grad_values(grad: Tensor, like: NestedTensor | None = None) -> Tensor:
    if isinstance(grad, NestedTensor):
        return grad._values
    raise TypeError(
        f"padless: expected the gradient of a NestedTensor to be a NestedTensor, got a dense "
        f"Tensor of shape {tuple(grad.shape)}"
    )


class _NestedView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, offsets, sizes, ragged, envelope, meta) -> NestedTensor:  # type: ignore[override]
        out = NestedTensor(values.detach(), offsets, sizes, ragged, envelope, meta)
        ctx.out = (offsets, sizes, ragged, tuple(envelope), out._meta)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return _conform(grad, ctx.out), None, None, None, None, None


def _conform(grad: Tensor, struct: tuple) -> Tensor:
    """The gradient's rows in the layout and structure of the forward output.

    Autograd hands a NestedTensor input the gradient of an op's *output*. Two cases need
    work here: the input was stored in another order (a transposed pair: its rows are
    permuted), or the op broadcast the input (an extent 1 met 0 or N in some sample)
    while the padded envelopes agree, so autograd did not call ``sum_to_size``
    (``x.unsqueeze(-1) + x.unsqueeze(-2)`` at ``N == 1``): the gradient is summed back.
    """
    values = _grad_values(grad)
    offsets, sizes, ragged, envelope, meta = struct
    gm = grad._meta
    if gm is meta:
        return values
    hs, ghs = meta.host_sizes, gm.host_sizes
    # Compared only when both host copies exist (never a sync on this path).
    sizes_differ = hs is not None and ghs is not None and hs is not ghs and not torch.equal(hs, ghs)
    if not sizes_differ and grad._ragged == ragged:
        return values
    if sizes_differ or set(grad._ragged) != set(ragged):
        if _is_traced(values) or not set(ragged) <= set(grad._ragged):
            raise RuntimeError(
                f"padless: gradient with ragged dims {grad.ragged_dims} cannot flow into a NestedTensor with "
                f"ragged dims {tuple(sorted(ragged))}"
            )
        return _unbroadcast(values, grad, struct)
    key = ("relayout", grad._ragged, ragged)
    idx = meta.derived.get(key)
    if idx is None:
        hs = meta.host_sizes if meta.host_sizes is not None else sizes.cpu()
        ho = meta.host_offsets if meta.host_offsets is not None else offsets.cpu()
        _, idx = layout.relayout_rows(hs, ho, grad._ragged, ragged, values.shape[0])
        idx = idx.to(values.device, non_blocking=True)
        meta.derived[key] = idx
    return values.index_select(0, idx)


def _unbroadcast(values: Tensor, grad: NestedTensor, struct: tuple) -> Tensor:
    """Sum the gradient rows of a broadcast result back onto the rows of the input.

    Every gradient row maps to the input row it was read from (an input extent of 1
    reads coordinate 0); dims that are ragged in the gradient but static (extent 1) in
    the input become that static dim. Rows of the input that fed no output (an extent 1
    broadcast to 0) get zeros.
    """
    offsets, sizes, ragged, envelope, meta = struct
    ths = meta.host_sizes if meta.host_sizes is not None else sizes.cpu()
    tho = meta.host_offsets if meta.host_offsets is not None else offsets.cpu()
    ghs, gho = grad.host_sizes(), grad.host_offsets()
    sid, coords = layout.row_coords(ghs, gho, grad._ragged, values.shape[0])
    idx = layout.source_rows(sid, dict(zip(grad._ragged, coords)), ths, tho, ragged)
    g = values
    t_static = layout.static_dims(ths.shape[1], ragged)
    for j, d in enumerate(t_static):
        if d in grad._ragged:
            g = g.unsqueeze(1 + j)
    red = [1 + j for j, d in enumerate(t_static) if int(envelope[d]) == 1 and g.shape[1 + j] != 1]
    if red:
        g = g.sum(red, keepdim=True)
    out = g.new_zeros((int(tho[-1]), *g.shape[1:]))
    return out.index_add(0, idx.to(g.device), g)


def nested_from_values(
    values: Tensor,
    offsets: Tensor,
    sizes: Tensor,
    ragged: tuple[int, ...],
    envelope: Sequence,
    meta: StructureMeta | None = None,
    *,
    shared: bool = False,
) -> NestedTensor:
    """Build a NestedTensor around ``values``, keeping ``values``' autograd history.

    ``shared``: ``values`` may be held elsewhere (a constructor's argument, which the caller
    keeps); handlers pass rows they have just computed (see :func:`_with_history`)."""
    if values.requires_grad and torch.is_grad_enabled():
        return _with_history(values, offsets, sizes, ragged, tuple(envelope), meta, shared)
    return NestedTensor(values, offsets, sizes, ragged, envelope, meta)


def rewrap(values: Tensor, like: NestedTensor) -> NestedTensor:
    """``values`` on ``like``'s rows (static extents may differ), keeping ``values``' history."""
    if values.shape[1:] == like._values.shape[1:]:
        sizes, meta, env = like._sizes, like._meta, like._env
    else:
        sizes, meta, env = static_change(values, like)
    if values.requires_grad and torch.is_grad_enabled():
        out = _with_history(values, like._offsets, sizes, like._ragged, env, meta, False)
    else:
        out = NestedTensor(values, like._offsets, sizes, like._ragged, env, meta)
    if like._lineage is not None:
        out._lineage = like._lineage  # like's samples (tensor.lineage)
    return out


ROWS_MARK = "_padless_rows"  # set on a tensor kept as some NestedTensor's rows (see _with_history)


def _with_history(values: Tensor, offsets, sizes, ragged, env, meta, shared: bool) -> NestedTensor:
    """The NestedTensor ``out`` around ``values``, recorded (:class:`_NestedView`), remembering
    its rows with their history: the next op that reads ``out``'s rows
    (:func:`padless.tensor.core.values_of`) takes them directly, so a chain of row-wise ops
    is one plain autograd graph with no NestedTensor gradient in between.

    Those consumers are then not recorded on ``out``; the gradient *of* ``out`` (asked for by
    ``torch.autograd.grad(..., [out])``, ``backward(inputs=[out])``, ``out.retain_grad()``,
    ``out.register_hook``) is read on its rows instead (:mod:`padless.tensor.grad_rows`).
    That is exact only if nothing but ``out`` holds those rows: everything that reaches them
    passes through ``out`` (its recorded view, or a consumer that took them from ``out``).
    Rows just computed by a handler are such (a new tensor with a new autograd node); a leaf,
    a constructor's argument (``shared``) or rows another NestedTensor already keeps (a handler
    that hands its input's rows back unchanged) are first seen through a view of their own."""
    if torch.compiler.is_compiling():
        return _NestedView.apply(values, offsets, sizes, ragged, env, meta)
    mark = getattr(values, "__dict__", None)
    if shared or values.is_leaf or mark is None or ROWS_MARK in mark:
        values = values.view_as(values)
        mark = values.__dict__
    mark[ROWS_MARK] = True
    if torch._C._are_functorch_transforms_active():
        out = _NestedView.apply(values, offsets, sizes, ragged, env, meta)
    else:  # Function.apply without its functorch bookkeeping (see core._apply)
        out = _NESTED_VIEW_APPLY(values, offsets, sizes, ragged, env, meta)
    out.__dict__["_grad_rows"] = (values, out._values._version)
    return out


# What ``_NestedView.apply`` calls when no functorch transform is active (see core._apply).
_NESTED_VIEW_APPLY = super(torch.autograd.Function, _NestedView).apply  # type: ignore[misc]


def kept_rows(nt: NestedTensor) -> Tensor | None:
    """The rows ``nt`` remembers (:func:`_with_history`), when they still are its rows (not
    written in place since); None otherwise."""
    hit = nt.__dict__.get("_grad_rows")
    if hit is None or hit[1] != nt._values._version:
        return None
    return hit[0]


@lend("guard_broadcast")  # NestedTensor.__torch_function__ calls it; core cannot import this module
def guard_broadcast(args: tuple, kwargs: dict, func=None) -> tuple[tuple, dict]:
    """Give the operands of a broadcasting elementwise call ``func`` a gradient checkpoint.

    First, a dense operand that requires grad and is read in padded coordinates becomes a
    NestedTensor through a gather autograd records (``padded_operands``, lent by
    :mod:`padless.ops.common.padded`), so its gradient is dense and scatters back.

    Autograd only knows padded envelopes: it reduces a broadcast operand's gradient
    (``sum_to_size``) only where the operand's shape differs from the result's. Two cases
    slip through and are routed through identity views here:

    * NestedTensor operands of different structures, broadcast sample by sample (an
      extent 1 meeting 0 or N). Where envelopes agree autograd would hand each operand
      the gradient in the *result's* structure (even to a leaf); where they differ
      without being expandable (``(3, 2)`` against ``(3, 4)`` when a sample broadcasts 1
      to 4) it would refuse it. Each such operand is seen through a view whose ragged
      envelope is the result's; the view's backward (:func:`_conform`) sums the gradient
      back onto the operand's own rows.
    * a dense operand whose shape equals the result's envelope (``(B, 1)`` against
      samples of length at most 1): its gradient would arrive as a NestedTensor. Its view
      sums that gradient over every ragged dim and the broadcast dims instead.

    Operands of one shared structure and no such dense operand (the common case) are
    returned untouched after a few identity and shape tests.
    """
    nts = [a for a in (*args, *kwargs.values()) if isinstance(a, NestedTensor)]
    if not nts:
        return args, kwargs
    if any(isinstance(a, Tensor) and not isinstance(a, NestedTensor) and a.requires_grad for a in (*args, *kwargs.values())):
        args, kwargs = lent("padded_operands")(func, args, kwargs)
        nts = [a for a in (*args, *kwargs.values()) if isinstance(a, NestedTensor)]
    ref = nts[0]
    ndim, b = ref.sample_dim, ref.batch_size
    dense = [
        a for a in (*args, *kwargs.values())
        if isinstance(a, Tensor) and not isinstance(a, NestedTensor) and a.requires_grad and a.dim() == ndim + 1
    ]
    differ = False
    if len(nts) > 1:
        differ = not all(n._meta is ref._meta or _structure_mismatch(ref, n) is None for n in nts[1:])
    if not differ and not dense:
        return args, kwargs
    if any(n.sample_dim != ndim or n.batch_size != b for n in nts):
        return args, kwargs  # the op itself names the mismatch
    if differ:
        out = nts[0].host_sizes()
        for n in nts[1:]:
            out = torch.where(out == 1, n.host_sizes(), out)  # torch's rule, sample by sample
        result_env = out.amax(0).tolist() if b else [0] * ndim
        for d in range(ndim):
            if all(d not in n._ragged for n in nts):
                result_env[d] = max(int(n._env[d]) for n in nts)
    else:
        result_env = [int(e) for e in ref._env]
    result_shape = (b, *result_env)
    ragged = sorted({r for n in nts for r in n._ragged})

    def guard(a):
        if isinstance(a, NestedTensor):
            if not (differ and a.requires_grad):
                return a
            env = tuple(result_env[d] if d in a._ragged else a._env[d] for d in range(ndim))
            view = _apply(_NestedView, values_of(a), a._offsets, a._sizes, a._ragged, env, a._meta)
            view._lineage = a._lineage  # the same samples: the op's result joins the operand's batch
            return view
        if any(a is x for x in dense) and tuple(a.shape) == result_shape:
            return _apply(_DenseOperand, a, tuple(d + 1 for d in ragged))
        return a

    return tuple(guard(a) for a in args), {k: guard(a) for k, a in kwargs.items()}


class _DenseOperand(torch.autograd.Function):
    """Identity on a dense operand of a NestedTensor op; its backward reduces a NestedTensor
    gradient to the operand's shape (every ragged dim, and every dim where it has extent 1)."""

    @staticmethod
    def forward(ctx, d: Tensor, ragged_outer: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        ctx.shape = tuple(d.shape)
        ctx.ragged_outer = ragged_outer
        return d.view_as(d)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        if not isinstance(grad, NestedTensor):
            return grad, None
        dims = sorted({*ctx.ragged_outer, *(i for i, n in enumerate(ctx.shape) if n == 1)})
        red = torch.ops.aten.sum.dim_IntList(grad, dims, True)
        return red.reshape(ctx.shape), None


def split_rows(values: Tensor, offsets: Sequence[int]) -> tuple[Tensor, ...]:
    """Rows of every sample, ``values[offsets[i]:offsets[i + 1]]`` (host offsets, no sync).

    Per-sample loops take their samples through this instead of slicing ``values`` once
    per sample: autograd's backward of a slice allocates a zero gradient the size of the
    *whole* buffer and adds the sample into it (B slices: O(B x T) of ``fill_``/``add_``),
    while the backward of one split is one concatenation of the per-sample gradients: O(T).
    ``offsets`` start at 0 and end at ``values.shape[0]``.
    """
    if len(offsets) <= 1:
        return ()
    counts = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    return torch.split(values, counts)
