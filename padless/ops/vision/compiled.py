"""Convolution, pooling, resampling and patches under ``torch.compile``.

Eagerly, every spatial op plans its dense work from the images' host sizes (a
:class:`~padless.ops.vision.spatial.SpatialPlan`, shape groups, patch permutations) and learns
its output row count ``sum_i oh_i * ow_i`` from them. Inside a compiled graph the sizes
are runtime data, so the design, in one place:

* **Row counts are sizes of carried maps.** Before the compiled region,
  :func:`prepare_images_for_compile` (``padless.vision.prepare_for_compile``) builds, for
  every image-size *level* the network reaches, a map with one entry per pixel of that
  level (the pixel's sample id) and caches it on the batch's structure under a name
  declared with :func:`padless.tensor.core.register_carried`. The compiler sees each
  map's length as a symbol. A level is a per-axis size map ``n -> floor((mul*n + add) /
  div)`` relative to the prepared batch: a stride-2 "same" convolution gives
  ``ceil(n/2) = floor((n+1)/2)``, the ResNet stem plus its max pool ``ceil(n/4)``.
* **Levels compose.** Every traced image structure records its level; a layer of
  geometry ``(k, s, p, d)`` maps ``m -> floor((m + p0 + p1 - d(k-1) - 1 + s) / s)``, and
  ``floor((floor((M n + a)/S) + c)/s) = floor((M n + a + cS)/(S s))``, so the output level
  (and therefore the map that holds its row count) is known at trace time. Ops whose row
  count is an exact multiple of the input's (stride 1 "same" layers, integer upsampling,
  pixel shuffles, patches of exact multiples, ``size=images``) need no map.
* **The dense work is an opaque op.** ``padless::image_island`` runs the eager handler
  itself (the same plan, the same kernels, so compiled equals eager) on a NestedTensor
  rebuilt from the inner tensors at run time; its fake implementation only states the
  output shape ``(rows, *static)``, with ``rows`` the symbol above. Its backward
  (``padless::image_island_backward``) is convolution's own backward on the plan's
  canvas for ``conv2d``, and for the other ops a vector-Jacobian product of the eager op
  recomputed from the saved input (they are cheap next to the convolutions).
* Output sizes, offsets and envelopes are tensor arithmetic on the input's sizes (the
  eager size rule, evaluated in the graph) and symbolic arithmetic on its envelope.

Layout of the maps for images ``(3, 5, 7)`` and ``(3, 2, 2)`` prepared with
``strides=(2,)`` (level ``ceil(n/2)`` on both axes: ``(3, 4)`` and ``(1, 1)``)::

    image_rows_h1p1d2_w1p1d2   [0 0 0 0 0 0 0 0 0 0 0 0 1]     sample id of every pixel

A plain image batch (host sizes known) that enters a compiled graph without maps gets the
default levels ``ceil(n / s)`` for ``s`` in 2..32 (:func:`auto_image_maps`, run when the batch
is flattened for the graph), so ResNet-style CNNs compile with no preparation step. A layer
whose level has no map raises under ``torch.compile``, naming the level and the
``prepare_for_compile`` call that provides it.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import (
    ROW_LEVEL_KEYS,
    NestedTensor,
    StructureMeta,
    _weak_dynamic,
    envelope_from_sizes,
    register_auto_carrier,
    register_carried,
)
from padless.tensor.errors import StructureError
from padless.tensor.traced import autograd_inside_op

__all__ = ["AxisMap", "prepare_images_for_compile", "image_island"]

MAP_PREFIX = "image_rows_"
LEVEL = "image_level"  # on a traced image structure: (AxisMap, AxisMap) relative to the prepared batch, or None
ROOT_ROWS = "image_root_rows"  # on a traced image structure: the prepared batch's row count (a symbol)
for _k in (LEVEL, ROOT_ROWS):  # ops that keep the rows (relu, batch norm, linear) keep these records
    if _k not in ROW_LEVEL_KEYS:
        ROW_LEVEL_KEYS.append(_k)


# ------------------------------------------------------------------ levels


@dataclasses.dataclass(frozen=True)
class AxisMap:
    """One axis' size map ``n -> floor((mul * n + add) / div)``, kept in a canonical form
    (so two layers stacks reaching the same sizes share one map)."""

    mul: int = 1
    add: int = 0
    div: int = 1

    def __post_init__(self) -> None:
        if self.mul < 1 or self.div < 1:
            raise ValueError(f"AxisMap: mul and div must be positive ints, got mul={self.mul}, div={self.div}")

    @staticmethod
    def make(mul: int, add: int, div: int) -> "AxisMap":
        import math

        g = math.gcd(mul, div)
        return AxisMap(mul // g, add // g, div // g)  # floor((gM n + a)/(gS)) == floor((M n + a//g)/S)

    @staticmethod
    def ceil_div(s: int) -> "AxisMap":
        """``ceil(n / s)``: the sizes after a stride-``s`` "same" layer (or a stack of them)."""
        return AxisMap.make(1, s - 1, s)

    @staticmethod
    def of_geometry(kernel: int, stride: int, pad: int, dilation: int) -> "AxisMap":
        """A convolution or pooling axis (no ceil mode): ``floor((n + pad - d(k-1) - 1) / s) + 1``."""
        return AxisMap.make(1, pad - dilation * (kernel - 1) - 1 + stride, stride)

    def then(self, other: "AxisMap") -> "AxisMap | None":
        """``other`` applied after ``self`` (None when that is not of this form)."""
        if other.mul == 1:
            return AxisMap.make(self.mul, self.add + other.add * self.div, self.div * other.div)
        if self.div == 1:
            return AxisMap.make(self.mul * other.mul, other.mul * self.add + other.add, other.div)
        return None

    @property
    def identity(self) -> bool:
        return (self.mul, self.add, self.div) == (1, 0, 1)

    def __call__(self, n):
        """Apply to an int, a SymInt or an int tensor (floor division, clamped at 0)."""
        if isinstance(n, Tensor):
            return torch.div(n * self.mul + self.add, self.div, rounding_mode="floor").clamp_min(0)
        return torch.sym_max((n * self.mul + self.add) // self.div, 0)

    @property
    def tag(self) -> str:
        sign = "p" if self.add >= 0 else "m"
        return f"{self.mul}{sign}{abs(self.add)}d{self.div}"

    def __str__(self) -> str:
        m = "n" if self.mul == 1 else f"{self.mul}n"
        a = f" + {self.add}" if self.add > 0 else f" - {-self.add}" if self.add < 0 else ""
        return f"{m}{a}" if self.div == 1 else f"floor(({m}{a}) / {self.div})"


Level = tuple[AxisMap, AxisMap]
IDENTITY: Level = (AxisMap(), AxisMap())


def map_name(level: Level) -> str:
    return f"{MAP_PREFIX}h{level[0].tag}_w{level[1].tag}"


def _level_rows(hw: Tensor, level: Level) -> Tensor:
    """Host pixel count per image at ``level`` (0 for empty images or a vanished side)."""
    h, w = level[0](hw[:, 0]), level[1](hw[:, 1])
    live = (hw[:, 0] > 0) & (hw[:, 1] > 0)
    return torch.where(live, h * w, torch.zeros_like(h))


def _as_level(op: str, entry: Any) -> Level:
    if isinstance(entry, AxisMap):
        return (entry, entry)
    if isinstance(entry, int) and not isinstance(entry, bool) and entry >= 1:
        return (AxisMap.ceil_div(entry), AxisMap.ceil_div(entry))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        if all(isinstance(e, AxisMap) for e in entry):
            return (entry[0], entry[1])
        if all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in entry):
            return (AxisMap.ceil_div(entry[0]), AxisMap.ceil_div(entry[1]))
    raise ValueError(
        f"{op}(): each entry of strides must be an int >= 1, a pair of them, an AxisMap or a pair of AxisMaps, got {entry!r}"
    )


#: The strided levels a ResNet-style CNN reaches (``ceil(n / s)``), carried by default.
DEFAULT_STRIDES = (2, 4, 8, 16, 32)


def prepare_images_for_compile(
    images: NestedTensor, strides: Iterable[Any] = DEFAULT_STRIDES, levels: Iterable[Any] = ()
) -> NestedTensor:
    """Carry, on ``images``' structure, the row maps of the image sizes a compiled CNN reaches.

    ``strides``: each ``s`` (or ``(sh, sw)``) adds the level ``ceil(H_i / s) x ceil(W_i / s)``,
    what stride-``s`` stacks of "same"-padded layers give (a ResNet's stem ``7x7/2 pad 3`` and
    max pool ``3x3/2 pad 1`` reach ``ceil(n/2)`` and ``ceil(n/4)``). ``levels``: other
    :class:`AxisMap` s (one for both axes, or a pair), e.g. ``AxisMap(1, -2, 1)`` for an
    unpadded 3x3 layer. Call it outside the compiled function (or in the collate worker);
    returns ``images``. The maps cost one int64 per pixel of each level."""
    op = "prepare_for_compile"
    if not isinstance(images, NestedTensor) or images.sample_dim != 3 or images._ragged != (1, 2):
        got = f"samples of rank {images.sample_dim} with ragged dims {images._ragged}" if isinstance(images, NestedTensor) else type(images).__name__
        raise StructureError(f"{op}(): expected images (C, H_i, W_i) with ragged sample dims (1, 2), got {got}")
    hw = images.host_sizes()[:, 1:]
    dev = images._values.device
    for entry in [*strides, *levels]:
        level = _as_level(op, entry)
        if level == IDENTITY:
            continue
        counts = _level_rows(hw, level)
        ids = torch.repeat_interleave(torch.arange(hw.shape[0]), counts).to(dev, non_blocking=True)
        _weak_dynamic(ids, {0})  # the row count is a symbol from the first compiled call
        name = register_carried(map_name(level))
        images._meta.derived[(name, dev)] = ids
    return images


@register_auto_carrier
def auto_image_maps(nt: NestedTensor) -> None:
    """Give a real image batch ``(C, H_i, W_i)`` (ragged dims 1 and 2) that enters a compiled
    graph without maps the default strided levels of :func:`prepare_images_for_compile`, so a
    CNN compiles without a preparation step. Runs from ``__tensor_flatten__`` only (never
    eagerly otherwise); does nothing for other layouts, for batches without host sizes (no
    sync is paid) or when the batch already carries image maps (an explicit call wins)."""
    if nt.sample_dim != 3 or nt._ragged != (1, 2) or nt._meta.host_sizes is None or _maps(nt):
        return
    prepare_images_for_compile(nt, DEFAULT_STRIDES)


def level_of(nt: NestedTensor) -> Level | None:
    """The traced structure's level; a structure without a record is the prepared batch itself."""
    return nt._meta.derived.get((LEVEL, nt._values.device), IDENTITY)


