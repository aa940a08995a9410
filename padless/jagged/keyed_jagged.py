"""KeyedJaggedTensor: several sparse features (keys), each a JaggedTensor, packed key-major.

The class here adds the constructors, per-key views (``[key]``, ``to_dict``),
``permute``/``split``, moves, TorchRec conversion and printing; its state, construction
checks, deferred structure checks and accessors are ``padless.jagged.kjt_base.KeyedJaggedBase``,
and joining several KJTs (``concat``, ``from_jt_dict``) is ``padless.jagged.kjt_combine``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from padless.jagged import _checks as C
from padless.jagged import _torchrec, fx, kjt_checks, kjt_combine
from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.kjt_base import KeyedJaggedBase


class KeyedJaggedTensor(KeyedJaggedBase):
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

    __slots__ = ()  # the slots are KeyedJaggedBase's

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
        if not jt_dict:
            return KeyedJaggedTensor.empty()
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

    # ------------------------------------------------------------------ per key

    def __getitem__(self, key: str) -> JaggedTensor:
        """The JaggedTensor of one key: views of values, weights and lengths (no copy)."""
        if self._index_per_key is None:  # a repeated key has no one position
            C.unique_keys(f"KeyedJaggedTensor[{key!r}]", self._keys, kjt_checks.POSITIONAL)
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
            C.unique_keys("KeyedJaggedTensor.to_dict()", keys, kjt_checks.POSITIONAL)  # a dict would drop one silently
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
        self._readable()  # reads values through the structure: a fault raises
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
        self._readable()  # reads values through the structure: a fault raises
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
        """TorchRec's KeyedJaggedTensor over the same tensors and host lists (needs the torchrec package)."""
        return _torchrec.module().KeyedJaggedTensor(**_torchrec.kjt_kwargs(self))

    @staticmethod
    def from_torchrec(kjt: Any) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(**_torchrec.kjt_kwargs(kjt))

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


def _per_key_offsets(hn: np.ndarray, keys: int, stride: int) -> np.ndarray:
    """Every key's offsets from 0, ``(keys, stride + 1)``, from the bag offsets of a fixed-batch
    KJT: row i is ``hn[i*stride : (i+1)*stride + 1] - hn[i*stride]`` (a strided view, one subtraction)."""
    hn = np.ascontiguousarray(hn, dtype=np.int64)
    view = np.ndarray((keys, stride + 1), np.int64, buffer=hn, strides=(stride * 8, 8))
    return view - view[:, :1]
