"""Batches whose samples repeat another batch's: ``bias.repeat_interleave(N, dim=0)``.

Folded triangle attention repeats a pair bias once per row of its sample so that every folded
sample ``(b, i)`` has a mask (:func:`padless.ops.rows.batch_repeats.repeat_batch`: sample ``(b, i)`` is
``bias[b]``). A consumer that can broadcast the source over the repeated samples (attention over
a folded batch, :mod:`padless.ops.attention.runs`) reads the source instead of the repeated rows:
it then neither reads those rows nor sends a gradient through the repeat.

The record lives on the repeated NestedTensor object itself (not on its structure, which other
tensors share), holds the source NestedTensor and one count per source sample (a few ints), and
is valid only while neither side was written in place since (version counters) and the repeated
tensor still holds the rows it was made with::

    r = bias.repeat_interleave(N, dim=0)       # mark(r, bias, counts)
    source_of(r)                               # RepeatOf(bias, counts)
    r.add_(1.0); source_of(r)                  # None: r's rows are no longer bias's
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from padless.tensor.core import NestedTensor

__all__ = ["RepeatOf", "mark", "source_of", "repeat_rows", "ROW_COPY_SAMPLES"]

_KEY = "_padless_repeat_of"


@dataclasses.dataclass(frozen=True)
class RepeatOf:
    """``counts[s]`` consecutive samples of the marked batch are sample ``s`` of ``source``."""

    source: NestedTensor
    counts: tuple[int, ...]


def mark(out: NestedTensor, source: NestedTensor, counts: tuple[int, ...]) -> None:
    """Record that ``out``'s samples are ``source``'s samples repeated ``counts[s]`` times each.
    Not for inference tensors (they have no version counter to guard the record)."""
    if out._values.is_inference() or source._values.is_inference():
        return
    out.__dict__[_KEY] = (RepeatOf(source, tuple(counts)), out._values, out._values._version, source._values,
                          source._values._version)


def source_of(nt: NestedTensor) -> RepeatOf | None:
    """The repeat ``nt`` was made by, while both sides hold the rows they had then; else None."""
    hit = nt.__dict__.get(_KEY)
    if hit is None:
        return None
    rec, vals, version, src_vals, src_version = hit
    src = rec.source
    if nt._values is not vals or vals._version != version or src._values is not src_vals \
            or src_vals._version != src_version:
        return None
    return rec


ROW_COPY_SAMPLES = 64
"""Up to this many source samples, :func:`repeat_rows` copies each sample's rows broadcast over
its repeats (one copy per sample, no index); more samples take one gather."""


def repeat_rows(values: Tensor, offsets: Sequence[int], counts: Sequence[int]) -> Tensor:
    """Rows ``values[offsets[s]:offsets[s + 1]]`` of every sample ``s`` repeated ``counts[s]``
    times, samples in order, differentiable: ``(sum counts[s] * rows[s], *static)``. Each sample
    is one broadcast copy (narrow rows, a pair bias's ``H`` numbers, gather slowly per row); its
    gradient is the sum over the repeats."""
    return _RepeatRows.apply(values, tuple(offsets), tuple(counts))


class _RepeatRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, offsets: tuple[int, ...], counts: tuple[int, ...]) -> Tensor:
        rows = [offsets[s + 1] - offsets[s] for s in range(len(counts))]
        out = values.new_empty((sum(c * r for c, r in zip(counts, rows)), *values.shape[1:]))
        pos = 0
        for s, (c, r) in enumerate(zip(counts, rows)):
            if c and r:
                seg = values[offsets[s]:offsets[s + 1]]
                out[pos:pos + c * r].view(c, r, *values.shape[1:]).copy_(seg.unsqueeze(0).expand(c, *seg.shape))
            pos += c * r
        ctx.offsets, ctx.counts, ctx.rows, ctx.shape = offsets, counts, rows, values.shape
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_zeros(ctx.shape)
        pos = 0
        for s, (c, r) in enumerate(zip(ctx.counts, ctx.rows)):
            if c and r:
                torch.sum(grad[pos:pos + c * r].reshape(c, r, *grad.shape[1:]), 0,
                          out=out[ctx.offsets[s]:ctx.offsets[s + 1]])
            pos += c * r
        return out, None, None
