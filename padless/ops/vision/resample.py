"""``F.interpolate`` on images at their own resolution (``nn.Upsample`` included).

Samples are ``(C, *spatial)`` with 1 to 3 spatial dims, as ``F.interpolate`` expects
without its batch dim: ``(C, L_i)``, ``(C, H_i, W_i)`` (ragged dims ``(1, 2)``) or
``(C, D_i, H_i, W_i)``. Every image is resampled exactly as ``F.interpolate`` resamples
it alone (same mode, ``align_corners``, ``antialias``, scale handling). The dense work
is batched by :func:`padless.ops.common.size_groups.apply_by_shape`: images of one size (and one
target size) go through one ``F.interpolate`` call, and no padded envelope is built.

Measured alternative (``benchmarks/resample.py``, 12 images of sides 48..216, one CPU
thread): gathering every output pixel's source rows for the whole batch with host index
arithmetic (one gather per axis, no loop) was 4.4x and 5.5x slower than these grouped calls for
bilinear forward + backward (the gather's backward is an ``index_add``) and no faster for
nearest, so the grouped calls stay; they beat the per-image loop and the padded batch.
The exception is nearest upsampling by a power of two per axis (``scale_factor=2``, a U-Net
decoder's ``size=skip.shape[2:]``): the source pixel is then exactly ``(y // k_h, x // k_w)``, one
gather of whole rows with indices cached on the structure, and the gradient gathers every input
pixel's ``k_h * k_w`` copies and sums them. Measured (one CPU thread, loaded machine): in a profile of
smp's U-Net train step (8 images 64..224) the five upsamplings took ~20 ms instead of ~30 ms (the
grouped path copied strided gradients); alone, forward + backward of 8 such images at strides 2 to 32
(32 to 512 channels), the gather took 0.45-0.96x the grouped calls' time (runs vary by ~20%).

The output size is given as in torch, or per image:

* ``scale_factor=s`` (or a tuple): each image becomes ``floor(H_i * s)`` and so on;
* ``size=(h, w)``: every image becomes ``(h, w)`` (the result stays a NestedTensor with
  the same ragged dims, as a declared ragged dim stays ragged);
* ``size=[(h_0, w_0), (h_1, w_1), ...]``: one target per image (a list of B tuples, or a
  CPU int tensor ``(B, k)``);
* ``size=other_nested_tensor``: the target of image i is the last ``k`` sample dims of
  ``other``'s sample i, e.g. ``F.interpolate(logits, size=images, mode="bilinear")``
  brings segmentation logits back to every image's own size;
* ``size=skip.shape[2:]`` (or ``(h, w)`` unpacked from it), with ``skip`` a NestedTensor of the
  same batch: the entries of a NestedTensor's shape at ragged dims remember each sample's
  own size (:mod:`padless.tensor.extents`), so image i goes to ``skip``'s image i, as the
  dense code does per image (smp's U-Net decoder is written this way). ``int(h)`` gives every
  image the envelope size instead.

>>> x = padless.from_list([torch.randn(3, 5, 7), torch.randn(3, 4, 4)])
>>> y = F.interpolate(x, scale_factor=2, mode="bilinear")       # (3, 10, 14), (3, 8, 8)
>>> z = F.interpolate(y, size=x, mode="bilinear", antialias=True)  # back to (3, 5, 7), (3, 4, 4)
"""

from __future__ import annotations

import operator
from typing import Any, Hashable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure
from padless.ops.common.size_groups import apply_by_shape
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _is_traced
from padless.tensor.errors import StructureError
from padless.tensor.extents import Extent, per_sample_extents
from padless.tensor.registry import implements

__all__ = ["interpolate", "per_image_sizes"]


def _spatial_rank(op: str, x: NestedTensor) -> int:
    k = x.sample_dim - 1
    if k not in (1, 2, 3):
        raise StructureError(
            f"{op}(): samples must be (C, *spatial) with 1 to 3 spatial dims, as F.interpolate expects "
            f"without its batch dim; got samples of rank {x.sample_dim} (envelope {tuple(x.shape)})"
        )
    return k


