"""The traced branches of the spatial ops: what ``F.conv2d``, pooling, ``F.interpolate`` and
patches do on image NestedTensors inside ``torch.compile`` (design in
:mod:`padless.ops.vision.compiled`).

Each branch (1) finds the output row count as a symbol (:func:`out_rows`: the input's rows,
an exact multiple of them, or the size of a carried map), (2) computes the output sizes in
the graph with the eager size rule, and the envelope with the same rule on the input's
envelope, and (3) runs the eager handler itself on the packed rows inside the opaque
``padless::image_island`` op, so compiled and eager results agree. The island bodies
registered here are those eager calls.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.vision.spatial import Geometry, conv_padding as _padding, spatial_plan, to_pair
from padless.ops.vision.compiled import (
    IDENTITY,
    AxisMap,
    Level,
    island,
    level_of,
    map_name,
    out_rows,
    out_sizes,
    run_island,
    traced_images,
)
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError

MAX_TOKENS_PREFIX = "image_maxtok_"


def _rel(g: Geometry) -> Level:
    return tuple(  # type: ignore[return-value]
        AxisMap.of_geometry(g.kernel[ax], g.stride[ax], g.padding[2 * ax] + g.padding[2 * ax + 1], g.dilation[ax])
        for ax in range(2)
    )


def _spatial_out(op: str, x: NestedTensor, rel: Level, channels: int, ohw: Tensor) -> tuple[Any, Level | None, Tensor, tuple]:
    rows, level = out_rows(op, x, rel)
    env = (channels, rel[0](x._env[1]), rel[1](x._env[2]))
    return rows, level, out_sizes(x, channels, ohw), env


# ------------------------------------------------------------------ conv2d


def traced_conv2d(x: NestedTensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any, groups: int, g: Geometry) -> NestedTensor:
    o = int(weight.shape[0])
    if g.kernel == (1, 1) and g.stride == (1, 1) and g.padding == (0, 0, 0, 0) and groups == 1:
        return rewrap(F.linear(values_of(x), weight.flatten(1), bias), x)  # as eager: a matmul on the rows
    rows, level, sizes, env = _spatial_out("conv2d", x, _rel(g), o, g.out_hw(x._sizes[:, 1:]))
    vals = run_island("conv2d", (stride, padding, dilation, groups, bias is not None), x, [weight, bias], rows, [o])
    return traced_images(vals, sizes, x, env, level)


def _conv2d_backward(nt: NestedTensor, tensors: list, spec: tuple, grad: Tensor, needs: list) -> list:
    """Convolution's own backward on the plan's canvas (no forward recompute): the gradient of
    every eager conv2d path (canvas, patches, strided 1x1), which all compute this convolution."""
    stride, padding, dilation, groups, has_bias = spec
    w = tensors[0]
    k = (int(w.shape[2]), int(w.shape[3]))
    st, dil = to_pair("conv2d", "stride", stride), to_pair("conv2d", "dilation", dilation)
    plan = spatial_plan("conv2d", nt, Geometry(k, st, _padding("conv2d", padding, k, st, dil), dil))
    v = nt._values
    if int(plan.out_offsets[-1]) == 0 or plan.blocks[1] == 0:
        return [None] * len(needs)
    need = [needs[0], needs[1], bool(has_bias and needs[2])]
    gi, gw, gb = torch.ops.aten.convolution_backward(
        plan.blocks_of_rows(grad), plan.to_blocks(v), w, [w.shape[0]] if has_bias else None, list(st), [0, 0],
        list(dil), False, [0, 0], groups, need,
    )
    out = [plan.rows_of_blocks(gi, v.shape[0]) if need[0] else None, gw if need[1] else None]
    return out + ([gb if need[2] else None] if has_bias else [])


@island("conv2d", backward=_conv2d_backward)
def _conv2d_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    stride, padding, dilation, groups, has_bias = spec
    return values_of(F.conv2d(nt, tensors[0], tensors[1] if has_bias else None, stride, padding, dilation, groups))


# ------------------------------------------------------------------ pooling


def traced_pool(op: str, x: NestedTensor, g: Geometry, spec: tuple) -> NestedTensor:
    if g.ceil_mode:
        raise NotImplementedError(
            f"{op}(): ceil_mode=True is not supported under torch.compile (its output sizes are not a size map "
            "the compiler can follow); use ceil_mode=False with padding, or run the op outside the compiled region"
        )
    c = int(x._values.shape[1])
    rows, level, sizes, env = _spatial_out(op, x, _rel(g), c, g.out_hw(x._sizes[:, 1:]))
    return traced_images(run_island(op, spec, x, [], rows, [c]), sizes, x, env, level)


@island("max_pool2d")
def _max_pool2d_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(F.max_pool2d(nt, *spec))


@island("avg_pool2d")
def _avg_pool2d_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(F.avg_pool2d(nt, *spec))


def traced_adaptive(op: str, x: NestedTensor, oh: int, ow: int) -> Tensor:
    """Dense ``(B, C, oh, ow)``: ``B * oh * ow`` rows, no map needed."""
    c = int(x._values.shape[1])
    b = x._sizes.shape[0]
    rows = run_island(op, (oh, ow), x, [], b * oh * ow, [c])
    return rows.view(b, oh, ow, c).permute(0, 3, 1, 2)


def _adaptive_rows(dense: Tensor) -> Tensor:
    return dense.permute(0, 2, 3, 1).reshape(-1, dense.shape[1])


@island("adaptive_avg_pool2d")
def _adaptive_avg_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return _adaptive_rows(F.adaptive_avg_pool2d(nt, spec))


@island("adaptive_max_pool2d")
def _adaptive_max_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return _adaptive_rows(F.adaptive_max_pool2d(nt, spec))


# ------------------------------------------------------------------ interpolate


def _scale_map(s: Any) -> AxisMap | None:
    """``floor(n * s)`` as a size map when torch's double arithmetic computes it exactly
    (an integer, or a fraction over a power of two such as 0.5)."""
    f = Fraction(float(s))
    if f <= 0 or f.denominator & (f.denominator - 1) or f.denominator > 1 << 16:
        return None
    return AxisMap.make(f.numerator, 0, f.denominator)


def traced_interpolate(x: NestedTensor, size: Any, scale_factor: Any, mode: str, align_corners: Any, recompute_scale_factor: Any, antialias: bool) -> NestedTensor:
    op = "interpolate"
    if x.sample_dim != 3 or x._ragged != (1, 2):
        raise NotImplementedError(
            f"{op}(): under torch.compile only images (C, H_i, W_i) with ragged dims (1, 2) are resampled; got samples "
            f"of rank {x.sample_dim} with ragged dims {x._ragged}. Run it outside the compiled region"
        )
    c = int(x._values.shape[1])
    kw = (mode, align_corners, recompute_scale_factor, antialias)
    if isinstance(size, NestedTensor):
        sd = size.sample_dim
        if size._ragged != (sd - 2, sd - 1):
            raise NotImplementedError(
                f"{op}(): under torch.compile, size= must be a NestedTensor whose last two sample dims are its ragged "
                f"dims (images (C, H_i, W_i) or masks (H_i, W_i)); got ragged dims {size._ragged}"
            )
        rows = size._values.shape[0]
        sizes = torch.cat([torch.full_like(size._sizes[:, :1], c), size._sizes[:, sd - 2 :]], 1)
        vals = run_island(op, ("like", None, *kw), x, [size._sizes], rows, [c])
        env = (c, size._env[sd - 2], size._env[sd - 1])
        return traced_images(vals, sizes, size if level_of(size) is not None else x, env, level_of(size))
    if scale_factor is not None:
        sf = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
        rel = tuple(_scale_map(s) for s in sf)
        if None in rel:
            raise NotImplementedError(
                f"{op}(): under torch.compile scale_factor must be an integer or a fraction over a power of two "
                f"(0.5, 0.25, 1.5); got {scale_factor!r}. Pass size= (one size, or size=images) instead"
            )
        rows, level = out_rows(op, x, rel)  # type: ignore[arg-type]
        hw = x._sizes[:, 1:]
        ohw = torch.stack([rel[0](hw[:, 0]), rel[1](hw[:, 1])], 1)  # type: ignore[index]
        env = (c, rel[0](x._env[1]), rel[1](x._env[2]))  # type: ignore[index]
        vals = run_island(op, ("scale", sf, *kw), x, [], rows, [c])
        return traced_images(vals, out_sizes(x, c, ohw), x, env, level)
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(s, int) for s in size) or isinstance(size, int):
        oh, ow = (size, size) if isinstance(size, int) else size
        b = x._sizes.shape[0]
        sizes = torch.tensor([c, oh, ow], dtype=torch.int64, device=x._sizes.device).expand(b, 3).clone()
        vals = run_island(op, ("size", (oh, ow), *kw), x, [], b * oh * ow, [c])
        return traced_images(vals, sizes, x, (c, oh, ow), None)
    raise NotImplementedError(
        f"{op}(): under torch.compile size must be one (h, w) for every image or a NestedTensor to match (size=images); "
        f"per-image lists and tensors are host data the graph cannot read. Got {type(size).__name__}"
    )


@island("interpolate")
def _interpolate_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    kind, arg, mode, align_corners, recompute, antialias = spec
    kw = dict(mode=mode, align_corners=align_corners, antialias=antialias)
    if kind == "like":
        targets = [tuple(r) for r in tensors[0][:, -2:].tolist()]
        return values_of(F.interpolate(nt, size=targets, **kw))
    if kind == "scale":
        return values_of(F.interpolate(nt, scale_factor=arg, recompute_scale_factor=recompute, **kw))
    return values_of(F.interpolate(nt, size=arg, **kw))


# ------------------------------------------------------------------ patches


def _max_tokens(x: NestedTensor, kh: int, kw: int) -> Any:
    name = f"{MAX_TOKENS_PREFIX}{kh}x{kw}"
    hit = x._meta.derived.get((name, x._values.device))
    if hit is None:
        raise StructureError(
            f"patchify(): under torch.compile the token envelope max_i N_i must be the size of a carried map, and the batch "
            f"carries no {name!r}; prepare it outside the compiled function: padless.vision.prepare_for_compile(images, patch={kh if kh == kw else (kh, kw)})"
        )
    return hit.shape[0]


def traced_patchify(images: NestedTensor, kh: int, kw: int) -> NestedTensor:
    from padless.tensor import layout

    rel = (AxisMap(1, 0, kh), AxisMap(1, 0, kw))
    rows, _ = out_rows("patchify", images, rel)
    c = int(images._values.shape[1])
    grid = images._sizes[:, 1:] // torch.tensor([kh, kw], device=images._sizes.device)
    n = grid.prod(1)
    sizes = torch.stack([n, torch.full_like(n, c * kh * kw)], 1)
    vals = run_island("patchify", (kh, kw), images, [], rows, [c * kh * kw])
    return nested_tokens(vals, layout.offsets_from_counts(n), sizes, (_max_tokens(images, kh, kw), c * kh * kw), images)


def nested_tokens(vals: Tensor, offsets: Tensor, sizes: Tensor, env: tuple, like: NestedTensor) -> NestedTensor:
    from padless.tensor.autograd import nested_from_values
    from padless.tensor.core import StructureMeta

    meta = StructureMeta()
    for k, v in like._meta.derived.items():  # the maps travel on (unpatchify needs none, a later prepare may)
        if isinstance(k, tuple) and isinstance(k[0], str) and k[0].startswith(("image_rows_", MAX_TOKENS_PREFIX)):
            meta.derived[k] = v
    return nested_from_values(vals, offsets, sizes, (0,), env, meta)


def traced_unpatchify(tokens: NestedTensor, kh: int, kw: int, images: Any) -> NestedTensor:
    if not isinstance(images, NestedTensor) or images.sample_dim != 3 or images._ragged != (1, 2):
        raise NotImplementedError(
            "unpatchify(): under torch.compile image_sizes must be the image batch itself (a NestedTensor "
            "(C, H_i, W_i)); a host size tensor is data the graph cannot read"
        )
    c = int(tokens._values.shape[1]) // (kh * kw)
    rows = tokens._values.shape[0] * kh * kw
    sizes = torch.cat([torch.full_like(images._sizes[:, :1], c), images._sizes[:, 1:]], 1)
    vals = run_island("unpatchify", (kh, kw), tokens, [images._sizes], rows, [c])
    return traced_images(vals, sizes, images, (c, images._env[1], images._env[2]), level_of(images))


def prepare_patches(images: NestedTensor, patches: list[tuple[int, int]]) -> None:
    """Carry the token-envelope map (``arange(max_i N_i)``) and the token-count level of each patch size."""
    from padless.ops.vision.compiled import _level_rows
    from padless.tensor.core import _weak_dynamic, register_carried

    hw = images.host_sizes()[:, 1:]
    dev = images._values.device
    for kh, kw in patches:
        level = (AxisMap(1, 0, kh), AxisMap(1, 0, kw))
        counts = _level_rows(hw, level)
        ids = torch.repeat_interleave(torch.arange(hw.shape[0]), counts).to(dev, non_blocking=True)
        most = torch.arange(int(counts.max()) if counts.numel() else 0).to(dev, non_blocking=True)
        for name, t in ((map_name(level), ids), (f"{MAX_TOKENS_PREFIX}{kh}x{kw}", most)):
            _weak_dynamic(t, {0})
            images._meta.derived[(register_carried(name), dev)] = t


__all__ = ["IDENTITY", "traced_conv2d", "traced_pool", "traced_adaptive", "traced_interpolate", "traced_patchify", "traced_unpatchify"]
