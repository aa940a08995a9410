"""``softmax(scores) @ v`` written by hand (``einsum``/``matmul`` + ``softmax``, as
AlphaFold/boltz code writes pair-biased and triangle attention): the contraction that sums
the softmax dim differentiates from the softmax's input in its padded buckets
(padless.ops.pairs.bucketed._SoftmaxContract). Every case is checked sample by sample
against the dense computation on each sample alone, values and gradients, and the fused
node is checked to have run (or not, where it must not)."""

import pytest
import torch

import padless
from padless.ops.common import content
from padless.ops.kernels import softmax as ks
from padless.ops.pairs import attend, attend_direct, bucketed
from padless.tensor.autograd import nested_from_values
from padless.testing import check_samples, leaves

NS = [3, 5, 0, 1, 6, 2]


@pytest.fixture
def fused_calls(monkeypatch):
    """The softmax operand's position, each time a fused node's forward ran: the one from the
    softmax's input (``_SoftmaxContract``) or the whole attention from pending scores
    (``attend.Attention``)."""
    calls = []
    real = bucketed._SoftmaxContract.forward
    real_att = attend.Attention.forward

    def counting(ctx, *args):
        calls.append(args[1])
        return real(ctx, *args)

    def counting_att(ctx, spec, *args):
        calls.append(spec.j)
        return real_att(ctx, spec, *args)

    monkeypatch.setattr(bucketed._SoftmaxContract, "forward", staticmethod(counting))
    monkeypatch.setattr(attend.Attention, "forward", staticmethod(counting_att))
    return calls


def _pair_bias(q, k, v, z, mask=None):
    """boltz's AttentionPairBias core on NestedTensors (batch dim first)."""
    a = torch.einsum("bihd,bjhd->bhij", q, k) / 3 ** 0.5 + z.permute(0, 3, 1, 2)
    if mask is not None:
        a = a + (1 - mask[:, None, None]) * -1e6
    return torch.einsum("bhij,bjhd->bihd", a.softmax(dim=-1), v)


def _pair_bias_ref(q, k, v, z, mask=None):
    a = torch.einsum("ihd,jhd->hij", q, k) / 3 ** 0.5 + z.permute(2, 0, 1)
    if mask is not None:
        a = a + (1 - mask[None, None]) * -1e6
    return torch.einsum("hij,jhd->ihd", a.softmax(dim=-1), v)


@pytest.mark.parametrize("ns", [NS, [4], [1], [0, 0, 2], [1, 1, 1]],
                         ids=["ragged", "one_sample", "size_one", "empties", "all_size_one"])
def test_pair_bias_attention_per_sample(ns, fused_calls):
    q = leaves([(n, 2, 3) for n in ns], seed=1)
    k = leaves([(n, 2, 3) for n in ns], seed=2)
    v = leaves([(n, 2, 3) for n in ns], seed=3)
    z = leaves([(n, n, 2) for n in ns], seed=4, ragged=(0, 1))
    check_samples(_pair_bias, _pair_bias_ref, [q, k, v, z])
    assert fused_calls == [0]  # the attention operand is the first


def test_pair_bias_attention_with_mask(fused_calls):
    """The key mask term of boltz (``(1 - mask[:, None, None]) * -inf``), a NestedTensor of ones."""
    q = leaves([(n, 2, 3) for n in NS], seed=5)
    k = leaves([(n, 2, 3) for n in NS], seed=6)
    v = leaves([(n, 2, 3) for n in NS], seed=7)
    z = leaves([(n, n, 2) for n in NS], seed=8, ragged=(0, 1))
    mask = padless.from_list([torch.ones(n) for n in NS])
    check_samples(lambda *t: _pair_bias(*t, mask), lambda *t: _pair_bias_ref(*t, torch.ones(t[0].shape[0])),
                  [q, k, v, z])
    assert len(fused_calls) == 1


def test_values_on_the_left(fused_calls):
    """``einsum("bjhd,bhij->bihd", v, attn)``: the softmax operand second."""
    q = leaves([(n, 2, 3) for n in NS], seed=9)
    k = leaves([(n, 2, 3) for n in NS], seed=10)
    v = leaves([(n, 2, 3) for n in NS], seed=11)

    def fn(a, b, c):
        return torch.einsum("bjhd,bhij->bihd", c, torch.einsum("bihd,bjhd->bhij", a, b).softmax(-1))

    def ref(a, b, c):
        return torch.einsum("jhd,hij->ihd", c, torch.einsum("ihd,jhd->hij", a, b).softmax(-1))

    check_samples(fn, ref, [q, k, v])
    assert fused_calls == [1]


