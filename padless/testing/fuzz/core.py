"""What a fuzz case is made of: where its randomness comes from, its steps, the side a step
runs on, and the batch it starts from."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from padless.tensor.construct import from_list
from padless.tensor.core import NestedTensor

DTYPES = (torch.float32, torch.float64, torch.bfloat16)

#: (rtol, atol) per dtype. ``atol`` is scaled by the largest magnitude the reference met along
#: the chain (cancellation after a large intermediate, e.g. ``x - x.mean()`` after a cumsum,
#: leaves an error of a few ulps of that intermediate): bf16 keeps 8 bits of mantissa and
#: segmented sums accumulate in another order than a dense sum.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (5e-2, 5e-2),
}

#: How a whole chain runs: recording autograd (values, then the gradients of the inputs, of
#: the dense operands that need one and, with ``Case.wrt``, of one intermediate), under
#: ``torch.no_grad()``, or under ``torch.inference_mode()`` (values only).
MODES = ("grad", "no_grad", "inference")


class Chooser(Protocol):
    """Where a fuzz case gets its randomness from."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]`` (inclusive)."""
        ...

    def choice(self, options: Sequence):
        """One element of ``options``."""
        ...


class RandomChooser:
    """A :class:`Chooser` over :class:`random.Random` (no hypothesis needed)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence):
        return options[self.rng.randrange(len(options))]


class Side(int):
    """The side a step runs on, as the int offset of the first sample dim: ``1`` on the
    NestedTensor (dim 0 is the batch), ``0`` on one dense sample (``i`` says which).

    A step is written once for both sides: ``t.sum(dim=o + d)``, ``t[o.ix(p, slice(0, 2))]``,
    ``t.reshape(*o.batch(t), *target)``. Dense operands a step reads (a position table, a
    mask) are :meth:`param`\\ s, created fresh for every run, so an in-place write to one
    in one run never leaks into the next; :meth:`at` reads such an operand, laid out in
    padded coordinates ``(B or 1, *envelope)``, at this side's coordinates."""

    i: int | None
    params: dict[str, Tensor]

    def __new__(cls, nested: bool, i: int | None = None) -> "Side":
        s = int.__new__(cls, 1 if nested else 0)
        s.i = i
        s.params = {}
        return s

    @property
    def nested(self) -> bool:
        return bool(self)

    def ix(self, p: int, e: Any) -> tuple:
        """An index tuple that applies ``e`` to sample dim ``p`` (``x[:, e]`` for ``p = 0``)."""
        return (slice(None),) * (int(self) + p) + (e,)

    def batch(self, t: Tensor) -> tuple:
        """``(B,)`` on the NestedTensor (``t.shape[:1]``), ``()`` on a sample: the lead of a
        reshape target."""
        return tuple(t.shape[:1]) if self else ()

    def apply(self, f: Callable[[Tensor], Any], t: Tensor) -> Any:
        """``f`` written for a batch (``(B, C, H, W)`` images): on the NestedTensor as it is,
        on a sample as ``f(t[None])[0]``."""
        return f(t) if self else f(t.unsqueeze(0))[0]

    def param(self, key: str, make: Callable[[], Tensor]) -> Tensor:
        """This run's copy of a dense operand (``make()`` the first time ``key`` is asked)."""
        if key not in self.params:
            with torch.inference_mode(False):
                self.params[key] = make()
        return self.params[key]

    def at(self, d: Tensor, shape: Sequence[int]) -> Tensor:
        """Dense ``d`` laid out as ``(B or 1, *envelope of shape)`` (missing leading dims count
        as 1): on the NestedTensor ``d`` itself (padless reads it in padded coordinates); on
        sample ``i`` its entry ``i`` (or 0 where shared), windowed to ``shape`` (this sample's
        own extents) along every dim where ``d`` is not 1."""
        if self:
            return d
        n = len(shape)
        full = d.reshape((1,) * (1 + n - d.dim()) + tuple(d.shape))
        t = full[self.i if full.shape[0] != 1 else 0]
        return t[tuple(slice(0, shape[j]) if t.shape[j] != 1 else slice(None) for j in range(n))]


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of a chain: ``fn(x, o)`` runs it on a NestedTensor (``o`` is ``1``) or a sample
    (``o`` is ``0``); ``o`` is a :class:`Side` when the chain runs.

    ``pointwise``: the op maps each element alone (``gelu``, ``tanh``), so padless runs torch's
    dense op on its packed values, and the reference can be taken on those same values when
    torch's own kernel answers differently for one element depending on where it sits
    (see :func:`padless.testing.fuzz.run.torch_disagrees`). ``family`` groups steps in the
    sweep's counts; ``tags`` name the mechanisms a step relies on, which the known-bug list
    (:mod:`padless.testing.fuzz.known`) refers to.
    """

    name: str
    fn: Callable[[Tensor, int], Any]
    pointwise: bool = False
    family: str = "basic"
    tags: frozenset = frozenset()

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass
class Case:
    """A batch layout, an op chain and how it runs (``mode`` of :data:`MODES`; ``wrt``: the
    index of the step whose output's gradient is compared too, or None)."""

    shapes: list[tuple[int, ...]]
    ragged: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    steps: list[Step]
    mode: str = "grad"
    wrt: int | None = None

    def __repr__(self) -> str:
        extra = "" if self.mode == "grad" else f", mode={self.mode!r}"
        extra += "" if self.wrt is None else f", wrt={self.wrt}"
        return (
            f"Case(shapes={self.shapes}, ragged={self.ragged}, dtype={self.dtype}, seed={self.seed}, "
            f"steps={self.steps}{extra})"
        )


def extents(x: NestedTensor, d: int) -> list[int]:
    """Every sample's extent along sample dim ``d`` (host ints)."""
    return x.host_sizes()[:, d].tolist()


# ---------------------------------------------------------------------------- structures

#: Named layouts of padded code, drawn as often as a fully random structure: token sequences
#: ``(L_i, C)``, heads ``(H, L_i, D)``, images ``(C, H_i, W_i)``, square pair states
#: ``(N_i, N_i, C)``.
LAYOUTS = ("random", "random", "tokens", "heads", "images", "images", "pairs")


def draw_structure(c: Chooser, *, max_len: int = 4, max_batch: int = 4) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Sample shapes and ragged dims: rank 1-3, 1-3 ragged dims, ragged extents in
    ``[0, max_len]`` (empty samples), static extents in ``[1, 3]``, 1 to ``max_batch`` samples."""
    ndim = c.integer(1, 3)
    n_ragged = c.integer(1, ndim)
    dims = list(range(ndim))
    ragged = []
    for _ in range(n_ragged):
        d = c.choice(dims)
        dims.remove(d)
        ragged.append(d)
    ragged_t = tuple(sorted(ragged))
    static = {d: c.integer(1, 3) for d in range(ndim) if d not in ragged_t}
    b = c.integer(1, max_batch)
    # Keep pair states small: rows grow with the product of ragged extents.
    cap = max_len if n_ragged == 1 else max(2, max_len - n_ragged + 1)
    shapes = [tuple(c.integer(0, cap) if d in ragged_t else static[d] for d in range(ndim)) for _ in range(b)]
    return shapes, ragged_t


def draw_layout(c: Chooser, layout: str | None = None) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Shapes and ragged dims of one of :data:`LAYOUTS` (drawn when ``layout`` is None)."""
    layout = layout or c.choice(LAYOUTS)
    if layout == "random":
        return draw_structure(c)
    b = c.integer(1, 4)
    if layout == "tokens":
        ch = c.integer(1, 4)
        return [(c.integer(0, 5), ch) for _ in range(b)], (0,)
    if layout == "heads":
        h, d = c.integer(1, 2), c.integer(1, 3)
        return [(h, c.integer(0, 5), d) for _ in range(b)], (1,)
    if layout == "images":
        ch = c.integer(1, 3)

        def side() -> int:  # now and then an image with no pixel
            return 0 if c.integer(0, 11) == 0 else c.integer(1, 5)

        return [(ch, side(), side()) for _ in range(b)], (1, 2)
    if layout == "pairs":
        ch = c.integer(1, 2)
        return [(n, n, ch) for n in (c.integer(0, 4) for _ in range(b))], (0, 1)
    raise ValueError(f"unknown layout {layout!r}")


def inputs(shapes, ragged, dtype, seed, grad: bool) -> tuple[NestedTensor, list[Tensor]]:
    """The case's batch as a NestedTensor leaf and as dense leaves, equal values."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    nt = from_list([d.clone() for d in dense], ragged_dims=ragged, requires_grad=grad)
    return nt, [d.requires_grad_(grad) for d in dense]


def seeded(seed: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Random values for a step's operand, fixed by ``seed`` (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
