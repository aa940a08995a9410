"""Contractions and softmax over ragged dims in padded buckets (padless.ops.pairs.bucketed,
the bucketed softmax twin): sample by sample against dense per-sample references, values
and gradients; the bucketing itself; the number of dense calls does not grow with B."""

import pytest
import torch

import padless
from padless.ops.kernels import layout as kl
from padless.testing import check_samples, leaves

NS = [3, 5, 0, 1, 6, 2]
ONE = [4]


def _plans(nt):
    return [plan for _, plan in nt._meta.derived.get("bucketed_plans", {}).values()]  # (weak partners, plan)


@pytest.mark.parametrize("ns", [NS, ONE, [0, 0, 2]], ids=["ragged", "one_sample", "empties"])
def test_pair_bias_scores_and_values(ns):
    """``einsum("bihd,bjhd->bhij")`` then ``einsum("bhij,bjhd->bihd")`` (pair-biased attention)."""
    q = leaves([(n, 2, 3) for n in ns], seed=1)
    k = leaves([(n, 2, 3) for n in ns], seed=2)
    out = check_samples(lambda a, b: torch.einsum("bihd,bjhd->bhij", a, b),
                        lambda a, b: torch.einsum("ihd,jhd->hij", a, b), [q, k])
    assert out.ragged_dims == (1, 2)
    plan = _plans(q[0])[0]
    assert plan is not None and len(plan.buckets) <= kl.MAX_BUCKETS
    a = leaves([(2, n, n) for n in ns], seed=3, ragged=(1, 2))
    v = leaves([(n, 2, 3) for n in ns], seed=4)
    check_samples(lambda x, y: torch.einsum("bhij,bjhd->bihd", x, y),
                  lambda x, y: torch.einsum("hij,jhd->ihd", x, y), [a, v])
    assert _plans(a[0])[0] is not None


def test_bias_from_permuted_pair_state():
    """The bias read from ``z (N, N, H)`` permuted to ``(H, N, N)`` is added to the scores."""
    q = leaves([(n, 2, 3) for n in NS], seed=5)
    k = leaves([(n, 2, 3) for n in NS], seed=6)
    z = leaves([(n, n, 2) for n in NS], seed=7)

    def fn(a, b, c):
        s = torch.einsum("bihd,bjhd->bhij", a, b) / 3 ** 0.5 + c.permute(0, 3, 1, 2)
        return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), b)

    def ref(a, b, c):
        s = torch.einsum("ihd,jhd->hij", a, b) / 3 ** 0.5 + c.permute(2, 0, 1)
        return torch.einsum("hij,jhd->ihd", s.softmax(-1), b)

    check_samples(fn, ref, [q, k, z])


@pytest.mark.parametrize("ns", [NS, ONE], ids=["ragged", "one_sample"])
@pytest.mark.parametrize("h,c", [(2, 3), (4, 4)], ids=["narrow_rows", "wide_rows"])
def test_row_attention_matmuls(ns, h, c):
    """Triangle-attention layout: ``(N, H, N, C) @ (N, H, C, N)``, softmax, ``@ (N, H, N, C)``.
    The transposed key is stored as rows ``(i, k)`` of ``H * C`` features: read element by
    element when they are few, by rows (a permuted view in the bucket) from
    :data:`~padless.ops.pairs.bucketed.ROW_MAP_WIDTH` features on."""
    from padless.ops.pairs.bucketed import ROW_MAP_WIDTH

    q = leaves([(n, h, n, c) for n in ns], seed=8, ragged=(0, 2))
    k = leaves([(n, h, c, n) for n in ns], seed=9, ragged=(0, 3))
    v = leaves([(n, h, n, c) for n in ns], seed=10, ragged=(0, 2))
    check_samples(lambda a, b, x: torch.matmul(torch.matmul(a, b).softmax(-1), x),
                  lambda a, b, x: torch.matmul(torch.matmul(a, b).softmax(-1), x), [q, k, v])
    plans = _plans(q[0])
    assert plans
    assert plans[0].flat[:2] == [False, h * c < ROW_MAP_WIDTH]  # q by rows; k^T by elements or rows


@pytest.mark.parametrize("eq", ["bikc,bjkc->bijc", "bkic,bkjc->bijc"])
def test_triangle_products(eq):
    a = leaves([(n, n, 3) for n in NS], seed=11)
    b = leaves([(n, n, 3) for n in NS], seed=12)
    check_samples(lambda x, y: torch.einsum(eq, x, y), lambda x, y: torch.einsum(eq.replace("b", ""), x, y),
                  [a, b], atol=1e-4, rtol=1e-4)
    assert _plans(a[0])


