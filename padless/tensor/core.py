"""The :class:`NestedTensor` representation and its two dispatch entry points.

Core builds on :mod:`padless.tensor.structure` (host metadata, carried maps, structure
comparison) and :mod:`padless.tensor.dynamo` (traced tensors, dynamic marks), and is built
on by every other tensor module. The few functions of those higher modules that the class
calls (the per-sample fallback, the broadcast guard of autograd, ``unbind`` for ``repr``)
are lent to core by name (:func:`padless.tensor.registry.lend`), never imported.
"""

from __future__ import annotations

import math
import threading
import weakref
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.tensor import layout, validate
from padless.tensor.dynamo import _is_traced, _mark_new, _TRACED_TYPES, source_fingerprint
from padless.tensor.errors import StructureError
from padless.tensor.lineage import Lineage, inherit
from padless.tensor.registry import ATEN_TABLE, FAST_POINTWISE, FUNCTION_TABLE, generic_aten_handler, lent, writes_first_arg
from padless.tensor.structure import (
    _EXACT_CARRIERS,
    AUTO_CARRIERS,
    CARRIED_INNER,
    StructureMeta,
    _structure_mismatch,
    carried_metadata,
    carry_on,
    handed_out,
    relaid_tangent,
    restore_metadata,
    static_change,
)

# Defined below core; re-exported because the op layer, padless.jagged, padless.collate
# and the tests have always imported them from padless.tensor.core.
from padless.tensor.dynamo import _weak_dynamic, mark_dynamic  # noqa: F401
from padless.tensor.structure import (  # noqa: F401
    CARRIED_KEYS,
    ROW_LEVEL_KEYS,
    _fmt_shape,
    check_same_structure,
    envelope_from_sizes,
    register_auto_carrier,
    register_carried,
)


class NeedsPerSample(Exception):
    """Raised below autograd when an ATen op needs the per-sample fallback, so that the
    torch-level call above it is re-run sample by sample *with* autograd."""

    def __init__(self, aten_op) -> None:
        super().__init__(str(aten_op))
        self.aten_op = aten_op


_TLS = threading.local()
# Torch-level calls that run the autograd engine (see ``NestedTensor.__torch_function__``).
_BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    if torch.is_grad_enabled():
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, Tensor) and a.requires_grad:
                return True
    return False


# ---------------------------------------------------------------------------- lent from above
# The class calls a few functions of modules that import core (autograd, convert, fallback),
# so core cannot import them: each module lends its function at import
# (:func:`padless.tensor.registry.lend`) and core looks it up once, on first use, then keeps
# it in the module global ``_<name>`` (the dispatch paths read one global, as for an import).
_guard_broadcast: Callable | None = None  # padless.tensor.autograd.guard_broadcast
_pointwise_with_grad: Callable | None = None  # padless.tensor.fast_grad.pointwise_with_grad
_per_sample: Callable | None = None  # padless.tensor.fallback.per_sample
_per_sample_function: Callable | None = None  # padless.tensor.fallback.per_sample_function
_unbind_samples: Callable | None = None  # padless.tensor.convert.unbind_samples
_backward_call: Callable | None = None  # padless.tensor.grad_rows.backward_call
_leaf_rows: Callable | None = None  # padless.tensor.leaf_rows.leaf_rows


def _borrow(name: str) -> Callable:
    fn = lent(name)
    globals()["_" + name] = fn
    return fn


_INT32_MAX = 2**31 - 1


