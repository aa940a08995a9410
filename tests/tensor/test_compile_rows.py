"""torch.compile end to end: attention layers, duck sizing, and ops that create rows.

Every test compiles with ``fullgraph=True`` over batches whose size and lengths change,
counts graphs with ``CompileCounterWithBackend`` and compares outputs and gradients with
eager. aot_eager is the default backend here (compiling is slow on a 2-core CPU);
``PADLESS_COMPILE_INDUCTOR=1`` adds the inductor runs of the layer tests.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.ops.attention.sdpa_compiled import packed_sdpa
from padless.testing import assert_close_samples

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")


def _batch(lengths, c=16, seed=0) -> padless.NestedTensor:
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(n, c, generator=g) for n in lengths], requires_grad=True)


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out


# The first batch has B == 4 == every length: duck sizing would tie batch size and length.
CHANGING = [[4, 4, 4, 4], [3, 9], [5, 2, 7, 6, 3], [8, 3, 6], [2, 5, 4, 7, 3, 6, 9]]


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if INDUCTOR else []))
def test_transformer_encoder_layer_batch_first_trains_in_one_graph(backend):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    cnt = CompileCounterWithBackend(backend)
    clayer = torch.compile(layer, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(CHANGING):
        x, x2 = _batch(lengths, seed=i), _batch(lengths, seed=i)
        y = clayer(x)
        (y.values() ** 2).sum().backward()
        g = _grads(layer)
        ref = layer(x2)
        (ref.values() ** 2).sum().backward()
        assert_close_samples(y, list(ref.unbind()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.values(), x2.grad.values(), atol=1e-5, rtol=1e-5)
        for a, b in zip(g, _grads(layer)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs over {len(CHANGING)} batches"


def test_multihead_attention_seq_first_and_causal_sdpa_compile():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=False)

    def f(x):
        a, _ = mha(x, x, x, need_weights=False)
        q = a.unflatten(-1, (4, 4)).transpose(1, 2)  # (H, L_i, E) samples
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(CHANGING[:3]):
        x, x2 = _batch(lengths, seed=i), _batch(lengths, seed=i)
        y = cf(x)
        y.values().sum().backward()
        ref = f(x2)
        ref.values().sum().backward()
        assert_close_samples(y, list(ref.unbind()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.values(), x2.grad.values(), atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ev", [8, 6])
def test_packed_sdpa_op_matches_dense_per_sample(causal, ev):
    """The custom op (run eagerly) against dense SDPA on each sample, with an empty sample,
    a sample without keys and cross-attention lengths; gradients included. ``ev=8``: torch's
    fused CPU kernels; ``ev=6`` (value head size differs): the formula path."""
    g = torch.Generator().manual_seed(1)
    lq, lk = [3, 0, 4, 2], [5, 2, 4, 0]
    q = torch.randn(sum(lq), 2, 8, generator=g, requires_grad=True)
    k = torch.randn(sum(lk), 2, 8, generator=g, requires_grad=True)
    v = torch.randn(sum(lk), 2, ev, generator=g, requires_grad=True)
    qo = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()])
    ko = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()])
    out = packed_sdpa(q, k, v, qo, ko, causal, None)
    go = torch.randn(out.shape, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    refs, gq, gk, gv = [], [], [], []
    for i in range(len(lq)):
        qi = q.detach()[qo[i]:qo[i + 1]].transpose(0, 1).requires_grad_()
        ki = k.detach()[ko[i]:ko[i + 1]].transpose(0, 1).requires_grad_()
        vi = v.detach()[ko[i]:ko[i + 1]].transpose(0, 1).requires_grad_()
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal)
        if lk[i] == 0:
            o = torch.zeros_like(o)  # torch's SDPA on an empty key set: zeros (CPU math gives NaN here)
        o = o.transpose(0, 1)
        refs.append(o)
        if lk[i] and lq[i]:
            a, b, c = torch.autograd.grad(o, (qi, ki, vi), go[qo[i]:qo[i + 1]])
        else:
            a, b, c = torch.zeros_like(qi), torch.zeros_like(ki), torch.zeros_like(vi)
        gq.append(a.transpose(0, 1)), gk.append(b.transpose(0, 1)), gv.append(c.transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, torch.cat(gq), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk, torch.cat(gk), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv, torch.cat(gv), atol=1e-5, rtol=1e-5)


def test_duck_sizing_batch_equal_to_a_length_does_not_specialise():
    """B == every length (and rows == B * C) on the first call; batches of 2..32 after it,
    built by paths that used to lose the dynamic marks (detach, dtype moves)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: (lin(x).relu() * x).mean(dim=1), backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for i, b in enumerate([8, 2, 5, 32, 3, 9, 16, 4]):
        lengths = [8] * b if i == 0 else torch.randint(2, 12, (b,), generator=g).tolist()
        x = padless.from_list([torch.randn(n, 8, generator=g) for n in lengths])
        x = x.detach() if i % 2 else x.to(torch.float64).to(torch.float32)
        torch.testing.assert_close(f(x), (lin(x).relu() * x).mean(dim=1))
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs"


