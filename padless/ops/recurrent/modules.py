"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` on NestedTensors, module code unchanged.

The modules' ``forward`` ends in ``torch._VF.lstm`` (``gru``, ``rnn_tanh``, ``rnn_relu``),
which reaches ``NestedTensor.__torch_function__``; the handler here runs the batch in
``PackedSequence`` form (:mod:`padless.tensor.packed`): one row gather into time-major order
by length, the recurrence with the module's flat weights, one gather back. The recurrence is
padless's own (:mod:`padless.ops.recurrent.loop`) on the CPU when autograd records it, and
torch's packed kernel otherwise (see :func:`own_loop`; cuDNN on CUDA, as for
``pack_padded_sequence``). The plan is built once per batch from host metadata: no device sync.

* input: a NestedTensor of ``(L_i, E)`` samples with ``batch_first=True``, or its
  sequence-first view ``x.transpose(0, 1)`` (``(T, B, E)``) with ``batch_first=False``;
  the output comes back in the same form (``(L_i, D*H)`` samples), ``h_n`` (and ``c_n``)
  dense ``(num_layers*D, B, H)``, every sample as if run alone.
* ``hx``: dense, ``(num_layers*D, B, H)`` (a tuple ``(h0, c0)`` for the LSTM), or None.
* an empty sample (length 0) makes no output rows and keeps its initial state: its ``h_n``
  (and ``c_n``) is its ``h0`` (zeros without ``hx``), which is what zero recurrence steps
  leave. torch itself refuses length 0 (``pack_sequence``, ``pack_padded_sequence``).
* a NestedTensor passed as it is to a ``batch_first=False`` module is refused: such a module
  reads the batch size from dim 1 (for a NestedTensor the longest length) and checks or
  builds ``hx`` with it, so the state could not be per sample.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from padless.ops.common.seq_first import SeqFirstView, takes_seq_first
from padless.ops.recurrent.loop import run_packed
from padless.tensor.autograd import rewrap, values_of
from padless.tensor.core import NestedTensor
from padless.tensor.errors import StructureError
from padless.tensor.packed import PackPlan, pack_plan
from padless.tensor.registry import implements

#: The kernels behind ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh / relu), with the name
#: errors give them.
_KERNELS = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh", torch.rnn_relu: "rnn_relu"}
_ARGS = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")


def own_loop(data: Tensor, hx: tuple[Tensor, ...], params: list[Tensor]) -> bool:
    """Whether the batch runs on padless's own recurrence (:mod:`padless.ops.recurrent.loop`):
    on the CPU when autograd records the step, where torch's packed kernel spends most of its
    backward zero-filling (see ``loop``). Without a graph to record (inference, ``no_grad``)
    torch's kernel is faster (its loop is C++: 1.3-1.7x the own loop's forward on one CPU
    thread, B=32 H=128 to B=2 H=8, 2026-12-07), and other devices keep it (cuDNN on CUDA)."""
    if data.device.type != "cpu" or not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in (data, *hx, *params))


def _bind(op: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The input form's arguments by name. The packed form (``data, batch_sizes, hx, ...``,
    what a ``PackedSequence`` input calls) has no NestedTensor argument to take."""
    if len(args) > 3 and not isinstance(args[3], bool):
        raise TypeError(
            f"{op}(): a PackedSequence whose data or state is a NestedTensor; a PackedSequence holds dense "
            "packed rows. Pass the NestedTensor itself to the module (or x.to_packed_sequence())"
        )
    bound = dict(zip(_ARGS, args))
    for k, v in kwargs.items():
        if k not in _ARGS or k in bound:
            raise TypeError(f"{op}(): unexpected or repeated argument {k!r}")
        bound[k] = v
    missing = [k for k in _ARGS if k not in bound]
    if missing:
        raise TypeError(f"{op}(): missing arguments {missing}")
    return bound


def _states(op: str, hx: Any, b: int) -> tuple[Tensor, ...]:
    hs = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
    for name, h in zip(("h0", "c0"), hs):
        if isinstance(h, NestedTensor) or not isinstance(h, Tensor):
            raise StructureError(
                f"{op}(): the initial state {name} must be a dense (num_layers * num_directions, B, H) tensor, "
                f"got {type(h).__name__}"
            )
        if h.dim() != 3 or h.shape[1] != b:
            raise StructureError(
                f"{op}(): the initial state {name} has shape {tuple(h.shape)}; expected (num_layers * "
                f"num_directions, {b}, H): one state per sample of the batch of {b}"
            )
    return hs


def _final_states(plan: PackPlan, out: tuple[Tensor, ...], h0: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Final states back in batch order; an empty sample keeps its initial state."""
    res = []
    for h, init in zip(out, h0):
        if plan.empty.numel():
            h = torch.cat([h, init.index_select(1, plan.empty)], 1)
        res.append(h if plan.identity else h.index_select(1, plan.restore))
    return tuple(res)


def _no_steps(op: str, x: NestedTensor, params: list, bidirectional: bool, h0: tuple[Tensor, ...]) -> tuple:
    """Every sample empty: no output rows, every state its initial state."""
    width = (2 if bidirectional else 1) * h0[0].shape[-1]
    v = values_of(x)
    rows = v.new_zeros((0, width))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (v, *params)):
        rows = rows + sum(t.sum() for t in (v, *params)) * 0  # no step ran: zero gradients, still connected
    return (rewrap(rows, x), *h0)


