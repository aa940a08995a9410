"""Accessors and conversions: unbind, indexing, padding, masks, metadata."""

import pytest
import torch

import padless
from padless.testing import VARIANTS, make_batch


@pytest.mark.parametrize("v", sorted(VARIANTS))
def test_unbind_iter_getitem_tolist_agree(v):
    nt, dense = make_batch(v)
    assert len(nt) == len(dense)
    for a, b in zip(nt.unbind(), dense):
        torch.testing.assert_close(a, b)
    for a, b in zip(nt, dense):
        torch.testing.assert_close(a, b)
    for i, b in enumerate(dense):
        torch.testing.assert_close(nt[i], b)
        torch.testing.assert_close(nt[i - len(dense)], b)
    assert nt.tolist() == [b.tolist() for b in dense]


@pytest.mark.parametrize("v", sorted(VARIANTS))
def test_to_padded_and_mask(v):
    nt, dense = make_batch(v)
    padded = nt.to_padded(value=-7.0)
    mask = nt.mask()
    assert padded.shape == nt.shape and mask.shape == nt.shape and mask.dtype == torch.bool
    for i, s in enumerate(dense):
        region = tuple(slice(0, n) for n in s.shape)
        torch.testing.assert_close(padded[i][region], s)
        assert bool(mask[i][region].all())
        assert int(mask[i].sum()) == s.numel()
    assert bool((padded[~mask] == -7.0).all())
    assert int(mask.sum()) == nt.numel()


def test_envelope_shape_and_numel():
    nt = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 6)])
    assert nt.shape == (2, 3, 4, 6) and nt.dim() == 4 and nt.size(-1) == 6 and nt.size(0) == 2
    assert nt.numel() == 3 * 20 + 3 * 12
    assert nt.padded_numel() == 2 * 3 * 4 * 6
    assert nt.occupancy() == pytest.approx((60 + 36) / 144)


def test_lengths_cu_seqlens_max_seqlen():
    nt = padless.from_list([torch.randn(3, 8), torch.randn(0, 8), torch.randn(5, 8)])
    assert nt.lengths().tolist() == [3, 0, 5]
    cu = nt.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8]
    assert nt.cu_seqlens() is cu  # cached per structure
    assert (nt * 2).cu_seqlens() is cu  # shared by ops that keep the structure
    assert nt.max_seqlen() == 5 and isinstance(nt.max_seqlen(), int)
    img = padless.from_list([torch.randn(3, 4, 5), torch.randn(3, 2, 6)])
    assert img.max_seqlen(1) == 4 and img.max_seqlen(2) == 6
    with pytest.raises(ValueError, match=r"lengths\(\) needs exactly one"):
        img.lengths()
    with pytest.raises(ValueError, match=r"max_seqlen\(\): this NestedTensor has ragged dims \(1, 2\); pass dim="):
        img.max_seqlen()


def test_batch_slicing_and_index_lists():
    nt, dense = make_batch("image")
    sub = nt[1:3]
    assert sub.batch_size == 2
    assert sub.values().data_ptr() == nt.values()[nt.offsets()[1]:].data_ptr()  # unit-step slice is a view
    for a, b in zip(sub, dense[1:3]):
        torch.testing.assert_close(a, b)
    for idx in ([2, 0], torch.tensor([2, 0]), torch.tensor([True, False, True]), slice(None, None, -1)):
        picked = nt[idx]
        want = [dense[i] for i in range(3)[idx]] if isinstance(idx, slice) else None
        if want is None:
            ids = idx.nonzero().flatten().tolist() if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool else list(map(int, idx))
            want = [dense[i] for i in ids]
        assert picked.batch_size == len(want)
        for a, b in zip(picked, want):
            torch.testing.assert_close(a, b)
    assert nt[5:].batch_size == 0


def test_getitem_then_sample_index():
    nt, dense = make_batch("seq")
    torch.testing.assert_close(nt[1, 2], dense[1][2])
    torch.testing.assert_close(nt[0, :, 1], dense[0][:, 1])


def test_getitem_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(IndexError, match="index 3 is out of range for a batch of 3 samples"):
        nt[3]
    with pytest.raises(IndexError, match="index 7 is out of range"):
        nt[[0, 7]]
    with pytest.raises(NotImplementedError, match="only the batch dim can be indexed"):
        make_batch("pair")[0][:, 0]  # x[:, 0] on a sole ragged dim picks a position (tests/ops/test_windows.py)


def test_indexing_is_differentiable():
    nt, dense = make_batch("pair", requires_grad=True)
    (nt[[2, 0]].sum() + nt[1].sum() * 2).backward()
    counts = [1, 2, 1]
    for i, g in enumerate(nt.grad.unbind()):
        torch.testing.assert_close(g, torch.full_like(dense[i], counts[i]))


def test_to_padded_is_differentiable():
    nt, dense = make_batch("image", requires_grad=True)
    (nt.to_padded() ** 2).sum().backward()
    for g, s in zip(nt.grad.unbind(), dense):
        torch.testing.assert_close(g, 2 * s.detach())


def test_to_padded_output_size_enlarge_and_truncation_error():
    nt = padless.from_list([torch.ones(2, 5), torch.ones(3, 4)])
    big = nt.to_padded(1.0, output_size=(2, 4, 6))
    assert big.shape == (2, 4, 6) and bool((big == 1).all())
    with pytest.raises(RuntimeError, match="Truncation is not supported"):
        nt.to_padded(2.0, output_size=(2, 2, 2))


def test_host_metadata_needs_no_device_work():
    nt = padless.from_list([torch.randn(3, 8), torch.randn(5, 8)])
    assert nt.host_sizes().device.type == "cpu" and nt.host_offsets().tolist() == [0, 3, 8]
    assert nt.row_sample_ids().tolist() == [0, 0, 0, 1, 1, 1, 1, 1]


def test_repr_shows_structure_and_samples():
    nt = padless.from_list([torch.zeros(1, 2), torch.ones(2, 2)], requires_grad=True)
    r = repr(nt)
    assert r.startswith("NestedTensor(batch=2, envelope=(2, 2, 2), ragged_dims=(0,), dtype=torch.float32")
    assert "requires_grad=True" in r and r.count("tensor(") == 2
    assert "grad_fn=<" in repr(nt * 2)
