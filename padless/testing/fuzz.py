"""Building blocks of the differential fuzzer: random structures and random op chains.

A *case* is a batch (one to three ragged dims, empty samples and one-sample batches
included, float32/float64/bf16) and a chain of ops drawn one after the other, each
from the ops that apply to the current result. Every op is one callable
``fn(x, o)`` written once for both sides: ``o = 1`` on the NestedTensor (dim 0 is
the batch) and ``o = 0`` on one dense sample. :func:`run_case` runs the chain on the
NestedTensor and on every sample, then compares values, structure and the gradient
of every input sample under dtype-aware tolerances.

Torch's own CPU kernels can answer differently for one element depending on whether it
runs in their vectorised or their scalar loop (``gelu(+inf)`` is NaN in a packed buffer,
inf in a one-element tensor). When a pointwise step meets such an element, the chain is
judged up to that step, and that step against torch's dense op on the same packed values
(:func:`torch_disagrees`), so the fuzzer never reports torch's behaviour as padless's.

Choices come from a :class:`Chooser` (``integer``/``choice``), so the same builders
run under hypothesis (``tests/fuzz/test_differential.py``, which shrinks failures)
or from a plain :class:`random.Random` (:class:`RandomChooser`) for ad-hoc sweeps::

    >>> import random
    >>> case = draw_case(RandomChooser(random.Random(0)))
    >>> run_case(case)  # raises AssertionError naming the op chain on a mismatch
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.tensor.construct import from_list
from padless.tensor.core import NestedTensor
from padless.testing.reference import assert_close_samples

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


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of a chain: ``fn(x, o)`` runs it on a NestedTensor (``o=1``) or a sample (``o=0``).

    ``pointwise``: the op maps each element alone (``gelu``, ``tanh``), so padless runs torch's
    dense op on its packed values, and the reference can be taken on those same values when
    torch's own kernel answers differently for one element depending on where it sits
    (see :func:`torch_disagrees`).
    """

    name: str
    fn: Callable[[Tensor, int], Tensor]
    pointwise: bool = False

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass
class Case:
    """A batch layout and an op chain."""

    shapes: list[tuple[int, ...]]
    ragged: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    steps: list[Step]

    def __repr__(self) -> str:
        return (
            f"Case(shapes={self.shapes}, ragged={self.ragged}, dtype={self.dtype}, seed={self.seed}, "
            f"steps={self.steps})"
        )


# ---------------------------------------------------------------------------- structures


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


# ---------------------------------------------------------------------------- ops


def _extents(x: NestedTensor, d: int) -> list[int]:
    return x.host_sizes()[:, d].tolist()


def _unary_steps() -> list[Step]:
    return [
        Step("tanh", lambda x, o: torch.tanh(x), pointwise=True),
        Step("sin", lambda x, o: x.sin(), pointwise=True),
        Step("sigmoid", lambda x, o: torch.sigmoid(x), pointwise=True),
        Step("affine", lambda x, o: x * 1.5 - 0.25, pointwise=True),
        Step("square", lambda x, o: x * x, pointwise=True),
        Step("gelu", lambda x, o: F.gelu(x), pointwise=True),
        Step("softplus", lambda x, o: F.softplus(x), pointwise=True),
        Step("mul_tanh", lambda x, o: x * torch.tanh(x), pointwise=True),
        Step("leaky_where", lambda x, o: torch.where(x > 0, x, x * 0.1), pointwise=True),
        Step("clamp", lambda x, o: x.clamp(-1.0, 1.5), pointwise=True),
    ]


_UNARY = _unary_steps()