class NestedTensor(Tensor):
    r"""A batch of differently shaped samples as one packed buffer plus their structure.

    Layout (three samples of shape ``(L_i, 2)``, ``L = 2, 0, 3``, ragged dim 0)::

        samples    [[a0 a1]    (empty)    [[c0 c1]
                    [b0 b1]]               [d0 d1]
                                           [e0 e1]]
        values     [[a0 a1] [b0 b1] [c0 c1] [d0 d1] [e0 e1]]   shape (5, 2)
        offsets    [0, 2, 2, 5]                                 int64 (B+1,)
        sizes      [[2, 2], [0, 2], [3, 2]]                     int64 (B, D)
        shape      (3, 3, 2)                                    padded envelope

    Several dims can be ragged. A ``(C, H_i, W_i)`` image sample is stored as its
    ``H_i * W_i`` pixels, each a row of ``C`` channels (ragged dims first, then the
    static ones): ``values`` is ``(sum_i H_i W_i, C)`` and ``ragged_dims == (1, 2)``.
    A ``(N_i, N_i, C)`` pair state is stored as ``N_i**2`` rows of ``C``.

    Inner tensors (what ``torch.compile`` sees as runtime inputs): ``_values``,
    ``_offsets``, ``_sizes`` (the latter two on the values' device). Static
    attributes (fixed per compiled program point): ``_ragged``, the ragged sample
    dims in storage order. Host metadata lives in a shared :class:`StructureMeta`.

    ``shape`` is the padded envelope ``(B, max n_0, ..., max n_{D-1})`` so code
    reading ``x.shape[-1]`` keeps working; storage is never padded.
    """

    # Declared once: everything else (flatten/unflatten, moves, equality, repr) derives from these.
    _INNER: tuple[str, ...] = ("_values", "_offsets", "_sizes")
    _ATTRS: tuple[str, ...] = ("_ragged",)

    _values: Tensor
    _offsets: Tensor
    _sizes: Tensor
    _ragged: tuple[int, ...]
    _env: tuple
    _meta: StructureMeta
    _lineage: Lineage | None = None  # the batch of samples it belongs to (padless.tensor.lineage)

    @staticmethod
    def __new__(
        cls,
        values: Tensor,
        offsets: Tensor,
        sizes: Tensor,
        ragged: tuple[int, ...],
        envelope: Sequence[int | torch.SymInt],
        meta: StructureMeta | None = None,
        requires_grad: bool = False,
    ) -> "NestedTensor":
        env = tuple(envelope)
        self = Tensor._make_wrapper_subclass(
            cls,
            (sizes.shape[0], *env),
            dtype=values.dtype,
            device=values.device,
            layout=values.layout,
            requires_grad=requires_grad,
        )
        self._values = values
        self._offsets = offsets
        self._sizes = sizes
        self._ragged = ragged
        self._env = env  # padded extent per sample dim == shape[1:], without a torch-function call
        self._meta = meta if meta is not None else StructureMeta()
        if not torch.compiler.is_compiling():
            _mark_new(self)  # every NestedTensor (detach, moves, op outputs): see mark_dynamic
        return self

    # ------------------------------------------------------------------ compile
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        ctx = tuple(getattr(self, a) for a in self._ATTRS)
        if AUTO_CARRIERS and not isinstance(self._values, _TRACED_TYPES) and not self._values.is_meta:
            if _EXACT_CARRIERS not in self._meta.derived:
                for fn in AUTO_CARRIERS:  # e.g. the pair row count (padless.ops.common.carried)
                    fn(self)
        carried = self._carried_names()
        if carried:  # row maps prepared for compiled row-creating ops (padless.ops.common.carried)
            return list(self._INNER) + ["_" + k for k in carried], ctx + (carried,)
        return list(self._INNER), ctx

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: tuple, expected_type: type | None = None):
        """A gradient fed to a compiled backward with exactly the carried maps (and the storage
        order) the graph traced its tangent with. None when a map it expects is missing."""
        if expected_type not in (None, type(self)):
            return None
        if expected_metadata[0] != self._ragged:  # stored in another order: re-laid out once
            return relaid_tangent(self, expected_metadata, expected_type)
        want = expected_metadata[1] if len(expected_metadata) > 1 else ()
        m, dev = self._meta, self._values.device
        meta = StructureMeta(m.host_sizes, m.host_offsets)
        for k in want:
            t = m.derived.get((k, dev))
            if t is None:
                return None
            meta.derived[(k, dev)] = t
        meta.derived[_EXACT_CARRIERS] = True
        return NestedTensor(self._values, self._offsets, self._sizes, self._ragged, self._env, meta)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size: Sequence, outer_stride: Sequence) -> "NestedTensor":
        ragged = ctx[0]
        meta = StructureMeta()
        dev = inner["_values"].device  # keyed by the values' device (a carried map may live on the CPU)
        for k in ctx[1] if len(ctx) > 1 else ():
            meta.derived[(k, dev)] = inner["_" + k]
        return NestedTensor(
            inner["_values"], inner["_offsets"], inner["_sizes"], ragged, tuple(outer_size[1:]), meta
        )

    def _carried_names(self) -> tuple[str, ...]:
        """Names of the cached row maps that flatten as extra inner tensors (see CARRIED_INNER)."""
        d = self._meta.derived
        dev = self._values.device
        return tuple(k for k in CARRIED_INNER if (k, dev) in d)

    def _stable_hash_for_caching(self) -> str:
        """Key for AOTAutograd's cache: the static attributes (inner tensors are keyed by torch)
        and a fingerprint of padless' source. The cache is keyed on Dynamo's graph, which
        calls padless' handlers without holding their code, so without the fingerprint an
        upgraded padless would be served graphs traced through the old handlers."""
        return f"padless.NestedTensor{tuple(getattr(self, a) for a in self._ATTRS)}{self._carried_names()}@{source_fingerprint()}"

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = FUNCTION_TABLE.get(func)
        if handler is None and func in _BACKWARD_CALLS:  # the autograd engine (tensor.grad_rows.backward_call)
            return (_backward_call or _borrow("backward_call"))(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():  # every result joins its input's batch (tensor.lineage)
            if handler is not None:
                return inherit(handler(func, *args, **kwargs), args, kwargs, NestedTensor)
            fast = FAST_POINTWISE.get(func)
            if fast is not None and not torch.compiler.is_compiling():
                if not _needs_grad(args, kwargs):
                    return inherit(fast(func, args, kwargs), args, kwargs, NestedTensor)
                out = (_pointwise_with_grad or _borrow("pointwise_with_grad"))(func, args, kwargs)
                if out is not None:  # one structure: plain autograd on the rows (tensor.fast_grad)
                    return inherit(out, args, kwargs, NestedTensor)
                args, kwargs = (_guard_broadcast or _borrow("guard_broadcast"))(args, kwargs, func)
            _TLS.depth = getattr(_TLS, "depth", 0) + 1
            try:
                out = func(*args, **kwargs)
            except NeedsPerSample as e:
                per_sample_function = _per_sample_function or _borrow("per_sample_function")
                out = per_sample_function(func, args, kwargs, e.aten_op)
            finally:
                _TLS.depth -= 1
            return inherit(out, args, kwargs, NestedTensor)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = ATEN_TABLE.get(func)
        if handler is None:
            handler = generic_aten_handler(func)
        if handler is None:
            per_sample = _per_sample or _borrow("per_sample")
            out = per_sample(func, args, kwargs, inside_function=getattr(_TLS, "depth", 0) > 0)
        else:
            out = handler(func, *args, **kwargs)
        if writes_first_arg(func) and args and isinstance(args[0], NestedTensor):  # graphs that saved the rows see it
            torch.autograd.graph.increment_version(args[0]._values)  # (below autograd no version bump)
        return out

    # ------------------------------------------------------------------ structure
    @property
    def ragged_dims(self) -> tuple[int, ...]:
        """Ragged sample dims (batch dim excluded), ascending. Never syncs."""
        return tuple(sorted(self._ragged))

    @property
    def storage_order(self) -> tuple[int, ...]:
        """Sample dims in the order rows and columns of ``values`` enumerate them. Never syncs."""
        return layout.storage_order(self._sizes.shape[1], self._ragged)

    @property
    def sample_dim(self) -> int:
        """Rank D of every sample (``self.dim() - 1``). Never syncs."""
        return self._sizes.shape[1]

    @property
    def batch_size(self) -> int:
        """Number of samples B. Never syncs."""
        return self._sizes.shape[0]

    def values(self) -> Tensor:  # type: ignore[override]
        """Packed buffer ``(T, *static)``, differentiable (gradients reach this NestedTensor).
        Never syncs; no copy (deferred rows, ``ops.pairs.pending``, are computed when read)."""
        v = values_of(self)  # a leaf's rows (tensor.leaf_rows) are handed out as a view of them
        return v.view(v.shape) if getattr(type(v), "padless_deferred", False) or (v.is_leaf and v.requires_grad) else v

    def offsets(self) -> Tensor:
        """Row offsets into ``values``, int64 ``(B+1,)`` on the values' device. Never syncs.

        A copy, made once per structure and cached (see
        :func:`padless.tensor.structure.handed_out`): writing into it (``z.offsets()[1] = 1``)
        leaves ``z`` intact, and the next call hands out a fresh copy.
        """
        return handed_out(self._meta, "offsets", self._offsets)

    def sizes(self) -> Tensor:
        """Exact shape of every sample, int64 ``(B, D)`` on the values' device. Never syncs.
        A copy made once per structure, like :meth:`offsets` (writes into it leave ``z`` intact)."""
        return handed_out(self._meta, "sizes", self._sizes)

    def lengths(self) -> Tensor:
        """Length of every sample along the only ragged dim, int64 ``(B,)``. Never syncs.
        A view of :meth:`sizes`' copy (writes into it leave ``z`` intact)."""
        if len(self._ragged) != 1:
            raise StructureError(
                f"lengths(): this NestedTensor has {len(self._ragged)} ragged dims {self.ragged_dims}; "
                "lengths() needs exactly one. Use sizes()[:, d] for ragged dim d."
            )
        return self.sizes()[:, self._ragged[0]]

    def host_sizes(self) -> Tensor:
        """``sizes`` on the CPU. Cached; syncs once only if the batch was built on a device
        without host metadata (collated batches always carry it).

        A copy made once per structure, like :meth:`offsets` (writes into it leave ``z`` intact).
        """
        m = self._meta
        if m.host_sizes is None:
            m.host_sizes = self._sizes.cpu()
        return handed_out(m, "host_sizes", m.host_sizes)

    def host_offsets(self) -> Tensor:
        """``offsets`` on the CPU. Cached; same sync rule as :meth:`host_sizes`.

        A copy made once per structure, like :meth:`offsets` (writes into it leave ``z`` intact).
        """
        m = self._meta
        if m.host_offsets is None:
            m.host_offsets = self._offsets.cpu()
        return handed_out(m, "host_offsets", m.host_offsets)

    def cu_seqlens(self) -> Tensor:
        """Row offsets as int32 on the values' device (flash-attention's ``cu_seqlens``).

        Cached per structure. Never syncs: made from the host copy when there is one
        (one host-to-device copy), else from ``offsets`` on the device.
        """
        key = ("cu_seqlens", self._offsets.device)
        m = self._meta
        hit = m.derived.get(key)
        if hit is None:
            src = m.host_offsets if m.host_offsets is not None else self._offsets
            if not _is_traced(self._offsets):
                rows = int(src[-1]) if src is m.host_offsets and src.numel() else self._values.shape[0]
                if rows > _INT32_MAX:
                    raise StructureError(
                        f"cu_seqlens(): the batch has {rows} rows, more than int32 holds ({_INT32_MAX}), "
                        "so int32 cu_seqlens would wrap around; use offsets() (int64) or split the batch"
                    )
            hit = src.to(dtype=torch.int32).to(self._offsets.device, non_blocking=True)
            if not _is_traced(self._offsets):
                m.derived[key] = hit
        return hit

    def max_seqlen(self, dim: int | None = None) -> int:
        """Largest extent along a ragged dim, as a python int (SymInt under compile).

        Read from the padded envelope: never syncs. ``dim`` is a sample dim
        (batch excluded) and may be omitted when there is one ragged dim.
        """
        if dim is None:
            if len(self._ragged) != 1:
                raise StructureError(
                    f"max_seqlen(): this NestedTensor has ragged dims {self.ragged_dims}; pass dim="
                )
            dim = self._ragged[0]
        return self._env[dim]

    def partitions(self) -> tuple[Tensor, ...]:
        """Host row splits per ragged level (see :func:`padless.tensor.layout.partitions`).

        Cached per structure; uses host sizes (see :meth:`host_sizes`)."""
        m = self._meta
        hit = m.derived.get("partitions")
        if hit is None:
            hit = layout.partitions(self.host_sizes(), self._ragged)
            m.derived["partitions"] = hit
        return hit

    def row_sample_ids(self) -> Tensor:
        """Sample index of every row of ``values`` (int64, values' device). Cached, no sync."""
        key = ("row_ids", self._values.device)
        m = self._meta
        hit = m.derived.get(key)
        if hit is None:
            if m.host_offsets is not None and not _is_traced(self._values):
                hit = layout.row_sample_ids(m.host_offsets, self._values.shape[0])
                hit = hit.to(self._values.device, non_blocking=True)
            else:
                hit = layout.row_sample_ids(self._offsets, self._values.shape[0])
            if not _is_traced(self._values):
                m.derived[key] = hit
        return hit

    def numel(self) -> int:  # type: ignore[override]
        """Number of real (unpadded) elements. Never syncs."""
        return self._values.numel()

    def padded_numel(self) -> int:
        """Elements of the padded envelope ``prod(shape)``. Never syncs."""
        return math.prod(self.shape)

    def occupancy(self) -> float:
        """Real elements over padded-envelope elements (1.0 means no padding saved). Never syncs."""
        env = self.padded_numel()
        return self.numel() / env if env else 1.0

    def same_structure(self, other: "NestedTensor") -> bool:
        """True when both hold samples of identical shapes in the same layout.

        Free when both share metadata or host sizes; otherwise compares device sizes (syncs).
        """
        return _structure_mismatch(self, other) is None

    def __repr__(self) -> str:  # type: ignore[override]
        head = (
            f"NestedTensor(batch={self.batch_size}, envelope={tuple(self.shape)}, "
            f"ragged_dims={self.ragged_dims}, dtype={self.dtype}, device={self.device}"
        )
        if self.grad_fn is not None:
            head += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            head += ", requires_grad=True"
        if _is_traced(self._values):
            return head + ")"
        unbind_samples = _unbind_samples or _borrow("unbind_samples")
        with torch.no_grad():
            samples = unbind_samples(self, differentiable=False)
        body = ",\n".join("  " + repr(s).replace("\n", "\n  ") for s in samples)
        return head + ")[\n" + body + "\n]"

    __str__ = __repr__

    def __reduce_ex__(self, protocol):
        return (
            _rebuild_nested,
            (
                self._values.detach(),
                self._offsets,
                self._sizes,
                self._ragged,
                tuple(int(s) for s in self._env),
                self._meta.host_sizes,
                self._meta.host_offsets,
                self.requires_grad,
                carried_metadata(self),
                self._lineage,  # one token per pickle: tensors of one batch stay one batch
            ),
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "NestedTensor.__deepcopy__: only leaf NestedTensors support deepcopy "
                "(same rule as torch.Tensor); call .detach() first"
            )
        meta = StructureMeta(
            None if self._meta.host_sizes is None else self._meta.host_sizes.clone(),
            None if self._meta.host_offsets is None else self._meta.host_offsets.clone(),
        )
        with torch.no_grad():
            out = NestedTensor(
                self._values.clone(),
                self._offsets.clone(),
                self._sizes.clone(),
                self._ragged,
                self._env,
                meta,
                requires_grad=self.requires_grad,
            )
        memo[id(self)] = out
        return out


carry_on(NestedTensor)  # every carried map ``k`` readable as ``nt._k`` (see structure.register_carried)


# --------------------------------------------------------------------------- values bridge
# NestedTensor -> values, differentiable; here because ``NestedTensor.values()`` calls it.


class _ValuesView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, nt: NestedTensor) -> Tensor:  # type: ignore[override]
        ctx.struct = (nt._offsets, nt._sizes, nt._ragged, nt._env, nt._meta)
        return nt._values.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        if any(st == 0 and (n > 1 if type(n) is int else torch.fx.experimental.symbolic_shapes.guard_or_true(n > 1)) for st, n in zip(grad.stride(), grad.shape)):
            # e.g. the expanded ones of ``values().sum()``: autograd may keep this gradient as a
            # leaf's ``.grad`` and accumulate into it in place, which an overlapping buffer refuses
            grad = grad.contiguous()
        return NestedTensor(grad, *ctx.struct)


