"""nn.LSTM / nn.GRU / nn.RNN on NestedTensors under CPU ``torch.autocast(dtype=torch.bfloat16)``:
the output and the final states have the dtype the module gives each sample alone (an LSTM's
were float32 where a sample alone gets bfloat16, on both padless paths: its own recurrence and
torch's packed kernel), and values and gradients agree within bfloat16's tolerance."""

import pytest
import torch
import torch.nn as nn

import padless

LENS = [3, 0, 5, 1]
BF16 = torch.bfloat16
TOL = dict(rtol=5e-2, atol=5e-2)

MODULES = {
    "lstm": lambda **kw: nn.LSTM(4, 3, **kw),
    "lstm_proj": lambda **kw: nn.LSTM(4, 3, proj_size=2, **kw),
    "gru": lambda **kw: nn.GRU(4, 3, **kw),
    "rnn_tanh": lambda **kw: nn.RNN(4, 3, **kw),
}


def _tuple(h):
    return h if isinstance(h, tuple) else (h,)


def _alone(m, s, seq_first):
    """Sample ``s`` (length > 0) alone under autocast: output ``(L, D*H)`` and final states."""
    if seq_first:
        out, h = m(s.unsqueeze(1))
        return out[:, 0], _tuple(h)
    out, h = m(s.unsqueeze(0))
    return out[0], _tuple(h)


@pytest.mark.parametrize("path", ["own_loop", "packed_kernel"])  # autograd recording, or not
@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_dtypes_and_values_match_each_sample_alone(kind, seq_first, path):
    torch.manual_seed(0)
    m = MODULES[kind](num_layers=2, bidirectional=True, batch_first=not seq_first)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 4, generator=g) for n in LENS]
    x = padless.from_list(xs)
    with torch.autocast("cpu", dtype=BF16), torch.set_grad_enabled(path == "own_loop"):
        out, h = m(x.transpose(0, 1) if seq_first else x)
        out = out.transpose(0, 1) if seq_first else out
        refs = [_alone(m, s, seq_first) if s.shape[0] else None for s in xs]
    want = next(r for r in refs if r is not None)
    assert out.dtype == want[0].dtype
    assert [t.dtype for t in _tuple(h)] == [t.dtype for t in want[1]]
    for i, r in enumerate(refs):
        if r is None:  # a sample of length 0 (torch refuses it): no rows, its state the zero h0
            assert out.unbind()[i].shape == (0, want[0].shape[-1])
            assert all(bool((t[:, i] == 0).all()) for t in _tuple(h))
            continue
        torch.testing.assert_close(out.unbind()[i], r[0], **TOL)
        for t, w in zip(_tuple(h), r[1]):
            torch.testing.assert_close(t[:, i : i + 1], w, **TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("lens", [LENS, [4]], ids=["batch", "one_sample"])
def test_gradients_match_each_sample_alone(kind, lens):
    torch.manual_seed(0)
    m = MODULES[kind](num_layers=1, bidirectional=True, batch_first=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 4, generator=g) for n in lens]
    cot = [torch.randn(n, 6, generator=g) for n in lens]
    x = padless.from_list(xs, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        out, _ = m(x)
        assert out.dtype == _alone(m, xs[0], False)[0].dtype
        (out.float() * padless.from_list(cot)).values().sum().backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    for i, (s, c) in enumerate(zip(xs, cot)):
        if not s.shape[0]:
            assert x.grad.unbind()[i].shape == (0, 4)
            continue
        s = s.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            (_alone(m, s, False)[0].float() * c).sum().backward()
        torch.testing.assert_close(x.grad.unbind()[i], s.grad, **TOL)
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=5e-2, atol=5e-2 * max(1.0, float(p.grad.abs().max())))