def applicable_steps(x: NestedTensor, c: Chooser, seed: int) -> list[Callable[[], Step]]:
    """Builders of the steps that apply to ``x`` (each draws its own parameters when called)."""
    ndim = x.sample_dim
    ragged = x.ragged_dims
    static = [d for d in range(ndim) if d not in ragged]
    env = list(x.shape[1:])
    out: list[Callable[[], Step]] = [lambda: c.choice(_UNARY)]  # one pick among many: chains stay varied

    def softmax() -> Step:
        d = c.choice(list(range(ndim)))
        log = c.choice([False, True])
        f = torch.log_softmax if log else torch.softmax
        return Step(f"{'log_' if log else ''}softmax(dim={d})", lambda t, o: f(t, dim=o + d))

    out.append(softmax)

    def reduce_static() -> Step:
        d = c.choice(static)
        op = c.choice(["sum", "mean", "amax"])
        keep = c.choice([False, True])
        return Step(f"{op}(dim={d}, keepdim={keep})", lambda t, o: getattr(t, op)(dim=o + d, keepdim=keep))

    if static and ndim > len(ragged):  # never reduce the last dim away entirely
        out.append(reduce_static)

    def reduce_ragged() -> Step:
        d = c.choice(list(ragged))
        ops = ["sum", "mean"] + (["amax", "logsumexp"] if min(_extents(x, d), default=1) > 0 else [])
        op = c.choice(ops)
        keep = c.choice([False, True])
        return Step(f"{op}(dim={d}, keepdim={keep})", lambda t, o: getattr(t, op)(dim=o + d, keepdim=keep))

    out.append(reduce_ragged)

    def cumsum() -> Step:
        d = c.choice(list(range(ndim)))
        return Step(f"cumsum(dim={d})", lambda t, o: t.cumsum(dim=o + d))

    out.append(cumsum)

    if static and env[-1] >= 1 and (ndim - 1) in static:
        cin = env[-1]

        def linear() -> Step:
            cout = c.integer(1, 3)
            g = torch.Generator().manual_seed(seed + cout)
            w = torch.randn(cout, cin, generator=g, dtype=torch.float64).to(x.dtype)
            bias = torch.randn(cout, generator=g, dtype=torch.float64).to(x.dtype)
            return Step(f"linear({cin}->{cout})", lambda t, o: F.linear(t, w, bias))

        def layer_norm() -> Step:
            return Step(f"layer_norm({cin})", lambda t, o: F.layer_norm(t, (cin,)))

        def normalize() -> Step:
            return Step(f"normalize(dim={ndim - 1})", lambda t, o: F.normalize(t, dim=o + ndim - 1))

        out += [linear, layer_norm, normalize]

    if ndim >= 2:

        def transpose() -> Step:
            a = c.choice(list(range(ndim)))
            b = c.choice([d for d in range(ndim) if d != a])
            return Step(f"transpose({a}, {b})", lambda t, o: t.transpose(o + a, o + b))

        def permute() -> Step:
            perm = list(range(ndim))
            for i in range(ndim - 1, 0, -1):  # Fisher-Yates from the chooser's draws
                j = c.integer(0, i)
                perm[i], perm[j] = perm[j], perm[i]
            return Step(f"permute{tuple(perm)}", lambda t, o: t.permute(*range(o), *(o + p for p in perm)))

        out += [transpose, permute]

    if ndim <= 3 and len(ragged) <= 2 and _rows(x) <= 64:

        def pair() -> Step:
            d = c.choice(list(ragged))
            return Step(f"pair(dim={d})", lambda t, o: t.unsqueeze(o + d + 1) + t.unsqueeze(o + d))

        out.append(pair)

    def center() -> Step:
        d = c.choice(list(ragged))
        return Step(f"center(dim={d})", lambda t, o: t - t.mean(dim=o + d, keepdim=True).nan_to_num())

    out.append(center)

    def var() -> Step:
        d = c.choice(list(range(ndim)))
        op = c.choice(["var", "std"])
        keep = c.choice([False, True])
        # correction 0: a one-element group has variance 0 on both sides (1 would give NaN)
        return Step(f"{op}(dim={d}, correction=0, keepdim={keep})",
                    lambda t, o: getattr(t, op)(dim=o + d, correction=0, keepdim=keep))

    if static:  # var of the only dim of a rank-1 sample would leave a dense batch: still fine
        out.append(var)

    if len(ragged) >= 2:

        def cross() -> Step:
            a = c.choice(list(ragged))
            b = c.choice([d for d in ragged if d != a])
            return Step(
                f"cross(sum dim {a} * sum dim {b})",
                lambda t, o: t.sum(dim=o + a, keepdim=True) * t.sum(dim=o + b, keepdim=True),
            )

        out.append(cross)

    nonempty = [d for d in ragged if min(_extents(x, d), default=1) > 0]
    if nonempty:

        def max_dim() -> Step:
            d = c.choice(nonempty)
            largest = c.choice([True, False])
            f = torch.max if largest else torch.min
            return Step(f"{'max' if largest else 'min'}(dim={d}).values", lambda t, o: f(t, dim=o + d).values)

        out.append(max_dim)

    if ndim <= 3:

        def unsqueeze() -> Step:
            d = c.integer(0, ndim)
            return Step(f"unsqueeze({d})", lambda t, o: t.unsqueeze(o + d))

        out.append(unsqueeze)

    ones = [d for d in static if env[d] == 1]
    if ones and ndim > 1:

        def squeeze() -> Step:
            d = c.choice(ones)
            return Step(f"squeeze({d})", lambda t, o: t.squeeze(o + d))

        out.append(squeeze)

    out.append(lambda: Step("contiguous", lambda t, o: t.contiguous()))
    return out


