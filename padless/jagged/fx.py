"""``torch.fx`` symbolic tracing of the jagged types, the way TorchRec's are traced.

Under ``torch.fx.symbolic_trace`` a module may take a ``JaggedTensor`` /
``KeyedJaggedTensor`` / ``KeyedTensor`` (its methods become ``call_method`` nodes, as for
any input), build one from traced tensors and return it, or call the static helpers
(``from_dense_lengths``, ``concat``, ``empty_like``, ``regroup``, ...) on traced inputs:

* a static helper decorated with ``@leaf`` becomes one ``call_function`` node when a
  Proxy is among its arguments (what ``torch.fx.wrap`` does for a module-level function);
  eagerly it costs one flag test;
* a constructor given traced tensors becomes one ``call_function`` node of the class, and
  the object it returns *stands in* for that node: every attribute it is asked for is the
  node's (``out.stride()`` is a ``call_method`` node), and ``__fx_create_arg__`` hands the
  node to whatever takes the object as an argument or returns it.

Nothing here runs in eager code: the constructors reach ``stand_in`` only on the path where
``values`` is not a tensor, which used to be an error. TorchRec gets the same behaviour from
a metaclass (``ProxyableClassMeta``), which costs every construction a python-level call.

TorchScript is not supported, and ``torch.jit.trace`` is refused (:func:`refuse_jit_trace`):
a trace records the host-side offsets and per-key lengths of the example batch as
constants, so the traced function would return that batch's structure for every other one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.fx._symbolic_trace as _st
from torch.fx import Proxy
from torch.fx.node import map_aggregate

F = TypeVar("F", bound=Callable[..., Any])

_PROXY_SLOT = "_values"  # a stand-in keeps the node's Proxy in this slot (every jagged type has it)
_OWN = frozenset({"__class__", "__fx_create_arg__", "__repr__", "__str__", "__len__", "__iter__", "__bool__"})


class _StandIn:
    """Mixin of the stand-in classes: attribute reads go to the node's Proxy."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, _PROXY_SLOT), name)

    def __fx_create_arg__(self, tracer: Any) -> Any:
        return object.__getattribute__(self, _PROXY_SLOT).node

    def __repr__(self) -> str:
        cls = type(self).__mro__[2].__name__
        return f"{cls}(traced: {object.__getattribute__(self, _PROXY_SLOT).node.name})"

    __str__ = __repr__

    def __len__(self) -> int:
        raise TypeError(
            f"len() of a traced {type(self).__mro__[2].__name__} is not known while tracing; "
            "use len(x.keys()) / x.lengths().numel() in traced code, as with TorchRec"
        )

    def __iter__(self) -> Any:
        raise TypeError(f"a traced {type(self).__mro__[2].__name__} cannot be iterated while tracing")

    def __bool__(self) -> bool:
        return True


@functools.lru_cache(maxsize=None)
def _stand_in_class(cls: type) -> type:
    # same slots as ``cls`` (no new ones), so an instance of ``cls`` can take this class
    return type(f"Traced{cls.__name__}", (_StandIn, cls), {"__slots__": (), "__module__": cls.__module__})


def _first_proxy(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Proxy | None:
    found: list[Proxy] = []

    def look(a: Any) -> Any:
        if not found:
            if isinstance(a, Proxy):
                found.append(a)
            elif isinstance(a, _StandIn):
                found.append(object.__getattribute__(a, _PROXY_SLOT))
        return a

    map_aggregate(tuple(args), look)
    map_aggregate(dict(kwargs), look)
    return found[0] if found else None


def stand_in(obj: Any, cls: type, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Called by a constructor whose ``values`` is not a tensor: under symbolic tracing, with
    a Proxy among ``args``/``kwargs``, record ``cls(*args, **kwargs)`` as a node, turn ``obj``
    into its stand-in and return True; otherwise return False (the caller raises its error)."""
    if not _st.is_fx_symbolic_tracing():
        return False
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return False
    node = proxy.tracer.create_proxy("call_function", cls, tuple(args), dict(kwargs))
    obj.__class__ = _stand_in_class(cls)
    object.__setattr__(obj, _PROXY_SLOT, node)
    return True


def refuse_jit_trace(what: str) -> None:
    """Raise under ``torch.jit.trace`` (called where JaggedTensor / KeyedJaggedTensor objects
    are built): a never-wrong error instead of a trace that bakes in one batch's offsets."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{what}: torch.jit.trace is not supported: the trace would record this batch's host-side "
            "offsets and lengths as constants and return them for every other batch. Trace with "
            "torch.fx.symbolic_trace (or TorchRec's tracer), or compile with torch.compile; "
            "TorchScript is not supported either"
        )


def leaf(fn: F) -> F:
    """Under symbolic tracing, a call with a Proxy (or a traced jagged type) among its
    arguments becomes one ``call_function`` node of ``fn``; otherwise ``fn`` runs."""

    @functools.wraps(fn)
    def traced_or_run(*args: Any, **kwargs: Any) -> Any:
        if _st.is_fx_symbolic_tracing():
            proxy = _first_proxy(args, kwargs)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)

    return traced_or_run  # type: ignore[return-value]
