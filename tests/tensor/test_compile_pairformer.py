"""torch.compile of a Pairformer layer (issue 21): triangle attention and pair-biased attention.

The scores ``q @ k^T`` of pair queries ``(N_i, H, N_i, E)`` have three ragged dims and a row
count no input has; under tracing the contraction runs as ``padless::nested_island`` (the
eager handler as one opaque op, :mod:`padless.ops.pairs.traced`), broadcasting the mask and
pair biases onto the scores is a traced broadcast plan, and the softmax reduces the scores'
last dim with a carried group count. Every test compiles with ``fullgraph=True``, counts
graphs over batches whose size and lengths change (an empty sample included; the first
batch has B equal to every length, for duck sizing), compares values and gradients with the
dense computation on each sample alone, and runs a one-sample batch (which specialises B = 1:
a graph of its own). ``PADLESS_COMPILE_INDUCTOR=1`` adds inductor runs of the attention cores.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.tensor.errors import StructureError

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")
LONG = os.environ.get("PADLESS_COMPILE_LONG", "") not in ("", "0")
BACKENDS = ["aot_eager"] + (["inductor"] if INDUCTOR else [])
TOL = dict(atol=2e-5, rtol=2e-5)
H, E = 2, 3
BATCHES = [[4, 4, 4, 4], [3, 0, 5], [6, 2]]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _nested(samples: list[torch.Tensor], ragged: tuple[int, ...]):
    return padless.from_list([s.detach().clone() for s in samples], ragged_dims=ragged, requires_grad=True)


def _leaves(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.detach().clone().requires_grad_() for s in samples]


def _check(fn, make, ragged: list[tuple[int, ...]], backend: str) -> None:
    """``fn`` compiled on NestedTensors (ragged dims ``ragged``) vs ``fn`` on each sample alone
    (a batch of one dense sample): values and the gradients of a sum of squares; one graph for
    the batches of B >= 2."""
    cnt = CompileCounterWithBackend(backend)
    cf = torch.compile(fn, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(BATCHES + [[5]]):
        per_sample = [make(n, 100 * i + j) for j, n in enumerate(lengths)]  # per sample: one tensor per operand
        nts = [_nested([s[k] for s in per_sample], r) for k, r in enumerate(ragged)]
        out = cf(*nts)
        (out.values() ** 2).sum().backward()
        outs = out.unbind()
        grads = [nt.grad.unbind() for nt in nts]
        for j, sample in enumerate(per_sample):
            dense = _leaves(sample)
            ref = fn(*[d.unsqueeze(0) for d in dense])[0]
            torch.testing.assert_close(outs[j], ref.detach(), **TOL)
            (ref**2).sum().backward()
            for k, d in enumerate(dense):
                torch.testing.assert_close(grads[k][j], d.grad if d.grad is not None else torch.zeros_like(d), **TOL)
        if len(lengths) > 1:
            assert cnt.frame_count == 1, f"batch {lengths}: {cnt.frame_count} graphs"
    assert cnt.frame_count <= 2  # the one-sample batch: B = 1 is specialised


# ---------------------------------------------------------------------------- triangle attention


def _triangle_core(q, k, v, mb, tri):
    """Triangle attention around the starting node: scores of three ragged dims, two biases."""
    a = torch.matmul(q, k.transpose(-1, -2)) + mb + tri
    return torch.matmul(a.softmax(-1), v)


def _triangle_inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, n, E, generator=g) for _ in range(3))
    mask = (torch.rand(n, n, generator=g) > 0.2).float()
    mb = (1e4 * (mask - 1))[:, None, None, :]  # (N, 1, 1, N)
    tri = torch.randn(1, H, n, n, generator=g)
    return [q, k, v, mb, tri]


@pytest.mark.parametrize("backend", BACKENDS)
def test_triangle_attention_scores_softmax_and_values_one_graph(backend):
    _check(_triangle_core, _triangle_inputs, [(0, 2), (0, 2), (0, 2), (0, 3), (2, 3)], backend)


def _triangle_log_weights(q, k, tri):
    """log_softmax over the scores' last ragged dim and over their first (other groups)."""
    a = torch.matmul(q, k.transpose(-1, -2)) + tri
    return a.log_softmax(-1) + a.softmax(1)


