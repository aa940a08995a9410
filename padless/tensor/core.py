"""The :class:`NestedTensor` representation and its two dispatch entry points."""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from padless.tensor import layout
from padless.tensor import validate
from padless.tensor.errors import StructureError
from padless.tensor.registry import ATEN_TABLE, FAST_POINTWISE, FUNCTION_TABLE, describe_args, lent, op_name


class NeedsPerSample(Exception):
    """Raised below autograd when an ATen op needs the per-sample fallback, so that the
    torch-level call above it is re-run sample by sample *with* autograd."""

    def __init__(self, aten_op) -> None:
        super().__init__(str(aten_op))
        self.aten_op = aten_op


_TLS = threading.local()
# Torch-level calls that run the autograd engine (see ``NestedTensor.__torch_function__``).
_BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

#: Row maps that ``__tensor_flatten__`` flattens as extra inner tensors when a structure
#: caches them under ``(name, device)``: their sizes are the row counts that ops create
#: (``sum N_i**2`` for pairs), so compiled graphs see those counts as symbols. Each name
#: ``k`` is readable as the attribute ``_k``. See :mod:`padless.ops.compile_rows`.
#: Extend it with :func:`register_carried` (never edit in place from another module).
CARRIED_INNER: list[str] = []
#: Derived keys that depend on the rows only; ops that keep the rows pass them on.
ROW_LEVEL_KEYS: list[str] = ["row_ids", "cu_seqlens", "pair_rows", "pair_groups"]


def register_carried(name: str, row_level: bool = True) -> str:
    """Declare a cached map ``meta.derived[(name, device)]`` that ``__tensor_flatten__``
    flattens as the extra inner tensor ``_<name>`` whenever a structure holds one, so a
    compiled graph sees its sizes (the row counts an op creates) as symbols.

    ``row_level=True``: the map depends on the rows only, so ops that keep the rows
    (pointwise math, linear, norms) pass it on to their output. Registering a name twice
    is harmless; returns ``name``."""
    if not name.isidentifier():
        raise ValueError(f"register_carried(): name must be an identifier, got {name!r}")
    if name not in CARRIED_INNER:
        CARRIED_INNER.append(name)
    if "NestedTensor" in globals() and not hasattr(NestedTensor, "_" + name):
        setattr(NestedTensor, "_" + name, _carried_property(name))
    if row_level and name not in ROW_LEVEL_KEYS:
        ROW_LEVEL_KEYS.append(name)
    return name


#: Key in ``meta.derived`` of a structure whose carried maps are fixed (no automatic ones).
_EXACT_CARRIERS = "exact_carriers"
#: Functions called on a real (not traced) NestedTensor when ``__tensor_flatten__`` hands it
#: to a compiled graph; each may cache carried maps on its structure (cheaply, from host
#: metadata), so batches compile without a preparation step. See :func:`register_auto_carrier`.
AUTO_CARRIERS: list[Callable[["NestedTensor"], None]] = []


def register_auto_carrier(fn: Callable[["NestedTensor"], None]) -> Callable[["NestedTensor"], None]:
    """Run ``fn(nt)`` whenever a real NestedTensor is flattened for ``torch.compile`` (never
    eagerly otherwise, never on traced tensors). ``fn`` must be idempotent and cheap on a
    structure it already served, since guards flatten every input on every call."""
    if fn not in AUTO_CARRIERS:
        AUTO_CARRIERS.append(fn)
    return fn
_INT32_MAX = 2**31 - 1


def _carried_property(name: str) -> property:
    """``nt._<name>``: the carried map, which torch's subclass machinery reads by the inner
    names that ``__tensor_flatten__`` returns."""

    def get(self: "NestedTensor") -> Tensor:
        return self._meta.derived[(name, self._values.device)]

    def set(self: "NestedTensor", value: Tensor) -> None:
        # AOTAutograd makes a tangent's strided inner tensors contiguous by assignment. The
        # tangent shares its structure with other tensors, so it gets its own copy of the
        # metadata: the others keep their (stride-0) carriers and their compiled guards.
        m = self._meta
        meta = StructureMeta(m.host_sizes, m.host_offsets)
        meta.derived.update(m.derived)
        meta.derived[(name, value.device)] = value
        self._meta = meta

    return property(get, set, doc=f"The carried ``{name}`` map (see :func:`register_carried`).")


