"""Dense tensors that remember a batch (packed rows, pooled maps) and the reshapes between them and
the batch: clear refusals instead of torch's raw messages, no memory kept after an op moves or
mixes dim 0, and the corner cases of an envelope of 1 (``x.view(-1, 1)``, pyramid pooling of
1x1 images). Sample by sample against the dense code on each sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import padless
from padless.ops.rows.packed_rows import PackedRows
from padless.ops.vision.batch_dense import BatchDense

# ---------------------------------------------------------------------------- packed rows


def test_rows_viewed_to_another_batch_shape_name_both_structures():
    x = padless.from_list([torch.randn(3, 8), torch.randn(0, 8), torch.randn(5, 8), torch.randn(1, 8)])
    other = padless.from_list([torch.randn(5, 8), torch.randn(0, 8), torch.randn(3, 8), torch.randn(1, 8)])
    rows = x.view(-1, 8)
    with pytest.raises(padless.StructureError, match=r"view\(\): these 9 rows are the packed rows of a batch of 4 samples of "
                                                      r"sizes \(3, 8\), \(0, 8\).*another batch \(its sample 0 has 5 entries "
                                                      r"along dim 1, this batch's sample 0 has 3\).*x\.shape"):
        rows.view(other.shape)
    three = padless.from_list([torch.randn(5, 8)] * 3)
    with pytest.raises(padless.StructureError, match=r"reshape\(\): .*another batch \(a batch of 3 samples\)"):
        rows.reshape(three.shape)
    back = (rows * 2).view(x.shape)  # the batch's own shape: its rows back
    torch.testing.assert_close(back.values(), 2 * x.values())


@pytest.mark.parametrize("lengths", [(1, 0, 1), (1,), (3, 0, 1)], ids=["envelope_1", "one_sample", "envelope_3"])
def test_view_minus_one_one_is_every_row_at_any_envelope(lengths):
    """``x.view(-1, 1)`` of ``(L_i,)`` samples is the real elements as one column, as the dense
    ``(B*L, 1)``, also when the envelope happens to be 1 (a plain 1 there is not the ragged dim)."""
    samples = [torch.randn(n) for n in lengths]
    x = padless.from_list(samples)
    col = x.view(-1, 1)
    assert isinstance(col, PackedRows)
    torch.testing.assert_close(col.as_subclass(torch.Tensor), torch.cat([s.view(-1, 1) for s in samples]))
    back = (col + 1).view(x.shape)
    for got, s in zip(back.unbind(), samples):
        torch.testing.assert_close(got, s + 1)
    assert x.view(-1, x.shape[1]).ragged_dims == (0,)  # the ragged dim named by its extent: the batch kept


def _square_rows():
    x = padless.from_list([torch.randn(2, 4), torch.randn(2, 4)])  # T = 4 rows of 4 features
    return x, x.reshape(-1, 4)


@pytest.mark.parametrize(
    "op",
    [
        lambda r: r.t(), lambda r: r.T, lambda r: r.transpose(0, 1), lambda r: r.permute(1, 0), lambda r: r.flip(0),
        lambda r: r.roll(1, 0), lambda r: r.sort(0).values, lambda r: r.cumsum(0), lambda r: r[torch.tensor([3, 2, 1, 0])],
        lambda r: r.index_select(0, torch.tensor([1, 0, 3, 2])), lambda r: F.softmax(r, 0), lambda r: r @ r,
        lambda r: r.triu(), lambda r: torch.mm(r.as_subclass(torch.Tensor), r), lambda r: r.sum(0, keepdim=True).expand(4, 4),
        lambda r: r.unsqueeze(0)[0], lambda r: F.scaled_dot_product_attention(r, r, r),
    ],
    ids=["t", "T", "transpose", "permute", "flip", "roll", "sort", "cumsum", "perm", "index_select", "softmax0", "matmul_rows",
         "triu", "mm_right", "sum0", "unsqueeze0", "sdpa"],
)
def test_rows_moved_or_mixed_along_dim0_are_plain(op):
    """Results with T entries on dim 0 that are not row i at index i no longer view back."""
    _, rows = _square_rows()
    out = op(rows)
    assert out.shape[0] == 4 and type(out) is torch.Tensor


@pytest.mark.parametrize(
    "op",
    [
        lambda r: r * 2 + 1, lambda r: F.gelu(r), lambda r: F.linear(r, torch.randn(4, 4)), lambda r: F.layer_norm(r, (4,)),
        lambda r: torch.addmm(torch.zeros(4), r, torch.randn(4, 4)), lambda r: r @ torch.randn(4, 4), lambda r: F.softmax(r, -1),
        lambda r: r[:, :2], lambda r: r[..., 1:], lambda r: r.split(2, dim=-1)[0], lambda r: r.float().clone().contiguous(),
        lambda r: torch.where(r > 0, r, 0.0), lambda r: r.sum(-1, keepdim=True), lambda r: F.dropout(r, 0.0),
        lambda r: r.clone().add_(1), lambda r: torch.cat([r, r], dim=-1), lambda r: r.unsqueeze(-1),
    ],
    ids=["arith", "gelu", "linear", "layer_norm", "addmm", "matmul_w", "softmax_last", "slice", "ellipsis", "split",
         "casts", "where", "sum_last", "dropout", "inplace", "cat_last", "unsqueeze_last"],
)
def test_row_wise_work_keeps_the_rows(op):
    x, rows = _square_rows()
    out = op(rows)
    assert isinstance(out, PackedRows)
    back = out.reshape(*x.shape[:-1], *out.shape[1:])
    assert isinstance(back, padless.NestedTensor) and back.sizes()[:, 0].tolist() == [2, 2]


@pytest.mark.parametrize("make", [torch.empty_like, torch.zeros_like], ids=["empty_like", "zeros_like"])
def test_rows_filled_chunk_by_chunk_come_back(make):
    """``out = torch.empty_like(rows)``, filled chunk by chunk, then reshaped to the batch's shape:
    the batch's structure over the new values."""
    samples = [torch.randn(3, 4), torch.randn(0, 4), torch.randn(5, 4)]
    x = padless.from_list(samples)
    other, rows = x.shape[:-1], x.reshape(-1, 4)
    out = make(rows)
    for s in range(0, rows.shape[0], 3):
        out[s : s + 3] = torch.tanh(rows[s : s + 3])
    y = out.reshape(*other, 4)
    assert isinstance(y, padless.NestedTensor)
    for got, xi in zip(y.unbind(), samples):
        torch.testing.assert_close(got, torch.tanh(xi))


