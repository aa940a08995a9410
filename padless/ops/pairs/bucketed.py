"""Per-sample contractions of NestedTensors as a few dense calls over padded buckets.

``einsum`` / ``@`` of two NestedTensors whose ragged dims differ per sample (``q @ k^T`` over
rows of a pair state, ``einsum("bihd,bjhd->bhij", q, k)``, ``attn @ v``) has no segmented GEMM
in torch. Instead of one dense call per sample, samples are grouped into at most
:data:`padless.ops.kernels.layout.MAX_BUCKETS` buckets of similar size
(:func:`padless.ops.kernels.layout.size_buckets`, choosing the count and the splits that
minimise padded work plus a fixed price per call); each operand is gathered once into a
buffer holding every bucket padded with zeros to its own largest extents, the dense
``einsum`` runs once per bucket, and one gather takes every sample's result back to packed
rows. Zeros along a contracted dim add nothing; results at padded positions are dropped, so
the op count does not depend on the batch size. Samples of lengths 2, 5, 4 for
``q (L_i, H, D) x k (L_i, H, D) -> (H, L_i, L_i)``::

    buckets      [0] padded to L=2          [2, 1] padded to L=5
    q buffer     rows (slot, l) of each bucket: 1*2 + 2*5 rows, zeros where l >= L_i
    dense calls  bmm on (1*H, 2, D) x (1*H, D, 2); bmm on (2*H, 5, D) x (2*H, D, 5)
    output       buffer (slot, h, i, j) per bucket; one gather of the valid (i, j, h)
                 elements of both results, in sample order

The scores' buffer is laid out in sample dim order (``(slot, h, i, j)``): when a static dim
comes before a ragged last one (scores ``(H, L_i, L_i)`` stored as rows ``(i, j)`` of ``H``
features), the maps read single elements, so no transposing copy of single elements runs on
either side of the dense call (:func:`_buffer_index`). Other buffers hold whole rows in
storage order (``q (L_i, H, D)``; ``(I, H, J, C)`` rows ``(i, j)`` of ``H * C`` features,
viewed permuted), read through one index per row. Both directions are gathers through maps
whose inverses are known (:func:`padless.ops.kernels.layout.gather_rows`), so no backward
scatters. The maps, the bucket views and the result's structure are computed once per
(operand structures, equation) from host metadata and cached, so a deep stack builds them
once per batch.

The dense side lives in :mod:`padless.ops.pairs.bucket_nodes`: one ``bmm`` per bucket on
permuted views; a two-operand contraction whose gradients are contractions of the same form
(``out,other->mine``) is one autograd node (``_Contract``), others differentiate through the
ops; and ``softmax(s) @ v`` written by hand (an operand that is the bucketed softmax's output
over the dim the contraction sums, :func:`padless.ops.kernels.softmax.softmax_source`) is one
node from ``s`` (``_SoftmaxContract``) whose backward turns the weights' gradient into
``s``'s inside the padded buckets, so the softmax's own backward does not run.

When one dense call per sample costs little next to the samples' work (cubic triangle
products of large pair states on a CPU, where padding and re-laying out the results cost
more than the calls), :func:`contract` declines and the caller's per-sample loop runs.

A two-operand contraction whose result's last dim is ragged (attention scores) returns its
rows pending (:mod:`padless.ops.pairs.pending`): a later ``softmax(scores * c + bias) @ v``
runs as one node in these buckets (:mod:`padless.ops.pairs.attend`), and any other use
computes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from padless.ops.common import content, partners, sample_views
from padless.ops.common.amp import autocast_inputs
from padless.ops.kernels.layout import MAX_BUCKETS, gather_rows, grid_positions, padding_maps, size_buckets
from padless.ops.pairs import pending
from padless.ops.pairs.bucket_nodes import (  # _Contract, _SoftmaxContract: tests reach them here
    _BATCH,
    _buckets,
    _Contract,
    _flatten,
    _Plan,
    _softmax_operand,
    _SoftmaxContract,
)
from padless.tensor import layout
from padless.tensor.autograd import nested_from_values, values_of
from padless.tensor.core import (
    NestedTensor,
    StructureMeta,
    _is_traced,
    envelope_from_sizes,
)

_LETTERS = "abcdefghijklmnopqrstuvwxy"


def _letter_extents(ins: Sequence[str], operands: Sequence[NestedTensor]) -> tuple[dict[str, Tensor], dict[str, int]] | None:
    """Per letter: per-sample extents (ragged in some operand) or one static extent; None when
    a ragged letter's extents differ between operands (size-1 broadcasting: the per-sample path)."""
    ragged: dict[str, Tensor] = {}
    static: dict[str, int] = {}
    for s, o in zip(ins, operands):
        hs = o.host_sizes()
        for d, c in enumerate(s):
            if d in o._ragged:
                col = hs[:, d]
                if c in ragged and not torch.equal(ragged[c], col):
                    return None
                ragged[c] = col
            else:
                e, prev = int(o._env[d]), static.get(c)
                static[c] = e if prev is None or prev == 1 else prev if e == 1 else max(prev, e)  # 1 broadcasts, 0 stays
    for c in ragged:
        if c in static:
            for s, o in zip(ins, operands):
                if c in s and s.index(c) not in o._ragged and not bool((ragged[c] == int(o._env[s.index(c)])).all()):
                    return None
            del static[c]
    return ragged, static


