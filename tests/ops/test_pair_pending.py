"""Deferred attention scores (padless.ops.pairs.pending): a bucketed contraction whose result's
last dim is ragged returns pending rows; scale / ``+ term`` extend the recipe; the softmax
over the last ragged dim is pending too; ``softmax(...) @ v`` runs as one node in buckets
(padless.ops.pairs.attend.Attention). Every case is checked sample by sample against the
dense computation on each sample alone (values and gradients of every input, float64), on
ragged batches with an empty sample and on one-sample batches, and the fused node's mode is
checked (gradients straight to the recipe's inputs, or through the softmax's input)."""

import pytest
import torch

import padless
from padless.ops.pairs import attend, pending, spread
from padless.testing import check_samples, leaves

BATCHES = {"ragged": [3, 5, 0, 1, 6, 2], "one_sample": [4], "empty_and_one": [0, 1]}
F64 = torch.float64


@pytest.fixture
def modes(monkeypatch):
    """Per fused node run: 'direct' (gradients to a, b, terms) or 'x' (through the softmax's input)."""
    calls = []
    real = attend.Attention.forward

    def counting(ctx, sp, a, b, v, x, *terms):
        calls.append("x" if x is not None else "direct")
        return real(ctx, sp, a, b, v, x, *terms)

    monkeypatch.setattr(attend.Attention, "forward", staticmethod(counting))
    return calls


def _qkv(ns, seed, h=2, d=3):
    return [leaves([(n, h, d) for n in ns], seed=seed + i, dtype=F64) for i in range(3)]


def _bias(ns, seed, h=2):
    return leaves([(n, n, h) for n in ns], seed=seed, ragged=(0, 1), dtype=F64)


@pytest.mark.parametrize("ns", BATCHES.values(), ids=BATCHES.keys())
def test_boltz_pair_bias_with_mask(ns, modes):
    """boltz's AttentionPairBias core: einsum, scale after, ``+ bias`` (another structure:
    the pair state permuted), ``+ (1 - mask) * -inf`` (a key mask broadcast over the rows)."""
    q, k, v = _qkv(ns, 1)
    z = _bias(ns, 4)
    mask = padless.from_list([torch.ones(n, dtype=F64) for n in ns])

    def fn(a, b, c, t):
        s = torch.einsum("bihd,bjhd->bhij", a, b) / 3 ** 0.5 + t.permute(0, 3, 1, 2)
        s = s + (1 - mask[:, None, None]) * -1e6
        return torch.einsum("bhij,bjhd->bihd", s.softmax(dim=-1), c)

    def ref(a, b, c, t):
        s = torch.einsum("ihd,jhd->hij", a, b) / 3 ** 0.5 + t.permute(2, 0, 1)
        return torch.einsum("hij,jhd->ihd", s.softmax(-1), c)

    check_samples(fn, ref, [q, k, v, z])
    assert modes == ["direct"]


def test_matmul_scale_first_and_bias_first(modes):
    """``q @ k^T`` written with matmul on ``(H, N_i, D)`` samples, the scale applied to ``q``
    first, then ``bias + scores`` and ``- term`` (terms on either side, subtraction)."""
    ns = BATCHES["ragged"]
    q, k, v = [leaves([(2, n, 3) for n in ns], seed=10 + i, ragged=(1,), dtype=F64) for i in range(3)]
    z = leaves([(2, n, n) for n in ns], seed=13, ragged=(1, 2), dtype=F64)
    w = leaves([(2, n, n) for n in ns], seed=14, ragged=(1, 2), dtype=F64)

    def fn(a, b, c, t, u):
        s = t + (a * 0.5) @ b.transpose(-1, -2)
        s = 2.0 * (s - u)
        return s.softmax(-1) @ c

    check_samples(fn, fn, [q, k, v, z, w])
    assert modes == ["direct"]


def test_scores_used_elsewhere_are_computed(modes):
    """The scores also feed another result: they are computed for that use (the recipe stands),
    values and gradients stay the dense ones."""
    ns = BATCHES["ragged"]
    q, k, v = _qkv(ns, 20)

    def fn(a, b, c):
        s = torch.einsum("bihd,bjhd->bhij", a, b) * 0.7
        o = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), c)
        return o + torch.einsum("bhij,bjhd->bihd", s.tanh(), c)

    def ref(a, b, c):
        s = torch.einsum("ihd,jhd->hij", a, b) * 0.7
        return torch.einsum("hij,jhd->ihd", s.softmax(-1), c) + torch.einsum("hij,jhd->ihd", s.tanh(), c)

    check_samples(fn, ref, [q, k, v])
    assert modes == ["direct"]  # the fused node still ran for softmax(s) @ v


