"""Steps along static dims: indexing (slices with steps and negative bounds, ints, ``None``,
``...``), ``select``, ``narrow``, ``cat`` and ``stack`` of pieces of one structure (a rotary
embedding's ``rotate_half``, a roll), each remembered per structure by
:mod:`padless.ops.rows.static_dims` after its first call, so every step runs twice."""

from __future__ import annotations

from typing import Any, Callable

import torch

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step


def _bound(c: Chooser, n: int) -> Any:
    return c.choice([None, c.integer(-n - 1, n + 1)])


def static_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the static-dim steps that apply to ``x``."""
    d_n = x.sample_dim
    static = [d for d in range(d_n) if d not in x.ragged_dims]
    env = [int(e) for e in x.shape[1:]]
    if not static:
        return {}
    out: list[Callable[[], Step]] = []

    def twice(f: Callable) -> Callable:  # the second call takes the remembered form
        return lambda t, o: f(t, o) + f(t, o)

    def index() -> Step:
        p = c.choice(static)
        n = env[p]
        kind = c.choice(["slice", "int", "none"] if n else ["slice", "none"])
        if kind == "slice":
            e: Any = slice(_bound(c, n), _bound(c, n), c.choice([None, 1, 2, 3]))
        elif kind == "int":
            e = c.integer(-n, n - 1)
        else:
            e = None
        last = p == d_n - 1 and kind != "none" and c.choice([False, True])

        def fn(t, o):
            return t[..., e] if last else t[o.ix(p, e)]

        return Step(f"static index(dim {p}, {'...' if last else ''}{e!r})", twice(fn), family="static")

    def select() -> Step:
        p = c.choice([d for d in static if env[d]])
        k = c.integer(-env[p], env[p] - 1)
        op = c.choice(["select", "narrow"])
        neg = c.choice([False, True])

        def fn(t, o):
            d = p - d_n if neg else o + p
            return t.select(d, k) if op == "select" else t.narrow(d, k, env[p] - k if k >= 0 else -k)

        return Step(f"static {op}(dim {p - d_n if neg else p}, {k})", twice(fn), family="static")

    def join() -> Step:
        p = c.choice(static)
        n = env[p]
        k = c.integer(0, n)
        op = c.choice(["rotate", "roll", "stack"])
        neg = c.choice([False, True])

        def fn(t, o):
            lo, hi = t[o.ix(p, slice(None, k))], t[o.ix(p, slice(k, None))]
            if op == "stack":  # a negative dim puts the new dim after dim p, a positive one before it
                return torch.stack((t, t * 0.5), dim=p - d_n if neg else o + p)
            first = -hi if op == "rotate" else hi
            return torch.cat((first, lo), dim=p - d_n if neg else o + p)

        return Step(f"static {op}(dim {p}, at {k}{', negative dim' if neg else ''})", twice(fn), family="static")

    out += [index, join] + ([select] if any(env[d] for d in static) else [])
    return {"static": out}
