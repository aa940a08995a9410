"""Attention over runs of equal-length samples: a folded batch attends in place.

A pair state folded into the batch (``z.reshape(B * N, N, d)``, :mod:`padless.ops.rows.folds`)
is a batch of ``sum N_b`` samples whose lengths come in runs: parent ``b`` gives ``N_b``
consecutive samples of length ``N_b``, and their rows are consecutive in the buffer. A run of
``G`` consecutive ``(H, L, E)`` samples of one length is one dense ``(G, L, H, E)`` tensor where
it lies (a view of the rows: nothing stacked, nothing gathered), so attention runs once per run
(``B`` calls for ``B`` parents) instead of once per sample or per length over stacked copies::

    rows of samples s .. s+G-1   (G * L, H, E)  -> view (G, L, H, E) -> (G, H, L, E)

The mask is read per run too. A per-row repeat of a pair bias (``bias.repeat_interleave(N,
dim=0)``: sample ``(b, i)`` is ``bias[b]``, :mod:`padless.ops.common.repeats`) is not read at
all: the run of parent ``b`` reads ``bias[b]`` once and broadcasts it over its rows, and the
bias gradient is summed over them there. Any other NestedTensor mask is viewed per run like the
query. Runs are split wherever the query or key length, the mask's sample shape or the repeated
sample changes, so each run's samples share one mask layout.

Per run, torch's SDPA runs on the views (its fused CPU kernel, also with a mask that needs no
gradient). A mask that needs a gradient makes torch fall back to its unfused math path; on the
CPU those calls run instead in one autograd node over every run (:class:`_RunAttention`):
per run ``softmax(bias + scale * q k^T) v`` with one ``baddbmm``, a softmax and a ``bmm``, and
a backward that writes the query, key, value and mask gradients into one buffer each.
Values and gradients are each sample's own dense SDPA: a run is a batch of exact lengths with no
padded position.

Taken (eager only) when there is no dropout and no mask_mod/score_mod, the mask (if any) is a
NestedTensor whose samples end in ``(L_i, S_i)``, and runs hold at least :data:`MIN_RUN` samples
on average (a folded batch: ``N_b``); other batches keep :mod:`padless.ops.attention.sdpa`'s
per-sample path.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from padless.ops.common import repeats
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _is_traced

__all__ = ["MIN_RUN", "ENABLED", "plan", "attention"]

MIN_RUN = 4
"""Mean samples per run from which runs are taken (fewer: the per-sample path groups lengths)."""

ENABLED = True
"""False sends every call to the per-sample path (A/B timing)."""


@dataclasses.dataclass(frozen=True)
class _MaskRows:
    """How a run reads its mask: rows ``[start, stop)`` of the mask buffer, ``count`` samples
    (1: one sample broadcast over the run's rows) of sample shape ``shape`` stored in ``order``."""

    start: int
    stop: int
    count: int
    shape: tuple[int, ...]
    order: tuple[int, ...]

    def view(self, buf: Tensor) -> Tensor:
        """The run's mask in ``buf`` as ``(count, H or 1, L, S)`` (a view)."""
        rows = buf[self.start:self.stop]
        t = rows.reshape([self.count] + [self.shape[d] for d in self.order])
        t = t.permute([0] + [1 + p for p in layout.inverse_order(self.order)])
        return t.unsqueeze(1) if len(self.shape) == 2 else t


@dataclasses.dataclass(frozen=True)
class Run:
    """``count`` consecutive samples of query length ``lq`` and key length ``lk``, starting at
    query row ``q0`` and key row ``k0``; ``mask`` says where its mask lies (None: no mask)."""

    q0: int
    k0: int
    count: int
    lq: int
    lk: int
    mask: _MaskRows | None


@dataclasses.dataclass(frozen=True)
class Plan:
    runs: tuple[Run, ...]
    mask: NestedTensor | None  # the tensor whose rows the runs' masks view (a repeat's source)


def _breaks(*columns: np.ndarray) -> np.ndarray:
    """Indices where any column changes value (a run starts), 0 included."""
    n = columns[0].shape[0]
    change = np.zeros(n, dtype=bool)
    if n:
        change[0] = True
    for c in columns:
        if n > 1:
            change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


def _eligible(q: NestedTensor, k: NestedTensor, v: NestedTensor, mask) -> bool:
    if not ENABLED or q.batch_size < MIN_RUN or torch.compiler.is_compiling():
        return False
    if mask is not None and not isinstance(mask, NestedTensor):
        return False
    for t in (q, k, v) + ((mask,) if mask is not None else ()):
        if t._meta.host_sizes is None or _is_traced(t._values):
            return False
    if any(t._values.dim() != 3 for t in (q, k, v)):
        return False
    if mask is None:
        return q._values.device.type == "cpu"  # on an accelerator the varlen kernels take it
    return True


def plan(q: NestedTensor, k: NestedTensor, v: NestedTensor, mask) -> Plan | None:
    """The runs of this call, or None when the per-sample path should take it (module docstring).
    Host ints only; an inconsistent mask returns None (the per-sample path names the problem)."""
    if not _eligible(q, k, v, mask):
        return None
    hq, hk = q._meta.host_sizes.numpy(), k._meta.host_sizes.numpy()
    lq, lk = hq[:, 1], hk[:, 1]
    b = q.batch_size
    rep = repeats.source_of(mask) if mask is not None else None
    src = rep.source if rep is not None else mask
    columns = [lq, lk]
    owner = None
    if mask is not None:
        if src.sample_dim not in (2, 3) or tuple(src._ragged) not in ((src.sample_dim - 2, src.sample_dim - 1),
                                                                     (src.sample_dim - 1, src.sample_dim - 2)):
            return None
        hm = mask._meta.host_sizes.numpy()
        if hm.shape[0] != b or hm.shape[1] != src.sample_dim or not (np.array_equal(hm[:, -2], lq)
                                                                    and np.array_equal(hm[:, -1], lk)):
            return None
        if src.sample_dim == 3:
            columns.append(hm[:, 0])
        if rep is not None:
            if len(rep.counts) != src.batch_size or sum(rep.counts) != b:
                return None
            owner = np.repeat(np.arange(len(rep.counts)), rep.counts)
            columns.append(owner)
    starts = _breaks(*columns)
    if len(starts) * MIN_RUN > b:
        return None
    ends = np.append(starts[1:], b)
    qo, ko = q.host_offsets().numpy(), k.host_offsets().numpy()
    if mask is not None:
        mo, order = src.host_offsets().numpy(), layout.storage_order(src.sample_dim, src._ragged)
        shapes = src._meta.host_sizes.numpy()
    runs = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        mr = None
        if mask is not None:
            if owner is not None:  # one source sample broadcast over the run
                p = int(owner[s])
                mr = _MaskRows(int(mo[p]), int(mo[p + 1]), 1, tuple(shapes[p].tolist()), order)
            else:
                mr = _MaskRows(int(mo[s]), int(mo[e]), e - s, tuple(shapes[s].tolist()), order)
        runs.append(Run(int(qo[s]), int(ko[s]), e - s, int(lq[s]), int(lk[s]), mr))
    return Plan(tuple(runs), src)


def attention(q: NestedTensor, k: NestedTensor, v: NestedTensor, p: Plan, is_causal: bool, scale, enable_gqa: bool) -> Tensor:
    """SDPA over ``p``'s runs; the output's packed rows ``(Tq, H, Ev)``."""
    qv = values_of(q)
    kv = qv if k is q else values_of(k)
    vv = kv if v is k else (qv if v is q else values_of(v))
    mv = values_of(p.mask) if p.mask is not None else None
    scale = qv.shape[-1] ** -0.5 if scale is None else scale
    if (mv is not None and mv.requires_grad and torch.is_grad_enabled() and qv.device.type == "cpu"
            and not is_causal and mv.dtype == qv.dtype and qv.dtype.is_floating_point
            and qv.shape[1] == kv.shape[1] == vv.shape[1] and qv.shape[2] == kv.shape[2]):
        return _RunAttention.apply(qv, kv, vv, mv, p.runs, float(scale))
    return _per_run(qv, kv, vv, mv, p.runs, is_causal, scale, enable_gqa)


def _per_run(qv, kv, vv, mv, runs: Sequence[Run], is_causal, scale, enable_gqa) -> Tensor:
    """torch's SDPA once per run on views of the rows (one split per buffer: the backward
    writes each buffer's gradient once). Runs cover every sample in order."""
    qs = torch.split(qv, [r.count * r.lq for r in runs])
    ks = qs if kv is qv else torch.split(kv, [r.count * r.lk for r in runs])
    vs = ks if vv is kv else (qs if vv is qv else torch.split(vv, [r.count * r.lk for r in runs]))
    outs = []
    for r, qr, kr, vr in zip(runs, qs, ks, vs):
        if r.lq == 0:
            continue
        qg = qr.reshape(r.count, r.lq, *qv.shape[1:]).transpose(1, 2)
        kg = kr.reshape(r.count, r.lk, *kv.shape[1:]).transpose(1, 2)
        vg = vr.reshape(r.count, r.lk, *vv.shape[1:]).transpose(1, 2)
        mg = r.mask.view(mv) if r.mask is not None else None
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mg, is_causal=is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
        outs.append(o.transpose(1, 2).reshape(r.count * r.lq, o.shape[1], o.shape[-1]))
    if not outs:
        return qv.new_empty((0, qv.shape[1], vv.shape[-1]))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _heads_first(buf: Tensor, start: int, count: int, length: int) -> Tensor:
    """Rows ``[start, start + count * length)`` of ``buf (T, H, E)`` as ``(count * H, length, E)``
    (one copy: the heads interleave in the rows)."""
    h, e = buf.shape[1], buf.shape[2]
    rows = buf[start:start + count * length].reshape(count, length, h, e)
    return rows.transpose(1, 2).reshape(count * h, length, e)


def _rows_view(buf: Tensor, start: int, count: int, length: int) -> Tensor:
    """The same rows of ``buf`` as a ``(count, H, length, E)`` view (to write into)."""
    h, e = buf.shape[1], buf.shape[2]
    return buf[start:start + count * length].view(count, length, h, e).transpose(1, 2)


class _RunAttention(torch.autograd.Function):
    """``softmax(mask + scale * q k^T) v`` per run, one node (module docstring). Rows where every
    key is masked with ``-inf`` give zeros, as torch's math path does."""

    @staticmethod
    def forward(ctx, qv: Tensor, kv: Tensor, vv: Tensor, mv: Tensor, runs: Sequence[Run], scale: float) -> Tensor:
        h, ev = qv.shape[1], vv.shape[2]
        out = qv.new_empty((qv.shape[0], h, ev))  # every row is written: a run without keys gives zeros
        safe = bool(torch.isneginf(mv).any())  # a row masked everywhere: zeros, not NaN (host tensor)
        saved = []
        for r in runs:
            if r.lq == 0 or r.lk == 0:
                out[r.q0:r.q0 + r.count * r.lq].zero_()
                saved.append(None)
                continue
            qr, kr, vr = (_heads_first(b, s, r.count, n) for b, s, n in ((qv, r.q0, r.lq), (kv, r.k0, r.lk), (vv, r.k0, r.lk)))
            s = torch.empty((r.count, h, r.lq, r.lk), dtype=qv.dtype, device=qv.device)
            s.copy_(r.mask.view(mv))
            s = s.view(r.count * h, r.lq, r.lk).baddbmm_(qr, kr.transpose(1, 2), alpha=scale)
            p = torch.ops.aten._safe_softmax(s, -1) if safe else torch.softmax(s, -1)
            _rows_view(out, r.q0, r.count, r.lq).copy_(torch.bmm(p, vr).view(r.count, h, r.lq, ev))
            saved.append((qr, kr, vr, p))
        ctx.runs, ctx.saved, ctx.scale = runs, saved, scale
        ctx.shapes = (qv.shape, kv.shape, vv.shape, mv.shape, mv.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        (qs, ks, vs, ms, mdt), scale = ctx.shapes, ctx.scale
        dout = dout.contiguous()
        need_q, need_k, need_v, need_m = ctx.needs_input_grad[:4]
        dq = dout.new_empty(qs) if need_q else None  # every row is written (zeros where a run has no
        dk = dout.new_empty(ks) if need_k else None  # queries or no keys)
        dv = dout.new_empty(vs) if need_v else None
        dm = dout.new_zeros(ms, dtype=mdt) if need_m else None
        h, ev = qs[1], vs[2]
        for r, held in zip(ctx.runs, ctx.saved):
            if held is None:
                for buf, start, n in ((dq, r.q0, r.lq), (dk, r.k0, r.lk), (dv, r.k0, r.lk)):
                    if buf is not None:
                        buf[start:start + r.count * n].zero_()
                continue
            qr, kr, vr, p = held
            do = _heads_first(dout, r.q0, r.count, r.lq)
            if dv is not None:
                _rows_view(dv, r.k0, r.count, r.lk).copy_(torch.bmm(p.transpose(1, 2), do).view(r.count, h, r.lk, ev))
            ds = torch._softmax_backward_data(torch.bmm(do, vr.transpose(1, 2)), p, -1, p.dtype)
            if dq is not None:
                _rows_view(dq, r.q0, r.count, r.lq).copy_(torch.bmm(ds, kr).mul_(scale).view(r.count, h, r.lq, -1))
            if dk is not None:
                _rows_view(dk, r.k0, r.count, r.lk).copy_(
                    torch.bmm(ds.transpose(1, 2), qr).mul_(scale).view(r.count, h, r.lk, -1))
            if dm is not None:
                target = r.mask.view(dm)
                g = ds.view(r.count, h, r.lq, r.lk)
                dims = [d for d in range(4) if target.shape[d] == 1 and g.shape[d] != 1]
                target.add_(g.sum(dims, keepdim=True) if dims else g)
        ctx.saved = None
        return dq, dk, dv, dm, None, None