def test_weights_used_twice(modes):
    """The pending softmax also feeds another op: it is computed there, its own backward runs."""
    ns = BATCHES["ragged"]
    q, k, v = _qkv(ns, 30)

    def fn(a, b, c):
        p = (torch.einsum("bihd,bjhd->bhij", a, b) - 0.25).softmax(-1)
        return torch.einsum("bhij,bjhd->bihd", p, c) + torch.einsum("bhij,bjhd->bihd", p * p, c)

    def ref(a, b, c):
        p = (torch.einsum("ihd,jhd->hij", a, b) - 0.25).softmax(-1)
        return torch.einsum("hij,jhd->ihd", p, c) + torch.einsum("hij,jhd->ihd", p * p, c)

    check_samples(fn, ref, [q, k, v])
    assert modes == ["direct"]


def test_in_place_scale_and_bias_extend_the_recipe(modes):
    """``s *= c`` and ``s += bias`` in place (boltz's triangle attention adds its biases so)
    change the recipe itself; a softmax taken before keeps the old scores."""
    ns = BATCHES["ragged"]
    q, k, v = _qkv(ns, 40)
    z = _bias(ns, 43)

    def fn(a, b, c, t):
        s = torch.einsum("bihd,bjhd->bhij", a, b)
        early = s.softmax(-1)
        used = early * early  # computed before the change
        s *= 0.5
        s += t.permute(0, 3, 1, 2)
        return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), c) + torch.einsum("bhij,bjhd->bihd", used + early, c)

    def ref(a, b, c, t):
        s = torch.einsum("ihd,jhd->hij", a, b)
        early = s.softmax(-1)
        s = s * 0.5 + t.permute(2, 0, 1)
        return torch.einsum("hij,jhd->ihd", s.softmax(-1), c) + torch.einsum("hij,jhd->ihd", early * early + early, c)

    check_samples(fn, ref, [q, k, v, z])
    assert modes == ["direct"]


def test_other_in_place_op_computes_the_scores(modes):
    """An in-place op that is not a scale or a shift (``clamp_``) computes the scores first;
    no fused node after it."""
    ns = BATCHES["ragged"]
    q, k, v = _qkv(ns, 45)

    def fn(a, b, c):
        s = torch.einsum("bihd,bjhd->bhij", a, b)
        s.clamp_(max=1.0)
        return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), c)

    def ref(a, b, c):
        return torch.einsum("hij,jhd->ihd", torch.einsum("ihd,jhd->hij", a, b).clamp(max=1.0).softmax(-1), c)

    check_samples(fn, ref, [q, k, v])
    assert modes == []


def test_pending_rows_in_a_list_operand():
    """``torch.cat`` of pending rows (a list operand) computes them."""
    ns = BATCHES["ragged"]
    (q, qs), (k, ks), _ = _qkv(ns, 47)
    with torch.no_grad():
        s = torch.einsum("bihd,bjhd->bhij", q, k) * 2.0
        both = torch.cat([s.values(), s.values() + 1.0])
    # the scores' rows (i, j) of H features, sample after sample, from each sample alone
    ref = torch.cat([(torch.einsum("ihd,jhd->hij", a, b) * 2.0).permute(1, 2, 0).reshape(-1, 2)
                     for a, b in zip(qs, ks)]).detach()
    torch.testing.assert_close(both, torch.cat([ref, ref + 1.0]))


def test_term_changed_in_place_before_use_raises():
    """A term changed in place after it entered the recipe would silently change the scores:
    it raises, naming the fix."""
    ns = BATCHES["ragged"]
    (q, _), (k, _), (v, _) = _qkv(ns, 50)
    z = padless.from_list([torch.randn(2, n, n, dtype=F64) for n in ns], ragged_dims=(1, 2))
    s = torch.einsum("bihd,bjhd->bhij", q, k) + z
    z.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def test_broadcast_term_changed_in_place_before_use_raises():
    """The same for a term broadcast onto the scores that needs a gradient (read again by the
    fused node): it raises rather than read the changed values."""
    ns = BATCHES["ragged"]
    (q, _), (k, _), (v, _) = _qkv(ns, 55)
    kb = padless.from_list([torch.randn(n, dtype=F64) for n in ns], requires_grad=True)
    s = torch.einsum("bihd,bjhd->bhij", q, k) + kb[:, None, None]
    with torch.no_grad():
        kb.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


