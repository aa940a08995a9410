"""bf16 autocast (CPU) over the op families: forward and backward run, each sample's output
has the dtype and (at bf16 tolerance) the values of the dense op on that sample under the
same autocast. Custom autograd nodes must see one dtype in their backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless

torch.manual_seed(0)
IMGS = [(3, 20, 28), (3, 16, 16), (3, 24, 12)]
SEQ = [(5, 32), (9, 32), (1, 32), (7, 32)]
PAIR = [(5, 5, 16), (9, 9, 16), (3, 3, 16)]


def _cases():
    """name -> (sample shapes, ragged dims, padless fn, dense fn on one sample)"""
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8).eval(), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 8, 3, stride=2, padding=1))
    enc = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    lin = nn.Linear(16, 16)
    return {
        "cnn": (IMGS, (1, 2), cnn, lambda s: cnn(s[None])[0]),
        "encoder_layer": (SEQ, (0,), enc, lambda s: enc(s[None])[0]),
        "triangle_product": (PAIR, (0, 1), lambda z: torch.einsum("bikc,bjkc->bijc", lin(z), lin(z)),
                             lambda s: torch.einsum("ikc,jkc->ijc", lin(s), lin(s))),
        "row_attention": (PAIR, (0, 1), lambda z: torch.einsum("bijh,bikh->bhijk", z[..., :4], z[..., 4:8]).softmax(-1),
                          lambda s: torch.einsum("ijh,ikh->hijk", s[..., :4], s[..., 4:8]).softmax(-1)),
        "pair_norm_gelu": (PAIR, (0, 1), lambda z: F.gelu(F.layer_norm(lin(z), (16,))),
                           lambda s: F.gelu(F.layer_norm(lin(s), (16,)))),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_bf16_autocast_per_sample(name):
    shapes, ragged, fn, dense = _cases()[name]
    samples = [torch.randn(*s) for s in shapes]
    x = padless.from_list([s.clone() for s in samples], ragged_dims=ragged).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
        refs = [dense(s) for s in samples]
    out.values().float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.values()).all()
    for got, ref in zip(out.unbind(), refs):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float().detach(), atol=5e-2, rtol=5e-2)
