"""Terms broadcast onto pending attention scores, kept at their own size (``ops.pairs.spread``).

Triangle attention adds a bias ``(1, H, N_i, N_i)`` and a key mask ``(N_i, 1, 1, N_i)`` to
scores ``(N_i, H, N_i, N_i)``. The fused node reads such a term once into its buckets with
its extent-1 dims kept and adds it by broadcasting; its gradient is the scores' gradient
summed over those dims. Checked sample by sample against dense triangle attention, float64,
values and gradients of every input, on ragged batches with empty samples and one-sample
batches.
"""

from __future__ import annotations

import pytest
import torch

import padless
from padless.ops.common import content
from padless.ops.kernels.layout import read_rows
from padless.ops.pairs import attend, bucketed, spread
from padless.testing import check_samples, leaves

BATCHES = {"ragged": [3, 5, 0, 1, 6, 2], "one_sample": [4], "empty_and_one": [0, 1], "equal": [3, 3]}
F64 = torch.float64
H, C = 2, 3


@pytest.fixture
def runs(monkeypatch):
    """Per fused node run: how many of its terms were spread (kept at their size)."""
    calls = []
    real = attend.Attention.forward

    def counting(ctx, sp, a, b, v, x, *terms):
        calls.append(sum(m is not None for m in sp.spreads))
        return real(ctx, sp, a, b, v, x, *terms)

    monkeypatch.setattr(attend.Attention, "forward", staticmethod(counting))
    return calls


def _inputs(ns, seed):
    """q, k, v ``(I, H, J, C)`` (rows ``I`` of a pair state), the triangle bias ``(1, H, J, K)``."""
    qkv = [leaves([(n, H, n, C) for n in ns], seed=seed + i, ragged=(0, 2), dtype=F64) for i in range(3)]
    bias = leaves([(1, H, n, n) for n in ns], seed=seed + 3, ragged=(2, 3), dtype=F64)
    return qkv, bias


def _mask(ns, seed):
    """A key mask term ``(I, 1, 1, K)``: 0 or -1e4, no gradient (not all ones: not a constant)."""
    g = torch.Generator().manual_seed(seed)
    dense = [((torch.rand(n, 1, 1, n, generator=g) < 0.3).to(F64) * -1e4) for n in ns]
    return padless.from_list(dense, ragged_dims=(0, 3)), dense


def _dense_attention(a, b, c, *terms):
    s = a @ b.transpose(-1, -2)
    for t in terms:
        s = s + t
    return s.softmax(-1) @ c


@pytest.mark.parametrize("ns", BATCHES.values(), ids=BATCHES.keys())
def test_triangle_bias_and_key_mask_broadcast_over_rows(ns, runs):
    """boltz's triangle attention core: ``s = q @ k^T``, ``s += mask_bias``, ``s += tri_bias``
    in place, softmax, ``@ v``: both terms spread, per-sample values and gradients."""
    (q, k, v), z = _inputs(ns, 1)
    m, md = _mask(ns, 9)

    def fn(a, b, c, t):
        s = a @ b.transpose(-1, -2)
        s += m
        s += t
        return s.softmax(-1) @ c

    masks = iter(md)  # check_samples calls ref once per sample, in order

    def ref(a, b, c, t):
        return _dense_attention(a, b, c, next(masks), t)

    check_samples(fn, ref, [q, k, v, z])
    assert runs == [1 + any(bool(t.any()) for t in md)]  # a mask that is 0 everywhere is a constant


def test_out_of_place_sub_alpha_and_two_spread_terms(runs):
    """``s - t``, ``torch.add(s, t, alpha=0.5)`` and a scale after: the recipe keeps each term's
    coefficient; a second spread term (another bias) sums with the first in the buckets."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 20)
    w = leaves([(1, H, n, n) for n in ns], seed=30, ragged=(2, 3), dtype=F64)

    def fn(a, b, c, t, u):
        s = torch.add(a @ b.transpose(-1, -2) - t, u, alpha=0.5) * 0.8
        return s.softmax(-1) @ c

    def ref(a, b, c, t, u):
        s = (a @ b.transpose(-1, -2) - t + 0.5 * u) * 0.8
        return s.softmax(-1) @ c

    check_samples(fn, ref, [q, k, v, z, w])
    assert runs == [2]


def test_spread_scores_used_elsewhere_are_computed(runs):
    """Scores with a spread term also feed another op: the term is read onto their rows there
    (the recipe stands for the fused node)."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 40)

    def fn(a, b, c, t):
        s = a @ b.transpose(-1, -2) + t
        return s.softmax(-1) @ c + s.tanh() @ c

    def ref(a, b, c, t):
        s = a @ b.transpose(-1, -2) + t
        return s.softmax(-1) @ c + s.tanh() @ c

    check_samples(fn, ref, [q, k, v, z])
    assert runs == [1]


def test_a_spread_term_keeps_the_scores_maps_unbuilt(runs):
    """With every term spread, nothing reads the scores as rows: the element maps of the scores
    (as long as the scores) are never built, forward or backward."""
    content.clear()  # plans are shared by content: another test's may have built these maps
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 50)
    plans = []
    real = attend.spec

    def spec(p1, *args):
        plans.append(p1)
        return real(p1, *args)

    attend.spec = spec
    try:
        s = q[0] @ k[0].transpose(-1, -2)
        s += z[0]
        (s.softmax(-1) @ v[0]).values().pow(2).sum().backward()
    finally:
        attend.spec = real
    assert runs == [1] and len(plans) == 1
    packs = plans[0].packs
    assert isinstance(packs, bucketed.LazyMaps) and packs._maps is None