@pytest.mark.parametrize("ns", BATCHES.values(), ids=BATCHES.keys())
def test_broadcast_term_with_a_gradient_stays_direct(ns, modes):
    """A key bias that needs a gradient, broadcast over the rows (read onto them inside an op
    recorded on NestedTensors): the fused node reads it onto the scores' rows again, recorded,
    so its gradients go straight to ``a``, ``b`` and the bias (not through the softmax's input)."""
    q, k, v = _qkv(ns, 60)
    kb = leaves([(n,) for n in ns], seed=63, dtype=F64)

    def fn(a, b, c, t):
        s = torch.einsum("bihd,bjhd->bhij", a, b) + t[:, None, None]
        return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), c)

    def ref(a, b, c, t):
        return torch.einsum("hij,jhd->ihd", (torch.einsum("ihd,jhd->hij", a, b) + t).softmax(-1), c)

    check_samples(fn, ref, [q, k, v, kb])
    assert modes == ["direct"]


def test_inference_and_values_on_the_left(modes):
    """No gradient: still one node; ``einsum("bjhd,bhij->bihd", v, attn)`` (the weights
    second) is one node too (the generic per-bucket path)."""
    ns = BATCHES["ragged"]
    (q, qs), (k, ks), (v, vs) = _qkv(ns, 70)
    with torch.no_grad():
        out = torch.einsum("bhij,bjhd->bihd", (torch.einsum("bihd,bjhd->bhij", q, k) * 0.3).softmax(-1), v)
        left = torch.einsum("bjhd,bhij->bihd", v, (torch.einsum("bihd,bjhd->bhij", q, k) * 0.3).softmax(-1))
    assert modes == ["direct", "direct"]
    for got, got_left, a, b, c in zip(out.unbind(), left.unbind(), qs, ks, vs):
        ref = torch.einsum("hij,jhd->ihd", (torch.einsum("ihd,jhd->hij", a, b) * 0.3).softmax(-1), c).detach()
        torch.testing.assert_close(got, ref)
        torch.testing.assert_close(got_left, ref)


def test_generic_and_fast_paths_agree():
    """The generic per-bucket path (any equation) and the fast ``bmm`` one give the same
    values and gradients."""
    ns = BATCHES["ragged"]
    (q, _), (k, _), (v, _) = _qkv(ns, 80)
    z, _ = _bias(ns, 83)
    results = []
    for fast in (True, False):
        real = attend.spec

        def spec(*args, _real=real, _fast=fast):
            sp = _real(*args)
            return sp if _fast else attend.Spec(sp.p1, sp.p2, sp.j, sp.dim, sp.alpha, sp.coefs, None)

        attend.spec = spec
        try:
            for t in (q, k, v, z):
                t.grad = None
            s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.5 + z.permute(0, 3, 1, 2)
            out = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
            out.values().pow(2).sum().backward()
            results.append([out.values().detach()] + [t.grad.values().clone() for t in (q, k, v, z)])
        finally:
            attend.spec = real
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("key_bias,spread_on,hide", [(False, True, False), (True, True, False), (True, False, False),
                                                     (True, False, True)],
                         ids=["direct", "broadcast_term_spread", "broadcast_term_read", "softmax_input"])
def test_fused_node_gradients_twice(key_bias, spread_on, hide, modes, monkeypatch):
    """Double backward through the fused node (both modes), float64. The broadcast key bias
    is kept at its size in the buckets (``spread``), or, with that off, read onto the scores'
    rows (and read again, recorded, by the node). The softmax-input mode is the fallback for
    a term whose history is unknown: forced here by hiding how that read was made."""
    if not spread_on:
        monkeypatch.setattr(spread, "spreads", lambda x, y: False)
    if hide:
        real = pending._owner
        monkeypatch.setattr(pending, "_owner", lambda term: False if isinstance(real(term), tuple) else real(term))
    ns = (2, 0, 3, 1)
    g = torch.Generator().manual_seed(0)
    q = padless.from_list([torch.randn(n, 2, 2, dtype=F64, generator=g) for n in ns])
    k = padless.from_list([torch.randn(n, 2, 2, dtype=F64, generator=g) for n in ns])
    v = padless.from_list([torch.randn(n, 2, 2, dtype=F64, generator=g) for n in ns])
    z = padless.from_list([torch.randn(n, n, 2, dtype=F64, generator=g) for n in ns], ragged_dims=(0, 1))
    kb = padless.from_list([torch.randn(n, dtype=F64, generator=g) for n in ns])
    leaves_ = [t.values().clone().requires_grad_() for t in (q, k, v, z, kb)]

    def fn(qv, kv, vv, zv, bv):
        a, b, c, t, u = (_like(x, o) for x, o in zip((qv, kv, vv, zv, bv), (q, k, v, z, kb)))
        s = torch.einsum("bihd,bjhd->bhij", a, b) * 0.5 + t.permute(0, 3, 1, 2)
        if key_bias:
            s = s + u[:, None, None]
        return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), c).values()

    torch.autograd.gradcheck(fn, leaves_)
    torch.autograd.gradgradcheck(fn, leaves_)
    assert set(modes) == {"x" if hide else "direct"}


