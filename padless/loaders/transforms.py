"""Per-sample transforms for the readers' ``transform=`` hook, at each image's native aspect.

A reader applies ``transform`` to every sample in the process that reads it (a
DataLoader worker), after decoding and before collation. It is either a function
of the whole sample dict (returning the new sample), or a ``{field: function}``
dict applied to those fields (:class:`FieldTransforms`)::

    from functools import partial
    reader = WebDatasetReader(shards, fields={"image": "jpg;png", "label": "cls"}, transform={
        "image": Compose(partial(resize_to_budget, patch=16, max_tokens=256), Normalize(MEAN, STD)),
    })

A sampler that budgets tokens must see the sizes after such a resize:
``BudgetBatchSampler(budget_sizes(folder.sizes(), 16, 256), PixelBudget(4096, patch_size=16))``.

Images are ``(C, H, W)``, contiguous or channel-last views (what the readers
decode to); both transforms here keep the input's layout, so a channel-last image
stays channel-last and the collator still packs it with a plain memory copy.

>>> import torch
>>> img = torch.full((3, 100, 300), 255, dtype=torch.uint8)
>>> out = Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])(resize_to_budget(img, 16, 64))
>>> tuple(out.shape), out.dtype, float(out.max())
((3, 64, 224), torch.float32, 1.0)
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor

Transform = Union[Callable[[dict], Any], Mapping[str, Callable[[Any], Any]]]


class Compose:
    """Apply functions in order: ``Compose(f, g)(x) == g(f(x))`` (picklable when the functions are)."""

    def __init__(self, *fns: Callable[[Any], Any]) -> None:
        for i, f in enumerate(fns):
            if not callable(f):
                raise TypeError(f"Compose: argument {i} must be callable, got {type(f).__name__}")
        self.fns = fns

    def __call__(self, x: Any) -> Any:
        for f in self.fns:
            x = f(x)
        return x

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.fns))})"


class FieldTransforms:
    """``{field: function}`` applied to those fields of a sample dict (a new dict is returned).

    >>> FieldTransforms({"x": abs})({"x": -3, "y": 1})
    {'x': 3, 'y': 1}
    """

    def __init__(self, fns: Mapping[str, Callable[[Any], Any]], owner: str = "transform") -> None:
        for k, f in fns.items():
            if not callable(f):
                raise TypeError(f"{owner}: transform for field {k!r} must be callable, got {type(f).__name__}")
        self.fns = dict(fns)

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(sample)
        for k, f in self.fns.items():
            if k not in out:
                raise KeyError(f"transform: field {k!r} is not in the sample (fields: {sorted(out)})")
            out[k] = f(out[k])
        return out

    def __repr__(self) -> str:
        return f"FieldTransforms({self.fns!r})"


def sample_transform(transform: Transform | None, owner: str) -> Callable[[dict], Any] | None:
    """The callable a reader applies to each sample dict, from its ``transform=`` argument."""
    if transform is None:
        return None
    if isinstance(transform, Mapping):
        return FieldTransforms(transform, owner)
    if not callable(transform):
        raise TypeError(
            f"{owner}: transform must be a function of the sample dict or a {{field: function}} dict, "
            f"got {type(transform).__name__}"
        )
    return transform


def apply_transform(transform: Callable[[dict], Any], sample: dict, where: str) -> Any:
    """``transform(sample)``; an exception keeps its type and gains a note naming ``where`` (Python 3.11+)."""
    try:
        return transform(sample)
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"while applying the transform {transform!r} to {where}")
        raise


class Normalize:
    """Per-channel ``(x - mean) / std`` of a ``(C, H, W)`` image, as float32 (``dtype=``).

    Integer images (uint8 from the readers) are first divided by ``scale`` (255 by
    default), so ``mean`` and ``std`` are in ``[0, 1]`` units, as torchvision's;
    float images are used as they are. ``mean``/``std`` hold one value per channel
    (or one for all). The output keeps the input's memory layout: a channel-last
    view gives a channel-last result.

    >>> import torch
    >>> x = torch.tensor([[[0, 255]], [[51, 102]]], dtype=torch.uint8)  # (2, 1, 2)
    >>> Normalize([0.5, 0.2], [0.5, 0.1])(x).tolist()
    [[[-1.0, 1.0]], [[0.0, 2.0]]]
    """

    def __init__(
        self, mean: Sequence[float] | float, std: Sequence[float] | float, *, scale: float = 255.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        m = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        s = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if m.numel() == 0 or s.numel() == 0:
            raise ValueError("Normalize: mean and std need at least one value")
        if m.numel() != s.numel() and 1 not in (m.numel(), s.numel()):
            raise ValueError(f"Normalize: mean has {m.numel()} values and std {s.numel()}; give one per channel (or one)")
        if not (torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(m).all()):
            raise ValueError(f"Normalize: std must be finite and > 0 and mean finite, got mean={m.tolist()} std={s.tolist()}")
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
            raise ValueError(f"Normalize: scale must be a number > 0, got {scale!r}")
        if not dtype.is_floating_point:
            raise TypeError(f"Normalize: dtype must be a floating dtype, got {dtype}")
        self.mean, self.std, self.scale, self.dtype = m, s, float(scale), dtype

    def __call__(self, img: Tensor) -> Tensor:
        if not isinstance(img, Tensor) or img.dim() != 3:
            got = f"shape {tuple(img.shape)}" if isinstance(img, Tensor) else type(img).__name__
            raise ValueError(f"Normalize: expected a (C, H, W) image tensor, got {got}")
        c = img.shape[0]
        n = max(self.mean.numel(), self.std.numel())
        if n != 1 and n != c:
            raise ValueError(f"Normalize: the image has {c} channels but mean/std hold {n} values")
        # the same arithmetic as torchvision's to_tensor + normalize: (x / 255 - mean) / std
        x = img.to(self.dtype, copy=True)
        if not img.dtype.is_floating_point:
            x.div_(self.scale)
        mean = self.mean.to(self.dtype).reshape(-1, 1, 1).to(x.device)
        std = self.std.to(self.dtype).reshape(-1, 1, 1).to(x.device)
        return x.sub_(mean).div_(std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()})"


def budget_size(
    h: int, w: int, patch: int, max_tokens: int, *, max_upsample: float | None = 1.0
) -> tuple[int, int]:
    """The largest ``(H, W)`` at the aspect of an ``h x w`` image whose patch grid fits ``max_tokens``.

    The image is scaled by the largest ``s`` such that the grid
    ``(max(1, floor(h*s/patch)), max(1, floor(w*s/patch)))`` has at most
    ``max_tokens`` patches and ``s <= max_upsample`` (``None``: no cap); the size is
    that grid times ``patch``, so both sides are multiples of the patch and the
    aspect is kept to within one patch per side. Every side gets at least one
    patch (an image smaller than a patch is upsampled to one).

    >>> budget_size(480, 640, 16, 256)                     # 14 x 18 = 252 patches
    (224, 288)
    >>> budget_size(20, 30, 16, 256)                       # no upsampling by default
    (16, 16)
    >>> budget_size(20, 30, 16, 256, max_upsample=None)    # 13 x 19 = 247 patches
    (208, 304)
    >>> budget_size(20, 30, 16, 256, max_upsample=4.0)     # 80 x 120 at most: 5 x 7 patches
    (80, 112)
    """
    for name, v in (("h", h), ("w", w), ("patch", patch), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"budget_size: {name} must be an int >= 1, got {v!r}")
    if max_upsample is not None and (isinstance(max_upsample, bool) or not isinstance(max_upsample, (int, float))
                                     or not math.isfinite(max_upsample) or max_upsample <= 0):
        raise ValueError(f"budget_size: max_upsample must be a finite number > 0 or None, got {max_upsample!r}")
    cap = Fraction(max_upsample) if max_upsample is not None else None

    def best(side: int, other: int) -> tuple[int, int, Fraction] | None:
        """The largest k patches along ``side`` that fits (the scale is then ``k * patch / side``)."""
        def grid(k: int) -> tuple[int, int]:
            return k, max(1, other * k // side)

        hi = max_tokens if cap is None else min(max_tokens, math.floor(cap * side / patch))
        lo = 0  # the largest k known to fit (0: none)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            a, b = grid(mid)
            if a * b <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return (*grid(lo), Fraction(lo * patch, side)) if lo else None

    candidates = [(1, 1, Fraction(0))]
    by_h = best(h, w)
    if by_h is not None:
        candidates.append(by_h)
    by_w = best(w, h)
    if by_w is not None:
        candidates.append((by_w[1], by_w[0], by_w[2]))
    gh, gw, _ = max(candidates, key=lambda c: c[2])
    return gh * patch, gw * patch


def budget_sizes(sizes: Any, patch: int, max_tokens: int, *, max_upsample: float | None = 1.0) -> np.ndarray:
    """:func:`budget_size` of every ``(H, W)`` row: the sizes a sampler should see when a
    reader's transform resizes to a token budget (``ImageFolder.sizes()`` are the sizes before it).

    >>> budget_sizes([(480, 640), (20, 30)], 16, 256).tolist()
    [[224, 288], [16, 16]]
    """
    arr = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    out = np.empty_like(arr)
    for i, (h, w) in enumerate(arr.tolist()):
        out[i] = budget_size(h, w, patch, max_tokens, max_upsample=max_upsample)
    return out


def resize_to_budget(
    img: Tensor, patch: int, max_tokens: int, *, max_upsample: float | None = 1.0, mode: str = "bilinear",
    antialias: bool = True,
) -> Tensor:
    """Resize a ``(C, H, W)`` image to :func:`budget_size` (same dtype, same memory layout).

    ``mode`` and ``antialias`` are those of ``torch.nn.functional.interpolate``; an
    image already at its budget size is returned as it is.

    >>> import torch
    >>> resize_to_budget(torch.zeros(3, 480, 640, dtype=torch.uint8), 16, 256).shape
    torch.Size([3, 224, 288])
    """
    if not isinstance(img, Tensor) or img.dim() != 3:
        got = f"shape {tuple(img.shape)}" if isinstance(img, Tensor) else type(img).__name__
        raise ValueError(f"resize_to_budget: expected a (C, H, W) image tensor, got {got}")
    _, h, w = img.shape
    if h == 0 or w == 0:
        raise ValueError(f"resize_to_budget: the image has an empty side ({h}x{w}); there is no aspect to keep")
    th, tw = budget_size(h, w, patch, max_tokens, max_upsample=max_upsample)
    if (th, tw) == (h, w):
        return img
    x = img[None]
    channel_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    fmt = torch.channels_last if channel_last else torch.contiguous_format
    kw: dict[str, Any] = {"antialias": antialias, "align_corners": False} if mode in ("bilinear", "bicubic") else {}
    if img.dtype == torch.uint8 and mode in ("bilinear", "nearest", "nearest-exact") or img.dtype.is_floating_point:
        out = torch.nn.functional.interpolate(x, size=(th, tw), mode=mode, **kw)
    else:  # other dtypes: resample in float
        out = torch.nn.functional.interpolate(x.float(), size=(th, tw), mode=mode, **kw)
        out = out.round_().clamp_(*_range(img.dtype)).to(img.dtype)
    return out.contiguous(memory_format=fmt)[0]


def _range(dtype: torch.dtype) -> tuple[float, float]:
    info = torch.iinfo(dtype)
    return float(info.min), float(info.max)
