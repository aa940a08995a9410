"""padless's own recurrence (the CPU path of nn.LSTM / nn.GRU / nn.RNN) against torch's packed kernel
and against each sample alone; the torch-kernel path (kept for CUDA) against each sample alone."""

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_sequence

import padless
from padless.ops.recurrent import modules
from padless.ops.recurrent.loop import run_packed
from padless.testing import assert_close_samples

KINDS = {
    "lstm": lambda **kw: nn.LSTM(3, 2, **kw),
    "lstm_proj_nobias": lambda **kw: nn.LSTM(3, 2, proj_size=1, bias=False, **kw),
    "gru": lambda **kw: nn.GRU(3, 2, **kw),
    "gru_nobias": lambda **kw: nn.GRU(3, 2, bias=False, **kw),
    "rnn_tanh_nobias": lambda **kw: nn.RNN(3, 2, bias=False, **kw),
    "rnn_relu": lambda **kw: nn.RNN(3, 2, nonlinearity="relu", **kw),
}
_OP = {nn.LSTM: "lstm", nn.GRU: "gru"}


def _module(kind, layers=2, bidirectional=True):
    torch.manual_seed(0)
    return KINDS[kind](num_layers=layers, bidirectional=bidirectional, batch_first=True).double().eval()


def _op(m):
    return _OP.get(type(m)) or ("rnn_relu" if m.nonlinearity == "relu" else "rnn_tanh")


def _states(m, n, seed=2):
    g = torch.Generator().manual_seed(seed)
    d = 2 if m.bidirectional else 1
    hs = [torch.randn(m.num_layers * d, n, m.proj_size or m.hidden_size, generator=g, dtype=torch.float64)]
    if isinstance(m, nn.LSTM):
        hs.append(torch.randn(m.num_layers * d, n, m.hidden_size, generator=g, dtype=torch.float64))
    return tuple(h.requires_grad_() for h in hs)


def _grads(outs, inputs, seed=3):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    got = torch.autograd.grad(loss, inputs, allow_unused=True)  # an empty sample alone is unused
    return [torch.zeros_like(t) if d is None else d for t, d in zip(inputs, got)]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("lens", [[4, 1, 4, 2], [1], [1, 1, 1]])
def test_own_loop_matches_torch_packed_kernel(kind, lens):
    """Outputs, final states and every gradient equal torch's packed kernel on the same packed rows."""
    m = _module(kind)
    op = _op(m)
    g = torch.Generator().manual_seed(1)
    ps = pack_sequence([torch.randn(n, 3, generator=g, dtype=torch.float64) for n in lens], enforce_sorted=False)
    data = ps.data.clone().requires_grad_()
    hx = _states(m, len(lens))
    params = list(m._flat_weights)
    args = (m.bias, m.num_layers, 0.0, False, True)
    got = run_packed(op, data, ps.batch_sizes.tolist(), hx, params, *args)
    want = getattr(torch, op)(data, ps.batch_sizes, hx if op == "lstm" else hx[0], params, *args)
    want = want if isinstance(want, tuple) else tuple(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for a, b in zip(_grads(got, [data, *hx, *params]), _grads(want, [data, *hx, *params])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("path", ["own", "torch_kernel"])
@pytest.mark.parametrize("kind", ["lstm_proj_nobias", "gru_nobias", "rnn_relu"])
def test_each_path_matches_each_sample_alone(kind, path, monkeypatch):
    """Both paths (padless's loop on the CPU, torch's kernel elsewhere), with an empty sample,
    samples of length 1 and a tie: outputs, final states and every gradient per sample."""
    if path == "torch_kernel":
        monkeypatch.setattr(modules, "own_loop", lambda *a: False)
    m = _module(kind)
    lens = [3, 0, 1, 3, 1]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in lens]
    hx = _states(m, len(lens))
    x = padless.from_list(xs, requires_grad=True)
    out, h = m(x, hx if isinstance(m, nn.LSTM) else hx[0])
    h = h if isinstance(h, tuple) else (h,)
    params = list(m.parameters())
    got = _grads((out.values(), *h), [x, *hx, *params])

    dense = [s.clone().requires_grad_() for s in xs]
    hx_ref = tuple(t.detach().clone().requires_grad_() for t in hx)
    refs, finals = [], []
    for i, s in enumerate(dense):
        h_i = tuple(t[:, i : i + 1] for t in hx_ref)
        if s.shape[0] == 0:  # zero steps: no rows, the initial state is the final state
            refs.append(s.new_zeros((0, out.values().shape[1])))
            finals.append(h_i)
            continue
        o, f = m(s[None], h_i if isinstance(m, nn.LSTM) else h_i[0])
        refs.append(o[0])
        finals.append(f if isinstance(f, tuple) else (f,))
    assert_close_samples(out, refs)
    h_ref = [torch.cat([f[k] for f in finals], 1) for k in range(len(h))]
    for a, b in zip(h, h_ref):
        torch.testing.assert_close(a, b)
    want = _grads((torch.cat(refs), *h_ref), [*dense, *hx_ref, *params])
    assert_close_samples(got[0], want[: len(xs)], what="input gradient")
    for a, b in zip(got[1:], want[len(xs) :]):
        torch.testing.assert_close(a, b)


def test_double_backward_through_the_loop():
    """Every step is ordinary autograd: second derivatives exist and are right."""
    m = _module("lstm", layers=1)
    g = torch.Generator().manual_seed(1)
    ps = pack_sequence([torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (3, 1)])
    hx = tuple(h.detach() for h in _states(m, 2))
    w = [p.detach() for p in m._flat_weights]

    def f(data, w_hh):
        out, h, c = run_packed("lstm", data, [2, 1, 1], hx, [w[0], w_hh, *w[2:4], *w[4:]], True, 1, 0.0, False, True)
        return out.sum() + h.sum() + c.sum()

    data = ps.data.clone().requires_grad_()
    w_hh = w[1].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(f, (data, w_hh))


def test_training_dropout_between_layers():
    m = _module("lstm")
    m.dropout = 0.5
    xs = padless.from_list([torch.randn(n, 3, dtype=torch.float64) for n in (4, 2)])
    eval_out = m(xs)[0].values()
    m.train()
    torch.manual_seed(5)
    train_out = m(xs)[0].values()
    assert not torch.allclose(train_out, eval_out)  # the second layer read dropped rows
    m.dropout = 0.0
    torch.testing.assert_close(m(xs)[0].values(), eval_out)  # no dropout: train mode is eval mode


@pytest.mark.parametrize("grad", ["none", "weights", "input", "no_grad"])
def test_the_loop_runs_where_autograd_records(grad, monkeypatch):
    """The own loop on the CPU when a gradient is recorded; torch's kernel (faster without a graph) otherwise."""
    calls = []
    monkeypatch.setattr(modules, "run_packed", lambda *a: calls.append(1) or run_packed(*a))
    m = _module("gru")
    m.requires_grad_(grad == "weights" or grad == "no_grad")
    x = padless.from_list([torch.randn(n, 3, dtype=torch.float64) for n in (3, 1)], requires_grad=grad == "input")
    with torch.set_grad_enabled(grad != "no_grad"):
        out, _ = m(x)
    assert len(calls) == (grad in ("weights", "input"))
    assert_close_samples(out, [m(s[None])[0][0] for s in x.unbind()])