def _like(values, like):
    from padless.tensor.autograd import nested_from_values

    return nested_from_values(values, like._offsets, like._sizes, like._ragged, like._env, like._meta)


def test_disabled_runs_every_op(modes):
    """``pending.ENABLED = False``: no deferral, same values."""
    ns = BATCHES["ragged"]
    q, k, v = _qkv(ns, 90)
    pending.ENABLED = False
    try:
        def fn(a, b, c):
            return torch.einsum("bhij,bjhd->bihd", (torch.einsum("bihd,bjhd->bhij", a, b) * 0.4).softmax(-1), c)

        def ref(a, b, c):
            return torch.einsum("hij,jhd->ihd", (torch.einsum("ihd,jhd->hij", a, b) * 0.4).softmax(-1), c)

        check_samples(fn, ref, [q, k, v])
    finally:
        pending.ENABLED = True
    assert modes == []


@pytest.mark.parametrize("ns", BATCHES.values(), ids=BATCHES.keys())
def test_baddbmm_bias(ns, modes):
    """``torch.baddbmm(bias, q, k^T, alpha=c)`` on ``(N_i, D)`` samples (one head), then
    softmax and ``@ v``: the same fused node, gradients to the bias too."""
    q, k, v = [leaves([(n, 3) for n in ns], seed=100 + i, dtype=F64) for i in range(3)]
    z = leaves([(n, n) for n in ns], seed=103, ragged=(0, 1), dtype=F64)

    def fn(a, b, c, t):
        s = torch.baddbmm(t, a, b.transpose(-1, -2), alpha=0.5)
        s2 = t.baddbmm(a, b.transpose(-1, -2), beta=2.0)
        return s.softmax(-1) @ c + s2.softmax(-1) @ c

    def ref(a, b, c, t):
        s = torch.addmm(t, a, b.transpose(-1, -2), alpha=0.5)
        s2 = torch.addmm(t, a, b.transpose(-1, -2), beta=2.0)
        return s.softmax(-1) @ c + s2.softmax(-1) @ c

    check_samples(fn, ref, [q, k, v, z])
    assert modes == ["direct", "direct"]


def test_values_of_deferred_scores_is_a_plain_differentiable_tensor():
    """``NestedTensor.values()`` is public: it hands out the computed rows as a plain tensor
    (``numpy()`` and ``type(t) is torch.Tensor`` checks work), and gradients flow through it."""
    (q, qs), (k, ks), _ = _qkv(BATCHES["ragged"], 7)
    want = [torch.einsum("ihd,jhd->hij", a, b) * 0.5 for a, b in zip(qs, ks)]
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.5
    assert type(s._values) is pending.Pending  # deferred inside the NestedTensor
    repr(s)  # printing reads the rows
    rows = s.values()
    assert type(rows) is torch.Tensor
    assert rows.detach().numpy().shape == tuple(rows.shape)
    for got, w in zip(s.unbind(), want):
        torch.testing.assert_close(got, w)
    rows.square().sum().backward()
    sum(w.square().sum() for w in want).backward()
    for nt, dense in ((q, qs), (k, ks)):
        for g, d in zip(nt.grad.unbind(), dense):
            torch.testing.assert_close(g, d.grad)