def _maps(nt: NestedTensor) -> dict:
    return {k: v for k, v in nt._meta.derived.items() if isinstance(k, tuple) and isinstance(k[0], str) and k[0].startswith(MAP_PREFIX)}


def _no_map(op: str, level: Level | None, rel: Level, why: str) -> StructureError:
    where = f"; the input has sides H: {level[0]}, W: {level[1]} of the prepared batch's n" if level is not None else ""
    return StructureError(
        f"{op}(): under torch.compile the output row count sum_i oh_i * ow_i must be the size of a carried map, and {why}. "
        "Prepare the batch outside the compiled function: padless.vision.prepare_for_compile(images, strides=..., levels=...) "
        f"(this layer maps sides by H: {rel[0]}, W: {rel[1]}{where}); or run the op outside the compiled region"
    )


def out_rows(op: str, x: NestedTensor, rel: Level) -> tuple[Any, Level | None]:
    """The output row count (a symbol) and level of a layer mapping sizes by ``rel``."""
    level = level_of(x)
    t = x._values.shape[0]
    if rel == IDENTITY:
        return t, level
    out_level = None
    if level is not None:
        h, w = level[0].then(rel[0]), level[1].then(rel[1])
        out_level = None if h is None or w is None else (h, w)
    if all(r.add == 0 and r.div == 1 for r in rel):  # exact multiples: no map needed
        return t * rel[0].mul * rel[1].mul, out_level
    if out_level is None:
        raise _no_map(op, level, rel, "the input's sizes are not a known level of the prepared batch")
    if out_level == IDENTITY:
        root = x._meta.derived.get((ROOT_ROWS, x._values.device))
        if root is None:
            raise _no_map(op, level, rel, "the prepared batch's own row count is not known here")
        return root, out_level
    hit = x._meta.derived.get((map_name(out_level), x._values.device))
    if hit is None:
        raise _no_map(op, level, rel, f"the batch carries no map {map_name(out_level)!r}")
    return hit.shape[0], out_level


