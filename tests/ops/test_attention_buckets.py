"""Length buckets on the CPU: many short samples as a few padded-within-bucket SDPA calls.

Each sample must still equal its own dense SDPA (values and gradients) with and without
causal masking, grouped heads, a scale and empty samples; the cut follows the cost model.
"""

import pytest
import torch
import torch.nn.functional as F

from padless.ops.attention import buckets
from padless.ops.attention import sdpa as attn
from padless.testing import check_samples, leaves


def _lengths(b: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (b,), generator=g).tolist()


def _sdpa_calls(t: torch.Tensor) -> int:
    seen, stack, n = set(), [t.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        n += type(fn).__name__.startswith("ScaledDotProduct")
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return n



@pytest.mark.parametrize("causal", [False, True])
def test_buckets_equal_dense_sdpa_per_sample(causal, one_thread):
    lens = _lengths(64, 1, 40, seed=1)
    lens[3], lens[10] = 0, 0
    q, k, v = (leaves([(4, n, 32) for n in lens], s) for s in (1, 2, 3))
    plan = buckets.plan(lens, [0] + torch.tensor(lens).cumsum(0).tolist(), 128, causal, torch.device("cpu"))
    assert plan is not None and len(plan.calls) < len(set(lens))

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

    out = check_samples(f, f, [q, k, v])
    assert _sdpa_calls(out) == len(plan.calls)


def test_buckets_with_grouped_heads_and_scale(one_thread):
    lens = _lengths(64, 1, 40, seed=2)
    q, k, v = leaves([(4, n, 32) for n in lens], 1), leaves([(2, n, 32) for n in lens], 2), leaves([(2, n, 32) for n in lens], 3)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, scale=0.3, enable_gqa=True)

    check_samples(f, f, [q, k, v])


def test_switch_off_gives_one_call_per_length(monkeypatch, one_thread):
    lens = _lengths(64, 1, 40, seed=1)
    (q, _) = leaves([(4, n, 32) for n in lens], 1)
    monkeypatch.setattr(attn, "BUCKETS", False)
    assert _sdpa_calls(F.scaled_dot_product_attention(q, q, q)) == len(set(lens))


def test_cut_keeps_long_samples_alone_and_groups_short_ones():
    long = [250, 200, 150, 100]
    assert buckets.cut(long, 128) == [[0], [1], [2], [3]]
    short = [4, 5, 6, 5, 4, 0]
    cuts = buckets.cut(short, 128)
    assert cuts == [[2, 1, 3, 0, 4]]  # longest first; the empty sample has no rows
    # long samples of distinct lengths: one call each costs less than the copies
    assert not buckets.worth(long, buckets.cut(long, 128), 128)
    many = _lengths(64, 4, 64, seed=0)
    assert buckets.worth(many, buckets.cut(many, 128), 128)
