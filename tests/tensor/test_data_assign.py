"""``nt.data = other`` (padless.tensor.behaviour.set_data): ``nt`` takes ``other``'s rows (shared,
untracked), as torch does for a dense tensor; what cannot fit a NestedTensor is refused."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.tensor.errors import StructureError


def _batch(scale=1.0, lengths=(2, 0, 3)):
    g = torch.Generator().manual_seed(0)
    return padless.from_list([torch.randn(n, 2, generator=g) * scale for n in lengths])


def test_data_assignment_replaces_the_rows():
    a, b = _batch(), _batch(3.0)
    a.data = b
    for x, y in zip(a.unbind(), b.unbind()):
        torch.testing.assert_close(x, y)
    b.values().add_(1)  # shared, as torch's .data = shares the storage
    torch.testing.assert_close(a.values(), b.values())


def test_data_assignment_of_an_intermediate_drops_its_remembered_rows():
    leaf = _batch().requires_grad_()
    y = leaf * 2  # y remembers the rows it was built from (tensor.autograd)
    y.data = _batch(5.0)
    torch.testing.assert_close(y.cos().values(), _batch(5.0).cos().values())


def test_data_assignment_of_a_view_leaves_its_base_alone():
    x = _batch()
    w = x[:, :1]
    w.data = _batch(7.0, lengths=(1, 0, 1))
    w.zero_()  # no longer a view: the write stays in w
    torch.testing.assert_close(x.values(), _batch().values())


def test_data_assignment_refusals():
    a = _batch()
    with pytest.raises(StructureError, match=r"NestedTensor.data = ...: expected a NestedTensor of the same structure, got Tensor"):
        a.data = torch.zeros(3, 3, 2)
    with pytest.raises(StructureError, match=r"NestedTensor.data =\(\): ragged structures differ"):
        a.data = _batch(lengths=(3, 0, 2))
    with pytest.raises(StructureError, match=r"shape, dtype and device are fixed.*other.to\(nt.dtype\)"):
        a.data = _batch().double()
