"""Every op that runs under ``torch.no_grad()`` runs under ``torch.inference_mode()`` with the
same result, for batches built outside the block (the usual serving path: a collated batch, a
model's buffers) and inside it. Inference tensors have no version counter, so nothing on these
paths may read one (caches keyed by version counters skip such tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.core import NestedTensor
from padless.testing.variants import make_batch
from padless.testing.vision import image_batch

torch.manual_seed(0)
_LIN = torch.nn.Linear(4, 6)
_CONV = torch.nn.Conv2d(3, 5, 3, padding=1)
_POS = torch.randn(1, 3, 4)  # a position table of the envelope's extent (padded coordinates)


def _seq():
    return make_batch("empty_sample", seed=1)[0]


def _seq_one():
    return make_batch("one_sample", seed=2)[0]


def _heads():  # (B, H, L_i, D) queries for SDPA
    return make_batch("channels_first", seed=3)[0].unsqueeze(1).expand(-1, 2, -1, -1).transpose(2, 3).contiguous()


def _images():
    return image_batch([(5, 6), (3, 4)], seed=4)[0]


def _collated():
    g = torch.Generator().manual_seed(5)
    samples = [{"x": torch.randn(n, 4, generator=g), "y": torch.tensor(n)} for n in (3, 1, 4)]
    return padless.collate(samples)


def _tokens():  # (L_i, H, D) queries for einsum attention, with an empty sample
    g = torch.Generator().manual_seed(6)
    return padless.from_list([torch.randn(n, 2, 3, generator=g) for n in (3, 0, 4)])


def _pairs():
    return make_batch("pair", seed=7)[0]


def _einsum_attention(q: NestedTensor):
    s = torch.einsum("bihd,bjhd->bhij", q, q * 0.5) * 0.3
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), q + 1)


def _pair_bias_attention(q: NestedTensor):
    z = q.sum(-1).unsqueeze(2) + q.sum(-1).unsqueeze(1)  # (N_i, N_i, H) pair bias
    s = torch.einsum("bihd,bjhd->bhij", q, q) + z.permute(0, 3, 1, 2)
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), q)


def _sdpa(q: NestedTensor):
    return F.scaled_dot_product_attention(q, q * 0.5, q + 1)


OPS = {
    "pointwise": (_seq, lambda x: (x * 2 + 1).sigmoid()),
    "pointwise_one_sample": (_seq_one, lambda x: x.exp() - x),
    "linear": (_seq, lambda x: _LIN(x)),
    "layer_norm": (_seq, lambda x: F.layer_norm(x, (4,))),
    "sum_ragged": (_seq, lambda x: x.sum(dim=1)),
    "mean_ragged": (_seq, lambda x: x.mean(dim=1)),
    "amax_static": (_seq, lambda x: x.amax(dim=-1)),
    "sum_static_keepdim": (_seq, lambda x: x.sum(dim=2, keepdim=True)),
    "softmax_static": (_seq, lambda x: x.softmax(-1)),
    "softmax_ragged": (_seq, lambda x: x.softmax(1)),
    "sdpa": (_heads, _sdpa),
    "unbind": (_seq, lambda x: x.unbind()),
    "offsets": (_seq, lambda x: x.offsets()),
    "sizes": (_seq, lambda x: x.sizes()),
    "host_offsets": (_seq, lambda x: x.host_offsets()),
    "padded_read": (_seq, lambda x: x + _POS),
    "padded_read_mul": (_seq, lambda x: x * _POS[:, :, :1]),
    "to_padded": (_seq, lambda x: x.to_padded(0.0)),
    "mask": (_seq, lambda x: x.mask()),
    "pair_broadcast": (_seq, lambda x: x.unsqueeze(2) + x.unsqueeze(1)),
    "window": (_seq, lambda x: x[:, :2]),
    "detach": (_seq, lambda x: x.detach() * 2),  # autograd shares the version counter: no inference wrapper
    "alias_requires_grad": (_seq, lambda x: torch.ops.aten.alias(x).detach().requires_grad_(False) + 1),
    "position": (_seq_one, lambda x: x[:, -1]),
    "conv2d": (_images, lambda x: _CONV(x)),
    "conv2d_pool": (_images, lambda x: F.max_pool2d(F.relu(_CONV(x)), 2)),
    "collate": (_collated, lambda b: (b["x"] * 2).sum(dim=1)),
    "repr": (_seq, lambda x: repr(x)),
    "einsum_attention": (_tokens, _einsum_attention),
    "add_inplace": (_seq, lambda x: x.clone().add_(1.0).mul_(x)),
    "relu_inplace": (_seq, lambda x: F.relu(x.clone(), inplace=True)),
    "pair_bias_attention": (_tokens, _pair_bias_attention),
    "pair_sum": (_pairs, lambda z: z.sum(dim=2)),
    "pair_softmax": (_pairs, lambda z: z.softmax(dim=2)),
    "pair_transpose": (_pairs, lambda z: z.transpose(1, 2) + z),
    "pair_triangle": (_pairs, lambda z: torch.einsum("bikc,bjkc->bijc", z, z)),
    "cat_static": (_seq, lambda x: torch.cat([x, x * 2], dim=-1)),
    "stack_sum": (_seq, lambda x: torch.stack([x, x + 1]).sum(0)),
    "cross_entropy": (_seq, lambda x: F.cross_entropy(x.values(), x.values().argmax(-1))),
    "embedding": (lambda: make_batch("seq_1d", seed=8, dtype=torch.int64, low=0, high=3)[0],
                  lambda i: F.embedding(i, _POS[0])),
}


def _flat(out):
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flat(v)]
    if isinstance(out, NestedTensor):
        return [s.clone() for s in out.unbind()]
    return [out]


def _same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb)
    for u, v in zip(fa, fb):
        if isinstance(u, torch.Tensor):
            assert u.shape == v.shape and u.dtype == v.dtype
            torch.testing.assert_close(u, v, equal_nan=True)
        else:
            assert u == v


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_inference_mode_matches_no_grad(name, where):
    build, op = OPS[name]
    with torch.no_grad():
        ref = op(build())
    if where == "outside":
        x = build()
        with torch.inference_mode():
            out = op(x)
            again = op(x)  # cached paths (handed-out copies, row maps, padded reads) a second time
    else:
        with torch.inference_mode():
            x = build()
            out = op(x)
            again = op(x)
    _same(out, ref)
    _same(again, ref)


def test_padded_read_of_a_table_written_in_inference_mode():
    """A dense operand created and then written in place inside the block is read afresh: an
    inference tensor has no version counter, so its rows are never cached."""
    x = _seq()
    with torch.inference_mode():
        pos = torch.zeros(1, 3, 4)
        first = x + pos
        pos.add_(1.0)
        second = x + pos
    for a, b in zip(first.unbind(), second.unbind()):
        torch.testing.assert_close(b, a + 1)


def test_offsets_written_in_inference_mode_leave_the_batch_intact():
    x = _seq()
    with torch.inference_mode():
        o = x.offsets()
        o.zero_()
        torch.testing.assert_close(x.offsets(), torch.tensor([0, 3, 3, 5]))


_TRAINABLE = sorted(n for n in OPS if n not in ("unbind", "offsets", "sizes", "host_offsets", "repr", "mask", "embedding",
                                                 "collate", "cross_entropy", "add_inplace", "relu_inplace", "detach", "alias_requires_grad"))


@pytest.mark.parametrize("name", _TRAINABLE)
def test_maps_built_in_inference_mode_serve_a_later_training_step(name):
    """Index maps are cached by content, across structures: maps first built inside the block
    (a serving call) must be normal tensors, or the next training step on a batch of the same
    sizes fails with "Inference tensors cannot be saved for backward"."""
    build, op = OPS[name]
    with torch.inference_mode():
        op(build())
    x = build().detach().requires_grad_()
    out = op(x)
    flat = [t for t in _flat(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sum(t.sum() for t in flat).backward() if flat else None
    assert x.grad is not None


@pytest.mark.parametrize("name", _TRAINABLE)
def test_a_batch_served_in_inference_mode_can_then_be_trained_on(name):
    """The same batch object, first used inside the block, then in a training step."""
    build, op = OPS[name]
    x = build().detach()
    with torch.inference_mode():
        op(x)
    x.requires_grad_()
    flat = [t for t in _flat(op(x)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sum(t.sum() for t in flat).backward() if flat else None
    assert x.grad is not None