def _buffer_index(hs: list[list[int]], ragged: tuple[int, ...], dims: Sequence[int], where: list[tuple[int, int]],
                  ext: list[list[int]], start: list[int], static: dict[int, int]) -> np.ndarray:
    """Where every packed row (or element) of one operand lies in its padded buffer (host numpy).

    A bucket's buffer holds its slots one after the other, each the dims ``dims`` row-major at
    that bucket's extents ``ext[k]``: the ragged dims in storage order for a buffer of rows, every
    sample dim in sample order for a buffer of elements (``(slot, h, i, j)`` for ``(H, N_i, N_i)``
    scores stored as rows ``(i, j)`` of ``H`` features). A sample's rows enumerate its ragged dims
    in storage order, then (elements) the static dims of ``dims`` in order: per sample one grid
    (:func:`padless.ops.kernels.layout.grid_positions`) at its own extents, at the buffer's strides
    of its bucket, from its slot's start. ``where[i]``: sample ``i``'s bucket and slot."""
    order = [*ragged, *(d for d in dims if d not in ragged)]
    strides, per_slot = [], []
    for e in ext:
        st, acc = {}, 1
        for d, n in zip(reversed(dims), reversed(e)):
            st[d] = acc
            acc *= n
        strides.append([st[d] for d in order])
        per_slot.append(acc)
    own = np.array([[row[d] if d in ragged else static[d] for d in order] for row in hs], dtype=np.int64).reshape(len(hs), len(order))
    base = np.array([start[k] + q * per_slot[k] for k, q in where], dtype=np.int64)
    return grid_positions(own, base, np.array([strides[k] for k, _ in where], dtype=np.int64).reshape(len(hs), len(order)))


def _element_maps(ndim: int, ragged: Sequence[int], width: int = 1) -> bool:
    """Whether a buffer is read through element maps: its rows ``(ragged...,
    static...)`` are not in sample dim order and its last dim is ragged, so the transposing
    copy a row map would need moves single elements (scores ``(H, I, J)`` stored as rows
    ``(i, j)`` of ``H`` features). When the last dim is static (``(I, H, J, C)``), whole
    ``C``-blocks move: row maps (an index per row, not per element) and a permuted view.
    ``width``: the features of one row; an operand whose rows are :data:`ROW_MAP_WIDTH` or
    wider is read by rows even with its last dim ragged (see there)."""
    return (tuple(layout.storage_order(ndim, ragged)) != tuple(range(ndim)) and (ndim - 1) in ragged
            and width < ROW_MAP_WIDTH)


ROW_MAP_WIDTH = 16
"""Row width (features) from which an operand whose last dim is ragged is still read through row
maps: a transposed key ``k.transpose(-1, -2)`` of ``(I, H, K, D)`` rows ``(i, k)`` of ``H * D``
features, as AlphaFold-style triangle attention writes ``q @ k^T``. Element maps for it are
``H * D`` times longer than row maps (built for every new batch, and read element by element
in both directions); by rows, the bucket's dense operand is a permuted view of whole rows,
made contiguous by one copy where the ``bmm`` needs it. Scores and biases (rows of a few heads)
keep element maps."""


