"""torch.autograd.gradcheck in float64 for the families without one elsewhere."""

import torch
import torch.nn.functional as F

import padless

OFFSETS = torch.tensor([0, 2, 2, 5])


def _x(v):
    return padless.from_values(v, OFFSETS)


def test_gradcheck_pointwise_and_feature_ops():
    v = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64)

    def f(v):
        x = _x(v)
        return (F.layer_norm(torch.sigmoid(x) * x, (4,)) @ w.T).values()

    assert torch.autograd.gradcheck(f, (v,))


def test_gradcheck_shape_ops():
    v = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def f(v):
        x = _x(v)
        y = torch.cat([x, x * 2], dim=1)  # per-sample concat along the ragged dim
        y = y.narrow(2, 1, 2).reshape(3, -1, 2, 1).squeeze(-1)
        return y.transpose(1, 2).contiguous().values()

    assert torch.autograd.gradcheck(f, (v,))


def test_gradcheck_patchify():
    sizes = torch.tensor([[2, 4, 2], [2, 2, 2]])  # (C, H, W) with ragged H, W
    v = torch.randn(4 * 2 + 2 * 2, 2, dtype=torch.float64, requires_grad=True)

    def f(v):
        imgs = padless.from_values(v, sizes=sizes, ragged_dims=(1, 2))
        return padless.patchify(imgs, 2).values()

    assert torch.autograd.gradcheck(f, (v,))
