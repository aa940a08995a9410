"""Building one KeyedJaggedTensor from several parts: ``concat`` and ``from_jt_dict``.

Each is one pass: the parts' values, weights and lengths are concatenated once, and the
host structure comes from one numpy pass over the joined lengths (or is left to a single
cumsum on first need), never per key. Parts built lazily by the caller are checked first.
"""

from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

from padless.jagged import _checks as C
from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.kjt_base import KeyedJaggedBase

# the parts' own class (``KeyedJaggedTensor``, which sits above this module) builds the result
K = TypeVar("K", bound=KeyedJaggedBase)


def concat(kjt_list: Sequence[K]) -> K:
    """``KeyedJaggedTensor.concat``: the keys of every KJT, in order (same batch, or a
    variable stride per key).

    Each part contributes the rows its lengths use, so a part's unused tail is dropped
    rather than shifted into the next part's keys. A part with a structure fault (its
    lengths need more rows than its values hold, say: TorchRec accepts that, e.g. values
    split at other points than the keys) is not read: then the parts' values are joined as
    they are, as TorchRec joins them, and the result is checked as a whole on first use."""
    what = "KeyedJaggedTensor.concat"
    if not kjt_list:
        raise ValueError(f"{what}: needs at least one KeyedJaggedTensor")
    if len(kjt_list) == 1:
        return kjt_list[0]
    weighted = [k._weights is not None for k in kjt_list]
    if any(weighted) and not all(weighted):
        raise ValueError(f"{what}: cannot mix weighted and unweighted KeyedJaggedTensors (weighted: {weighted})")
    # one pass over the parts: what to concatenate and what is known on the host
    keys: list[str] = []
    vals, ws, lens = [], [], []
    ends: list[int | None] = []
    lpk: list[int] | None = []
    keyed = []  # a KJT without keys has no batch size to agree on
    for k in kjt_list:
        k._check()  # a part built lazily by the caller is checked here (faults are kept, not raised)
    faulty = any(k._fault is not None for k in kjt_list)
    for k in kjt_list:
        keys += k._keys
        opk = k._offset_per_key
        end = None if opk is None or faulty else opk[-1]  # rows it uses: its values may hold an unused tail
        ends.append(end)
        vals.append(C.used(k._values, end))
        if weighted[0]:
            ws.append(C.used(k._weights, end))
        ln = k._lengths if k._lengths is not None else k.lengths()
        lens.append(ln if ln.dim() == 1 else ln.reshape(-1))
        if lpk is not None and k._length_per_key is not None:
            lpk += k._length_per_key
        else:
            lpk = None
        if k._keys:
            keyed.append(k)
    values = torch.cat(vals)  # type: ignore[arg-type]
    weights = torch.cat(ws) if weighted[0] else None  # type: ignore[arg-type]
    lengths = torch.cat(lens)
    first = (keyed or kjt_list)[0]
    variable = any(k._stride_per_key_per_rank is not None or k._stride != first._stride for k in keyed)
    pending = None
    host = None
    if lengths.device.type == "cpu":
        # parts checked and per-key lists known: the bag offsets are one cumsum, on first need
        pending = C.CHECKED if lpk is not None else ""
    elif None not in ends:
        hos = [k._sound_host() for k in kjt_list]
        if all(h is not None for h in hos):
            host = join_host_offsets(hos, C.cumsum_list(ends))  # type: ignore[arg-type]
    spkpr = [r for k in kjt_list for r in k._per_key_ranks()] if variable else None
    inv = None
    if all(k._inverse_indices is not None for k in kjt_list):
        invs = [k._inverse_indices for k in kjt_list]
        inv = ([x for i in invs for x in i[0]], torch.cat([i[1] for i in invs]))  # type: ignore[index]
    if faulty:  # joined as TorchRec joins them; the whole is checked on first use
        return type(kjt_list[0])(
            keys, values, weights, lengths, stride=None if spkpr is not None else first._stride,
            stride_per_key_per_rank=spkpr, length_per_key=lpk, inverse_indices=inv,
        )
    out = type(kjt_list[0])._make(
        keys, values, weights, lengths, None,
        C.vbe_stride(spkpr, inv) if spkpr is not None else first._stride,
        spkpr, lpk, None if lpk is None else C.cumsum_list(lpk), host, inv,
    )
    out._pending = pending
    return out


