"""Arguments of window ops (kernel, stride, padding, dilation) as the spatial plans read them:
pairs, ``(top, bottom, left, right)`` paddings, a convolution's ``'same'``/``'valid'``.
Errors name the op and the argument."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["conv_padding", "to_padding", "to_pair"]

Pair = tuple[int, int]


def to_pair(op: str, name: str, v: Any, *, minimum: int = 1) -> Pair:
    """An int or a 2-sequence of ints ``>= minimum`` as a pair (errors name the op and argument)."""
    t = (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list, torch.Size)) else None
    if t is not None and len(t) == 1:
        t = (t[0], t[0])
    if t is None or len(t) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in t):
        raise ValueError(f"{op}(): {name} must be an int >= {minimum} or a pair of them, got {v!r}")
    return t  # type: ignore[return-value]


def to_padding(op: str, v: Any) -> tuple[int, int, int, int]:
    """``p``, ``(ph, pw)`` or ``(top, bottom, left, right)`` as ``(top, bottom, left, right)``."""
    if isinstance(v, (tuple, list)) and len(v) == 4 and all(isinstance(x, int) and x >= 0 for x in v):
        return tuple(v)  # type: ignore[return-value]
    ph, pw = to_pair(op, "padding", v, minimum=0)
    return (ph, ph, pw, pw)


def conv_padding(op: str, padding: Any, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    """A convolution's ``padding`` (``'same'``, ``'valid'``, an int or a pair) as ``(top, bottom, left, right)``."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        if stride != (1, 1):
            raise ValueError(f"{op}(): padding='same' is not supported for strided convolutions (stride {stride})")
        pads = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)  # type: ignore[return-value]
    if isinstance(padding, str):
        raise ValueError(f"{op}(): padding must be 'same', 'valid', an int or a pair of ints, got {padding!r}")
    return to_padding(op, padding)