# ---------------------------------------------------------------------------- pair blocks


class PairBlock(torch.nn.Module):
    """``p = u(x)[:, :, None] + v(x)[:, None]; p = p + mlp(ln(p)); x + g(p.mean(dim=2))``."""

    def __init__(self, c: int = 8, p: int = 4) -> None:
        super().__init__()
        self.u, self.v, self.g = torch.nn.Linear(c, p), torch.nn.Linear(c, p), torch.nn.Linear(p, c)
        self.ln = torch.nn.LayerNorm(p)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(p, 16), torch.nn.ReLU(), torch.nn.Linear(16, p))

    def forward(self, x):
        p = self.u(x).unsqueeze(2) + self.v(x).unsqueeze(1)
        p = p + self.mlp(self.ln(p))
        return x + self.g(p.mean(dim=2))


def _pair_batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sizes = [4, 2, 7, 3, 9, 5, 16, 6, 32][:n]
    for i, b in enumerate(sizes):
        # first batch: B == every length (duck sizing); later ones include 1-row samples
        lengths = [4] * b if i == 0 else torch.randint(1, 9, (b,), generator=g).tolist()
        yield [torch.randn(m, 8, generator=g) for m in lengths]


def _check_pair_block(backend: str, n_batches: int) -> None:
    torch.manual_seed(0)
    block = PairBlock()
    cnt = CompileCounterWithBackend(backend)
    cblock = torch.compile(block, backend=cnt, fullgraph=True)
    for samples in _pair_batches(n_batches):
        x = padless.from_list(samples, requires_grad=True)  # no preparation step (auto carriers)
        x2 = padless.from_list(samples, requires_grad=True)
        y = cblock(x)
        (y.values() ** 2).sum().backward()
        g = _grads(block)
        ref = block(x2)
        (ref.values() ** 2).sum().backward()
        assert_close_samples(y, list(ref.unbind()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.values(), x2.grad.values(), atol=1e-5, rtol=1e-5)
        for a, b in zip(g, _grads(block)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs over {n_batches} batches"


def test_pair_block_fullgraph_one_graph_over_changing_batches_aot_eager():
    _check_pair_block("aot_eager", 8)


@pytest.mark.skipif(not INDUCTOR, reason="inductor compiles of the pair block take about 25 s on a 2-core CPU: "
                    "PADLESS_COMPILE_INDUCTOR=1 runs it (test_compile.py::test_inductor_backend keeps one inductor run)")
def test_pair_block_fullgraph_inductor():
    _check_pair_block("inductor", 8)


def test_pair_reduction_over_either_axis_and_sum_compile():
    """Reducing the first pair axis too (``p.sum(dim=1)``), from ``x.unsqueeze(1) * x.unsqueeze(2)``."""

    def f(x):
        p = x.unsqueeze(1) * x.unsqueeze(2)  # the (1, N, C) operand first
        return p.sum(dim=1) - p.amax(dim=2)

    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for samples in _pair_batches(3, seed=1):
        x = padless.prepare_for_compile(padless.from_list(samples))
        assert_close_samples(cf(x), [f(s.unsqueeze(0))[0] for s in x.unbind()], atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1


def test_flatten_carries_the_pair_row_count_without_preparation():
    x = padless.from_list([torch.randn(n, 3) for n in (2, 1)])
    assert "_pair_count" not in x._meta.derived  # nothing paid eagerly
    names, ctx = x.__tensor_flatten__()  # what torch.compile calls on a real input
    assert names == ["_values", "_offsets", "_sizes", "_pair_count"] and ctx == ((0,), ("pair_count",))
    carrier = x._pair_count
    assert carrier.shape == (5,) and carrier.stride() == (0,) and carrier.untyped_storage().nbytes() == 1
    y = type(x).__tensor_unflatten__({n: getattr(x, n) for n in names}, ctx, x.shape, x.stride())
    assert y._pair_count is carrier
    # AOTAutograd's cache key names the carried maps and padless' source fingerprint
    assert x._stable_hash_for_caching().startswith("padless.NestedTensor((0,),)('pair_count',)@")
    # ops that keep the rows keep the carrier (so u(x).unsqueeze(2) still finds it)
    assert torch.nn.Linear(3, 5)(x).unsqueeze(2)._pair_count is carrier
    # the pair maps built from it, as documented in padless.ops.common.carried
    assert padless.ops.common.carried.pair_rows(x.offsets(), 5).tolist() == [0, 0, 1, 1, 2]
    # prepare_for_compile still works (and makes the same carrier now)
    z = padless.prepare_for_compile(padless.from_list([torch.randn(n, 3) for n in (2, 1)]))
    assert z._pair_count.shape == (5,)


def test_prepare_for_compile_errors():
    with pytest.raises(TypeError, match=r"prepare_for_compile\(\): nt must be a NestedTensor, got Tensor"):
        padless.prepare_for_compile(torch.zeros(2, 3))
    img = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 6)])
    with pytest.raises(ValueError, match=r"prepare_for_compile\(pairs=True\): the batch has ragged dims \(1, 2\)"):
        padless.prepare_for_compile(img)


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if INDUCTOR else []))
def test_compiled_dropout_draws_with_atens_generator(backend):
    """Under compile, NestedTensor dropout draws its keep mask in an opaque op (ATen's
    generator, as eager): kept elements are scaled by 1/(1-p), dropped ones and their
    gradients are zero, the kept fraction is about 1-p, one graph over changing batches, and
    the compiled draw equals eager's for the same seed (one bernoulli_ per element either way)."""
    p = 0.3
    cnt = CompileCounterWithBackend(backend)

    def f(x):
        return F.dropout(x * 1.0, p, training=True)

    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for i, ns in enumerate([[40, 40, 40, 40], [300, 90], [50, 200, 7]]):
        x = padless.from_list([torch.rand(n, 16) + 1.0 for n in ns], requires_grad=True)
        y = cf(x)
        y.values().sum().backward()
        v, yv, g = x.values().detach(), y.values().detach(), x.grad.values()
        kept = yv != 0
        torch.testing.assert_close(yv[kept], v[kept] / (1 - p))
        torch.testing.assert_close(g, kept.to(g.dtype) / (1 - p))
        assert abs(kept.float().mean().item() - (1 - p)) < 0.05
    assert cnt.frame_count == 1
    x = padless.from_list([torch.rand(n, 16) + 1.0 for n in (30, 50)])
    torch.manual_seed(7)
    a = cf(x)
    torch.manual_seed(7)
    b = torch.empty_like(x.values()).bernoulli_(1 - p)
    torch.testing.assert_close(a.values() != 0, b != 0)
