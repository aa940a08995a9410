"""torch.compile: fullgraph tracing, eager parity, and no recompiles as lengths or batch size change."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.testing import assert_close_samples, check_op


def _fn(x, w):
    return (x * w).sigmoid() + torch.where(x > 0, x.cos(), -x) * 2


def _batch(lengths, c=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(n, c, generator=g) for n in lengths])


def test_fullgraph_matches_eager_and_does_not_recompile():
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(_fn, backend=cnt, fullgraph=True)
    w = torch.randn(8)
    # Lengths change at a fixed batch size, then the batch size changes (avoid 0/1, which dynamo specialises).
    for i, lengths in enumerate([[3, 5, 7], [4, 9, 2], [6, 2, 11], [5, 5, 5, 8], [2, 3], [7, 3, 9, 4, 5, 6]]):
        x = _batch(lengths, seed=i)
        out = f(x, w)
        assert isinstance(out, padless.NestedTensor) and out.shape == x.shape
        assert_close_samples(out, [_fn(s, w) for s in x.unbind()])
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} graphs"


def test_multi_ragged_compile_no_recompile():
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: (x * 2 - 1).relu() * x, backend=cnt, fullgraph=True)
    for i, hw in enumerate([[(4, 5), (2, 6)], [(3, 3), (7, 2)], [(5, 2), (2, 9), (3, 4)]]):
        x = padless.from_list([torch.randn(3, h, w) for h, w in hw])
        out = f(x)
        assert_close_samples(out, [((s * 2 - 1).relu() * s) for s in x.unbind()])
    assert cnt.frame_count == 1


@pytest.mark.parametrize("v", ["seq", "image", "pair", "empty_sample"])
def test_compiled_forward_backward_through_harness(v):
    check_op(lambda x: (x.tanh() * 3 + x * x).sigmoid(), v, compiled=True)


def test_compiled_training_step_gradients_match_eager():
    w = torch.randn(8, requires_grad=True)

    def step(x, w):
        return ((x * w).sigmoid() * x).mean()

    cstep = torch.compile(step, backend="aot_eager", fullgraph=True)
    for lengths in ([3, 5, 7], [6, 2, 4]):
        x = _batch(lengths)
        x.requires_grad_()
        x2 = x.detach().requires_grad_()
        w2 = w.detach().clone().requires_grad_()
        cstep(x, w).backward()
        step(x2, w2).backward()
        torch.testing.assert_close(x.grad.values(), x2.grad.values())
        torch.testing.assert_close(w.grad, w2.grad)
        w.grad = None


def test_inductor_backend():
    f = torch.compile(lambda x, w: (x * w + 1).relu(), fullgraph=True)
    w = torch.randn(8)
    x = _batch([3, 5, 7])
    assert_close_samples(f(x, w), [(s * w + 1).relu() for s in x.unbind()])


def test_flatten_contract():
    x = _batch([2, 3])
    names, ctx = x.__tensor_flatten__()
    # the pair row count rides along as a stride-0 carrier (padless.ops.common.carried)
    assert names == ["_values", "_offsets", "_sizes", "_pair_count"] and ctx == ((0,), ("pair_count",))
    y = type(x).__tensor_unflatten__({n: getattr(x, n) for n in names}, ctx, x.shape, x.stride())
    assert y.shape == x.shape and torch.equal(y.values(), x.values())




def test_compiled_model_with_ragged_reductions_one_graph():
    """Feature ops, a ragged mean and a ragged softmax: fullgraph, forward + backward, one graph."""
    torch.manual_seed(0)
    lin, ln = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def f(x):
        h = x + torch.nn.functional.gelu(lin(ln(x)))
        return h.mean(dim=1), torch.softmax(h, dim=1)

    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for lengths in ([3, 5, 7], [4, 9, 2], [6, 2, 11, 5]):
        x = padless.from_list([torch.randn(n, 8) for n in lengths], requires_grad=True)
        x2 = x.detach().requires_grad_()
        a, b = cf(x)
        ra, rb = f(x2)
        torch.testing.assert_close(a, ra)
        assert_close_samples(b, list(rb.unbind()))
        (a.sum() + (b * b).sum()).backward()
        (ra.sum() + (rb * rb).sum()).backward()
        torch.testing.assert_close(x.grad.values(), x2.grad.values())
    assert cnt.frame_count == 1


def test_ops_needing_host_metadata_fall_back_to_eager_under_compile():
    """Pair broadcasting, per-sample attention: graph breaks, eager results, no Dynamo crash."""
    torch.manual_seed(0)
    u, v = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def pair_block(x):
        p = u(x).unsqueeze(2) + v(x).unsqueeze(1)
        return p.mean(dim=2).sum(dim=1)

    def scores(x):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1)

    x = _batch([3, 5, 2])
    out = torch.compile(pair_block, backend="aot_eager")(x)
    torch.testing.assert_close(out, pair_block(x))
    out.sum().backward()
    s = torch.compile(scores, backend="aot_eager")(x)
    assert_close_samples(s, list(scores(x).unbind()))


def test_padless_registers_with_dynamo():
    from padless.tensor import dynamo

    import torch._dynamo.trace_rules as rules

    assert dynamo._done and dynamo._DIR in rules.SKIP_DIRS  # skipped as a frame...
    inline = getattr(rules, "BUILTIN_INLINE_WHEN_CALLED", None)  # ...inlined when called (torch >= 2.12)
    assert dynamo._DIR in inline if inline is not None else rules.check_file._padless
    assert not rules.check_file(dynamo.__file__, is_inlined_call=True).skipped
    assert rules.check_file(dynamo.__file__, is_inlined_call=False).skipped