def _apply(fn: type[torch.autograd.Function], *args):
    """``fn.apply`` without the Python wrapper's functorch bookkeeping when no functorch
    transform is active and nothing is being compiled (a few microseconds per op)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)  # type: ignore[misc]


_VALUES_VIEW_APPLY = super(torch.autograd.Function, _ValuesView).apply  # type: ignore[misc]  # (see _apply)


def values_of(nt: NestedTensor) -> Tensor:
    """``nt``'s packed buffer, differentiable w.r.t. ``nt`` when needed: the rows ``nt`` was built
    from (:func:`padless.tensor.autograd._with_history`), else one weakly kept view (:class:`_ValuesView`)."""
    if nt.requires_grad and torch.is_grad_enabled():
        d = nt.__dict__
        hit = d.get("_grad_rows")  # its rows, unchanged, nobody watching nt's gradient
        if hit is not None and hit[1] == nt._values._version and not nt.retains_grad and not nt._backward_hooks:
            d["_rows_taken"] = True  # a consumer reads the rows, not nt (tensor.grad_rows)
            return hit[0]  # (tensor.autograd._with_history)
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return _ValuesView.apply(nt)
        if nt.is_leaf and not nt._backward_hooks:  # its rows are the autograd leaf (tensor.leaf_rows)
            return (_leaf_rows or _borrow("leaf_rows"))(nt)
        seen = d.get("_rows_view")  # (weak view, the values it views, their version)
        if seen is not None and seen[1] is nt._values and seen[2] == nt._values._version:
            view = seen[0]()
            if view is not None:
                return view
        view = _VALUES_VIEW_APPLY(nt)
        d["_rows_view"] = (weakref.ref(view), nt._values, nt._values._version)  # weak: view -> node -> nt
        return view
    return nt._values


# ---------------------------------------------------------------------------- pickling


def _rebuild_nested(values, offsets, sizes, ragged, envelope, host_sizes, host_offsets, requires_grad, carried=None,
                    lineage=None):
    """Unpickling entry point (registered as a safe global for ``torch.load(weights_only=True)``).

    Nothing read from a file is trusted: the structure is checked and the envelope
    recomputed (:func:`padless.tensor.validate.check_structure`), and carried caches are
    validated before they are installed.

    ``map_location="meta"`` is refused: a meta tensor holds no data, so the structure
    could be neither checked nor known (the envelope is computed from the sizes).
    """
    if any(isinstance(t, Tensor) and t.is_meta for t in (values, offsets, sizes, host_sizes, host_offsets)):
        raise NotImplementedError(
            "NestedTensor (unpickled): loading on the meta device (map_location='meta') is not supported: "
            "a NestedTensor's structure (offsets, sizes) is data that must be read to be checked. "
            "Load it on 'cpu' (then .to('meta') if you only need shapes and dtypes)"
        )
    ragged, env, host_sizes, host_offsets = validate.check_structure(
        values, offsets, sizes, ragged, host_sizes, host_offsets
    )
    meta = StructureMeta(host_sizes, host_offsets)
    if carried is not None:
        if not isinstance(carried, dict):
            raise StructureError(f"NestedTensor (unpickled): carried metadata must be a dict, got {type(carried).__name__}")
        restore_metadata(meta, carried, values, offsets, ragged)
    out = NestedTensor(values, offsets, sizes, ragged, tuple(env), meta, requires_grad=bool(requires_grad))
    out._lineage = lineage if isinstance(lineage, Lineage) else Lineage()
    return out


# ---------------------------------------------------------------------------- helpers for handlers


def wrap_like(values: Tensor, like: NestedTensor) -> NestedTensor:
    """New NestedTensor with ``like``'s structure around ``values`` (no autograd link)."""
    if values.shape[1:] == like._values.shape[1:]:
        return NestedTensor(values, like._offsets, like._sizes, like._ragged, like._env, like._meta)
    return wrap_static_change(values, like)


def wrap_static_change(values: Tensor, like: NestedTensor) -> NestedTensor:
    """Like :func:`wrap_like` when the static extents changed (e.g. ``Linear(C, 4C)``)."""
    sizes, meta, env = static_change(values, like)
    return NestedTensor(values, like._offsets, sizes, like._ragged, env, meta)


def inner_tensors(nt: NestedTensor) -> list[Tensor]:
    return [getattr(nt, n) for n in nt._INNER]


def warn_once(key: Any, msg: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(msg, stacklevel=3)


_WARNED: set = set()
