"""The sequence-first view ``x.transpose(0, 1)`` (padless.ops.common.seq_first_ops): row-wise
ops, residual adds, reductions and fairseq-style attention with heads folded into the batch,
each checked sample by sample against the dense code on each sample alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.common.seq_first import SeqFirstView
from padless.ops.rows import folds
from padless.testing.reference import check_samples, leaves

E, H = 8, 2
LENGTHS = {"batch": [3, 0, 5, 1], "one_sample": [4], "length_one": [1, 1]}


@pytest.fixture(autouse=True)
def _fresh_registry():
    folds._REGISTRY.clear()
    yield
    folds._REGISTRY.clear()


class FairseqAttention(nn.Module):
    """fairseq's MultiheadAttention (no masks), sequence-first ``(T, B, E)``, unchanged."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(E, E).double() for _ in range(4))
        self.head_dim = E // H
        self.scaling = self.head_dim ** -0.5

    def forward(self, query):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * H, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * H, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * H, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_weights, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class SeqFirstLayer(nn.Module):
    """A pre-norm transformer layer written sequence-first (fairseq's TransformerEncoderLayer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = FairseqAttention()
        self.ln1, self.ln2 = nn.LayerNorm(E).double(), nn.LayerNorm(E).double()
        self.fc1, self.fc2 = nn.Linear(E, 2 * E).double(), nn.Linear(2 * E, E).double()

    def forward(self, x):  # (T, B, E)
        residual = x
        x = F.dropout(self.attn(self.ln1(x)), p=0.0, training=self.training)
        x = residual + x
        residual = x
        x = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return residual + x


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_fairseq_layer_on_the_sequence_first_view(lengths):
    layer = SeqFirstLayer()

    def run(x):
        y = layer(x.transpose(0, 1))
        assert isinstance(y, SeqFirstView) and y.shape == (x.shape[1], x.shape[0], E)
        return y.transpose(0, 1)

    out = check_samples(run, lambda s: layer(s[:, None])[:, 0], [leaves([(n, E) for n in lengths], dtype=torch.float64)])
    assert out.ragged_dims == (0,)


def test_row_wise_ops_and_dense_operands_in_sequence_first_coordinates():
    torch.manual_seed(0)
    pos = torch.randn(5, 1, E, dtype=torch.float64)  # (T, 1, E) position table, sequence-first
    gate = torch.randn(E, dtype=torch.float64)

    def f(x):
        y = x.transpose(0, 1)
        y = F.layer_norm(y, (E,)) + pos[: y.shape[0]]
        y = torch.where(y > 0, y, 0.5 * y) * gate
        a, b = y.chunk(2, dim=-1)
        y = torch.cat([a.sigmoid(), b.tanh()], dim=-1).softmax(-1) @ torch.eye(E, dtype=torch.float64)
        y = y.clone()
        y.mul_(2.0)
        return y.transpose(0, 1)

    def ref(s):
        y = s[:, None]
        y = F.layer_norm(y, (E,)) + pos[: y.shape[0]]
        y = torch.where(y > 0, y, 0.5 * y) * gate
        a, b = y.chunk(2, dim=-1)
        y = torch.cat([a.sigmoid(), b.tanh()], dim=-1).softmax(-1) @ torch.eye(E, dtype=torch.float64)
        return (y * 2.0)[:, 0]

    check_samples(f, ref, [leaves([(n, E) for n in (3, 0, 5)], dtype=torch.float64)])


def test_reductions_over_time_and_features():
    def f(x):
        y = x.transpose(0, 1)
        return y.mean(0) + y.amax(dim=0) + y.sum(-1).transpose(0, 1).sum(-1, keepdim=True) + y.softmax(0).sum(0)

    def ref(s):
        y = s[:, None]
        return (y.mean(0) + y.amax(dim=0) + y.sum(-1).transpose(0, 1).sum(-1, keepdim=True) + y.softmax(0).sum(0))[0]

    check_samples(f, ref, [leaves([(n, E) for n in (3, 2, 5)], dtype=torch.float64)])


def test_cat_along_time_joins_each_sample():
    x, xs = leaves([(n, E) for n in (2, 0, 3)], dtype=torch.float64)
    y = torch.cat([x.transpose(0, 1), x.transpose(0, 1) * 2], dim=0).transpose(0, 1)
    assert y.sizes()[:, 0].tolist() == [4, 0, 6]
    torch.testing.assert_close(y.unbind()[2], torch.cat([xs[2], xs[2] * 2]).detach())


def test_refusals_name_the_rewrite():
    x, _ = leaves([(n, E) for n in (3, 2)])
    y = x.transpose(0, 1)
    with pytest.raises(padless.StructureError, match=r"sum\(\): dim 1 of a sequence-first view .* is the batch dim; reducing over it would mix samples"):
        y.sum(1)
    with pytest.raises(padless.StructureError, match=r"chunk\(\): dim 1 of a sequence-first view .* split the batch"):
        y.chunk(2, dim=1)
    with pytest.raises(padless.StructureError, match=r"view\(\): the sequence-first view has envelope \(3, 2, 8\); it can be viewed as"):
        y.view(-1, E)
    with pytest.raises(RuntimeError, match=r"flip\(\) on a sequence-first view .* has no rule"):
        y.flip(0)


def test_heads_fold_of_the_view_is_a_batch_of_b_times_h_samples():
    x, xs = leaves([(n, E) for n in (3, 0, 2)])
    q = x.transpose(0, 1).contiguous().view(3, 3 * H, E // H).transpose(0, 1)
    assert q.batch_size == 3 * H and q.sizes()[:, 0].tolist() == [3, 3, 0, 0, 2, 2]
    torch.testing.assert_close(q.unbind()[1], xs[0].detach().view(3, H, E // H)[:, 1])
    assert folds.fold_link(q).kind == "static"
    back = q.transpose(0, 1).view(3, 3, E)
    torch.testing.assert_close(back.transpose(0, 1).values(), x.values())
