"""matmul / bmm / einsum on NestedTensors, per sample with gradients."""

import pytest
import torch

import padless
from padless.testing import assert_close_samples, check_op


def _leaves(shapes, seed=0, ragged=None):
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(s, generator=g) .requires_grad_() for s in shapes]
    nt = padless.from_list([d.detach() for d in dense], ragged_dims=ragged, requires_grad=True)
    return nt, dense


def _check(fn, ref, inputs, tol=1e-5):
    out = fn(*[nt for nt, _ in inputs])
    b = len(inputs[0][1])
    refs = [ref(*[dense[i] for _, dense in inputs]) for i in range(b)]
    assert_close_samples(out, refs, atol=tol, rtol=tol)
    cot = [torch.randn_like(r) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims) if isinstance(out, padless.NestedTensor) else torch.stack(cot))
    torch.autograd.backward(refs, cot)
    for nt, dense in inputs:
        assert_close_samples(nt.grad, [d.grad for d in dense], what="gradient", atol=tol, rtol=tol)
    return out


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
    q = _leaves([(n, 4) for n in NS], seed=1)
    k = _leaves([(m, 4) for m in (2, 6, 3, 0)], seed=2)
    out = _check(lambda a, b: a @ b.transpose(-1, -2), lambda a, b: a @ b.transpose(-1, -2), [q, k])
    assert out.ragged_dims == (0, 1)


def test_multihead_scores_and_weighted_values():
    q = _leaves([(2, n, 4) for n in NS], seed=3, ragged=(1,))
    k = _leaves([(2, n, 4) for n in NS], seed=4, ragged=(1,))
    v = _leaves([(2, n, 4) for n in NS], seed=5, ragged=(1,))

    def fn(a, b, c):
        s = torch.softmax(a @ b.transpose(-1, -2), dim=-1)
        return s @ c

    def ref(a, b, c):
        return torch.softmax(a @ b.transpose(-1, -2), dim=-1) @ c

    _check(fn, ref, [q, k, v])


def test_bmm():
    a = _leaves([(n, 3) for n in NS], seed=6)
    b = _leaves([(3, n) for n in NS], seed=7, ragged=(1,))
    _check(lambda x, y: torch.bmm(x, y), lambda x, y: x @ y, [a, b])


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

    inputs = [_leaves([shape(k, n) for n in NS], seed=10 + i) for i, k in enumerate(shapes)]
    sample_eq = eq.replace("b", "")
    _check(lambda *xs: torch.einsum(eq, *xs), lambda *xs: torch.einsum(sample_eq, *xs), inputs, tol=1e-4)


def test_einsum_errors():
    x = padless.from_list([torch.randn(2, 3)])
    with pytest.raises(ValueError, match="first index must be the batch index"):
        torch.einsum("ic,bjc->bij", x, x)
    with pytest.raises(NotImplementedError, match="ellipsis"):
        torch.einsum("b...->b...", x)
    with pytest.raises(TypeError, match="every operand must be a NestedTensor"):
        torch.einsum("bic,cd->bid", x, torch.randn(3, 2))


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