def test_bmm_and_letters_outside_the_alphabet():
    a = leaves([(n, 3) for n in NS], seed=13)
    b = leaves([(3, n) for n in NS], seed=14, ragged=(1,))
    check_samples(lambda x, y: torch.bmm(x, y), lambda x, y: x @ y, [a, b])
    c = leaves([(n, 3) for n in NS], seed=15)
    d = leaves([(n, 3) for n in NS], seed=16)
    check_samples(lambda x, y: torch.einsum("ZIC,ZJC->ZIJ", x, y), lambda x, y: torch.einsum("IC,JC->IJ", x, y), [c, d])


@pytest.mark.parametrize("index", [[4, 0, 2, 1, 3], [4, 0, 2]], ids=["every_row_placed", "rows_dropped"])
def test_row_gather_gradients(index):
    """Rows placed into a padded buffer and read back: both directions are gathers whose
    backward is the other one (and differentiable again)."""
    x = torch.randn(len(index), 3, dtype=torch.float64, requires_grad=True)
    to_pad, to_packed = kl.padding_maps(torch.tensor(index), 6, "cpu")

    def pad(t):
        return kl.gather_rows(t, to_pad, to_packed, -1.0)

    def pack(t):
        return kl.gather_rows(t, to_packed, to_pad)

    torch.autograd.gradcheck(pad, (x,))
    torch.autograd.gradgradcheck(pad, (x,))
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(pack, (y,))
    torch.autograd.gradgradcheck(pack, (y,))
    p = pad(x)
    assert p[5].tolist() == [-1.0] * 3 and torch.equal(p[4], x[0]) and torch.equal(pack(p), x)


def test_many_samples_few_dense_calls(monkeypatch):
    """The dense contraction (one ``bmm``) runs once per bucket: at most MAX_BUCKETS calls in
    the forward, whatever B."""
    calls = []
    real = torch.bmm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    for b in (4, 32):
        ns = torch.randint(1, 12, (b,), generator=g).tolist()
        q = padless.from_list([torch.randn(n, 2, 3) for n in ns], requires_grad=True)
        k = padless.from_list([torch.randn(n, 2, 3) for n in ns], requires_grad=True)
        calls.clear()
        monkeypatch.setattr(torch, "bmm", counting)
        try:
            s = torch.einsum("bihd,bjhd->bhij", q, k)
            total = s.values().sum()  # scores may be deferred (pairs.pending) until first read
        finally:
            monkeypatch.setattr(torch, "bmm", real)
        total.backward()
        assert 1 <= len(calls) <= kl.MAX_BUCKETS


def test_size_buckets():
    ext = torch.tensor([[2], [9], [3], [8], [0]])
    for overhead in (0.0, 1.0, 5.0, 1e9):
        groups = kl.size_buckets(ext, overhead=overhead)
        assert sorted(i for g in groups for i in g) == list(range(5))
        assert 1 <= len(groups) <= kl.MAX_BUCKETS
    assert len(kl.size_buckets(ext, overhead=1e9)) == 1
    assert kl.size_buckets(ext, overhead=1.0) == [[4], [0, 2], [3, 1]]  # the empty sample costs no work
    assert kl.size_buckets(torch.zeros(0, 1, dtype=torch.int64)) == []
    assert kl.size_buckets(torch.zeros(3, 0, dtype=torch.int64)) == [[0, 1, 2]]
    many = torch.randint(0, 50, (500, 2), generator=torch.Generator().manual_seed(0))
    assert sorted(i for g in kl.size_buckets(many) for i in g) == list(range(500))


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("ns", [NS, ONE, [0, 3, 0]], ids=["ragged", "one_sample", "empties"])
def test_softmax_over_last_ragged_dim(ns, log):
    """Bucketed twin: groups of consecutive rows, static features, empty samples."""
    fn = torch.log_softmax if log else torch.softmax
    x = leaves([(2, n, n) for n in ns], seed=20, ragged=(1, 2))
    check_samples(lambda t: fn(t, -1), lambda t: fn(t, -1), [x])
    y = leaves([(n, 4) for n in ns], seed=21)  # one ragged dim, features static
    check_samples(lambda t: fn(t, 1), lambda t: fn(t, 0), [y])
    w = leaves([(n,) for n in ns], seed=22)  # no static dims
    check_samples(lambda t: fn(t, 1), lambda t: fn(t, 0), [w])


