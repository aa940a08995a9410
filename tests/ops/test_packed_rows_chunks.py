"""Rows rebuilt chunk by chunk (padless.ops.rows.packed_rows): a Pairformer's inference-time
transition and OpenFold's ``chunk_layer`` flatten the batch to rows, allocate a dense tensor of
that many rows, fill it chunk by chunk with a row-wise layer and reshape it to the batch's shape.
Sample by sample against the same code on each sample alone (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import padless
from padless.ops.rows.packed_rows import PackedRows
from padless.testing.reference import check_samples, leaves

C, C2, CHUNK = 6, 4, 3
BATCHES = {
    "pairs": ([(3, 3, C), (0, 0, C), (2, 2, C)], (0, 1)),
    "pairs_one_sample": ([(4, 4, C)], (0, 1)),
    "pairs_length_1": ([(1, 1, C), (1, 1, C)], (0, 1)),
    "tokens": ([(3, C), (0, C), (5, C), (1, C)], (0,)),
}


def _transition(alloc: str):
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(C, 2 * C).double(), nn.Linear(2 * C, C2).double()

    def f(t):
        return lin2(torch.relu(lin1(t)))

    def run(x):
        other = x.shape[:-1]
        rows = x.reshape(-1, C)
        t = rows.shape[0]
        out = None
        if alloc == "empty":
            out = torch.empty((t, C2), dtype=rows.dtype)
        elif alloc == "new_zeros":
            out = rows.new_zeros((t, C2))
        for s in range(0, t, CHUNK):
            chunk_out = f(rows[s : s + CHUNK])
            if out is None:  # OpenFold's chunk_layer: allocated from the first chunk's output
                out = chunk_out.new_zeros((t,) + chunk_out.shape[1:])
            out[s : s + CHUNK] = chunk_out
        if out is None:  # no rows, no chunk (an empty sample alone)
            out = rows.new_zeros((t, C2))
        return out.reshape(*other, C2)

    return run


@pytest.mark.parametrize("alloc", ["empty", "new_zeros", "from_chunk"])
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_rows_filled_chunk_by_chunk_are_the_batch(batch, alloc):
    shapes, ragged = batch
    fn = _transition(alloc)
    # (+ 0 * s.sum(): an empty sample alone writes no chunk, so its output has no graph to the input)
    out = check_samples(fn, lambda s: fn(s[None])[0] + 0 * s.sum(), [leaves(shapes, ragged=ragged, dtype=torch.float64)])
    assert isinstance(out, padless.NestedTensor)
    assert out.sizes().tolist() == [list(s[:-1]) + [C2] for s in shapes]


def test_an_all_empty_batch_allocated_from_the_rows():
    x, _ = leaves([(0, C), (0, C)], dtype=torch.float64)
    out = _transition("new_zeros")(x)  # no chunk at all: the allocation alone names the batch
    assert isinstance(out, padless.NestedTensor) and out.sizes().tolist() == [[0, C2], [0, C2]]


def test_chunks_are_rows_of_the_batch_and_row_wise_work_keeps_them():
    x, _ = leaves([(3, C), (0, C), (5, C), (1, C)], dtype=torch.float64)
    rows = x.reshape(-1, C)
    c = rows[2:7]
    assert type(c) is PackedRows and c._span == (2, 7)
    assert type(torch.tanh(c[:, :4] * 2)) is PackedRows and torch.tanh(c[:, :4])._span == (2, 7)
    assert c[1:3]._span == (3, 5) and rows[7:100]._span == (7, 9) and rows[0:9]._span is None
    assert type(rows[0:8:2]) is torch.Tensor  # a stride is no chunk
    assert type(rows[2:5] + rows[5:8]) is torch.Tensor  # two ranges: rows of different samples meet
    assert type(c.sum(0)) is torch.Tensor and type(c.t()) is torch.Tensor


def test_a_write_that_is_not_the_rows_own_keeps_the_tensor_plain():
    x, _ = leaves([(3, C), (0, C), (5, C), (1, C)], dtype=torch.float64)
    other, rows = x.shape[:-1], x.detach().reshape(-1, C)
    out = torch.zeros(9, C)
    out[0:3] = rows[3:6]  # rows 3:6 at rows 0:3: not the batch's rows, row for row
    assert type(out) is torch.Tensor
    out[3:6] = rows[3:6]  # its own rows: out holds the batch's rows
    assert type(out) is PackedRows
    out[6:9] = torch.ones(3, C)  # dense values into part of dim 0: plain again
    assert type(out) is torch.Tensor
    filled = rows.new_zeros((9, C))
    filled[0:2] = rows[5:7]
    assert type(filled) is torch.Tensor
    other_rows = padless.from_list([torch.randn(5, C), torch.randn(4, C)]).reshape(-1, C)  # 9 rows of another batch
    out2 = torch.zeros(9, C, dtype=torch.float64)
    out2[0:3] = other_rows[0:3]
    out2[3:9] = rows[3:9]  # rows of two batches: rows 0:3 were never this batch's
    with pytest.raises(padless.StructureError, match=r"reshape\(\): these 9 rows were recognised .* rows 0:3 were never "
                                                      r"written from that batch's rows"):
        out2.reshape(*other, C)
    out2[0:3] = rows[0:3]  # now every row is
    torch.testing.assert_close(out2.reshape(*other, C).values(), x.detach().values())
    out3 = torch.zeros(9, C)
    out3[2:4] = rows[2:4] * 2
    with pytest.raises(padless.StructureError, match=r"rows 0:2, 4:9 were never written"):
        (out3 + 1).view(x.shape)  # row-wise work keeps the record


def test_views_that_cannot_be_the_batch_are_refused():
    x, _ = leaves([(3, C), (0, C), (5, C), (1, C)], dtype=torch.float64)
    other, rows = x.shape[:-1], x.detach().reshape(-1, C)
    with pytest.raises(padless.StructureError, match=r"reshape\(\): these 3 rows are rows 0:3 of the 9 packed rows of a "
                                                      r"batch of 4 samples; only all 9 rows view back.*out\[s:e\] = f\(rows\[s:e\]\)"):
        rows[0:3].reshape(*other, C)
    wide = torch.cat([rows, rows[:, :2]], dim=-1)  # 8 features per row, viewed to C = 6
    with pytest.raises(padless.StructureError, match=r"view\(\): these 9 rows of \(8,\) .* names the batch's sizes and gives "
                                                      r"every row the shape \(6,\)"):
        wide.view(x.shape)
    out = torch.empty((9, C2))
    out[0:9] = rows[:, :C2]
    y = padless.from_list([torch.randn(5, C), torch.randn(0, C), torch.randn(3, C), torch.randn(1, C)])
    with pytest.raises(padless.StructureError, match=r"another batch \(its sample 0 has 5 entries"):
        out.reshape(*y.shape[:-1], C2)


def test_rows_of_pairs_at_an_envelope_of_1_are_rows():
    """``z.reshape(-1, d)`` of pairs is every row also where a fold would fit the target by
    coincidence (an envelope of 1 with an empty sample, or no rows at all)."""
    for ns in ([1, 0], [0, 0]):
        samples = [torch.randn(n, n, 1, dtype=torch.float64) for n in ns]
        z = padless.from_list(samples, ragged_dims=(0, 1))
        rows = z.reshape(-1, 1)
        assert type(rows) is PackedRows
        torch.testing.assert_close(rows.as_subclass(torch.Tensor), torch.cat([s.reshape(-1, 1) for s in samples]))


def test_rows_of_a_batch_without_rows_view_back_at_any_width():
    """With no rows every sample is empty, so rows of any width view to the batch's shape (each
    empty sample alone does); with rows, a width that does not fit is refused (test above)."""
    x, _ = leaves([(0, 4), (0, 4)], dtype=torch.float64)
    wide = x.view(-1, 4) @ torch.randn(4, 3, dtype=torch.float64)
    back = wide.view(x.shape)
    assert isinstance(back, padless.NestedTensor) and back.sizes().tolist() == [[0, 4], [0, 4]]


@pytest.mark.parametrize("batch", [BATCHES["pairs"], BATCHES["tokens"]], ids=["pairs", "tokens"])
def test_rows_split_into_chunks_and_joined_are_the_batch(batch):
    """``torch.cat([f(c) for c in rows.split(k)])`` (the chunked forward written with a join)."""
    shapes, ragged = batch
    torch.manual_seed(0)
    lin = nn.Linear(C, C2).double()

    def fn(x):
        rows = x.reshape(-1, C)
        return torch.cat([torch.relu(lin(c)) for c in rows.split(CHUNK)] or [lin(rows)]).reshape(*x.shape[:-1], C2)

    out = check_samples(fn, lambda s: fn(s[None])[0] + 0 * s.sum(), [leaves(shapes, ragged=ragged, dtype=torch.float64)])
    assert isinstance(out, padless.NestedTensor)
    x, _ = leaves(shapes, ragged=ragged)
    parts = x.reshape(-1, C).split(CHUNK)
    if len(parts) > 1:
        assert type(torch.cat(parts[::-1])) is torch.Tensor  # out of order: not the rows


def test_sizes_read_from_a_batch_rebuilt_from_rows_apply_through_a_fold():
    """A batch rebuilt from its rows is the batch's own samples: ``N``, ``M`` read from its shape
    give every folded sample its parent's size (here ``sum N_i == B``, where reading them as the
    folded batch's own sizes would fit the count and be wrong)."""
    torch.manual_seed(0)

    def fn(x):
        t = torch.nn.functional.layer_norm(x.reshape(-1, 2), (2,)).view(x.size()[:-1] + (2,))
        B, N, M = t.shape[0], t.shape[1], t.shape[2]
        return t.reshape(B * N, M, 2).softmax(1).reshape(B, N, M, 2)

    out = check_samples(fn, lambda s: fn(s[None])[0], [leaves([(2, 2, 2), (1, 1, 2), (0, 0, 2)], ragged=(0, 1),
                                                              dtype=torch.float64)])
    assert out.sizes().tolist() == [[2, 2, 2], [1, 1, 2], [0, 0, 2]]


def test_a_buffer_reused_by_the_next_batch_holds_that_batch():
    """A buffer of ``T`` rows filled by one batch, then by another batch of ``T`` rows of other
    sizes, holds the second batch's rows (never the first's structure over the second's values)."""
    a = padless.from_list([torch.randn(3, C), torch.randn(2, C)])
    b = padless.from_list([torch.randn(1, C), torch.randn(4, C)])
    buf = torch.empty(5, C)
    for x in (a, b):
        rows = x.reshape(-1, C)
        for s in range(0, 5, 2):
            buf[s : s + 2] = rows[s : s + 2] * 2
        y = buf.reshape(x.shape)
        assert y.sizes().tolist() == x.sizes().tolist()
        torch.testing.assert_close(y.values(), 2 * x.values())
