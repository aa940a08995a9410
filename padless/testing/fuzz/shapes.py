"""Steps that read sizes from shapes: reshape/view targets built from extents and their
arithmetic, the tokens round trip of images, and packed rows.

Every target is written from ``t.shape`` (or ``t.size(d)``) once for both sides: on the
NestedTensor its ragged entries are :class:`padless.tensor.extents.Extent` ints that
remember every sample's own size, on a sample they are that sample's sizes, so the dense
side is exactly what the padded model code does to one sample alone.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step, seeded

# tags (see padless.testing.fuzz.known)
RESHAPE_EXTENTS = "reshape_extents"
VIEW_REINTERPRET = "view_reinterpret"
RESHAPE_PLAIN = "reshape_plain"
EXTENT_MINMAX = "extent_minmax"
FLATTEN_TRANSPOSED = "flatten_transposed"


def _prod(xs: list[Any]) -> Any:
    return functools.reduce(operator.mul, xs)


def _entry(t, o, j: int, by_size: bool) -> Any:
    """Sample dim ``j``'s extent, read as ``t.shape[o + j]`` or ``t.size(o + j)``."""
    return t.size(o + j) if by_size else t.shape[o + j]


def _inner(c: Chooser, x_width: int | None, seed: int, dtype: torch.dtype) -> tuple[str, Callable]:
    """A feature op to run between two reshapes (on the last dim when ``x_width`` is given)."""
    options = ["tanh", "affine"] + (["linear", "layer_norm"] if x_width else [])
    kind = c.choice(options)
    if kind == "tanh":
        return kind, torch.tanh
    if kind == "affine":
        return kind, lambda u: u * 1.5 - 0.25
    if kind == "layer_norm":
        return kind, lambda u: F.layer_norm(u, (x_width,))
    w = seeded(seed, (x_width, x_width), dtype)
    return kind, lambda u: F.linear(u, w)


