"""Reductions over every dim of every variant, sample by sample against the dense op."""

import itertools

import pytest
import torch

import padless
from padless.testing import VARIANTS, check_op, make_batch

REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(dim=d, keepdim=k),
    "mean": lambda x, d, k: x.mean(dim=d, keepdim=k),
    "amax": lambda x, d, k: x.amax(dim=d, keepdim=k),
    "amin": lambda x, d, k: torch.amin(x, dim=d, keepdim=k),
    "prod": lambda x, d, k: x.prod(dim=d[0], keepdim=k) if isinstance(d, tuple) else x.prod(dim=d, keepdim=k),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k),
    "var": lambda x, d, k: x.var(dim=d, keepdim=k),
    "std_biased": lambda x, d, k: x.std(dim=d, keepdim=k, correction=0),
    "norm2": lambda x, d, k: torch.linalg.vector_norm(x, 2, dim=d, keepdim=k),
    "norm1": lambda x, d, k: x.norm(p=1, dim=d, keepdim=k),
    "max_values": lambda x, d, k: x.max(dim=d[0] if isinstance(d, tuple) else d, keepdim=k).values,
}
SINGLE_DIM_ONLY = {"prod", "max_values"}
NAMES = [v for v in sorted(VARIANTS) if v not in ("static_zero",)]


def _dim_choices(v):
    n = VARIANTS[v].sample_dim
    singles = [(d,) for d in range(1, n + 1)]
    pairs = [c for c in itertools.combinations(range(1, n + 1), 2)][:3]
    return singles + pairs


CASES = [
    (op, v, dims, keep)
    for v in NAMES
    for dims in _dim_choices(v)
    for op in REDUCTIONS
    for keep in (False, True)
    if not (op in SINGLE_DIM_ONLY and len(dims) > 1)
    if keep is False or op in ("sum", "mean", "amax", "var")
]


def _ref_raises(fn, v):
    _, dense = make_batch(v)
    try:
        for s in dense:
            fn(s.unsqueeze(0))
    except (RuntimeError, ValueError, IndexError):
        return True
    return False


