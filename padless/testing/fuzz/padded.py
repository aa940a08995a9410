"""Steps with dense operands in padded coordinates: a tensor built from the envelope
(``x.shape``) whose extent along a ragged dim is the envelope's, read at every element's own
coordinates (:mod:`padless.ops.common.padded`): position tables ``(1, L, C)`` and
``emb(arange(x.shape[1]))``, masks ``(B, L)``, additive attention masks ``(B, 1, L, L)``,
pair biases ``(B, N, N, 1)``; buffers and parameters (their gradients are compared too), and
writes to the operand between two reads (``.data.fill_``, ``.data.copy_``, an in-place add
under ``no_grad``), which a stale cache would miss.

The operand is drawn at the envelope of the batch the step meets. On the NestedTensor the
step reads it whole; on sample ``i`` it reads entry ``i`` (or the shared entry 0) windowed to
the sample's own extents (:meth:`padless.testing.fuzz.core.Side.at`), which is what the
padded model computes for that sample's real positions.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step, seeded

# tags (see padless.testing.fuzz.known)
OPERAND_DATA_WRITE = "operand_data_write"
EMPTY_ATTENTION = "empty_attention"
SCORES_OPERAND_WRITE = "scores_operand_write"

WRITES = ("data.fill_", "data.copy_", "no_grad add_")


def _write(d: torch.Tensor, kind: str, seed: int) -> None:
    if kind == "data.fill_":
        d.data.fill_(0.5)
    elif kind == "data.copy_":
        d.data.copy_(seeded(seed + 7, d.shape, d.dtype) if d.is_floating_point() else ~d.data)
    else:
        with torch.no_grad():
            if d.is_floating_point():
                d.add_(1.0)
            else:
                d.logical_not_()


def padded_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the padded-coordinate operand steps that apply to ``x``."""
    ragged = x.ragged_dims
    d_n = x.sample_dim
    env = [int(e) for e in x.shape[1:]]
    b = x.batch_size
    out: list[Callable[[], Step]] = []
    if not ragged:
        return {}

    def operand() -> Step:
        bdim = c.choice([1, b])
        ext = [c.choice([1, env[j]]) for j in range(d_n)]
        r = c.choice(list(ragged))
        ext[r] = env[r]  # at least one ragged dim in padded coordinates
        shape = [bdim, *ext]
        drop = 0
        while drop < len(shape) - 1 and shape[drop] == 1 and c.integer(0, 1):
            drop += 1  # missing leading dims count as 1
        shape = shape[drop:]
        # "sliced": a larger table cut to the envelope, pos[:, :x.shape[1]], as position
        # embeddings are; else the operand has the envelope's extents (a mask from x.shape)
        sliced = c.integer(0, 2) == 0
        big = [n + 2 if j >= len(shape) - d_n and (j - len(shape) + d_n) in ragged and n != 1 else n
               for j, n in enumerate(shape)] if sliced else shape
        kind = c.choice(["add", "mul", "rsub", "where", "masked_fill", "bool_where"])
        boolean = kind == "bool_where"
        rg = not boolean and c.choice([False, True])
        # a write the version counter sees would fail the backward of an op that saved the
        # operand, on both sides: the first read is an add, or a bool mask written by .data
        # (an in-place add to a parameter mid-forward is left out: whether a backward then
        # fails on a saved version depends on torch's backend, on both sides)
        write = c.choice([None, None] + list(WRITES[:2] if boolean or rg else WRITES))
        aligned = [1] * (1 + d_n - len(shape)) + shape
        gathered = any(aligned[1 + j] != 1 for j in ragged)  # read in padded coordinates, not broadcast
        base = seeded(seed, big, x.dtype)
        if boolean:
            base = base > 0

        def read(t, o, d):
            if sliced:  # cut at this side's extents: the envelope, or the sample's own
                lead = d.dim() - d_n
                d = d[(slice(None),) * lead + tuple(slice(0, t.shape[o + j]) if d.shape[lead + j] != 1 else slice(None)
                                                    for j in range(d_n))]
            r = o.at(d, t.shape[o:])
            # a bool mask the dense op saves for its backward (torch.where), then written through
            # .data before the backward: torch's backward reads the written mask (a .data write
            # moves no version counter). padless does the same where the operand broadcasts (extent
            # 1 on every ragged dim: the op saves the operand itself), but a read in padded
            # coordinates is a gather at read time (docs/tensor.md), so its backward keeps the mask
            # as read: the reference snapshots the mask there only
            return r.clone() if boolean and gathered and not o else r

        def use(t, o, v, k):
            if kind == "add":
                return t + v
            if kind == "mul":
                return t * v
            if kind == "rsub":
                return v - t
            if kind == "where":
                return torch.where(v > 0, t, t * 0.5)
            if kind == "masked_fill":
                return t.masked_fill(v > 0.5, 0.25)
            return torch.where(v, t, -t) if k == 0 else t.masked_fill(~v, 0.0)

        def fn(t, o):
            d = o.param(f"operand{seed}", lambda: base.clone().requires_grad_(rg))
            if write is None:
                return use(t, o, read(t, o, d), 0)
            y = use(t, o, read(t, o, d), 0) if boolean else t + read(t, o, d)
            _write(d, write, seed)
            return use(y, o, read(y, o, d), 1)

        tags = {OPERAND_DATA_WRITE} if write and write.startswith("data") else set()
        name = f"operand({kind}, {tuple(shape)}{' cut from ' + str(tuple(big)) if sliced else ''}{', param' if rg else ''}{', then ' + write + ', again' if write else ''})"
        return Step(name, fn, family="padded", tags=frozenset(tags))

    out.append(operand)

    # position table indexed by arange of the envelope: rows (L, *static tail) (nn.Embedding)
    p = ragged[-1]
    if all(j not in ragged for j in range(p + 1, d_n)):
        tail = env[p + 1:]

        def table() -> Step:
            rg = c.choice([False, True])
            n = env[p] + c.integer(0, 2)
            base = seeded(seed, (n, *tail), x.dtype)
            how = c.choice(["index", "embedding"]) if len(tail) == 1 else "index"

            def fn(t, o):
                w = o.param(f"table{seed}", lambda: base.clone().requires_grad_(rg))
                pos = torch.arange(t.shape[o + p])
                e = F.embedding(pos, w) if how == "embedding" else w[pos]
                return t + e

            return Step(f"pos_table({how}, arange(shape[{p}]){', param' if rg else ''})", fn, family="padded")

        out.append(table)

    if d_n == 3 and ragged == (1,):  # heads (H, L, D): attention with a dense mask or bias
        h = env[0]

        def attention() -> Step:
            bdim = c.choice([1, b])
            hm = c.choice([1, h])
            how = c.choice(["sdpa", "scores"])
            rg = c.choice([False, True])
            write = c.choice([None, None] + list(WRITES[:2] if rg else WRITES))
            base = seeded(seed, (bdim, hm, env[1], env[1]), x.dtype)

            def fn(t, o):
                m = o.param(f"mask{seed}", lambda: base.clone().requires_grad_(rg))
                sh = (t.shape[o], t.shape[o + 1], t.shape[o + 1])
                if how == "sdpa":
                    y = F.scaled_dot_product_attention(t, t, t, attn_mask=o.at(m, sh))
                else:
                    s = (t @ t.transpose(-1, -2)) * 0.5 + o.at(m, sh)
                    y = s.softmax(-1) @ t
                if write is None:
                    return y
                _write(m, write, seed)
                return F.scaled_dot_product_attention(y, t, t, attn_mask=o.at(m, sh))

            tags = {OPERAND_DATA_WRITE} if write and write.startswith("data") else set()
            if env[1] == 0:
                tags.add(EMPTY_ATTENTION)
            if write and how == "scores":
                tags.add(SCORES_OPERAND_WRITE)
            name = f"attention({how}, mask ({bdim}, {hm}, L, L){', param' if rg else ''}{', then ' + write if write else ''})"
            return Step(name, fn, family="padded", tags=frozenset(tags))

        out.append(attention)
    return {"padded": out}
