"""Random chains on deferred attention scores (padless.ops.pairs.pending) against the dense
computation on each sample alone: scores by ``einsum`` or ``matmul``, then 0-4 of scale,
divide, ``+ bias`` (out of place or in place), a constant shift, a zero-weighted term, negation,
``tanh``, a product with itself, an in-place scale; then the rows themselves, their softmax,
or ``softmax @ v`` (once or with the weights reused). Values and the gradients of q, k, v and
the bias, float64, on batches with empty samples, single samples and equal sizes.

``PADLESS_FUZZ_EXAMPLES`` (default 30 here) sets the number of chains, as for tests/fuzz;
``PADLESS_FUZZ_RANDOM=1`` draws new ones every run."""

from __future__ import annotations

import os
import random

import pytest
import torch

import padless

EXAMPLES = max(1, int(os.environ.get("PADLESS_FUZZ_EXAMPLES", "30")))
SEED = random.randrange(1 << 30) if os.environ.get("PADLESS_FUZZ_RANDOM") else 0
STEPS = ("scale", "div", "bias", "bias_iadd", "const", "zero_term", "neg", "tanh", "square", "iscale")
ENDS = ("rows", "softmax", "softmax_v", "softmax_v_twice")
F64 = torch.float64


def _chain(r: random.Random):
    ns = [r.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(r.choice([1, 2, 5, 9]))]
    if not any(ns):
        ns[0] = 3
    steps = [r.choice(STEPS) for _ in range(r.randint(0, 4))]
    if "tanh" in steps:  # in place after tanh would fail in dense PyTorch too (its backward reads its output)
        steps = [s for s in steps if s not in ("bias_iadd", "iscale")]
    return ns, r.choice([1, 2]), r.choice([1, 3]), steps, r.choice(ENDS), r.choice(["einsum", "matmul"])


def _run(q, k, v, z, steps, end, form, dense):
    if dense:
        s = torch.einsum("ihd,jhd->hij", q, k) if form == "einsum" else q.transpose(0, 1) @ k.permute(1, 2, 0)
        bias, eq = z.permute(2, 0, 1), "hij,jhd->ihd"
    else:
        s = torch.einsum("bihd,bjhd->bhij", q, k) if form == "einsum" else q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
        bias, eq = z.permute(0, 3, 1, 2), "bhij,bjhd->bihd"
    for st in steps:
        if st == "scale":
            s = s * 0.7
        elif st == "div":
            s = s / 1.3
        elif st == "bias":
            s = s + bias
        elif st == "bias_iadd":
            s += bias
        elif st == "const":
            s = s - 0.5
        elif st == "zero_term":
            s = s + 0.0 * bias
        elif st == "neg":
            s = -s
        elif st == "tanh":
            s = s.tanh()
        elif st == "square":
            s = s * s
        elif st == "iscale":
            s *= 2.0
    if end == "rows":
        return s
    p = s.softmax(-1)
    if end == "softmax":
        return p
    o = torch.einsum(eq, p, v)
    return o + torch.einsum(eq, p * 2, v) if end == "softmax_v_twice" else o


@pytest.mark.parametrize("case", range(EXAMPLES))
def test_random_chain_matches_dense_samples(case):
    r = random.Random(SEED * 100003 + case)
    ns, h, d, steps, end, form = _chain(r)
    g = torch.Generator().manual_seed(SEED + case)
    dense = [[torch.randn(n, h, d, generator=g, dtype=F64, requires_grad=True) for n in ns] for _ in range(3)]
    dense.append([torch.randn(n, n, h, generator=g, dtype=F64, requires_grad=True) for n in ns])
    nts = [padless.from_list([t.detach() for t in ts], ragged_dims=(0,) if i < 3 else (0, 1), requires_grad=True)
           for i, ts in enumerate(dense)]
    what = f"samples {ns}, H={h}, D={d}, {form}, steps {steps}, then {end}"
    out = _run(*nts, steps, end, form, dense=False)
    refs = [_run(*xs, steps, end, form, dense=True) for xs in zip(*dense)]
    for i, (got, want) in enumerate(zip(out.unbind(), refs)):
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: sample {i}: {m}")
    out.values().square().sum().backward()
    sum(w.square().sum() for w in refs).backward()
    for name, nt, ds in zip("qkvz", nts, dense):
        grads = nt.grad.unbind() if nt.grad is not None else [None] * len(ds)
        for i, (got, t) in enumerate(zip(grads, ds)):
            want = t.grad if t.grad is not None else torch.zeros_like(t)
            got = got if got is not None else torch.zeros_like(t)
            torch.testing.assert_close(got, want, msg=lambda m: f"{what}: grad of {name}, sample {i}: {m}")
