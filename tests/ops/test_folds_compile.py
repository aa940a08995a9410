"""Folds under torch.compile (padless.ops.rows.folds_traced): one graph (aot_eager, fullgraph)
over batches whose size and lengths change, outputs and gradients equal to eager, which
tests/ops/test_folds.py and test_seq_first.py check against the dense code per sample."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless

D, H, DH = 8, 2, 4
# No first batch with B equal to its longest sample (duck sizing would tie them); an empty sample last.
CHANGING = [[4, 1, 2], [2, 5, 1, 3], [6, 2, 3, 1, 2], [2, 0, 3]]


class RowAttention(nn.Module):
    """Attention over the rows of a pair state, rows folded into the batch."""

    def __init__(self, sdpa: bool):
        super().__init__()
        torch.manual_seed(0)
        self.sdpa = sdpa
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))
        self.o = nn.Linear(H * DH, D)

    def forward(self, z):
        B, N = z.shape[0], z.shape[1]
        zf = z.reshape(B * N, N, D)
        q, k, v = (lin(zf).view(B * N, N, H, DH).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            o = ((q @ k.transpose(-1, -2)) / math.sqrt(DH)).softmax(-1) @ v
        o = self.o(o.transpose(1, 2).reshape(B * N, N, H * DH))
        return o.reshape(B, N, N, D)


class Heads(nn.Module):
    """Heads folded into the batch: batch-first (``view/transpose/reshape``) or sequence-first
    (fairseq's ``view(T, B * H, d)``)."""

    def __init__(self, seq_first: bool):
        super().__init__()
        torch.manual_seed(0)
        self.seq_first = seq_first
        self.qkv, self.ln = nn.Linear(D, 3 * D), nn.LayerNorm(D)

    def forward(self, x):
        if self.seq_first:
            y = x.transpose(0, 1)
            T, B, _ = y.size()
            q, k, v = (t.contiguous().view(T, B * H, DH).transpose(0, 1) for t in self.qkv(self.ln(y)).chunk(3, dim=-1))
            o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).contiguous().view(T, B, D)
            return (y + F.gelu(o)).transpose(0, 1)
        B, L, _ = x.shape
        q, k, v = (t.view(B, L, H, DH).transpose(1, 2).reshape(B * H, L, DH) for t in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v)
        return o.unflatten(0, (B, H)).transpose(1, 2).reshape(B, L, D)


def _run_changing(module, make):
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=cnt, fullgraph=True)
    for i, ns in enumerate(CHANGING):
        g = torch.Generator().manual_seed(i)
        samples = make(ns, g)
        x = padless.from_list(samples, ragged_dims=tuple(range(samples[0].dim() - 1)), requires_grad=True)
        x2 = padless.from_list(samples, ragged_dims=x.ragged_dims, requires_grad=True)
        out = compiled(x)
        (out.values() ** 2).sum().backward()
        ref = module(x2)
        (ref.values() ** 2).sum().backward()
        assert out.sizes().tolist() == ref.sizes().tolist()
        torch.testing.assert_close(out.values(), ref.values(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.values(), x2.grad.values(), atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs over {len(CHANGING)} batches"


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "softmax"])
def test_folded_row_attention_one_graph(sdpa):
    _run_changing(RowAttention(sdpa), lambda ns, g: [torch.randn(n, n, D, generator=g) for n in ns])


@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
def test_heads_folded_into_the_batch_one_graph(seq_first):
    _run_changing(Heads(seq_first), lambda ns, g: [torch.randn(n, D, generator=g) for n in ns])


