"""Short paths along static dims (padless.ops.rows.static_dims) and the remembered plan of a
padded-coordinate read (padless.ops.common.padded): indexing, select, cat and stack of one
structure, a rotary embedding. Every op runs twice (the second call takes the remembered form)
and is checked per sample against the dense op on each sample alone: values, structure,
gradients; empty samples and one-sample batches included. Every refusal stays."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.ops.common import padded
from padless.ops.rows import static_dims
from padless.tensor.errors import StructureError

LENGTHS = [[3, 0, 5], [4], [0], [2, 6, 1]]


def _samples(lengths, heads_first, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*((2, n) if heads_first else (n, 2)), 6, generator=g, dtype=torch.float64) for n in lengths]


def _rotate_half(t):
    return torch.cat((-t[..., 3:], t[..., :3]), dim=-1)


# each written once for both sides: o is 1 on the NestedTensor (dim 0 is the batch), 0 on a sample
OPS = {
    "lo": lambda t, o: t[..., :3],
    "hi": lambda t, o: t[..., 3:],
    "step": lambda t, o: t[..., 1::2],
    "negative": lambda t, o: t[..., -4:-1:2],
    "int": lambda t, o: t[..., -1],
    "none": lambda t, o: t[..., None, 2:],
    "leading": lambda t, o: t[(slice(None),) * o + (slice(None), slice(None), 0)],
    "select": lambda t, o: t.select(-1, 2),
    "select_neg_index": lambda t, o: t.select(-1, -2),
    "narrow": lambda t, o: t.narrow(-1, 1, 4),
    "rotate_half": lambda t, o: _rotate_half(t),
    "cat_negative_dim": lambda t, o: torch.cat((t, t * 2, t[..., :1]), dim=-1),
    "stack_last": lambda t, o: torch.stack((t, -t), dim=-1),
    "stack_first": lambda t, o: torch.stack((t, t * 0.5), dim=o),
}


@pytest.mark.parametrize("heads_first", [False, True], ids=["(L_i, 2, 6)", "(2, L_i, 6)"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_static_dim_op_matches_every_sample_alone(name, lengths, heads_first):
    f = OPS[name]
    xs = _samples(lengths, heads_first)
    x = padless.from_list(xs, ragged_dims=(1,) if heads_first else (0,)).requires_grad_()
    outs = [f(x, 1), f(x, 1)]  # the second call takes the remembered form
    assert outs[0]._meta is outs[1]._meta  # one structure for both
    (outs[0].values().sum() + outs[1].values().pow(2).sum()).backward()
    for i, t in enumerate(xs):
        ti = t.clone().requires_grad_()
        ref = [f(ti, 0), f(ti, 0)]
        (ref[0].sum() + ref[1].pow(2).sum()).backward()
        for out, r in zip(outs, ref):
            assert out[i].shape == r.shape
            torch.testing.assert_close(out[i], r)
        torch.testing.assert_close(x.grad[i], ti.grad)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_rotary_embedding_on_heads_first_queries_matches_every_sample_alone(lengths):
    """transformers' apply_rotary_pos_emb on (B, H, L_i, d) queries with dense cos/sin tables
    (B, 1, Lmax, d) in padded coordinates; the tables need a gradient too."""
    xs = _samples(lengths, heads_first=True)
    q = padless.from_list(xs, ragged_dims=(1,)).requires_grad_()
    lmax = q.shape[2]
    g = torch.Generator().manual_seed(3)
    cos = torch.randn(len(xs), 1, lmax, 6, generator=g, dtype=torch.float64).requires_grad_()
    sin = torch.randn(len(xs), 1, lmax, 6, generator=g, dtype=torch.float64)
    outs = [q * cos + _rotate_half(q) * sin for _ in range(2)]
    (outs[0].values().sum() + outs[1].values().pow(2).sum()).backward()
    cos_grad = torch.zeros_like(cos)
    for i, t in enumerate(xs):
        ti, ci = t.clone().requires_grad_(), cos[i, :, : t.shape[1]].detach().clone().requires_grad_()
        ref = [ti * ci + _rotate_half(ti) * sin[i, :, : t.shape[1]] for _ in range(2)]
        (ref[0].sum() + ref[1].pow(2).sum()).backward()
        for out, r in zip(outs, ref):
            torch.testing.assert_close(out[i], r)
        torch.testing.assert_close(q.grad[i], ti.grad)
        cos_grad[i, :, : t.shape[1]] = ci.grad
    torch.testing.assert_close(cos.grad, cos_grad)  # zeros at padded positions


def test_forms_are_remembered_per_structure(monkeypatch):
    calls = []
    index_form, join_form = static_dims._index_form, static_dims._join_form
    monkeypatch.setattr(static_dims, "_index_form", lambda *a: calls.append("index") or index_form(*a))
    monkeypatch.setattr(static_dims, "_join_form", lambda *a: calls.append("join") or join_form(*a))
    x = padless.from_list(_samples([3, 1], heads_first=True), ragged_dims=(1,))
    for _ in range(3):
        _rotate_half(x)
    assert sorted(calls) == ["index", "index", "join"]


def test_remembered_forms_are_bounded_per_structure():
    x = padless.from_list([torch.randn(2, 3 * static_dims.MAX_FORMS), torch.randn(4, 3 * static_dims.MAX_FORMS)])
    for k in range(2 * static_dims.MAX_FORMS):
        torch.testing.assert_close(x[..., k][1], x[1][..., k])
    assert len(x._meta.derived[static_dims._KEY]) <= static_dims.MAX_FORMS


def test_a_write_into_a_static_slice_writes_through_as_before():
    xs = _samples([3, 0, 2], heads_first=False)
    w = padless.from_list(xs).requires_grad_()
    y = w * 1
    v = y[..., :3]
    v.mul_(2)  # a view of y: y changes, and the gradient knows it
    y.values().sum().backward()
    for i, t in enumerate(xs):
        ti = t.clone().requires_grad_()
        yi = ti * 1
        yi[..., :3].mul_(2)
        yi.sum().backward()
        torch.testing.assert_close(y[i], yi)
        torch.testing.assert_close(w.grad[i], ti.grad)


@pytest.mark.parametrize("index, error, match", [
    ((Ellipsis, 6), IndexError, "out of range for static dim 3 of size 6"),
    ((Ellipsis, slice(None, None, -1)), StructureError, "slice step must be positive"),
    ((slice(None), slice(None), slice(None), slice(None), 0), IndexError, "too many indices"),
    ((Ellipsis, 0, Ellipsis), IndexError, "single ellipsis"),
])
def test_refusals_stay_on_every_call(index, error, match):
    x = padless.from_list(_samples([3, 1], heads_first=False))
    for _ in range(2):
        with pytest.raises(error, match=match):
            x[index]


def test_ragged_dim_cut_is_refused_and_joins_of_other_structures_take_the_general_path():
    x = padless.from_list(_samples([3, 1], heads_first=False))
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="dim 1 is ragged"):
            x[:, ::2]
    y = padless.from_list(_samples([2, 2], heads_first=False))
    for _ in range(2):
        with pytest.raises(StructureError, match="cat"):
            torch.cat((x, y), dim=-1)
    out = torch.cat((x, x), dim=1)  # the ragged dim: each sample's rows twice
    for i, t in enumerate(_samples([3, 1], heads_first=False)):
        torch.testing.assert_close(out[i], torch.cat((t, t), 0))


def test_padded_read_plan_reads_the_operand_values_every_time():
    """Only the read's index map is remembered: a .data write to the table (no version bump)
    is seen by the next read, and strict mode refuses a read that was remembered."""
    q = padless.from_list(_samples([3, 0, 2], heads_first=True), ragged_dims=(1,))
    table = torch.randn(3, 1, 3, 6, dtype=torch.float64)
    first = q * table
    table.data = table.data + 1
    second = q * table
    for i, t in enumerate(_samples([3, 0, 2], heads_first=True)):
        n = t.shape[1]
        torch.testing.assert_close(first[i], t * (table[i, :, :n] - 1))
        torch.testing.assert_close(second[i], t * table[i, :, :n])
    with padless.padded_reads(strict=True):
        with pytest.raises(StructureError, match="strict padded reads are on"):
            q * table
    with pytest.raises(StructureError, match="spans ragged dim 2"):
        q * torch.randn(3, 1, 2, 6, dtype=torch.float64)


def test_padded_read_plans_are_bounded_per_structure():
    xs = [torch.randn(3, 2, 2, 2, 2, 2), torch.randn(1, 2, 2, 2, 2, 2)]
    q = padless.from_list(xs).requires_grad_()  # (the gradient path reads by padded_rows)
    for k in range(32):  # 32 operand shapes: every static extent 1 or 2
        bits = [1 + (k >> j & 1) for j in range(5)]
        d = torch.randn(2, 3, *bits)
        out = q * d
        for i, t in enumerate(xs):
            torch.testing.assert_close(out[i], (t * d[i, : t.shape[0]]))
    assert len(q._meta.derived[padded._PLANS]) <= padded._MAX_PLANS


@pytest.mark.parametrize("grad", [False, True])
def test_padded_read_of_an_operand_with_a_static_extent_0(grad):
    """fuzz seed 300926: the read's grid was reshaped with -1, ambiguous for 0 elements."""
    xs = [torch.randn(0, 0, 0), torch.randn(4, 4, 0), torch.randn(2, 3, 0)]
    x = padless.from_list(xs, ragged_dims=(0, 1)).requires_grad_(grad)
    d = torch.randn(3, 4, 1, 0)
    out = torch.where(x > 0, x, d)
    for i, t in enumerate(xs):
        ref = torch.where(t > 0, t, d[i, : t.shape[0], :1])
        assert out[i].shape == ref.shape