def test_the_key_mask_weighs_nothing_past_each_sample_and_is_small():
    """The fused node's key mask (``attend._key_mask``: per bucket ``(count, 1, 1, 1, K)``)
    agrees, on every query row of a real sample, with the scores' buffer read through their
    element maps (holes: the large negative number), and it holds ``count * K`` numbers, not a
    buffer as large as the scores."""
    ns = BATCHES["ragged"]
    (q, k, _), _ = _inputs(ns, 60)
    with torch.no_grad():
        s = q[0] @ k[0].transpose(-1, -2)
    plan = s._values._thunk.plan
    assert plan.flat[-1]  # scores (I, H, J, K) stored as rows (i, j, k) of H: element maps
    dim = 4  # K, of a bucket's dense scores (slot, I, H, J, K)
    masks = attend._key_mask(plan, dim, F64, torch.device("cpu"))
    neg = torch.finfo(F64).min
    want = attend._pieces(plan, read_rows(torch.zeros(plan.out_rows * H, dtype=F64), plan.packs[0], neg))
    assert len(masks) == len(want) == len(plan.groups)
    for mask, full, ids in zip(masks, want, plan.groups):
        assert mask.numel() == len(ids) * full.shape[dim]
        got = mask.expand(full.shape)
        real = full.amax(dim, keepdim=True) > neg  # query rows of a real sample
        assert bool(real.any())
        torch.testing.assert_close(torch.where(real, got, full), full, atol=0, rtol=0)


def test_a_spread_term_changed_in_place_before_use_raises():
    """As for every term of a recipe: the bias changed in place before the scores are used."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 70)
    t = z[0].detach().clone()
    s = q[0] @ k[0].transpose(-1, -2) + t
    t.values().add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        s.softmax(-1) @ v[0]


def test_spread_off_gives_the_same_values_and_gradients(monkeypatch):
    """The spread path and the path that reads the term onto the scores' rows agree."""
    ns = BATCHES["ragged"]
    results = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(spread, "spreads", lambda x, y: False)
        (q, k, v), z = _inputs(ns, 80)
        s = q[0] @ k[0].transpose(-1, -2)
        s += z[0]
        out = s.softmax(-1) @ v[0]
        out.values().pow(2).sum().backward()
        results.append([out.values().detach()] + [t[0].grad.values() for t in (q, k, v, z)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("masked", [0.0, 0.3], ids=["all_ones", "some_masked"])
def test_dense_key_mask_in_padded_coordinates(masked, runs):
    """The padded batch's pair mask given to padless (``mask[..., :, None, None, :]``, dense, in
    padded coordinates): its samples' windows are the term, kept at their size; a mask of ones
    on every real position is a constant (nothing is read into the buckets)."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 90)
    n = max(ns)
    g = torch.Generator().manual_seed(5)
    mask = torch.zeros(len(ns), n, n, dtype=F64)
    for i, m in enumerate(ns):
        mask[i, :m, :m] = (torch.rand(m, m, generator=g) >= masked).to(F64)
    bias = 1e4 * (mask[..., :, None, None, :] - 1)  # (B, I, 1, 1, K), 0 or -1e4 on real positions
    windows = iter([bias[i, :m, :, :, :m] for i, m in enumerate(ns)])

    def fn(a, b, c, t):
        s = a @ b.transpose(-1, -2)
        s += bias
        s += t
        return s.softmax(-1) @ c

    def ref(a, b, c, t):
        return _dense_attention(a, b, c, next(windows), t)

    check_samples(fn, ref, [q, k, v, z])
    assert runs == [1 + (masked > 0)]


def test_spread_term_stored_transposed(runs):
    """A bias whose pair dims are stored in the other order (``w.transpose(-1, -2)``, rows
    ``(k, j)``) and a bias over the key rows (``(I, H, 1, K)``, extent 1 on the query dim)."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 100)
    kb = leaves([(n, H, 1, n) for n in ns], seed=105, ragged=(0, 3), dtype=F64)

    def fn(a, b, c, t, u):
        s = a @ b.transpose(-1, -2) + t.transpose(-1, -2)
        return (s + u).softmax(-1) @ c

    def ref(a, b, c, t, u):
        return _dense_attention(a, b, c, t.transpose(-1, -2), u)

    check_samples(fn, ref, [q, k, v, z, kb])
    assert runs == [2]


def test_triangle_scores_of_a_small_batch_run_in_buckets():
    """Triangle-attention scores of the zoo's size (B=4, N 18..40, two heads of 8) are bucketed
    and deferred: their element maps are not priced (built only if read as rows) and, per
    sample, scores cost the fused node's chain of calls (``SCORES_CALL_COST``)."""
    from padless.ops.pairs import pending

    ns = [40, 33, 27, 18]
    q = leaves([(n, 2, n, 8) for n in ns], seed=1, ragged=(0, 2))[0]
    k = leaves([(n, 2, n, 8) for n in ns], seed=2, ragged=(0, 2))[0]
    s = q @ k.transpose(-1, -2)
    assert isinstance(s._values, pending.Pending)


def test_spread_term_with_a_term_of_the_scores_shape(runs):
    """A term of the scores' own shape (read on their rows, through their maps) and a spread
    one in the same recipe: both reach the buckets, both get their gradients."""
    ns = BATCHES["ragged"]
    (q, k, v), z = _inputs(ns, 110)
    full = leaves([(n, H, n, n) for n in ns], seed=115, ragged=(0, 2, 3), dtype=F64)

    def fn(a, b, c, t, u):
        s = a @ b.transpose(-1, -2) * 0.5 + u
        s += t
        return s.softmax(-1) @ c

    def ref(a, b, c, t, u):
        return _dense_attention(a * 0.5, b, c, u, t)

    check_samples(fn, ref, [q, k, v, z, full])
    assert runs == [1]