CALL_COST = 300_000.0
"""Fixed price of one more bucket (its dense call, the gathers in and out, views and autograd
nodes), in multiply-adds of a small CPU matmul, forward and backward. 300k (not the 100k
the dense call alone costs) keeps small batches on the per-sample loop: the zoo's boltz
layer (B=4, N 16..48, Cz 16) ran 0.22x padded with 100k and 0.32x with 300k, while the
benchmark's layer (B=8, N 16..64, Cz 64) keeps its buckets (2.11x vs 2.15x, one thread)."""
SCORES_CALL_COST = 1_000_000.0
""":data:`CALL_COST` of a contraction whose result's last dim is ragged: attention scores, which
come back as deferred rows (:mod:`padless.ops.pairs.pending`) and usually end in the fused
attention node, whose bucket runs about three times a plain contraction's calls (the terms'
gather, ``baddbmm``, softmax, ``bmm``, the gathers back; forward and backward). It sets how
many buckets such a contraction gets, and on the CPU it is also the price of one sample of
the per-sample loop (:data:`SAMPLE_CALL_COST` otherwise): per sample the scores run the
same chain of calls (the terms, the softmax, the second contraction, their backward) a
bucket does. Measured on boltz's AttentionPairBias (B=8, N 16..64, one thread, CPU time):
two buckets at 300k, one at 1M, 8.5-11.5 against 8.0-9.3 ms per step."""
SAMPLE_CALL_COST = 350_000.0
"""Fixed price of one sample in the per-sample loop (its dense call, slicing, packing and
autograd nodes), in the same units (about 90 us)."""
SAMPLE_CALL_COST_DEVICE = 10_000_000.0
"""The same on an accelerator: each sample's call is several kernel launches, and a step
whose launch count grows with the batch is launch-bound there, so buckets win nearly
always (on the CPU the per-sample loop stays where it is cheaper)."""
BUCKET_FACTOR = 1.15
"""Padded work is dearer than the same work per sample: the buffers are gathered and the
results re-laid out and gathered back (forward and backward)."""
PENDING_FACTOR = 0.8
"""The same factor for attention scores (they defer and end in one fused node,
:mod:`padless.ops.pairs.pending`) and for a contraction of pending weights (``softmax(scores)
@ v`` whose scores were bucketed): in buckets the chain runs as one node; per sample the
weights are computed first and re-laid out. Triangle attention is bucketed so since its
biases stay at their size in the buckets (:mod:`padless.ops.pairs.spread`) and the scores'
element maps are built only when something reads the scores as rows (:class:`LazyMaps`):
before that, each new batch built maps as long as the scores and the layer ran slower with
buckets (354-360 against 215-227 ms per step, two threads)."""
ELEMENT_MAP_COST = 64.0
"""Price of one element of a bucketed operand read through element maps (:func:`_element_maps`:
``(H, I, J)`` stored as rows ``(i, j)``) when its samples are large enough that the per-sample
path would run on views (:func:`padless.ops.common.sample_views.pays`): the maps are built for
each new batch and the operand is gathered through them, forward and backward. (The result's
maps are not priced: they are built only when the result is read as rows, see :class:`LazyMaps`.)
It was measured with the result priced too, on the zoo's boltz layer (B=4, N 16..48, Cz 16,
one thread, a new batch every step): triangle attention, then bucketed in about 40% of
batches, was each time about 17 ns per score element slower than per sample."""
ELEMENT_COST = 4.0
"""Price of one element of an operand or the result (its copies), in the same units."""


def _cost(ins: Sequence[str], out: str, letters: list[str], static: dict[str, int]):
    """Work of one sample slot padded to extents ``env`` (one per ragged letter): the
    multiply-adds of the contraction plus the padded elements it moves. Plain integer
    arithmetic, memoised: bucket choice evaluates it for every span of sorted samples."""
    pos = {c: i for i, c in enumerate(letters)}

    def split(t: str) -> tuple[int, list[int]]:
        return math.prod(static[c] for c in t if c not in pos), [pos[c] for c in t if c in pos]

    terms = [split(t) for t in (*ins, out)]
    every = split("".join(dict.fromkeys("".join((*ins, out)))))
    memo: dict[tuple, float] = {}

    def cost(env: Sequence[int]) -> float:
        key = tuple(env)
        hit = memo.get(key)
        if hit is None:
            moved = 0
            for base, idx in terms:
                for i in idx:
                    base *= key[i]
                moved += base
            work = every[0]
            for i in every[1]:
                work *= key[i]
            hit = memo[key] = float(work) + ELEMENT_COST * moved
        return hit

    return cost