def _int(op: str, what: str, v: Any) -> int:
    try:
        if isinstance(v, (bool, float)):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{op}(): {what} must hold ints, got {v!r}") from None


SIZE_REWRITE = " (or pass size=other, a NestedTensor, to bring every image to the size of the same sample of other)"


def per_image_sizes(op: str, size: Any, input: Any, k: int) -> list[tuple[int, ...]] | None:
    """The per-image target sizes ``size`` names, or ``None`` when it is one size for all.

    Per-image forms: a NestedTensor (its last ``k`` sample dims), a CPU int tensor
    ``(B, k)``, a list/tuple of ``B`` sequences of ``k`` ints, or ``k`` ints read from a
    NestedTensor's shape (:class:`padless.tensor.extents.Extent`: each image gets its own
    sample's size there; plain ints give every image the same size). ``input`` is the batch
    the sizes apply to: sizes read from another batch's shape are refused.
    """
    batch = input.batch_size
    if isinstance(size, NestedTensor):
        if size.batch_size != batch:
            raise StructureError(
                f"{op}(): size is a NestedTensor of {size.batch_size} samples, the input has {batch}; "
                "size=other takes every image's target from the same sample of other"
            )
        if size.sample_dim < k:
            raise StructureError(f"{op}(): size is a NestedTensor of rank-{size.sample_dim} samples; it needs at least {k} dims to give a {k}-d size")
        return [tuple(r) for r in host_structure(size, op)[0][:, size.sample_dim - k :].tolist()]
    if isinstance(size, Tensor):
        if size.dim() != 2 or size.shape != (batch, k) or size.is_floating_point() or size.device.type != "cpu":
            raise ValueError(
                f"{op}(): a tensor size must be a CPU int tensor (B, {k}) = ({batch}, {k}) of per-image targets, "
                f"got shape {tuple(size.shape)}, dtype {size.dtype} on {size.device}"
            )
        return [tuple(r) for r in size.tolist()]
    if isinstance(size, (list, tuple)) and size and all(isinstance(s, (list, tuple, torch.Size)) for s in size):
        if len(size) != batch:
            raise ValueError(f"{op}(): size lists {len(size)} per-image targets for a batch of {batch} images; give one per image")
        out = []
        for i, s in enumerate(size):
            if len(s) != k:
                raise ValueError(f"{op}(): the target size of image {i} is {tuple(s)}; it needs {k} entries (one per spatial dim)")
            out.append(tuple(_int(op, "size", v) for v in s))
        return out
    if isinstance(size, Extent):  # one extent read from a shape: every spatial dim, per image
        size = (size,) * k
    if isinstance(size, (list, tuple)) and len(size) == k:
        # ``size=skip.shape[2:]``: entries read from a NestedTensor's shape name each image's
        # own size (padless.tensor.extents), as the dense code does for each image alone
        return per_sample_extents(size, input, op, SIZE_REWRITE)
    return None