class StructureMeta:
    """Host metadata shared by every NestedTensor of one structure.

    Operations that keep the structure (pointwise math, linear, dropout, moves)
    hand the same ``StructureMeta`` to their output, so structure checks between
    them are an identity test and derived metadata (``cu_seqlens``, row ids,
    padded indices, coordinate maps) is computed once per batch.

    ``host_sizes`` / ``host_offsets`` are CPU int64 tensors, or ``None`` when the
    batch was built from device tensors and nobody paid for a sync yet.
    ``derived`` maps a key such as ``("cu_seqlens", device)`` to a cached tensor.
    """

    __slots__ = ("host_sizes", "host_offsets", "derived")

    def __init__(self, host_sizes: Tensor | None = None, host_offsets: Tensor | None = None):
        self.host_sizes = host_sizes
        self.host_offsets = host_offsets
        self.derived: dict[Any, Any] = {}


from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # noqa: E402
from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor  # noqa: E402

_TRACED_TYPES = (_FakeTensor, _FunctionalTensor)


def _is_traced(t: Tensor) -> bool:
    """True for fake/functional/meta tensors: we are inside torch.compile or a meta trace."""
    if torch.compiler.is_compiling():  # first: the checks below would break a dynamo graph
        return True
    if isinstance(t, _TRACED_TYPES):
        return True
    return t.is_meta or torch._is_functional_tensor(t)


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, Tensor) and a.requires_grad:
            return True
    for a in kwargs.values():
        if isinstance(a, Tensor) and a.requires_grad:
            return True
    return False


