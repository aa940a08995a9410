"""Samples of similar length as one SDPA call: the CPU path when per-sample calls dominate.

A self-attention batch of many short samples (a d=128 encoder at B=64, lengths 4..64)
spends its attention time in the fixed cost of one fused SDPA call per sample (~40 us
forward + backward here), not in the scores. This path sorts the samples by length and
cuts the sorted list into buckets; each bucket is one ``(G, H, L_b, E)`` SDPA call over
its samples padded to the bucket's longest (``L_b``), with a key-padding mask (causal
attention needs none: right padding never precedes a real key). The cut minimises a cost
model, one call's fixed cost against the padded scores and rows a bucket adds::

    lengths 9 8 8 7 | 3 3 2 | 1         (sorted; three calls instead of eight)
    bucket 0: 4 samples x 9 rows, mask [[1]*9, [1]*8+[0], [1]*8+[0], [1]*7+[0, 0]]

so a batch of long samples keeps one call per sample (padding would cost more than the
calls) and a batch of short ones runs in a few. Rows are gathered once per operand (one
``index_select``, padded slots repeat the sample's last row) and the output rows come
back with one ``index_select``: padded query rows are computed and dropped, padded keys
are masked, so values and gradients are each sample's own dense SDPA (a masked key has
probability 0 and gets a zero gradient). The plan (buckets, indices, masks) is built
once per structure and cached on it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

# Cost model, forward + backward, in microseconds (fitted on this project's 2-core CPU with
# torch 2.13 from the attention-only step of benchmarks/encoder.py, lengths U[16, 256] at
# B=16 and U[4, 64] at B=64, H * E = 128; the per-row and per-score terms scale with H * E).
CALL_US = 45.0  # fixed cost of one SDPA call
SCORE_NS = 20.0  # per (query, key) score
ROW_NS = 30.0  # per padded row inside a bucket
COPY_NS = 400.0  # per row of the batch: the gathers and concatenations of the bucket path


@dataclasses.dataclass
class Plan:
    """Buckets of one structure: ``calls`` holds ``(first padded row, G, L_b, key mask or None)``."""

    calls: list[tuple[int, int, int, Tensor | None]]
    gather: Tensor  # (P,) row of values read by every padded slot
    unpad: Tensor  # (T,) padded slot of every row, in row order
    back: Tensor  # (P,) row of every real slot, T for a padded slot


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward is a gather as well (no zero fill, no scatter).

    ``inverse`` maps every input row to the output row holding it. With ``zero_tail`` the
    output rows ``inverse`` leaves out get a zero gradient (``inverse`` then reads row
    ``len(grad)`` of the gradient, an appended zero row); without it, they are known to
    carry a zero gradient already (padded slots: masked keys, dropped queries).
    """

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor, zero_tail: bool) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.zero_tail = zero_tail
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g: Tensor):
        (inverse,) = ctx.saved_tensors
        if ctx.zero_tail:
            g = torch.cat([g, g.new_zeros((1, *g.shape[1:]))])
        return g.index_select(0, inverse), None, None, None


def cut(lengths: list[int], width: int) -> list[list[int]]:
    """Buckets of sample indices (each sorted by length, longest first) minimising the cost model.

    Contiguous runs of the length-sorted order; dynamic programming over the cut points.
    Samples of length 0 have no rows and are left out.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    lens = [lengths[i] for i in order]
    n = len(order)
    score = SCORE_NS * width / 128 / 1000.0  # us per score
    row = ROW_NS * width / 128 / 1000.0
    best = [0.0] + [float("inf")] * n
    back = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            lb, g = lens[i], j - i
            c = best[i] + CALL_US + g * lb * (lb * score + row)
            if c < best[j]:
                best[j], back[j] = c, i
            if g * lb * lb * score > best[j]:  # a longer bucket only gets costlier
                break
    out = []
    j = n
    while j > 0:
        out.append(order[back[j] : j])
        j = back[j]
    return out[::-1]


def worth(lengths: list[int], cuts: list[list[int]], width: int) -> bool:
    """Whether the buckets cost less than one call per distinct length (exact groups, no copies)."""
    scale = width / 128 / 1000.0
    exact = len({n for n in lengths if n > 0}) * CALL_US + sum(n * n for n in lengths) * SCORE_NS * scale
    padded = sum(len(m) * lengths[m[0]] ** 2 for m in cuts) * SCORE_NS * scale
    rows = sum(len(m) * lengths[m[0]] for m in cuts) * ROW_NS * scale
    return len(cuts) * CALL_US + padded + rows + sum(lengths) * COPY_NS * scale < exact


def plan(lengths: list[int], offsets: list[int], width: int, causal: bool, device: torch.device) -> Plan | None:
    """The bucket plan of a structure (host arithmetic, once per structure), or None where
    one call per sample (and per group of equal lengths) costs less."""
    cuts = cut(lengths, width)
    if not worth(lengths, cuts, width):
        return None
    calls, gather, slots = [], [], []
    start = 0
    for members in cuts:
        lb, g = lengths[members[0]], len(members)
        ln = torch.tensor([lengths[i] for i in members]).view(g, 1)
        ar = torch.arange(lb).view(1, lb)
        base = torch.tensor([offsets[i] for i in members]).view(g, 1)
        gather.append((base + torch.minimum(ar, ln - 1)).reshape(-1))
        valid = ar < ln
        slots.append(valid.reshape(-1))
        ragged = bool((ln != lb).any())
        mask = valid.view(g, 1, 1, lb).to(device) if ragged and not causal else None
        calls.append((start, g, lb, mask))
        start += g * lb
    if not calls:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Plan([], empty, empty, empty)
    gidx = torch.cat(gather)
    real = torch.cat(slots).nonzero().reshape(-1)
    unpad = torch.empty(offsets[-1], dtype=torch.long)
    unpad[gidx[real]] = real
    back = torch.full_like(gidx, offsets[-1])
    back[real] = gidx[real]
    return Plan(calls, gidx.to(device), unpad.to(device), back.to(device))


def attention(qv: Tensor, kv: Tensor, vv: Tensor, p: Plan, is_causal: bool, scale, enable_gqa: bool) -> Tensor:
    """SDPA of ``(T, H, E)`` rows bucket by bucket; output rows ``(T, H, E_v)`` in row order."""
    def pad(x: Tensor) -> Tensor:
        return _Gather.apply(x, p.gather, p.unpad, False)

    qg = pad(qv)
    kg = qg if kv is qv else pad(kv)
    vg = kg if vv is kv else (qg if vv is qv else pad(vv))
    # one split per operand (not a slice per bucket): the backward writes each gradient row once
    sizes = [g * lb for _, g, lb, _ in p.calls]
    qs = qg.split(sizes)
    ks = qs if kg is qg else kg.split(sizes)
    vs = ks if vg is kg else (qs if vg is qg else vg.split(sizes))
    outs = []
    for (_, g, lb, mask), *qkv in zip(p.calls, qs, ks, vs):
        q4, k4, v4 = (t.unflatten(0, (g, lb)).transpose(1, 2) for t in qkv)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        outs.append(o.transpose(1, 2).flatten(0, 1))
    return _Gather.apply(torch.cat(outs), p.unpad, p.back, True)
