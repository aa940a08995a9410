"""KeyedJaggedTensor: several sparse features (keys), each a JaggedTensor, packed key-major."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from padless.jagged import _checks as C
from padless.jagged.jagged_tensor import JaggedTensor


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

    What costs what: ``length_per_key()``/``offset_per_key()`` are host lists. They come
    free when given, when the KJT was built from host tensors (as ``collate_sparse``
    does in the DataLoader worker) and after ``to(device)`` of such a KJT; only a KJT
    built from device tensors without them reads its lengths back once (a device sync;
    ``from_lengths_sync``/``from_offsets_sync``/``sync()`` make that explicit).
    ``lengths()``/``offsets()`` derive each other on the device (no sync) and cache.
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
        "_jt_dict",
        "_inverse_indices",
    )

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        length_per_key: Sequence[int] | None = None,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: Mapping[str, int] | None = None,
        jt_dict: Mapping[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> None:
        what = "KeyedJaggedTensor"
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"{what}: keys must be strings, got {k!r} ({type(k).__name__})")
        if not isinstance(values, Tensor):
            raise TypeError(f"{what}: values must be a tensor, got {type(values).__name__}")
        if values.dim() < 1:
            raise ValueError(f"{what}: values must have a row dim, got a 0-d tensor")
        if lengths is None and offsets is None:
            raise ValueError(f"{what}: pass lengths= or offsets= (or both)")
        C.check_weights(what, weights, values)
        total = values.shape[0]
        n_bags = lengths.numel() if lengths is not None else offsets.numel() - 1  # type: ignore[union-attr]
        if lengths is not None:
            C.check_int(what, "lengths", lengths)
        if offsets is not None:
            C.check_int(what, "offsets", offsets)
            if lengths is not None and offsets.numel() != lengths.numel() + 1:
                raise ValueError(
                    f"{what}: offsets must have len(lengths) + 1 = {lengths.numel() + 1} entries, got {offsets.numel()}"
                )
        # batch size per key
        if stride_per_key_per_rank is not None:
            if stride is not None:
                raise ValueError(f"{what}: pass stride= or stride_per_key_per_rank=, not both")
            spkpr = [[int(s) for s in r] for r in stride_per_key_per_rank]
            if len(spkpr) != len(keys):
                raise ValueError(
                    f"{what}: stride_per_key_per_rank has {len(spkpr)} entries but there are {len(keys)} keys"
                )
            expected = sum(sum(r) for r in spkpr)
            if n_bags != expected:
                raise ValueError(
                    f"{what}: keys and lengths disagree: stride_per_key_per_rank {spkpr} needs {expected} "
                    f"lengths, got {n_bags}"
                )
            self._stride_per_key_per_rank: list[list[int]] | None = spkpr
            self._stride = max((sum(r) for r in spkpr), default=0)
        else:
            if stride is None:
                if not keys:
                    if n_bags:
                        raise ValueError(f"{what}: keys and lengths disagree: no keys but {n_bags} lengths")
                    stride = 0
                elif n_bags % len(keys):
                    raise ValueError(
                        f"{what}: keys and lengths disagree: {n_bags} lengths cannot be split evenly over "
                        f"{len(keys)} keys {keys}"
                    )
                else:
                    stride = n_bags // len(keys)
            elif n_bags != stride * len(keys):
                raise ValueError(
                    f"{what}: keys and lengths disagree: {len(keys)} keys x stride {stride} = "
                    f"{stride * len(keys)} lengths expected, got {n_bags}"
                )
            self._stride_per_key_per_rank = None
            self._stride = int(stride)
        # host-side structure (validated when it lives on the host)
        host: Tensor | None = None
        if lengths is not None and C.is_host(lengths):
            C.check_lengths(what, lengths, total)
            host = C.offsets_from_lengths(lengths.to(torch.int64))
        if offsets is not None and C.is_host(offsets):
            C.check_offsets(what, offsets, total)
            ho = offsets.to(torch.int64)
            if host is not None and not torch.equal(ho, host):
                raise ValueError(
                    f"{what}: lengths and offsets disagree: offsets {ho.tolist()}, cumsum of lengths {host.tolist()}"
                )
            host = ho
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._host_offsets = host
        lop = self.lengths_offset_per_key()
        self._length_per_key: list[int] | None = None
        self._offset_per_key: list[int] | None = None
        if length_per_key is not None:
            lpk = [int(x) for x in length_per_key]
            if len(lpk) != len(keys):
                raise ValueError(
                    f"{what}: keys and length_per_key disagree: {len(keys)} keys, {len(lpk)} lengths {lpk}"
                )
            if sum(lpk) != total:
                raise ValueError(f"{what}: length_per_key {lpk} sums to {sum(lpk)} but values has {total} rows")
            self._length_per_key = lpk
        if offset_per_key is not None:
            opk = [int(x) for x in offset_per_key]
            if len(opk) != len(keys) + 1 or (opk and (opk[0] != 0 or opk[-1] != total)):
                raise ValueError(
                    f"{what}: offset_per_key must have len(keys) + 1 = {len(keys) + 1} entries from 0 to "
                    f"{total}, got {opk}"
                )
            self._offset_per_key = opk
        if host is not None:
            opk = host[lop].tolist()
            lpk = [b - a for a, b in zip(opk[:-1], opk[1:])]
            if self._length_per_key is not None and self._length_per_key != lpk:
                raise ValueError(
                    f"{what}: length_per_key {self._length_per_key} disagrees with lengths (which give {lpk})"
                )
            self._length_per_key, self._offset_per_key = lpk, opk
        if self._length_per_key is not None and self._offset_per_key is None:
            self._offset_per_key = C.cumsum_list(self._length_per_key)
        elif self._offset_per_key is not None and self._length_per_key is None:
            o = self._offset_per_key
            self._length_per_key = [b - a for a, b in zip(o[:-1], o[1:])]
        self._index_per_key = dict(index_per_key) if index_per_key is not None else None
        self._jt_dict = dict(jt_dict) if jt_dict is not None else None
        self._inverse_indices = inverse_indices

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
    ) -> "KeyedJaggedTensor":
        """Internal: trusted, already consistent parts; no checks, no syncs."""
        k = cls.__new__(cls)
        k._keys, k._values, k._weights, k._lengths, k._offsets = keys, values, weights, lengths, offsets
        k._stride, k._stride_per_key_per_rank = stride, stride_per_key_per_rank
        k._length_per_key, k._offset_per_key = length_per_key, offset_per_key
        k._host_offsets = host_offsets
        k._index_per_key = None
        k._jt_dict = None
        k._inverse_indices = None
        return k

    # ------------------------------------------------------------------ constructors

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
    ) -> "KeyedJaggedTensor":
        """Build and ``sync()``: per-key lengths are read now (a device sync for device lengths)."""
        return KeyedJaggedTensor(
            keys, values, weights, lengths=lengths, stride=stride, stride_per_key_per_rank=stride_per_key_per_rank
        ).sync()

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
    ) -> "KeyedJaggedTensor":
        """Build and ``sync()`` from offsets (a device sync for device offsets)."""
        return KeyedJaggedTensor(
            keys, values, weights, offsets=offsets, stride=stride, stride_per_key_per_rank=stride_per_key_per_rank
        ).sync()

    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Concatenate one JaggedTensor per key (in dict order). JaggedTensors of different
        batch sizes give a variable stride per key. Weighted only if every one is."""
        what = "KeyedJaggedTensor.from_jt_dict"
        keys = list(jt_dict)
        jts = [jt_dict[k] for k in keys]
        if not jts:
            return KeyedJaggedTensor.empty()
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError(f"{what}: some JaggedTensors have weights and some do not: {dict(zip(keys, weighted))}")
        values = torch.cat([jt.values() for jt in jts])
        weights = torch.cat([jt.weights() for jt in jts]) if all(weighted) else None
        lengths = torch.cat([jt.lengths() for jt in jts])
        strides = [jt.batch_size() for jt in jts]
        hos = [jt._host_offsets for jt in jts]
        lpk = [int(h[-1]) for h in hos] if all(h is not None for h in hos) else None  # type: ignore[index]
        if len(set(strides)) <= 1:
            kjt = KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=strides[0], length_per_key=lpk)
        else:
            kjt = KeyedJaggedTensor(
                keys, values, weights, lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                length_per_key=lpk,
            )
        kjt._jt_dict = dict(jt_dict)
        return kjt

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
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """Same keys and strides, every bag empty (TorchRec leaves ``lengths`` empty here; padless
        keeps the structure consistent: ``lengths`` are zeros)."""
        w = kjt.weights_or_none()
        n = sum(kjt.stride_per_key())
        lengths = torch.zeros(n, dtype=kjt.lengths().dtype, device=kjt.device())
        return KeyedJaggedTensor._make(
            list(kjt.keys()),
            kjt.values().new_empty((0, *kjt.values().shape[1:])),
            None if w is None else w.new_empty((0, *w.shape[1:])),
            lengths,
            None,
            kjt._stride,
            kjt._stride_per_key_per_rank,
            [0] * len(kjt.keys()),
            [0] * (len(kjt.keys()) + 1),
            torch.zeros(n + 1, dtype=torch.int64),
        )

    @staticmethod
    def concat(kjt_list: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of every KJT, in order (same batch, or a variable stride per key)."""
        what = "KeyedJaggedTensor.concat"
        if not kjt_list:
            raise ValueError(f"{what}: needs at least one KeyedJaggedTensor")
        if len(kjt_list) == 1:
            return kjt_list[0]
        weighted = [k.weights_or_none() is not None for k in kjt_list]
        if any(weighted) and not all(weighted):
            raise ValueError(f"{what}: cannot mix weighted and unweighted KeyedJaggedTensors (weighted: {weighted})")
        keys = [key for k in kjt_list for key in k.keys()]
        values = torch.cat([k.values() for k in kjt_list])
        weights = torch.cat([k.weights() for k in kjt_list]) if all(weighted) else None
        lengths = torch.cat([k.lengths() for k in kjt_list])
        keyed = [k for k in kjt_list if k.keys()]  # a KJT without keys has no batch size to agree on
        variable = any(k.variable_stride_per_key() for k in keyed) or len({k.stride() for k in keyed}) > 1
        lpks = [k.length_per_key_or_none() for k in kjt_list]
        lpk = [x for l in lpks for x in l] if all(l is not None for l in lpks) else None  # type: ignore[union-attr]
        hos = [k._host_offsets for k in kjt_list]
        host = None
        if all(h is not None for h in hos):
            host = C.offsets_from_lengths(torch.cat([C.lengths_from_offsets(h) for h in hos]))  # type: ignore[arg-type]
        spkpr = [r for k in kjt_list for r in k.stride_per_key_per_rank()] if variable else None
        return KeyedJaggedTensor._make(
            keys, values, weights, lengths, None,
            max((sum(r) for r in spkpr), default=0) if spkpr is not None else (keyed or kjt_list)[0].stride(),
            spkpr, lpk, None if lpk is None else C.cumsum_list(lpk), host,
        )

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
        if self._lengths is None:
            self._lengths = C.lengths_from_offsets(self._offsets)  # type: ignore[arg-type]
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        return self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            self._offsets = C.offsets_from_lengths(self._lengths)  # type: ignore[arg-type]
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        """Batch size (the largest per-key batch under a variable stride)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        if self._stride_per_key_per_rank is None:
            return [self._stride] * len(self._keys)
        return [sum(r) for r in self._stride_per_key_per_rank]

    def stride_per_key_per_rank(self) -> list[list[int]]:
        if self._stride_per_key_per_rank is None:
            return [[self._stride] for _ in self._keys]
        return self._stride_per_key_per_rank

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

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
        if self._length_per_key is None:
            self.sync()
        return self._length_per_key  # type: ignore[return-value]

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Where each key's values start, plus the end (host list, cached)."""
        if self._offset_per_key is None:
            self.sync()
        return self._offset_per_key  # type: ignore[return-value]

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def host_offsets(self) -> Tensor:
        """Bag offsets as a CPU int64 tensor (cached; reads device offsets once if built on a device)."""
        if self._host_offsets is None:
            self._host_offsets = self.offsets().to("cpu", torch.int64)
        return self._host_offsets

    def sync(self) -> "KeyedJaggedTensor":
        """Compute ``length_per_key``/``offset_per_key`` now (one device sync when the lengths
        live only on a device); returns self."""
        if self._length_per_key is None or self._offset_per_key is None:
            opk = self.host_offsets()[self.lengths_offset_per_key()].tolist()
            self._offset_per_key = opk
            self._length_per_key = [b - a for a, b in zip(opk[:-1], opk[1:])]
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        """Drop the cached per-key host lists (as TorchRec does); returns self."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    # ------------------------------------------------------------------ per key

    def __getitem__(self, key: str) -> JaggedTensor:
        """The JaggedTensor of one key: views of values, weights and lengths (no copy)."""
        idx = self.index_per_key().get(key)
        if idx is None:
            raise KeyError(f"KeyedJaggedTensor: no key {key!r}; keys are {self._keys}")
        opk = self.offset_per_key()
        lop = self.lengths_offset_per_key()
        s, e = opk[idx], opk[idx + 1]
        w = self._weights
        host = None
        if self._host_offsets is not None:
            host = self._host_offsets[lop[idx] : lop[idx + 1] + 1] - s
        return JaggedTensor._make(
            self._values[s:e],
            None if w is None else w[s:e],
            self.lengths()[lop[idx] : lop[idx + 1]],
            None,
            host,
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` in key order (cached)."""
        if self._jt_dict is None:
            self._jt_dict = {k: self[k] for k in self._keys}
        return self._jt_dict

    def permute(self, indices: Sequence[int], indices_tensor: Tensor | None = None) -> "KeyedJaggedTensor":
        """Keys reordered (or repeated, or dropped) as ``[keys[i] for i in indices]``."""
        what = "KeyedJaggedTensor.permute"
        n = len(self._keys)
        for i in indices:
            if not -n <= int(i) < n:
                raise IndexError(f"{what}: index {i} is out of range for {n} keys {self._keys}")
        idx = [int(i) % n for i in indices]
        opk = self.offset_per_key()
        lop = self.lengths_offset_per_key()
        spkpr = self.stride_per_key_per_rank()

        def gather(t: Tensor, bounds: list[int]) -> Tensor:
            parts = [t[bounds[i] : bounds[i + 1]] for i in idx]
            return torch.cat(parts) if parts else t[:0]

        lengths = gather(self.lengths(), lop)
        host = None
        if self._host_offsets is not None:
            host = C.offsets_from_lengths(gather(C.lengths_from_offsets(self._host_offsets), lop))
        lpk = [opk[i + 1] - opk[i] for i in idx]
        variable = self.variable_stride_per_key()
        new_spkpr = [spkpr[i] for i in idx] if variable else None
        return KeyedJaggedTensor._make(
            [self._keys[i] for i in idx],
            gather(self._values, opk),
            None if self._weights is None else gather(self._weights, opk),
            lengths,
            None,
            max((sum(r) for r in new_spkpr), default=0) if new_spkpr is not None else self._stride,
            new_spkpr,
            lpk,
            C.cumsum_list(lpk),
            host,
        )

    def split(self, segments: Sequence[int]) -> list["KeyedJaggedTensor"]:
        """Consecutive groups of ``segments[j]`` keys each (views, no copy)."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(
                f"KeyedJaggedTensor.split: segments {list(segments)} must be >= 0 and sum to the "
                f"{len(self._keys)} keys"
            )
        opk = self.offset_per_key()
        lop = self.lengths_offset_per_key()
        spkpr = self.stride_per_key_per_rank()
        out = []
        start = 0
        for seg in segments:
            end = start + seg
            s, e = opk[start], opk[end]
            ls, le = lop[start], lop[end]
            host = None if self._host_offsets is None else self._host_offsets[ls : le + 1] - s
            variable = self.variable_stride_per_key()
            sub = spkpr[start:end] if variable else None
            out.append(
                KeyedJaggedTensor._make(
                    self._keys[start:end],
                    self._values[s:e],
                    None if self._weights is None else self._weights[s:e],
                    self.lengths()[ls:le],
                    None,
                    max((sum(r) for r in sub), default=0) if sub is not None else self._stride,
                    sub,
                    self._length_per_key[start:end] if self._length_per_key is not None else None,
                    [o - s for o in opk[start : end + 1]],
                    host,
                )
            )
            start = end
        return out

    # ------------------------------------------------------------------ moves

    def _with(self, f: Callable[[Tensor | None], Tensor | None]) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor._make(
            self._keys,
            f(self._values),  # type: ignore[arg-type]
            f(self._weights),
            f(self._lengths),
            f(self._offsets),
            self._stride,
            self._stride_per_key_per_rank,
            self._length_per_key,
            self._offset_per_key,
            self._host_offsets,
        )

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

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weighted"
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride_per_key={self.stride_per_key()}, "
            f"length_per_key={self._length_per_key}, values={tuple(self._values.shape)}, "
            f"dtype={self._values.dtype}, device={self.device()}{w})"
        )
