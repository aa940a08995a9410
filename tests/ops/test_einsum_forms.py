"""einsum as real code writes it: an ellipsis (einops' form) and dense operands, per sample."""

import pytest
import torch

import padless
from padless.testing import check_samples, leaves

NS = [3, 0, 5, 1]


def _dense(shape, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _check(eq, sample_eq, nested_shapes, dense=(), per_sample=(), ns=NS):
    """``eq`` on NestedTensors (``nested_shapes(n)`` per input) and dense operands against
    ``sample_eq`` on each sample alone; ``per_sample`` marks dense operands whose first dim
    is the batch (the reference takes slice i). Forward, input and dense-operand gradients."""
    inputs = [leaves([shape(n) for n in ns], seed=10 + i, dtype=torch.float64) for i, shape in enumerate(nested_shapes)]
    mine = [d.clone().requires_grad_() for d in dense]
    ref = [d.clone().requires_grad_() for d in dense]

    def ref_fn_for(i):
        return [r[i] if j in per_sample else r for j, r in enumerate(ref)]

    calls = iter(range(len(ns)))
    check_samples(
        lambda *nts: torch.einsum(eq, *nts, *mine),
        lambda *xs: torch.einsum(sample_eq, *xs, *ref_fn_for(next(calls))),
        inputs,
    )
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_pair_states_with_ellipsis():
    _check("... i k d, ... j k d -> ... i j d", "ikd,jkd->ijd", [lambda n: (n, n, 4)] * 2)


def test_tokens_with_ellipsis():
    _check("... i d, ... j d -> ... i j", "id,jd->ij", [lambda n: (n, 4)] * 2)


def test_batch_then_ellipsis_reduction():
    _check("b ... d -> b ...", "id->i", [lambda n: (n, 4)])
    _check("b ... -> b", "...->", [lambda n: (n, 4)])


def test_ellipsis_in_the_middle_and_transposed_output():
    _check("b i ... d, b j ... d -> b ... i j", "ihd,jhd->hij", [lambda n: (n, 2, 4)] * 2)


def test_dense_weight():
    _check("... i d, d e -> ... i e", "id,de->ie", [lambda n: (n, 4)], [_dense((4, 6))])
    _check("b l d, d e -> b e l", "ld,de->el", [lambda n: (n, 4)], [_dense((4, 6))])


def test_dense_operand_with_its_own_ellipsis():
    # (H, d) under "..." aligns right with the NestedTensor's (B, L, H): it is the H letter
    _check("... d, ... d -> ... d", "lhd,hd->lhd", [lambda n: (n, 2, 4)], [_dense((2, 4))])
    # (B, d): one row per sample (its ellipsis is the batch)
    _check("... l d, ... d -> ... l", "ld,d->l", [lambda n: (n, 4)], [_dense((len(NS), 4))], per_sample={0})


def test_ellipsis_broadcast_of_different_lengths():
    # a dense extent of 1 broadcasts against H (einsum's ellipsis rule); a shorter ellipsis aligns right
    _check("... h d, ... h d -> ... h", "lhd,hd->lh", [lambda n: (n, 2, 4)], [_dense((1, 4))])
    _check("... h d, ... d -> ... h", "lhd,d->lh", [lambda n: (n, 2, 4)], [_dense((4,))])
    # extents of 1 over the ragged and the static letter both broadcast (one after the other)
    _check("... d, ... d -> ... d", "...d,...d->...d", [lambda n: (n, 2, 4)], [_dense((1, 1, 4))])
    _check("... d, ... d -> ... d", "...d,...d->...d", [lambda n: (n, 2, 4)], [_dense((1, 2, 4))])


def test_dense_operand_summing_a_ragged_dim():
    _check("b l d, d -> b", "ld,d->", [lambda n: (n, 4)], [_dense((4,))])
    _check("b l h d, h d -> b h", "lhd,hd->h", [lambda n: (n, 2, 4)], [_dense((2, 4))])


def test_one_sample_batch():
    _check("... i d, ... j d -> ... i j", "id,jd->ij", [lambda n: (n, 4)] * 2, ns=[4])
    _check("... i d, d e -> ... i e", "id,de->ie", [lambda n: (n, 4)], [_dense((4, 3))], ns=[2])


def test_sublist_format():
    x = padless.from_list([torch.randn(n, 4) for n in (3, 5)])
    w = torch.randn(4, 6)
    out = torch.einsum(x, [..., 1, 2], x, [..., 3, 2], [..., 1, 3])
    for i in range(2):
        torch.testing.assert_close(out[i], torch.einsum("id,jd->ij", x[i], x[i]))
    out = torch.einsum(x, [0, 1, 2], w, [2, 3], [0, 1, 3])
    for i in range(2):
        torch.testing.assert_close(out[i], x[i] @ w)


def test_refusals():
    x = padless.from_list([torch.randn(2, 3), torch.randn(4, 3)])
    with pytest.raises(padless.StructureError, match=r"dense operand 1 \('il'\) indexes 'i', a ragged dim"):
        torch.einsum("bid,il->bld", x, torch.randn(4, 5))
    with pytest.raises(TypeError, match=r"dense operands are taken beside exactly one NestedTensor operand \(got 2\)"):
        torch.einsum("bic,bjc,cd->bijd", x, x, torch.randn(3, 2))
    with pytest.raises(padless.StructureError, match=r"extent 3 at the batch index 'b', the batch holds 2"):
        torch.einsum("bic,bc->bi", x, torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"give the output explicitly"):
        torch.einsum("...ic,...jc", x, x)
    with pytest.raises(padless.StructureError, match=r"operand 0 \('...ijkc'\) names 4 dims but has 3"):
        torch.einsum("...ijkc->...ijkc", x)
    with pytest.raises(ValueError, match=r"output must start with the batch index 'b'"):
        torch.einsum("bic,cd->ibd", x, torch.randn(3, 2))


def test_einops_patterns():
    einops = pytest.importorskip("einops")
    x = padless.from_list([torch.randn(n, 6) for n in (3, 5)])
    y = einops.einsum(x, x, "... i d, ... j d -> ... i j")
    for i in range(2):
        torch.testing.assert_close(y[i], x[i] @ x[i].T)
    r = einops.rearrange(x, "b l (h d) -> b l h d", h=2)
    assert [tuple(s.shape) for s in r.unbind()] == [(3, 2, 3), (5, 2, 3)]
    m = einops.reduce(x, "b l d -> b d", "mean")
    for i in range(2):
        torch.testing.assert_close(m[i], x[i].mean(0))
