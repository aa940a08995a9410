"""The traced branches of the spatial ops: what ``F.conv2d``, pooling, ``F.pad``, ``F.interpolate``
and patches do on image NestedTensors inside ``torch.compile`` (design in
:mod:`padless.ops.vision.compiled`).

Each branch (1) finds the output's host sides and row count (:func:`derive`: the layer's size
rule on the input's host sides, a CPU tensor of the graph, and an unbacked symbol for the
rows, shared with any earlier layer that reached the same sizes), (2) computes the output's
device sizes with the same rule on the device sizes, and the envelope with it on the input's
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
    _Record,
    dead_zero,
    derive,
    fresh,
    island,
    lookup_extent,
    out_sizes,
    pixel_count,
    record_of,
    run_index,
    run_island,
    traced_images,
    unresolved_extent,
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


def _transposed_rel(g: Geometry) -> Level:
    """A transposed layer's size map: ``(n - 1) s - p0 - p1 + e + output_padding``."""
    return tuple(  # type: ignore[return-value]
        AxisMap.make(g.stride[ax], g.extent[ax] + g.output_padding[ax] - g.padding[2 * ax] - g.padding[2 * ax + 1] - g.stride[ax], 1)
        for ax in range(2)
    )


def _step(g: Geometry) -> Any:
    """The layer's size map for :func:`derive`: a :data:`Level`, or (ceil mode) a key naming it."""
    if g.ceil_mode:
        return ("geometry", g)
    return _transposed_rel(g) if g.transposed else _rel(g)