def test_static_dims_broadcast():
    """A static dim of extent 1 in one operand broadcasts against the other's (as in torch)."""
    a = leaves([(n, 1, 3) for n in NS], seed=30)
    b = leaves([(n, 2, 3) for n in NS], seed=31)
    check_samples(lambda x, y: torch.einsum("bihd,bjhd->bhij", x, y), lambda x, y: torch.einsum("ihd,jhd->hij", x, y), [a, b])
    c = leaves([(1, n, 3) for n in NS], seed=32, ragged=(1,))
    d = leaves([(2, 3, n) for n in NS], seed=33, ragged=(2,))
    check_samples(lambda x, y: x @ y, lambda x, y: x @ y, [c, d])


def test_large_samples_take_the_per_sample_paths(monkeypatch):
    """When one dense call per sample is cheap next to the samples' work (large cubic
    products, large softmaxes), the per-sample paths run; results are the same."""
    from padless.ops.kernels import softmax as ks
    from padless.ops.pairs import bucketed

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 0.0)
    monkeypatch.setattr(ks, "BUCKET_LIMIT", 0)
    a = leaves([(n, n, 3) for n in NS], seed=40)
    b = leaves([(n, n, 3) for n in NS], seed=41)
    check_samples(lambda x, y: torch.einsum("bikc,bjkc->bijc", x, y).softmax(2),
                  lambda x, y: torch.einsum("ikc,jkc->ijc", x, y).softmax(1), [a, b], atol=1e-5, rtol=1e-4)
    assert all(p is None for p in _plans(a[0]))  # the bucketed plan declined: the per-sample loop ran


def test_bucket_choice_follows_the_work():
    """Cheap contractions (small quadratic scores) are bucketed; a cubic triangle product of
    large pair states runs per sample."""
    from padless.ops.pairs import bucketed

    small = [padless.from_list([torch.randn(n, 2, 4) for n in (20, 35, 50, 28)]) for _ in range(2)]
    assert bucketed._build(["ihd", "jhd"], "hij", small) is not None
    big = [padless.from_list([torch.randn(n, n, 64) for n in (20, 35, 50, 28)]) for _ in range(2)]
    assert bucketed._build(["ikc", "jkc"], "ijc", big) is None


def test_fused_contraction_gradients_twice():
    """The one-node contraction's backward is differentiable (double backward), float64."""
    from padless.ops.pairs import bucketed

    ns = (2, 0, 3, 1)
    q = padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64) for n in ns])
    k = padless.from_list([torch.randn(n, 2, 2, dtype=torch.float64) for n in ns])
    plan = bucketed._plan(["ihd", "jhd"], "hij", [q, k])
    assert plan is not None and plan.grad_equations is not None
    qv = q.values().clone().requires_grad_()
    kv = k.values().clone().requires_grad_()
    torch.autograd.gradcheck(lambda a, b: bucketed._Contract.apply(plan, a, b), (qv, kv))
    torch.autograd.gradgradcheck(lambda a, b: bucketed._Contract.apply(plan, a, b), (qv, kv))


@pytest.mark.parametrize("log", [False, True])
def test_bucketed_softmax_gradients_twice(log):
    """The one-node bucketed softmax's backward is differentiable (double backward), float64."""
    from padless.ops.kernels import softmax as ks

    runs = [(0, 4, 2), (4, 4, 1), (4, 13, 3), (13, 14, 1)]  # (first row, end row, group size)
    plan = ks._runs_plan(runs, 14, (2,), torch.device("cpu"))
    x = torch.randn(14, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: ks._BucketedSoftmax.apply(t, plan, log), (x,))
    torch.autograd.gradgradcheck(lambda t: ks._BucketedSoftmax.apply(t, plan, log), (x,))


def test_accelerator_price_buckets_large_products_too(monkeypatch):
    """On an accelerator a call per sample is a launch per sample: with its price
    (SAMPLE_CALL_COST_DEVICE, used for non-CPU values) even large cubic products take the
    buckets, so the dense calls do not grow with B; results are the same."""
    from padless.ops.pairs import bucketed

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", bucketed.SAMPLE_CALL_COST_DEVICE)
    ns = [30, 25, 0, 28]
    a = leaves([(n, n, 3) for n in ns], seed=42)
    b = leaves([(n, n, 3) for n in ns], seed=43)
    check_samples(lambda x, y: torch.einsum("bikc,bjkc->bijc", x, y),
                  lambda x, y: torch.einsum("ikc,jkc->ijc", x, y), [a, b], atol=1e-5, rtol=1e-4)
    assert any(p is not None for p in _plans(a[0]))  # the bucketed plan ran


