"""SDPA where the ragged dims are not (only) the sequence dim, and row attention over pairs.

Two families (:mod:`padless.ops.attention.rows`): ragged batch dims with a static sequence
(NJT's ``(B, j, L, E)``, one SDPA call on the packed rows), and pair states
``(N_i, N_i, H, E)`` where each row of a sample attends over that sample's keys
(:func:`padless.ops.row_attention`, or plain SDPA on ``(N_i, H, N_i, E)``). Every output
sample and gradient is compared with dense attention on that sample, on batches with empty
samples and one-sample batches; compiled with ``fullgraph=True`` over changing batches.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import padless
from padless.testing.reference import graph_nodes
from padless.testing import assert_close_samples, check_samples, leaves

LENS = [[3, 0, 1, 4], [5]]  # an empty sample, a one-row sample; a one-sample batch
H, E = 2, 4
TOL = dict(atol=1e-5, rtol=1e-5)
# Heavy compile runs (inductor, extra graphs), as in tests/tensor/test_compile_rows.py.
HEAVY = os.environ.get("PADLESS_COMPILE_INDUCTOR", "") not in ("", "0")


def _graph_nodes(t: torch.Tensor) -> set[str]:
    return {type(fn).__name__ for fn in graph_nodes(t)}


def _pairs(lens, seed, tail=(H, E)):
    return leaves([(n, n, *tail) for n in lens], seed, ragged=(0, 1))


def _row_ref(q, k, v, bias=None, keep=None, scale=None):
    """Row attention written out: row a, head h, query b over keys c (independent of SDPA)."""
    s = torch.einsum("abhe,ache->ahbc", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if bias is not None:
        s = s + bias.permute(2, 0, 1)
    dead = None
    if keep is not None:
        keep = keep.view(1, 1, 1, -1) if keep.dim() == 1 else keep.view(keep.shape[0], 1, 1, keep.shape[1])
        s = s.masked_fill(~keep, float("-inf"))
        dead = ~keep.any(-1, keepdim=True)
        s = s.masked_fill(dead, 0.0)
    p = torch.softmax(s, -1)
    if dead is not None:
        p = p.masked_fill(dead, 0.0)
    return torch.einsum("ahbc,ache->abhe", p, v)


def _check_with_index(fn, ref, inputs, extra):
    """:func:`check_samples` for a reference that also takes per-sample constants ``extra[i]``."""
    out = fn(*[nt for nt, _ in inputs])
    refs = [ref(*[d[i] for _, d in inputs], *extra[i]) for i in range(len(inputs[0][1]))]
    assert_close_samples(out, refs, **TOL)
    g = torch.Generator().manual_seed(99)
    cot = [torch.randn(r.shape, generator=g) for r in refs]
    out.backward(padless.from_list(cot, ragged_dims=out.ragged_dims))
    torch.autograd.backward(refs, cot)
    for nt, dense in inputs:
        assert_close_samples(nt.grad, [d.grad for d in dense], what="gradient", **TOL)
    return out


# ---------------------------------------------------------------------------- static sequence


@pytest.mark.parametrize("lens", LENS)
def test_static_sequence_is_one_sdpa_call_on_packed_rows(lens):
    x = leaves([(n, 6, E) for n in lens], 1)  # (N_i, L, E): L static, N_i ragged

    def f(a):
        return F.scaled_dot_product_attention(a, a, a)

    out = check_samples(f, f, [x])
    assert out.ragged_dims == (0,) and out.values().shape == x[0].values().shape
    assert "SplitWithSizesBackward0" not in _graph_nodes(out)  # no per-sample loop


@pytest.mark.parametrize("mask", ["causal", "dense", "nested", "cross"])
def test_static_sequence_heads_masks_and_cross_attention(mask):
    lens = LENS[0]
    s = 5 if mask == "cross" else 3
    q = leaves([(n, H, 3, E) for n in lens], 1)
    k = leaves([(n, H, s, E) for n in lens], 2)
    v = leaves([(n, H, s, 6) for n in lens], 3)
    g = torch.Generator().manual_seed(4)
    dense = torch.rand(3, 3, generator=g) > 0.4
    per = [torch.randn(n, 1, 3, 3, generator=g) for n in lens]
    nested = padless.from_list(per, ragged_dims=(0,))
    kw = {
        "causal": dict(is_causal=True),
        "dense": dict(attn_mask=dense),
        "nested": dict(attn_mask=nested),
        "cross": dict(scale=0.7),
    }[mask]

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, **kw)

    def ref(a, b, c, i):
        rkw = dict(kw, attn_mask=per[i]) if mask == "nested" else kw
        return F.scaled_dot_product_attention(a, b, c, **rkw)

    out = _check_with_index(f, ref, [q, k, v], [(i,) for i in range(len(lens))])
    assert out.shape == (4, 4, H, 3, 6)


def test_static_sequence_matches_torch_njt():
    g = torch.Generator().manual_seed(5)
    lens = [3, 0, 1, 4]
    samples = [[torch.randn(n, H, 3, E, generator=g, dtype=torch.float64) for n in lens] for _ in range(3)]
    njt = [torch.nested.nested_tensor(s, layout=torch.jagged, requires_grad=True) for s in samples]
    pl = [padless.nested.nested_tensor(s, layout=torch.jagged, requires_grad=True) for s in samples]
    o_njt = F.scaled_dot_product_attention(*njt, scale=0.5)
    o_pl = F.scaled_dot_product_attention(*pl, scale=0.5)
    torch.testing.assert_close(o_pl.values(), o_njt.values())
    assert o_pl.offsets().tolist() == o_njt.offsets().tolist() and o_pl.shape[2:] == o_njt.shape[2:]
    cot = torch.randn(o_njt.values().shape, generator=g, dtype=torch.float64)
    o_njt.values().backward(cot)
    o_pl.values().backward(cot)
    for a, b in zip(pl, njt):
        torch.testing.assert_close(a.grad.values(), b.grad.values())


# ---------------------------------------------------------------------------- pair states


@pytest.mark.parametrize("lens", LENS)
def test_sdpa_on_transposed_pairs_is_row_attention_with_bias(lens):
    q, k, v, b = _pairs(lens, 1), _pairs(lens, 2), _pairs(lens, 3, (H, 5)), _pairs(lens, 4, (H,))

    def f(q, k, v, b):
        qt, kt, vt = (t.transpose(2, 3) for t in (q, k, v))  # (N_i, H, N_i, E)
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=b.permute(0, 3, 1, 2)).transpose(2, 3)

    out = check_samples(f, _row_ref, [q, k, v, b])
    assert out.ragged_dims == (0, 1) and out.shape[-2:] == (H, 5)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(enable_gqa=True, scale=0.3)])
def test_pair_layout_causal_and_grouped_heads_match_dense_sdpa(kw):
    lens = LENS[0]
    q = _pairs(lens, 1, (4, E))
    k, v = _pairs(lens, 2, (H, E)), _pairs(lens, 3, (H, 3))

    def f(a, b, c):
        return F.scaled_dot_product_attention(a.transpose(2, 3), b.transpose(2, 3), c.transpose(2, 3), **kw)

    def ref(a, b, c):
        return F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), **kw)

    if not kw.get("enable_gqa"):
        q = _pairs(lens, 1)
    check_samples(f, ref, [q, k, v])


def test_row_attention_bfloat16_matches_dense_sdpa_per_sample():
    lens = [3, 1, 4]  # torch's SDPA leaves an empty sample's mask without .grad; fp32 tests cover N = 0
    q, k = leaves([(n, n, H, E) for n in lens], 1, (0, 1), torch.bfloat16), leaves([(n, n, H, E) for n in lens], 2, (0, 1), torch.bfloat16)
    b = leaves([(n, n, H) for n in lens], 3, (0, 1), torch.bfloat16)

    def f(q, k, b):
        return padless.ops.row_attention(q, k, k, bias=b)

    def ref(q, k, b):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), attn_mask=b.permute(2, 0, 1)[None]
        ).transpose(1, 2)

    out = check_samples(f, ref, [q, k, b], atol=2e-2, rtol=2e-2)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("key_mask", [None, "keys", "pair"])
@pytest.mark.parametrize("lens", LENS)
def test_row_attention_bias_and_key_masks(lens, key_mask):
    q, k, v, b = _pairs(lens, 1), _pairs(lens, 2), _pairs(lens, 3), _pairs(lens, 4, (H,))
    g = torch.Generator().manual_seed(6)
    if key_mask == "keys":
        keep = [torch.rand(n, generator=g) > 0.3 for n in lens]
    elif key_mask == "pair":
        keep = [torch.rand(n, n, generator=g) > 0.3 for n in lens]
        if lens[0] > 1:
            keep[0][1] = False  # row 1 of sample 0 has no key: zeros, as torch's SDPA
    else:
        keep = [None] * len(lens)
    km = None if key_mask is None else padless.from_list(keep, ragged_dims=tuple(range(keep[0].dim())))

    def f(q, k, v, b):
        return padless.ops.row_attention(q, k, v, bias=b, key_mask=km, scale=0.4)

    def ref(q, k, v, b, keep_i):
        return _row_ref(q, k, v, b, keep_i, scale=0.4)

    out = _check_with_index(f, ref, [q, k, v, b], [(m,) for m in keep])
    if key_mask == "pair" and lens[0] > 1:
        assert float(out.unbind()[0][1].detach().abs().sum()) == 0.0
        assert torch.isfinite(q[0].grad.values()).all()


def test_column_attention_and_self_attention_share_one_split():
    q = _pairs([4, 2, 0], 1)

    def f(a):
        at = a.transpose(1, 2)  # column ("ending node") attention: rows of the transposed pair
        return padless.ops.row_attention(at, at, at).transpose(1, 2)

    def ref(a):
        at = a.transpose(0, 1)
        return _row_ref(at, at, at).transpose(0, 1)

    out = check_samples(f, ref, [q])
    assert "SliceBackward0" not in _graph_nodes(out)


def test_row_attention_gradcheck_float64():
    offsets = torch.tensor([0, 4, 5, 5])  # N = 2, 1, 0
    sizes = torch.tensor([[2, 2, 1, 3], [1, 1, 1, 3], [0, 0, 1, 3]])
    g = torch.Generator().manual_seed(7)
    qkv = [torch.randn(5, 1, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    bias = torch.randn(5, 1, generator=g, dtype=torch.float64, requires_grad=True)

    def f(qv, kv, vv, bv):
        q, k, v = (padless.from_values(t, offsets, sizes=sizes, ragged_dims=(0, 1)) for t in (qv, kv, vv))
        b = padless.from_values(bv, offsets, sizes=sizes[:, :3], ragged_dims=(0, 1))
        return padless.ops.row_attention(q, k, v, bias=b).values()

    assert torch.autograd.gradcheck(f, (*qkv, bias), fast_mode=True)


# ---------------------------------------------------------------------------- errors


def test_row_attention_errors_name_the_sample():
    q = _pairs([3, 2], 1)[0]
    bias = padless.from_list([torch.randn(3, 3, H), torch.randn(3, 3, H)], ragged_dims=(0, 1))
    with pytest.raises(padless.StructureError, match=r"row_attention\(\): bias sample 1 has shape \(3, 3, 2\), expected \(N_i, N_i, H\) = \(2, 2, 2\)"):
        padless.ops.row_attention(q, q, q, bias=bias)
    km = padless.from_list([torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)])
    with pytest.raises(padless.StructureError, match=r"key_mask sample 1 has shape \(3\), expected \(2,\) or \(2, 2\)"):
        padless.ops.row_attention(q, q, q, key_mask=km)
    with pytest.raises(TypeError, match=r"key_mask must be a boolean NestedTensor"):
        padless.ops.row_attention(q, q, q, key_mask=padless.from_list([torch.ones(3), torch.ones(2)]))
    with pytest.raises(padless.StructureError, match=r"key_mask samples must be \(N_i,\) or \(N_i, N_i\)"):
        padless.ops.row_attention(q, q, q, key_mask=padless.from_list([torch.ones(3, 2, dtype=torch.bool)] * 2))
    seq = leaves([(n, H, E) for n in (3, 2)], 2)[0]
    with pytest.raises(padless.StructureError, match=r"query must have \(N_i, N_i, H, E\) samples \(ragged sample dims \(0, 1\)\); got rank 3"):
        padless.ops.row_attention(seq, seq, seq)
    with pytest.raises(TypeError, match=r"row_attention\(\): query, key and value must be NestedTensors"):
        padless.ops.row_attention(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))
    with pytest.raises(TypeError, match=r"bias must be a NestedTensor of \(N_i, N_i, H\) samples"):
        padless.ops.row_attention(q, q, q, bias=torch.ones(3, 3, H))
    other = _pairs([3], 3)[0]
    with pytest.raises(padless.StructureError, match=r"bias has 1 samples, query 2"):
        padless.ops.row_attention(q, q, q, bias=other[..., 0])
    with pytest.raises(padless.StructureError, match=r"key_mask has 1 samples, query 2"):
        padless.ops.row_attention(q, q, q, key_mask=padless.from_list([torch.ones(3, dtype=torch.bool)]))


def test_sdpa_layout_errors():
    qt = _pairs([3, 2], 1)[0].transpose(2, 3)  # (N_i, H, N_i, E)
    with pytest.raises(padless.StructureError, match=r"a dense attn_mask of shape \(4, 3\) has extent 4 along dim -2, where the envelope has 3"):
        F.scaled_dot_product_attention(qt, qt, qt, attn_mask=torch.zeros(4, 3))
    bad = padless.from_list([torch.zeros(H, 3, 3), torch.zeros(H, 3, 3)], ragged_dims=(1, 2))
    with pytest.raises(padless.StructureError, match=r"attn_mask sample 1 has shape \(2, 3, 3\), which does not broadcast to that sample's attention scores \(2, 2, 2, 2\)"):
        F.scaled_dot_product_attention(qt, qt, qt, attn_mask=bad)
    one = padless.from_list([torch.zeros(H, 3, 3)], ragged_dims=(1, 2))
    with pytest.raises(padless.StructureError, match=r"attn_mask has 1 samples, query 2"):
        F.scaled_dot_product_attention(qt, qt, qt, attn_mask=one)
    with pytest.raises(ValueError, match=r"mask_mod/score_mod need samples \(\.\.\., L_i, E\)"):
        padless.ops.attention.attention(qt, qt, qt, mask_mod=lambda b, h, i, j: i >= j)
    v5 = _pairs([3, 2], 2, (H, 5))[0].transpose(2, 3)
    k_bad = _pairs([3, 3], 3)[0].transpose(2, 3)
    with pytest.raises(padless.StructureError, match=r"sample 1: key has shape \(3, 2, 3, 4\) and value \(2, 2, 2, 5\)"):
        F.scaled_dot_product_attention(qt, k_bad, v5)
    k6 = _pairs([3, 2], 4, (H, 6))[0].transpose(2, 3)
    with pytest.raises(padless.StructureError, match=r"sample 0: query feature size 4 differs from key feature size 6"):
        F.scaled_dot_product_attention(qt, k6, k6)
    k_rows = _pairs([3, 3], 5)[0].transpose(2, 3)
    with pytest.raises(padless.StructureError, match=r"sample 1: query \(2, 2, 2, 4\) and key \(3, 2, 3, 4\) have batch dims that do not broadcast"):
        F.scaled_dot_product_attention(qt, k_rows, k_rows)
    x3 = leaves([(n, 3, E) for n in (3, 2)], 6)[0]
    x4 = leaves([(n, 1, 3, E) for n in (3, 2)], 7)[0]
    with pytest.raises(padless.StructureError, match=r"key samples have rank 4, query samples rank 3"):
        F.scaled_dot_product_attention(x3, x4, x4)
    x1 = leaves([(n, 3, E) for n in (3,)], 8)[0]
    with pytest.raises(padless.StructureError, match=r"batch sizes differ: query 2, key 1, value 1"):
        F.scaled_dot_product_attention(x3, x1, x1)
    with pytest.raises(padless.StructureError, match=r"a dense attn_mask applies to every sample, so it has at most the sample rank 3 dims"):
        F.scaled_dot_product_attention(x3, x3, x3, attn_mask=torch.ones(2, 2, 3, 3, dtype=torch.bool))
    with pytest.raises(padless.StructureError, match=r"extent 2 at the ragged sample dim 1"):
        F.scaled_dot_product_attention(x3, x3, x3, attn_mask=torch.ones(2, 3, 3, dtype=torch.bool))
    other_rows = padless.from_list([torch.ones(2, 3, 3, dtype=torch.bool)] * 2)
    with pytest.raises(padless.StructureError, match=r"attn_mask must have the query's rows"):
        F.scaled_dot_product_attention(x3, x3, x3, attn_mask=other_rows)


# ---------------------------------------------------------------------------- compile


class _PairAttention(torch.nn.Module):
    """A pair block as Pairformer writes it: pair state from a sequence, projections, row
    attention with a pair bias and a key mask, and the same as plain SDPA on the pair layout."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(c, 3 * c)
        self.bias = torch.nn.Linear(c, H)

    def forward(self, x, keys):
        p = x.unsqueeze(2) + x.unsqueeze(1)  # (N_i, N_i, C): sum N_i**2 rows, symbolic
        q, k, v = self.qkv(p).unflatten(-1, (3 * H, -1)).chunk(3, dim=-2)
        b = self.bias(p)
        rows = padless.ops.row_attention(q, k, v, bias=b, key_mask=keys)
        qt, kt, vt = (t.transpose(2, 3) for t in (q, k, v))
        plain = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=b.permute(0, 3, 1, 2))
        return rows, plain.transpose(2, 3)


