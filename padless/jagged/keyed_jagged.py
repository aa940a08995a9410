"""KeyedJaggedTensor: several sparse features (keys), each a JaggedTensor, packed key-major."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.jagged import _checks as C
from padless.jagged import fx, kjt_checks, kjt_combine
from padless.jagged.jagged_tensor import JaggedTensor
from padless.tensor.errors import StructureError


class KeyedJaggedTensor:
    """Jagged slices for several keys (features) over one batch, laid out key-major.

    Two features over a batch of 3 (``stride == 3``)::

                      sample 0   sample 1   sample 2
        "Feature0"    [V0, V1]   []         [V2]
        "Feature1"    [V3]       [V4]       [V5, V6, V7]

        keys           = ["Feature0", "Feature1"]
        values         = [V0, V1, V2, V3, V4, V5, V6, V7]   all of Feature0, then all of Feature1
        weights        = [W0, W1, W2, W3, W4, W5, W6, W7]   optional, shape of values
        lengths        = [2, 0, 1, 1, 1, 3]                  len(keys) * stride, key-major
        offsets        = [0, 2, 2, 3, 4, 5, 8]
        length_per_key = [3, 5]                              host lists, computed once, cached
        offset_per_key = [0, 3, 8]
        index_per_key  = {"Feature0": 0, "Feature1": 1}

    ``stride`` is the batch size. With a variable batch per key,
    ``stride_per_key_per_rank=[[2], [1, 2]]`` gives key 0 two bags and key 1 three
    (``stride_per_key() == [2, 3]``, ``stride() == 3``, the largest).

    Construction is lazy, as in TorchRec: the constructor checks types, counts and
    strides only. The structure (lengths >= 0, offsets from 0 and never decreasing, the
    two agreeing, ``values`` and weights long enough, given per-key
    lists matching) is checked on first use, and what TorchRec accepts, padless accepts:
    a KJT with a fault still gives ``lengths()``/``offsets()``, the per-key lists (as
    TorchRec derives them), ``sync()``, ``to(device)``, ``pin_memory()`` and ``concat``;
    what reads values through the structure (``to_dict()``, ``[key]``, ``permute``,
    ``split``, printing, pooling) raises a ``StructureError`` naming the fault, each time,
    as ``validate()`` (``padless.jagged.validate``) does at once. Tensors on a device are
    trusted, as in TorchRec.

    What costs what: ``length_per_key()``/``offset_per_key()`` are host lists. They come
    free when given, for a KJT built from host tensors (one min and one per-key sum of the
    lengths, on first use; ``collate_sparse`` does it in the DataLoader worker) and after
    ``to(device)`` of such a KJT; only a KJT built from device tensors without them reads
    its lengths back once (a device sync; ``from_lengths_sync``/``from_offsets_sync``/
    ``sync()`` make that explicit). The host bag offsets are one numpy cumsum, made when
    an op first needs them (``permute``/``split``/``concat`` of host KJTs leave them to
    that). ``lengths()``/``offsets()`` derive each other without a sync and cache.
    """

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
        spkpr = _spkpr_list(stride_per_key_per_rank)
        self._keys = keys
        self._stride_per_key_per_rank: list[list[int]] | None = spkpr
        self._inverse_indices = inverse_indices
        if spkpr is not None:
            if len(spkpr) > len(keys):
                raise StructureError(
                    f"{what}: stride_per_key_per_rank has {len(spkpr)} entries but there are only {len(keys)} keys"
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
            lpk, opk, blame, bad = kjt_checks.given_lists(len(keys), total, length_per_key, offset_per_key)
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
        """The structure checks construction defers (``kjt_checks.check``), once; never raises."""
        if self._pending is not None and self._pending != C.CHECKED:
            kjt_checks.check(self)

    def validate(self) -> "KeyedJaggedTensor":
        """Run the structure checks now (a no-op once done, and for tensors on a device, which
        are trusted); returns self. ``padless.jagged.validate(kjt)`` does the same."""
        self._check()
        if self._fault is not None:
            raise StructureError(self._fault)
        return self

    @classmethod
    def _make(
        cls,
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
    ) -> "KeyedJaggedTensor":
        """Internal: trusted, already consistent parts; no checks, no syncs."""
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

    # ------------------------------------------------------------------ constructors

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | Tensor | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """Build and ``sync()``: per-key lengths are read now (a device sync for device lengths)."""
        return KeyedJaggedTensor(
            keys, values, weights, lengths=lengths, stride=stride, stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        ).sync()

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | Tensor | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """Build and ``sync()`` from offsets (a device sync for device offsets)."""
        return KeyedJaggedTensor(
            keys, values, weights, offsets=offsets, stride=stride, stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        ).sync()

    @staticmethod
    @fx.leaf
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor], force_variable_stride: bool = False) -> "KeyedJaggedTensor":
        """Concatenate one JaggedTensor per key (in dict order). JaggedTensors of different
        batch sizes give a variable stride per key (always, with ``force_variable_stride``).
        Weighted only if every one is. Host metadata of the JaggedTensors is reused."""
        return kjt_combine.from_jt_dict(KeyedJaggedTensor, jt_dict, force_variable_stride)

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """No keys, no values (``stride() == 0``)."""
        return KeyedJaggedTensor(
            keys=[],
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
        )

    @staticmethod
    @fx.leaf
    def empty_like(kjt: "KeyedJaggedTensor", device: torch.device | str | None = None) -> "KeyedJaggedTensor":
        """TorchRec's two meanings. Without ``device``: no keys and no values, keeping only the
        batch size (``stride()``, or ``stride_per_key_per_rank()`` of a variable-batch KJT) and
        the dtypes. With ``device``: the same keys and strides with uninitialised tensors of
        ``kjt``'s shapes on ``device`` (host metadata kept)."""
        w = kjt.weights_or_none()
        spkpr = kjt._stride_per_key_per_rank
        if device is None:
            dev = kjt.device()
            return KeyedJaggedTensor._make(
                [],
                torch.empty(0, dtype=kjt.values().dtype, device=dev),
                None if w is None else torch.empty(0, dtype=w.dtype, device=dev),
                torch.empty(0, dtype=kjt.lengths().dtype, device=dev),
                None,
                0 if spkpr is not None else kjt.stride(),
                spkpr,
                [],
                [0],
                torch.zeros(1, dtype=torch.int64),
            )
        inv = kjt._inverse_indices
        out = KeyedJaggedTensor._make(
            list(kjt.keys()),
            torch.empty_like(kjt.values(), device=device),
            None if w is None else torch.empty_like(w, device=device),
            None if kjt._lengths is None else torch.empty_like(kjt._lengths, device=device),
            None if kjt._offsets is None else torch.empty_like(kjt._offsets, device=device),
            kjt._stride,
            spkpr,
            kjt._length_per_key,
            kjt._offset_per_key,
            kjt._sound_host(),
            None if inv is None else (inv[0], torch.empty_like(inv[1], device=device)),
        )
        out._fault = kjt._fault  # uninitialised copies of a faulty structure are as unreadable
        return out

    @staticmethod
    @fx.leaf
    def concat(kjt_list: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of every KJT, in order (same batch, or a variable stride per key)."""
        return kjt_combine.concat(kjt_list)

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
        if self._index_per_key is None:
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

    def sync(self) -> "KeyedJaggedTensor":
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

    def unsync(self) -> "KeyedJaggedTensor":
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

    # ------------------------------------------------------------------ per key

    def __getitem__(self, key: str) -> JaggedTensor:
        """The JaggedTensor of one key: views of values, weights and lengths (no copy)."""
        idx = self.index_per_key().get(key)
        if idx is None:
            raise KeyError(f"KeyedJaggedTensor: no key {key!r}; keys are {self._keys}")
        return self._key_jt(idx, self.offset_per_key(), self.lengths_offset_per_key(), None)

    def _key_jt(self, idx: int, opk: list[int], lop: list[int], offsets: Tensor | None) -> JaggedTensor:
        s, e = opk[idx], opk[idx + 1]
        w = self._weights
        host = None
        h = self._host()
        if h is not None:
            host = torch.from_numpy(h.numpy()[lop[idx] : lop[idx + 1] + 1] - s)
        return JaggedTensor._make(
            self._values[s:e],
            None if w is None else w[s:e],
            self.lengths()[lop[idx] : lop[idx + 1]],
            offsets,
            host,
        )

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` in key order (cached). Each JaggedTensor views this KJT's
        values and lengths; with ``compute_offsets`` (the default, as in TorchRec) its offsets
        are computed too, in one batched op for all keys; without, ``offsets_or_none()`` is None."""
        if self._jt_dict is None:
            keys = self._keys
            if not keys:
                self._jt_dict = {}
                return self._jt_dict
            h = self._host()  # a host-built KJT: checked now
            lpk = self.length_per_key()
            opk = self.offset_per_key()
            spk = self.stride_per_key()
            lop = C.cumsum_list(spk)
            end = opk[-1]
            vals = C.used(self._values, end).split_with_sizes(lpk)  # type: ignore[union-attr]
            w = self._weights
            ws = C.used(w, end).split_with_sizes(lpk) if w is not None else [None] * len(keys)  # type: ignore[union-attr]
            lengths = self.lengths()
            lengths = lengths if lengths.dim() == 1 else lengths.reshape(-1)
            lens = lengths.split_with_sizes(spk)
            n = len(keys)
            offs: Sequence[Tensor | None] = [None] * n
            hos: Sequence[Tensor | None] = [None] * n
            if h is not None and self._stride_per_key_per_rank is None:
                # one numpy op gives every key's host offsets: rows of a (keys, B+1) strided view
                per = torch.from_numpy(_per_key_offsets(h.numpy(), n, self._stride))
                hos = per.unbind(0)
                if compute_offsets and lengths.device.type == "cpu":
                    offs = hos if lengths.dtype == torch.int64 else per.to(C.offsets_dtype(lengths)).unbind(0)
            elif h is not None:
                hn = h.numpy()
                hos = [torch.from_numpy(hn[lop[i] : lop[i + 1] + 1] - opk[i]) for i in range(n)]
            if compute_offsets and offs[0] is None:
                offs = self._offsets_per_key(lop)
            make = JaggedTensor._make
            self._jt_dict = {k: make(vals[i], ws[i], lens[i], offs[i], hos[i]) for i, k in enumerate(keys)}
        return self._jt_dict

    def _offsets_per_key(self, lop: list[int]) -> list[Tensor]:
        """Every key's offsets (from 0), in the dtype of ``lengths()``: one op for a fixed batch."""
        lengths = self.lengths().reshape(-1)
        if self._stride_per_key_per_rank is None:
            k, b = len(self._keys), self._stride
            out = torch.zeros(k, b + 1, dtype=C.offsets_dtype(lengths), device=lengths.device)
            if b:
                torch.cumsum(lengths.view(k, b), 1, out=out[:, 1:])
            return list(out.unbind(0))
        return [C.offsets_from_lengths(lengths[lop[i] : lop[i + 1]]) for i in range(len(self._keys))]

    def permute(self, indices: Sequence[int], indices_tensor: Tensor | None = None) -> "KeyedJaggedTensor":
        """Keys reordered (or repeated, or dropped) as ``[keys[i] for i in indices]``; the
        batch size (``stride()``) is the parent's, as in TorchRec."""
        what = "KeyedJaggedTensor.permute"
        self.validate()  # reads values through the structure: a fault raises
        n = len(self._keys)
        for i in indices:
            if not -n <= int(i) < n:
                raise IndexError(f"{what}: index {i} is out of range for {n} keys {self._keys}")
        idx = [int(i) % n for i in indices]
        lpk0 = self.length_per_key()
        opk = self.offset_per_key()
        spk = self.stride_per_key()
        lop = C.cumsum_list(spk)
        end = opk[-1]

        def gather(t: Tensor, sizes: list[int]) -> Tensor:
            parts = t.split_with_sizes(sizes)  # one op: a view per key
            return torch.cat([parts[i] for i in idx]) if idx else t[:0]

        lengths = self.lengths()
        lengths = gather(lengths if lengths.dim() == 1 else lengths.reshape(-1), spk)
        host = None
        on_host = lengths.device.type == "cpu"  # then the bag offsets are one cumsum, on first need
        h0 = None if on_host else self._host()
        if h0 is not None:
            hl = np.diff(h0.numpy())
            sel = np.concatenate([hl[lop[i] : lop[i + 1]] for i in idx]) if idx else hl[:0]
            h = np.empty(sel.size + 1, np.int64)
            h[0] = 0
            np.cumsum(sel, out=h[1:])
            host = torch.from_numpy(h)
        lpk = [opk[i + 1] - opk[i] for i in idx]
        spkpr = self._per_key_ranks()
        new_spkpr = [spkpr[i] for i in idx] if self.variable_stride_per_key() else None
        out = KeyedJaggedTensor._make(
            [self._keys[i] for i in idx],
            gather(C.used(self._values, end), lpk0),  # type: ignore[arg-type]
            None if self._weights is None else gather(C.used(self._weights, end), lpk0),  # type: ignore[arg-type]
            lengths,
            None,
            self._stride,
            new_spkpr,
            lpk,
            C.cumsum_list(lpk),
            host,
            self._inverse_indices,
        )
        if on_host:
            out._pending = C.CHECKED
        return out

    def split(self, segments: Sequence[int]) -> list["KeyedJaggedTensor"]:
        """Consecutive groups of ``segments[j]`` keys each (views, no copy); every part keeps
        the parent's batch size (``stride()``), as in TorchRec."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(
                f"KeyedJaggedTensor.split: segments {list(segments)} must be >= 0 and sum to the "
                f"{len(self._keys)} keys"
            )
        self.validate()  # reads values through the structure: a fault raises
        opk = self.offset_per_key()
        lop = self.lengths_offset_per_key()
        variable = self.variable_stride_per_key()
        spkpr = self._per_key_ranks() if variable else None
        lengths = self.lengths()
        lengths = lengths if lengths.dim() == 1 else lengths.reshape(-1)
        # host lengths: each part's bag offsets are one cumsum of its lengths, on first need (as TorchRec defers)
        defer = lengths.device.type == "cpu"
        h = None if defer else self._host()
        hn = None if h is None else h.numpy()
        lpk = self._length_per_key
        out = []
        start = 0
        for seg in segments:
            end = start + seg
            s, e = opk[start], opk[end]
            ls, le = lop[start], lop[end]
            host = None if hn is None else torch.from_numpy(hn[ls : le + 1] - s)
            out.append(
                KeyedJaggedTensor._make(
                    self._keys[start:end],
                    self._values[s:e],
                    None if self._weights is None else self._weights[s:e],
                    lengths[ls:le],
                    None,
                    self._stride,
                    spkpr[start:end] if spkpr is not None else None,
                    lpk[start:end] if lpk is not None else None,
                    [o - s for o in opk[start : end + 1]],
                    host,
                )
            )
            if defer:
                out[-1]._pending = C.CHECKED
            start = end
        return out

    # ------------------------------------------------------------------ moves

    def _with(self, f: Callable[[Tensor | None], Tensor | None]) -> "KeyedJaggedTensor":
        host = self._sound_host()  # host metadata (or the structure's fault) travels with the moved KJT
        inv = self._inverse_indices
        out = KeyedJaggedTensor._make(
            self._keys,
            f(self._values),  # type: ignore[arg-type]
            f(self._weights),
            f(self._lengths),
            f(self._offsets),
            self._stride,
            self._stride_per_key_per_rank,
            self._length_per_key,
            self._offset_per_key,
            host,
            None if inv is None else (inv[0], f(inv[1])),  # type: ignore[arg-type]
        )
        out._fault = self._fault
        return out

    def to(
        self, device: torch.device | str, non_blocking: bool = False, dtype: torch.dtype | None = None
    ) -> "KeyedJaggedTensor":
        """Move every tensor (``dtype`` casts the weights, as in TorchRec); host metadata
        (per-key lists, host offsets) travels along, so nothing syncs later."""
        out = self._with(lambda t: C.move(t, device, non_blocking))
        if dtype is not None and out._weights is not None:
            out._weights = out._weights.to(dtype)
        return out

    def pin_memory(self) -> "KeyedJaggedTensor":
        return self._with(C.pin)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            C.record(t, stream)

    # ------------------------------------------------------------------ torchrec

    def to_torchrec(self) -> Any:
        from padless.jagged.interop import kjt_to_torchrec

        return kjt_to_torchrec(self)

    @staticmethod
    def from_torchrec(kjt: Any) -> "KeyedJaggedTensor":
        from padless.jagged.interop import kjt_from_torchrec

        return kjt_from_torchrec(kjt)

    def __str__(self) -> str:
        """Every key's bags (and weights), printed as TorchRec prints them (reads host offsets)."""
        if not self._keys or (self._lengths is None and self._offsets is None):
            return "KeyedJaggedTensor()\n"
        ho = self.host_offsets().tolist()
        lop = self.lengths_offset_per_key()
        parts = []
        for i, k in enumerate(self._keys):
            v = C.jagged_string(self._values, ho, lop[i], lop[i + 1])
            if self._weights is None:
                parts.append(f'    "{k}": {v}')
            else:
                w = C.jagged_string(self._weights, ho, lop[i], lop[i + 1])
                parts.append(f'    "{k}": {{\n        "values": {v},\n        "weights": {w}\n    }}')
        return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weighted"
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride_per_key={self.stride_per_key()}, "
            f"length_per_key={self._length_per_key}, values={tuple(self._values.shape)}, "
            f"dtype={self._values.dtype}, device={self.device()}{w})"
        )


def _spkpr_list(spkpr: Sequence[Sequence[int]] | Tensor | None) -> list[list[int]] | None:
    """Per-key-per-rank strides as lists (TorchRec also passes an int tensor ``(keys, ranks)``)."""
    if spkpr is None:
        return None
    if isinstance(spkpr, Tensor):
        return [[int(s) for s in r] for r in spkpr.tolist()] if spkpr.dim() == 2 else []
    return [[int(s) for s in r] for r in spkpr]


def _per_key_offsets(hn: np.ndarray, keys: int, stride: int) -> np.ndarray:
    """Every key's offsets from 0, ``(keys, stride + 1)``, from the bag offsets of a fixed-batch
    KJT: row i is ``hn[i*stride : (i+1)*stride + 1] - hn[i*stride]`` (a strided view, one subtraction)."""
    hn = np.ascontiguousarray(hn, dtype=np.int64)
    view = np.ndarray((keys, stride + 1), np.int64, buffer=hn, strides=(stride * 8, 8))
    return view - view[:, :1]
