"""matmul / bmm / einsum on NestedTensors, per sample with gradients."""

import pytest
import torch

import padless
from padless.testing import check_op, check_samples, leaves


NS = [3, 5, 0, 1]


@pytest.mark.parametrize("v", ["seq", "empty_sample", "pair", "channels_first", "one_sample"])
def test_matmul_dense_weight(v):
    torch.manual_seed(0)
    from padless.testing import make_batch

    nt, _ = make_batch(v)
    w = torch.randn(nt.shape[-1], 3)
    if v == "channels_first":
        with pytest.raises(ValueError, match=r"matmul\(\): the contracted dim \(last of the NestedTensor\) is ragged"):
            nt @ w
        m = torch.randn(5, nt.shape[1])
        check_op(lambda x: m @ x, v)  # dense @ (C, L_i): contracts the static C
        return
    check_op(lambda x: x @ w, v)
    check_op(lambda x: torch.matmul(x, w[:, 0]), v)


def test_scores_q_k_transpose():
    q = leaves([(n, 4) for n in NS], seed=1)
    k = leaves([(m, 4) for m in (2, 6, 3, 0)], seed=2)
    out = check_samples(lambda a, b: a @ b.transpose(-1, -2), lambda a, b: a @ b.transpose(-1, -2), [q, k])
    assert out.ragged_dims == (0, 1)


def test_multihead_scores_and_weighted_values():
    q = leaves([(2, n, 4) for n in NS], seed=3, ragged=(1,))
    k = leaves([(2, n, 4) for n in NS], seed=4, ragged=(1,))
    v = leaves([(2, n, 4) for n in NS], seed=5, ragged=(1,))

    def fn(a, b, c):
        s = torch.softmax(a @ b.transpose(-1, -2), dim=-1)
        return s @ c

    def ref(a, b, c):
        return torch.softmax(a @ b.transpose(-1, -2), dim=-1) @ c

    check_samples(fn, ref, [q, k, v])


def test_bmm():
    a = leaves([(n, 3) for n in NS], seed=6)
    b = leaves([(3, n) for n in NS], seed=7, ragged=(1,))
    check_samples(lambda x, y: torch.bmm(x, y), lambda x, y: x @ y, [a, b])


@pytest.mark.parametrize(
    "eq,shapes",
    [
        ("bic,bjc->bijc", ("single", "single")),
        ("bijc,bjc->bic", ("pair", "single")),
        ("bikc,bjkc->bijc", ("pair", "pair")),
        ("bkic,bkjc->bijc", ("pair", "pair")),
        ("bij,bjc->bic", ("pair1", "single")),
    ],
)
def test_einsum_pair_patterns(eq, shapes):
    def shape(kind, n):
        return {"single": (n, 3), "pair": (n, n, 3), "pair1": (n, n)}[kind]

    inputs = [leaves([shape(k, n) for n in NS], seed=10 + i) for i, k in enumerate(shapes)]
    sample_eq = eq.replace("b", "")
    check_samples(lambda *xs: torch.einsum(eq, *xs), lambda *xs: torch.einsum(sample_eq, *xs), inputs, atol=1e-4, rtol=1e-4)


def test_einsum_errors():
    x = padless.from_list([torch.randn(2, 3)])
    with pytest.raises(ValueError, match="first index must be the batch index"):
        torch.einsum("ic,bjc->bij", x, x)
    with pytest.raises(TypeError, match="dense operands are taken beside exactly one NestedTensor"):
        torch.einsum("bic,bjc,cd->bijd", x, x, torch.randn(3, 2))


def test_gradcheck_contractions():
    values = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 5])

    def f(v):
        x = padless.from_values(v, offsets)
        s = x @ x.transpose(-1, -2)  # (N_i, N_i)
        p = torch.einsum("bic,bjc->bijc", x, x)
        t = torch.einsum("bikc,bjkc->bijc", p, p)
        return (s.unsqueeze(3) * t).sum(dim=(1, 2))

    assert torch.autograd.gradcheck(f, (values,))


TRIANGLE_EQS = ["bikc,bjkc->bijc", "bkic,bkjc->bijc", "bikc,bjkc->bjic", "bkic,bjkc->bijc", "bikc,bkjc->bjic"]


@pytest.mark.parametrize("eq", TRIANGLE_EQS)
@pytest.mark.parametrize("ns", [(3, 0, 4, 1), (4,)], ids=["with_empty", "one_sample"])
def test_triangle_products_one_node(eq, ns, monkeypatch):
    """Triangle products run as one node whose gradients are the same kind of product
    (channel-major copies, never a bmm on a transposed gradient): per sample, float64, values
    and gradients, and gradients of gradients."""
    from padless.ops.pairs import bucketed, triangle

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 0.0)  # these small products would be bucketed
    ran = []
    real = triangle._PairProduct.apply
    monkeypatch.setattr(triangle._PairProduct, "apply", lambda *a: ran.append(a[3]) or real(*a))
    a = leaves([(n, n, 2) for n in ns], seed=1, ragged=(0, 1), dtype=torch.float64)
    b = leaves([(n, n, 2) for n in ns], seed=2, ragged=(0, 1), dtype=torch.float64)
    sample_eq = eq.replace("b", "")
    check_samples(lambda x, y: torch.einsum(eq, x, y), lambda x, y: torch.einsum(sample_eq, x, y), [a, b],
                  atol=1e-10, rtol=1e-10)
    if len(ns) > 1:  # (one sample runs as a dense einsum on its view)
        assert len(ran) == 1, ran  # one node (its backward runs the gradient products itself)

    structure = a[0]

    def f(va, vb):
        x = padless.from_values(va, sizes=structure._sizes, ragged_dims=(0, 1))
        y = padless.from_values(vb, sizes=structure._sizes, ragged_dims=(0, 1))
        return torch.einsum(eq, x, y).values()

    va = structure.values().detach().clone().requires_grad_()
    vb = b[0].values().detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(f, (va, vb))