def test_a_static_extent_of_zero_reshapes_and_attends_per_sample():
    """Seeds 373951 and 362157: a static dim sliced to extent 0 (``x[:, 1:]`` of one head) then
    reshaped with sizes read from the shape (was: "-1 is ambiguous" on 0 elements), or attended
    (the bucketed contraction read the extent 0 as a broadcast 1: a bmm into a wrong buffer)."""
    import torch.nn.functional as F

    from padless.tensor.construct import from_list

    xs = [torch.randn(1, n, 3) for n in (4, 1, 0, 2)]
    y = from_list(xs, ragged_dims=(1,))[:, 1:]
    b, s0, s1, s2 = y.shape[0], y.shape[1], y.shape[2], y.shape[3]
    z = y.reshape(b, s2, s0, s1 // 2, 2)
    assert [tuple(t.shape) for t in z.unbind()] == [tuple(x[1:].reshape(3, 0, x.shape[1] // 2, 2).shape) for x in xs]
    with torch.inference_mode():
        s = y @ y.transpose(-1, -2)
        o = F.scaled_dot_product_attention(y, y, y)
    assert [tuple(t.shape) for t in s.unbind()] == [(0, n, n) for n in (4, 1, 0, 2)]
    assert [tuple(t.shape) for t in o.unbind()] == [(0, n, 3) for n in (4, 1, 0, 2)]