@pytest.mark.parametrize("op,v,dims,keep", CASES, ids=[f"{o}-{v}-{d}-{k}" for o, v, d, k in CASES])
def test_reduction(op, v, dims, keep):
    d = dims[0] if len(dims) == 1 else dims
    fn = lambda x: REDUCTIONS[op](x, d, keep)  # noqa: E731
    if _ref_raises(fn, v):
        nt, _ = make_batch(v)
        with pytest.raises((ValueError, RuntimeError)):
            fn(nt)
        return
    check_op(fn, v, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("v", ["seq", "pair", "image", "empty_sample", "rect", "heads_pair", "three_ragged"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "cumsum"])
def test_along_dim_ops(op, v):
    n = VARIANTS[v].sample_dim
    for d in range(1, n + 1):
        fn = {
            "softmax": lambda x: torch.softmax(x, dim=d),
            "log_softmax": lambda x: torch.nn.functional.log_softmax(x, dim=d),
            "cumsum": lambda x: x.cumsum(d),
        }[op]
        check_op(fn, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("v", ["seq", "pair", "image", "empty_sample"])
def test_global_reductions(v):
    nt, dense = make_batch(v, requires_grad=True)
    flat = torch.cat([s.reshape(-1) for s in dense])
    torch.testing.assert_close(nt.sum(), flat.sum())
    torch.testing.assert_close(nt.mean(), flat.mean())
    torch.testing.assert_close(nt.amax(), flat.amax())
    torch.testing.assert_close(torch.max(nt), flat.max())
    torch.testing.assert_close(nt.var(), flat.var())
    torch.testing.assert_close(nt.sum(dim=tuple(range(nt.dim()))), flat.sum())
    nt.mean().backward()
    flat.mean().backward()
    for g, s in zip(nt.grad.unbind(), dense):
        torch.testing.assert_close(g, s.grad)


def test_logical_reductions():
    nt, dense = make_batch("pair")
    m = nt > 0
    for d in (1, 2, 3):
        padless.testing.assert_close_samples(m.any(dim=d), [s.gt(0).any(dim=d - 1) for s in dense])
        padless.testing.assert_close_samples(m.all(dim=d), [s.gt(0).all(dim=d - 1) for s in dense])
    e, edense = make_batch("empty_sample")
    padless.testing.assert_close_samples((e > 0).all(dim=1), [s.gt(0).all(dim=0) for s in edense])
    padless.testing.assert_close_samples((e > 0).any(dim=1), [s.gt(0).any(dim=0) for s in edense])


def test_argmax_and_max_indices_are_sample_local():
    nt, dense = make_batch("pair")
    for d in (1, 2, 3):
        padless.testing.assert_close_samples(nt.argmax(dim=d), [s.argmax(dim=d - 1) for s in dense])
        padless.testing.assert_close_samples(nt.min(dim=d).indices, [s.min(dim=d - 1).indices for s in dense])


def test_mean_over_empty_sample_is_nan_like_torch():
    nt, _ = make_batch("empty_sample")
    out = nt.mean(dim=1)
    assert bool(torch.isnan(out[1]).all()) and not bool(torch.isnan(out[0]).any())


def test_reduction_result_rule():
    p, _ = make_batch("pair")
    assert isinstance(p.sum(dim=1), padless.NestedTensor)  # one of two ragged dims: singles
    assert type(p.sum(dim=(1, 2))) is torch.Tensor  # every ragged dim: dense (B, C)
    assert p.sum(dim=3).ragged_dims == (0, 1)  # static dim: structure kept
    assert p.mean(dim=2, keepdim=True).shape == (3, 4, 1, 2)


def test_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"sum\(\): dim 0 is the batch dim of a NestedTensor"):
        nt.sum(dim=0)
    e, _ = make_batch("empty_sample")
    with pytest.raises(ValueError, match=r"amax\(\): sample 1 has extent 0 along reduced dim\(s\) \(1,\)"):
        e.amax(dim=1)
    chw = padless.from_list([torch.randn(3, 4), torch.randn(3, 2)], ragged_dims=(1,))  # stored permuted
    # argmax() without dim, one ragged dim: a flat index into NJT's buffer layout (C, T)
    assert chw.values().T.flatten()[chw.argmax()] == chw.values().max()
    img = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 2)], ragged_dims=(1, 2))
    with pytest.raises(padless.StructureError, match=r"argmax\(\): a flat index over this NestedTensor has no meaning"):
        img.argmax()
    with pytest.raises(RuntimeError, match=r"only defined together with every ragged dim \(1, 2\)"):
        make_batch("pair")[0].sum(dim=(0, 1))
    with pytest.raises(ValueError, match=r"softmax\(\): dim is required"):
        torch.nn.functional.softmax(nt)
    with pytest.raises(IndexError, match=r"mean\(\): dim 3 is out of range"):
        nt.mean(dim=3)


def test_gradcheck_segmented_reductions():
    values = torch.randn(7, 2, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 3, 4, 7])

    def f(v):
        x = padless.from_values(v, offsets)
        return x.logsumexp(dim=1) + x.var(dim=1, correction=0) + (torch.softmax(x, dim=1) * x).sum(dim=1) + x.cumsum(1).amax(1)

    assert torch.autograd.gradcheck(f, (values,))


def test_no_python_loop_over_samples_for_ragged_sum(monkeypatch):
    """The segmented path never unbinds (a loop over samples would)."""
    nt, _ = make_batch("pair")
    import padless.tensor.convert as conv

    monkeypatch.setattr(conv, "unbind_samples", lambda *a, **k: (_ for _ in ()).throw(AssertionError("unbind called")))
    nt.sum(dim=1)
    nt.softmax(dim=2)
    nt.cumsum(dim=1)
