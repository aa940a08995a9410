"""Convolution, pooling, padding, resampling and patches under ``torch.compile``.

Eagerly, every spatial op plans its dense work from the images' host sizes (a
:class:`~padless.ops.vision.spatial.SpatialPlan`, shape groups, patch permutations) and learns
its output row count ``sum_i oh_i * ow_i`` from them. Inside a compiled graph the design, in
one place:

* **The host sizes enter the graph.** An image batch ``(C, H_i, W_i)`` (any batch whose last
  two sample dims are ragged) carries its host sides ``(H_i, W_i)`` as a small CPU int64
  tensor ``(B, 2)``, flattened as an extra inner tensor (``image_host_hw``, declared with
  :func:`padless.tensor.core.register_carried`; made from host metadata when the batch is
  flattened for the graph, no preparation call). A batch built on a device without host sizes
  reads them once, at its first spatial op, inside the graph.
* **Output sizes are CPU tensor arithmetic in the graph**: the eager size rule of the layer
  (any kernel, stride, padding, dilation, ceil mode, pads, per-image targets) on the input's
  host sides gives the output's host sides.
* **The row count is an unbacked symbol**: ``sum_i oh_i * ow_i`` read with ``.item()`` from that
  CPU tensor (no device sync, no recompile: the compiler knows only that it is ``>= 0``).
  One mechanism for every data-dependent row count; there is no menu of prepared sizes.
* **Equal sizes share one symbol.** Each traced image structure keeps a record: its host
  sides, its rows and its *level*, the size map from the batch that entered the graph. A
  layer of geometry ``(k, s, p, d)`` maps ``m -> floor((m + p0 + p1 - d(k-1) - 1 + s) / s)``,
  and ``floor((floor((M n + a)/S) + c)/s) = floor((M n + a + cS)/(S s))``, so two paths that
  reach the same sizes (a ResNet block's strided conv and its strided 1x1 shortcut) reach
  the same :class:`AxisMap` level, and the second reuses the first's sides and row symbol:
  adding the two needs no runtime check. Layers whose rule is not of that form (ceil mode,
  per-image targets) get a level named after the layer and its input's level.
* **Shapes read from a batch name its images.** ``F.interpolate(x, size=skip.shape[2:])`` gets
  the envelope's symbols; each record registers its envelope symbols, so the traced op finds
  ``skip``'s images and brings image i of ``x`` to image i of ``skip``, as eagerly (where the
  shape's entries are :class:`~padless.tensor.extents.Extent` ints). A symbol the graph cannot
  map back to images (arithmetic such as ``skip.shape[-1] // 3``, or the shape of a NestedTensor
  input no spatial op has seen) is refused, naming ``size=skip`` instead, never read as the
  envelope. Per-image lists of ``(h, w)`` are constants of the graph.
* **The dense work is an opaque op.** ``padless::image_island`` runs the eager handler itself
  (the same plan, the same kernels, so compiled equals eager) on a NestedTensor rebuilt at
  run time from the inner tensors and the host sides (no device read); its fake
  implementation only states the output shape ``(rows, *static)``. Its backward
  (``padless::image_island_backward``) is convolution's own backward on the plan's canvas for
  ``conv2d``, and for the other ops a vector-Jacobian product of the eager op recomputed from
  the saved input (they are cheap next to the convolutions).
* **An index is an opaque op too, its reads are not.** Where the eager op is a read of input
  rows (max pooling: the row of every window's maximum), ``padless::image_index`` computes
  only the int64 index with the eager plan (no gradient) and the graph gathers with it: the
  backward is the gather's scatter (no recompute of the pool) and the compiler fuses the
  gather with the batch norm / ReLU around it. A strided 1x1 convolution keeps its eager body
  in the island (a matmul of the rows of its pixels) and its backward is two matmuls and an
  ``index_copy`` (no canvas).
* Device sizes, offsets and envelopes are tensor arithmetic on the input's device sizes (the
  eager size rule, evaluated in the graph) and symbolic arithmetic on its envelope.

Layout for images ``(3, 5, 7)`` and ``(3, 2, 2)`` through ``nn.MaxPool2d(2)``::

    image_host_hw (input)   [[5, 7], [2, 2]]     CPU int64, a graph input
    host sides (output)     [[2, 3], [1, 1]]     floor(n / 2), CPU arithmetic in the graph
    rows                    u0 = 2*3 + 1*1       .item() of CPU data: an unbacked symbol (7 at run time)

:func:`prepare_images_for_compile` (``padless.vision.prepare_for_compile``) is no longer needed;
it carries the host sides now (one read for a batch built on a device) and accepts its former
arguments.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from padless.ops.common.islands import rebuilt
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import (
    ROW_LEVEL_KEYS,
    NestedTensor,
    StructureMeta,
    _weak_dynamic,
    register_auto_carrier,
    register_carried,
)
from padless.tensor.errors import StructureError
from padless.tensor.traced import autograd_inside_op

__all__ = ["AxisMap", "prepare_images_for_compile", "image_island"]

HOST_HW = register_carried("image_host_hw")  # CPU int64 (B, 2): every image's (H_i, W_i)
RECORD = "image_record"  # on a traced image structure: its _Record
if RECORD not in ROW_LEVEL_KEYS:  # ops that keep the rows (relu, batch norm, linear) keep the record
    ROW_LEVEL_KEYS.append(RECORD)


# ------------------------------------------------------------------ levels


@dataclasses.dataclass(frozen=True)
class AxisMap:
    """One axis' size map ``n -> floor((mul * n + add) / div)``, kept in a canonical form
    (so two layer stacks reaching the same sizes share one level)."""

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


def _is_image_like(nt: NestedTensor) -> bool:
    """Samples whose last two dims are their ragged dims: images ``(C, H_i, W_i)``, masks ``(H_i, W_i)``."""
    sd = nt.sample_dim
    return sd >= 2 and nt._ragged == (sd - 2, sd - 1)


def prepare_images_for_compile(
    images: NestedTensor, strides: Iterable[Any] = (), levels: Iterable[Any] = ()
) -> NestedTensor:
    """Carry ``images``' host sides into compiled graphs (what every image batch with host sizes
    does by itself when it enters one; a batch built on a device reads its sizes here, once).

    ``strides`` and ``levels`` are accepted for compatibility and only checked: any geometry
    compiles without preparation (see the module doc). Returns ``images``."""
    op = "prepare_for_compile"
    if not isinstance(images, NestedTensor) or images.sample_dim != 3 or images._ragged != (1, 2):
        got = f"samples of rank {images.sample_dim} with ragged dims {images._ragged}" if isinstance(images, NestedTensor) else type(images).__name__
        raise StructureError(f"{op}(): expected images (C, H_i, W_i) with ragged sample dims (1, 2), got {got}")
    for entry in [*strides, *levels]:
        _as_level(op, entry)
    images.host_sizes()  # device-built batches: one read here, so the sides can be carried
    auto_image_sides(images)
    return images


@register_auto_carrier
def auto_image_sides(nt: NestedTensor) -> None:
    """Carry the host sides ``(B, 2)`` of a real image-like batch into a compiled graph. Runs from
    ``__tensor_flatten__`` only; does nothing for other layouts or for batches without host
    sizes (no sync is paid: the graph reads them at the first spatial op instead)."""
    m = nt._meta
    if m.host_sizes is None or not _is_image_like(nt):
        return
    key = (HOST_HW, nt._values.device)
    if key not in m.derived:
        hs = m.host_sizes
        hw = torch.stack([hs[:, -2], hs[:, -1]], 1)  # strides (2, 1) for every B (a view of B = 1 keeps (3, 1))
        _weak_dynamic(hw, {0})
        m.derived[key] = hw


# ------------------------------------------------------------------ records and row counts


@dataclasses.dataclass(eq=False)
class _Record:
    """What a traced image structure knows about its images: host sides (a CPU tensor of the
    graph), row count, envelope ``(H, W)`` and level; ``memo`` (shared by every structure from
    one graph input) maps a level to the record that first reached it."""

    hw: Tensor
    rows: Any
    env: tuple
    level: Any
    memo: dict
    dev_hw: Tensor | None = None  # the same sides on the values' device (the structure's own sizes)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return type(a) is type(b) and a == b


_REGISTRY: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _register(rec: _Record) -> None:
    """Remember which record each symbolic envelope entry belongs to (for ``size=x.shape[2:]``)."""
    for col, e in enumerate(rec.env):
        if isinstance(e, torch.SymInt):
            _REGISTRY.setdefault(e.node.shape_env, {})[e.node.expr] = (rec, col)


def lookup_extent(e: Any) -> tuple[_Record, int] | None:
    """The record and column (0: H, 1: W) whose envelope entry is the symbol ``e``."""
    if not isinstance(e, torch.SymInt):
        return None
    return _REGISTRY.get(e.node.shape_env, {}).get(e.node.expr)


def unresolved_extent(e: Any) -> str | None:
    """Why the symbol ``e`` (not an envelope entry of a record) still comes from a ragged extent,
    or None: arithmetic on image envelopes (``skip.shape[-1] // 3``), or the shape of a
    NestedTensor input that no spatial op has seen (its host sides are not known here). A
    NestedTensor input is recognised by its inner ``_sizes`` among the graph's sources."""
    if not isinstance(e, torch.SymInt):
        return None
    env = e.node.shape_env
    free = e.node.expr.free_symbols
    if any(k.free_symbols & free for k in _REGISTRY.get(env, {})):
        return "computed from an image batch's shape"
    names = {src.name for srcs in env.var_to_sources.values() for src in srcs}
    for sym in free:
        for src in env.var_to_sources.get(sym, ()):
            base = getattr(src, "base", None)
            if base is not None and f"{base.name}._sizes.size()[0]" in names:
                return f"read from the shape of the NestedTensor input {base.name}, which no spatial op has seen in this graph"
    return None


def record_of(x: NestedTensor) -> _Record:
    """``x``'s record; a graph input (or a structure without one) gets a new root record."""
    d, dev = x._meta.derived, x._values.device
    sd = x.sample_dim
    env = (x._env[sd - 2], x._env[sd - 1])
    rec = d.get((RECORD, dev))
    if rec is not None and _same(rec.env[0], env[0]) and _same(rec.env[1], env[1]):
        return rec
    hw = d.get((HOST_HW, dev))
    if hw is None:  # a batch built on a device without host sizes: one read, here
        hw = x._sizes[:, sd - 2 :].cpu()
    rec = _Record(hw, x._values.shape[0], env, IDENTITY, {}, x._sizes[:, sd - 2 :])
    rec.memo[IDENTITY] = rec
    d[(RECORD, dev)] = rec
    _register(rec)
    return rec


@contextlib.contextmanager
def _scalar_outputs():
    """Let ``.item()`` of (CPU) graph data make an unbacked symbol while this op is traced,
    whatever ``torch._dynamo.config.capture_scalar_outputs`` says (the handler is not user
    code: the symbol is the row count of its output)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode()
    if mode is None:
        yield
        return
    old = mode.allow_scalar_outputs
    mode.allow_scalar_outputs = True
    try:
        yield
    finally:
        mode.allow_scalar_outputs = old


def count(t: Tensor) -> Any:
    """The int in the 0-d CPU tensor ``t`` as an unbacked symbol (no device read)."""
    with _scalar_outputs():
        n = t.item()
    if isinstance(n, torch.SymInt):
        torch._check(n >= 0)
    return n


def pixel_count(hw: Tensor) -> Any:
    return count((hw[:, 0] * hw[:, 1]).sum())


def derive(
    x: NestedTensor, step: Any, host: Callable[[Tensor], Tensor], env: Callable[[], tuple], rows: Any = None,
    src: _Record | None = None,
) -> _Record:
    """The record of the output of a layer on ``x``: ``step`` is the layer's size map (a
    :data:`Level`, composed with the input's) or a hashable key naming it; ``host`` maps host
    sides to host sides; ``env`` gives the output envelope ``(H, W)``; ``rows`` is the output
    row count when the caller knows it (else the sum of the output's pixels, unbacked). A level
    reached before is reused: same sides, same row symbol."""
    rec = src if src is not None else record_of(x)
    level = None
    if isinstance(rec.level, tuple) and len(rec.level) == 2 and all(isinstance(a, AxisMap) for a in rec.level) and (
        isinstance(step, tuple) and len(step) == 2 and all(isinstance(a, AxisMap) for a in step)
    ):
        h, w = rec.level[0].then(step[0]), rec.level[1].then(step[1])
        level = None if h is None or w is None else (h, w)
    if level is None:
        level = ("after", rec.level, step)
    hit = rec.memo.get(level)
    if hit is not None:
        return hit
    hw = host(rec.hw)
    out = _Record(hw, pixel_count(hw) if rows is None else rows, tuple(env()), level, rec.memo)
    rec.memo[level] = out
    _register(out)
    return out


def fresh(base: _Record, tag: str, hw: Tensor, rows: Any, env: tuple, dev_hw: Tensor | None) -> _Record:
    """A record of sizes that no size map relates to ``base``'s level (fixed or per-image
    targets): a level of its own in ``base``'s memo, so later layers on it share symbols too."""
    level = (tag, len(base.memo))
    out = _Record(hw, rows, tuple(env), level, base.memo, dev_hw)
    base.memo[level] = out
    _register(out)
    return out


def traced_images(values: Tensor, sizes: Tensor, env: Sequence, rec: _Record | None) -> NestedTensor:
    """A traced image NestedTensor around ``values`` with device ``sizes`` ``(B, 3)`` and ``rec``."""
    meta = StructureMeta()
    dev = values.device
    if rec is not None:
        if rec.dev_hw is None:
            rec.dev_hw = sizes[:, 1:]
        meta.derived[(RECORD, dev)] = rec
    offsets = layout.offsets_from_counts(sizes[:, 1] * sizes[:, 2])
    return nested_from_values(values, offsets, sizes, (1, 2), tuple(env), meta)


def out_sizes(x: NestedTensor, channels: int, ohw: Tensor) -> Tensor:
    """Device sizes ``(B, 3)`` of images with ``channels`` and sides ``ohw`` (zero where the input
    image is empty or a side vanished, as the eager plan records them)."""
    return _with_channels(dead_zero(x._sizes[:, 1:], ohw), channels)


def dead_zero(hw: Tensor, ohw: Tensor) -> Tensor:
    """``ohw`` with zeros where the input image ``hw`` is empty or an output side vanished."""
    dead = (hw.prod(1) == 0) | (ohw <= 0).any(1)
    return torch.where(dead.unsqueeze(1), torch.zeros_like(ohw), ohw)


def _with_channels(ohw: Tensor, channels: int) -> Tensor:
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


def _eager_input(v: Tensor, sizes: Tensor, offsets: Tensor, ragged: Sequence[int], hw: Tensor | None) -> NestedTensor:
    """The op's input as an eager NestedTensor; its structure (and every plan cached on it) is
    kept for the next calls of the same sizes (backward, the next step). ``hw``: the host sides
    of image-like samples (their last two dims), so nothing is read from the device."""
    if hw is None:
        hs, ho = sizes.cpu(), offsets.cpu()  # real data at run time (a sync on a GPU)
    else:
        static = sizes.shape[1] - 2
        hs = torch.cat([torch.tensor(list(v.shape[1 : 1 + static]), dtype=torch.int64).expand(hw.shape[0], static), hw], 1)
        ho = layout.offsets_from_counts(hw[:, 0] * hw[:, 1])
    return rebuilt(v, offsets, sizes, ragged, hs, ho)


@torch.library.custom_op("padless::image_island", mutates_args=())
def image_island(
    name: str, spec: str, v: Tensor, sizes: Tensor, offsets: Tensor, ragged: list[int], hw: Tensor | None,
    tensors: list[Tensor], rows: int, static: list[int],
) -> Tensor:
    """The eager body ``name`` on the images ``(v, sizes, offsets)`` with host sides ``hw``:
    output rows ``(rows, *static)``."""
    nt = _eager_input(v, sizes, offsets, ragged, hw)
    with torch.no_grad():
        out = _FORWARD[name](nt, list(tensors), _spec(spec))
    if tuple(out.shape) != (rows, *static):
        raise StructureError(
            f"{name}(): under torch.compile the host sizes gave {rows} output rows of {tuple(static)}, the op "
            f"made {tuple(out.shape)}: the carried host sizes do not match the batch"
        )
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (v, *tensors)):
        return out.clone()
    return out.contiguous()


