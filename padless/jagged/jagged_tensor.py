"""JaggedTensor: one ragged axis over packed values, TorchRec's type on padless' layout."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.utils._pytree
from torch import Tensor
from torch.fx._pytree import register_pytree_flatten_spec

from padless.jagged import _checks as C
from padless.jagged import _torchrec, fx
from padless.tensor.errors import StructureError

if TYPE_CHECKING:
    from padless.tensor.core import NestedTensor


class JaggedTensor:
    """A batch of variable-length slices of one packed ``values`` buffer (optionally weighted).

    Six slices, lengths ``2, 0, 1, 1, 1, 3``::

        slice    0        1     2     3     4     5
               [1, 2]    []    [3]   [4]   [5]   [6, 7, 8]

        values  = [1, 2, 3, 4, 5, 6, 7, 8]          (T,) or (T, *static): slices' rows, packed
        lengths = [2, 0, 1, 1, 1, 3]                (B,)
        offsets = [0, 2, 2, 3, 4, 5, 8]             (B+1,) slice i is values[offsets[i]:offsets[i+1]]
        weights = same shape as values, or None

    This is padless' packed layout (``NestedTensor.values()`` / ``offsets()``) with one
    ragged dim, so ``to_nested()`` and ``from_nested()`` are views, not copies.

    Give ``lengths`` or ``offsets`` (or both); the other is derived on request and
    cached. Accessors say what they cost: ``lengths()``/``offsets()`` compute (no
    sync) and cache, ``*_or_none()`` never compute.

    Construction is lazy, as in TorchRec: it checks types and ranks only. The structure
    of host (CPU) lengths/offsets (lengths >= 0, offsets from 0 and never decreasing, the
    two agreeing, values and weights long enough) is checked the first time
    values are read through them (``to_dense()``, ``to_padded_dense()``, ``to_nested()``,
    ``str()``, pooling, ``host_offsets()``), or at once with ``validate()``; an invalid
    structure raises there, every time, with the same message. What TorchRec accepts
    without reading values (``lengths()``, ``offsets()``, ``to(device)``, ``pin_memory()``)
    works on it, and the fault travels with the moved copy. A host copy of valid offsets
    is kept, so nothing waits on a device after ``to(device)``. Tensors given on a device
    are trusted (never read back), as in TorchRec.

    >>> jt = JaggedTensor(values=torch.tensor([1., 2, 3, 4, 5, 6, 7, 8]),
    ...                   offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    >>> jt.lengths()
    tensor([2, 0, 1, 1, 1, 3])
    >>> [t.tolist() for t in jt.to_dense()]
    [[1.0, 2.0], [], [3.0], [4.0], [5.0], [6.0, 7.0, 8.0]]
    """

    __slots__ = ("_values", "_weights", "_lengths", "_offsets", "_host_offsets", "_unchecked", "_fault")

    def __init__(
        self,
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> None:
        what = "JaggedTensor"
        if not isinstance(values, Tensor):
            if fx.stand_in(self, type(self), (values, weights, lengths, offsets), {}):
                return  # built from traced tensors under torch.fx: stands in for the graph node
            raise TypeError(f"{what}: values must be a tensor, got {type(values).__name__}")
        fx.refuse_jit_trace(what)
        if values.dim() < 1:
            raise ValueError(f"{what}: values must have a row dim (T, *static), got a 0-d tensor")
        if lengths is None and offsets is None:
            raise ValueError(f"{what}: pass lengths= or offsets= (or both)")
        fault = C.weights_fault(what, weights)
        if lengths is not None:
            C.check_int(what, "lengths", lengths)
        if offsets is not None:
            C.check_int(what, "offsets", offsets)
            if lengths is not None and offsets.numel() and offsets.numel() != lengths.numel() + 1:
                raise StructureError(
                    f"{what}: offsets must have len(lengths) + 1 = {lengths.numel() + 1} entries, got {offsets.numel()}"
                )
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._host_offsets: Tensor | None = None
        self._unchecked = True  # the structure checks run on first need (``_scan()``)
        self._fault: str | None = fault  # what makes values unreadable (raised by readers), if anything

    @classmethod
    def _make(
        cls,
        values: Tensor,
        weights: Tensor | None,
        lengths: Tensor | None,
        offsets: Tensor | None,
        host_offsets: Tensor | None,
    ) -> "JaggedTensor":
        """Internal: trusted parts (already validated), no checks."""
        fx.refuse_jit_trace("JaggedTensor")
        jt = cls.__new__(cls)
        jt._values, jt._weights, jt._lengths, jt._offsets = values, weights, lengths, offsets
        jt._host_offsets = host_offsets
        jt._unchecked = False
        jt._fault = None
        return jt

    def _scan(self) -> None:
        """Run the checks construction defers, once: valid host offsets are kept, a fault is
        recorded (not raised: see ``_host``)."""
        host, fault = C.host_offsets("JaggedTensor", self._lengths, self._offsets, self._values.shape[0])
        if fault is None and host is not None and self._weights is not None:
            fault = C.short_weights("JaggedTensor", self._weights, int(host.numpy()[-1]))
        self._fault = self._fault or fault
        self._host_offsets = host if self._fault is None else None
        self._unchecked = False

    def _host(self) -> Tensor | None:
        """Host offsets when known or readable without a sync (None for device-built tensors),
        for what reads values through them. The first call on a host-built JaggedTensor checks
        its structure; an invalid one raises here, every time it is asked."""
        if self._unchecked:
            self._scan()
        if self._fault is not None:
            raise StructureError(self._fault)
        return self._host_offsets

    def validate(self) -> "JaggedTensor":
        """Run the structure checks now (a no-op once done, and for tensors on a device, which
        are trusted); returns self. ``padless.jagged.validate(jt)`` does the same."""
        self._host()
        return self

    # ------------------------------------------------------------------ accessors

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        """The weights; raises if this JaggedTensor has none (see ``weights_or_none``)."""
        if self._weights is None:
            raise ValueError("JaggedTensor.weights(): this JaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def lengths(self) -> Tensor:
        """Slice lengths ``(B,)``; derived from offsets on their device (no sync) and cached."""
        if self._unchecked:
            self._scan()  # checked on the tensors given, before a derived one is cached (never raises)
        if self._lengths is None:
            off = self._require(self._offsets)
            self._lengths = C.lengths_from_offsets(off) if off.numel() else off.new_empty(0)
        return self._lengths

    @staticmethod
    def _require(t: Tensor | None) -> Tensor:
        if t is None:  # construction guarantees one of lengths/offsets; reaching this is a bug
            raise RuntimeError("padless internal: a JaggedTensor lost both its lengths and its offsets")
        return t

    def lengths_or_none(self) -> Tensor | None:
        return self._lengths

    def offsets(self) -> Tensor:
        """Offsets ``(B+1,)``; derived from lengths on their device (no sync) and cached."""
        if self._unchecked:
            self._scan()  # checked on the tensors given, before a derived one is cached (never raises)
        if self._offsets is None:
            self._offsets = C.offsets_from_lengths(self._require(self._lengths))
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        return self._offsets

    def host_offsets(self) -> Tensor:
        """Offsets ``(B+1,)`` as a CPU int64 tensor, cached. Syncs once only for a JaggedTensor
        built from device tensors (anything built on the host, then moved, carries it)."""
        if self._host() is None:
            off = self.offsets()
            self._host_offsets = off.to("cpu", torch.int64) if off.numel() else torch.zeros(1, dtype=torch.int64)
        return self._host_offsets

    def _end(self) -> int:
        """Rows of values the slices use (values may hold a tail past them; reads host offsets)."""
        return int(self.host_offsets().numpy()[-1])

    def device(self) -> torch.device:
        return self._values.device

    def batch_size(self) -> int:
        """Number of slices B (no sync)."""
        if self._lengths is not None:
            return self._lengths.numel()
        return C.count(self._offsets, offsets=True)

    def __len__(self) -> int:
        return self.batch_size()

    # ------------------------------------------------------------------ dense views

    def to_dense(self) -> list[Tensor]:
        """One tensor per slice (views of ``values``); reads host offsets."""
        return list(torch.split(C.used(self._values, self._end()), self._host_lengths()))

    def to_dense_weights(self) -> list[Tensor] | None:
        if self._weights is None:
            return None
        return list(torch.split(C.used(self._weights, self._end()), self._host_lengths()))

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> Tensor:
        """Dense ``(B, N, *static)``: slices padded with ``padding_value`` to ``N`` rows.

        ``N = desired_length``, or the longest slice when None; slices longer than
        ``desired_length`` are truncated (as TorchRec documents).

        >>> jt = JaggedTensor(values=torch.tensor([1., 2, 3, 4, 5, 6, 7, 8]),
        ...                   offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
        >>> jt.to_padded_dense(desired_length=2, padding_value=10.0).tolist()
        [[1.0, 2.0], [10.0, 10.0], [3.0, 10.0], [4.0, 10.0], [5.0, 10.0], [6.0, 7.0]]
        """
        return self._padded(self._values, desired_length, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> Tensor | None:
        if self._weights is None:
            return None
        return self._padded(self._weights, desired_length, padding_value)

    def _host_lengths(self) -> list[int]:
        return C.lengths_from_offsets(self.host_offsets()).tolist()

    def _padded(self, src: Tensor, desired_length: int | None, padding_value: float) -> Tensor:
        if desired_length is not None and desired_length < 0:
            raise ValueError(f"JaggedTensor.to_padded_dense: desired_length must be >= 0, got {desired_length}")
        if src.device.type != "cpu":
            return self._padded_device(src, desired_length, padding_value)
        ho = self._host_offsets if not self._unchecked else None
        h = (ho if ho is not None else self.host_offsets()).numpy()
        b = h.size - 1
        if b == 0:
            return src.new_full((0, int(desired_length or 0), *src.shape[1:]), padding_value)
        mask, keep, n = _pad_mask(h, desired_length)
        end = int(h[-1])
        rows = src if src.shape[0] == end else src[:end]
        if keep is not None:
            rows = rows.index_select(0, torch.from_numpy(keep))
        npd = _NUMPY_DTYPES.get(rows.dtype)
        if npd is not None and not rows.requires_grad:
            # no autograd to record: numpy's boolean assignment (no torch dispatch at all)
            shape = (b, n, *src.shape[1:])
            dense = np.zeros(shape, dtype=npd) if padding_value == 0 else np.full(shape, padding_value, dtype=npd)
            dense[mask] = rows.numpy()
            return torch.from_numpy(dense)
        out = src.new_full((b, n, *src.shape[1:]), padding_value)
        m = torch.from_numpy(mask)
        if src.dim() > 1:
            m = m.view(b, n, *[1] * (src.dim() - 1)).expand(out.shape)
        # one masked scatter fills every slice's rows in order (autograd: a masked select)
        return out.masked_scatter_(m, rows)

    def _padded_device(self, src: Tensor, desired_length: int | None, padding_value: float) -> Tensor:
        """Device path: one scatter computed on the device from its offsets (no sync; the
        width comes from the host offsets)."""
        ho = self.host_offsets()
        b = ho.numel() - 1
        n = int(C.lengths_from_offsets(ho).max()) if desired_length is None else int(desired_length)
        total = int(ho[-1])
        if total == 0 or n == 0:
            return src.new_full((b, n, *src.shape[1:]), padding_value)
        # a flat buffer with a spill slot for truncated rows: no boolean indexing, so no sync
        out = src.new_full((b * n + 1, *src.shape[1:]), padding_value)
        off = self.offsets().to(torch.int64)
        rows = torch.repeat_interleave(torch.arange(b, device=src.device), off[1:] - off[:-1], output_size=total)
        pos = torch.arange(total, device=src.device) - off[:-1][rows]
        dest = torch.where(pos < n, rows * n + pos, b * n)
        out.index_put_((dest,), C.used(src, total))  # truncated rows all land in the spill slot, then dropped
        return out[: b * n].view(b, n, *src.shape[1:])

    # ------------------------------------------------------------------ constructors

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        """A JaggedTensor of zero slices (``lengths == []`` and, as in TorchRec, ``offsets == []``)."""
        w = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=w,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            offsets=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    @fx.leaf
    def empty_like(jt: "JaggedTensor", device: torch.device | str | None = None) -> "JaggedTensor":
        """Zero slices with ``jt``'s dtypes on its device; with ``device`` given, uninitialised
        tensors of ``jt``'s shapes on that device instead (TorchRec's two meanings)."""
        w = jt.weights_or_none()
        if device is None:
            dev = jt.device()
            return JaggedTensor(
                values=torch.empty(0, dtype=jt.values().dtype, device=dev),
                weights=None if w is None else torch.empty(0, dtype=w.dtype, device=dev),
                lengths=torch.empty(0, dtype=jt.lengths().dtype, device=dev),
            )
        return JaggedTensor._make(
            torch.empty_like(jt.values(), device=device),
            None if w is None else torch.empty_like(w, device=device),
            None if jt.lengths_or_none() is None else torch.empty_like(jt.lengths(), device=device),
            None if jt.offsets_or_none() is None else torch.empty_like(jt.offsets(), device=device),
            None,
        )

    @staticmethod
    def from_dense(values: Sequence[Tensor], weights: Sequence[Tensor] | None = None) -> "JaggedTensor":
        """Pack a list of slices ``(L_i, *static)`` (lengths are int32, as in TorchRec).

        >>> jt = JaggedTensor.from_dense([torch.tensor([1.]), torch.tensor([]), torch.tensor([7., 8.])])
        >>> jt.values().tolist(), jt.lengths().tolist()
        ([1.0, 7.0, 8.0], [1, 0, 2])
        """
        what = "JaggedTensor.from_dense"
        vals = [torch.as_tensor(v) for v in values]
        if weights is not None and len(weights) != len(vals):
            raise ValueError(f"{what}: got {len(vals)} value slices but {len(weights)} weight slices")
        device = vals[0].device if vals else None
        lengths = torch.tensor([v.shape[0] if v.dim() else 1 for v in vals], dtype=torch.int32)
        vt = torch.cat([v.reshape(-1) if v.dim() <= 1 else v for v in vals]) if vals else torch.empty(0)
        wt = None
        if weights is not None:
            ws = [torch.as_tensor(w) for w in weights]
            for i, (v, w) in enumerate(zip(vals, ws)):
                if w.shape != v.shape:
                    raise ValueError(
                        f"{what}: weights[{i}] has shape {tuple(w.shape)} but values[{i}] has {tuple(v.shape)}"
                    )
            wt = torch.cat([w.reshape(-1) if w.dim() <= 1 else w for w in ws]) if ws else torch.empty(0)
        if device is not None and device.type != "cpu":
            jt = JaggedTensor(values=vt, weights=wt, lengths=lengths)
            return jt.to(device)
        return JaggedTensor(values=vt, weights=wt, lengths=lengths)

    @staticmethod
    @fx.leaf
    def from_dense_lengths(values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> "JaggedTensor":
        """Keep the first ``lengths[i]`` entries of row i of a dense ``(B, N, *static)`` tensor."""
        what = "JaggedTensor.from_dense_lengths"
        if values.dim() < 2:
            raise ValueError(f"{what}: values must be (B, N, *static), got shape {tuple(values.shape)}")
        C.check_int(what, "lengths", lengths)
        if lengths.numel() != values.shape[0]:
            raise ValueError(f"{what}: lengths has {lengths.numel()} entries but values has {values.shape[0]} rows")
        if C.is_host(lengths) and lengths.numel() and bool(((lengths < 0) | (lengths > values.shape[1])).any()):
            raise ValueError(
                f"{what}: lengths must lie in [0, {values.shape[1]}] (the dense width), got {lengths.tolist()}"
            )
        C.check_weights(what, weights, values)
        mask = torch.arange(values.shape[1], device=values.device)[None, :] < lengths.to(values.device)[:, None]
        return JaggedTensor(values=values[mask], weights=None if weights is None else weights[mask], lengths=lengths)

    # ------------------------------------------------------------------ padless interop

    def to_nested(self, *, weights: bool = False) -> "NestedTensor":
        """A ``padless.NestedTensor`` of samples ``(L_i, *static)`` viewing ``values``
        (or ``weights`` with ``weights=True``); no copy, autograd kept."""
        from padless.tensor.construct import from_values

        ho = self.host_offsets()
        src = C.used(self.weights() if weights else self._values, int(ho[-1]))
        lens = C.lengths_from_offsets(ho)
        ms = int(lens.max()) if lens.numel() else 0
        on_host = src.device.type == "cpu"
        offs = ho if on_host else self.offsets().to(torch.int64)
        return from_values(src, offs, max_seqlen=ms, validate=on_host)

    @staticmethod
    def from_nested(nt: "NestedTensor", weights: "NestedTensor | Tensor | None" = None) -> "JaggedTensor":
        """View a NestedTensor with one leading ragged dim (samples ``(L_i, *static)``)."""
        what = "JaggedTensor.from_nested"
        if nt.ragged_dims != (0,):
            raise ValueError(
                f"{what}: needs samples whose only ragged dim is the first (L_i, *static), "
                f"got ragged_dims={nt.ragged_dims}"
            )
        w = weights.values() if weights is not None and hasattr(weights, "ragged_dims") else weights
        C.check_weights(what, w, nt.values())  # type: ignore[arg-type]
        ho = nt.host_offsets()
        return JaggedTensor._make(nt.values(), w, None, nt.offsets(), ho)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ moves

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "JaggedTensor":
        """Move every tensor; the host offsets (or the structure's fault) travel with it, so
        nothing syncs later."""
        return self._moved(lambda t: C.move(t, device, non_blocking))

    def pin_memory(self) -> "JaggedTensor":
        return self._moved(C.pin)

    def _moved(self, f: Callable[[Tensor | None], Tensor | None]) -> "JaggedTensor":
        if self._unchecked:
            self._scan()
        out = JaggedTensor._make(
            f(self._values), f(self._weights), f(self._lengths), f(self._offsets), self._host_offsets  # type: ignore[arg-type]
        )
        out._fault = self._fault
        return out

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            C.record(t, stream)

    # ------------------------------------------------------------------ torchrec

    def to_torchrec(self) -> Any:
        """TorchRec's JaggedTensor over the same tensors (needs the torchrec package)."""
        return _torchrec.module().JaggedTensor(**_torchrec.jt_kwargs(self))

    @staticmethod
    def from_torchrec(jt: Any) -> "JaggedTensor":
        return JaggedTensor(**_torchrec.jt_kwargs(jt))

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths and offsets (those present; as TorchRec counts)."""
        return C.nbytes(self._values, self._weights, self._lengths, self._offsets)

    def __str__(self) -> str:
        """The slices' contents, printed as TorchRec prints them (reads host offsets)."""
        ho = self.host_offsets().tolist()
        b = len(ho) - 1
        if self._weights is None:
            return "JaggedTensor({\n    " + C.jagged_string(self._values, ho, 0, b) + "\n})\n"
        return (
            'JaggedTensor({\n    "values": ' + C.jagged_string(self._values, ho, 0, b)
            + ',\n    "weights": ' + C.jagged_string(self._weights, ho, 0, b) + "\n})\n"
        )

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weighted"
        return (
            f"JaggedTensor(B={self.batch_size()}, values={tuple(self._values.shape)}, "
            f"dtype={self._values.dtype}, device={self.device()}{w})"
        )


_NUMPY_DTYPES = {
    d: torch.empty(0, dtype=d).numpy().dtype
    for d in (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}


def _pad_mask(ho: np.ndarray, desired_length: int | None) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Host plan for ``to_padded_dense`` from int64 host offsets (numpy: a few microseconds):
    the ``(B, N)`` mask of real positions, the value rows kept (None unless slices longer
    than ``desired_length`` are truncated) and the width ``N``."""
    lens = ho[1:] - ho[:-1]
    longest = int(lens.max())  # B >= 1 here
    n = longest if desired_length is None else int(desired_length)
    if n >= longest:
        return _prefix_mask(lens, n), None, n
    pos = np.arange(int(ho[-1]), dtype=np.int64) - np.repeat(ho[:-1], lens)
    return _prefix_mask(np.minimum(lens, n), n), np.flatnonzero(pos < n), n


def _prefix_mask(lens: np.ndarray, n: int) -> np.ndarray:
    """``(B, n)`` bool, row i true on its first ``lens[i] <= n`` entries: rows of a cached
    ``(n + 1, n)`` triangle gathered by length (several times faster than a broadcast compare)."""
    if n > _TRIANGLE_MAX:
        return lens[:, None] > np.arange(n)
    return _triangle(n).take(lens, axis=0)


_TRIANGLE_MAX = 512  # a triangle of (513, 512) bools is 263 KB


@functools.lru_cache(maxsize=16)
def _triangle(n: int) -> np.ndarray:
    return np.arange(n + 1)[:, None] > np.arange(n)


def _jt_flatten(jt: JaggedTensor) -> tuple[list[Tensor | None], None]:
    return [jt._values, jt._weights, jt._lengths, jt._offsets], None


def _jt_flatten_with_keys(jt: JaggedTensor) -> tuple[list[tuple[Any, Tensor | None]], None]:
    from torch.utils._pytree import GetAttrKey

    return [(GetAttrKey(k), v) for k, v in zip(_JT_FIELDS, _jt_flatten(jt)[0])], None


def _jt_unflatten(values: list[Tensor | None], context: None) -> JaggedTensor:
    return JaggedTensor(*values)  # type: ignore[arg-type]


_JT_FIELDS = ("_values", "_weights", "_lengths", "_offsets")
# a pytree node (as TorchRec registers its JaggedTensor): tree_map, torch.export and
# DataLoader pinning see its tensors rather than one opaque leaf
torch.utils._pytree.register_pytree_node(
    JaggedTensor,
    _jt_flatten,
    _jt_unflatten,
    flatten_with_keys_fn=_jt_flatten_with_keys,
    serialized_type_name="padless.jagged.JaggedTensor",
)
register_pytree_flatten_spec(JaggedTensor, lambda x, spec: _jt_flatten(x)[0])