def shape_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the reshape and packed-rows steps that apply to ``x``."""
    d_n = x.sample_dim
    ragged = x.ragged_dims
    env = [int(e) for e in x.shape[1:]]
    out: dict[str, list[Callable[[], Step]]] = {"reshape": [], "rows": []}
    if not ragged:
        return {}

    def regroup() -> Step:
        perm = list(range(d_n))
        for i in range(d_n - 1, 0, -1):
            j = c.integer(0, i)
            perm[i], perm[j] = perm[j], perm[i]
        groups: list[list[int]] = []
        for j in perm:
            if groups and c.integer(0, 2) == 0:
                groups[-1].append(j)
            else:
                groups.append([j])
        minus = c.integer(0, len(groups) - 1) if c.integer(0, 2) == 0 else None
        halve = None  # one ragged entry e read as (e // 2, 2): odd samples cannot (both sides refuse)
        if c.integer(0, 5) == 0:
            halve = c.choice([k for k, g in enumerate(groups) if any(j in ragged for j in g) and k != minus] or [None])
        op = c.choice(["reshape", "reshape", "view"])
        by_size = c.choice([False, True])
        labels = []
        for k, g in enumerate(groups):
            s = "-1" if k == minus else "*".join(f"s{j}" for j in g)
            labels.append(f"{s}//2, 2" if k == halve else s)
        has_extent = any(k != minus and any(j in ragged for j in g) for k, g in enumerate(groups))
        tags = {RESHAPE_EXTENTS if has_extent else RESHAPE_PLAIN}
        if op == "view":
            tags.add(VIEW_REINTERPRET)

        def fn(t, o):
            ents = [_entry(t, o, j, by_size) for j in range(d_n)]
            target: list[Any] = []
            for k, g in enumerate(groups):
                if k == minus:
                    target.append(-1)
                elif k == halve:
                    target += [_prod([ents[j] for j in g]) // 2, 2]
                else:
                    target.append(_prod([ents[j] for j in g]))
            src = t.contiguous() if op == "view" else t
            return getattr(src, op)(*o.batch(t), *target)

        return Step(f"{op}(B, {', '.join(labels)})", fn, family="reshape", tags=frozenset(tags))

    out["reshape"].append(regroup)

    pairs = [p for p in ragged if p + 1 in ragged]
    if pairs:
        p = pairs[0] if len(pairs) == 1 else None

        def tokens() -> Step:
            q = p if p is not None else c.choice(pairs)
            # (.., C, h, w) -> tokens (.., C, h*w); a ViT or Segformer then works on them
            # transposed, (.., h*w, C), and transposes back; MAnet reads the transposed tokens
            # straight back by reshape (each sample's memory in the new shape)
            can_move = q >= 1 and (q - 1) not in ragged and q + 1 == d_n - 1
            move = can_move and c.choice([False, True])
            if move:
                width = env[q - 1]
            elif (d_n - 1) not in ragged and d_n - 1 > q + 1:
                width = env[-1]
            else:
                width = None
            name, inner = _inner(c, width, seed, x.dtype)
            transpose_back = not move or c.choice([True, True, False])
            back = c.choice(["reshape", "view", "unflatten"]) if transpose_back else "reshape"
            by_size = c.choice([False, True])
            tags = {RESHAPE_EXTENTS} | ({VIEW_REINTERPRET} if back == "view" else set())
            order = list(x.storage_order)
            if q in ragged and q + 1 in ragged and order.index(q + 1) != order.index(q) + 1:
                tags.add(FLATTEN_TRANSPOSED)  # two ragged dims not adjacent in storage order (transposed)

            def fn(t, o):
                h, w = _entry(t, o, q, by_size), _entry(t, o, q + 1, by_size)
                sh = t.shape
                y = t.flatten(o + q, o + q + 1)
                if move:
                    y = inner(y.transpose(o + q - 1, o + q))
                    if transpose_back:
                        y = y.transpose(o + q - 1, o + q)
                else:
                    y = inner(y)
                if back == "unflatten":
                    return y.unflatten(o + q, (h, w))
                return getattr(y, back)(*sh[: o + q], h, w, *sh[o + q + 2:])

            label = f"tokens(dims {q},{q + 1}{', transposed' if move else ''}, {name}, "
            label += f"{back} back)" if transpose_back else "reshape as (C, h, w))"
            return Step(label, fn, family="reshape", tags=frozenset(tags))

        out["reshape"].append(tokens)

    if (d_n - 1) not in ragged and env[-1] % 2 == 0 and env[-1] >= 2:
        width = env[-1]
        w1, w2 = seeded(seed, (2 * width, width), x.dtype), seeded(seed + 1, (width, 2 * width), x.dtype)

        def heads() -> Step:
            # what every transformers layer does: split heads off the features (sizes read from
            # the shape), move them first, work per head, move back, merge, add the residual, then
            # a feed-forward out and back to the width (the structures come back: one per layer)
            by_size = c.choice([False, True])

            def fn(t, o):
                lead = [_entry(t, o, j, by_size) for j in range(d_n - 1)]
                q = t.reshape(*o.batch(t), *lead, 2, width // 2).movedim(-2, o)
                y = F.softmax(q, dim=-1).movedim(o, -2)
                h = t + y.reshape(*o.batch(t), *lead, width)
                return h + F.linear(F.gelu(F.linear(h, w1)), w2)

            return Step("heads(split, move first, softmax, move back, merge, residual, feed-forward)", fn,
                        family="reshape", tags=frozenset({RESHAPE_EXTENTS}))

        out["reshape"].append(heads)

    k = len(ragged)
    if ragged == tuple(range(k)) and k < d_n:
        width = 1
        for e in env[k:]:
            width *= e

        def rows() -> Step:
            op = c.choice(["reshape", "view"])
            n = c.choice([width, c.integer(1, 3)]) if d_n - k == 1 else width
            kind = c.choice(["linear", "gelu", "layer_norm"]) if n == width else "linear"
            g = seeded(seed, (n, width), x.dtype)
            f = {
                "linear": lambda r: F.linear(r, g),
                "gelu": F.gelu,
                "layer_norm": lambda r: F.layer_norm(r, (width,)),
            }[kind]
            back = c.choice(["shape", "size+n"]) if d_n - k == 1 else "shape"

            def fn(t, o):
                rws = getattr(t, op)(-1, width)
                rws = f(rws)
                if back == "shape":
                    return getattr(rws, op)(t.shape)
                return rws.view(t.size()[:-1] + (n,))

            tags = set()
            if op == "view" and tuple(x._ragged) != tuple(sorted(x._ragged)):
                tags.add(FLATTEN_TRANSPOSED)  # rows of ragged dims stored transposed: view refuses
            return Step(f"rows({op}(-1, {width}), {kind}, back by {back})", fn, family="rows", tags=frozenset(tags))

        out["rows"].append(rows)
    return {f: b for f, b in out.items() if b}