@pytest.mark.parametrize("ns", [NS, [4]], ids=["ragged", "one_sample"])
def test_triangle_attention_matmuls(ns, fused_calls):
    """Triangle-attention layout ``(N, H, N, C) @ (N, H, C, N)``, a bias added in place as
    boltz does, softmax, ``@ (N, H, N, C)``; small samples, so the softmax runs in buckets."""
    q = leaves([(n, 2, n, 3) for n in ns], seed=12, ragged=(0, 2))
    k = leaves([(n, 2, 3, n) for n in ns], seed=13, ragged=(0, 3))
    v = leaves([(n, 2, n, 3) for n in ns], seed=14, ragged=(0, 2))
    def fn(a, b, c):
        s = torch.matmul(a, b)
        s *= 0.5  # in place, as boltz adds its biases
        return torch.matmul(s.softmax(-1), c)

    check_samples(fn, fn, [q, k, v])
    assert fused_calls == [0]


def test_softmax_output_used_twice(fused_calls):
    """The attention weights also feed the result elsewhere: their own gradient still flows
    (the softmax's backward runs for that use, the fused node's for the contraction)."""
    q = leaves([(n, 2, 3) for n in NS], seed=15)
    k = leaves([(n, 2, 3) for n in NS], seed=16)
    v = leaves([(n, 2, 3) for n in NS], seed=17)

    def fn(a, b, c):
        p = torch.einsum("bihd,bjhd->bhij", a, b).softmax(-1)
        return torch.einsum("bhij,bjhd->bihd", p, c) + torch.einsum("bhij,bjhd->bihd", p * p, c)

    def ref(a, b, c):
        p = torch.einsum("ihd,jhd->hij", a, b).softmax(-1)
        return torch.einsum("hij,jhd->ihd", p, c) + torch.einsum("hij,jhd->ihd", p * p, c)

    check_samples(fn, ref, [q, k, v])
    assert fused_calls == [0]


def test_inference_fuses_per_sample(fused_calls):
    """Without a gradient the pending scores still run as one node in the buckets; each
    sample matches the dense computation on it alone."""
    q = leaves([(n, 2, 3) for n in NS], seed=18)
    k = leaves([(n, 2, 3) for n in NS], seed=19)
    with torch.no_grad():
        out = torch.einsum("bhij,bjhd->bihd", (torch.einsum("bihd,bjhd->bhij", q[0], k[0]) * 0.3).softmax(-1), k[0])
    assert fused_calls == [0]
    assert len(out.unbind()) == len(NS)
    for got, a, b in zip(out.unbind(), q[1], k[1]):
        ref = torch.einsum("hij,jhd->ihd", (torch.einsum("ihd,jhd->hij", a, b) * 0.3).softmax(-1), b)
        torch.testing.assert_close(got, ref.detach())


def test_no_fusion_when_summing_another_dim(fused_calls):
    """A contraction that does not sum the softmax dim (``p^T @ v``) uses the plain one."""
    q = leaves([(n, 2, 3) for n in NS], seed=18)
    k = leaves([(n, 2, 3) for n in NS], seed=19)
    check_samples(lambda a, b: torch.einsum("bhij,bihd->bjhd", torch.einsum("bihd,bjhd->bhij", a, b).softmax(-1), a),
                  lambda a, b: torch.einsum("hij,ihd->jhd", torch.einsum("ihd,jhd->hij", a, b).softmax(-1), a),
                  [q, k])
    assert fused_calls == []


def test_changed_softmax_output_is_not_fused():
    """An in-place change of the softmax's output drops its mark."""
    x = torch.randn(5, 2, requires_grad=True)
    runs = [(0, 4, 2), (4, 5, 1)]
    plan = ks._runs_plan(runs, 5, (2,), torch.device("cpu"))
    cache = {("bucketed_runs", x.device, (2,)): plan}
    y = ks._bucketed_runs(x, runs, cache, log=False)
    assert ks.softmax_source(y)[0] is x
    y.mul_(2.0)
    assert ks.softmax_source(y) is None
    assert ks.softmax_source(ks._bucketed_runs(x, runs, cache, log=True)) is None


def test_fused_node_gradients_twice():
    """The fused node's backward is differentiable (double backward), float64."""
    ns = (2, 0, 3, 1)
    g = torch.Generator().manual_seed(0)
    q = padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64, generator=g) for n in ns])
    k = padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64, generator=g) for n in ns])
    v = padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64, generator=g) for n in ns])
    s = torch.einsum("bihd,bjhd->bhij", q, k)  # the scores' structure
    xv = s.values().clone().requires_grad_()
    vv = v.values().clone().requires_grad_()

    def fn(x, w):
        a = nested_from_values(x, s._offsets, s._sizes, s._ragged, s._env, s._meta)
        b = nested_from_values(w, v._offsets, v._sizes, v._ragged, v._env, v._meta)
        return torch.einsum("bhij,bjhd->bihd", a.softmax(-1), b).values()

    calls = []
    real = bucketed._SoftmaxContract.forward
    bucketed._SoftmaxContract.forward = staticmethod(lambda ctx, *a: calls.append(1) or real(ctx, *a))
    try:
        torch.autograd.gradcheck(fn, (xv, vv))
        torch.autograd.gradgradcheck(fn, (xv, vv))
    finally:
        bucketed._SoftmaxContract.forward = staticmethod(real)
    assert calls


