"""The sequence-first view ``x.transpose(0, 1)`` of a NestedTensor, for attention modules.

A NestedTensor has no padded "sequence-first" layout, but ``batch_first=True`` modules
(``nn.MultiheadAttention``, the Transformer layers) transpose their inputs with
``x.transpose(1, 0)`` before the attention call. The transpose handler of the rows family
returns a :class:`SeqFirstView`: a thin wrapper that only supports being transposed back
and being passed to the ops listed in :data:`SEQ_FIRST_OPS` (``F.multi_head_attention_forward``,
and the recurrent kernels ``nn.LSTM``/``nn.GRU``/``nn.RNN`` call with ``batch_first=False``):
their families' handlers, reached through the registry. Anything else raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.tensor.core import NestedTensor
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
        if func in SEQ_FIRST_OPS:
            # The family's handler, reached through the registry (no family import).
            return FUNCTION_TABLE[func](func, *args, **kwargs)
        if name in _METADATA or func in (torch.Tensor.is_floating_point,):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(
            f"padless: {name or func}() on a sequence-first view of a NestedTensor (x.transpose(0, 1)); "
            "such a view only exists to feed attention and recurrent modules. Transpose it back with .transpose(0, 1)."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"padless: {func} on a sequence-first view of a NestedTensor; transpose it back first")


def unwrap_seq_first(x: Any) -> Any:
    """The NestedTensor behind a :class:`SeqFirstView`; anything else as it is."""
    return x._nt if isinstance(x, SeqFirstView) else x
