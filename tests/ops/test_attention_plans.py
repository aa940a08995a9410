"""Host plans of the per-sample attention path, cached on the structure (issue 23).

The per-sample CPU path reads its offsets and groups of equal lengths from a plan built once
per structure; the backend probe imports flash-attn at most once per process. Every sample
still equals its own dense SDPA (values and gradients), with the plan reused by a second
layer, for one-sample batches and with empty samples.
"""

import builtins

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.ops.attention import sdpa as attn
from padless.testing import check_samples, leaves


def _heads(x, h: int):
    """(L_i, h * e) samples as (h, L_i, e), a view of the same structure."""
    return x.unflatten(-1, (h, -1)).transpose(-3, -2)


@pytest.mark.parametrize("lens", [[5, 0, 7, 7, 3, 5, 1], [6], [0, 4, 4]])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_reused_by_a_second_layer_keeps_each_sample_exact(lens, causal, monkeypatch, one_thread):
    monkeypatch.setattr(attn, "BUCKETS", False)  # the per-sample path and its groups of equal lengths
    (x, xs) = leaves([(n, 16) for n in lens], 1, dtype=torch.float64)
    w1, w2 = (0.25 * torch.randn(16, 48, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (2, 3))

    def layer(t, w):
        q, k, v = (t @ w).chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(*(_heads(u.contiguous(), 2) for u in (q, k, v)), is_causal=causal)
        return o.transpose(-3, -2).flatten(-2)

    def net(t):
        return layer(layer(t, w1), w2)

    check_samples(net, net, [(x, xs)], atol=1e-10, rtol=1e-10)
    q = _heads(x.detach(), 2)
    F.scaled_dot_product_attention(q, q, q)
    key = ("attention_samples", 3, len(lens) >= 2)
    assert key in q._meta.derived
    assert attn._sample_plan(q, q, key[2]) is q._meta.derived[key]  # read, not rebuilt
    qo, ko, alone, groups = q._meta.derived[key]
    assert qo == ko == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert sorted(alone + [i for g in groups for i in g]) == list(range(len(lens)))
    assert all(len({lens[i] for i in g}) == 1 for g in groups)


def test_cross_attention_plan_is_not_shared_between_key_structures(monkeypatch, one_thread):
    monkeypatch.setattr(attn, "BUCKETS", False)
    lq = [3, 5, 2]
    q = leaves([(2, n, 8) for n in lq], 1, dtype=torch.float64)
    for seed, lk in ((2, [4, 1, 6]), (3, [2, 2, 7])):
        k, v = (leaves([(2, n, 8) for n in lk], s, dtype=torch.float64) for s in (seed, seed + 10))
        q[0].grad = None
        for d in q[1]:
            d.grad = None
        check_samples(F.scaled_dot_product_attention, F.scaled_dot_product_attention, [q, k, v])


def test_flash_attn_probe_imports_once(monkeypatch, one_thread):
    attn._flash_attn.cache_clear()
    tries = []
    real_import = builtins.__import__

    def counting(name, *a, **kw):
        if name == "flash_attn":
            tries.append(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", counting)
    q = padless.from_list([torch.randn(2, n, 8) for n in (3, 4)])
    for _ in range(3):
        F.scaled_dot_product_attention(q, q, q)
        attn.explain(q, q, q)
    assert len(tries) <= 1
    attn._flash_attn.cache_clear()
