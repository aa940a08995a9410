"""The state of a KeyedJaggedTensor and what reads or fills it: construction, deferred checks, accessors.

``KeyedJaggedBase`` holds what every KeyedJaggedTensor carries (keys, values, weights,
lengths/offsets, strides, the cached per-key host lists and host bag offsets, a recorded
fault), the constructor's checks, the structure checks it defers to first use, the
accessors and ``sync()``. The public class, ``padless.jagged.keyed_jagged.KeyedJaggedTensor``,
derives from it and adds the rest (constructors, per-key views, ``permute``/``split``,
moves, TorchRec conversion, printing); ``padless.jagged.kjt_combine`` joins several KJTs
on this base, building the result with the parts' own class. The layering is
``kjt_checks`` < this module < ``kjt_combine`` < ``keyed_jagged``.
"""

from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

import torch
from torch import Tensor

from padless.jagged import _checks as C
from padless.jagged import fx, kjt_checks
from padless.jagged.jagged_tensor import JaggedTensor
from padless.tensor.errors import StructureError

K = TypeVar("K", bound="KeyedJaggedBase")


class KeyedJaggedBase:
    """Storage, construction checks and accessors of ``KeyedJaggedTensor`` (see its docstring
    for the layout and what each accessor costs). Not built directly: ``KeyedJaggedTensor``
    is the class to use."""

    __slots__ = (
        "_keys",
        "_values",
        "_weights",
        "_lengths",
        "_offsets",
        "_stride",
        "_stride_per_key_per_rank",
        "_length_per_key",
        "_offset_per_key",
        "_index_per_key",
        "_host_offsets",
        "_pending",
        "_jt_dict",
        "_inverse_indices",
        "_fault",
    )

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | Tensor | None = None,
        stride_per_key: Sequence[int] | None = None,
        length_per_key: Sequence[int] | None = None,
        lengths_offset_per_key: Sequence[int] | None = None,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: Mapping[str, int] | None = None,
        jt_dict: Mapping[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> None:
        if not isinstance(values, Tensor):  # built from traced tensors under torch.fx: stands in for the node
            given = {k: v for k, v in locals().items() if k not in ("self", "keys", "values") and v is not None}
            if fx.stand_in(self, type(self), (keys, values), given):
                return
        what = "KeyedJaggedTensor"
        fx.refuse_jit_trace(what)
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"{what}: keys must be strings, got {k!r} ({type(k).__name__})")
        if not isinstance(values, Tensor):
            raise TypeError(f"{what}: values must be a tensor, got {type(values).__name__}")
        if values.dim() < 1:
            raise ValueError(f"{what}: values must have a row dim, got a 0-d tensor")
        fault = C.weights_fault(what, weights)  # kept, raised by what reads values
        total = values.shape[0]
        if lengths is not None:
            C.check_int(what, "lengths", lengths)
        if offsets is not None:
            C.check_int(what, "offsets", offsets)
            if lengths is not None and offsets.numel() and offsets.numel() != lengths.numel() + 1:
                raise StructureError(
                    f"{what}: offsets must have len(lengths) + 1 = {lengths.numel() + 1} entries, got {offsets.numel()}"
                )
        # with neither lengths nor offsets (TorchRec allows it) there are no bags
        n_bags = lengths.numel() if lengths is not None else C.count(offsets, offsets=True)
        spkpr = kjt_checks.spkpr_list(stride_per_key_per_rank)
        self._keys = keys
        self._stride_per_key_per_rank: list[list[int]] | None = spkpr
        self._inverse_indices = inverse_indices
        if spkpr is not None:
            if len(spkpr) > len(keys):
                raise StructureError(
                    f"{what}: stride_per_key_per_rank has {len(spkpr)} entries but there are only {len(keys)} keys"
                )
            bad = next(((k, r, x) for k, row in enumerate(spkpr) for r, x in enumerate(row) if x < 0), None)
            if bad is not None:  # TorchRec accepts it; nothing can read it (kept, raised by validate() and readers)
                k, r, x = bad
                fault = fault or (
                    f"{what}: stride_per_key_per_rank must be >= 0, but key {keys[k]!r} has stride {x} on rank {r} "
                    f"(stride_per_key_per_rank {spkpr})"
                )
            expected = sum(sum(r) for r in spkpr)
            if n_bags != expected:
                raise StructureError(
                    f"{what}: keys and lengths disagree: stride_per_key_per_rank {spkpr} needs {expected} "
                    f"lengths, got {n_bags}"
                )
            self._stride = int(stride) if stride is not None else C.vbe_stride(spkpr, inverse_indices)
        else:
            if stride is None:
                if not keys:
                    if n_bags:
                        raise StructureError(f"{what}: keys and lengths disagree: no keys but {n_bags} lengths")
                    stride = 0
                elif n_bags % len(keys):
                    raise StructureError(
                        f"{what}: keys and lengths disagree: {n_bags} lengths cannot be split evenly over "
                        f"{len(keys)} keys {keys}"
                    )
                else:
                    stride = n_bags // len(keys)
            elif n_bags != stride * len(keys):
                raise StructureError(
                    f"{what}: keys and lengths disagree: {len(keys)} keys x stride {stride} = "
                    f"{stride * len(keys)} lengths expected, got {n_bags}"
                )
            self._stride = int(stride)
        if stride_per_key is not None and [int(s) for s in stride_per_key] != self.stride_per_key():
            raise StructureError(
                f"{what}: stride_per_key {list(stride_per_key)} disagrees with the strides {self.stride_per_key()}"
            )
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._host_offsets: Tensor | None = None
        if lengths_offset_per_key is not None:
            lop = self.lengths_offset_per_key()
            if [int(x) for x in lengths_offset_per_key] != lop:
                raise StructureError(
                    f"{what}: lengths_offset_per_key {list(lengths_offset_per_key)} disagrees with the strides (which give {lop})"
                )
        lpk = opk = None
        blame = ""  # the given per-key list the deferred check compares with the lengths
        if length_per_key is not None or offset_per_key is not None:
            lpk, opk, blame, bad = kjt_checks.given_lists(keys, total, length_per_key, offset_per_key)
            fault = fault or bad
        self._length_per_key: list[int] | None = lpk
        self._offset_per_key: list[int] | None = opk
        # the checks that read host lengths/offsets run on first need (``_host()``), as TorchRec defers them
        self._pending: str | None = blame
        self._fault: str | None = fault
        self._index_per_key = dict(index_per_key) if index_per_key is not None else None
        self._jt_dict = dict(jt_dict) if jt_dict is not None else None

    def _sound_host(self) -> Tensor | None:
        """Host bag offsets when known or readable without a sync; None for a KJT built from
        device tensors and for one whose structure has a fault. The first call on a host-built
        KJT runs the checks construction defers and fills ``length_per_key``/``offset_per_key``."""
        if self._pending is not None:
            self._check()
            if self._pending == C.CHECKED:  # checked host lengths: the offsets are one cumsum
                self._host_offsets = C.cumsum_host(self._lengths)  # type: ignore[arg-type]
                self._pending = None
        return self._host_offsets

    def _host(self) -> Tensor | None:
        """``_sound_host()`` for what reads values through the structure: a fault raises here,
        every time it is asked."""
        h = self._sound_host()
        if self._fault is not None:
            raise StructureError(self._fault)
        return h

    def _unchecked(self) -> bool:
        return self._pending is not None and self._pending != C.CHECKED

    def _check(self) -> None:
        """The structure checks construction defers, once; never raises.

        Fills ``length_per_key``/``offset_per_key`` as TorchRec derives them (faulty or not;
        given lists stay as given) and records the first fault. Host lengths alone (the common
        case) take one min and one per-key sum, leaving the bag offsets' cumsum to the first
        op that needs them (the ``CHECKED`` state).
        """
        blame = self._pending
        if blame is None or blame == C.CHECKED:
            return
        what = kjt_checks.WHAT
        lengths, offsets = self._lengths, self._offsets
        total = self._values.shape[0]
        if (
            offsets is None and lengths is not None and self._stride_per_key_per_rank is None
            and lengths.numel() and lengths.device.type == "cpu"
        ):
            opk, fault = C.key_offsets(what, lengths, len(self._keys), self._stride, total, self._where)
            host = None
        else:
            if lengths is None and offsets is None:  # no bags
                host, fault = torch.zeros(1, dtype=torch.int64), None
            else:
                host, fault = C.host_offsets(what, lengths, offsets, total, self._where)
            hn = None if host is None else host.numpy()
            opk = None if hn is None else (hn[self.lengths_offset_per_key()] - hn[0]).tolist()
        if fault is None and opk is not None and self._weights is not None:
            fault = C.short_weights(what, self._weights, opk[-1])
        if opk is not None:
            if not blame:
                self._offset_per_key = opk
                self._length_per_key = [b - a for a, b in zip(opk[:-1], opk[1:])]
            elif self._offset_per_key != opk and fault is None:
                given = self._length_per_key if blame == "length_per_key" else self._offset_per_key
                lpk = [b - a for a, b in zip(opk[:-1], opk[1:])]
                fault = f"{what}: {blame} {given} disagrees with lengths (which give {lpk if blame == 'length_per_key' else opk})"
        self._fault = self._fault or fault
        self._host_offsets = host if self._fault is None else None
        self._pending = C.CHECKED if opk is not None and host is None and self._fault is None else None

    def _where(self, i: int) -> str:
        """Bag ``i`` (of the flat lengths) as ``"key 'a', sample 1"``, for messages."""
        start = 0
        for key, n in zip(self._keys, self.stride_per_key()):
            if n > 0 and i < start + n:
                return f"key {key!r}, sample {i - start}"
            start += max(n, 0)
        return f"bag {i}"

    def validate(self: K) -> K:
        """Run the structure checks now (a no-op once done, and for tensors on a device, which
        are trusted) and check that the keys are unique, as TorchRec's
        ``validate_keyed_jagged_tensor`` does; returns self. ``padless.jagged.validate(kjt)``
        does the same."""
        self._readable()
        C.unique_keys(kjt_checks.WHAT + ".validate()", self._keys, kjt_checks.POSITIONAL)
        return self

    def _readable(self: K) -> K:
        """The structure checks alone (what reads values through the structure runs them): keys
        repeated by ``permute`` are positional there, as in TorchRec."""
        self._check()
        if self._fault is not None:
            raise StructureError(self._fault)
        return self

    @classmethod
    def _make(
        cls: type[K],
        keys: list[str],
        values: Tensor,
        weights: Tensor | None,
        lengths: Tensor | None,
        offsets: Tensor | None,
        stride: int,
        stride_per_key_per_rank: list[list[int]] | None,
        length_per_key: list[int] | None,
        offset_per_key: list[int] | None,
        host_offsets: Tensor | None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> K:
        """Internal: trusted, already consistent parts; no checks, no syncs."""
        fx.refuse_jit_trace("KeyedJaggedTensor")
        k = cls.__new__(cls)
        k._keys, k._values, k._weights, k._lengths, k._offsets = keys, values, weights, lengths, offsets
        k._stride, k._stride_per_key_per_rank = stride, stride_per_key_per_rank
        k._length_per_key, k._offset_per_key = length_per_key, offset_per_key
        k._host_offsets = host_offsets
        k._pending = None
        k._index_per_key = None
        k._jt_dict = None
        k._inverse_indices = inverse_indices
        k._fault = None
        return k

    # ------------------------------------------------------------------ accessors

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("KeyedJaggedTensor.weights(): this KeyedJaggedTensor has no weights; use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def lengths(self) -> Tensor:
        """Bag lengths, key-major ``(sum(stride_per_key()),)``; derived on device and cached."""
        self._check()  # checked on the tensors given, before a derived one is cached (never raises)
        if self._lengths is None:
            off = self._offsets
            if off is None:  # built with neither: no bags
                self._lengths = torch.empty(0, dtype=torch.int32, device=self._values.device)
            else:
                self._lengths = C.lengths_from_offsets(off) if off.numel() else off.new_empty(0)
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        return self._lengths

    def offsets(self) -> Tensor:
        """Bag offsets ``(len(lengths()) + 1,)`` in the dtype of the lengths; derived without a sync
        (host lengths: from the host bag offsets, one numpy cumsum) and cached."""
        if self._offsets is None:
            h = self._sound_host()  # host tensors are checked on first use
            ln = self.lengths()
            if h is not None and ln.device.type == "cpu" and ln.dim() == 1:
                self._offsets = h if ln.dtype == torch.int64 else h.to(C.offsets_dtype(ln))
            else:
                self._offsets = C.offsets_from_lengths(ln)
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        """Batch size: for a variable batch per key, the width of the inverse indices when
        given, else the largest per-key batch."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        """Bags per key (a key past a short ``stride_per_key_per_rank`` has none)."""
        if self._stride_per_key_per_rank is None:
            return [self._stride] * len(self._keys)
        out = [sum(r) for r in self._stride_per_key_per_rank]
        return out + [0] * (len(self._keys) - len(out))

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Bags per key per rank of a variable-batch KJT; ``[]`` otherwise (as in TorchRec)."""
        if self._stride_per_key_per_rank is None:
            return []
        return self._stride_per_key_per_rank

    def _per_key_ranks(self) -> list[list[int]]:
        """Per key, its bags per rank (``[[stride]]`` per key for a fixed batch)."""
        if self._stride_per_key_per_rank is None:
            return [[self._stride] for _ in self._keys]
        r = self._stride_per_key_per_rank
        return r + [[0] for _ in range(len(self._keys) - len(r))]

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> tuple[list[str], Tensor]:
        """``(keys, (len(keys), stride()) indices)``: for each sample of the full batch, which bag
        of a variable-batch KJT it uses; raises when the KJT has none."""
        if self._inverse_indices is None:
            raise ValueError(
                "KeyedJaggedTensor.inverse_indices(): this KeyedJaggedTensor has no inverse indices; "
                "pass inverse_indices= when building it, or use inverse_indices_or_none()"
            )
        return self._inverse_indices

    def inverse_indices_or_none(self) -> tuple[list[str], Tensor] | None:
        return self._inverse_indices

    def lengths_offset_per_key(self) -> list[int]:
        """Where each key's lengths start in ``lengths()`` (host list, never a sync)."""
        return C.cumsum_list(self.stride_per_key())

    def index_per_key(self) -> dict[str, int]:
        """``{key: position}``; keys that repeat (``permute`` with a repeated index) have no one
        position and are refused, naming the key (TorchRec keeps the last silently)."""
        if self._index_per_key is None:
            C.unique_keys(kjt_checks.WHAT + ".index_per_key()", self._keys, kjt_checks.POSITIONAL)
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def length_per_key(self) -> list[int]:
        """Number of values per key (host list, cached; see the class note on cost)."""
        if self._length_per_key is None or self._unchecked():  # a given list is checked on first use
            self.sync()
        return self._length_per_key  # type: ignore[return-value]

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Where each key's values start, plus the end (host list, cached)."""
        if self._offset_per_key is None or self._unchecked():
            self.sync()
        return self._offset_per_key  # type: ignore[return-value]

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def host_offsets(self) -> Tensor:
        """Bag offsets as a CPU int64 tensor (cached; reads device offsets once if built on a device)."""
        if self._host() is None:
            self._host_offsets = self.offsets().to("cpu", torch.int64)
        return self._host_offsets

    def sync(self: K) -> K:
        """Compute ``length_per_key``/``offset_per_key`` now (one device sync when the lengths
        live only on a device); returns self. On the meta device, where nothing can be read,
        the values are split evenly over the keys (the first key takes the remainder), as
        TorchRec does."""
        self._check()  # a host-built KJT: checks its structure and fills the per-key lists
        if self._length_per_key is None or self._offset_per_key is None:
            if self._host_offsets is None and self._values.is_meta:
                n, k = self._values.shape[0], len(self._keys)
                lpk = [n // k] * k if k else []
                if lpk:
                    lpk[0] += n % k
                self._length_per_key, self._offset_per_key = lpk, C.cumsum_list(lpk)
                return self
            hn = (self.host_offsets() if self._fault is None else self.offsets().to("cpu", torch.int64)).numpy()
            opk = (hn[self.lengths_offset_per_key()] - hn[0]).tolist()
            self._offset_per_key = opk
            self._length_per_key = [b - a for a, b in zip(opk[:-1], opk[1:])]
        return self

    def unsync(self: K) -> K:
        """Drop the cached per-key host lists (as TorchRec does); returns self."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths and offsets (those present), plus the int32
        per-key-per-rank strides of a variable-batch KJT, as TorchRec counts them."""
        n = C.nbytes(self._values, self._weights, self._lengths, self._offsets)
        if self._stride_per_key_per_rank is not None:
            n += 4 * sum(len(r) for r in self._stride_per_key_per_rank)
        return n

    def clear_storage(self) -> int:
        """Free the storage of values, lengths, offsets and weights now (``untyped_storage()
        .resize_(0)``, as TorchRec does to give device memory back early); returns the bytes
        freed. The KJT must not be read afterwards; views sharing that storage lose it too."""
        self._pending = None  # nothing is left to check (or to read)
        return sum(C.free(t) for t in (self._values, self._lengths, self._offsets, self._weights))