# OpenFold writes its triangle multiplications as matmuls of channel-first permuted pair states
OPENFOLD_MATMULS = {
    "outgoing": ((0, 3, 1, 2), (0, 3, 2, 1)),  # a (C, i, k) @ b (C, k, j)
    "incoming": ((0, 3, 2, 1), (0, 3, 1, 2)),  # a (C, i, k) @ b (C, k, j), k the first pair dim
}


@pytest.mark.parametrize("kind", sorted(OPENFOLD_MATMULS))
@pytest.mark.parametrize("ns", [(3, 0, 4, 1), (4,)], ids=["with_empty", "one_sample"])
def test_triangle_products_written_as_matmuls(kind, ns, monkeypatch):
    """``a.permute(0, 3, 1, 2) @ b.permute(0, 3, 2, 1)`` (OpenFold's form) is the same triangle
    product as the einsum and takes the same per-sample node: per sample, float64, values and
    gradients; the result, permuted back, is stored as a plain ``(N_i, N_i, C)`` state."""
    from padless.ops.pairs import bucketed, triangle

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 0.0)  # these small products would be bucketed
    ran = []
    real = triangle._PairProduct.apply
    monkeypatch.setattr(triangle._PairProduct, "apply", lambda *a: ran.append(a[3]) or real(*a))
    pa, pb = OPENFOLD_MATMULS[kind]
    a = leaves([(n, n, 2) for n in ns], seed=3, ragged=(0, 1), dtype=torch.float64)
    b = leaves([(n, n, 2) for n in ns], seed=4, ragged=(0, 1), dtype=torch.float64)

    def nested(x, y):
        out = torch.matmul(x.permute(*pa), y.permute(*pb)).permute(0, 2, 3, 1)
        assert out.storage_order == (0, 1, 2)
        return out

    def dense(x, y):
        return torch.matmul(x.permute(*[d - 1 for d in pa[1:]]), y.permute(*[d - 1 for d in pb[1:]])).permute(1, 2, 0)

    check_samples(nested, dense, [a, b], atol=1e-10, rtol=1e-10)
    assert ran  # the triangle node, not a matmul per sample on views


@pytest.mark.parametrize("eq", ["bikc,bjkc->bijc", "bkic,bkjc->bijc"])
def test_triangle_products_of_transposed_pair_states(eq, monkeypatch):
    """An operand stored transposed (``z.transpose(1, 2)``, as an "ending node" layer sees its
    pair state) is read in its storage order by the same triangle node: per sample, float64,
    values and gradients, with an empty sample."""
    from padless.ops.pairs import bucketed, triangle

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 0.0)
    ran = []
    real = triangle._PairProduct.apply
    monkeypatch.setattr(triangle._PairProduct, "apply", lambda *a: ran.append(a[3]) or real(*a))
    ns = (3, 0, 5, 2)
    a = leaves([(n, n, 2) for n in ns], seed=5, ragged=(0, 1), dtype=torch.float64)
    b = leaves([(n, n, 2) for n in ns], seed=6, ragged=(0, 1), dtype=torch.float64)
    check_samples(lambda x, y: torch.einsum(eq, x.transpose(1, 2), y),
                  lambda x, y: torch.einsum(eq.replace("b", ""), x.transpose(0, 1), y), [a, b], atol=1e-10, rtol=1e-10)
    assert ran


def _top_level_aten_ops(step) -> int:
    """aten ops that Python and autograd dispatch in ``step()`` (not those another aten op calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ev = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


@pytest.mark.parametrize("eq", TRIANGLE_EQS)
def test_triangle_products_per_sample_ops(eq, monkeypatch):
    """The per-sample path costs each sample 11 aten ops over forward and backward: a ``bmm``
    and a ``view`` of its result per product (three products), and five strided views of the
    operands (the backward reuses the forward's; no transposes, no copies per sample)."""
    from padless.ops.pairs import bucketed

    monkeypatch.setattr(bucketed, "SAMPLE_CALL_COST", 0.0)

    def step(ns):
        a = padless.from_list([torch.randn(n, n, 4) for n in ns], ragged_dims=(0, 1), requires_grad=True)
        b = padless.from_list([torch.randn(n, n, 4) for n in ns], ragged_dims=(0, 1), requires_grad=True)
        return lambda: torch.einsum(eq, a, b).values().sum().backward()

    few, many = step([3, 5]), step([3, 5, 4, 6, 2, 7])
    few(), many()  # warm
    assert _top_level_aten_ops(many) - _top_level_aten_ops(few) <= 11 * 4