def _element_map_price(ins, out, operands, ragged_ext, static_ext, letters, rows, groups, device) -> float:
    """:data:`ELEMENT_MAP_COST` for every padded element of the operands and the result that
    are read through element maps and whose samples are large enough for per-sample views."""
    pos = {c: i for i, c in enumerate(letters)}
    b = len(rows)
    price = 0.0
    for s, ragged in ((s, o._ragged) for s, o in zip(ins, operands)):  # the result's maps are lazy
        width = math.prod(static_ext[c] for c in s if c not in pos)
        if not ragged or not _element_maps(len(s), ragged, width):
            continue
        per_row = [pos[s[d]] for d in ragged]
        total = sum(math.prod(r[i] for i in per_row) for r in rows)
        if not sample_views.pays(b, total, device):
            continue
        price += ELEMENT_MAP_COST * width * sum(
            len(ids) * math.prod(max(rows[i][j] for i in ids) for j in per_row) for ids in groups)
    return price


def _build(ins: Sequence[str], out: str, operands: Sequence[NestedTensor], forced: Sequence | None = None,
           unread: int | None = None, priced_for: torch.device | None = None,
           pending_operands: Sequence[bool] | None = None) -> _Plan | None:
    """The plan of one contraction; ``forced``: the buckets' samples (another plan's, so two
    contractions share their padded layout), else chosen here (None when the per-sample
    loop is cheaper). ``unread``: an operand whose buffer is never gathered through this plan
    (the weights of a fused attention, computed in the node): its maps are not built
    (``pads[unread]`` is None). The maps are built on the operands' device; the prices are
    those of ``priced_for`` (default that device) and of operands that are pending or not as
    ``pending_operands`` says (default: as they are): a Collator's worker builds on the host
    the plans a batch meets on its device (:mod:`padless.ops.pairs.recipe`)."""
    ext = _letter_extents(ins, operands)
    if ext is None or 0 in ext[1].values():  # a static extent 0 (x[:, 1:] of one head): per sample
        return None
    ragged_ext, static_ext = ext
    b = operands[0].batch_size
    letters = sorted(ragged_ext)
    table = torch.stack([ragged_ext[c] for c in letters], 1) if letters else torch.zeros(b, 0, dtype=torch.int64)
    cost = _cost(ins, out, letters, static_ext)
    # how many buckets: scores (the result's last dim ragged, summed over static letters only)
    # pay the fused node's price per bucket; a product that sums a ragged letter (a triangle
    # multiplication written as a matmul of (C, N_i, N_i) states) is not attention
    summed = {c for t in ins for c in t} - set(out)
    bucket_call = SCORES_CALL_COST if out and out[-1] in ragged_ext and not summed & set(ragged_ext) else CALL_COST
    scores = bucket_call == SCORES_CALL_COST
    rows = table.tolist()
    priced_for = operands[0]._values.device if priced_for is None else priced_for
    call = SAMPLE_CALL_COST if priced_for.type == "cpu" else SAMPLE_CALL_COST_DEVICE
    if scores:  # per sample, scores run the same chain of calls a bucket does
        call = max(call, SCORES_CALL_COST)
    per_sample = sum(cost(r) for r in rows) + b * call
    # pending weights (softmax(scores) @ v), or scores (they defer, and end in the fused node)
    if pending_operands is None:
        pending_operands = [isinstance(o._values, pending.Pending) for o in operands]
    factor = PENDING_FACTOR if scores or any(pending_operands) else BUCKET_FACTOR
    if forced is None and factor * (per_sample - b * call + CALL_COST) > per_sample:
        return None  # even one bucket without padding costs more: no need to choose buckets
    groups = size_buckets(table, cost=cost, overhead=bucket_call) if forced is None else [list(ids) for ids in forced]
    padded = sum(len(ids) * cost([max(rows[i][j] for i in ids) for j in range(len(letters))]) + CALL_COST
                 for ids in groups)
    if forced is None:  # large samples read through element maps (see ELEMENT_MAP_COST)
        padded += _element_map_price(ins, out, operands, ragged_ext, static_ext, letters, rows, groups, priced_for)
    if forced is None and factor * padded > per_sample:
        return None  # large samples (a cubic triangle product): the per-sample loop is cheaper
    nbk = len(groups)
    # per sample its bucket and slot, per bucket its padded extents: plain Python on the host
    # lists (a torch op per bucket and letter cost more than the values)
    where = [(0, 0)] * b
    for k, ids in enumerate(groups):
        for q, i in enumerate(ids):
            where[i] = (k, q)
    env = {c: [max((rows[i][j] for i in ids), default=0) for ids in groups] for j, c in enumerate(letters)}
    counts = [len(ids) for ids in groups]
    dev = operands[0]._values.device

    def index(hs, ragged, s, static, need: bool = True, width: int = 1):
        """The operand's (or the result's) maps into its buffer (None unless ``need``), the
        buffer's start of every bucket and its end, and whether it maps elements. Maps of one
        layout (``q``, ``k``, ``v``, ``softmax(q @ k^T) @ v``: rows of the same sequences in the
        same slots) are built once, cached by content on what they depend on."""
        flat = _element_maps(len(s), ragged, width)  # buffer in sample dim order: maps over elements
        dims = tuple(range(len(s))) if flat else tuple(ragged)
        ext = [[env[s[d]][k] if d in ragged else static[d] for d in dims] for k in range(nbk)]
        start = [0]
        for k in range(nbk):
            start.append(start[-1] + counts[k] * math.prod(ext[k]))
        if not need:
            return None, start, flat
        key = ("bucket_maps", dev, tuple(ragged), dims, hs[:, list(ragged)].numpy().tobytes(), b, groups_key,
               tuple(map(tuple, ext)), tuple(sorted(static.items())) if flat else ())
        maps = content.get(key)
        if maps is None:
            maps = padding_maps(_buffer_index(hs.tolist(), ragged, dims, where, ext, start, static), start[-1], dev)
            held = sum(t.numel() * t.element_size() + 128 for m in maps for t in m if t is not None)
            content.put(key, maps, held + len(key[4]) + PLAN_PYTHON_BYTES)  # counted, not walked
        return maps, start, flat

    groups_key = tuple(tuple(ids) for ids in groups)
    pads, starts, flat = [], [], []
    for j, (s, o) in enumerate(zip(ins, operands)):
        static = {d: int(o._env[d]) for d in range(len(s)) if d not in o._ragged}
        maps, start, fl = index(o.host_sizes(), o._ragged, s, static, j != unread, math.prod(static.values()))
        pads.append(maps)
        starts.append(start)
        flat.append(fl)
    out_ragged = tuple(d for d, c in enumerate(out) if c in ragged_ext)
    out_hs = torch.stack([ragged_ext[c] if c in ragged_ext else torch.full((b,), static_ext[c], dtype=torch.int64)
                          for c in out], 1) if out else torch.zeros(b, 0, dtype=torch.int64)
    out_ho = layout.offsets_from_counts(layout.row_counts(out_hs, out_ragged))
    out_args = (out_hs, out_ragged, out, {d: static_ext[c] for d, c in enumerate(out) if d not in out_ragged})
    _, out_start, out_flat = index(*out_args, need=False)
    flat.append(out_flat)
    # the result's maps: built when first read (fused attention reads its scores in its buckets)
    elements = int(out_ho[-1]) * (math.prod(out_args[3].values()) if out_flat else 1)
    packs = LazyMaps(lambda: index(*out_args)[0], _maps_bytes(elements, out_start[-1]))
    rows = None  # element maps' row twins (bucket_nodes.result_rows: a pair bias read onto the scores)
    if out_flat:
        row_end = index(*out_args, need=False, width=ROW_MAP_WIDTH)[1][-1]
        rows = LazyMaps(lambda: index(*out_args, width=ROW_MAP_WIDTH)[0], _maps_bytes(int(out_ho[-1]), row_end))
    out_static = tuple(static_ext[c] for d, c in enumerate(out) if d not in out_ragged)
    env_out = envelope_from_sizes(out_hs, out_ragged, out_static)
    on_cpu = dev.type == "cpu"
    structure = (out_ho if on_cpu else out_ho.to(dev, non_blocking=True), out_hs if on_cpu else out_hs.to(dev, non_blocking=True),
                 env_out, StructureMeta(out_hs, out_ho))
    per_bucket = [(counts[k], {**{c: env[c][k] for c in letters}, **static_ext}) for k in range(nbk)]
    equation = ",".join(_BATCH + s for s in ins) + "->" + _BATCH + out
    views = [[_view(o, s, nb, ext, fl) for s, o, fl in zip(ins, operands, flat)] for nb, ext in per_bucket]
    out_order = list(range(len(out))) if out_flat else layout.storage_order(len(out), out_ragged)
    out_perm = [0, *[1 + d for d in out_order]]
    out_shapes = [[nb, *[ext[out[d]] for d in out_order]] for nb, ext in per_bucket]
    splits = [[b_ - a_ for a_, b_ in zip(st[:-1], st[1:])] for st in starts]
    return _Plan(equation, per_bucket, pads, packs, splits, flat, views, out_perm, out_shapes,
                 _grad_equations(ins, out, operands), out_ragged,
                 out_static, structure, int(out_ho[-1]),
                 tuple(s[o._ragged[-1]] if o._ragged else "" for s, o in zip(ins, operands)),
                 tuple(tuple(ids) for ids in groups), rows)


