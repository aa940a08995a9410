"""Tensor behaviour: copies, moves, serialization, sharing, modules."""

import copy
import io
import pickle

import pytest
import torch

import padless
from padless import NestedTensor
from padless.testing import assert_close_samples, make_batch


def _same(a, b):
    assert isinstance(a, NestedTensor) and isinstance(b, NestedTensor)
    assert a.ragged_dims == b.ragged_dims and a.shape == b.shape
    assert torch.equal(a.sizes().cpu(), b.sizes().cpu()) and torch.equal(a.offsets().cpu(), b.offsets().cpu())
    assert_close_samples(a, [s.to(a.dtype) for s in b.cpu().unbind()], check_device=False)


@pytest.mark.parametrize("v", ["seq", "image", "pair", "empty_sample"])
def test_dtype_moves(v):
    nt, dense = make_batch(v)
    for conv, dt in ((lambda x: x.double(), torch.float64), (lambda x: x.half(), torch.float16),
                     (lambda x: x.to(torch.bfloat16), torch.bfloat16), (lambda x: x.float(), torch.float32),
                     (lambda x: x.to(dtype=torch.int32), torch.int32)):
        out = conv(nt)
        assert isinstance(out, NestedTensor) and out.dtype == dt and out.values().dtype == dt
        assert_close_samples(out, [conv(s) for s in dense])
    assert nt.to("cpu") is nt and nt.cpu() is nt and nt.to(torch.float32) is nt


def test_to_meta_moves_metadata_keeps_host_copy():
    nt, _ = make_batch("image")
    m = nt.to("meta")
    assert m.device.type == "meta" and m.offsets().device.type == "meta" and m.sizes().device.type == "meta"
    assert m.host_sizes().device.type == "cpu" and m.shape == nt.shape


def test_dtype_move_keeps_gradient_path():
    nt, dense = make_batch("seq", requires_grad=True)
    nt.double().sum().backward()
    assert nt.grad.dtype == torch.float32


def test_clone_detach_contiguous():
    nt, dense = make_batch("pair", requires_grad=True)
    c = nt.clone()
    assert c.values().data_ptr() != nt.values().data_ptr()
    _same(c, nt)
    d = nt.detach()
    assert not d.requires_grad and d.values().data_ptr() == nt.values().data_ptr()
    assert nt.is_contiguous() and nt.contiguous() is nt
    t = padless.from_values(torch.randn(3, 6)[:, ::2], torch.tensor([0, 1, 3]))
    assert not t.is_contiguous() and t.contiguous().is_contiguous()


def test_requires_grad_():
    nt, _ = make_batch("seq")
    assert not nt.requires_grad
    nt.requires_grad_()
    assert nt.requires_grad and nt.is_leaf
    (nt * 2).sum().backward()
    assert nt.grad is not None


def test_pickle_and_deepcopy():
    nt, _ = make_batch("image", requires_grad=True)
    for out in (pickle.loads(pickle.dumps(nt)), copy.deepcopy(nt)):
        _same(out, nt)
        assert out.requires_grad and out.is_leaf
        assert out.values().data_ptr() != nt.values().data_ptr()


def test_torch_save_load_weights_only_default():
    nt, _ = make_batch("pair")
    buf = io.BytesIO()
    torch.save({"x": nt, "w": torch.ones(2)}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True is torch's default
    _same(loaded["x"], nt)
    buf.seek(0)
    _same(torch.load(buf, weights_only=True)["x"], nt)


def test_module_buffer_and_state_dict():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", padless.from_list([torch.randn(2, 3), torch.randn(4, 3)]))

    m = M()
    m2 = copy.deepcopy(m)
    _same(m2.table, m.table)
    m.double()
    assert m.table.dtype == torch.float64 and isinstance(m.table, NestedTensor)
    sd = m.state_dict()
    other = M().double()
    other.load_state_dict(sd)
    _same(other.table, m.table)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    _same(torch.load(buf)["table"], m.table)


def test_share_memory_():
    nt, _ = make_batch("seq")
    assert not nt.is_shared()
    assert nt.share_memory_() is nt
    # the structure itself is shared (offsets()/sizes() hand out copies: issue 25, item 7)
    assert nt.is_shared() and nt._offsets.is_shared() and nt._sizes.is_shared()


def test_is_pinned_false_on_cpu_tensor():
    nt, _ = make_batch("seq")
    assert nt.is_pinned() is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_pin_and_record_stream():
    nt, dense = make_batch("image")
    p = nt.pin_memory()
    assert p.is_pinned() and p.host_sizes().is_pinned()
    g = p.to("cuda", non_blocking=True)
    assert g.device.type == "cuda" and g.offsets().is_cuda and g.cu_seqlens().is_cuda
    g.record_stream(torch.cuda.current_stream())
    assert_close_samples(g.cpu(), dense)
    assert_close_samples(padless.from_list([d.cuda() for d in dense], ragged_dims=(1, 2)).cpu(), dense)


def _worker_collate(batch):
    return padless.from_list(batch)


def test_dataloader_workers_ship_nested_tensors():
    data = [torch.randn(n, 3) for n in (2, 5, 1, 4)]
    dl = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2, collate_fn=_worker_collate)
    got = list(dl)
    assert all(isinstance(b, NestedTensor) for b in got)
    assert_close_samples(got[0], data[:2])
    assert_close_samples(got[1], data[2:])


def test_like_factories_and_new_factories():
    nt, dense = make_batch("image")
    z = torch.zeros_like(nt)
    assert isinstance(z, NestedTensor) and z.same_structure(nt) and float(z.values().abs().sum()) == 0
    o = torch.ones_like(nt, dtype=torch.float64)
    assert o.dtype == torch.float64 and bool((o.values() == 1).all())
    r = torch.randn_like(nt)
    assert r.same_structure(nt)
    f = torch.full_like(nt, 3.0)
    assert bool((f.values() == 3).all())
    e = nt.new_zeros(4, 2)
    assert type(e) is torch.Tensor and e.shape == (4, 2)


def test_numpy_names_the_arrays_a_ragged_batch_has():
    import numpy as np

    x = padless.from_list([torch.randn(2, 3), torch.randn(4, 3)])
    rewrite = r"use x\.values\(\)\.numpy\(\) for the packed rows, \[s\.numpy\(\) for s in x\.unbind\(\)\]"
    with pytest.raises(padless.StructureError, match=r"numpy\(\): a NestedTensor of 2 ragged samples .*" + rewrite):
        x.numpy()
    with pytest.raises(RuntimeError, match=r"__array__\(\): .*" + rewrite):  # torch.nested code catches RuntimeError
        np.asarray(x)
    assert np.array_equal(x.values().numpy(), torch.cat([s for s in x.unbind()]).numpy())
    assert [s.numpy().shape for s in x.unbind()] == [(2, 3), (4, 3)]
