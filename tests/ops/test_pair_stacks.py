"""Pair stacks (issue 21): triangle products as batched matmuls, cached index maps, row
attention over pair states; every result checked per sample against the dense computation,
forward and backward."""

import pytest
import torch

import padless
from padless.testing import check_samples, leaves

NS = [3, 5, 0, 1, 4]


@pytest.mark.parametrize(
    "eq",
    ["bikc,bjkc->bijc", "bkic,bkjc->bijc", "bikc,bjkc->bjic", "bkic,bjkc->bijc", "bikc,bkjc->bijc"],
)
def test_triangle_products(eq):
    inputs = [leaves([(n, n, 3) for n in NS], seed=20 + i) for i in range(2)]
    for _ in range(2):
        check_samples(lambda *xs: torch.einsum(eq, *xs), lambda *xs: torch.einsum(eq.replace("b", ""), *xs),
                      inputs, atol=1e-5, rtol=1e-5)


def test_triangle_product_transposed_layout():
    """A pair state stored transposed (``p.transpose(1, 2)``) still gives the per-sample result."""
    a = leaves([(n, n, 3) for n in NS], seed=3)
    b = leaves([(n, n, 3) for n in NS], seed=4)
    check_samples(lambda x, y: torch.einsum("bikc,bjkc->bijc", x.transpose(1, 2), y),
                  lambda x, y: torch.einsum("ikc,jkc->ijc", x.transpose(0, 1), y), [a, b], atol=1e-5, rtol=1e-5)


def test_triangle_product_gradcheck():
    values = torch.randn(4 + 9, 2, dtype=torch.float64, requires_grad=True)

    def f(v):
        p = padless.from_values(v, torch.tensor([0, 4, 13]), sizes=torch.tensor([[2, 2, 2], [3, 3, 2]]), ragged_dims=(0, 1))
        out = torch.einsum("bkic,bkjc->bijc", p, p) + torch.einsum("bikc,bjkc->bijc", p, p)
        return out.values()

    assert torch.autograd.gradcheck(f, (values,))


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize(
    "shape,dim",
    [(lambda n: (n, n, 3), 2), (lambda n: (n, n, 3), 1), (lambda n: (n, 2, n), 3), (lambda n: (n, 2, n, n), 4)],
)
def test_softmax_over_rows_of_pairs(shape, dim, log):
    """Softmax over the last ragged dim runs one dense softmax per sample (groups are runs of
    consecutive rows); other dims keep the segmented path. Both agree with the dense op."""
    fn = torch.log_softmax if log else torch.softmax
    x = leaves([shape(n) for n in NS if n], seed=5)
    check_samples(lambda t: fn(t, dim), lambda t: fn(t, dim - 1), [x], atol=1e-5, rtol=1e-5)
    y = leaves([shape(n) for n in NS if n], seed=6)
    check_samples(lambda t: fn(t.transpose(1, 2), dim), lambda t: fn(t.transpose(0, 1), dim - 1), [y], atol=1e-5, rtol=1e-5)


def test_repeat_interleave_once_over_the_batch_keeps_the_structure():
    """boltz's ``bias.repeat_interleave(multiplicity, 0)`` with multiplicity 1: no per-sample
    fallback, same structure, gradients per sample."""
    import warnings

    x = leaves([(n, n, 2) for n in NS], seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_samples(lambda t: t.repeat_interleave(1, 0) * 2, lambda t: t * 2, [x])
        y = x[0].repeat_interleave(1, dim=0)
    assert y._meta is x[0]._meta and y.values().data_ptr() != x[0].values().data_ptr()


def _row_attention_step(x, mask):
    """Triangle attention as boltz writes it: ``(B, I, H, J, E)`` queries over rows of a pair state."""
    q = x.unflatten(-1, (2, 3)).transpose(-2, -3)  # (N_i, H, N_i, E)
    bias = x[..., :2].permute(0, 3, 1, 2).unsqueeze(1)  # (1, H, N_i, N_i)
    mb = (1e9 * (mask - 1))[..., :, None, None, :]  # (N_i, 1, 1, N_i)
    a = torch.matmul(q, q.transpose(-1, -2)) + mb + bias
    o = torch.matmul(a.softmax(-1), q).transpose(-2, -3).flatten(-2)
    return o


def test_steady_state_step_does_no_coordinate_arithmetic():
    """The second step on one batch reuses every index map: no remainder / repeat_interleave
    (coordinates from flat row indices), and the results agree per sample with dense."""
    ns = [3, 5, 1, 4]
    x, dense = leaves([(n, n, 6) for n in ns], seed=8)
    mask = padless.from_list([torch.ones(n, n) for n in ns])
    for _ in range(2):  # the second call runs on the cached structures
        check_samples(lambda t: _row_attention_step(t, mask),
                      lambda t: _row_attention_step(t[None], torch.ones(1, *t.shape[:2]))[0], [(x, dense)],
                      atol=1e-5, rtol=1e-5)
    _row_attention_step(x, mask).values().sum().backward()
    with torch.profiler.profile() as prof:
        _row_attention_step(x, mask).values().sum().backward()
    names = {e.name for e in prof.events()}
    assert not names & {"aten::remainder", "aten::repeat_interleave", "aten::clamp_min"}, names