@implements(F.interpolate, accepts="packed (C, *spatial) images; size: ints, per-image list/tensor, or a NestedTensor to match")
def interpolate(
    func,
    input: NestedTensor,
    size: Any = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> NestedTensor:
    """``F.interpolate`` of every image at its own size (see the module docstring for ``size``).

    Exactly the dense op on each image alone, forward and backward; images of one size
    (and one target) share one dense call. A target of 0 pixels or an empty image raises
    torch's error for that image, naming it.
    """
    k = _spatial_rank("interpolate", input)
    if _is_traced(input._values):  # torch.compile: see padless.ops.vision.compiled
        from padless.ops.vision.traced import traced_interpolate

        if size is not None and scale_factor is not None:
            raise ValueError("interpolate(): only one of size or scale_factor should be defined")
        return traced_interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    targets = per_image_sizes("interpolate", size, input, k)
    if targets is not None and scale_factor is not None:
        raise ValueError("interpolate(): only one of size or scale_factor should be defined")
    if mode in ("nearest", "nearest-exact") and not antialias and align_corners is None:
        out = _nearest_by_rows(input, size, scale_factor, targets)
        if out is not None:
            return out
    kw = dict(mode=mode, align_corners=align_corners, antialias=antialias)

    def run(dense: Tensor, key: Hashable) -> Tensor:
        if antialias:  # torch's antialiased kernels misread channels-last inputs with a side of 1 (torch 2.13)
            dense = dense.contiguous()
        if targets is not None:
            return F.interpolate(dense, size=key, **kw)
        return F.interpolate(dense, size=size, scale_factor=scale_factor, recompute_scale_factor=recompute_scale_factor, **kw)

    return apply_by_shape("interpolate", input, run, keys=targets)


# ------------------------------------------------------------ nearest, whole multiples


def _nearest_by_rows(x: NestedTensor, size: Any, scale_factor: Any, targets: list | None) -> NestedTensor | None:
    """Nearest upsampling of images ``(C, H_i, W_i)`` by a power of two per axis (``scale_factor=2``,
    ``size=skip.shape[2:]`` of a U-Net decoder) as one gather of whole rows: output pixel ``(y, x)``
    of image i is input pixel ``(y // k_h, x // k_w)``. For such factors torch's source index
    (``floor(y * in / out)``, ``nearest-exact``: ``floor((y + 0.5) * in / out)``) is exactly that, the
    float scale being a power of two. The gradient gathers every input pixel's ``k_h * k_w`` copies
    and sums them (no scatter). ``None``: other factors, layouts or sizes (the grouped dense calls).
    """
    if x.sample_dim != 3 or x._ragged != (1, 2) or x._values.dim() != 2 or x.batch_size == 0:
        return None
    if not (x._values.is_floating_point() or x._values.dtype == torch.uint8):
        return None  # the dtypes torch's nearest kernels take (others keep torch's error)
    hs, ho = host_structure(x, "interpolate")
    hw = hs[:, 1:].tolist()
    if targets is None:
        if size is not None:
            if isinstance(size, (list, tuple)) and len(size) == 2:
                one = tuple(size)
            elif isinstance(size, (list, tuple)):
                return None
            else:
                one = (size, size)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in one):
                return None
            targets = [one] * len(hw)
        elif scale_factor is not None:
            sf = tuple(scale_factor) if isinstance(scale_factor, (list, tuple)) else (scale_factor, scale_factor)
            if len(sf) != 2 or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 1 for f in sf):
                return None
            if not all(float(f) == int(f) and _pow2(int(f)) for f in sf):
                return None  # torch's float scale 1 / f is exact only for powers of two
            targets = [(int(h * sf[0]), int(w * sf[1])) for h, w in hw]
        else:
            return None
    factors = []
    for (h, w), (th, tw) in zip(hw, targets):
        if h <= 0 or w <= 0 or th % h or tw % w or not (_pow2(th // h) and _pow2(tw // w)):
            return None
        factors.append((th // h, tw // w))
    src, kids, out_hs, out_ho = _nearest_index(x, hs, ho, hw, factors)
    uneven = len({a * b for a, b in factors}) > 1  # some images have fewer copies: their lists end in the zero row
    return from_host_structure(_GatherRows.apply(values_of(x), src, kids, uneven), out_hs, (1, 2), x, out_ho)


def _pow2(k: int) -> bool:
    return k >= 1 and k & (k - 1) == 0


def _nearest_index(x: NestedTensor, hs, ho, hw: list, factors: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The source row of every output row, the ``k_h * k_w`` output rows of every input row (the
    repeat of the largest factor pads a smaller image's list with a spare zero row), and the output
    host sizes and offsets; cached on the structure per factors."""
    dev = x._values.device
    key = ("nearest_rows", tuple(factors), dev)
    hit = x._meta.derived.get(key)
    if hit is not None:
        return hit
    traced = _is_traced(x._values)
    if not traced and len(set(factors)) == 1:  # one factor: the maps live on the spatial cache too (by content)
        from padless.ops.vision.spatial import _cache_of

        src, kids, out_hw_t, out_ho = nearest_of(_cache_of("interpolate", x), factors[0], dev)[:4]
        out_hs = torch.cat([hs[:, :1], out_hw_t], 1)
        hit = (src, kids, out_hs, out_ho)
        x._meta.derived[key] = hit
        return hit
    src, kids, out_hw_t, out_ho = _nearest_maps(ho, hw, factors, dev)
    hit = (src, kids, torch.cat([hs[:, :1], out_hw_t], 1), out_ho)
    if not traced:
        x._meta.derived[key] = hit
    return hit


def nearest_of(cache: Any, factor: tuple[int, int], dev: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
    """The nearest-upsampling maps of every image of a spatial cache by one factor ``(k_h, k_w)``:
    ``(src, kids, out_hw, out_offsets, out_cache)``, cached there (a network plan recipe replays it
    in a worker, :mod:`padless.ops.vision.recipe`)."""
    from padless.ops.vision.spatial import _cache_for

    key = ("nearest", factor, dev)
    hit = cache.plans.get(key)
    if hit is None:
        hw = cache.hw.tolist()
        src, kids, out_hw, out_ho = _nearest_maps(cache.host_offsets, hw, [factor] * len(hw), dev)
        hit = (src, kids, out_hw, out_ho, _cache_for(out_hw, out_ho, cache.ragged))
        cache.plans[key] = hit
    return hit


def _nearest_maps(ho: Tensor, hw: list, factors: list, dev: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(src, kids, out_hw (B, 2), out_offsets)`` of :func:`_nearest_index` (host work)."""
    out_hw = [(h * a, w * b) for (h, w), (a, b) in zip(hw, factors)]
    out_hw_t = torch.tensor(out_hw, dtype=torch.int64).view(-1, 2)
    counts = np.array([oh * ow for oh, ow in out_hw], dtype=np.int64)
    out_ho_np = np.concatenate([[0], np.cumsum(counts)])
    total_out = int(out_ho_np[-1])
    m = max(a * b for a, b in factors)
    src = np.empty(total_out, dtype=np.int64)
    kids = np.full((int(ho[-1]), m), total_out, dtype=np.int64)  # total_out: a zero row appended to the gradient
    base_in = ho.tolist()
    for i, ((h, w), (a, b)) in enumerate(zip(hw, factors)):
        o0, oh, ow = int(out_ho_np[i]), h * a, w * b
        r = np.arange(oh)[:, None] // a * w + np.arange(ow)[None, :] // b  # (oh, ow) source pixel in the image
        src[o0 : o0 + oh * ow] = base_in[i] + r.reshape(-1)
        # input pixel (p, q)'s copies: output (p*a + u, q*b + v) for u < a, v < b
        out_pos = (np.arange(h)[:, None, None, None] * a + np.arange(a)[None, None, :, None]) * ow \
            + np.arange(w)[None, :, None, None] * b + np.arange(b)[None, None, None, :]
        kids[base_in[i] : base_in[i] + h * w, : a * b] = o0 + out_pos.reshape(h * w, a * b)
    return torch.from_numpy(src).to(dev), torch.from_numpy(kids).reshape(-1).to(dev), out_hw_t, torch.from_numpy(out_ho_np)


class _GatherRows(torch.autograd.Function):
    """``values[src]`` whose gradient is a gather too: every input row's output rows ``kids``
    (a fixed number per row, a zero row where an image has fewer), summed."""

    @staticmethod
    def forward(ctx, values: Tensor, src: Tensor, kids: Tensor, uneven: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(kids)
        ctx.rows, ctx.uneven = values.shape[0], uneven
        return values.index_select(0, src)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (kids,) = ctx.saved_tensors
        rows = ctx.rows
        if rows == 0:
            return g.new_zeros((0, *g.shape[1:])), None, None, None
        # no copy of a strided gradient (the channel slice a ``torch.cat`` of skips hands back): the
        # gather reads its rows where they are
        ext = torch.cat([g, g.new_zeros((1, *g.shape[1:]))]) if ctx.uneven else g
        return ext.index_select(0, kids).view(rows, kids.shape[0] // rows, *g.shape[1:]).sum(1), None, None, None
