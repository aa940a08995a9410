"""Checks for a NestedTensor rebuilt from untrusted parts (unpickling, ``torch.load``).

``torch.load(weights_only=True)`` refuses to run code, but it hands padless whatever
tensors the file holds: offsets that skip rows, sizes whose products disagree with
them, row ids that file sample 1's rows under sample 0. Ops trust the structure (that
is what makes them fast), so it is checked here once, on the host, before a
NestedTensor exists:

* ``sizes`` ``(B, D)`` int64 and ``offsets`` ``(B+1,)`` int64; ``ragged`` distinct dims
  in ``range(D)``; ``values`` holds one dim per static sample dim;
* every extent ``>= 0``; every static extent equals ``values``' extent there;
* ``offsets`` start at 0, never decrease (compared, not subtracted: differences of
  int64 offsets wrap), step by each sample's row count (the product of its ragged
  extents), and end at ``len(values)``;
* host copies, when carried, equal the tensors they mirror;
* the envelope is recomputed from the sizes (it is derived, never trusted);
* carried caches (``cu_seqlens``, ``row_ids``, ``partitions``) are validated with
  vectorised checks, O(B) or O(rows), never a Python loop over samples.

The arithmetic is written inline rather than through :mod:`padless.tensor.layout`:
a collated batch arriving from a DataLoader worker is checked, not recomputed
(``tests/collation/test_opcache.py`` counts calls into ``layout``).

:func:`norm_ragged_dims` checks the other untrusted input, the ``ragged_dims`` a caller
names (shared by the constructors and the compiled ``from_padded``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from padless.tensor.errors import StructureError

WHAT = "NestedTensor (unpickled)"


def _fail(msg: str) -> StructureError:
    return StructureError(f"{WHAT}: {msg}; the saved structure is inconsistent (corrupt or forged file)")


def _int_tensor(t: Any, name: str, ndim: int) -> Tensor:
    if type(t) not in (Tensor, torch.nn.Parameter):
        raise _fail(f"{name} must be a plain tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.dim() != ndim:
        raise _fail(f"{name} must be a {ndim}-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return t


def _host(t: Tensor) -> Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def check_structure(
    values: Any,
    offsets: Any,
    sizes: Any,
    ragged: Any,
    host_sizes: Any,
    host_offsets: Any,
) -> tuple[tuple[int, ...], list[int], Tensor, Tensor]:
    """Validate the parts of a NestedTensor; return ``(ragged, envelope, host_sizes, host_offsets)``.

    Raises :class:`~padless.StructureError` naming the first inconsistency.
    """
    if not isinstance(values, Tensor) or values.dim() < 1:
        raise _fail(f"values must be a tensor with a row dim, got {type(values).__name__}")
    sizes = _int_tensor(sizes, "sizes", 2)
    offsets = _int_tensor(offsets, "offsets", 1)
    b, ndim = sizes.shape
    if offsets.shape[0] != b + 1:
        raise _fail(f"offsets has {offsets.shape[0]} entries for {b} samples (needs B+1 = {b + 1})")
    if not isinstance(ragged, (tuple, list)) or not all(type(d) is int for d in ragged):
        raise _fail(f"ragged dims must be a tuple of ints, got {ragged!r}")
    ragged = tuple(ragged)
    if len(set(ragged)) != len(ragged) or any(not 0 <= d < ndim for d in ragged):
        raise _fail(f"ragged dims {ragged} must be distinct sample dims in range({ndim})")
    static = [d for d in range(ndim) if d not in ragged]
    if values.dim() - 1 != len(static):
        raise _fail(
            f"values of shape {tuple(values.shape)} has {values.dim() - 1} static dims, but samples of rank "
            f"{ndim} with ragged dims {ragged} have {len(static)}"
        )
    hs = _mirror(sizes, host_sizes, "host_sizes", "sizes")
    ho = _mirror(offsets, host_offsets, "host_offsets", "offsets")
    neg = hs < 0
    if bool(neg.any()):
        i, d = (int(k) for k in neg.nonzero()[0])
        raise _fail(f"sample {i} has extent {int(hs[i, d])} along dim {d}")
    if static:
        want = torch.tensor(values.shape[1:], dtype=torch.int64)
        bad = (hs[:, static] != want).any(1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise _fail(
                f"sample {i} has shape {tuple(hs[i].tolist())} but values' static dims {tuple(static)} "
                f"have extents {tuple(values.shape[1:])}"
            )
    ext = hs[:, list(ragged)]
    if ragged and b and bool((ext.double().log2().sum(1) > 62).any()):  # log2(0) = -inf: fine
        i = int((ext.double().log2().sum(1) > 62).nonzero()[0, 0])
        raise _fail(f"sample {i}'s extents {tuple(hs[i].tolist())} multiply past int64")
    counts = ext.prod(1) if ragged else torch.ones(b, dtype=torch.int64)
    if int(ho[0]) != 0:
        raise _fail(f"offsets must start at 0, got offsets[0]={int(ho[0])}")
    dec = ho[1:] < ho[:-1]  # compared first: the steps below are differences, which wrap for such offsets
    if bool(dec.any()):
        i = int(dec.nonzero()[0, 0])
        raise _fail(f"offsets decrease at sample {i}: offsets[{i}]={int(ho[i])} > offsets[{i + 1}]={int(ho[i + 1])}")
    bad = (ho[1:] - ho[:-1]) != counts
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise _fail(
            f"sample {i} spans offsets[{i}:{i + 2}] = {int(ho[i])}..{int(ho[i + 1])} "
            f"({int(ho[i + 1] - ho[i])} rows), but its shape {tuple(hs[i].tolist())} needs {int(counts[i])}"
        )
    if int(ho[-1]) != values.shape[0]:
        raise _fail(f"offsets end at {int(ho[-1])}, but values has {values.shape[0]} rows")
    maxes = hs.amax(0).tolist() if b else [0] * ndim
    env = [int(maxes[d]) for d in range(ndim)]
    for d, s in zip(static, values.shape[1:]):
        env[d] = int(s)
    return ragged, env, hs, ho


def _mirror(dev: Tensor, host: Any, name: str, of: str) -> Tensor:
    """The host copy of ``dev``: the carried one when it equals ``dev``, else ``dev`` itself."""
    if host is None:
        return _host(dev)
    host = _int_tensor(host, name, dev.dim())
    if host.device.type != "cpu":
        raise _fail(f"{name} must live on the CPU, got {host.device}")
    if host.shape != dev.shape or not torch.equal(host, _host(dev)):
        raise _fail(f"{name} {host.tolist()} differs from {of} {_host(dev).tolist()}")
    return host


def check_carried(
    carried: dict, ragged: Sequence[int], hs: Tensor, ho: Tensor, values: Tensor, offsets_device: torch.device
) -> dict[str, Any]:
    """Validate carried caches against the (already validated) structure; return the good ones.

    An entry on another device than the values (``map_location``) is dropped; one that
    disagrees with the structure raises.
    """
    out: dict[str, Any] = {}
    b = hs.shape[0]
    cu, rid, parts = carried.get("cu_seqlens"), carried.get("row_ids"), carried.get("partitions")
    if cu is not None:
        if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.shape != ho.shape:
            raise _fail(f"carried cu_seqlens must be int32 of shape {tuple(ho.shape)}, got {_describe(cu)}")
        if not torch.equal(_host(cu).to(torch.int64), ho):
            raise _fail(f"carried cu_seqlens {_host(cu).tolist()} differ from offsets {ho.tolist()}")
        if cu.device == offsets_device:
            out["cu_seqlens"] = cu
    if rid is not None:
        t = values.shape[0]
        if not isinstance(rid, Tensor) or rid.dtype != torch.int64 or tuple(rid.shape) != (t,):
            raise _fail(f"carried row_ids must be int64 of shape ({t},), got {_describe(rid)}")
        counts = (ho[1:] - ho[:-1]).to(rid.device)
        # non-decreasing ids in [0, B) with each sample's row count: exactly the canonical map
        ok = t == 0 or (
            bool(((rid >= 0) & (rid < b)).all())
            and bool((rid[1:] >= rid[:-1]).all())
            and torch.equal(torch.bincount(rid, minlength=b), counts)
        )
        if not ok:
            raise _fail("carried row_ids do not give every row its sample (ids must follow offsets)")
        if rid.device == values.device:
            out["row_ids"] = rid
    if parts is not None:
        want = _partitions(hs, ragged)
        if (
            not isinstance(parts, (list, tuple))
            or len(parts) != len(want)
            or not all(isinstance(p, Tensor) and p.dtype == torch.int64 and p.device.type == "cpu" for p in parts)
            or not all(p.shape == w.shape and torch.equal(p, w) for p, w in zip(parts, want))
        ):
            raise _fail("carried partitions differ from the row splits of sizes")
        out["partitions"] = tuple(parts)
    return out


def _partitions(hs: Tensor, ragged: Sequence[int]) -> tuple[Tensor, ...]:
    """Row splits per ragged level (same rule as ``layout.partitions``, written inline)."""
    groups = torch.ones(hs.shape[0], dtype=torch.int64)
    out = []
    for d in ragged:
        n = hs[:, d]
        per_group = torch.repeat_interleave(n, groups)
        level = torch.zeros(per_group.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(per_group, 0, out=level[1:])
        out.append(level)
        groups = groups * n
    return tuple(out)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} of shape {tuple(x.shape)}"
    return type(x).__name__


# ---------------------------------------------------------------------------- caller arguments


def norm_ragged_dims(dims: Sequence[int] | int, ndim: int, what: str) -> tuple[int, ...]:
    """``ragged_dims`` as a caller gives them (an int or ints; sample dims, batch excluded,
    negative allowed) checked and normalised: distinct, in ``range(ndim)``, ascending."""
    if isinstance(dims, int):
        dims = (dims,)
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"{what}: ragged_dims must be ints (sample dims, batch excluded), got {d!r}")
        if not -ndim <= d < ndim:
            raise StructureError(
                f"{what}: ragged dim {d} is out of range for samples of rank {ndim} "
                f"(ragged_dims count sample dims, batch excluded)"
            )
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise StructureError(f"{what}: ragged_dims {tuple(dims)} repeats a dim")
    return tuple(sorted(out))
