"""The gradient of an intermediate NestedTensor whose consumers read its rows directly.

A NestedTensor ``y`` built from rows with history remembers them
(:func:`padless.tensor.autograd._with_history`), and the row-wise ops that consume ``y``
(``y.cos()``, ``y * 2``, ``lin(y)``) take those rows directly: autograd records plain tensor
ops on them, not an op on ``y``. Nothing reaches those rows except through ``y``, so the
gradient of ``y`` *is* the gradient of its rows, in ``y``'s structure. The four ways of asking
for it are answered on the rows::

    y = x * 2                                  rows r = x.rows * 2, y = NestedTensor(r)
    out = y.cos().sum()                        cos recorded on r (not on y)
    torch.autograd.grad(out, [y])              -> NestedTensor(grad of r, y's structure)
    out.backward(inputs=[y])                   -> y.grad, the same
    y.retain_grad(); out.backward()            -> y.grad, the same (a hook on r)
    y.register_hook(fn)                        -> fn(NestedTensor(grad of r)); may return a new one

Once ``y`` was written in place its rows are no longer remembered (their version moved) and
every consumer is recorded on ``y`` itself, as for any tensor: the calls above then go to torch
unchanged. A NestedTensor built without history never takes this path; a leaf's gradient is the
sum of its own and its rows' (:mod:`padless.tensor.leaf_rows`), asked for here together.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from padless.tensor import leaf_rows
from padless.tensor.leaf_rows import as_gradient
from padless.tensor.autograd import _grad_values, kept_rows, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.engine_calls import call_read_as
from padless.tensor.registry import implements, lend

_GRAD = inspect.signature(torch.autograd.grad)
_BACKWARD = inspect.signature(torch.autograd.backward)
_TENSOR_BACKWARD = inspect.signature(torch.Tensor.backward)
_RETAINS = "_padless_retains_grad"  # set on y when its gradient is retained on its rows


def _substitute(inputs: Any) -> tuple[list | None, dict[int, NestedTensor], dict[int, int]]:
    """``inputs`` with every NestedTensor that remembers its rows replaced by those rows, and
    the rows of every leaf read by row-wise ops (:mod:`padless.tensor.leaf_rows`) appended
    (``leaves``: the leaf's index -> its rows' index)."""
    if inputs is None:
        return None, {}, {}
    seq = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    swapped, leaves = {}, {}
    for i, t in enumerate(list(seq)):
        if isinstance(t, NestedTensor) and t.requires_grad:
            rows = kept_rows(t)
            if rows is not None:
                swapped[i] = t
                seq[i] = rows
            elif t.is_leaf and (rows := leaf_rows.pending_rows(t)) is not None:
                leaves[i] = len(seq)
                seq.append(rows)
    return seq, swapped, leaves


_SKIP_ONE_HOP = getattr(torch.overrides, "redispatch_function", None)  # torch >= 2.12


@lend("backward_call")
def backward_call(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` / ``backward`` called with NestedTensors (from
    ``NestedTensor.__torch_function__``).

    The engine runs backward formulas as ATen ops (an op without a handler there runs per
    sample; re-running ``backward`` per sample is wrong). Only this hop is skipped: Python
    backward code (custom Functions, hooks) still sees NestedTensors at torch level; before
    torch 2.12 (no one-hop skip) the whole call runs below it. Intermediates among
    ``inputs`` are answered on their rows first (:func:`grad_through_rows`), and outputs that
    read as another tensor (a sequence-first view after a NestedTensor among the outputs) are
    read so first (:func:`padless.tensor.engine_calls.call_read_as`)."""
    read = call_read_as(func, args, kwargs)
    if read is not NotImplemented:
        return read
    through = grad_through_rows(func, args, kwargs)
    if through is not NotImplemented:
        return through
    if _SKIP_ONE_HOP is not None:
        return _SKIP_ONE_HOP(func, types, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def grad_through_rows(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` / ``backward`` with intermediate NestedTensors among ``inputs``
    (module docstring); ``NotImplemented`` when none of them remembers its rows."""
    sig = _GRAD if func is torch.autograd.grad else _BACKWARD if func is torch.autograd.backward else _TENSOR_BACKWARD
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented  # torch names the mistake
    inputs, swapped, leaves = _substitute(bound.arguments.get("inputs"))
    if not swapped and not leaves:
        return NotImplemented
    if func is torch.autograd.grad:
        if bound.arguments.get("is_grads_batched"):
            if leaves:
                raise NotImplementedError(
                    "torch.autograd.grad(..., is_grads_batched=True) with a leaf NestedTensor among inputs that "
                    "row-wise ops read: not supported; call it once per gradient"
                )
            return NotImplemented
        bound.arguments["inputs"] = inputs
        if leaves:
            return _grad_with_leaves(func, bound, swapped, leaves, len(inputs) - len(leaves))
        grads = list(func(*bound.args, **bound.kwargs))
        for i, nt in swapped.items():
            if grads[i] is not None:
                grads[i] = as_gradient(grads[i], nt)
        return tuple(grads)
    # backward(inputs=...): the rows' .grad is filled, then moved onto the NestedTensor
    rows = {i: inputs[i] for i in swapped}
    before = {i: _grad_of(r) for i, r in rows.items()}
    for r in rows.values():
        r.grad = None
    bound.arguments["inputs"] = inputs
    _below(func, bound) if leaves else func(*bound.args, **bound.kwargs)
    for i, nt in swapped.items():
        g, rows[i].grad = _grad_of(rows[i]), before[i]
        if g is not None:
            _accumulate(nt, g)
    return None


def _below(func: Callable, bound: inspect.BoundArguments) -> Any:
    """``func`` called below ``NestedTensor.__torch_function__`` (a leaf stays among its inputs)."""
    if _SKIP_ONE_HOP is not None:
        return _SKIP_ONE_HOP(func, (NestedTensor,), bound.args, bound.kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*bound.args, **bound.kwargs)


_UNUSED = ("One of the differentiated Tensors appears to not have been used in the graph. "
           "Set allow_unused=True if this is the desired behavior.")


def _grad_with_leaves(func: Callable, bound: inspect.BoundArguments, swapped: dict, leaves: dict, n: int) -> tuple:
    """``torch.autograd.grad`` where a leaf's gradient is the sum of its own (general-path
    consumers) and its rows' (row-wise consumers); ``allow_unused``/``materialize_grads`` are
    applied to the sums."""
    args = bound.arguments
    materialize = bool(args.get("materialize_grads", False))
    allow = args.get("allow_unused")
    allow = materialize if allow is None else allow
    args["allow_unused"], args["materialize_grads"] = True, False
    grads = list(_below(func, bound))
    inputs = args["inputs"]
    for i, nt in swapped.items():
        if grads[i] is not None:
            grads[i] = as_gradient(grads[i], nt)
    for i, j in leaves.items():
        g, r = grads[i], grads[j]
        if r is not None:
            r = as_gradient(r, inputs[i])
            grads[i] = r if g is None else g + r
    out = []
    for i, g in enumerate(grads[:n]):
        if g is None:
            if materialize:
                g = torch.zeros_like(inputs[i])
            elif not allow:
                raise RuntimeError(_UNUSED)
        out.append(g)
    return tuple(out)


def _grad_of(nt: Tensor) -> Tensor | None:
    """``nt.grad`` without torch's warning about reading a non-leaf's unset gradient (the
    gradient is retained here, on the rows, which torch does not know)."""
    with warnings.catch_warnings(), torch._C.DisableTorchFunctionSubclass():
        warnings.simplefilter("ignore", UserWarning)
        return torch.Tensor.grad.__get__(nt)


def _accumulate(nt: NestedTensor, g: Tensor) -> None:
    """``nt.grad += g`` (rows ``g``), as torch accumulates into a retained gradient."""
    new = as_gradient(g, nt)
    old = _grad_of(nt)
    nt.grad = new if old is None else old + new


@implements(torch.Tensor.retain_grad, accepts="NestedTensor (an intermediate's gradient is kept from its rows)")
def retain_grad(func, nt: NestedTensor) -> None:
    rows = kept_rows(nt) if isinstance(nt, NestedTensor) and nt.requires_grad and not nt.is_leaf else None
    if rows is None:
        return func(nt)
    if nt.__dict__.get(_RETAINS):
        return None
    ref = weakref.ref(nt)

    def keep(g: Tensor) -> None:
        y = ref()
        if y is not None:
            _accumulate(y, g.clone())

    rows.register_hook(keep)
    nt.__dict__[_RETAINS] = True
    return None


@implements(torch.Tensor.retains_grad.__get__, accepts="NestedTensor")
def retains_grad(func, nt: NestedTensor) -> bool:
    return bool(nt.__dict__.get(_RETAINS)) or func(nt)


@implements(torch.Tensor.grad.__get__, accepts="NestedTensor (a leaf's includes what its rows gathered)")
def grad(func, nt: NestedTensor) -> Tensor | None:
    if nt.__dict__.get(_RETAINS):
        return _grad_of(nt)
    leaf_rows.fold(nt)
    return func(nt)


@implements(torch.Tensor.grad.__set__, accepts="NestedTensor (a leaf's rows forget what they gathered)")
def set_grad(func, nt: NestedTensor, value) -> None:
    leaf_rows.clear(nt)
    return func(nt, value)


@implements(torch.Tensor.register_hook, accepts="NestedTensor, a hook taking and returning a NestedTensor gradient")
def register_hook(func, nt: NestedTensor, hook: Callable):
    if isinstance(nt, NestedTensor) and nt.is_leaf:
        rows = leaf_rows.pending_rows(nt)
        if rows is None:
            return func(nt, hook)
        # graphs built so far read the rows; later reads go through nt (values_of sees the hook)
        return _Handles(func(nt, hook), rows.register_hook(_on_rows(nt, hook)))
    rows = kept_rows(nt) if isinstance(nt, NestedTensor) and nt.requires_grad else None
    if rows is None or not nt.__dict__.get("_rows_taken"):
        # before any consumer read the rows: a hook on nt itself (its consumers then go through
        # nt, values_of); FSDP2's pre-backward hook on a module's output is such a hook, and put on
        # the rows it left FSDP2's gradients wrong (tests/test_distributed.py)
        return func(nt, hook)
    return rows.register_hook(_on_rows(nt, hook))


class _Handles:
    """Both handles of a hook put on a leaf and on its rows; ``remove()`` removes both."""

    def __init__(self, *handles) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> "_Handles":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _on_rows(nt: NestedTensor, hook: Callable) -> Callable:
    """``hook`` of ``nt``'s gradient as a hook of its rows' gradient."""
    ref = weakref.ref(nt)

    def on_rows(g: Tensor):
        y = ref()
        if y is None:
            return None
        out = hook(as_gradient(g, y))
        if out is None:
            return None
        return values_of(out) if isinstance(out, NestedTensor) else _grad_values(out)

    return on_rows
