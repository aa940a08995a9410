"""padless's own recurrence over packed rows: the CPU path of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``.

Same contract as torch's packed kernel (``torch.lstm(data, batch_sizes, hx, params, ...)``):
``data`` holds the rows in ``PackedSequence`` order (time-major, samples longest first),
``hx`` the initial states of those samples in that order; it returns the output rows in the
same order and the final states ``(num_layers * D, n, H)``.

Why not torch's kernel on the CPU: its packed recurrence slices each step's input gates out
of the ``(sum L, G*H)`` projection, and the backward of every slice materialises a zero
gradient of the full projection and adds it up: one ``(sum L, G*H)`` fill and add per time
step, per direction and layer (about 90% of an LSTM step at ``benchmarks/rnn.py``'s shapes).
Here the projection of every row is one matmul per direction, cut into its time steps by one
``split`` (one backward node that concatenates the step gradients), and each step runs
``h @ W_hh^T`` on the samples still running. Every step is ordinary autograd ops, so
gradients (to the rows, the states and every weight) and double backward come from autograd.

Three samples of lengths 3, 2, 1 (``batch_sizes = [3, 2, 1]``), forward direction::

    step 0: rows of samples 0 1 2   h = cell(x_0, h0[0:3])
    step 1: rows of samples 0 1     h = cell(x_1, h[0:2])   sample 2 ends: h_n[2] = h[2]
    step 2: rows of sample  0       h = cell(x_2, h[0:1])   sample 1 ends: h_n[1] = h[1]
                                                            then h_n[0] = h[0]

The reverse direction runs the steps backwards: the batch grows, a sample joining at its last
step starts from its own ``h0`` row.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

State = tuple[Tensor, ...]
#: A step: (this step's input gates, the running samples' states, the step weights) -> new states.
Step = Callable[[Tensor, State, tuple], State]


def _lstm_step(gx: Tensor, state: State, w: tuple) -> State:
    w_hh_t, w_hr_t = w
    h, c = state
    i, f, g, o = torch.addmm(gx, h, w_hh_t).chunk(4, 1)
    c = torch.addcmul(torch.sigmoid(f) * c, torch.sigmoid(i), torch.tanh(g))
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr_t is None else h @ w_hr_t), c


def _gru_step(gx: Tensor, state: State, w: tuple) -> State:
    w_hh_t, b_hh = w
    (h,) = state
    gh = h @ w_hh_t if b_hh is None else torch.addmm(b_hh, h, w_hh_t)
    x_r, x_z, x_n = gx.chunk(3, 1)
    h_r, h_z, h_n = gh.chunk(3, 1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(torch.addcmul(x_n, r, h_n))
    return (torch.addcmul(n, z, h - n),)


def _tanh_step(gx: Tensor, state: State, w: tuple) -> State:
    return (torch.tanh(torch.addmm(gx, state[0], w[0])),)


def _relu_step(gx: Tensor, state: State, w: tuple) -> State:
    return (torch.relu(torch.addmm(gx, state[0], w[0])),)


def _weights(op: str, p: list[Tensor], has_biases: bool) -> tuple[Tensor, Tensor | None, tuple]:
    """(input weight, input-projection bias, step weights) of one layer and direction."""
    w_ih, w_hh = p[0], p[1]
    b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
    if op == "gru":  # b_hh stays inside the step: the reset gate scales h @ W_hn^T + b_hn
        return w_ih, b_ih, (w_hh.t(), b_hh)
    bias = None if b_ih is None else b_ih + b_hh
    if op == "lstm":
        w_hr = p[-1] if len(p) == (5 if has_biases else 3) else None
        return w_ih, bias, (w_hh.t(), None if w_hr is None else w_hr.t())
    return w_ih, bias, (w_hh.t(),)


_STEPS: dict[str, Step] = {"lstm": _lstm_step, "gru": _gru_step, "rnn_tanh": _tanh_step, "rnn_relu": _relu_step}


def _direction(step: Step, gates: Tensor, bs: list[int], h0: State, w: tuple, reverse: bool) -> tuple[Tensor, State]:
    """One direction of one layer: output rows (packed order) and final states (``(n, H)`` each)."""
    per_step = gates.split(bs)  # one node: its backward concatenates the step gradients
    outs: list[Tensor] = []
    if not reverse:
        state, done = h0, []
        for t, n in enumerate(bs):
            if n < state[0].shape[0]:  # samples n.. ended at step t - 1: their final states
                done.append(tuple(s[n:] for s in state))
                state = tuple(s[:n] for s in state)
            state = step(per_step[t], state, w)
            outs.append(state[0])
        done.append(state)
        done.reverse()  # longest first: the last still running come first
        return torch.cat(outs), tuple(torch.cat(parts) for parts in zip(*done))
    state = tuple(s[: bs[-1]] for s in h0)
    for t in range(len(bs) - 1, -1, -1):
        n, m = bs[t], state[0].shape[0]
        if n > m:  # samples m..n start here, at their last step, from their own initial state
            state = tuple(torch.cat([s, s0[m:n]]) for s, s0 in zip(state, h0))
        state = step(per_step[t], state, w)
        outs.append(state[0])
    outs.reverse()
    return torch.cat(outs), state


def run_packed(
    op: str,
    data: Tensor,
    batch_sizes: list[int],
    hx: State,
    params: list[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
) -> tuple[Tensor, ...]:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` on packed rows (``batch_sizes`` a
    host list, at least one step): ``(output rows, h_n[, c_n])``, as the packed kernel returns them."""
    step = _STEPS[op]
    d = 2 if bidirectional else 1
    per = len(params) // (num_layers * d)
    initial = [h.unbind(0) for h in hx]
    finals: list[State] = []
    x = data
    for layer in range(num_layers):
        if layer and train and dropout > 0:
            x = F.dropout(x, dropout, training=True)
        ys = []
        for k in range(layer * d, layer * d + d):
            w_ih, bias, w = _weights(op, params[k * per : (k + 1) * per], has_biases)
            gates = x @ w_ih.t() if bias is None else torch.addmm(bias, x, w_ih.t())
            y, final = _direction(step, gates, batch_sizes, tuple(h[k] for h in initial), w, reverse=k % d == 1)
            ys.append(y)
            finals.append(final)
        x = torch.cat(ys, 1) if d > 1 else ys[0]
    return (x, *(torch.stack(f) for f in zip(*finals)))