@implements(*_KERNELS, accepts="packed (L_i, E) sequences (batch_first) or their sequence-first view; dense hx and weights")
def recurrent(func, *args: Any, **kwargs: Any) -> tuple:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (what the ``nn`` modules call) on packed rows."""
    op = _KERNELS[func]
    a = _bind(op, args, kwargs)
    inp = a["input"]
    seq_first = isinstance(inp, SeqFirstView)
    x = inp._nt if seq_first else inp
    if not isinstance(x, NestedTensor):
        raise TypeError(
            f"{op}(): the input must be the NestedTensor (or its sequence-first view); the initial states "
            "and the weights must be dense tensors"
        )
    batch_first = bool(a["batch_first"])
    if seq_first and batch_first:
        raise StructureError(
            f"{op}(): a sequence-first view (x.transpose(0, 1)) passed to a batch_first=True module; pass the "
            "NestedTensor itself"
        )
    if not seq_first and not batch_first:
        raise StructureError(
            f"{op}(): a NestedTensor (B, L_i, E) passed to a batch_first=False module, which reads the batch size "
            "from dim 1 (here the longest length) to check or build the initial state. Pass the sequence-first "
            "view x.transpose(0, 1) (the output comes back as one: .transpose(0, 1) gives the NestedTensor), "
            "or build the module with batch_first=True"
        )
    if x.sample_dim != 2:
        raise StructureError(
            f"{op}(): expects (L_i, E) sequences (a 3-D NestedTensor (B, L_i, E)), got {x.sample_dim}-D samples"
        )
    plan = pack_plan(x, f"{op}()")
    h0 = _states(op, a["hx"], x.batch_size)
    params = list(a["params"])
    if plan.n == 0:
        out = _no_steps(op, x, params, bool(a["bidirectional"]), h0)
    else:
        data = values_of(x).index_select(0, plan.rows)
        hx = tuple(h if plan.identity else h.index_select(1, plan.order) for h in h0)
        flags = (
            bool(a["has_biases"]), int(a["num_layers"]), float(a["dropout"]), bool(a["train"]), bool(a["bidirectional"]),
        )
        if own_loop(data, hx, params):
            res = run_packed(op, data, plan.batch_sizes.tolist(), hx, params, *flags)
        else:
            res = func(data, plan.batch_sizes, hx if func is torch.lstm else hx[0], params, *flags)
        rows = res[0].index_select(0, plan.unpack)
        out = (rewrap(rows, x), *_final_states(plan, tuple(res[1:]), h0))
    if torch.is_autocast_enabled(x.device.type):
        out = _as_under_autocast(out, _autocast_dtypes(func, a, x, h0, params))
    if seq_first:
        return (SeqFirstView(out[0]), *out[1:])
    return out


def _autocast_dtypes(func: Any, a: dict[str, Any], x: NestedTensor, h0: tuple[Tensor, ...], params: list) -> tuple:
    """The dtypes of ``(output, h_n[, c_n])`` that torch's own kernel gives a sample alone under
    the autocast in force. They differ from what the packed rows give: on the CPU, the input
    form of ``torch.lstm`` runs oneDNN's ``mkldnn_rnn_layer`` (an autocast lower-precision op:
    bfloat16 out) where the CPU supports it, the packed form and padless's own recurrence keep
    the cell state in float32 (float32 out); ``rnn_*`` and ``gru`` agree. Torch's kernel answers
    for itself, on a one-step sample without a graph (what its choice depends on: device, the
    CPU's support, grad mode); only under autocast."""
    dev = x.device.type
    key = (func, dev, torch.get_autocast_dtype(dev), torch.is_grad_enabled(), x.dtype, bool(a["has_biases"]),
           int(a["num_layers"]), bool(a["bidirectional"]), tuple(h.dtype for h in h0),
           tuple((p.dtype, tuple(p.shape)) for p in params))
    hit = _AUTOCAST_DTYPES.get(key)
    if hit is None:
        if len(_AUTOCAST_DTYPES) >= 64:  # a few module shapes per program: a small table, never a leak
            _AUTOCAST_DTYPES.clear()
        hit = _AUTOCAST_DTYPES[key] = _probe_dtypes(func, a, x, h0, params)
    return hit


#: :func:`_autocast_dtypes`' answers by what torch's choice depends on (one probe per module shape)
_AUTOCAST_DTYPES: dict[tuple, tuple] = {}


def _probe_dtypes(func: Any, a: dict[str, Any], x: NestedTensor, h0: tuple[Tensor, ...], params: list) -> tuple:
    one = values_of(x).detach().new_zeros((1, 1, x.shape[-1]))
    hx = tuple(h.detach().new_zeros((h.shape[0], 1, h.shape[2])) for h in h0)
    with warnings.catch_warnings():  # what torch says of its choice (no oneDNN for projections) is not asked here
        warnings.simplefilter("ignore")
        res = func(one, hx if func is torch.lstm else hx[0], [p.detach() for p in params], bool(a["has_biases"]),
                   int(a["num_layers"]), 0.0, False, bool(a["bidirectional"]), True)
    return tuple(r.dtype for r in res)


def _as_under_autocast(out: tuple, dtypes: tuple) -> tuple:
    """``out`` in ``dtypes`` (the rows and the states computed in the packed form's precision,
    rounded once to the dtype a sample alone gets, :func:`_autocast_dtypes`)."""
    nt, states = out[0], out[1:]
    if nt.dtype != dtypes[0]:
        nt = rewrap(values_of(nt).to(dtypes[0]), nt)
    return (nt, *(h if h.dtype == d else h.to(d) for h, d in zip(states, dtypes[1:])))


takes_seq_first(*_KERNELS)