def test_log_softmax_and_softmax_over_other_ragged_dims_of_scores_one_graph():
    _check(_triangle_log_weights, lambda n, s: [_triangle_inputs(n, s)[i] for i in (0, 1, 4)],
           [(0, 2), (0, 2), (2, 3)], "aot_eager")


def _triangle_end(q, k, v):
    """The ending node: the pair axes swapped first (a ragged transpose), then as above."""
    q, k, v = (t.transpose(0 + 1, 2 + 1) for t in (q, k, v))  # batch dim first: sample dims 0 and 2
    return torch.matmul((torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(E)).softmax(-1), v).transpose(1, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triangle_attention_on_swapped_pair_axes_one_graph(backend):
    _check(_triangle_end, lambda n, s: _triangle_inputs(n, s)[:3], [(0, 2)] * 3, backend)


# ---------------------------------------------------------------------------- pair-biased attention


def _pair_biased(q, k, v, bias, mask):
    """boltz's AttentionPairBias: einsum scores, pair bias, sequence mask, softmax, einsum."""
    a = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(E) + bias
    a = (a + (1 - mask[:, None, None]) * -1e6).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", a, v)


def _pair_biased_inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, E, generator=g) for _ in range(3))
    bias = torch.randn(H, n, n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()
    if n:
        mask[0] = 1.0  # every row keeps a key: no all-masked row (its softmax is flat either way)
    return [q, k, v, bias, mask]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_biased_attention_one_graph(backend):
    _check(_pair_biased, _pair_biased_inputs, [(0,), (0,), (0,), (1, 2), (0,)], backend)


# ---------------------------------------------------------------------------- run-time checks


def test_result_given_an_operands_structure_is_checked_when_the_graph_runs():
    """``a @ v`` takes ``v``'s structure (same layout) without reading sizes; a batch where
    the result's rows differ from ``v``'s raises when the graph runs, naming the sample."""
    cf = torch.compile(lambda a, v: torch.matmul(a, v), backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    ns, ms = [3, 4], [3, 2]
    a = padless.from_list([torch.randn(n, H, m, n, generator=g) for n, m in zip(ns, ms)], ragged_dims=(0, 2, 3))
    v = padless.from_list([torch.randn(n, H, n, E, generator=g) for n in ns], ragged_dims=(0, 2))
    with pytest.raises(StructureError, match=r"matmul\(\).*sample 1 of the result has shape \(4, 2, 2, 3\)"):
        cf(a, v)
    ok = padless.from_list([torch.randn(n, H, n, n, generator=g) for n in ns], ragged_dims=(0, 2, 3))
    out = cf(ok, v)
    for o, x, y in zip(out.unbind(), ok.unbind(), v.unbind()):
        torch.testing.assert_close(o, x @ y, **TOL)


def test_broadcast_onto_scores_checks_ragged_extents_when_the_graph_runs():
    """A bias whose ragged extents differ from the scores' raises the eager error at run time."""
    cf = torch.compile(lambda a, b: a + b, backend="aot_eager", fullgraph=True)
    a = padless.from_list([torch.randn(n, H, n, n) for n in (2, 3)], ragged_dims=(0, 2, 3))
    b = padless.from_list([torch.randn(1, H, n, n) for n in (2, 4)], ragged_dims=(2, 3))
    with pytest.raises(StructureError, match=r"add\(\): ragged structures differ: sample 1"):
        cf(a, b)


# ---------------------------------------------------------------------------- the layer


CS, CZ = 16, 8


def _mini_layer(dropout: float):
    from benchmarks.pairformer import MiniPairformer

    torch.manual_seed(0)
    # Static extents differ from every envelope the batches reach (the layer's view(b, -1, h, d)
    # compares its static entries with the envelope under tracing: an equal one would specialise it).
    return MiniPairformer(CS, CZ, 2, dropout, 3, 2)


class _NoMaskDraw(torch.nn.Module):
    """MiniPairformer with its dropout masks left out (``z + branch``): everything else of the
    layer, the dense dropout masks being what :func:`test_layer_with_dense_dropout_masks` covers."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _mini_layer(0.0)
        self.inner._drop = lambda z, columnwise=False: 1.0

    def forward(self, s, z, mask, pair_mask):
        return self.inner(s, z, mask, pair_mask)


def _layer_inputs(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    ss = [torch.randn(n, CS, generator=g) for n in lengths]
    zs = [torch.randn(n, n, CZ, generator=g) for n in lengths]
    return ss, zs


def _as_batch(ss, zs):
    s, z = _nested(ss, (0,)), _nested(zs, (0, 1))
    mask = padless.from_list([torch.ones(len(x)) for x in ss], ragged_dims=(0,))
    pair_mask = padless.from_list([torch.ones(len(x), len(x)) for x in ss], ragged_dims=(0, 1))
    return s, z, mask, pair_mask


def test_layer_compiles_in_one_graph_and_matches_dense_samples():
    """The whole layer (triangle products, triangle attention on both axes, transitions,
    pair-biased attention) in train mode: values and gradients of inputs and parameters
    against the dense layer on each sample alone."""
    layer = _NoMaskDraw().train()
    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(layer, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(BATCHES + [[5]]):
        ss, zs = _layer_inputs(lengths, i)
        s, z, mask, pair_mask = _as_batch(ss, zs)
        layer.zero_grad()
        out_s, out_z = cf(s, z, mask, pair_mask)
        ((out_s.values() ** 2).sum() + (out_z.values() ** 2).sum()).backward()
        got = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        for j, (x, p) in enumerate(zip(ss, zs)):
            x, p = x[None].clone().requires_grad_(), p[None].clone().requires_grad_()
            n = x.shape[1]
            rs, rz = layer(x, p, torch.ones(1, n), torch.ones(1, n, n))
            ((rs**2).sum() + (rz**2).sum()).backward()
            torch.testing.assert_close(out_s.unbind()[j], rs[0].detach(), **TOL)
            torch.testing.assert_close(out_z.unbind()[j], rz[0].detach(), **TOL)
            torch.testing.assert_close(s.grad.unbind()[j], x.grad[0], **TOL)
            torch.testing.assert_close(z.grad.unbind()[j], p.grad[0], **TOL)
        for a, p in zip(got, layer.parameters()):  # parameter gradients: the samples' together
            torch.testing.assert_close(a, p.grad if p.grad is not None else torch.zeros_like(a), atol=1e-4, rtol=1e-4)
        if len(lengths) > 1:
            assert cnt.frame_count == 1, f"batch {lengths}: {cnt.frame_count} graphs"




def _check_layer_against_eager(layer) -> None:
    """Compiled vs eager padless in train mode with dropout, the same seed for both: values and
    gradients of inputs and parameters; one graph over batches whose size and lengths change."""
    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(layer, backend=cnt, fullgraph=True)
    for i, lengths in enumerate([[4, 4, 4, 4], [3, 1, 5], [6, 2]]):
        ss, zs = _layer_inputs(lengths, i)
        results = []
        for f in (cf, layer):
            s, z, mask, pair_mask = _as_batch(ss, zs)
            layer.zero_grad()
            torch.manual_seed(i)
            out_s, out_z = f(s, z, mask, pair_mask)
            ((out_s.values() ** 2).sum() + (out_z.values() ** 2).sum()).backward()
            results.append([out_s.values(), out_z.values(), s.grad.values(), z.grad.values(), *(p.grad.clone() for p in layer.parameters())])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert cnt.frame_count == 1, f"batch {lengths}: {cnt.frame_count} graphs"


@pytest.mark.skipif(not LONG, reason="a second compile of the whole layer (about 25 s on a 2-core CPU): "
                    "PADLESS_COMPILE_LONG=1 runs it; test_layer_compiles_in_one_graph_and_matches_dense_samples covers the layer")
def test_layer_with_dense_dropout_masks():
    _check_layer_against_eager(_mini_layer(0.25).train())


def test_boltz_pairformer_layer():
    """boltz 2.2.1's own PairformerLayer (in zoo/.venv; skipped where boltz is not installed)."""
    pytest.importorskip("boltz")
    import argparse

    from benchmarks.pairformer import build_layer

    layer, _ = build_layer(argparse.Namespace(cs=CS, cz=CZ, heads=2, dropout=0.25, pair_width=3, pair_heads=2))
    _check_layer_against_eager(layer.train())
