"""One dispatch point for every kernel family: the Triton kernel or its torch twin.

Rule (decided at call time, never at import time):

* ``PADLESS_KERNELS=torch`` forces the twins everywhere;
* ``PADLESS_KERNELS=triton`` forces the kernels (on CPU tensors this needs
  ``TRITON_INTERPRET=1``, which runs them in Triton's interpreter: the test mode);
* otherwise (unset or ``auto``): CUDA tensors use the kernel when ``triton`` is
  importable, anything else uses the twin.

A family may also decline inputs it does not cover (an integer dtype, reduced dims
that are not consecutive in storage, ...): the twin runs and the reason is recorded.
:func:`explain` says which implementation ran last for each family, and why::

    >>> from padless.ops.kernels import dispatch
    >>> dispatch.explain()                       # doctest: +SKIP
    {'segment_reduce': Choice(backend='torch', reason='not on CUDA (device cpu)')}
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Union

from torch import Tensor

ENV = "PADLESS_KERNELS"
MODES = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which implementation of a kernel family runs, and why."""

    backend: str  # "triton" or "torch"
    reason: str


_LAST: dict[str, Choice] = {}
_CPU_DEFAULT = Choice("torch", "not on CUDA (device cpu)")


# ``os.environ.get`` of an unset variable raises and catches a KeyError inside ``os``: about
# 1 us per call, paid by every reduction on the CPU path. The environment's own dict (keyed
# by encoded names) answers the same question with one dict lookup; fall back when absent.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if hasattr(os.environ, "encodekey") else None


def _env() -> str | None:
    """``PADLESS_KERNELS`` as set now (None when unset); cheap enough for every call."""
    if _ENV_DATA is not None and _ENV_KEY is not None:
        raw = _ENV_DATA.get(_ENV_KEY)
        return None if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(ENV)


def mode() -> str:
    """The requested mode from ``PADLESS_KERNELS`` (read at every call)."""
    raw = (_env() or "").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(f"{ENV}={raw!r} is not a kernel mode; use one of {', '.join(MODES)} (or leave it unset)")
    return raw


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def triton_missing() -> str | None:
    """None when ``triton`` imports, else why not (imported once, lazily)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"triton is not importable ({type(exc).__name__}: {exc}); install the extra: pip install 'padless[gpu]'"
    return None


Unsupported = Union[str, None, Callable[[], Union[str, None]]]


def choose(family: str, *tensors: Tensor, unsupported: Unsupported = None) -> Choice:
    """Pick the backend of ``family`` for ``tensors`` and record it for :func:`explain`.

    ``unsupported``: why the kernel does not cover these inputs (None when it does), or a
    function returning that, called only when a kernel could otherwise run (so the CPU
    default path never pays for the structure analysis kernels need).
    Raises when ``PADLESS_KERNELS=triton`` asks for a kernel that cannot run.
    """
    if tensors and _env() is None and not tensors[0].is_cuda:
        _LAST[family] = _CPU_DEFAULT  # the common CPU path: no env var, nothing to analyse
        return _CPU_DEFAULT
    m = mode()
    dev = tensors[0].device if tensors else None
    kernel_possible = m == "triton" or (m == "auto" and dev is not None and dev.type == "cuda")
    if kernel_possible and callable(unsupported):
        unsupported = unsupported()
    if m == "torch":
        c = Choice("torch", f"{ENV}=torch")
    elif kernel_possible and unsupported is not None:
        c = Choice("torch", unsupported)
    elif m == "triton":
        missing = triton_missing()
        if missing is not None:
            raise RuntimeError(f"{family}: {ENV}=triton but {missing}")
        if dev is not None and dev.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"{family}: {ENV}=triton with tensors on {dev.type}: Triton kernels need CUDA tensors, "
                "or TRITON_INTERPRET=1 to run them in the CPU interpreter"
            )
        c = Choice("triton", f"{ENV}=triton" + (" (TRITON_INTERPRET=1)" if interpreting() else ""))
    elif dev is None or dev.type != "cuda":
        c = Choice("torch", f"not on CUDA (device {dev.type if dev is not None else 'none'})")
    else:
        missing = triton_missing()
        c = Choice("torch", missing) if missing is not None else Choice("triton", "CUDA tensors and triton importable")
    _LAST[family] = c
    return c


def use_kernel(family: str, *tensors: Tensor, unsupported: Unsupported = None) -> bool:
    """Shorthand: True when :func:`choose` picks the Triton kernel."""
    return choose(family, *tensors, unsupported=unsupported).backend == "triton"


def explain(family: str | None = None) -> dict[str, Choice] | Choice | None:
    """The last choice made for ``family`` (or for every family that ran so far)."""
    if family is not None:
        return _LAST.get(family)
    return dict(_LAST)


def quick_check(*tensors: Tensor) -> bool:
    """Cheap pre-test for call sites: could any kernel run for these tensors?

    False on the CPU default path (no env var, CPU tensors), so twins pay nothing
    for structure analysis that only kernels need.
    """
    m = _env()
    if m == "torch":
        return False
    if m == "triton":
        return True
    return any(t.is_cuda for t in tensors)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch a jitted kernel; through ``wrap_triton`` when compiled code must see it."""
    if not interpreting():
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **meta)
    else:  # the interpreter's InterpretedFunction is not a JITFunction; call it directly
        kernel[grid](*args, **meta)


def jit_kernels(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """Cache ``build(triton, tl)`` per interpreter state (``triton.jit`` decides at decoration)."""

    @functools.lru_cache(maxsize=2)
    def cached(interp: bool) -> Any:
        import triton
        import triton.language as tl

        return build(triton, tl)

    def get() -> Any:
        return cached(interpreting())

    return get


def next_pow2(n: int, lo: int = 1, hi: int = 1 << 30) -> int:
    """Smallest power of two >= n, clamped to [lo, hi] (block sizes are powers of two)."""
    p = lo
    while p < n and p < hi:
        p *= 2
    return p