def test_bf16_autocast_per_sample():
    """Under CPU bf16 autocast (the fused node steps aside: autocast's casts sit between the
    softmax and the contraction), each sample matches the dense op under the same autocast."""
    ns = [5, 9, 3]
    qs = [torch.randn(n, 2, 8) for n in ns]
    zs = [torch.randn(n, n, 2) for n in ns]
    q = padless.from_list([t.clone() for t in qs]).requires_grad_()
    z = padless.from_list([t.clone() for t in zs], ragged_dims=(0, 1)).requires_grad_()
    lin = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        def fn(a, b):
            h = lin(a)
            s = torch.einsum("bihd,bjhd->bhij", h, h).float() + b.permute(0, 3, 1, 2)
            return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), h)

        def ref(a, b):
            h = lin(a)
            s = torch.einsum("ihd,jhd->hij", h, h).float() + b.permute(2, 0, 1)
            return torch.einsum("hij,jhd->ihd", s.softmax(-1), h)

        out = fn(q, z)
        refs = [ref(a, b) for a, b in zip(qs, zs)]
    out.values().float().sum().backward()
    assert torch.isfinite(q.grad.values()).all() and torch.isfinite(z.grad.values()).all()
    for got, r in zip(out.unbind(), refs):
        assert got.dtype == r.dtype
        torch.testing.assert_close(got.float(), r.float().detach(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("ns", [NS, [4], [0, 0, 2]], ids=["ragged", "one_sample", "empties"])
def test_pair_bias_read_by_rows(ns, monkeypatch):
    """boltz's bias (a linear of the pair state to the heads, ``(N_i, N_i, H)`` rows, read as
    ``(H, N_i, N_i)``) enters the fused node by rows: the scores' element maps (``H`` times longer)
    are never built, the row maps are; values and the gradients of q, k, v, z and the linear's
    weight match each sample alone."""
    plans = []
    real = attend.Attention.forward

    def spy(ctx, spec, *args):
        plans.append(spec.p1)
        return real(ctx, spec, *args)

    monkeypatch.setattr(attend.Attention, "forward", staticmethod(spy))
    q = leaves([(n, 3, 2) for n in ns], seed=11)
    k = leaves([(n, 3, 2) for n in ns], seed=12)
    v = leaves([(n, 3, 2) for n in ns], seed=13)
    z = leaves([(n, n, 4) for n in ns], seed=14, ragged=(0, 1))
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(15)).requires_grad_()
    mask = padless.from_list([torch.ones(n) for n in ns])

    def fn(q, k, v, z):
        return _pair_bias(q, k, v, torch.nn.functional.linear(z, w), mask)

    def ref(q, k, v, z):
        return _pair_bias_ref(q, k, v, torch.nn.functional.linear(z, w), torch.ones(q.shape[0]))

    out = fn(*[nt for nt, _ in (q, k, v, z)])
    out.values().pow(2).sum().backward()
    gw = w.grad.clone()
    w.grad = None
    for i in range(len(ns)):
        ref(*[d[i] for _, d in (q, k, v, z)]).pow(2).sum().backward()
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-5)
    for t in (q, k, v, z):
        t[0].grad = None
        for d in t[1]:
            d.grad = None
    check_samples(fn, ref, [q, k, v, z])
    assert plans and all(p.rows is not None for p in plans)
    assert all(p.rows._maps is not None and p.packs._maps is None for p in plans)


def test_pair_bias_by_rows_gradients_twice():
    """The fused node with a full-size bias read by rows, differentiated twice (float64)."""
    ns = (2, 0, 3, 1)
    g = torch.Generator().manual_seed(3)
    qv, kv, vv = (padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64, generator=g) for n in ns])
                  for _ in range(3))
    z = padless.from_list([torch.randn(n, n, 2, dtype=torch.float64, generator=g) for n in ns], ragged_dims=(0, 1))
    leaves_ = [t.values().clone().requires_grad_() for t in (qv, kv, vv, z)]

    def fn(q, k, v, b):
        qs, ks, vs, zs = (nested_from_values(x, t._offsets, t._sizes, t._ragged, t._env, t._meta)
                          for x, t in zip((q, k, v, b), (qv, kv, vv, z)))
        return _pair_bias(qs, ks, vs, zs).values()

    torch.autograd.gradcheck(fn, leaves_)
    torch.autograd.gradgradcheck(fn, leaves_)


