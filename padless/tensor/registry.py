"""Handler registries for the two dispatch layers of :class:`NestedTensor`.

padless intercepts PyTorch at two levels:

* ``__torch_function__`` (Python API level): ops whose meaning depends on the
  ragged structure (reductions, linear, layer_norm, shape ops, attention,
  conversions). Handlers compute on the packed ``values`` with ordinary torch
  ops, so autograd flows through ``values``. Register with :func:`implements`.
* ``__torch_dispatch__`` (ATen level, below autograd): pointwise math, copies,
  moves and the handful of ops the autograd engine itself calls on gradients.
  Register with :func:`implements_aten`.

Registering the same op twice is an error, so two modules can never silently
fight over an op. Each handler declares what it accepts; the table can be
printed with ``python -m padless.ops``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

Handler = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class HandlerInfo:
    """One registered handler: which op, which layer, what it accepts."""

    op: Any
    layer: str  # "function" or "aten"
    handler: Handler
    accepts: str  # human-readable, e.g. "packed", "packed, dense weight"
    module: str


FUNCTION_TABLE: dict[Any, Handler] = {}
ATEN_TABLE: dict[Any, Handler] = {}
# Torch-level callables that are elementwise: when no gradient is needed they run
# straight on ``values`` from ``__torch_function__`` (skipping the ATen round trip).
# Maps callable -> runner(func, args, kwargs).
FAST_POINTWISE: dict[Any, Handler] = {}
_INFO: dict[tuple[str, Any], HandlerInfo] = {}


class RegistrationError(RuntimeError):
    """Raised when an op is registered twice on the same layer."""


_MODULE_ALIASES = {"torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch", "torch._C": "torch"}


def op_name(op: Any) -> str:
    """A readable name for a torch callable or an ATen overload."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None)
    if name is not None and "<locals>" in name:  # e.g. F.max_pool2d, made by torch's boolean_dispatch
        name = getattr(op, "__name__", name)
    if name is None:
        return repr(op)
    name = name.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "")
    if name.startswith("Tensor."):
        return f"torch.{name}"
    mod = getattr(op, "__module__", None) or "torch"
    mod = _MODULE_ALIASES.get(mod, mod)
    return f"{mod}.{name}"


def _register(table: dict, layer: str, ops: Iterable[Any], accepts: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for op in ops:
            if op in table:
                prev = _INFO[(layer, op)]
                raise RegistrationError(
                    f"padless: {op_name(op)} already has a {layer}-level handler "
                    f"({prev.handler.__name__} in {prev.module}); refusing to register "
                    f"{fn.__name__} from {fn.__module__}"
                )
            table[op] = fn
            _INFO[(layer, op)] = HandlerInfo(op, layer, fn, accepts, fn.__module__)
        return fn

    return deco


def implements(*ops: Any, accepts: str = "packed") -> Callable[[Handler], Handler]:
    """Register a ``__torch_function__``-level handler for one or more torch callables.

    The handler is called as ``handler(func, *args, **kwargs)`` with torch-function
    subclass dispatch disabled, so inside it torch ops on plain tensors run normally.
    """
    return _register(FUNCTION_TABLE, "function", ops, accepts)


def implements_aten(*ops: Any, accepts: str = "packed") -> Callable[[Handler], Handler]:
    """Register a ``__torch_dispatch__``-level handler for ATen overloads (or packets)."""
    expanded = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            expanded.extend(getattr(op, o) for o in op.overloads())
        else:
            expanded.append(op)
    return _register(ATEN_TABLE, "aten", expanded, accepts)


_LENT: dict[str, Callable] = {}


def lend(name: str) -> Callable[[Callable], Callable]:
    """A higher layer lends a lower one a function by name, so the dependency arrow points
    one way. The op layer lends the tensor layer (``padless.tensor`` never imports
    ``padless.ops``); inside the tensor layer, autograd, convert and fallback lend
    :mod:`padless.tensor.core` what ``NestedTensor``'s methods call (they import core).

    Lending a different function under a taken name is an error, as for handlers."""

    def deco(fn: Callable) -> Callable:
        old = _LENT.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise RegistrationError(f"lend(): {name!r} is already lent by {old.__module__}.{old.__qualname__}")
        _LENT[name] = fn
        return fn

    return deco


def lent(name: str) -> Callable:
    """The function lent under ``name`` (by the op layer, or by a higher tensor module)."""
    fn = _LENT.get(name)
    if fn is None:
        raise RuntimeError(f"padless: {name!r} comes from the op layer, which is not loaded; import padless first")
    return fn


_GENERIC_CACHE: dict[Any, Any] = {}


def generic_aten_handler(func: Any) -> Handler | None:
    """The handler of an ATen op without its own: the generic pointwise path (lent by
    :mod:`padless.ops.common.engine`) for ops tagged pointwise, else None."""
    hit = _GENERIC_CACHE.get(func, False)
    if hit is not False:
        return hit
    handler = lent("pointwise_aten") if torch.Tag.pointwise in func.tags else None
    _GENERIC_CACHE[func] = handler
    return handler


def registered() -> list[HandlerInfo]:
    """Every registered handler, function layer first, sorted by op name."""
    return sorted(_INFO.values(), key=lambda h: (h.layer != "function", op_name(h.op)))


_WRITES: dict[Any, bool] = {}


def writes_first_arg(func: Any) -> bool:
    """True for an ATen overload that writes its first argument in place (``add_``, ``copy_``)."""
    hit = _WRITES.get(func)
    if hit is None:
        args = getattr(getattr(func, "_schema", None), "arguments", ())
        info = args[0].alias_info if args else None
        hit = _WRITES[func] = bool(info is not None and info.is_write)
    return hit
