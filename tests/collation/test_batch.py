"""Batch: a dict-like container that moves in one copy per dtype, pickles, and talks to kernels."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import padless
from padless import Batch, Collator, Field
from padless.collation import transfer
from padless.testing import assert_close_samples

aten = torch.ops.aten
HAS_CUDA = torch.cuda.is_available()


def _samples(lengths=(2, 5, 3)):
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(0, 9, (n,), generator=g), "x": torch.randn(n, 4, generator=g),
             "w": torch.randn(3, generator=g), "y": i, "name": f"s{i}"} for i, n in enumerate(lengths)]


COLLATOR = Collator({"ids": Field(position_ids="pos", labels="labels", seq_idx="seq"), "x": Field(pair=True)})


def _batch():
    return COLLATOR(_samples())


def test_dict_like_with_attribute_access():
    b = _batch()
    assert len(b) == 3 and b.num_samples == 3
    assert list(b.keys()) == ["ids", "x", "w", "y", "name", "pos", "seq", "labels"]
    assert b.ids is b["ids"] and "x" in b and "nope" not in b and b.get("nope") is None
    assert dict(**b).keys() == b.keys()
    b["extra"] = torch.ones(2)
    b.other = 3
    assert b.extra.tolist() == [1, 1] and b["other"] == 3
    del b["other"]
    with pytest.raises(KeyError, match="Batch has no field 'nope'"):
        b["nope"]
    with pytest.raises(AttributeError, match="Batch has no attribute or field 'nope'"):
        b.nope
    with pytest.raises(AttributeError, match="cannot set 'to'"):
        b.to = 1
    assert "ids: NestedTensor(envelope=(3, 5)" in repr(b)


def _leaf_storages(b):
    out = {}
    for t, host in transfer.leaves(b._fields):
        out.setdefault((t.dtype, host), set()).add(t.untyped_storage().data_ptr())
    return out


def test_collated_batch_lives_in_one_buffer_per_dtype():
    b = _batch()
    per_dtype = {}
    for (dt, _), ptrs in _leaf_storages(b).items():
        per_dtype.setdefault(dt, set()).update(ptrs)
    assert all(len(p) == 1 for p in per_dtype.values()), per_dtype
    assert set(per_dtype) == {torch.float32, torch.int64, torch.int32}


class CrossDeviceCopies(TorchDispatchMode):
    """Counts copies between devices and the bytes they move."""

    def __init__(self):
        super().__init__()
        self.copies, self.nbytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0] if func is aten.copy_.default else out
            if src.device != dst.device:
                self.copies += 1
                self.nbytes += src.numel() * src.element_size()
        return out


def test_to_device_is_one_copy_per_dtype():
    b = _batch()
    with CrossDeviceCopies() as c:
        m = b.to("meta", non_blocking=True)
    assert c.copies == 3  # float32, int64, int32
    assert m.device.type == "meta" and m.x.device.type == "meta" and m.ids.offsets().device.type == "meta"
    assert m.x._meta.host_sizes.device.type == "cpu"  # host metadata stays on the CPU
    assert c.nbytes == b.nbytes()
    assert m.x.shape == b.x.shape and m.ids.ragged_dims == (0,)


def test_scattered_fields_are_staged_into_one_buffer_per_dtype():
    b = _batch()
    b["extra"] = torch.randn(7)  # not in the collated buffer
    b["more"] = padless.from_list([torch.randn(2, 2), torch.randn(1, 2)])
    with CrossDeviceCopies() as c:
        b.to("meta")
    assert c.copies == 3


def test_relocated_batch_keeps_values_structure_and_caches():
    """The staging logic on CPU: 'finish' stands in for the host-to-device copy."""
    b = _batch()
    b["extra"] = torch.arange(4.0)
    finished = []

    def fake_device_copy(buf):
        finished.append(buf.dtype)
        return buf.clone()

    fields = transfer.relocate(b._fields, lambda host: not host, lambda dt, n: torch.empty(n, dtype=dt), fake_device_copy)
    moved = Batch(fields, len(b))
    assert sorted(map(str, finished)) == ["torch.float32", "torch.int32", "torch.int64"]
    for k in ("ids", "x", "pos", "seq", "labels"):
        assert_close_samples(moved[k], list(b[k].unbind()))
        assert moved[k].values().data_ptr() != b[k].values().data_ptr()
    assert torch.equal(moved.extra, b.extra) and torch.equal(moved.w, b.w) and moved.name == b.name
    assert moved.pos._meta is moved.ids._meta  # shared structures stay shared
    assert moved.x.cu_seqlens().data_ptr() == moved.field_meta("x").cu_seqlens.data_ptr()
    ref = [s.unsqueeze(1) + s.unsqueeze(0) for s in b.x.unbind()]
    assert_close_samples(moved.x.unsqueeze(2) + moved.x.unsqueeze(1), ref)


def test_to_same_device_is_free():
    b = _batch()
    assert b.to("cpu") is b and b.cpu() is b


def test_pickle_round_trip_keeps_fields_and_metadata():
    b = _batch()
    r = pickle.loads(pickle.dumps(b))
    assert isinstance(r, Batch) and len(r) == 3 and list(r.keys()) == list(b.keys())
    for k in ("ids", "x", "pos", "labels"):
        assert_close_samples(r[k], list(b[k].unbind()))
    assert r.pair_maps("x").rows_i.tolist() == b.pair_maps("x").rows_i.tolist()
    assert r.field_meta("ids").outputs == {"position_ids": "pos", "seq_idx": "seq", "labels": "labels"}


def test_interop_kwargs():
    b = _batch()
    fa = b.flash_attn_kwargs("ids")
    assert fa["cu_seqlens_q"].dtype == torch.int32 and fa["cu_seqlens_q"].tolist() == [0, 2, 7, 10]
    assert fa["max_seqlen_q"] == 5 and type(fa["max_seqlen_k"]) is int
    hf = b.hf_kwargs("ids")
    assert hf["input_ids"].shape == (1, 10) and hf["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 4, 0, 1, 2]]
    assert hf["cu_seq_lens_q"].dtype == torch.int32 and hf["max_length_q"] == 5 and hf["labels"].shape == (1, 10)
    assert "inputs_embeds" in b.hf_kwargs("x") and b.hf_kwargs("x")["inputs_embeds"].shape == (1, 10, 4)
    padded, mask = b.padded("x")
    assert padded.shape == (3, 5, 4) and mask.shape == (3, 5) and mask.sum(1).tolist() == [2, 5, 3]
    with pytest.raises(TypeError, match="field 'w' is a Tensor, not a NestedTensor"):
        b.hf_kwargs("w")
    with pytest.raises(ValueError, match="field 'ids' has no pair maps"):
        b.pair_maps("ids")


def test_hf_kwargs_without_row_maps_match():
    s = _samples()
    b = Collator({"ids": Field(row_maps=False)})(s)
    assert b.hf_kwargs("ids")["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 4, 0, 1, 2]]


def test_flash_attn_kwargs_refuses_images():
    b = Collator({"img": Field(ragged=(1, 2))})([{"img": torch.ones(3, 2, 2)}, {"img": torch.ones(3, 1, 2)}])
    with pytest.raises(ValueError, match=r"field 'img' has ragged dims \(1, 2\); flash_attn_kwargs needs"):
        b.flash_attn_kwargs("img")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on machines without an accelerator")
def test_pin_memory_without_accelerator_says_so():
    with pytest.raises(RuntimeError, match=r"Batch.pin_memory\(\): pinned memory needs an accelerator"):
        _batch().pin_memory()


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour of DataLoader(pin_memory=True)")
def test_dataloader_pin_memory_on_cpu_only_machine_still_delivers():
    loader = torch.utils.data.DataLoader(_samples(), batch_size=3, collate_fn=COLLATOR, pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory"):
        (b,) = list(loader)
    assert isinstance(b, Batch) and not b.is_pinned()


# ---------------------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_pin_and_move_in_one_copy_per_dtype():
    b = _batch()
    p = b.pin_memory()
    assert p.is_pinned() and p.x._meta.host_sizes.is_pinned()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g = p.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(h2d) == 3, [e.name for e in h2d]
    assert g.x.is_cuda and g.x.cu_seqlens().is_cuda and not g.x._meta.host_sizes.is_cuda
    assert not g.x._meta.host_sizes.is_pinned()  # the device batch does not hold the pinned buffer
    g.record_stream(torch.cuda.current_stream())
    assert_close_samples(g.x.cpu(), list(b.x.unbind()))
    ref = [s.unsqueeze(1) + s.unsqueeze(0) for s in b.x.unbind()]
    assert_close_samples((g.x.unsqueeze(2) + g.x.unsqueeze(1)).cpu(), ref)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_dataloader_pin_memory_pins_batches():
    loader = torch.utils.data.DataLoader(_samples(), batch_size=3, collate_fn=COLLATOR, pin_memory=True, num_workers=1)
    (b,) = list(loader)
    assert b.is_pinned()
