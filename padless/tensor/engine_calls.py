"""Autograd-engine calls whose outputs are one of padless's other tensor subclasses.

``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` look for
``__torch_function__`` on their outputs and inputs only. When the output is a dense view of a
NestedTensor (``y[:, -1]``, a :class:`~padless.tensor.views.DenseView`), its packed rows
(``PackedRows``), a pooled map that remembers its batch (``BatchDense``) or the
sequence-first view (``SeqFirstView``), that subclass answers first; if it ran the call below
torch-function dispatch, NestedTensor would never see the NestedTensors among ``inputs``, whose
gradient padless answers on their rows (:mod:`padless.tensor.grad_rows`), and ``h.grad`` (or a
leaf's rows' share of it) would stay empty::

    p = F.adaptive_avg_pool2d(lin(x), 2)        # BatchDense
    p.backward(cot, inputs=[x])                 # x.grad: None before, the gradient now

:func:`call_read_as` is the one mechanism: every such output (and its gradient) is replaced by
the tensor it reads as, attached to the same graph, and the call is made again at torch level,
where NestedTensor answers it when NestedTensors are among ``inputs``. Each subclass registers
how it reads (:func:`reads_as`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import Tensor

#: The torch-level calls that run the autograd engine: (signature, outputs' name, gradients' name).
ENGINE_CALLS: dict[Callable, tuple[inspect.Signature, str, str]] = {
    Tensor.backward: (inspect.signature(Tensor.backward), "self", "gradient"),
    torch.autograd.backward: (inspect.signature(torch.autograd.backward), "tensors", "grad_tensors"),
    torch.autograd.grad: (inspect.signature(torch.autograd.grad), "outputs", "grad_outputs"),
}

#: ``read_as(output, gradient) -> (output, gradient)``: what a subclass output and its
#: gradient (``None`` where none was given) read as; it may raise to refuse a pair.
ReadAs = Callable[[Any, Any], "tuple[Any, Any]"]

#: The subclasses that read as another tensor, and how (:func:`reads_as`).
_READS_AS: dict[type, ReadAs] = {}


def reads_as(cls: type, read_as: ReadAs | None = None) -> None:
    """Register ``cls`` (its instances among an engine call's outputs or gradients are read as
    ``read_as`` says; :func:`plain` by default)."""
    _READS_AS[cls] = plain if read_as is None else read_as


def plain(output: Any, gradient: Any) -> tuple[Any, Any]:
    """The :data:`ReadAs` of a subclass that reads as its plain tensor (``as_subclass(Tensor)``
    stays attached to the graph)."""
    return _as_plain(output), _as_plain(gradient)


def _as_plain(t: Any) -> Any:
    return t.as_subclass(Tensor) if isinstance(t, Tensor) and type(t) is not Tensor else t


def _items(v: Any) -> tuple[list, bool]:
    """``v`` as a list, and whether it was a single value (a tensor, or ``None``)."""
    if v is None or isinstance(v, (Tensor, torch.autograd.graph.GradientEdge)):
        return [v], True
    return list(v), False


def _reading(output: Any, gradient: Any) -> ReadAs | None:
    """The :data:`ReadAs` of a pair: the output's class's, else the gradient's."""
    return _READS_AS.get(type(output)) or _READS_AS.get(type(gradient))


def call_read_as(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` (one of :data:`ENGINE_CALLS`) with every registered subclass (:func:`reads_as`)
    among its outputs and their gradients read as it says, called again at torch level (module
    docstring); ``NotImplemented`` where there is none (the caller goes on as before) or where
    the call does not bind (torch names the mistake). Every such subclass's
    ``__torch_function__`` calls it, and so does NestedTensor's, which answers first when a
    NestedTensor comes first among the outputs."""
    sig, o_name, g_name = ENGINE_CALLS[func]
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    a = bound.arguments
    outs, one = _items(a.get(o_name))
    grads, _ = _items(a.get(g_name))
    if a.get(g_name) is None:
        grads = [None] * len(outs)
    if len(grads) != len(outs) or not any(_reading(o, g) for o, g in zip(outs, grads)):
        return NotImplemented
    pairs = [(r(o, g) if (r := _reading(o, g)) else (o, g)) for o, g in zip(outs, grads)]
    new_outs = [p[0] for p in pairs]
    new_grads = [p[1] for p in pairs]
    a[o_name] = new_outs[0] if one else new_outs
    if a.get(g_name) is not None or any(g is not None for g in new_grads):
        a[g_name] = new_grads[0] if one else new_grads
    return func(*bound.args, **bound.kwargs)


def inputs_of(func: Callable, args: tuple, kwargs: dict) -> list:
    """The tensors ``func`` (one of :data:`ENGINE_CALLS`) differentiates with respect to
    (``inputs``); empty where none are named or the call does not bind."""
    try:
        v = ENGINE_CALLS[func][0].bind(*args, **kwargs).arguments.get("inputs")
    except TypeError:
        return []
    return [] if v is None else _items(v)[0]