def _grad_equations(ins: Sequence[str], out: str, operands: Sequence[NestedTensor]) -> list[str] | None:
    """``out,other->mine`` for both operands of a two-operand contraction whose gradients are
    contractions of the same form (every letter of an operand is in the result or the other
    operand, and static extents agree: no broadcasting to sum back), else None."""
    if len(ins) != 2:
        return None
    (x, y), (a, b) = ins, operands
    if not set(x) <= set(out) | set(y) or not set(y) <= set(out) | set(x):
        return None
    for c in set(x) & set(y):
        dx, dy = x.index(c), y.index(c)
        if (dx in a._ragged) != (dy in b._ragged) or (dx not in a._ragged and int(a._env[dx]) != int(b._env[dy])):
            return None
    return [f"{_BATCH}{out},{_BATCH}{y}->{_BATCH}{x}", f"{_BATCH}{out},{_BATCH}{x}->{_BATCH}{y}"]


def _view(nt: NestedTensor, letters: str, nb: int, ext: dict[str, int], flat: bool = False) -> tuple[list[int], list[int] | None]:
    """Shape of one bucket's rows of an operand's buffer, and the permutation to sample order
    (none for a buffer laid out in sample order, ``flat``)."""
    order = list(range(nt.sample_dim)) if flat else layout.storage_order(nt.sample_dim, nt._ragged)
    shape = [nb, *[ext[letters[d]] if d in nt._ragged else int(nt._env[d]) for d in order]]
    inv = layout.inverse_order(order)
    return shape, ([0, *[1 + p for p in inv]] if inv != list(range(len(inv))) else None)


