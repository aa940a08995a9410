"""Worker transfer: a batch crosses from a DataLoader worker as one shared-memory block per dtype."""

from __future__ import annotations

import io

import torch
from torch.utils.data import DataLoader

import padless
from padless import Batch, Collator, Field, NestedTensor
from padless.collation import transfer
from padless.collation.synthetic import PairDataset, TokenDataset
from padless.testing import assert_close_samples


def _blocks(leaves):
    """dtype -> set of shared-memory blocks (storages) holding that dtype's tensors."""
    out = {}
    for t, _ in leaves:
        assert t.is_shared(), (t.dtype, t.shape)
        out.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    return out


def test_collator_batch_arrives_as_one_shared_block_per_dtype():
    ds = PairDataset(8, lo=3, hi=9, c=4, cp=2, pool=8)
    c = Collator({"single": Field(pair=True), "pair": Field(ragged=(0, 1)), "label": Field(ragged=())})
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=c)
    got = list(loader)
    assert len(got) == 2
    for k, b in enumerate(got):
        assert isinstance(b, Batch) and len(b) == 4
        blocks = _blocks(transfer.leaves(b._fields))
        assert set(blocks) == {torch.float32, torch.int64, torch.int32}
        assert all(len(v) == 1 for v in blocks.values()), {d: len(v) for d, v in blocks.items()}
        samples = [ds[4 * k + i] for i in range(4)]
        assert_close_samples(b.single, [s["single"] for s in samples])
        assert_close_samples(b.pair, [s["pair"] for s in samples])
        assert b.label.tolist() == [s["label"] for s in samples]
        assert b.pair_maps("single").rows_i.is_shared()


def test_drop_in_collate_arrives_as_one_shared_block_per_dtype():
    ds = TokenDataset(8, lo=1, hi=40, mean=2.5, pool=8)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=padless.collate)
    for b in loader:
        ids = b["input_ids"]
        assert isinstance(ids, NestedTensor)
        assert ("cu_seqlens", ids.device) in ids._meta.derived
        ts = [ids._values, ids._offsets, ids._sizes, ids._meta.host_sizes, ids._meta.host_offsets,
              ids.cu_seqlens(), b["label"]]
        blocks = _blocks([(t, False) for t in ts])
        assert all(len(v) == 1 for v in blocks.values()), {d: len(v) for d, v in blocks.items()}


def test_carried_metadata_survives_torch_save_weights_only():
    nt = padless.collate([torch.randn(2, 3), torch.randn(4, 3)])
    nt.row_sample_ids()  # cached by the op layer: carried too
    buf = io.BytesIO()
    torch.save({"x": nt}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["x"]
    assert ("cu_seqlens", back.device) in back._meta.derived and ("row_ids", back.device) in back._meta.derived
    assert back.cu_seqlens().tolist() == [0, 2, 6] and back.row_sample_ids().tolist() == [0, 0, 1, 1, 1, 1]
    assert_close_samples(back, list(nt.unbind()))