def traced_images(values: Tensor, sizes: Tensor, like: NestedTensor, env: Sequence, level: Level | None) -> NestedTensor:
    """A traced image NestedTensor around ``values`` with device ``sizes`` ``(B, 3)``, keeping
    ``like``'s carried maps and recording ``level``."""
    meta = StructureMeta()
    meta.derived.update(_maps(like))
    dev = values.device
    root = like._meta.derived.get((ROOT_ROWS, dev))
    if root is None and level_of(like) == IDENTITY:
        root = like._values.shape[0]
    if root is not None:
        meta.derived[(ROOT_ROWS, dev)] = root
    meta.derived[(LEVEL, dev)] = level
    offsets = layout.offsets_from_counts(sizes[:, 1] * sizes[:, 2])
    return nested_from_values(values, offsets, sizes, (1, 2), tuple(env), meta)


def out_sizes(x: NestedTensor, channels: int, ohw: Tensor) -> Tensor:
    """Device sizes ``(B, 3)`` of images with ``channels`` and sides ``ohw`` (zero where the input
    image is empty or a side vanished, as the eager plan records them)."""
    hw = x._sizes[:, 1:]
    dead = (hw.prod(1) == 0) | (ohw <= 0).any(1)
    ohw = torch.where(dead.unsqueeze(1), torch.zeros_like(ohw), ohw)
    return torch.cat([torch.full_like(ohw[:, :1], channels), ohw], 1)