def from_jt_dict(cls: type[K], jt_dict: Mapping[str, JaggedTensor], force_variable_stride: bool = False) -> K:
    """``KeyedJaggedTensor.from_jt_dict``: one JaggedTensor per key, concatenated in dict order,
    built as ``cls``. ``jt_dict`` has at least one key (the method answers ``{}`` itself)."""
    what = "KeyedJaggedTensor.from_jt_dict"
    keys = list(jt_dict)
    jts = [jt_dict[k] for k in keys]
    weighted = [jt.weights_or_none() is not None for jt in jts]
    if any(weighted) and not all(weighted):
        raise ValueError(f"{what}: some JaggedTensors have weights and some do not: {dict(zip(keys, weighted))}")
    lens, vals, ws, strides = [], [], [], []
    for jt in jts:
        if jt._unchecked:  # built lazily by the caller: its deferred checks run now (faults are kept)
            jt._scan()
        ln = jt._lengths if jt._lengths is not None else jt.lengths()
        ln = ln if ln.dim() == 1 else ln.reshape(-1)
        lens.append(ln)
        strides.append(ln.shape[0])
        vals.append(jt._values)
        ws.append(jt._weights)
    lengths = torch.cat(lens)
    variable = force_variable_stride or strides.count(strides[0]) != len(strides)
    spkpr = [[s] for s in strides] if variable else None
    stride = max(strides) if variable else strides[0]
    if any(jt._fault is not None for jt in jts):  # not read: joined as they are, checked as a whole on first use
        weights = torch.cat(ws) if weighted[0] else None  # type: ignore[arg-type]
        return cls(keys, torch.cat(vals), weights, lengths, stride=None if variable else stride, stride_per_key_per_rank=spkpr)
    # one pass over all keys' lengths gives the bag offsets and the rows each key uses
    host, ends = _bag_offsets(lengths, strides, [jt._host_offsets for jt in jts])
    if ends is not None and any(v.shape[0] != e for v, e in zip(vals, ends)):
        vals = [C.used(v, e) for v, e in zip(vals, ends)]  # type: ignore[misc]  # drop unused tails
        ws = [C.used(w, e) for w, e in zip(ws, ends)]  # type: ignore[misc]
    values = torch.cat(vals)
    weights = torch.cat(ws) if weighted[0] else None  # type: ignore[arg-type]
    opk = None if ends is None else C.cumsum_list(ends)
    kjt = cls._make(keys, values, weights, lengths, None, stride, spkpr, ends, opk, host)
    if ends is None:  # device lengths without host metadata: read them, as TorchRec's sync() does
        kjt.sync()
    kjt._jt_dict = dict(jt_dict)
    return kjt


def _bag_offsets(
    lengths: Tensor, strides: Sequence[int], hos: Sequence[Tensor | None]
) -> tuple[Tensor | None, list[int] | None]:
    """Host bag offsets of concatenated parts and the rows each part uses, in one pass.

    ``lengths`` are the parts' lengths concatenated (part i has ``strides[i]`` bags) and
    ``hos`` their host offsets where known. Host lengths: one cumsum over all of them.
    Device lengths: the parts' host offsets joined, when every part has them; else
    ``(None, None)`` (reading them is a sync, left to the caller).
    """
    if lengths.device.type == "cpu":
        ln = lengths.numpy() if not lengths.requires_grad else lengths.detach().numpy()
        host = np.zeros(ln.size + 1, np.int64)
        host[1:] = ln
        np.cumsum(host, out=host)
        cut = host[C.cumsum_list(strides)]
        return torch.from_numpy(host), (cut[1:] - cut[:-1]).tolist()
    if any(h is None for h in hos):
        return None, None
    ends = [int(h.numpy()[-1]) for h in hos]  # type: ignore[union-attr]
    return join_host_offsets(hos, C.cumsum_list(ends)), ends  # type: ignore[arg-type]


def join_host_offsets(hos: Sequence[Tensor], starts: Sequence[int]) -> Tensor:
    """One host offsets tensor from per-part host offsets, part i shifted by ``starts[i]``."""
    parts = [np.zeros(1, np.int64)] + [h.numpy()[1:] + s for h, s in zip(hos, starts)]
    return torch.from_numpy(np.concatenate(parts))