def _maps_bytes(rows: int, padded: int) -> int:
    """Bytes of :func:`padding_maps` of ``rows`` packed rows into ``padded`` places: a source row
    per place, a place per row (int32 below 2^31), and the holes (int64)."""
    width = 4 if max(rows, padded) < 2 ** 31 else 8
    return width * (padded + rows) + 8 * (padded - rows) + 512


class LazyMaps:
    """A pair of maps built on first indexing (a plan's result maps: attention scores that
    stay in the fused node's buckets are never read as rows, and their element maps, as long
    as the scores, are then never built). Shared by every copy of the plan. ``nbytes``: what
    the maps will hold once built (the content cache counts it when the plan enters)."""

    __slots__ = ("_build", "_maps", "nbytes")

    def __init__(self, build, nbytes: int = 0) -> None:
        self._build, self._maps, self.nbytes = build, None, nbytes

    def __getitem__(self, i: int):
        if self._maps is None:
            self._maps, self._build = self._build(), None
        return self._maps[i]


PLAN_CACHE_SIZE = 16
"""Plans one structure keeps for its latest contraction partners and equations (LRU; the
partners are referenced weakly, see :mod:`padless.ops.common.partners`)."""

_MISS = object()


def _plan(ins: Sequence[str], out: str, operands: Sequence[NestedTensor]) -> _Plan | None:
    key = (tuple(ins), out, operands[0]._values.device)
    others = [o._meta for o in operands[1:]]
    hit = partners.get(operands[0]._meta, "bucketed_plans", key, others, _MISS)
    if hit is not _MISS:
        return hit  # None: this contraction declined the buckets
    plan = _by_content(_content_key(ins, out, operands), operands, lambda: _build(ins, out, operands))
    partners.put(operands[0]._meta, "bucketed_plans", key, others, plan, PLAN_CACHE_SIZE)
    return plan


def _plan_on(ins: Sequence[str], out: str, operands: Sequence[NestedTensor], groups, unread: int | None = None) -> _Plan | None:
    """The plan of a contraction on given buckets (another plan's: the second contraction of a
    fused attention), shared by content as :func:`_plan`'s are; ``unread``: see :func:`_build`."""
    ckey = _content_key(ins, out, operands)
    ckey = None if ckey is None else (*ckey, "on", tuple(tuple(ids) for ids in groups), unread)
    return _by_content(ckey, operands, lambda: _build(ins, out, operands, groups, unread), (groups, unread))