@image_island.register_fake
def _image_island_fake(name, spec, v, sizes, offsets, ragged, hw, tensors, rows, static):
    return v.new_empty((rows, *static))


@torch.library.custom_op("padless::image_island_backward", mutates_args=())
def image_island_backward(
    name: str, spec: str, grad: Tensor, v: Tensor, sizes: Tensor, offsets: Tensor, ragged: list[int],
    hw: Tensor | None, tensors: list[Tensor], needs: list[bool],
) -> list[Tensor]:
    """Gradients of :func:`image_island` for ``v`` and ``tensors`` (zeros where not needed)."""
    nt_args = (v, sizes, offsets, ragged, hw)
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
def _image_island_backward_fake(name, spec, grad, v, sizes, offsets, ragged, hw, tensors, needs):
    return [torch.empty_like(v), *(torch.empty_like(t) for t in tensors)]


def _setup(ctx, inputs, output) -> None:
    name, spec, v, sizes, offsets, ragged, hw, tensors, _, _ = inputs
    ctx.save_for_backward(v, sizes, offsets, hw, *tensors)
    ctx.args = (name, spec, list(ragged))
    ctx.needs = [v.requires_grad, *(t.requires_grad for t in tensors)]


def _backward(ctx, grad):
    v, sizes, offsets, hw, *tensors = ctx.saved_tensors
    name, spec, ragged = ctx.args
    if not any(ctx.needs):
        return None, None, None, None, None, None, None, [None] * len(tensors), None, None
    gs = image_island_backward(name, spec, grad.contiguous(), v, sizes, offsets, ragged, hw, tensors, ctx.needs)
    keep = [g if n else None for g, n in zip(gs, ctx.needs)]
    return None, None, keep[0], None, None, None, None, keep[1:], None, None


