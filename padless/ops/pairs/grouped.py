"""Per-sample contractions of NestedTensors as one grouped matmul launch.

The NestedTensor entry points of :mod:`padless.ops.kernels.grouped_mm` (the kernel and its
torch twin live there, below the op families; building the result's structure lives here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from padless.ops.common.structure import build_nested
from padless.ops.kernels import dispatch
from padless.ops.kernels.grouped_mm import Operand, build_desc, grouped_mm, operand, sample_strides
from padless.tensor import layout
from padless.tensor.autograd import values_of


def _static_extent(nt: Any, d: int) -> int | None:
    return None if d in nt._ragged else int(nt._env[d])


def contract_nested(a: Any, la: str, b: Any, lb: str, lout: str) -> Any | None:
    """``einsum(la, lb -> lout)`` over the sample dims of two NestedTensors (batch letter
    excluded) as one grouped matmul, or None when the equation or the inputs are outside
    the kernel's pattern (one contracted letter, one free letter per operand, at most one
    shared static batch letter) or the dispatch picks the twin."""
    if not dispatch.quick_check(a._values, b._values):
        return None
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(lout)) != len(lout):
        return None
    k = [c for c in la if c in lb and c not in lout]
    m = [c for c in la if c not in lb]
    n = [c for c in lb if c not in la]
    h = [c for c in la if c in lb and c in lout]
    if len(k) != 1 or len(m) != 1 or len(n) != 1 or len(h) > 1 or sorted(lout) != sorted(m + n + h):
        return None
    if a.batch_size != b.batch_size or a._values.dtype != b._values.dtype:
        return None
    k, m, n = k[0], m[0], n[0]
    hl = h[0] if h else None
    hx = 1
    if hl is not None:
        ea, eb = _static_extent(a, la.index(hl)), _static_extent(b, lb.index(hl))
        if ea is None or eb is None or ea != eb:
            return None
        hx = ea
    ha, hb = a.host_sizes(), b.host_sizes()
    if not torch.equal(ha[:, la.index(k)], hb[:, lb.index(k)]):
        return None  # the twin raises torch's shape error for the offending sample
    src = {m: (ha, la, a), n: (hb, lb, b)}
    if hl is not None:
        src[hl] = (ha, la, a)
    out_hs = torch.stack([src[c][0][:, src[c][1].index(c)] for c in lout], 1) if a.batch_size else torch.zeros(0, len(lout), dtype=torch.int64)
    out_ragged = tuple(i for i, c in enumerate(lout) if src[c][1].index(c) in src[c][2]._ragged)
    static_shape = tuple(int(src[c][2]._env[src[c][1].index(c)]) for i, c in enumerate(lout) if i not in out_ragged)
    counts = layout.row_counts(out_hs, out_ragged)
    total = int(counts.sum())
    f_out = math.prod(static_shape)
    oc = Operand(out_hs, sample_strides(out_hs, out_ragged, static_shape), (torch.cumsum(counts, 0) - counts) * f_out, lout)
    desc = build_desc(operand(a, la), operand(b, lb), oc, m, n, k, hl)
    av = values_of(a).contiguous().reshape(-1)
    bv = values_of(b).contiguous().reshape(-1)
    c = grouped_mm(av, bv, desc, hx, total * f_out)
    return _wrap(c, total, static_shape, a, out_hs, out_ragged, lout, build_nested)


def _wrap(c, total, static_shape, like, out_hs, out_ragged, lout, build_nested):
    env = [int(out_hs[:, i].max()) if out_hs.shape[0] else 0 for i in range(len(lout))]
    dev = like._values.device
    return build_nested(c.view(total, *static_shape), like, out_hs, out_hs.to(dev), out_ragged, env)


def matmul_nested(a: Any, b: Any) -> Any | None:
    """``a @ b`` for NestedTensors with 2-D or 3-D samples (a shared static leading dim)."""
    if a.sample_dim != b.sample_dim or a.sample_dim not in (2, 3):
        return None
    if a.sample_dim == 2:
        return contract_nested(a, "mk", b, "kn", "mn")
    return contract_nested(a, "hmk", b, "hkn", "hmn")