# ------------------------------------------------------------------ the opaque op

Island = Callable[[NestedTensor, list, tuple], Tensor]
_FORWARD: dict[str, Island] = {}
_BACKWARD: dict[str, Callable] = {}


def island(name: str, backward: Callable | None = None) -> Callable[[Island], Island]:
    """Register ``fn(images, tensors, spec) -> output rows`` as the eager body of island ``name``."""

    def deco(fn: Island) -> Island:
        if name in _FORWARD:
            raise RuntimeError(f"padless internal: image island {name!r} registered twice")
        _FORWARD[name] = fn
        if backward is not None:
            _BACKWARD[name] = backward
        return fn

    return deco


@functools.lru_cache(maxsize=256)
def _spec(spec: str) -> tuple:
    return ast.literal_eval(spec)


_METAS: "collections.OrderedDict[Any, StructureMeta]" = collections.OrderedDict()
_META_LIMIT = 64


def _eager_input(v: Tensor, sizes: Tensor, offsets: Tensor, ragged: Sequence[int]) -> NestedTensor:
    """The op's input as an eager NestedTensor; its structure (and every plan cached on it) is
    kept for the next calls of the same sizes (backward, the next step)."""
    hs, ho = sizes.cpu(), offsets.cpu()  # real data at run time (a sync on a GPU)
    key = (tuple(ragged), hs.numpy().tobytes(), ho.numpy().tobytes(), v.device)
    meta = _METAS.get(key)
    if meta is None:
        meta = StructureMeta(hs, ho)
        _METAS[key] = meta
        if len(_METAS) > _META_LIMIT:
            _METAS.popitem(last=False)
    else:
        _METAS.move_to_end(key)
    env = envelope_from_sizes(hs, tuple(ragged), v.shape[1:])
    return nested_from_values(v, offsets, sizes, tuple(ragged), env, meta)


