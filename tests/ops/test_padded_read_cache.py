"""Dense operands read in padded coordinates are never served stale (issues 23, 39).

A table read in padded coordinates (rotary cos/sin, a position table, a mask) is gathered
through a row index cached on the structure; its values are gathered at every read. Some
writes to a dense tensor move no version counter (``p.data.copy_``, ``p.data = new``,
``vector_to_parameters``, an EMA through ``.data``), so no gathered rows may be kept: every
write, of whatever kind, is seen by the next read, with and without autograd.
"""

import gc

import pytest
import torch

import padless

LENS = [3, 0, 5, 1]


def _q(seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(2, n, 4, generator=g, dtype=torch.float64) for n in LENS], ragged_dims=(1,))


def _per_sample(q, table):
    return [s * table[0, :, : s.shape[1]] for s in q.unbind()]


def test_rotary_style_table_read_by_many_layers_and_its_backward(one_thread):
    q = _q().requires_grad_()
    cos = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64)
    out = q
    for _ in range(3):  # three layers multiply by the same table
        out = out * cos + out
    (out.values() ** 2).sum().backward()
    ref_in = [s.detach().clone().requires_grad_() for s in _q().unbind()]
    tot = 0
    for s in ref_in:
        o = s
        for _ in range(3):
            o = o * cos[0, :, : s.shape[1]] + o
        tot = tot + (o ** 2).sum()
    tot.backward()
    for got, ref in zip(q.grad.unbind(), ref_in):
        torch.testing.assert_close(got, ref.grad)


def test_in_place_change_of_the_table_is_read_again(one_thread):
    q = _q()
    t = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64)
    first = q * t
    t.mul_(3.0)
    for got, ref in zip((q * t).unbind(), _per_sample(q, t)):
        torch.testing.assert_close(got, ref)
    for got, ref in zip(first.unbind(), _per_sample(q, t / 3.0)):
        torch.testing.assert_close(got, ref)


def test_another_table_at_a_reused_address_is_read(one_thread):
    q = _q()
    for seed in range(4):
        t = torch.full((1, 1, max(LENS), 4), float(seed), dtype=torch.float64)
        for got, ref in zip((q * t).unbind(), _per_sample(q, t)):
            torch.testing.assert_close(got, ref)
        del t
        gc.collect()


def test_table_that_requires_grad_gets_its_gradient(one_thread):
    q = _q()
    t = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64, requires_grad=True)
    (q * t).values().sum().backward()
    (q * t).values().sum().backward()
    expect = torch.zeros_like(t)
    for s in q.unbind():
        expect[0, :, : s.shape[1]] += 2 * s.sum(0)
    torch.testing.assert_close(t.grad, expect)


def test_rows_written_in_place_through_expand_as_are_read_again(one_thread):
    q = _q()
    t = torch.randn(1, 2, max(LENS), 4, dtype=torch.float64)
    e = t.expand_as(q)
    e.values().add_(1.0)
    for got, s in zip((q * t).unbind(), q.unbind()):
        torch.testing.assert_close(got, s * t[0, :, : s.shape[1]])


def test_the_issue_example_a_data_write_is_read():
    x = padless.from_list([torch.randn(3, 4), torch.randn(5, 4)])
    pos = torch.zeros(1, 5, 4)  # extent 5 == envelope: padded coordinates
    y = x + pos
    pos.data.fill_(1.0)
    y2 = x + pos
    assert torch.equal(y.values(), x.values())
    assert torch.equal(y2.values(), x.values() + 1)


# Every way a user writes a dense tensor: (name, write(p, new_values)). ``p`` is a Parameter or
# a buffer; the writes through ``.data`` and ``p.data = ...`` move no version counter of ``p``.
def _data_fill(p, v):
    p.data.copy_(v)


def _data_assign(p, v):
    p.data = v.clone()


def _vector_to_parameters(p, v):
    torch.nn.utils.vector_to_parameters(v.flatten().clone(), [p])