image_island.register_autograd(_backward, setup_context=_setup)


_INDEX: dict[str, Callable[[NestedTensor, tuple], Tensor]] = {}


def index_island(name: str) -> Callable:
    """Register ``fn(images, spec) -> int64 rows`` as the body of index island ``name``: an index
    into the input's rows that the graph then reads with plain ops (``index_select``, ``gather``),
    so the gather, its backward (a scatter) and the ops around it are the compiler's to fuse."""

    def deco(fn: Callable) -> Callable:
        if name in _INDEX:
            raise RuntimeError(f"padless internal: image index island {name!r} registered twice")
        _INDEX[name] = fn
        return fn

    return deco


@torch.library.custom_op("padless::image_index", mutates_args=())
def image_index(
    name: str, spec: str, v: Tensor, sizes: Tensor, offsets: Tensor, ragged: list[int], hw: Tensor | None,
    rows: int, static: list[int],
) -> Tensor:
    """The int64 index ``(rows, *static)`` that index island ``name`` reads off the images."""
    nt = _eager_input(v, sizes, offsets, ragged, hw)
    with torch.no_grad():
        out = _INDEX[name](nt, _spec(spec))
    if tuple(out.shape) != (rows, *static) or out.dtype != torch.int64:
        raise StructureError(
            f"{name}(): under torch.compile the host sizes gave an index of {rows} rows of {tuple(static)}, the op "
            f"made {tuple(out.shape)} {out.dtype}: the carried host sizes do not match the batch"
        )
    return out.clone()  # never a cached index: the graph owns its output


@image_index.register_fake
def _image_index_fake(name, spec, v, sizes, offsets, ragged, hw, rows, static):
    return v.new_empty((rows, *static), dtype=torch.int64)


def run_index(name: str, spec: tuple, x: NestedTensor, rows: Any, static: Sequence[int]) -> Tensor:
    """Call index island ``name`` on ``x`` (no gradient flows through an index)."""
    hw = record_of(x).hw if _is_image_like(x) else None
    return image_index(name, repr(spec), values_of(x).detach(), x._sizes, x._offsets, list(x._ragged), hw, rows, list(static))


def run_island(name: str, spec: tuple, x: NestedTensor, tensors: Sequence[Tensor | None], rows: Any, static: Sequence[int]) -> Tensor:
    """Call island ``name`` on ``x`` (``None`` tensors are left out; the body gets them in order
    of the non-None ones and reads ``spec`` to know which were given). Image-like inputs pass
    their host sides (their record's), so the island reads nothing from the device."""
    hw = record_of(x).hw if _is_image_like(x) else None
    return image_island(
        name, repr(spec), values_of(x), x._sizes, x._offsets, list(x._ragged), hw, [t for t in tensors if t is not None],
        rows, list(static),
    )
