"""Opaque ops of compiled pair attention (issue 21): the cached broadcast maps onto scores
(``padless::broadcast_rows``), the softmax island's backward on its kept result, the
contraction island's backward in the forward's buckets, and a reshape whose target entries
equal the envelope without specialising it.

Every compiled test runs ``fullgraph=True`` over batches whose size and lengths change (an
empty sample included), compares values and gradients with the dense computation on each
sample alone, and runs a one-sample batch (which specialises B = 1: a graph of its own).
``PADLESS_COMPILE_INDUCTOR=1`` adds inductor runs."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.ops.pairs import traced, traced_maps
from padless.tensor.errors import StructureError

INDUCTOR = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")
BACKENDS = ["aot_eager"] + (["inductor"] if INDUCTOR else [])
TOL = dict(atol=2e-5, rtol=2e-5)
H = 2
BATCHES = [[4, 4, 4, 4], [3, 0, 5], [6, 2]]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


def _check(fn, make, ragged, backend="aot_eager"):
    """``fn`` compiled on NestedTensors vs ``fn`` on each sample alone (batch of one dense
    sample): values and gradients of a sum of squares; one graph for the batches of B >= 2."""
    cnt = CompileCounterWithBackend(backend)
    cf = torch.compile(fn, backend=cnt, fullgraph=True)
    for i, lengths in enumerate(BATCHES + [[5]]):
        per_sample = [make(n, 100 * i + j) for j, n in enumerate(lengths)]
        nts = [padless.from_list([s[k].clone() for s in per_sample], ragged_dims=r, requires_grad=True)
               for k, r in enumerate(ragged)]
        out = cf(*nts)
        (out.values() ** 2).sum().backward()
        for j, sample in enumerate(per_sample):
            dense = [t.clone().requires_grad_() for t in sample]
            ref = fn(*[d.unsqueeze(0) for d in dense])[0]
            torch.testing.assert_close(out.unbind()[j], ref.detach(), **TOL)
            (ref**2).sum().backward()
            for nt, d in zip(nts, dense):
                torch.testing.assert_close(nt.grad.unbind()[j], d.grad, **TOL)
        if len(lengths) > 1:
            assert cnt.frame_count == 1, f"batch {lengths}: {cnt.frame_count} graphs"
    assert cnt.frame_count <= 2


# ---------------------------------------------------------------------------- broadcast maps


def _scores_plus_biases(a, mb, tri):
    return a + mb + tri


def _score_inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, n, n, generator=g), torch.randn(n, 1, 1, n, generator=g), torch.randn(1, H, n, n, generator=g)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_biases_broadcast_onto_scores_through_cached_maps(backend, monkeypatch):
    """Values and gradients of ``scores + mask_bias + pair_bias`` (the biases read through the
    eager maps); the maps come from the map op when the graph runs."""
    calls = []
    real = traced_maps._host_map
    monkeypatch.setattr(traced_maps, "_host_map", lambda *a: calls.append(a[2]) or real(*a))
    _check(_scores_plus_biases, _score_inputs, [(0, 2, 3), (0, 3), (2, 3)], backend)
    assert calls, "the broadcasts did not go through padless::broadcast_rows"


def test_map_op_returns_a_copy_of_the_cached_map():
    """Writing into one result of the map op changes neither the cache nor the next result,
    and equal sizes hit the cache (the map is built once)."""
    a = padless.from_list([torch.randn(n, H, n, n) for n in (2, 3)], ragged_dims=(0, 2, 3))
    b = padless.from_list([torch.randn(n, 1, 1, n) for n in (2, 3)], ragged_dims=(0, 3))
    args = (a._sizes, a._offsets, [0, 2, 3], b._sizes, b._offsets, [0, 3], a._values.shape[0], "add")
    traced_maps._MAPS.clear()
    first = traced_maps.broadcast_rows(*args)
    want = first.clone()
    first.fill_(-1)
    second = traced_maps.broadcast_rows(*args)
    assert len(traced_maps._MAPS) == 1
    torch.testing.assert_close(second, want)
    # the map reads every score row's bias row: the gather is the eager broadcast
    got = a.values() + b.values().reshape(-1).index_select(0, second)[:, None]
    torch.testing.assert_close(got, (a + b).values())


def test_map_op_raises_the_eager_error_when_extents_differ():
    a = padless.from_list([torch.randn(n, H, n, n) for n in (2, 3)], ragged_dims=(0, 2, 3))
    b = padless.from_list([torch.randn(n, 1, 1, n) for n in (2, 4)], ragged_dims=(0, 3))
    with pytest.raises(StructureError, match=r"add\(\): ragged structures differ: sample 1"):
        traced_maps.broadcast_rows(a._sizes, a._offsets, [0, 2, 3], b._sizes, b._offsets, [0, 3], a._values.shape[0], "add")


# ---------------------------------------------------------------------------- softmax backward


def _softmaxes(a):
    """Softmax and log_softmax over the last ragged dim (runs of rows: torch's backward per
    sample) and a softmax over the first (the eager ops' gradient)."""
    return a.softmax(-1) * 2 + a.log_softmax(-1) + a.softmax(1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_island_backward_uses_the_kept_result(backend, monkeypatch):
    """Gradients per sample as the dense softmaxes', and the backward runs no softmax again
    (it differentiates the kept result): the eager softmax bodies run once per island."""
    ran = []
    real = traced._run
    monkeypatch.setattr(traced, "_run", lambda name, *a: ran.append(name) or real(name, *a))
    _check(_softmaxes, lambda n, s: [torch.randn(n, H, n, n, generator=torch.Generator().manual_seed(s))], [(0, 2, 3)], backend)
    steps = len(BATCHES) + 1
    assert ran.count("softmax") == 2 * steps and ran.count("log_softmax") == steps, ran


# ---------------------------------------------------------------------------- reshape guards


def _heads(x):
    """A head split of per-token features, as attention code writes it (``view(b, -1, h, d)``)."""
    return x.view(x.shape[0], -1, 4, 3) * 2


def test_head_split_with_the_longest_sample_as_long_as_a_head_dim_does_not_specialise():
    """The first batch's longest sample has 4 tokens, as many as heads: reading the target
    entries must not guard on the envelope (one graph over the batches, values per sample)."""
    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(_heads, backend=cnt, fullgraph=True)
    for lengths in ([4, 2, 3], [5, 0, 3], [2, 6]):
        xs = [torch.randn(n, 12) for n in lengths]
        out = cf(padless.from_list(xs, ragged_dims=(0,)))
        for o, x in zip(out.unbind(), xs):
            torch.testing.assert_close(o, x.view(-1, 4, 3) * 2)
        assert cnt.frame_count == 1, f"batch {lengths}: {cnt.frame_count} graphs"


# ---------------------------------------------------------------------------- contraction backward


def _scores_then_values(q, k, v):
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)


def _qkv(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, n, 3, generator=g) for _ in range(3)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_contraction_island_backward_in_the_forward_buckets(backend, monkeypatch):
    """The gradients of ``q @ k^T`` and ``attn @ v`` come from the buckets of the eager
    contraction's plan (the result's gradient gathered once), and equal the dense ones."""
    from padless.ops.pairs import bucket_nodes

    calls = []
    real = bucket_nodes.contract_backward
    # the island's call passes no saved buffers (an eager autograd node would pass its own)
    monkeypatch.setattr(bucket_nodes, "contract_backward", lambda *a: calls.append(len(a[3]) == 0) or real(*a))
    _check(_scores_then_values, _qkv, [(0, 2)] * 3, backend)
    assert any(calls), "the island backward did not use the buckets"
