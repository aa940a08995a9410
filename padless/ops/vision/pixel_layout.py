"""Ops that extend or rearrange each sample's own pixels: ``F.pad`` (static and ragged dims),
``F.pixel_shuffle`` / ``F.pixel_unshuffle`` and ``F.unfold``.

Each is exactly the dense op on every sample alone. ``pad`` and ``unfold`` batch the
dense work by sample shape (:func:`padless.ops.common.size_groups.apply_by_shape`); the pixel
shuffles of ``(C, H_i, W_i)`` images are one row permutation over the whole batch,
computed once per structure on the host metadata. Layout of ``pixel_shuffle`` with
``r = 2`` on one ``(4, 1, 2)`` image (rows ``p``, ``q``; channels ``0..3``)::

    input rows     p = [p0 p1 p2 p3]   q = [q0 q1 q2 q3]      (H*W, C) = (2, 4)
    output image   p0 p1 q0 q1                                 (C/4, 2H, 2W) = (1, 2, 4)
                   p2 p3 q2 q3
    output rows    [p0] [p1] [q0] [q1] [p2] [p3] [q2] [q3]    (4H*W, C/4)
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure, int_entries
from padless.ops.common.structure import STATIC, keep_all, restructure, values_dim
from padless.ops.common.size_groups import apply_by_shape
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _fmt_shape, _is_traced
from padless.tensor.registry import implements
from padless.tensor.errors import StructureError

__all__ = ["pad", "pad_ragged", "pixel_shuffle", "pixel_unshuffle", "unfold"]


def pad_ragged(nt: NestedTensor, pads: Sequence[int], mode: str = "constant", value: float | None = None) -> NestedTensor:
    """``F.pad`` for pads that touch ragged dims (``F.pad``'s handler sends them here): every
    sample is padded as ``F.pad`` pads it in a dense batch of one, ``(1, *sample)``, so the
    rank rules of torch's non-constant modes (``reflect``, ``replicate``, ``circular`` pad the
    last ``k = len(pads) // 2`` dims of a ``k + 1`` or ``k + 2``-dim input) apply to that
    batch. ``constant`` pads any trailing dims, and negative pads crop. An image too small
    for a reflect pad gets torch's error, naming it."""

    def run(dense: Tensor, key: Hashable) -> Tensor:
        if mode == "constant":
            return F.pad(dense, list(pads), value=0.0 if value is None else value)
        return F.pad(dense, list(pads), mode=mode)

    return apply_by_shape("pad", nt, run)


def _check_std_images(op: str, nt: NestedTensor) -> bool:
    """True for ``(C, H_i, W_i)`` images with a static C and ragged ``(H, W)`` stored row-major,
    the layout the one-permutation path handles; other layouts go by sample shape."""
    if nt.sample_dim < 3:
        raise StructureError(f"{op}(): samples must be (*, C, H, W) with at least 3 dims, got rank {nt.sample_dim} (envelope {tuple(nt.shape)})")
    return nt.sample_dim == 3 and nt._ragged == (1, 2)


def _factor(op: str, name: str, r: int) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"{op}(): {name} must be a positive int, got {r!r}")
    return r