def _rows(x: NestedTensor) -> int:
    return max((int(n) for n in x.host_offsets().diff().tolist()), default=0)


# ---------------------------------------------------------------------------- cases


def draw_case(c: Chooser, *, max_steps: int = 4) -> Case:
    """A structure, a dtype and a chain of 1 to ``max_steps`` ops, each drawn against the
    structure the previous ops produced (chains end early when the result is dense)."""
    shapes, ragged = draw_structure(c)
    dtype = c.choice(DTYPES)
    seed = c.integer(0, 2**16)
    steps: list[Step] = []
    x, _ = _inputs(shapes, ragged, dtype, seed, grad=False)
    with torch.no_grad():
        for _ in range(c.integer(1, max_steps)):
            if not isinstance(x, NestedTensor):
                break
            options = applicable_steps(x, c, seed + len(steps))
            step = c.choice(options)()
            steps.append(step)
            x = step.fn(x, 1)
    return Case(shapes, ragged, dtype, seed, steps)


def _inputs(shapes, ragged, dtype, seed, grad: bool) -> tuple[NestedTensor, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    nt = from_list([d.clone() for d in dense], ragged_dims=ragged, requires_grad=grad)
    return nt, [d.requires_grad_(grad) for d in dense]


class TorchDisagrees(Exception):
    """Torch's dense kernel gives one element of a sample different non-finite results in its
    vectorised loop and in its scalar loop (``gelu(+inf)``: NaN packed, inf alone); ``step`` is
    the index of that pointwise step in the chain."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


_VECTOR_PAD = 128  # elements: a buffer of whole multiples of this runs entirely in torch's vectorised loop


def torch_disagrees(step: Step, x: Tensor, y: Tensor) -> bool:
    """True when the pointwise ``step`` maps some element of the dense sample ``x`` to a value
    (``y = step.fn(x, 0)``) whose NaN/inf pattern differs from what torch's vectorised loop
    gives the same element (the sample padded into a long buffer): the result depends on
    where the element sits, so a per-sample reference cannot judge padless's packed one."""
    with torch.no_grad():
        flat = x.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return False
        buf = torch.zeros(-(-n // _VECTOR_PAD) * _VECTOR_PAD, dtype=flat.dtype)
        buf[:n] = flat
        v = step.fn(buf, 0)[:n]
        w = y.detach().reshape(-1)
        return not (torch.equal(v.isnan(), w.isnan()) and torch.equal(v.isinf(), w.isinf()) and torch.equal(v[v.isinf()], w[w.isinf()]))


def run_chain(
    steps: Sequence[Step], x: Tensor, o: int, scale: list[float] | None = None, probe: bool = False
) -> Tensor:
    """Apply ``steps``; with ``scale``, append the largest finite magnitude of every intermediate.

    With ``probe`` (a dense sample, ``o=0``), raise :class:`TorchDisagrees` at the first
    pointwise step whose result torch itself makes depend on the element's position."""
    for k, s in enumerate(steps):
        y = s.fn(x, o)
        if probe and s.pointwise and torch_disagrees(s, x, y):
            raise TorchDisagrees(k)
        x = y
        if scale is not None and x.numel():
            v = x.detach().double().abs()
            v = v[torch.isfinite(v)]
            scale.append(float(v.max()) if v.numel() else 0.0)
    return x


def run_case(case: Case) -> None:
    """Run ``case`` on the NestedTensor and on every sample; compare values and gradients.

    Raises ``AssertionError`` naming the case on any difference.
    """
    rtol, atol = TOLERANCES[case.dtype]
    nt, dense = _inputs(case.shapes, case.ragged, case.dtype, case.seed, grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch's "degrees of freedom <= 0" on an empty sample
        _compare(case, nt, dense, rtol, atol)


def _first_disagreement(case: Case, dense: list[Tensor]) -> int | None:
    """The first step at which torch's kernel disagrees with itself on some sample (see
    :func:`torch_disagrees`), or None."""
    first = None
    with torch.no_grad():
        for s in dense:
            try:
                run_chain(case.steps, s.detach(), 0, probe=True)
            except TorchDisagrees as e:
                first = e.step if first is None else min(first, e.step)
    return first


def _compare_packed(case: Case, nt: NestedTensor, dense: list[Tensor], k: int, rtol: float, atol: float) -> None:
    """Forward only, for a chain whose step ``k`` is pointwise and position-dependent in torch:
    steps before it against the per-sample reference, step ``k`` against torch's dense op on
    the same packed values padless ran it on (the rest of the chain has no per-sample reference)."""
    with torch.no_grad():
        x = run_chain(case.steps[:k], nt, 1)
        seen: list[float] = [1.0]
        if k:
            refs = [run_chain(case.steps[:k], s.detach(), 0, seen) for s in dense]
            assert_close_samples(x, refs, rtol=rtol, atol=atol * max(seen))
        step = case.steps[k]
        y = step.fn(x, 1)
        packed = isinstance(x, NestedTensor) and isinstance(y, NestedTensor)
        got, want = (y.values(), step.fn(x.values(), 0)) if packed else (y, step.fn(x, 0))
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol * max(seen), equal_nan=True)
        except AssertionError as e:
            raise AssertionError(f"step {k} ({step.name}) differs from torch's dense op on the same packed values\n{e}") from None


def _compare(case: Case, nt: NestedTensor, dense: list[Tensor], rtol: float, atol: float) -> None:
    try:
        k = _first_disagreement(case, dense)
        if k is not None:
            _compare_packed(case, nt, dense, k, rtol, atol)
            return
        out = run_chain(case.steps, nt, 1)
        seen: list[float] = [1.0]
        refs = [run_chain(case.steps, s, 0, seen) for s in dense]
        assert_close_samples(out, refs, rtol=rtol, atol=atol * max(seen))
        g = torch.Generator().manual_seed(case.seed + 1)
        cot = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(r.dtype) for r in refs]
        if isinstance(out, NestedTensor):
            out.backward(from_list(cot, ragged_dims=out.ragged_dims, dtype=out.dtype))
        else:
            out.backward(torch.stack(cot))
        torch.autograd.backward(refs, cot)
        want = [s.grad if s.grad is not None else torch.zeros_like(s) for s in dense]
        for w in want:
            fin = w.detach().double().abs()
            fin = fin[torch.isfinite(fin)]
            seen.append(float(fin.max()) if fin.numel() else 0.0)
        if nt.grad is None:
            if any(bool(w.abs().sum() > 0) for w in want):
                raise AssertionError("gradient: the NestedTensor received no .grad but the reference did")
        else:
            assert_close_samples(nt.grad, want, what="gradient", rtol=rtol, atol=atol * max(seen))
    except AssertionError as e:
        raise AssertionError(f"{case!r}\n{e}") from None
    except Exception as e:
        raise AssertionError(f"{case!r}\nraised {type(e).__name__}: {e}") from e
