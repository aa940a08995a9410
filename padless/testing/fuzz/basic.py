"""The basic steps: pointwise and feature ops, softmax, reductions, cumsum, transposes and
permutations, pair states, (un)squeeze (the fuzzer's first families)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step, extents


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


def basic_steps(x: NestedTensor, c: Chooser, seed: int) -> list[Callable[[], Step]]:
    """Builders of the basic steps that apply to ``x`` (each draws its own parameters when called):
    pointwise, softmax, reductions, cumsum, feature ops, transposes, pair states, squeezes."""
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
        ops = ["sum", "mean"] + (["amax", "logsumexp"] if min(extents(x, d), default=1) > 0 else [])
        op = c.choice(ops)
        keep = c.choice([False, True])
        return Step(f"{op}(dim={d}, keepdim={keep})", lambda t, o: getattr(t, op)(dim=o + d, keepdim=keep))

    if ragged:  # a batch may have none left (a window that keeps one position of its only ragged dim)
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
        # std is left out: at a variance of 0 (a pair state's softmax over dim 0 has equal
        # columns) its gradient divides rounding noise by ~0 on both sides, and they differ
        op = "var"
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

    nonempty = [d for d in ragged if min(extents(x, d), default=1) > 0]
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