@torch.library.custom_op("padless::image_island", mutates_args=())
def image_island(
    name: str, spec: str, v: Tensor, sizes: Tensor, offsets: Tensor, ragged: list[int], tensors: list[Tensor],
    rows: int, static: list[int],
) -> Tensor:
    """The eager body ``name`` on the images ``(v, sizes, offsets)``: output rows ``(rows, *static)``."""
    nt = _eager_input(v, sizes, offsets, ragged)
    with torch.no_grad():
        out = _FORWARD[name](nt, list(tensors), _spec(spec))
    if tuple(out.shape) != (rows, *static):
        raise StructureError(
            f"{name}(): under torch.compile the carried maps promised {rows} output rows of {tuple(static)}, the op "
            f"made {tuple(out.shape)}: the batch was prepared for other sizes (prepare_for_compile on this very batch)"
        )
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (v, *tensors)):
        return out.clone()
    return out.contiguous()


@image_island.register_fake
def _image_island_fake(name, spec, v, sizes, offsets, ragged, tensors, rows, static):
    return v.new_empty((rows, *static))


@torch.library.custom_op("padless::image_island_backward", mutates_args=())
def image_island_backward(
    name: str, spec: str, grad: Tensor, v: Tensor, sizes: Tensor, offsets: Tensor, ragged: list[int],
    tensors: list[Tensor], needs: list[bool],
) -> list[Tensor]:
    """Gradients of :func:`image_island` for ``v`` and ``tensors`` (zeros where not needed)."""
    nt_args = (v, sizes, offsets, ragged)
    custom = _BACKWARD.get(name)
    if custom is not None:
        got = custom(_eager_input(*nt_args), list(tensors), _spec(spec), grad, needs)
    else:
        with autograd_inside_op():
            leaves = [t.detach().requires_grad_(n) for t, n in zip([v, *tensors], needs)]
            nt = _eager_input(leaves[0], *nt_args[1:])
            out = _FORWARD[name](nt, leaves[1:], _spec(spec))
            want = [t for t, n in zip(leaves, needs) if n]
            gs = iter(torch.autograd.grad(out, want, grad, allow_unused=True) if want and out.requires_grad else [None] * len(want))
            got = [next(gs) if n else None for n in needs]
    return [torch.zeros_like(t) if g is None else g.contiguous() for t, g in zip([v, *tensors], got)]


@image_island_backward.register_fake
def _image_island_backward_fake(name, spec, grad, v, sizes, offsets, ragged, tensors, needs):
    return [torch.empty_like(v), *(torch.empty_like(t) for t in tensors)]


def _setup(ctx, inputs, output) -> None:
    name, spec, v, sizes, offsets, ragged, tensors, _, _ = inputs
    ctx.save_for_backward(v, sizes, offsets, *tensors)
    ctx.args = (name, spec, list(ragged))
    ctx.needs = [v.requires_grad, *(t.requires_grad for t in tensors)]


def _backward(ctx, grad):
    v, sizes, offsets, *tensors = ctx.saved_tensors
    name, spec, ragged = ctx.args
    if not any(ctx.needs):
        return None, None, None, None, None, None, [None] * len(tensors), None, None
    gs = image_island_backward(name, spec, grad.contiguous(), v, sizes, offsets, ragged, tensors, ctx.needs)
    keep = [g if n else None for g, n in zip(gs, ctx.needs)]
    return None, None, keep[0], None, None, None, keep[1:], None, None


image_island.register_autograd(_backward, setup_context=_setup)


def run_island(name: str, spec: tuple, x: NestedTensor, tensors: Sequence[Tensor | None], rows: Any, static: Sequence[int]) -> Tensor:
    """Call island ``name`` on ``x`` (``None`` tensors are left out; the body gets them in order
    of the non-None ones and reads ``spec`` to know which were given)."""
    return image_island(
        name, repr(spec), values_of(x), x._sizes, x._offsets, list(x._ragged), [t for t in tensors if t is not None],
        rows, list(static),
    )
