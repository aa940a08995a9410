"""The sequence-first view ``x.transpose(0, 1)`` of a NestedTensor.

A NestedTensor's batch dim is always its first dim, but code written for sequence-first
models holds ``(T, B, E)`` tensors: ``batch_first=True`` modules (``nn.MultiheadAttention``,
the Transformer layers) transpose their inputs with ``x.transpose(1, 0)``, and fairseq-style
models run their whole encoder sequence-first. The transpose handler of the rows family
returns a :class:`SeqFirstView`: the same batch read with two dims swapped. Row-wise ops
(linear, layer norm, dropout, activations, residual adds of two views), reductions over time
or features, ``cat``, and the reshapes that fold heads into the batch run on it as on the
batch (:mod:`padless.ops.common.seq_first_ops`); the ops in :data:`SEQ_FIRST_OPS` take it
(``F.multi_head_attention_forward`` and the recurrent
kernels ``nn.LSTM``/``nn.GRU``/``nn.RNN`` call with ``batch_first=False``: their families'
handlers, reached through the registry); ``.transpose(0, 1)`` gives
the batch back. Anything else raises, naming the op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common import seq_first_ops
from padless.tensor.core import NestedTensor
from padless.tensor.engine_calls import ENGINE_CALLS, call_read_as, inputs_of, reads_as
from padless.tensor.registry import FUNCTION_TABLE


#: Metadata reads a SeqFirstView answers about its padded envelope (torch.compile asks for them
#: when it records the view; they describe the wrapper, never touch data).
_METADATA = frozenset(
    ("__get__", "dim", "size", "stride", "storage_offset", "is_contiguous", "ndimension", "nelement", "numel")
)


#: Torch callables that take a sequence-first view: the view goes to the op's registered handler
#: (a family adds its ops with :func:`takes_seq_first`; the handler unwraps the view).
SEQ_FIRST_OPS: set = {F.multi_head_attention_forward}


def takes_seq_first(*funcs: Any) -> None:
    """Route ``funcs`` called on a :class:`SeqFirstView` to their registered handlers."""
    SEQ_FIRST_OPS.update(funcs)


class SeqFirstView(Tensor):
    """``x.transpose(0, 1)`` of a NestedTensor: envelope ``(L, B, ...)``, for attention modules."""

    _nt: NestedTensor

    @staticmethod
    def __new__(cls, nt: NestedTensor) -> "SeqFirstView":
        env = nt._env
        shape = (env[0], nt.batch_size, *env[1:])
        self = Tensor._make_wrapper_subclass(cls, shape, dtype=nt.dtype, device=nt.device, requires_grad=nt.requires_grad)
        self._nt = nt
        return self

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SeqFirstView(envelope={tuple(self.shape)}) of {self._nt!r}"

    # torch.compile: the view is a traceable wrapper around its NestedTensor (nothing static).
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_nt"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: None, outer_size, outer_stride) -> "SeqFirstView":
        return SeqFirstView(inner["_nt"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes):
            dims = sorted(d % 3 if d < 0 else d for d in args[1:3]) if len(args) >= 3 else None
            if dims == [0, 1]:
                return args[0]._nt
        if func in (torch.Tensor.permute, torch.permute):
            perm = args[1:] if len(args) > 2 or not isinstance(args[1], (tuple, list)) else args[1]
            n = args[0].dim()
            perm = [p % n for p in perm]
            if perm[:2] == [1, 0]:
                return args[0]._nt.permute(0, 1, *perm[2:])
        if func in ENGINE_CALLS:
            return _engine_call(func, args, kwargs)
        if func in SEQ_FIRST_OPS:
            # The family's handler, reached through the registry (no family import).
            return FUNCTION_TABLE[func](func, *args, **kwargs)
        if name in _METADATA or func in (torch.Tensor.is_floating_point,):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if seq_first_ops.handles(func):
            return seq_first_ops.run(func, args, kwargs, SeqFirstView, SeqFirstView)
        raise RuntimeError(
            f"padless: {name or func}() on a sequence-first view of a NestedTensor (x.transpose(0, 1)) has no "
            "rule: row-wise ops, elementwise ops, reductions over time or features, cat and the reshapes that "
            "fold heads into the batch run on it (padless.ops.common.seq_first_ops). Transpose it back with "
            ".transpose(0, 1) and write the op on the batch."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"padless: {func} on a sequence-first view of a NestedTensor; transpose it back first")


def _engine_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.backward`` / ``torch.autograd.backward`` / ``grad`` of a sequence-first view: the
    call on the NestedTensor it views, with the gradient's view read the same way
    (:mod:`padless.tensor.engine_calls`)."""
    name = getattr(func, "__qualname__", func)
    if any(isinstance(t, SeqFirstView) for t in inputs_of(func, args, kwargs)):
        raise TypeError(
            f"padless: {name}(): a sequence-first view (x.transpose(0, 1)) among inputs; it is a view read as the "
            "batch, not a tensor of the graph: ask for the gradient of the NestedTensor it views and transpose that "
            "(torch.autograd.grad(out, [x])[0].transpose(0, 1))"
        )
    out = call_read_as(func, args, kwargs)
    if out is NotImplemented:  # the call does not bind: torch names the mistake
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return out


def _read_as_batch(output: Any, gradient: Any) -> tuple[Any, Any]:
    """An output and its gradient, both sequence-first views, as their NestedTensors."""
    if isinstance(output, SeqFirstView) and (gradient is None or isinstance(gradient, SeqFirstView)):
        return output._nt, None if gradient is None else gradient._nt
    if isinstance(output, SeqFirstView):
        raise TypeError(
            "padless: the gradient of a sequence-first view (y.transpose(0, 1)) is a sequence-first view too, got "
            f"{type(gradient).__name__} of shape {tuple(gradient.shape)}: pass g.transpose(0, 1) of a NestedTensor g "
            "of the batch's structure (or call backward on the batch, y.transpose(0, 1))"
        )
    raise TypeError(
        f"padless: a sequence-first view (g.transpose(0, 1)) given as the gradient of a {type(output).__name__} "
        f"of shape {tuple(output.shape)}: the gradient of a NestedTensor is a NestedTensor (pass g, not its view)"
    )


reads_as(SeqFirstView, _read_as_batch)


def unwrap_seq_first(x: Any) -> Any:
    """The NestedTensor behind a :class:`SeqFirstView`; anything else as it is."""
    return x._nt if isinstance(x, SeqFirstView) else x