def test_triangle_attention_biases_in_place_with_per_sample_views(modes, monkeypatch):
    """boltz's triangle attention over rows of a pair state: scores ``(I, H, J, J)``, then
    ``s += mask_bias`` (``(I, 1, 1, J)``) and ``s += tri_bias`` (``(1, H, I, J)``) in place,
    both of other structures. With few large samples the broadcast would run on per-sample
    views (:mod:`padless.ops.common.sample_views`), which would slice and so compute the
    scores; deferred rows take the rows path instead and the chain stays one fused node."""
    from padless.ops.common import sample_views
    from padless.ops.pairs import bucketed

    monkeypatch.setattr(sample_views, "ROWS_PER_SAMPLE", 1)  # every batch counts as few large samples
    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 1e9)  # bucketed, so the scores are deferred
    ns = [3, 4, 1]
    q, k, v = (leaves([(n, 2, n, 3) for n in ns], seed=50 + i, ragged=(0, 2), dtype=F64) for i in range(3))
    tri = leaves([(1, 2, n, n) for n in ns], seed=53, ragged=(2, 3), dtype=F64)
    mask = padless.from_list([torch.ones(n, n, dtype=F64) for n in ns])

    def fn(a, b, c, t):
        s = torch.matmul(a, b.transpose(-1, -2))
        s += (1e6 * (mask - 1))[:, :, None, None, :]
        s += t
        return torch.matmul(s.softmax(-1), c)

    def ref(a, b, c, t):
        return torch.matmul((torch.matmul(a, b.transpose(-1, -2)) + t).softmax(-1), c)

    check_samples(fn, ref, [q, k, v, tri])
    assert modes, "the chain did not run as one fused node"


@pytest.mark.parametrize("zeros", [False, True], ids=["mask_all_ones", "mask_with_zeros"])
def test_all_zero_key_mask_term_is_a_constant(zeros, monkeypatch):
    """``s + (1 - mask) * -1e6`` with a mask that is all ones on real positions adds zeros: the
    recipe takes a constant instead of a term read onto every score; a mask with a zero stays
    a term. Values and gradients per sample either way."""
    seen = []
    real = attend.Attention.forward

    def counting(ctx, sp, a, b, v, x, *terms):
        seen.append(sum(t.dim() > 0 for t in terms))  # a constant is not read onto the scores
        return real(ctx, sp, a, b, v, x, *terms)

    monkeypatch.setattr(attend.Attention, "forward", staticmethod(counting))
    ns = [3, 5, 2]
    q, k, v = _qkv(ns, 60)
    z = _bias(ns, 63)
    masks = [torch.ones(n, dtype=F64) for n in ns]
    if zeros:
        masks[1][2] = 0.0
    mask = padless.from_list(masks)

    def fn(a, b, c, t):
        s = torch.einsum("bihd,bjhd->bhij", a, b) / 3 ** 0.5 + t.permute(0, 3, 1, 2)
        s = s + (1 - mask[:, None, None]) * -1e6
        return torch.einsum("bhij,bjhd->bihd", s.softmax(dim=-1), c)

    def ref(a, b, c, t):
        i = next(j for j, n in enumerate(ns) if n == a.shape[0])
        s = torch.einsum("ihd,jhd->hij", a, b) / 3 ** 0.5 + t.permute(2, 0, 1) + (1 - masks[i]) * -1e6
        return torch.einsum("hij,jhd->ihd", s.softmax(-1), c)

    check_samples(fn, ref, [q, k, v, z])
    assert seen == ([2] if zeros else [1]), seen


@pytest.mark.parametrize("ns", [[0, 0], [0]], ids=["all_empty", "one_empty_sample"])
@pytest.mark.parametrize("bias", [False, True])
def test_attention_on_a_batch_of_empty_samples(ns, bias, modes):
    """``(q @ k^T).softmax(-1) @ v`` when every sample is empty (``(H, 0, D)`` each): the empty
    result, as each sample alone gives, values and gradients (the fused node's per-bucket
    views have a zero extent; they raised ZeroDivisionError)."""
    q, k, v = [leaves([(2, n, 3) for n in ns], seed=70 + i, ragged=(1,), dtype=F64) for i in range(3)]
    m = torch.randn(1, 2, 0, 0, dtype=F64)

    def fn(a, b, c):
        s = (a @ b.transpose(-1, -2)) * 0.5
        return (s + m if bias else s).softmax(-1) @ c

    def ref(a, b, c):
        s = (a @ b.transpose(-1, -2)) * 0.5
        return (s + m[0] if bias else s).softmax(-1) @ c

    out = check_samples(fn, ref, [q, k, v])
    assert out.shape[:3] == (len(ns), 2, 0) and modes == ["direct"]
    with torch.no_grad():
        assert fn(q[0], k[0], v[0]).values().shape == (0, 2, 3)