def envelope_from_sizes(host_sizes: Tensor, ragged: Sequence[int], static_shape: Sequence[int]) -> list[int]:
    """Padded extent of every sample dim, from host sizes (no device involved)."""
    ndim = host_sizes.shape[1]
    env = [0] * ndim
    maxes = host_sizes.amax(0).tolist() if host_sizes.shape[0] > 0 else [0] * ndim
    for d in ragged:
        env[d] = int(maxes[d])
    for d, s in zip(layout.static_dims(ndim, ragged), static_shape):
        env[d] = int(s)
    return env


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
            _mark(self)  # every NestedTensor (detach, moves, op outputs): see mark_dynamic
        return self

    # ------------------------------------------------------------------ compile
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        ctx = tuple(getattr(self, a) for a in self._ATTRS)
        if AUTO_CARRIERS and not isinstance(self._values, _TRACED_TYPES) and not self._values.is_meta:
            if _EXACT_CARRIERS not in self._meta.derived:
                for fn in AUTO_CARRIERS:  # e.g. the pair row count (padless.ops.compile_rows)
                    fn(self)
        carried = self._carried_names()
        if carried:  # row maps prepared for compiled row-creating ops (padless.ops.compile_rows)
            return list(self._INNER) + ["_" + k for k in carried], ctx + (carried,)
        return list(self._INNER), ctx

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: tuple, expected_type: type | None = None):
        """A gradient fed to a compiled backward with exactly the carried maps the graph traced
        its tangent with (a real gradient may carry others, or get automatic ones when
        flattened). None when a map the graph expects is missing (torch then explains)."""
        if expected_type not in (None, type(self)) or expected_metadata[0] != self._ragged:
            return None
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
        for k in ctx[1] if len(ctx) > 1 else ():
            t = inner["_" + k]
            meta.derived[(k, t.device)] = t
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
        return f"padless.NestedTensor{tuple(getattr(self, a) for a in self._ATTRS)}{self._carried_names()}@{_source_fingerprint()}"

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = FUNCTION_TABLE.get(func)
        if handler is None and func in _BACKWARD_CALLS:
            # The engine runs backward formulas as ATen ops: an op without a handler there
            # runs per sample at ATen level (re-running ``backward`` per sample is wrong).
            # Only this hop is skipped: Python backward code (a custom ``autograd.Function``,
            # hooks) still sees NestedTensors at torch level, as when backward starts from a
            # dense loss.
            return torch.overrides.redispatch_function(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if handler is not None:
                return handler(func, *args, **kwargs)
            fast = FAST_POINTWISE.get(func)
            if fast is not None and not torch.compiler.is_compiling():
                if not _needs_grad(args, kwargs):
                    return fast(func, args, kwargs)
                from padless.tensor.autograd import guard_broadcast

                args, kwargs = guard_broadcast(args, kwargs)
            _TLS.depth = getattr(_TLS, "depth", 0) + 1
            try:
                return func(*args, **kwargs)
            except NeedsPerSample as e:
                from padless.tensor.fallback import per_sample_function

                return per_sample_function(func, args, kwargs, e.aten_op)
            finally:
                _TLS.depth -= 1

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = ATEN_TABLE.get(func)
        if handler is None:
            handler = _generic_aten_handler(func)
        if handler is None:
            from padless.tensor.fallback import per_sample

            return per_sample(func, args, kwargs, inside_function=getattr(_TLS, "depth", 0) > 0)
        return handler(func, *args, **kwargs)

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

        Never syncs; no copy.
        """
        from padless.tensor.autograd import values_of

        return values_of(self)

    def offsets(self) -> Tensor:
        """Row offsets into ``values``, int64 ``(B+1,)`` on the values' device. Never syncs."""
        return self._offsets

    def sizes(self) -> Tensor:
        """Exact shape of every sample, int64 ``(B, D)`` on the values' device. Never syncs."""
        return self._sizes

    def lengths(self) -> Tensor:
        """Length of every sample along the only ragged dim, int64 ``(B,)``. Never syncs."""
        if len(self._ragged) != 1:
            raise ValueError(
                f"lengths(): this NestedTensor has {len(self._ragged)} ragged dims {self.ragged_dims}; "
                "lengths() needs exactly one. Use sizes()[:, d] for ragged dim d."
            )
        return self._sizes[:, self._ragged[0]]

    def host_sizes(self) -> Tensor:
        """``sizes`` on the CPU. Cached; syncs once only if the batch was built on a device
        without host metadata (collated batches always carry it)."""
        m = self._meta
        if m.host_sizes is None:
            m.host_sizes = self._sizes.cpu()
        return m.host_sizes

    def host_offsets(self) -> Tensor:
        """``offsets`` on the CPU. Cached; same sync rule as :meth:`host_sizes`."""
        m = self._meta
        if m.host_offsets is None:
            m.host_offsets = self._offsets.cpu()
        return m.host_offsets

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
                raise ValueError(
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
        from padless.tensor.convert import unbind_samples

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


_FINGERPRINT: list[str] = []


def _source_fingerprint() -> str:
    """blake2b of every padless ``.py`` file (path and content), computed once per process."""
    if not _FINGERPRINT:
        import hashlib
        import pathlib

        root = pathlib.Path(__file__).resolve().parent.parent
        h = hashlib.blake2b(digest_size=12)
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        _FINGERPRINT.append(h.hexdigest())
    return _FINGERPRINT[0]


def _rebuild_nested(values, offsets, sizes, ragged, envelope, host_sizes, host_offsets, requires_grad, carried=None):
    """Unpickling entry point (registered as a safe global for ``torch.load(weights_only=True)``).

    Nothing read from a file is trusted: the structure is checked and the envelope
    recomputed (:func:`padless.tensor.validate.check_structure`), and carried caches are
    validated before they are installed.
    """
    ragged, env, host_sizes, host_offsets = validate.check_structure(
        values, offsets, sizes, ragged, host_sizes, host_offsets
    )
    meta = StructureMeta(host_sizes, host_offsets)
    if carried is not None:
        if not isinstance(carried, dict):
            raise StructureError(f"NestedTensor (unpickled): carried metadata must be a dict, got {type(carried).__name__}")
        restore_metadata(meta, carried, values, offsets, ragged)
    return NestedTensor(values, offsets, sizes, ragged, tuple(env), meta, requires_grad=bool(requires_grad))


#: Derived entries keyed ``(name, device)`` that pickling carries, so metadata a DataLoader
#: worker computed (``padless.collate``) is not recomputed by the main process. Plain
#: tensors in a dict: ``torch.load(weights_only=True)`` accepts them.
CARRIED_KEYS = ("cu_seqlens", "row_ids")


register_carried("pair_rows")  # padless.ops.compile_rows: (sum N_i**2,) pair row map


def carried_metadata(nt: NestedTensor) -> dict[str, Any] | None:
    """The cached row-level metadata of ``nt`` that pickling carries (None when none is cached)."""
    m = nt._meta
    out: dict[str, Any] = {}
    for name in CARRIED_KEYS:
        t = m.derived.get((name, nt._values.device))
        if isinstance(t, Tensor):
            out[name] = t
    parts = m.derived.get("partitions")
    if isinstance(parts, tuple):
        out["partitions"] = list(parts)
    return out or None


def restore_metadata(
    meta: StructureMeta, carried: dict[str, Any], values: Tensor, offsets: Tensor, ragged: tuple[int, ...]
) -> None:
    """Install carried metadata into ``meta`` after checking it against the structure.

    Entries on another device than the one they serve are dropped; entries that disagree
    with the offsets and sizes raise :class:`StructureError` (a forged ``row_ids`` would
    otherwise mix samples). ``meta`` must hold validated host sizes and offsets.
    """
    hs, ho = meta.host_sizes, meta.host_offsets
    if hs is None or ho is None:
        return  # nothing to check against: caches are rebuilt on first use instead
    good = validate.check_carried(carried, ragged, hs, ho, values, offsets.device)
    if "cu_seqlens" in good:
        meta.derived[("cu_seqlens", offsets.device)] = good["cu_seqlens"]
    if "row_ids" in good:
        meta.derived[("row_ids", values.device)] = good["row_ids"]
    if "partitions" in good:
        meta.derived["partitions"] = good["partitions"]


# ---------------------------------------------------------------------------- helpers for handlers


def mark_dynamic(nt: NestedTensor) -> NestedTensor:
    """Tell ``torch.compile`` that batch size, ragged extents and row counts vary.

    Called by every user-facing constructor, so a compiled function sees these
    dims as symbolic from its first call: new lengths or a new batch size reuse
    the same graph instead of recompiling. (0 and 1 are still specialised by
    dynamo, as for any tensor.)
    """
    if not torch.compiler.is_compiling():
        _mark(nt)
    return nt


def _mark(nt: NestedTensor) -> None:
    """Weak-dynamic marks on ``nt`` and its inner tensors (what :func:`mark_dynamic` does).

    ``NestedTensor.__new__`` calls it for every instance, so a batch made by ``detach()``,
    ``to()``, an op run eagerly before a compiled region, or any other path is dynamic
    from its first compiled call. Dims marked this way get their own symbols (no duck
    sizing): a batch size equal to a ragged extent on the first call does not tie the
    two together, so the next batch does not recompile.
    """
    _weak_dynamic(nt, {0, *(r + 1 for r in nt._ragged)})
    _weak_dynamic(nt._values, {0})
    _weak_dynamic(nt._offsets, {0})
    _weak_dynamic(nt._sizes, {0})


def _weak_dynamic(t: Tensor, dims: set) -> None:
    cur = getattr(t, "_dynamo_weak_dynamic_indices", None)
    if cur is None:
        t._dynamo_weak_dynamic_indices = set(dims)
    else:
        cur.update(dims)
    t._has_dynamo_dim_marking = True



def wrap_like(values: Tensor, like: NestedTensor) -> NestedTensor:
    """New NestedTensor with ``like``'s structure around ``values`` (no autograd link)."""
    if values.shape[1:] == like._values.shape[1:]:
        return NestedTensor(values, like._offsets, like._sizes, like._ragged, like._env, like._meta)
    return wrap_static_change(values, like)


def wrap_static_change(values: Tensor, like: NestedTensor) -> NestedTensor:
    """Like :func:`wrap_like` when the static extents changed (e.g. ``Linear(C, 4C)``)."""
    sizes, meta, env = static_change(values, like)
    return NestedTensor(values, like._offsets, sizes, like._ragged, env, meta)


def static_change(values: Tensor, like: NestedTensor) -> tuple[Tensor, StructureMeta, tuple]:
    """``(sizes, meta, envelope)`` of ``like``'s rows with ``values``' static extents.

    Cached on ``like``'s metadata per static shape, so a layer applied to the same batch
    every step reuses one structure (and everything cached on it).
    """
    ndim = like.sample_dim
    static = layout.static_dims(ndim, like._ragged)
    if values.dim() - 1 != len(static):
        raise RuntimeError(
            f"padless internal: values of rank {values.dim()} do not fit a layout with "
            f"{len(static)} static dims"
        )
    traced = _is_traced(values)
    key = ("static_shape", like._ragged, tuple(values.shape[1:]))
    hit = None if traced else like._meta.derived.get(key)
    if hit is not None:
        return hit
    new_static = list(values.shape[1:])
    sizes = like._sizes.clone()
    if len(static):
        sizes[:, list(static)] = torch.tensor(new_static, dtype=torch.int64, device=sizes.device)
    meta = StructureMeta()
    if like._meta.host_sizes is not None:
        hs = like._meta.host_sizes.clone()
        if len(static):
            hs[:, list(static)] = torch.tensor(new_static, dtype=torch.int64)
        meta.host_sizes = hs
        meta.host_offsets = like._meta.host_offsets
    for k, v in like._meta.derived.items():  # row-level caches do not depend on static extents
        if isinstance(k, tuple) and k[0] in ROW_LEVEL_KEYS:
            meta.derived[k] = v
    env = list(like._env)
    for d, s in zip(static, new_static):
        env[d] = s
    out = (sizes, meta, tuple(env))
    if not traced:
        like._meta.derived[key] = out
    return out


def _fmt_shape(row: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(x)) for x in row) + (",)" if len(row) == 1 else ")")


def _structure_mismatch(
    a: NestedTensor, b: NestedTensor, opname: Any = None, broadcast: bool = False
) -> str | None:
    """None when a and b have the same structure, else a message naming the first differing sample.

    Under ``torch.compile`` sizes are runtime data: with ``opname`` given, the graph gets a
    check that raises the eager error when it runs (:mod:`padless.tensor.traced_checks`;
    ``broadcast`` words it as pointwise broadcasting does), and this returns None."""
    if a._meta is b._meta or a._sizes is b._sizes:
        return None if a._ragged == b._ragged else _layout_msg(a, b)
    if a.batch_size != b.batch_size:
        return f"batch sizes differ: {a.batch_size} vs {b.batch_size}"
    if a.sample_dim != b.sample_dim:
        return f"sample ranks differ: {a.sample_dim} vs {b.sample_dim}"
    if set(a._ragged) != set(b._ragged):
        return f"ragged dims differ: {a.ragged_dims} vs {b.ragged_dims}"
    if a._ragged != b._ragged:
        return _layout_msg(a, b)
    if _is_traced(a._sizes) or _is_traced(b._sizes):
        # Under torch.compile sizes are runtime data: compared when the graph runs.
        if opname is not None and a._sizes is not b._sizes:
            from padless.tensor.traced_checks import check_same_sizes

            check_same_sizes(a._sizes, b._sizes, list(a._ragged), str(opname), broadcast)
        return None
    if a._meta.host_sizes is not None and b._meta.host_sizes is not None:
        sa, sb = a._meta.host_sizes, b._meta.host_sizes
    else:
        sa, sb = a._sizes, b._sizes.to(a._sizes.device)
    if torch.equal(sa, sb):
        if a._meta.host_sizes is not None and b._meta.host_sizes is not None:
            b._meta = a._meta  # same structure: share metadata, so the next check is an identity test
        return None
    rdims = list(a._ragged)
    ra, rb = sa[:, rdims], sb[:, rdims]
    if torch.equal(ra, rb):
        return None
    bad = int((ra != rb).any(1).nonzero()[0, 0])
    return f"sample {bad} has {_fmt_shape(sa[bad].tolist())}, other has {_fmt_shape(sb[bad].tolist())}"


def _layout_msg(a: NestedTensor, b: NestedTensor) -> str:
    return (
        f"storage orders differ: ragged dims stored as {a._ragged} vs {b._ragged} "
        "(one of them was transposed); call .contiguous() on both"
    )


def check_same_structure(opname: str, a: NestedTensor, b: NestedTensor) -> None:
    msg = _structure_mismatch(a, b, opname)
    if msg is not None:
        raise StructureError(f"{opname}(): ragged structures differ: {msg}")


# ---------------------------------------------------------------------------- generic aten path

_GENERIC_CACHE: dict[Any, Any] = {}


def _generic_aten_handler(func):
    hit = _GENERIC_CACHE.get(func, False)
    if hit is not False:
        return hit
    handler = None
    if torch.Tag.pointwise in func.tags:
        handler = lent("pointwise_aten")  # the generic pointwise path, lent by padless.ops.pointwise
    _GENERIC_CACHE[func] = handler
    return handler


def inner_tensors(nt: NestedTensor) -> list[Tensor]:
    return [getattr(nt, n) for n in nt._INNER]


def warn_once(key: Any, msg: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(msg, stacklevel=3)


_WARNED: set = set()