def test_per_row_repeats_are_refused_under_compile():
    z = padless.from_list([torch.randn(n, n, H) for n in (3, 1, 2)], ragged_dims=(0, 1))

    def f(z):
        return z.permute(0, 3, 1, 2).repeat_interleave(z.shape[1], dim=0)

    with pytest.raises(Exception, match=r"repeat_interleave\(\): repeating every sample along the batch dim under torch.compile"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(z)


# Three batches of other lengths and sizes, a one-sample batch and an empty sample among them.
THREE = [[4, 1, 2], [3], [2, 0, 5, 1]]


def _check_against_eager(module, fullgraph: bool, batches=THREE) -> int:
    torch._dynamo.reset()  # no code compiled by another test (same forward, other settings)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=cnt, fullgraph=fullgraph)
    for i, ns in enumerate(batches):
        g = torch.Generator().manual_seed(i)
        samples = [torch.randn(n, n, D, generator=g) for n in ns]
        x = padless.from_list(samples, ragged_dims=(0, 1), requires_grad=True)
        x2 = padless.from_list(samples, ragged_dims=(0, 1), requires_grad=True)
        out, ref = compiled(x), module(x2)
        (out.values() ** 2).sum().backward()
        (ref.values() ** 2).sum().backward()
        assert out.sizes().tolist() == ref.sizes().tolist()
        torch.testing.assert_close(out.values(), ref.values(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.values(), x2.grad.values(), atol=1e-5, rtol=1e-5)
    return cnt.frame_count


def test_fold_attention_unfold_with_a_one_sample_batch():
    """A batch of one sample is compiled once more (dynamo specialises a size of 1), then the
    graph serves every batch size again."""
    assert _check_against_eager(RowAttention(sdpa=True), fullgraph=True, batches=THREE + [[2, 6, 3]]) == 2


def test_fold_without_fullgraph_when_dynamic_output_shapes_are_captured():
    """The fold itself needs no data-dependent size (test_fold_without_fullgraph_one_graph), but
    the pair product ``q @ k^T`` of the folded batch makes its row count with a custom op of
    data-dependent size (``padless::total_carrier``, padless.ops.pairs.traced): dynamo captures it
    under ``fullgraph=True`` or with ``capture_dynamic_output_shape_ops``; then one graph."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert _check_against_eager(RowAttention(sdpa=False), fullgraph=False, batches=CHANGING) == 1


def _dense_per_sample(f, ns, seed: int = 0) -> None:
    """``f`` compiled (aot_eager, no fullgraph) and eager on a batch of ``(n, n, D)`` samples for each
    ``ns``, checked per sample against ``f`` on that sample alone as a dense batch of one (values and
    gradients). Returns the number of graphs."""
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=cnt)
    for i, batch in enumerate(ns):
        g = torch.Generator().manual_seed(seed + i)
        samples = [torch.randn(n, n, D, generator=g) for n in batch]
        for run in (compiled, f):
            x = padless.from_list(samples, ragged_dims=(0, 1), requires_grad=True)
            out = run(x)
            (out.values() ** 2).sum().backward()
            for s, o, gx in zip(samples, out.unbind(), x.grad.unbind()):
                d = s.clone().requires_grad_(True)
                ref = f(d[None])[0]
                (ref ** 2).sum().backward()
                torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(gx, d.grad, atol=1e-5, rtol=1e-5)
    return cnt.frame_count


def test_fold_without_fullgraph_one_graph():
    """The fold's sample count (sum N_i) is the carried size ``drop_count`` of a pair state
    (padless.ops.common.carried): an input size, so no data-dependent op and no graph break at the
    fold without ``fullgraph=True``: the unfold meets the folded batch's link in the same graph."""
    lin = nn.Linear(D, D)

    def f(z):
        B, N = z.shape[0], z.shape[1]
        return lin(z.reshape(B * N, N, D)).reshape(B, N, N, D)

    assert _dense_per_sample(f, CHANGING) == 1


def test_unfold_after_a_graph_break_is_refused():
    """A folded batch crosses a graph break without its link to the parent (sizes after the break
    are plain ints): the unfold there is refused, saying why."""
    lin = nn.Linear(D, D)

    def f(z):
        B, N = z.shape[0], z.shape[1]
        y = lin(z.reshape(B * N, N, D))
        torch._dynamo.graph_break()
        return y.reshape(B, N, N, D)

    torch._dynamo.reset()
    z = padless.from_list([torch.randn(n, n, D) for n in (4, 1, 2)], ragged_dims=(0, 1))
    with pytest.raises(Exception, match=r"a graph break between the fold and the unfold .* loses that link"):
        torch.compile(f, backend="aot_eager")(z)


def test_fold_of_an_envelope_of_one_under_compile_is_refused():
    """Every sample of length 0 or 1: the compiler specialises N = 1, so ``B * N`` is ``B`` and the
    target cannot say fold from keep (eagerly the size read from the shape says it): refused,
    naming the explicit forms, which compile (next test)."""
    with pytest.raises(Exception, match=r"reshape\(\): under torch.compile, target .* may fold dim 1 into the batch "
                       r"or keep the batch: .*specialises \(N = 1\).*z.flatten\(0, 1\)"):
        _check_against_eager(RowAttention(sdpa=True), fullgraph=True, batches=[[1, 0, 1]])
    z = padless.from_list([torch.randn(1, 1, D), torch.randn(1, 1, D)], ragged_dims=(0, 1))

    def g(z):  # the explicit fold, then B * N for the folded batch: unfold or keep it?
        B, N = z.shape[0], z.shape[1]
        return z.flatten(0, 1).reshape(B * N, N, D)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"may keep this folded batch or unfold it: .*specialises \(N = 1\)"):
        torch.compile(g, backend="aot_eager", fullgraph=True)(z)


def test_explicit_fold_and_unfold_of_an_envelope_of_one_under_compile():
    lin = nn.Linear(D, D)

    def f(z):
        B, N = z.shape[0], z.shape[1]
        zf = z.flatten(0, 1)
        y = lin(zf).view(zf.shape[0], N, 2, D // 2)
        return y.reshape(zf.shape[0], N, D).unflatten(0, (B, N))

    _dense_per_sample(f, [[3, 1, 2], [1, 1], [1, 0, 1]])


def test_fold_of_a_transposed_pair_without_fullgraph_one_graph():
    """Samples (N_i, M_i) transposed (stored as (1, 0)): the fold relays the rows out first, and its
    count (sum M_i) is the carried size of the batch before that (one graph, no fullgraph)."""
    lin = nn.Linear(D, D)

    def f(z):
        zt = z.transpose(1, 2)
        B, M = zt.shape[0], zt.shape[1]
        return lin(zt.flatten(0, 1)).unflatten(0, (B, M))

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=cnt)
    for i, shapes in enumerate([[(3, 2), (1, 4), (2, 2)], [(2, 5), (4, 1), (3, 3), (1, 1)], [(5, 2), (2, 1)]]):
        g = torch.Generator().manual_seed(i)
        samples = [torch.randn(n, m, D, generator=g) for n, m in shapes]
        x = padless.from_list(samples, ragged_dims=(0, 1), requires_grad=True)
        out = compiled(x)
        (out.values() ** 2).sum().backward()
        for s, o, gx in zip(samples, out.unbind(), x.grad.unbind()):
            d = s.clone().requires_grad_(True)
            ref = lin(d.transpose(0, 1))  # the sample alone: (M, N, D)
            (ref ** 2).sum().backward()
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gx, d.grad, atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 1


# Rectangular pairs (N_i, M_i) with parent samples of N_b = 0 (their M_b held only by the fold's link),
# an empty parent whose M_b is the envelope, and a one-sample batch.
EMPTY_PARENTS = [[(2, 3), (1, 4), (3, 5)], [(2, 3), (0, 3), (3, 5), (0, 2)], [(1, 2), (0, 6), (4, 1)], [(0, 3)]]


def test_an_empty_parent_sample_unfolds_with_its_own_extents_one_graph():
    """A parent sample (0, M_b, d) gave no samples to the fold: the compiled unfold gives it
    (0, M_b, d), as eagerly (it gave (0, 0, d)), from the parent's sizes the traced link holds;
    one graph over the changing batches (a one-sample batch specialises once more)."""
    lin = nn.Linear(D, 5)

    def f(z):
        B, N = z.shape[0], z.shape[1]
        return lin(z.flatten(0, 1).tanh()).unflatten(0, (B, N))

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=cnt, fullgraph=True)
    for i, shapes in enumerate(EMPTY_PARENTS):
        g = torch.Generator().manual_seed(i)
        samples = [torch.randn(n, m, D, generator=g) for n, m in shapes]
        x = padless.from_list(samples, ragged_dims=(0, 1), requires_grad=True)
        out = compiled(x)
        assert [tuple(o.shape) for o in out.unbind()] == [(n, m, 5) for n, m in shapes]
        assert tuple(out.shape) == (len(shapes), max(n for n, _ in shapes), max(m for _, m in shapes), 5)
        (out.values() ** 2).sum().backward()
        for s, o, gx in zip(samples, out.unbind(), x.grad.unbind()):
            d = s.clone().requires_grad_(True)
            ref = lin(d.tanh())  # the sample alone
            (ref ** 2).sum().backward()
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gx, d.grad, atol=1e-5, rtol=1e-5)
    assert cnt.frame_count == 2


def test_an_empty_parent_sample_whose_extents_an_op_changed_is_refused_under_compile():
    """The folded samples transposed ((M_i, d) -> (d, M_i)) before the unfold: an empty parent
    sample's extents are not known, refused as eagerly (by a device-side assert: no host read);
    without an empty parent sample the same graph unfolds."""

    def f(z):
        B, N = z.shape[0], z.shape[1]
        return z.flatten(0, 1).transpose(1, 2).unflatten(0, (B, N))

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    full = [torch.randn(n, m, D) for n, m in EMPTY_PARENTS[0]]
    out = compiled(padless.from_list(full, ragged_dims=(0, 1)))
    for s, o in zip(full, out.unbind()):
        torch.testing.assert_close(o, s.transpose(1, 2))
    z = padless.from_list([torch.randn(n, m, D) for n, m in EMPTY_PARENTS[1]], ragged_dims=(0, 1))
    with pytest.raises(RuntimeError, match=r"unflatten\(\): under torch.compile, a parent sample gave no samples to the fold"):
        compiled(z)