@pytest.mark.parametrize("ns", [[3, 0, 2], [1, 1], [1]], ids=["ragged", "all_one", "one_sample"])
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared_bias", "padded_bias"])
@pytest.mark.parametrize("rg", [False, True], ids=["buffer", "param"])
def test_bias_written_in_place_after_the_forward(ns, per_sample, rg, modes):
    """``softmax(q @ k^T + bias) @ v`` then ``bias.add_(1)`` under ``no_grad`` (an EMA, a mask
    reused by the next layer): the backward works and is the dense one, as torch's ``scores +
    bias`` keeps no bias for its backward (the fused node kept the bias as a saved tensor, and
    autograd's version check failed the backward)."""
    (x, dense) = leaves([(2, n, 3) for n in ns], seed=80, ragged=(1,), dtype=F64)
    b, n = len(ns), max(ns)
    m = torch.randn((b, 2, n, n) if per_sample else (1, 1, 1, 1), dtype=F64, requires_grad=rg)
    m0 = m.detach().clone()
    y = ((x @ x.transpose(-1, -2)) * 0.5 + m).softmax(-1) @ x
    with torch.no_grad():
        m.add_(1.0)
    g = torch.Generator().manual_seed(5)
    cot = [torch.randn(d.shape, generator=g, dtype=F64) for d in dense]
    y.backward(padless.from_list(cot, ragged_dims=(1,)))
    ms = [m0.clone().requires_grad_(rg) for _ in ns]
    for i, (d, c) in enumerate(zip(dense, cot)):
        mi = ms[i][i if per_sample else 0][..., : d.shape[1], : d.shape[1]] if per_sample else ms[i][0]
        yi = ((d @ d.transpose(-1, -2)) * 0.5 + mi).softmax(-1) @ d
        torch.autograd.backward(yi, c)
    for got, d in zip(x.grad.unbind(), dense):
        torch.testing.assert_close(got, d.grad)
    if rg:  # None where no path reaches it (softmax over one key: its gradient is zero)
        torch.testing.assert_close(torch.zeros_like(m) if m.grad is None else m.grad, sum(mi.grad for mi in ms))
    if not (rg and not per_sample):  # a broadcast parameter is added at once, not deferred (a .data write)
        assert modes == ["direct"]


def test_double_backward_after_the_bias_changed_in_place_raises():
    """The fused node recomputes its forward for a double backward (a backward with
    ``create_graph``): a bias written in place since the forward is refused there (autograd's
    message for a saved tensor), never read with its new values. The plain backward works
    (test_bias_written_in_place_after_the_forward)."""
    (x, _) = leaves([(1, n, 3) for n in [1, 0]], seed=81, ragged=(1,), dtype=F64)
    xv = x.values().detach().clone().requires_grad_()
    m = torch.randn(1, 1, 1, 1, dtype=F64)
    a = _like(xv, x)
    y = ((a @ a.transpose(-1, -2)) * 0.5 + m).softmax(-1) @ a
    with torch.no_grad():
        m.add_(1.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: term 0 added to the attention scores"):
        torch.autograd.grad(y.values().pow(2).sum(), xv, create_graph=True)


@pytest.mark.parametrize("rg", [False, True], ids=["buffer", "param"])
@pytest.mark.parametrize("write", ["data", "no_grad"])
def test_a_broadcast_operand_written_after_a_pending_op_is_read_as_it_was(write, rg):
    """Pending pair scores (einsum) shifted by a dense operand that broadcasts, then the operand
    written (through ``.data``, which moves no version counter, or in place): the first result
    keeps the values read when its op ran, as dense does (both results once read the new value:
    long fuzz run, seed 342464)."""
    xs = [torch.randn(0, 2), torch.randn(1, 2), torch.randn(3, 2)]
    x = padless.from_list(xs)
    d = torch.full((1, 1, 1), 2.0, requires_grad=rg)
    with torch.no_grad():
        s = torch.einsum("...id,...jd->...ij", x, x)
    a = d - s
    with torch.no_grad():
        if write == "data":
            d.data.copy_(torch.full((1, 1, 1), 5.0))
        else:
            d.add_(3.0)
    b = d - s
    for ga, gb, xi in zip(a.unbind(), b.unbind(), xs):
        si = xi @ xi.T
        torch.testing.assert_close(ga, 2.0 - si)
        torch.testing.assert_close(gb, 5.0 - si)