@pytest.mark.parametrize("eq", ["bikc,bjkc->bijc", "bkic,bkjc->bijc"])
def test_one_sample_buckets_multiply_in_one_call(eq, monkeypatch):
    """A bucket of one sample reads a channels-last operand ``(1, I, K, C)`` as ``(C, I, K)``,
    matrices with no dim of unit stride, which torch's CPU ``bmm`` multiplies one matrix at a
    time: it is copied once first, so the aten ops of the step do not grow with the channels
    (per sample, values and gradients)."""
    from padless.ops.pairs import bucketed

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", bucketed.SAMPLE_CALL_COST_DEVICE)
    ns = [4, 16, 40]  # sizes far apart: the largest sample has a bucket of its own

    def step(c, seed):
        a = leaves([(n, n, c) for n in ns], seed=seed, ragged=(0, 1))
        b = leaves([(n, n, c) for n in ns], seed=seed + 1, ragged=(0, 1))
        return a, b, lambda: torch.einsum(eq, a[0], b[0]).values().sum().backward()

    a, b, _ = step(3, 50)
    check_samples(lambda x, y: torch.einsum(eq, x, y), lambda x, y: torch.einsum(eq.replace("b", ""), x, y),
                  [a, b], atol=1e-5, rtol=1e-4)
    assert any(count == 1 for p in _plans(a[0]) if p is not None for count, _ in p.buckets)
    counts = []
    for c in (2, 16):
        run = step(c, 60)[2]
        run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
    assert counts[0] == counts[1], counts


def test_under_autocast_bf16():
    """Under autocast the bucketed contraction runs in bf16 and the bucketed softmax in float32
    (as torch's policy does for the dense ops), forward and backward, per sample against the
    dense ops under the same autocast."""
    ns = [3, 5, 0, 2]
    q = leaves([(n, 2, 4) for n in ns], seed=50)
    k = leaves([(n, 2, 4) for n in ns], seed=51)

    def f(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.einsum("bihd,bjhd->bhij", a, b).softmax(-1).float()

    def ref(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.einsum("ihd,jhd->hij", a, b).softmax(-1).float()

    check_samples(f, ref, [q, k], atol=2e-2, rtol=2e-2)


def test_scores_pay_the_fused_nodes_price_per_bucket(monkeypatch):
    """A contraction whose result's last dim is ragged (attention scores, later one fused node per
    bucket) is split into fewer buckets than a plain contraction of the same work: its price per
    bucket is :data:`~padless.ops.pairs.bucketed.SCORES_CALL_COST`. Values stay exact either way."""
    from padless.ops.pairs import bucketed

    ns = [40, 64, 42, 18, 32, 48, 47, 41]  # pair-biased attention, 8 heads of 16

    def buckets():
        q = leaves([(n, 8, 16) for n in ns], seed=11)
        k = leaves([(n, 8, 16) for n in ns], seed=12)
        check_samples(lambda a, b: torch.einsum("bihd,bjhd->bhij", a, b),
                      lambda a, b: torch.einsum("ihd,jhd->hij", a, b), [q, k])
        return len(_plans(q[0])[0].buckets)

    fused = buckets()
    monkeypatch.setattr(bucketed, "SCORES_CALL_COST", bucketed.CALL_COST)
    plain = buckets()
    assert 1 <= fused < plain


def test_large_element_mapped_samples_stay_per_sample(monkeypatch):
    """Attention weights ``(N, H, N, N)`` of a few samples of thousands of rows each (triangle
    attention) times ``v``: the weights are read into buckets through element maps, which the
    per-sample path does not need (its elementwise terms run on views), so the plan prices them
    (:data:`~padless.ops.pairs.bucketed.ELEMENT_MAP_COST`) and runs per sample; priced at zero,
    the same batch is bucketed. Values and gradients agree either way."""
    from padless.ops.pairs import bucketed

    ns = [18, 22, 17, 17]

    def plan():
        w = leaves([(n, 2, n, n) for n in ns], seed=13, ragged=(0, 2, 3))
        v = leaves([(n, 2, n, 8) for n in ns], seed=14, ragged=(0, 2))
        check_samples(lambda a, b: torch.einsum("zabcd,zabde->zabce", a, b),
                      lambda a, b: torch.einsum("abcd,abde->abce", a, b), [w, v])
        return _plans(w[0])[0]

    assert plan() is None
    monkeypatch.setattr(bucketed, "ELEMENT_MAP_COST", 0.0)
    assert plan() is not None