@pytest.fixture
def direct_reads(monkeypatch):
    """Every operand the fused node read straight into its matmul layout (``attend_direct``):
    whether it was read as a transpose (``k`` of ``q @ k^T``)."""
    reads = []
    real = attend_direct.Direct.read

    def spy(self, values):
        reads.append(self.trans)
        return real(self, values)

    monkeypatch.setattr(attend_direct.Direct, "read", spy)
    return reads


@pytest.mark.parametrize("ns", [NS, [4], [0, 0, 2], [0]], ids=["ragged", "one_sample", "empties", "one_empty"])
def test_operands_read_into_matmul_layout(ns, direct_reads):
    """q, k, v (v of another width) and the result's gradient read by units straight into the
    buckets' ``(count * H, L, D)`` operands, the gradients written back by one map each: values
    and gradients of q, k, v, the bias and the mask's source match each sample alone, and match
    the gather-and-copy path exactly."""
    q = leaves([(n, 3, 4) for n in ns], seed=21)
    k = leaves([(n, 3, 4) for n in ns], seed=22)
    v = leaves([(n, 3, 2) for n in ns], seed=23)
    z = leaves([(n, n, 3) for n in ns], seed=24, ragged=(0, 1))
    m = leaves([(n,) for n in ns], seed=25)

    def fn(q, k, v, z, m):
        a = torch.einsum("bihd,bjhd->bhij", q, k) / 2 + z.permute(0, 3, 1, 2)
        a = a + (1 - m.sigmoid()[:, None, None]) * -3
        return torch.einsum("bhij,bjhd->bihd", a.softmax(dim=-1), v)

    def ref(q, k, v, z, m):
        a = torch.einsum("ihd,jhd->hij", q, k) / 2 + z.permute(2, 0, 1)
        a = a + (1 - m.sigmoid()[None, None]) * -3
        return torch.einsum("hij,jhd->ihd", a.softmax(dim=-1), v)

    check_samples(fn, ref, [q, k, v, z, m])
    if sum(ns):
        assert sorted(set(direct_reads)) == [False, True]  # q and v as they are, k transposed
    got = []
    for on in (True, False):
        attend_direct.ENABLED = on
        try:
            xs = [nt.detach().requires_grad_() for nt, _ in (q, k, v, z, m)]
            out = fn(*xs)
            out.values().pow(2).sum().backward()
            got.append([out.values(), *[x.grad.values() for x in xs]])
        finally:
            attend_direct.ENABLED = True
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_operands_read_into_matmul_layout_gradcheck(direct_reads):
    """The fused node reading its operands by units, differentiated once and twice (float64)."""
    ns = (2, 0, 3, 1)
    g = torch.Generator().manual_seed(5)
    qv, kv = (padless.from_list([torch.randn(n, 2, 3, dtype=torch.float64, generator=g) for n in ns]) for _ in range(2))
    vv = padless.from_list([torch.randn(n, 2, 1, dtype=torch.float64, generator=g) for n in ns])
    z = padless.from_list([torch.randn(n, n, 2, dtype=torch.float64, generator=g) for n in ns], ragged_dims=(0, 1))
    leaves_ = [t.values().clone().requires_grad_() for t in (qv, kv, vv, z)]

    def fn(q, k, v, b):
        qs, ks, vs, zs = (nested_from_values(x, t._offsets, t._sizes, t._ragged, t._env, t._meta)
                          for x, t in zip((q, k, v, b), (qv, kv, vv, z)))
        a = torch.einsum("bihd,bjhd->bhij", qs, ks) * 0.7 + zs.permute(0, 3, 1, 2)
        return torch.einsum("bhij,bjhd->bihd", a.softmax(dim=-1), vs).values()

    torch.autograd.gradcheck(fn, leaves_)
    assert direct_reads
    torch.autograd.gradgradcheck(fn, leaves_)


def test_unit_maps_shared_by_content(monkeypatch):
    """A new batch of lengths seen before (new objects) builds no unit maps: they are cached by
    content; q, k, v and the result of one batch share one build."""
    builds = []
    real = attend_direct._unit_maps

    def counting(*args):
        builds.append(args[3])
        return real(*args)

    monkeypatch.setattr(attend_direct, "_unit_maps", counting)
    content.clear()
    ns = [7, 2, 0, 5]
    for seed in (31, 41):
        q, k, v = (leaves([(n, 2, 3) for n in ns], seed=seed + j)[0] for j in range(3))
        z = leaves([(n, n, 2) for n in ns], seed=seed + 3, ragged=(0, 1))[0]
        _pair_bias(q, k, v, z).values().sum().backward()
        assert len(builds) == 1