class _StaticSequence(torch.nn.Module):
    def forward(self, x, keys):
        xs = x.unflatten(-1, (2, -1))  # (N_i, 2, C/2): a static sequence of 2 per row
        return (F.scaled_dot_product_attention(xs, xs, xs, is_causal=True),)


def _compiled_matches_eager(model: torch.nn.Module, backend: str, batches) -> int:
    torch.manual_seed(0)
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    for i, lens in enumerate(batches):
        g = torch.Generator().manual_seed(i)
        xs = [torch.randn(n, 8, generator=g) for n in lens]
        keys = padless.from_list([torch.rand(n, generator=g) > 0.3 for n in lens], ragged_dims=(0,))
        x = padless.prepare_for_compile(padless.from_list(xs, requires_grad=True))
        x_ref = padless.from_list(xs, requires_grad=True)
        outs, refs = compiled(x, keys), model(x_ref, keys)
        sum((o.values() ** 2).sum() for o in outs).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        sum((o.values() ** 2).sum() for o in refs).backward()
        for o, r in zip(outs, refs):
            assert_close_samples(o, list(r.unbind()), **TOL)
        torch.testing.assert_close(x.grad.values(), x_ref.grad.values(), **TOL)
        for a, p in zip(grads, model.parameters()):
            # atol 1e-4: the bias projection's own bias shifts every logit of a head alike, so its
            # gradient is 0 up to float32 rounding (inductor rounds differently from eager)
            torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)
        model.zero_grad()
    return cnt.frame_count


BATCHES = [[4, 4, 4, 4], [3, 0, 6], [5, 2, 7, 3]]  # B == N on the first call: no duck sizing


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if HEAVY else []))
def test_compiled_row_attention_one_graph_over_changing_batches(backend):
    torch._dynamo.reset()
    frames = _compiled_matches_eager(_PairAttention(), backend, BATCHES)
    assert frames == 1, f"{frames} graphs over {len(BATCHES)} batches"


@pytest.mark.skipif(not HEAVY, reason="one more compile (~5 s): set PADLESS_COMPILE_INDUCTOR=1")
def test_compiled_static_sequence_one_graph():
    torch._dynamo.reset()
    assert _compiled_matches_eager(_StaticSequence(), "aot_eager", BATCHES) == 1


def test_dropout_under_compile_is_refused(monkeypatch):
    from padless.ops.attention import rows as attention_rows

    qt = _pairs([3, 2], 1)[0].transpose(2, 3)
    monkeypatch.setattr(attention_rows, "_is_traced", lambda t: True)  # as inside torch.compile
    with pytest.raises(ValueError, match=r"dropout_p > 0 with ragged batch dims .* is eager only"):
        F.scaled_dot_product_attention(qt, qt, qt, dropout_p=0.1)