def _env_side(g: Geometry, n: Any, ax: int) -> Any:
    """The output envelope along ``ax`` from the input's (the size rule is monotone in ``n``),
    symbolic without a guard. Ceil mode's "the last window starts inside the image or its
    left padding" is ``min(ceil((n + p0 + p1 - e) / s) + 1, ceil((n + p0) / s))`` (checked
    against the eager rule for every geometry torch accepts, pad <= kernel / 2)."""
    if not g.ceil_mode:
        return _step(g)[ax](n)
    s, e = g.stride[ax], g.extent[ax]
    p0, p1 = g.padding[2 * ax], g.padding[2 * ax + 1]
    o = (n + p0 + p1 - e + s - 1) // s + 1
    return torch.sym_max(torch.sym_min(o, (n + p0 + s - 1) // s), 0)


def _spatial_out(x: NestedTensor, g: Geometry, channels: int) -> tuple[_Record, Tensor, tuple]:
    """The output record, device sizes and envelope of a window layer of geometry ``g``."""
    rec = derive(
        x, _step(g), lambda hw: dead_zero(hw, g.out_hw(hw)),
        lambda: (_env_side(g, x._env[1], 0), _env_side(g, x._env[2], 1)),
    )
    return rec, out_sizes(x, channels, g.out_hw(x._sizes[:, 1:])), (channels, *rec.env)


# ------------------------------------------------------------------ conv2d


def traced_conv2d(x: NestedTensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any, groups: int, g: Geometry) -> NestedTensor:
    o = int(weight.shape[0])
    if g.kernel == (1, 1) and g.stride == (1, 1) and g.padding == (0, 0, 0, 0) and groups == 1:
        return rewrap(F.linear(values_of(x), weight.flatten(1), bias), x)  # as eager: a matmul on the rows
    rec, sizes, env = _spatial_out(x, g, o)
    if g.kernel == (1, 1) and g.padding == (0, 0, 0, 0) and groups == 1:  # a strided projection (conv.py)
        vals = run_island("strided_1x1", (g.stride, bias is not None), x, [weight, bias], rec.rows, [o])
        return traced_images(vals, sizes, env, rec)
    vals = run_island("conv2d", (stride, padding, dilation, groups, bias is not None), x, [weight, bias], rec.rows, [o])
    return traced_images(vals, sizes, env, rec)


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


def traced_conv_transpose2d(x: NestedTensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any, output_padding: Any, groups: int, dilation: Any, g: Geometry) -> NestedTensor:
    o = int(weight.shape[1]) * groups
    rec, sizes, env = _spatial_out(x, g, o)
    spec = (stride, padding, output_padding, groups, dilation, bias is not None)
    vals = run_island("conv_transpose2d", spec, x, [weight, bias], rec.rows, [o])
    return traced_images(vals, sizes, env, rec)


@island("conv_transpose2d")
def _conv_transpose2d_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    stride, padding, output_padding, groups, dilation, has_bias = spec
    return values_of(F.conv_transpose2d(nt, tensors[0], tensors[1] if has_bias else None, stride, padding, output_padding, groups, dilation))


# ------------------------------------------------------------------ pooling


def traced_pool(op: str, x: NestedTensor, g: Geometry, spec: tuple) -> NestedTensor:
    """Max and average pooling: any kernel, stride, padding, dilation, floor or ceil mode."""
    c = int(x._values.shape[1])
    rec, sizes, env = _spatial_out(x, g, c)
    v = values_of(x)
    if op == "max_pool2d" and v.dim() == 2 and v.dtype.is_floating_point:
        # the row of every maximum (an index island), then a gather in the graph: its backward is
        # a scatter of the gradient (no recompute of the pool), and both fuse with their neighbours
        spec_rows = (g.kernel, g.stride, g.padding, g.dilation, g.ceil_mode)
        rows = run_index("max_pool2d_rows", spec_rows, x, rec.rows, [c])  # registered in pool.py
        n = v.shape[0]
        got = v.gather(0, rows.clamp_max(n - 1))
        return traced_images(torch.where(rows < n, got, float("-inf")), sizes, env, rec)  # n: a maximum in a gap
    return traced_images(run_island(op, spec, x, [], rec.rows, [c]), sizes, env, rec)


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


# ------------------------------------------------------------------ padding


def traced_pad(x: NestedTensor, pads: list[int], mode: str, value: Any) -> NestedTensor:
    """``F.pad`` of images' sides (constant, reflect, replicate, circular; negative pads crop)."""
    op = "pad"
    if x.sample_dim != 3 or x._ragged != (1, 2) or len(pads) > 4:
        raise NotImplementedError(
            f"{op}(): under torch.compile only the sides of images (C, H_i, W_i) with ragged dims (1, 2) are padded "
            f"(pad of length 2 or 4); got samples of rank {x.sample_dim} with ragged dims {x._ragged} and pad {tuple(pads)}. "
            "Run it outside the compiled region"
        )
    p = list(pads) + [0] * (4 - len(pads))
    pw, ph = p[0] + p[1], p[2] + p[3]
    step = (AxisMap(1, ph, 1), AxisMap(1, pw, 1))
    grow = torch.tensor([ph, pw], dtype=torch.int64)

    def host(hw: Tensor) -> Tensor:
        return dead_zero(hw, hw + grow)

    rec = derive(x, step, host, lambda: (step[0](x._env[1]), step[1](x._env[2])))
    c = int(x._values.shape[1])
    dhw = x._sizes[:, 1:]
    sizes = out_sizes(x, c, torch.stack([dhw[:, 0] + ph, dhw[:, 1] + pw], 1))
    vals = run_island(op, (tuple(pads), mode, value), x, [], rec.rows, [c])
    return traced_images(vals, sizes, (c, *rec.env), rec)


@island("pad")
def _pad_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    pads, mode, value = spec
    return values_of(F.pad(nt, list(pads), mode=mode, value=value))


# ------------------------------------------------------------------ pixel shuffles


def traced_shuffle(x: NestedTensor, r: int, up: bool) -> NestedTensor:
    """``F.pixel_shuffle`` (``up``) / ``F.pixel_unshuffle`` of images ``(C, H_i, W_i)``."""
    op = "pixel_shuffle" if up else "pixel_unshuffle"
    c = int(x._values.shape[1])
    oc = c // (r * r) if up else c * r * r
    step = (AxisMap(r, 0, 1), AxisMap(r, 0, 1)) if up else (AxisMap(1, 0, r), AxisMap(1, 0, r))

    def host(hw: Tensor) -> Tensor:
        return dead_zero(hw, step[0](hw))

    rows = x._values.shape[0] * r * r if up else None  # unshuffle: sides must divide (the island says so)
    rec = derive(x, step, host, lambda: (step[0](x._env[1]), step[1](x._env[2])), rows=rows)
    sizes = out_sizes(x, oc, step[0](x._sizes[:, 1:]))
    vals = run_island(op, (r,), x, [], rec.rows, [oc])
    return traced_images(vals, sizes, (oc, *rec.env), rec)


@island("pixel_shuffle")
def _pixel_shuffle_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(F.pixel_shuffle(nt, spec[0]))


@island("pixel_unshuffle")
def _pixel_unshuffle_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(F.pixel_unshuffle(nt, spec[0]))


# ------------------------------------------------------------------ interpolate


def _scale_map(s: Any) -> AxisMap | None:
    """``floor(n * s)`` as a size map when torch's double arithmetic computes it exactly
    (an integer, or a fraction over a power of two such as 0.5)."""
    f = Fraction(float(s))
    if f <= 0 or f.denominator & (f.denominator - 1) or f.denominator > 1 << 16:
        return None
    return AxisMap.make(f.numerator, 0, f.denominator)


def _targets(op: str, x: NestedTensor, size: Any) -> tuple[Tensor, Tensor, tuple, _Record | None] | None:
    """Per-image targets named by ``size`` under tracing: host sides ``(B, 2)``, device sides,
    envelope and the record they are (when one batch's own sides are named); None for one
    size for every image."""
    b = x._sizes.shape[0]
    dev = x._sizes.device
    if isinstance(size, Tensor):
        raise NotImplementedError(
            f"{op}(): under torch.compile a size tensor is data whose largest entry (the envelope) the graph cannot "
            "know; pass per-image targets as a list of (h, w), a NestedTensor (size=images) or a batch's shape[2:]"
        )
    if isinstance(size, (list, tuple)) and size and all(isinstance(s, (list, tuple, torch.Size)) for s in size):
        rows = [tuple(int(v) for v in s) for s in size]
        if len(rows) != b or any(len(r) != 2 for r in rows):
            raise ValueError(f"{op}(): size lists {len(rows)} per-image targets for a batch of {b} images; give one (h, w) per image")
        hw = torch.tensor(rows, dtype=torch.int64)
        return hw, torch.tensor(rows, dtype=torch.int64, device=dev), (max(r[0] for r in rows), max(r[1] for r in rows)), None
    entries = (size, size) if not isinstance(size, (list, tuple)) else tuple(size)
    if len(entries) != 2:
        return None
    hits = [lookup_extent(e) for e in entries]
    for e, hit in zip(entries, hits):
        why = unresolved_extent(e) if hit is None else None
        if why is not None:
            raise NotImplementedError(
                f"{op}(): under torch.compile a size {why} ({e}) cannot name every image's own size; pass the batch "
                "itself (size=skip, a NestedTensor) or the shape of a batch that a spatial op made (size=skip.shape[2:])"
            )
    if all(h is None for h in hits):
        return None
    if hits[0] is not None and hits[1] is not None and hits[0][0] is hits[1][0] and (hits[0][1], hits[1][1]) == (0, 1):
        rec = hits[0][0]
        return rec.hw, rec.dev_hw, rec.env, rec
    host_cols, dev_cols, env = [], [], []
    for e, hit in zip(entries, hits):
        if hit is None:
            host_cols.append(torch.full((b,), e, dtype=torch.int64))
            dev_cols.append(torch.full((b,), e, dtype=torch.int64, device=dev))
            env.append(e)
        else:
            rec, col = hit
            host_cols.append(rec.hw[:, col])
            dev_cols.append(rec.dev_hw[:, col])
            env.append(rec.env[col])
    return torch.stack(host_cols, 1), torch.stack(dev_cols, 1), tuple(env), None


def traced_interpolate(x: NestedTensor, size: Any, scale_factor: Any, mode: str, align_corners: Any, recompute_scale_factor: Any, antialias: bool) -> NestedTensor:
    op = "interpolate"
    if x.sample_dim != 3 or x._ragged != (1, 2):
        raise NotImplementedError(
            f"{op}(): under torch.compile only images (C, H_i, W_i) with ragged dims (1, 2) are resampled; got samples "
            f"of rank {x.sample_dim} with ragged dims {x._ragged}. Run it outside the compiled region"
        )
    c = int(x._values.shape[1])
    kw = (mode, align_corners, recompute_scale_factor, antialias)
    record_of(x)  # registers x's envelope: size=x.shape[2:] names x's own images
    if isinstance(size, NestedTensor):
        sd = size.sample_dim
        if size._ragged != (sd - 2, sd - 1):
            raise NotImplementedError(
                f"{op}(): under torch.compile, size= must be a NestedTensor whose last two sample dims are its ragged "
                f"dims (images (C, H_i, W_i) or masks (H_i, W_i)); got ragged dims {size._ragged}"
            )
        rec = record_of(size)
        sizes = torch.cat([torch.full_like(size._sizes[:, :1], c), size._sizes[:, sd - 2 :]], 1)
        vals = run_island(op, ("like", None, *kw), x, [rec.hw], rec.rows, [c])
        return traced_images(vals, sizes, (c, *rec.env), rec)
    if scale_factor is not None:
        sf = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
        rel = tuple(_scale_map(s) for s in sf)
        if None in rel:
            raise NotImplementedError(
                f"{op}(): under torch.compile scale_factor must be an integer or a fraction over a power of two "
                f"(0.5, 0.25, 1.5); got {scale_factor!r}. Pass size= (one size, or size=images) instead"
            )

        def host(hw: Tensor) -> Tensor:
            return dead_zero(hw, torch.stack([rel[0](hw[:, 0]), rel[1](hw[:, 1])], 1))  # type: ignore[index]

        rec = derive(x, rel, host, lambda: (rel[0](x._env[1]), rel[1](x._env[2])))  # type: ignore[index]
        hw = x._sizes[:, 1:]
        ohw = torch.stack([rel[0](hw[:, 0]), rel[1](hw[:, 1])], 1)  # type: ignore[index]
        vals = run_island(op, ("scale", sf, *kw), x, [], rec.rows, [c])
        return traced_images(vals, out_sizes(x, c, ohw), (c, *rec.env), rec)
    per_image = _targets(op, x, size)
    if per_image is not None:
        hw, dev_hw, env, rec = per_image
        if rec is None:
            base = record_of(x)
            rec = fresh(base, "size", hw, pixel_count(hw), env, dev_hw)
        sizes = torch.cat([torch.full_like(dev_hw[:, :1], c), dev_hw], 1)
        vals = run_island(op, ("like", None, *kw), x, [rec.hw], rec.rows, [c])
        return traced_images(vals, sizes, (c, *rec.env), rec)
    if isinstance(size, (tuple, list)) and len(size) == 2 or isinstance(size, (int, torch.SymInt)):
        oh, ow = (size, size) if isinstance(size, (int, torch.SymInt)) else size
        b = x._sizes.shape[0]
        dev = x._sizes.device
        sizes = torch.stack([torch.full((b,), v, dtype=torch.int64, device=dev) for v in (c, oh, ow)], 1)
        host = torch.stack([torch.full((b,), v, dtype=torch.int64) for v in (oh, ow)], 1)
        base = record_of(x)
        rec = fresh(base, "fixed", host, b * oh * ow, (oh, ow), sizes[:, 1:])
        vals = run_island(op, ("size", (oh, ow), *kw), x, [], rec.rows, [c])
        return traced_images(vals, sizes, (c, oh, ow), rec)
    raise NotImplementedError(
        f"{op}(): under torch.compile size must be one (h, w) for every image, per-image targets (a list of (h, w), a CPU "
        f"int tensor (B, 2), a NestedTensor or a batch's shape[2:]); got {type(size).__name__}"
    )


@island("interpolate")
def _interpolate_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    kind, arg, mode, align_corners, recompute, antialias = spec
    kw = dict(mode=mode, align_corners=align_corners, antialias=antialias)
    if kind == "like":
        targets = [tuple(r) for r in tensors[0].tolist()]  # host sides (B, 2): a CPU tensor of the graph
        return values_of(F.interpolate(nt, size=targets, **kw))
    if kind == "scale":
        return values_of(F.interpolate(nt, scale_factor=arg, recompute_scale_factor=recompute, **kw))
    return values_of(F.interpolate(nt, size=arg, **kw))


# ------------------------------------------------------------------ patches


def _max_tokens(x: NestedTensor, kh: int, kw: int) -> Any:
    """The token envelope ``max_i N_i``: the length of the carried map that
    ``prepare_for_compile(images, patch=...)`` makes (an envelope is a size of the structure,
    which a symbol read from data cannot be)."""
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

    def host(hw: Tensor) -> Tensor:
        return dead_zero(hw, torch.stack([hw[:, 0] // kh, hw[:, 1] // kw], 1))

    rec = derive(images, rel, host, lambda: (rel[0](images._env[1]), rel[1](images._env[2])))
    c = int(images._values.shape[1])
    grid = images._sizes[:, 1:] // torch.tensor([kh, kw], device=images._sizes.device)
    n = grid.prod(1)
    sizes = torch.stack([n, torch.full_like(n, c * kh * kw)], 1)
    vals = run_island("patchify", (kh, kw), images, [], rec.rows, [c * kh * kw])
    return nested_tokens(vals, layout.offsets_from_counts(n), sizes, (_max_tokens(images, kh, kw), c * kh * kw), images)


def nested_tokens(vals: Tensor, offsets: Tensor, sizes: Tensor, env: tuple, like: NestedTensor) -> NestedTensor:
    from padless.tensor.autograd import nested_from_values
    from padless.tensor.core import StructureMeta

    meta = StructureMeta()
    for k, v in like._meta.derived.items():  # the token-envelope maps travel on (a later patchify may use them)
        if isinstance(k, tuple) and isinstance(k[0], str) and k[0].startswith(MAX_TOKENS_PREFIX):
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
    src = record_of(images)
    vals = run_island("unpatchify", (kh, kw), tokens, [src.hw], rows, [c])
    rec = fresh(src, "unpatchify", src.hw, rows, src.env, src.dev_hw)
    return traced_images(vals, sizes, (c, *src.env), rec)


def prepare_patches(images: NestedTensor, patches: list[tuple[int, int]]) -> None:
    """Carry the token-envelope map (``arange(max_i N_i)``) of each patch size, so the token
    envelope is a backed size (without it, it is an unbacked symbol read from the host sides)."""
    from padless.tensor.core import _weak_dynamic, register_carried

    hw = images.host_sizes()[:, 1:]
    dev = images._values.device
    for kh, kw in patches:
        counts = (hw[:, 0] // kh) * (hw[:, 1] // kw)
        most = torch.arange(int(counts.max()) if counts.numel() else 0).to(dev, non_blocking=True)
        _weak_dynamic(most, {0})
        images._meta.derived[(register_carried(f"{MAX_TOKENS_PREFIX}{kh}x{kw}"), dev)] = most


__all__ = [
    "IDENTITY", "traced_conv2d", "traced_conv_transpose2d", "traced_shuffle", "traced_pool", "traced_pad", "traced_adaptive", "traced_interpolate", "traced_patchify",
    "traced_unpatchify",
]