def _shuffle_index(nt: NestedTensor, r: int, up: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Host out sizes, out offsets and the row index on the values' device (cached per structure)."""
    key = ("pixel_shuffle" if up else "pixel_unshuffle", r, nt._values.device)
    hit = nt._meta.derived.get(key)
    if hit is not None:
        return hit
    op = key[0]
    hs, ho = host_structure(nt, op)
    c = nt._values.shape[1]
    out_hs = hs.clone()
    if up:
        out_hs[:, 0] = c // (r * r)
        out_hs[:, 1:] = hs[:, 1:] * r
    else:
        bad = ((hs[:, 1] % r) | (hs[:, 2] % r)).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise StructureError(
                f"{op}(): sample {i} has shape {_fmt_shape(hs[i].tolist())}; its height and width must be "
                f"divisible by downscale_factor={r} (crop or pad it first)"
            )
        out_hs[:, 0] = c * r * r
        out_hs[:, 1:] = hs[:, 1:] // r
    out_ho = layout.offsets_from_counts(layout.row_counts(out_hs, (1, 2)))
    if up:  # out row (y, x) <- sub-row (in row (y//r, x//r), channel block (y%r, x%r))
        sid, (y, x) = layout.row_coords(out_hs, out_ho, (1, 2), int(out_ho[-1]))
        src = ho[:-1][sid] + (y // r) * hs[sid, 2] + x // r
        idx = src * (r * r) + (y % r) * r + x % r
    else:  # (out row, i, j) <- in row (h*r + i, w*r + j)
        sid, (h, w) = layout.row_coords(out_hs, out_ho, (1, 2), int(out_ho[-1]))
        i = torch.arange(r).repeat_interleave(r)
        j = torch.arange(r).repeat(r)
        idx = (ho[:-1][sid, None] + (h[:, None] * r + i) * hs[sid, 2, None] + w[:, None] * r + j).flatten()
    out = (out_hs, out_ho, idx.to(nt._values.device, non_blocking=True))
    if not _is_traced(nt._values):
        nt._meta.derived[key] = out
    return out


@implements(torch.pixel_shuffle, accepts="packed images (*, C, H_i, W_i)")
def pixel_shuffle(func, input: NestedTensor, upscale_factor: int) -> NestedTensor:
    """``F.pixel_shuffle``: ``(C*r*r, H_i, W_i)`` -> ``(C, H_i*r, W_i*r)`` per image, one row
    permutation for the whole batch (other layouts: one dense call per image size)."""
    r = _factor("pixel_shuffle", "upscale_factor", upscale_factor)
    if not _check_std_images("pixel_shuffle", input):
        return apply_by_shape("pixel_shuffle", input, lambda dense, key: F.pixel_shuffle(dense, r))
    c = input._values.shape[1]
    if c % (r * r):
        raise ValueError(f"pixel_shuffle(): the images have {c} channels, which is not divisible by upscale_factor**2 = {r * r}")
    if _is_traced(input._values):  # torch.compile: see padless.ops.vision.compiled
        from padless.ops.vision.traced import traced_shuffle

        return traced_shuffle(input, r, True)
    out_hs, out_ho, idx = _shuffle_index(input, r, True)
    vals = values_of(input)
    sub = vals.reshape(vals.shape[0], c // (r * r), r * r).transpose(1, 2).reshape(-1, c // (r * r))
    return from_host_structure(sub.index_select(0, idx), out_hs, (1, 2), input, out_ho)


@implements(torch.pixel_unshuffle, accepts="packed images (*, C, H_i, W_i)")
def pixel_unshuffle(func, input: NestedTensor, downscale_factor: int) -> NestedTensor:
    """``F.pixel_unshuffle``: ``(C, H_i, W_i)`` -> ``(C*r*r, H_i/r, W_i/r)`` per image; a side
    not divisible by ``r`` raises, naming the image."""
    r = _factor("pixel_unshuffle", "downscale_factor", downscale_factor)
    if not _check_std_images("pixel_unshuffle", input):
        return apply_by_shape("pixel_unshuffle", input, lambda dense, key: F.pixel_unshuffle(dense, r))
    if _is_traced(input._values):  # torch.compile: see padless.ops.vision.compiled
        from padless.ops.vision.traced import traced_shuffle

        return traced_shuffle(input, r, False)
    c = input._values.shape[1]
    out_hs, out_ho, idx = _shuffle_index(input, r, False)
    gathered = values_of(input).index_select(0, idx)
    n = gathered.shape[0] // (r * r)
    out = gathered.reshape(n, r * r, c).transpose(1, 2).reshape(n, c * r * r)
    return from_host_structure(out, out_hs, (1, 2), input, out_ho)


@implements(F.unfold, accepts="packed images (C, H_i, W_i)")
def unfold(func, input: NestedTensor, kernel_size, dilation=1, padding=0, stride=1) -> NestedTensor:
    """``F.unfold`` of every image alone: ``(C, H_i, W_i)`` -> ``(C*kh*kw, L_i)`` sliding blocks,
    ragged along the block dim (one dense call per image size)."""
    if input.sample_dim != 3:
        raise StructureError(f"unfold(): expected images (C, H_i, W_i), got samples of rank {input.sample_dim} (envelope {tuple(input.shape)})")
    return apply_by_shape(
        "unfold", input, lambda dense, key: F.unfold(dense, kernel_size, dilation, padding, stride), out_ragged=(1,)
    )


@implements(F.pad, torch._C._nn.pad, accepts="packed")
def pad(func, nt: NestedTensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> NestedTensor:
    """``F.pad`` of static dims (any mode; modes other than constant act one dim at a time,
    which is what they compute). Pads that touch a ragged dim pad every sample alone, as
    the dense op does (:func:`pad_ragged`: constant, reflect,
    replicate, circular), e.g. a zero or reflect border around every image."""
    pads = int_entries("pad", "pad", pad)
    d = nt.sample_dim
    if len(pads) % 2 or len(pads) // 2 > d:
        raise StructureError(f"pad(): pad {tuple(pads)} must have an even length of at most 2 * {d} (sample dims)")
    dims = keep_all(nt)
    per_dim: dict[int, tuple[int, int]] = {}
    for j in range(len(pads) // 2):
        p, lo, hi = d - 1 - j, pads[2 * j], pads[2 * j + 1]
        if (lo, hi) == (0, 0):
            continue
        if p in nt._ragged:  # each sample padded alone, batched by sample shape
            if _is_traced(nt._values):  # torch.compile: see padless.ops.vision.compiled
                from padless.ops.vision.traced import traced_pad

                return traced_pad(nt, pads, mode, value)
            return pad_ragged(nt, pads, mode, value)
        per_dim[p] = (lo, hi)
    vals = values_of(nt)
    if not per_dim:
        return restructure(nt, vals.clone(), dims)
    if mode == "constant":
        vpad: list[int] = []
        for p in reversed([c for c in range(d) if dims[c][0] == STATIC]):
            vpad += list(per_dim.get(p, (0, 0)))
        vals = F.pad(vals, vpad, value=0.0 if value is None else value)
    else:
        for p, (lo, hi) in per_dim.items():
            v = vals.movedim(values_dim(nt, p), -1)
            lead = v.shape[:-1]
            v = F.pad(v.reshape(-1, 1, v.shape[-1]), (lo, hi), mode=mode)
            vals = v.reshape(*lead, v.shape[-1]).movedim(-1, values_dim(nt, p))
    for p, (lo, hi) in per_dim.items():
        dims[p] = (STATIC, dims[p][1] + lo + hi)
    return restructure(nt, vals, dims)
