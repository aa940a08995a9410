"""Drawing a case: a layout, a dtype, a mode, and a chain of steps, each drawn against the
structure the steps before it produced."""

from __future__ import annotations

from typing import Callable, Collection

import torch

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.basic import basic_steps
from padless.testing.fuzz.layouts import layout_steps
from padless.testing.fuzz.core import DTYPES, Case, Chooser, Side, Step, draw_layout, inputs
from padless.testing.fuzz.padded import padded_steps
from padless.testing.fuzz.shapes import shape_steps
from padless.testing.fuzz.static import static_steps
from padless.testing.fuzz.vision import vision_steps
from padless.testing.fuzz.writes import write_steps

#: Every step family, in the order the sweep prints them.
FAMILIES = ("basic", "reshape", "rows", "window", "window_write", "inplace", "stack", "static", "padded", "interpolate", "batch_dense", "layout")

_MODE_DRAW = ("grad", "grad", "grad", "no_grad", "inference")


def applicable(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of every step that applies to ``x``, by family."""
    out = {"basic": basic_steps(x, c, seed)}
    for more in (shape_steps, static_steps, write_steps, padded_steps, vision_steps, layout_steps):
        for fam, builders in more(x, c, seed).items():
            out.setdefault(fam, []).extend(builders)
    return out


def draw_case(
    c: Chooser,
    *,
    max_steps: int = 4,
    families: Collection[str] | None = None,
    layout: str | None = None,
    modes: Collection[str] | None = None,
) -> Case:
    """A layout (:data:`padless.testing.fuzz.core.LAYOUTS`), a dtype, a mode and a chain of 1 to
    ``max_steps`` steps (chains end early when the result is dense or a step raises).

    ``families`` restricts the steps to those families where one applies (targeted draws);
    ``layout`` and ``modes`` fix the layout and restrict the modes."""
    shapes, ragged = draw_layout(c, layout)
    dtype = c.choice(DTYPES)
    seed = c.integer(0, 2**16)
    mode = c.choice([m for m in _MODE_DRAW if modes is None or m in modes])
    steps: list[Step] = []
    nested: list[bool] = []
    x, _ = inputs(shapes, ragged, dtype, seed, grad=False)
    with torch.no_grad():
        for _ in range(c.integer(1, max_steps)):
            if not isinstance(x, NestedTensor):
                break
            options = applicable(x, c, seed + len(steps))
            if families is not None:
                options = {f: b for f, b in options.items() if f in families} or options
            weighted = [f for f in sorted(options) for _ in range(3 if f == "basic" else 1)]
            step = c.choice(options[c.choice(weighted)])()
            steps.append(step)
            try:
                x = step.fn(x, Side(True))
            except Exception:  # noqa: BLE001 - the run judges it; the chain ends here
                break
            nested.append(isinstance(x, NestedTensor))
    wrt = None
    if mode == "grad" and len(steps) >= 2 and c.integer(0, 3) == 0:
        candidates = [k for k in range(min(len(steps) - 1, len(nested))) if nested[k]]
        if candidates:
            wrt = c.choice(candidates)
    return Case(shapes, ragged, dtype, seed, steps, mode, wrt)
