"""nn.LSTM / nn.GRU / nn.RNN on NestedTensors, module code unchanged: every sample as if run alone."""

import pytest
import torch
import torch.nn as nn

import padless
from padless.testing import assert_close_samples

LENS = [3, 0, 5, 1, 5]  # an empty sample, a tie, lengths out of order

MODULES = {
    "lstm": lambda **kw: nn.LSTM(4, 3, **kw),
    "lstm_proj": lambda **kw: nn.LSTM(4, 3, proj_size=2, **kw),
    "gru": lambda **kw: nn.GRU(4, 3, **kw),
    "rnn_tanh": lambda **kw: nn.RNN(4, 3, **kw),
    "rnn_relu": lambda **kw: nn.RNN(4, 3, nonlinearity="relu", **kw),
}


def _module(kind, layers=2, bidirectional=True, batch_first=True, seed=0):
    torch.manual_seed(seed)
    m = MODULES[kind](num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, dropout=0.5)
    return m.double().eval()  # dropout between layers is off in eval: the per-sample reference is exact


def _samples(lens=LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in lens]


def _initial(m, b, seed=2):
    g = torch.Generator().manual_seed(seed)
    d = 2 if m.bidirectional else 1
    h = torch.randn(m.num_layers * d, b, m.proj_size or m.hidden_size, generator=g, dtype=torch.float64)
    if isinstance(m, nn.LSTM):
        return h, torch.randn(m.num_layers * d, b, m.hidden_size, generator=g, dtype=torch.float64)
    return h


def _tuple(h):
    return h if isinstance(h, tuple) else (h,)


def _select(hx, i):
    return tuple(h[:, i : i + 1] for h in _tuple(hx))


def _alone(m, s, hx_i):
    """The module on one sample, batch_first, its state shaped (layers*D, 1, H); length 0 keeps hx."""
    if s.shape[0] == 0:
        d = 2 if m.bidirectional else 1
        return s.new_zeros((0, d * (m.proj_size or m.hidden_size))), hx_i
    arg = hx_i if isinstance(m, nn.LSTM) else (None if hx_i is None else hx_i[0])
    if m.batch_first:
        out, h = m(s.unsqueeze(0), arg)
        return out[0], _tuple(h)
    out, h = m(s.unsqueeze(1), arg)
    return out[:, 0], _tuple(h)


def _reference(m, xs, hx):
    outs, finals = [], []
    for i, s in enumerate(xs):
        if hx is None:
            d = 2 if m.bidirectional else 1
            zeros = [torch.zeros(m.num_layers * d, 1, m.proj_size or m.hidden_size, dtype=s.dtype)]
            if isinstance(m, nn.LSTM):
                zeros.append(torch.zeros(m.num_layers * d, 1, m.hidden_size, dtype=s.dtype))
            hx_i = tuple(zeros) if s.shape[0] == 0 else None
        else:
            hx_i = _select(hx, i)
        o, h = _alone(m, s, hx_i)
        outs.append(o)
        finals.append(h)
    return outs, [torch.cat([f[k] for f in finals], 1) for k in range(len(finals[0]))]


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("with_hx", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_matches_each_sample_alone(kind, with_hx, bidirectional):
    m = _module(kind, bidirectional=bidirectional)
    xs = _samples()
    x = padless.from_list(xs)
    hx = _initial(m, len(xs)) if with_hx else None
    out, h = m(x, hx)
    refs, h_refs = _reference(m, xs, hx)
    assert isinstance(out, padless.NestedTensor) and out.ragged_dims == (0,)
    assert_close_samples(out, refs)
    for got, want in zip(_tuple(h), h_refs):
        assert not isinstance(got, padless.NestedTensor)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_sequence_first_view_with_batch_first_false(kind):
    m = _module(kind, batch_first=False)
    xs = _samples()
    x = padless.from_list(xs)
    hx = _initial(m, len(xs))
    out, h = m(x.transpose(0, 1), hx)  # what a (T, B, E) pipeline passes
    refs, h_refs = _reference(m, xs, hx)
    assert tuple(out.shape) == (5, len(xs), 6)
    assert_close_samples(out.transpose(0, 1), refs)
    for got, want in zip(_tuple(h), h_refs):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["lstm", "lstm_proj", "gru", "rnn_relu"])
def test_gradients_to_input_state_and_weights(kind):
    m = _module(kind)
    xs = _samples()
    hx = _initial(m, len(xs))
    hx = tuple(h.requires_grad_() for h in _tuple(hx))
    arg = hx if isinstance(m, nn.LSTM) else hx[0]
    x = padless.from_list(xs, requires_grad=True)
    out, h = m(x, arg)
    g = torch.Generator().manual_seed(3)
    cot = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out.unbind()]
    h_cot = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in _tuple(h)]
    loss = (out * padless.from_list(cot)).sum() + sum((t * c).sum() for t, c in zip(_tuple(h), h_cot))
    params = list(m.parameters())
    got = torch.autograd.grad(loss, [x, *hx, *params])

    dense = [s.clone().requires_grad_() for s in xs]
    hx_ref = tuple(t.detach().clone().requires_grad_() for t in hx)
    refs, h_refs = _reference(m, dense, hx_ref)
    ref_loss = sum((o * c).sum() for o, c in zip(refs, cot)) + sum((t * c).sum() for t, c in zip(h_refs, h_cot))
    want = torch.autograd.grad(ref_loss, [*dense, *hx_ref, *params], allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for t, w in zip([*dense, *hx_ref, *params], want)]  # empty sample
    assert_close_samples(got[0], want[: len(xs)], what="input gradient")
    for a, b in zip(got[1:], want[len(xs) :]):
        torch.testing.assert_close(a, b)