def _ema_through_data(p, v):  # the timm/torchvision EMA idiom: ema.mul_(d).add_(w, alpha=1 - d) on .data
    p.data.mul_(0.0).add_(v, alpha=1.0)


def _copy_no_grad(p, v):
    with torch.no_grad():
        p.copy_(v)


def _load_state_dict(p, v):
    m = torch.nn.Module()
    m.register_parameter("w", p) if isinstance(p, torch.nn.Parameter) else m.register_buffer("w", p)
    m.load_state_dict({"w": v.clone()})


def _in_place_op(p, v):
    with torch.no_grad():
        p.mul_(0.0).add_(v)


def _index_put(p, v):
    with torch.no_grad():
        p[...] = v


def _detach_write(p, v):
    p.detach().copy_(v)


WRITES = [_data_fill, _data_assign, _vector_to_parameters, _ema_through_data, _copy_no_grad, _load_state_dict,
          _in_place_op, _index_put, _detach_write]


def _dense_ref(op, x, d, per_sample):
    """``op(x[i], d[i or 0][:L_i])`` sample by sample."""
    out = []
    for i, s in enumerate(x.unbind()):
        di = d[i if per_sample else 0]
        out.append(op(s, di[: s.shape[0]]))
    return out


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("kind", ["parameter", "buffer"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("per_sample", [False, True], ids=["shared", "per_sample"])
def test_every_write_to_a_dense_operand_is_read(write, kind, grad, per_sample):
    lens = [3, 0, 5, 1] if per_sample else [5]  # a one-sample batch for the shared table
    x = padless.from_list([torch.randn(n, 4, dtype=torch.float64) for n in lens])
    b = len(lens) if per_sample else 1
    first = torch.randn(b, max(lens), 4, dtype=torch.float64)
    p = torch.nn.Parameter(first.clone()) if kind == "parameter" else first.clone()
    ops = [lambda a, d: a + d, lambda a, d: a * d, lambda a, d: torch.where(d > 0, a, d)]
    with torch.set_grad_enabled(grad):
        for op in ops:  # read once (the old code kept these rows), then write, then read again
            op(x, p)
        new = torch.randn(b, max(lens), 4, dtype=torch.float64)
        write(p, new)
        assert torch.equal(p.detach(), new)
        for op in ops:
            got = op(x, p)
            for g, r in zip(got.unbind(), _dense_ref(op, x, new, per_sample)):
                torch.testing.assert_close(g.detach(), r)
            if grad and kind == "parameter":
                assert got.requires_grad


@pytest.mark.parametrize("write", [_data_fill, _data_assign, _ema_through_data], ids=lambda f: f.__name__.strip("_"))
def test_a_data_write_to_a_pair_bias_is_read(write):
    ns = [2, 0, 3]
    x = padless.from_list([torch.randn(n, n, 1, dtype=torch.float64) for n in ns], ragged_dims=(0, 1))
    bias = torch.zeros(len(ns), 3, 3, 1, dtype=torch.float64)
    with torch.no_grad():
        x + bias
        new = torch.randn_like(bias)
        write(bias, new)
        got = x + bias
    for i, (g, s) in enumerate(zip(got.unbind(), x.unbind())):
        torch.testing.assert_close(g, s + new[i, : s.shape[0], : s.shape[1]])


def test_a_data_write_to_a_rotary_table_is_read_by_the_next_layer_and_backward():
    q = _q().requires_grad_()
    cos = torch.randn(1, 1, max(LENS), 4, dtype=torch.float64)
    (q * cos).values().sum().backward()
    cos.data.mul_(2.0)  # a new step writes its table through .data
    q.grad = None
    (q * cos).values().sum().backward()
    for g, s in zip(q.grad.unbind(), q.unbind()):
        torch.testing.assert_close(g, cos[0, :, : s.shape[1]].expand_as(s))
