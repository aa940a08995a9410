"""The CPU attention hot path: large batches, equal-length groups, and an O(T) backward.

Samples of equal (query, key) lengths run as one batched SDPA call; every sample must
still equal its own dense SDPA (values and gradients), including empty samples, and the
backward must write each sample's gradient once (no per-sample slice of the buffer).
"""

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.attention import sdpa as attn
from padless.testing import assert_close_samples, check_samples, leaves


def _short_lengths(b: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (b,), generator=g).tolist()


def _graph_nodes(t: torch.Tensor) -> list[str]:
    """Names of every autograd node behind ``t``."""
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return names



def _sdpa(a, b, c):
    return F.scaled_dot_product_attention(a, b, c)


def test_256_short_samples_with_empty_ones_match_dense_per_sample(one_thread):
    lens = _short_lengths(256, 0, 12, seed=3)
    lens[:3] = [0, 0, 5]
    q = leaves([(2, n, 8) for n in lens], 1)
    out = check_samples(lambda a: _sdpa(a, a, a), lambda a: _sdpa(a, a, a), [q])
    assert out.ragged_dims == (1,) and out.batch_size == 256


def test_cross_attention_groups_by_query_and_key_length():
    lq = [3, 3, 0, 0, 5, 3, 1, 5, 2]
    lk = [4, 4, 2, 2, 0, 1, 1, 0, 4]  # groups (3,4), (0,2), (5,0); the rest alone
    q, k, v = leaves([(2, n, 8) for n in lq], 1), leaves([(2, n, 8) for n in lk], 2), leaves([(2, n, 6) for n in lk], 3)
    out = check_samples(_sdpa, _sdpa, [q, k, v])
    assert float(out[4].detach().abs().sum()) == 0.0  # queries without keys: zeros, as dense SDPA


@pytest.mark.parametrize("lk", [[4, 4, 4, 2, 2], [6, 6, 6, 1, 3]])
def test_causal_in_groups_is_top_left(lk):
    lq = [4, 4, 4, 2, 2]
    q, k, v = leaves([(2, n, 8) for n in lq], 1), leaves([(2, n, 8) for n in lk], 2), leaves([(2, n, 8) for n in lk], 3)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    check_samples(f, f, [q, k, v])


def test_gqa_and_scale_in_groups():
    lens = [3, 3, 3, 7, 7, 1]
    q, k, v = leaves([(4, n, 8) for n in lens], 1), leaves([(2, n, 8) for n in lens], 2), leaves([(2, n, 8) for n in lens], 3)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, scale=0.3, enable_gqa=True)

    check_samples(f, f, [q, k, v])


def test_two_dim_samples_in_groups():
    q = leaves([(n, 8) for n in [5, 5, 2, 0, 0, 5]], 4, ragged=(0,))
    check_samples(lambda a: _sdpa(a, a, a), lambda a: _sdpa(a, a, a), [q])


def test_one_sample_batch():
    q = leaves([(2, 6, 8)], 5, ragged=(1,))
    check_samples(lambda a: _sdpa(a, a, a), lambda a: _sdpa(a, a, a), [q])


def test_bf16_groups():
    q = leaves([(2, n, 8) for n in [4, 4, 4, 9]], 6, dtype=torch.bfloat16)
    check_samples(lambda a: _sdpa(a, a, a), lambda a: _sdpa(a, a, a), [q], atol=2e-2, rtol=2e-2)


def test_masks_of_equal_length_samples_are_stacked_per_sample():
    # each sample keeps its own mask: equal lengths run as one call on the stacked masks
    lens = [3, 3, 3]
    (q, qs) = leaves([(2, n, 8) for n in lens], 1, ragged=(1,))
    g = torch.Generator().manual_seed(0)
    masks = [torch.randn(2, n, n, generator=g) for n in lens]
    m = padless.from_list(masks, ragged_dims=(1, 2))
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    assert sum(n.startswith("ScaledDotProduct") for n in _graph_nodes(out)) == 1
    for i, (o, s) in enumerate(zip(out.unbind(), qs)):
        torch.testing.assert_close(o, F.scaled_dot_product_attention(s, s, s, attn_mask=masks[i]), atol=1e-6, rtol=1e-5)


def test_dropout_on_equal_lengths_keeps_per_sample_rng_order():
    (q, _) = leaves([(2, 4, 8)] * 3, 2, ragged=(1,))
    torch.manual_seed(5)
    out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(5)
    refs = [F.scaled_dot_product_attention(a, a, a, dropout_p=0.5) for a in q.unbind()]
    assert_close_samples(out, refs)


def test_backward_is_one_split_not_a_slice_per_sample():
    lens = _short_lengths(64, 1, 8, seed=1)
    (q, _) = leaves([(2, n, 8) for n in lens], 1)
    out = F.scaled_dot_product_attention(q, q, q)
    names = _graph_nodes(out)
    assert "SliceBackward0" not in names
    sdpa_calls = sum(n.startswith("ScaledDotProduct") for n in names)
    assert sdpa_calls <= len(set(lens))  # one call per distinct length
    assert attn.last_choice.backend == "per_sample"


def test_distinct_lengths_use_split_views():
    (q, _) = leaves([(2, n, 8) for n in [1, 2, 3, 4]], 1)
    names = _graph_nodes(F.scaled_dot_product_attention(q, q, q))
    assert "SliceBackward0" not in names and "SplitWithSizesBackward0" in names