def test_one_sample_and_all_empty():
    m = _module("lstm")
    xs = _samples([4])
    out, (h, c) = m(padless.from_list(xs))
    refs, h_refs = _reference(m, xs, None)
    assert_close_samples(out, refs)
    torch.testing.assert_close(h, h_refs[0])

    hx = _initial(m, 2)
    empty = padless.from_list([torch.zeros(0, 4, dtype=torch.float64)] * 2)
    out, (h, c) = m(empty, hx)
    assert out.values().shape == (0, 6)
    torch.testing.assert_close(h, hx[0])
    torch.testing.assert_close(c, hx[1])


@pytest.mark.parametrize("lens", [[5, 4, 4, 2], [5, 3, 0], [0, 2], [2, 0, 0, 1]])
def test_sorted_batches_and_trailing_empty_samples(lens):
    m = _module("gru")
    xs = _samples(lens)  # [5, 4, 4, 2] is already sorted: no state gather
    hx = _initial(m, len(xs))
    out, h = m(padless.from_list(xs), hx)
    refs, h_refs = _reference(m, xs, hx)
    assert_close_samples(out, refs)
    torch.testing.assert_close(h, h_refs[0])


def test_training_dropout_runs():
    m = _module("gru")
    xs = _samples([5, 4, 4, 2])
    m.train()  # dropout between layers: random, but it runs (on the CPU: padless's own recurrence)
    out, h = m(padless.from_list(xs, requires_grad=True))
    out.values().sum().backward()


def test_a_linear_after_the_rnn_keeps_the_batch():
    m = _module("lstm")
    head = nn.Linear(6, 2).double()
    xs = _samples()
    y = head(m(padless.from_list(xs))[0])
    refs, _ = _reference(m, xs, None)
    assert_close_samples(y, [head(r) for r in refs])


def test_nested_tensor_with_batch_first_false_is_refused():
    m = _module("lstm", batch_first=False)
    with pytest.raises(padless.StructureError, match=r"lstm\(\): a NestedTensor .* batch_first=False .* x\.transpose\(0, 1\)"):
        m(padless.from_list(_samples()))


def test_sequence_first_view_with_batch_first_true_is_refused():
    m = _module("gru")
    x = padless.from_list(_samples([2, 2]))  # B == L: torch's own checks pass
    with pytest.raises(padless.StructureError, match=r"gru\(\): a sequence-first view .* batch_first=True"):
        m(x.transpose(0, 1))


def test_bad_layouts_are_refused():
    m = _module("gru")
    ragged_features = padless.from_list([torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)])
    with pytest.raises(padless.StructureError, match=r"gru\(\): expects a batch of sequences .* ragged dims \(0, 1\)"):
        torch.gru(ragged_features, torch.zeros(4, 2, 3, dtype=torch.float64), m._flat_weights, True, 2, 0.0, False, True, True)
    images = padless.from_list([torch.randn(2, 3, 4, dtype=torch.float64)] * 2)
    with pytest.raises(padless.StructureError, match=r"gru\(\): expects \(L_i, E\) sequences .* got 3-D samples"):
        torch.gru(images, torch.zeros(4, 2, 3, dtype=torch.float64), m._flat_weights, True, 2, 0.0, False, True, True)
    x = padless.from_list(_samples([2, 3]))
    with pytest.raises(padless.StructureError, match=r"gru\(\): the initial state h0 must be a dense"):
        torch.gru(x, padless.from_list([torch.zeros(2, 3)] * 2), m._flat_weights, True, 2, 0.0, False, True, True)
    with pytest.raises(padless.StructureError, match=r"gru\(\): the initial state h0 has shape \(4, 3, 3\)"):
        torch.gru(x, torch.zeros(4, 3, 3, dtype=torch.float64), m._flat_weights, True, 2, 0.0, False, True, True)


def test_float32_module_default():
    torch.manual_seed(0)
    m = nn.LSTM(4, 8, num_layers=2, bidirectional=True, batch_first=True).eval()
    xs = [torch.randn(n, 4) for n in (6, 2, 0, 9)]
    out, (h, c) = m(padless.from_list(xs))
    refs, h_refs = _reference(m, xs, None)
    assert_close_samples(out, refs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_refs[0], atol=1e-5, rtol=1e-5)


def test_empty_batch_runs():
    m = _module("lstm")
    x = padless.from_list(_samples([2]))[torch.tensor([False])]
    out, (h, c) = m(x)
    assert out.batch_size == 0 and h.shape == (4, 0, 3)


def test_dense_input_with_a_nested_state_and_nested_packed_data_are_refused():
    m = _module("gru")
    w = m._flat_weights
    h0 = padless.from_list([torch.zeros(4, 3, dtype=torch.float64)] * 2)
    with pytest.raises(TypeError, match=r"gru\(\): the input must be the NestedTensor .* must be dense"):
        torch.gru(torch.zeros(2, 3, 4, dtype=torch.float64), h0, w, True, 2, 0.0, False, True, True)
    x = padless.from_list(_samples([2, 3]))
    with pytest.raises(TypeError, match=r"gru\(\): a PackedSequence whose data or state is a NestedTensor"):
        torch.gru(x, torch.tensor([2, 2, 1]), torch.zeros(4, 2, 3, dtype=torch.float64), w, True, 2, 0.0, False, True)