BUILT: list = []
"""Callbacks ``(ins, out, operands, plan, on)`` told of every plan built here (``on``: the
``(groups, unread)`` of a plan on given buckets, else None): how a recipe learns a step's plans
(:mod:`padless.ops.pairs.recipe`)."""


def _by_content(ckey: tuple | None, operands: Sequence[NestedTensor], build, on: tuple | None = None) -> _Plan | None:
    """The plan cached under ``ckey`` (the same rows seen through other structure objects: the
    next layer of a stack, a new batch object), copied for these operands; else ``build()``,
    cached."""
    hit = content.get(ckey) if ckey is not None else None
    if hit is not None:
        return _own_copy(hit[0], operands)
    plan = build()
    if ckey is not None:
        entry = _shared(plan)
        content.put(ckey, entry, _entry_bytes(ckey, entry[0]))
        for tell in BUILT:
            tell(ckey[1], ckey[2], operands, plan, on)
    return plan


def _content_key(ins: Sequence[str], out: str, operands: Sequence[NestedTensor]) -> tuple | None:
    """What a plan depends on besides the structure objects (:func:`plan_key`), for these operands."""
    keys = [content.structure_key(o) for o in operands]
    if any(k is None for k in keys):
        return None
    v = operands[0]._values
    return plan_key(ins, out, v.device, v.dtype, keys, [isinstance(o._values, pending.Pending) for o in operands])


def plan_key(ins: Sequence[str], out: str, device: torch.device, dtype: torch.dtype, keys: Sequence[tuple],
             pending_operands: Sequence[bool], groups: Sequence | None = None, unread: int | None = None) -> tuple:
    """The content cache's key of a plan: the operands' rows (``keys``: their
    :func:`padless.ops.common.content.structure_key`), the equation, the device and dtype, whether
    an operand is pending, the prices (tests change them), and for a plan on given buckets
    (:func:`_plan_on`) those buckets and its unread operand."""
    key = ("bucketed", tuple(ins), out, device, dtype, tuple(keys), tuple(pending_operands),
           (CALL_COST, SCORES_CALL_COST, SAMPLE_CALL_COST, SAMPLE_CALL_COST_DEVICE, BUCKET_FACTOR, PENDING_FACTOR,
            ELEMENT_COST, ELEMENT_MAP_COST, MAX_BUCKETS, sample_views.ROWS_PER_SAMPLE))
    return key if groups is None else (*key, "on", tuple(tuple(ids) for ids in groups), unread)


def _own_copy(plan: _Plan | None, operands: Sequence[NestedTensor]) -> _Plan | None:
    """``plan`` for one structure: its index maps shared, its own result metadata object (the
    content cache holds no structure object, whose caches would grow unaccounted), its own
    derived-buffer cache (the partners are referenced weakly by the structure's cache key)."""
    if plan is None:
        return None
    offsets, sizes, env, meta = plan.structure
    host = meta if isinstance(meta, tuple) else (meta.host_sizes, meta.host_offsets)
    return dataclasses.replace(plan, structure=(offsets, sizes, env, StructureMeta(*host)), cache={})


def _shared(plan: _Plan | None) -> tuple:
    """The content cache's entry for ``plan``: no structure object in it (only the result's
    host sizes and offsets), its index maps counted."""
    if plan is None:
        return (None,)
    offsets, sizes, env, meta = plan.structure
    shared = dataclasses.replace(plan, structure=(offsets, sizes, env, (meta.host_sizes, meta.host_offsets)), cache={})
    return shared, shared.pads, shared.packs


PLAN_PYTHON_BYTES = 4096
"""What a plan's Python parts and its key's hold besides the operands' host sizes and offsets
(equation, per-bucket extents, views and shapes of a few buckets), counted as one figure: walking
them object by object cost more than the host work of a small plan (about 0.2 ms per plan, twice
per attention layer of a new batch)."""