# ---------------------------------------------------------------------------- pooled maps


def test_pooled_map_with_dim0_moved_is_plain():
    x = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 6, 2), torch.randn(3, 2, 2)], ragged_dims=(1, 2))
    p = F.adaptive_avg_pool2d(x, 2)  # (B, C, 2, 2) with B == C == 3
    assert isinstance(p, BatchDense)
    for moved in (p.transpose(0, 1), p.flip(0), p[torch.tensor([2, 0, 1])], p.roll(1, 0), p.permute(1, 0, 2, 3),
                  p.movedim(0, 1), torch.cat([p[:1], p[1:]], 0)):
        assert moved.shape[0] == 3 and type(moved) is torch.Tensor
        dense = F.interpolate(moved, size=x.shape[2:])  # a plain tensor: the envelope size, as torch does
        assert type(dense) is torch.Tensor and dense.shape[2:] == (6, 5)
    kept = F.relu(nn.BatchNorm2d(3)(nn.Conv2d(3, 3, 1)(p)))  # the PSP block: still the batch
    assert isinstance(kept, BatchDense)
    assert F.interpolate(kept, size=x.shape[2:]).sizes()[:, 1:].tolist() == [[4, 5], [6, 2], [2, 2]]


class PSPBlock(nn.Module):  # smp's PSPBlock
    def __init__(self, c: int, k: int) -> None:
        super().__init__()
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Conv2d(c, 2, 1), nn.ReLU())

    def forward(self, x):
        height, width = x.shape[2:]
        return F.interpolate(self.pool(x), size=(height, width), mode="bilinear", align_corners=True)


@pytest.mark.parametrize("sizes", [[(1, 1), (1, 1), (1, 1)], [(1, 1)], [(2, 1), (1, 1)]],
                         ids=["envelope_1x1", "one_image", "envelope_2x1"])
def test_pyramid_pooling_on_a_1x1_envelope(sizes):
    torch.manual_seed(0)
    blocks = nn.ModuleList(PSPBlock(4, k) for k in (1, 2)).double()
    xs = [torch.randn(4, h, w, dtype=torch.float64) for h, w in sizes]
    x = padless.from_list(xs, ragged_dims=(1, 2))
    y = torch.cat([x] + [b(x) for b in blocks], dim=1)
    assert y.sizes().tolist() == [[8, h, w] for h, w in sizes]
    for got, xi in zip(y.unbind(), xs):
        torch.testing.assert_close(got, torch.cat([xi[None]] + [b(xi[None]) for b in blocks], dim=1)[0])
