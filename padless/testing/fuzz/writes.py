"""Steps on windows, positions and writes: ``x[:, a:b]`` and ``x[:, -1]`` of ragged dims
(clamped per sample as Python clamps), in-place ops on them and on the whole batch (on a
clone), and stacked batches (``torch.stack([a, b])``, then a reduction or an index, with a
later in-place write to an input)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step

# tags (see padless.testing.fuzz.known)
WINDOW_INPLACE = "window_inplace"
WINDOW_SETITEM = "window_setitem"
WINDOW_EXTENT_BOUND = "window_extent_bound"
STACK_WRITE = "stack_write"

BOUNDS = (None, None, -3, -2, -1, 0, 1, 2, 3, 4)


def write_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the window, position, in-place and stack steps that apply to ``x``."""
    ragged = x.ragged_dims
    d_n = x.sample_dim
    out: dict[str, list[Callable[[], Step]]] = {"window": [], "window_write": [], "inplace": [], "stack": []}
    if not ragged:
        return {}

    def draw_window() -> tuple[int, slice]:
        return c.choice(list(ragged)), slice(c.choice(BOUNDS), c.choice(BOUNDS))

    def window() -> Step:
        p, e = draw_window()
        return Step(f"window(dim {p}, {e.start}:{e.stop})", lambda t, o: t[o.ix(p, e)], family="window")

    def extent_bound() -> Step:
        p = c.choice(list(ragged))
        kind = c.choice([":L-1", "L//2:", "1:L"])

        def fn(t, o):
            n = t.shape[o + p]
            e = {":L-1": slice(None, n - 1), "L//2:": slice(n // 2, None), "1:L": slice(1, n)}[kind]
            return t[o.ix(p, e)]

        return Step(f"window(dim {p}, {kind} from the shape)", fn, family="window", tags=frozenset({WINDOW_EXTENT_BOUND}))

    out["window"] += [window, extent_bound]

    if len(ragged) == 1:
        p0 = ragged[0]

        def position() -> Step:
            k = c.integer(-2, 2)
            return Step(f"position(dim {p0}, {k})", lambda t, o: t[o.ix(p0, k)], family="window")

        out["window"].append(position)

    def window_write() -> Step:
        p, e = draw_window()
        kind = c.choice(["zero_", "mul_", "add_", "setitem", "setitem_tensor", "iadd"])
        if len(ragged) == 1 and c.integer(0, 2) == 0:
            e = c.integer(-2, 1)  # a position: x[:, -1] = v
        tags = {WINDOW_SETITEM} if kind.startswith("setitem") or kind == "iadd" else {WINDOW_INPLACE}

        def fn(t, o):
            y = t.clone()
            idx = o.ix(p, e)
            if kind == "zero_":
                y[idx].zero_()
            elif kind == "mul_":
                y[idx].mul_(2.0)
            elif kind == "add_":
                y[idx].add_(1.0)
            elif kind == "setitem":
                y[idx] = 0.5
            elif kind == "setitem_tensor":
                y[idx] = torch.full((), 0.75, dtype=t.dtype)
            else:
                y[idx] += 1.0
            return y

        label = f"{e.start}:{e.stop}" if isinstance(e, slice) else str(e)
        return Step(f"write(dim {p}, [{label}], {kind})", fn, family="window_write", tags=frozenset(tags))

    out["window_write"].append(window_write)

    def inplace() -> Step:
        kind = c.choice(["add_", "mul_x", "mul_add_x", "iadd_2x", "clamp_", "masked_fill_", "sub_mean"])

        def fn(t, o):
            y = t.clone()
            if kind == "add_":
                y.add_(1.5)
            elif kind == "mul_x":
                y.mul_(t)
            elif kind == "mul_add_x":
                y.mul_(0.5).add_(t)
            elif kind == "iadd_2x":
                y += t * 2
            elif kind == "clamp_":
                y.clamp_(-1.0, 1.0)
            elif kind == "masked_fill_":
                y.masked_fill_(t > 0.5, 0.0)
            else:
                y.sub_(t.tanh())
            return y

        return Step(f"inplace({kind})", fn, family="inplace")

    out["inplace"].append(inplace)

    def stack() -> Step:
        second = c.choice(["2x", "tanh", "clone"])
        n = c.choice([2, 3])
        red = c.choice(["sum(0)", "mean(0)", "amax(0)", "[k]", "(s*2).sum(0)", "s.sum(0) - s[0]", "dim=-1"])
        k = c.integer(0, n - 1)
        write = c.choice([None, None, "a.add_", "a.mul_", "b.zero_"])
        if write == "b.zero_" and second == "tanh":
            second = "2x"  # tanh saves its output for its backward: a write to it fails both sides

        def fn(t, o):
            a = t.clone() if write else t
            b = {"2x": lambda: t * 2.0, "tanh": lambda: torch.tanh(t), "clone": t.clone}[second]()
            members = [a, b, t][:n]
            if red == "dim=-1":
                s = torch.stack(members, dim=-1)  # inside every sample
            else:
                s = torch.stack(members)
            if write == "a.add_":
                a.add_(1.0)
            elif write == "a.mul_":
                a.mul_(0.0)
            elif write == "b.zero_":
                b.zero_()
            return _reduce(s, red, k)

        tags = {STACK_WRITE} if write else set()
        return Step(f"stack({n}, {second}{', then ' + write if write else ''}).{red}", fn, family="stack",
                    tags=frozenset(tags))

    if d_n <= 3:
        out["stack"].append(stack)
    return {f: b for f, b in out.items() if b}


def _reduce(s: Any, red: str, k: int) -> Any:
    if red == "sum(0)":
        return s.sum(0)
    if red == "mean(0)":
        return s.mean(0)
    if red == "amax(0)":
        return s.amax(0)
    if red == "[k]":
        return s[k]
    if red == "(s*2).sum(0)":
        return (s * 2.0).sum(0)
    if red == "s.sum(0) - s[0]":
        return s.sum(0) - s[0]
    return s  # dim=-1: the stack is the result