def _entry_bytes(ckey: tuple, plan: _Plan | None) -> int:
    """Bytes of a content-cache entry: the operands' host sizes and offsets in its key, the plan's
    index maps (the result's too, built or not) and its result's metadata tensors (their
    elements), and :data:`PLAN_PYTHON_BYTES`."""
    total = PLAN_PYTHON_BYTES + sum(len(k[1]) + len(k[4]) for k in ckey[5])
    if plan is None:
        return total
    tensors = [t for maps in plan.pads if maps is not None for m in maps for t in m if t is not None]
    for maps in (plan.packs, plan.rows):
        if isinstance(maps, LazyMaps):
            total += maps.nbytes
        elif maps is not None:
            tensors += [t for m in maps for t in m if t is not None]
    offsets, sizes, _, meta = plan.structure
    host = (meta.host_sizes, meta.host_offsets) if isinstance(meta, StructureMeta) else meta
    # each tensor's own elements: a carried plan's maps are views of one buffer per batch
    # (padless.collation.pair_plans), which its few entries share
    return total + sum(t.numel() * t.element_size() + 128 for t in (*tensors, offsets, sizes, *host))


def contract(ins: Sequence[str], out: str, operands: Sequence[NestedTensor]) -> NestedTensor | None:
    """``einsum`` over the sample dims of NestedTensors (``ins``/``out``: the letters of every
    operand and the result, batch letter excluded) in padded buckets, or None when this path
    does not apply (traced, no host metadata, dtypes differ, repeated letters, ragged extents
    that differ between operands of one sample) or would be slower than the per-sample loop
    (samples so large that one dense call each costs little next to their work, see
    :data:`SAMPLE_CALL_COST`): the caller's per-sample path runs then."""
    if not operands or any(_is_traced(o._values) or o._meta.host_sizes is None for o in operands):
        return None
    if len({o._values.dtype for o in operands}) > 1 or len({o.batch_size for o in operands}) > 1:
        return None
    if any(len(set(s)) != len(s) for s in ins) or len(set(out)) != len(out) or operands[0].batch_size == 0:
        return None
    if any(not set(c).issubset(set(_LETTERS)) for c in (*ins, out)):
        ins, out = _rename(ins, out)
    vals = [values_of(o) for o in operands]
    # softmax(a . b * c + terms) . v pending: one node in the scores' buckets, on this
    # contraction's plan for those buckets (its own choice of buckets is not needed)
    attended = pending.attention(ins, out, operands, vals, _grad_equations(ins, out, operands) is not None, _plan_on)
    if attended is not None:
        packed, p2 = attended
        offsets, sizes, env_out, meta = p2.structure
        return nested_from_values(packed, offsets, sizes, p2.out_ragged, env_out, meta)
    plan = _plan(ins, out, operands)
    if plan is None:
        return None
    deferred = pending.deferrable(plan, out, vals)
    fused = _softmax_operand(ins, out, operands, vals) if plan.grad_equations is not None and not deferred else None
    if deferred:  # scores: pending until used
        packed = pending.contract(plan, *vals)
    elif fused is not None:  # softmax(x) @ v: one node from x, its backward in the buckets
        j, x, y = fused
        other = vals[1 - j]
        packed = _SoftmaxContract.apply(plan, j, x, other, y.detach())
    elif plan.grad_equations is not None:  # one autograd node for the whole contraction
        with autocast_inputs(*vals) as vals:  # under autocast: its dtype, one dtype in backward
            packed = _Contract.apply(plan, *vals)
    else:
        bufs = [gather_rows(_flatten(v, fl), to_buf, to_rows) for v, (to_buf, to_rows), fl in zip(vals, plan.pads, plan.flat)]
        packed = gather_rows(_buckets(plan, bufs), plan.packs[1], plan.packs[0])
        packed = packed.view(plan.out_rows, *plan.out_static) if plan.flat[-1] else packed
    offsets, sizes, env_out, meta = plan.structure
    return nested_from_values(packed, offsets, sizes, plan.out_ragged, env_out, meta)


def _rename(ins: Sequence[str], out: str) -> tuple[list[str], str]:
    """The equation with letters from :data:`_LETTERS` (the batch letter is reserved)."""
    names: dict[str, str] = {}
    for c in "".join(ins) + out:
        names.setdefault(c, _LETTERS[len(names)])
    return ["".join(names[c] for c in s) for s in ins], "".join(names[c] for c in out)


def matmul(a: NestedTensor, b: NestedTensor) -> NestedTensor | None:
    """``a @ b`` for NestedTensors of one sample rank ``>= 2`` (batch dims matched dim by dim,
    size-1 static batch dims broadcast), or None (see :func:`contract`)."""
    r = a.sample_dim
    if b.sample_dim != r or r < 2 or r + 2 > len(_LETTERS):
        return None
    batch = _LETTERS[: r - 2]
    m, k, n = _LETTERS[r - 2: r + 1]
    return contract([batch + m + k, batch + k + n], batch + m + n, [a, b])
