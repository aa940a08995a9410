"""Pair-biased single attention (AlphaFold3 / boltz ``AttentionPairBias``, written with
``einsum`` + softmax as those codebases write it) on NestedTensors: every sample equals the
module run on that sample alone, values and gradients (inputs and parameters)."""

import pytest
import torch
from torch import nn

import padless


class PairBiasAttention(nn.Module):
    """boltz 2.2.1's ``AttentionPairBias`` (v2) forward, unchanged in substance."""

    def __init__(self, c_s: int = 8, c_z: int = 6, heads: int = 2, inf: float = 1e6) -> None:
        super().__init__()
        self.h, self.d, self.inf = heads, c_s // heads, inf
        self.proj_q = nn.Linear(c_s, c_s)
        self.proj_k = nn.Linear(c_s, c_s, bias=False)
        self.proj_v = nn.Linear(c_s, c_s, bias=False)
        self.proj_g = nn.Linear(c_s, c_s, bias=False)
        self.norm_z, self.proj_z = nn.LayerNorm(c_z), nn.Linear(c_z, heads, bias=False)
        self.proj_o = nn.Linear(c_s, c_s, bias=False)

    def forward(self, s, z, mask, k_in):
        b = s.shape[0]
        q = self.proj_q(s).view(b, -1, self.h, self.d)
        k = self.proj_k(k_in).view(b, -1, self.h, self.d)
        v = self.proj_v(k_in).view(b, -1, self.h, self.d)
        bias = self.proj_z(self.norm_z(z)).permute(0, 3, 1, 2)
        g = self.proj_g(s).sigmoid()
        attn = torch.einsum("bihd,bjhd->bhij", q.float(), k.float())
        attn = attn / (self.d ** 0.5) + bias.float()
        attn = attn + (1 - mask[:, None, None].float()) * -self.inf
        attn = attn.softmax(dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", attn, v.float()).to(v.dtype)
        return self.proj_o(g * o.reshape(b, -1, self.h * self.d))


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("ns", [[3, 7, 1, 5, 4, 6], [5], [2, 0, 4]], ids=["ragged", "one_sample", "empty_sample"])
def test_samples_and_gradients(ns):
    torch.manual_seed(0)
    att = PairBiasAttention()
    ss = [torch.randn(n, 8, dtype=torch.float64) for n in ns]
    zs = [torch.randn(n, n, 6, dtype=torch.float64) for n in ns]
    att = att.double()
    s = padless.from_list(ss, requires_grad=True)
    z = padless.from_list(zs, ragged_dims=(0, 1), requires_grad=True)
    mask = padless.from_list([torch.ones(n, dtype=torch.float64) for n in ns])
    out = att(s, z, mask, s)
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(n, 8, generator=g, dtype=torch.float64) for n in ns]
    out.backward(padless.from_list(cot))
    got = _grads(att)
    att.zero_grad()
    for i, n in enumerate(ns):
        si = ss[i][None].clone().requires_grad_()
        zi = zs[i][None].clone().requires_grad_()
        ref = att(si, zi, torch.ones(1, n, dtype=torch.float64), si)
        torch.testing.assert_close(out.unbind()[i], ref[0])
        ref.backward(cot[i][None])
        torch.testing.assert_close(s.grad.unbind()[i], si.grad[0])
        torch.testing.assert_close(z.grad.unbind()[i], zi.grad[0])
    for a, b in zip(got, _grads(att)):
        torch.testing.assert_close(a, b)


def test_dense_padded_mask_reads_like_ones():
    """The padded batch's dense mask (ones on real positions) gives the same result."""
    torch.manual_seed(0)
    att = PairBiasAttention().double()
    ns = [3, 6, 2]
    ss = [torch.randn(n, 8, dtype=torch.float64) for n in ns]
    zs = [torch.randn(n, n, 6, dtype=torch.float64) for n in ns]
    s, z = padless.from_list(ss), padless.from_list(zs, ragged_dims=(0, 1))
    ones = padless.from_list([torch.ones(n, dtype=torch.float64) for n in ns])
    dense = torch.stack([torch.nn.functional.pad(torch.ones(n, dtype=torch.float64), (0, 6 - n)) for n in ns])
    a, b = att(s, z, ones, s), att(s, z, dense, s)
    for x, y in zip(a.unbind(), b.unbind()):
        torch.testing.assert_close(x, y)
