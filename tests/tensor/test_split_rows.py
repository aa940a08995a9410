"""Per-sample loops take their samples from one split of ``values``: an O(T) backward.

A slice of ``values`` per sample makes autograd allocate a zero gradient of the whole
buffer per sample (O(B x T)); every per-sample path (unbind, the fallback, NT @ NT
contractions, the triangle einsum, attention) must show no ``SliceBackward0`` node, and
its gradients must still equal the dense per-sample ones.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing.reference import graph_nodes
from padless.tensor.autograd import split_rows
from padless.testing import check_samples, leaves


def _graph_nodes(t: torch.Tensor) -> set[str]:
    return {type(fn).__name__ for fn in graph_nodes(t)}


def test_split_rows_views_and_one_concatenation_backward():
    v = torch.arange(5.0, requires_grad=True)
    parts = split_rows(v, [0, 2, 2, 5])
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    assert all(p._base is v for p in parts)
    (parts[0].sum() * 2 + parts[2].sum()).backward()  # the empty sample gets no gradient: zeros
    assert v.grad.tolist() == [2.0, 2.0, 1.0, 1.0, 1.0]
    assert split_rows(v, [0]) == ()


def test_unbind_is_one_split():
    (x, _) = leaves([(n, 3) for n in [2, 0, 4]], 1)
    names = _graph_nodes(torch.stack([s.sum() for s in x.unbind()]))
    assert "SliceBackward0" not in names and "SplitWithSizesBackward0" in names


def test_nested_matmul_backward_has_no_per_sample_slice():
    a = leaves([(n, 4) for n in [3, 0, 2, 5]], 1)
    b = leaves([(4, n) for n in [3, 0, 2, 5]], 2, ragged=(1,))
    out = check_samples(torch.matmul, torch.matmul, [a, b])
    assert "SliceBackward0" not in _graph_nodes(out)


def test_triangle_einsum_backward_has_no_per_sample_slice():
    shapes = [(n, n, 2) for n in [3, 1, 4]]
    a, b = leaves(shapes, 3, ragged=(0, 1)), leaves(shapes, 4, ragged=(0, 1))

    def f(x, y):
        return torch.einsum("bikc,bjkc->bijc", x, y)

    def ref(x, y):
        return torch.einsum("ikc,jkc->ijc", x, y)

    out = check_samples(f, ref, [a, b])
    assert "SliceBackward0" not in _graph_nodes(out)


def test_fallback_backward_has_no_per_sample_slice():
    x = leaves([(n, 3) for n in [2, 0, 4, 1]], 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = check_samples(lambda a: torch.cumprod(a, dim=-1), lambda a: torch.cumprod(a, dim=-1), [x])
    assert "SliceBackward0" not in _graph_nodes(out)


@pytest.mark.parametrize("lens", [[5, 1, 0, 3], [2, 2, 2, 7]])
def test_attention_backward_has_no_per_sample_slice(lens):
    q = leaves([(2, n, 4) for n in lens], 6, ragged=(1,))
    out = check_samples(
        lambda a: F.scaled_dot_product_attention(a, a, a), lambda a: F.scaled_dot_product_attention(a, a, a), [q]
    )
    assert "SliceBackward0" not in _graph_nodes(out)
    assert isinstance(out, padless.NestedTensor)
