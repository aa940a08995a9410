"""The Collator schema: declared ragged dims, casts, outputs, padding, pairs, and its errors."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils.data import default_collate

import padless
from padless import Collator, Field, NestedTensor
from padless.testing import assert_close_samples


def _seqs(lengths, dim=None, dtype=torch.int64):
    g = torch.Generator().manual_seed(0)
    if dim is None:
        return [torch.randint(0, 100, (n,), generator=g, dtype=dtype) for n in lengths]
    return [torch.randn(n, dim, generator=g) for n in lengths]


def test_declared_ragged_field_stays_nested_when_sizes_agree():
    samples = [{"ids": t, "y": i} for i, t in enumerate(_seqs([3, 3, 3]))]
    b = Collator({"ids": Field(ragged=0)})(samples)
    assert isinstance(b.ids, NestedTensor) and b.ids.ragged_dims == (0,)
    assert_close_samples(b.ids, [s["ids"] for s in samples])
    assert torch.equal(b.y, default_collate([s["y"] for s in samples]))
    assert type(padless.collate(samples)["ids"]) is torch.Tensor  # inference stacks them


def test_undeclared_fields_follow_inference_and_default_collate():
    samples = [{"ids": t, "w": torch.ones(2) * i, "name": f"s{i}"} for i, t in enumerate(_seqs([2, 4]))]
    b = Collator({"ids": Field()})(samples)
    assert torch.equal(b["w"], default_collate([s["w"] for s in samples]))
    assert b.name == ["s0", "s1"] and len(b) == 2 and list(b.keys()) == ["ids", "w", "name"]


def test_namedtuple_and_dataclass_samples():
    NT = collections.namedtuple("NT", ["ids", "y"])

    @dataclasses.dataclass
    class DC:
        ids: torch.Tensor
        y: int

    for make in (NT, DC):
        samples = [make(t, i) for i, t in enumerate(_seqs([2, 5]))]
        b = Collator({"ids": Field()})(samples)
        assert b.ids.lengths().tolist() == [2, 5] and b.y.tolist() == [0, 1]


def test_dtype_cast():
    samples = [{"x": torch.arange(3, dtype=torch.int32)}, {"x": torch.arange(2, dtype=torch.int64)}]
    b = Collator({"x": Field(dtype=torch.float16)})(samples)
    assert b.x.dtype == torch.float16 and b.x.values().tolist() == [0, 1, 2, 0, 1]


def test_images_with_declared_ragged_dims():
    imgs = [torch.randn(3, 4, 5), torch.randn(3, 4, 5), torch.randn(3, 2, 7)]
    b = Collator({"img": Field(ragged=(-2, -1))})([{"img": t} for t in imgs])
    assert b.img.ragged_dims == (1, 2)
    assert_close_samples(b.img, imgs)


def test_position_ids_seq_idx_and_labels():
    ids = [torch.tensor([5, 6]), torch.tensor([7, 8, 9]), torch.tensor([], dtype=torch.int64), torch.tensor([4])]
    c = Collator({"ids": Field(position_ids="pos", position_start=2, seq_idx="seq", labels="labels")})
    b = c([{"ids": t} for t in ids])
    assert b.pos.values().tolist() == [2, 3, 2, 3, 4, 2]
    assert b.seq.values().tolist() == [0, 0, 1, 1, 1, 3] and b.seq.dtype == torch.int32
    assert b.labels.values().tolist() == [-100, 6, -100, 8, 9, -100]
    for out in (b.pos, b.seq, b.labels):  # same structure object: structure checks are identity tests
        assert out._meta is b.ids._meta
    # next-token loss on packed rows never crosses a sample boundary
    shifted = b.labels.values()[1:]
    starts = set(b.ids.offsets()[1:-1].tolist())
    assert all(int(shifted[i - 1]) == -100 for i in starts if i < 6 and i > 0)


def test_position_ids_for_feature_sequences():
    feats = _seqs([2, 3], dim=4)
    b = Collator({"x": Field(position_ids="pos")})([{"x": t} for t in feats])
    assert b.pos.shape == (2, 3) and b.pos.values().tolist() == [0, 1, 0, 1, 2]
    assert b.pos._meta.host_offsets is b.x._meta.host_offsets


def test_pad_to_multiple_adds_a_dummy_segment():
    ids = [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    c = Collator({"ids": Field(pad_to_multiple=8, pad_value=0, position_ids="pos", labels="labels")})
    b = c([{"ids": t} for t in ids])
    assert len(b) == 2 and b.ids.batch_size == 3
    assert b.ids.values().shape[0] == 8 and b.ids.offsets().tolist() == [0, 2, 5, 8]
    assert b.ids.values().tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert b.pos.values().tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert b.labels.values().tolist() == [-100, 6, -100, 8, 9, -100, -100, -100]
    assert b.flash_attn_kwargs("ids")["cu_seqlens_q"].tolist() == [0, 2, 5, 8]
    exact = c([{"ids": torch.arange(8)}])  # already a multiple: the dummy segment is empty
    assert exact.ids.batch_size == 2 and exact.ids.offsets().tolist() == [0, 8, 8]


def test_square_pair_maps():
    feats = _seqs([2, 1, 3], dim=4)
    b = Collator({"x": Field(pair=True)})([{"x": t} for t in feats])
    pm = b.pair_maps("x")
    assert pm.offsets.tolist() == [0, 4, 5, 14]
    assert pm.rows_i[:5].tolist() == [0, 0, 1, 1, 2] and pm.rows_j[:5].tolist() == [0, 1, 0, 1, 2]
    x = b.x
    p = x.unsqueeze(2) + x.unsqueeze(1)
    ref = [s.unsqueeze(1) + s.unsqueeze(0) for s in feats]
    assert_close_samples(p, ref)
    assert_close_samples(x.unsqueeze(1) * x.unsqueeze(2), [s.unsqueeze(0) * s.unsqueeze(1) for s in feats])
    assert_close_samples(p.mean(dim=2), [r.mean(1) for r in ref])
    assert_close_samples(p.sum(dim=1), [r.sum(0) for r in ref])
    assert_close_samples(p.amax(dim=2), [r.amax(1) for r in ref])
    assert_close_samples(torch.softmax(p, dim=2), [torch.softmax(r, 1) for r in ref])
    values, idx = p.max(dim=2)  # arg-reductions read the pair coordinates (computed on first use)
    assert_close_samples(idx, [r.max(1).indices for r in ref])
    assert_close_samples(p.argmin(dim=1), [r.argmin(0) for r in ref])
    assert_close_samples(p.cumsum(dim=1), [r.cumsum(0) for r in ref])


def test_rectangular_pair_maps():
    xs, ys = _seqs([2, 3], dim=4), _seqs([4, 1], dim=4)
    b = Collator({"x": Field(pair="y"), "y": Field()})([{"x": a, "y": c} for a, c in zip(xs, ys)])
    p = b.x.unsqueeze(2) + b.y.unsqueeze(1)
    ref = [a.unsqueeze(1) + c.unsqueeze(0) for a, c in zip(xs, ys)]
    assert p.shape == (2, 3, 4, 4)
    assert_close_samples(p, ref)
    assert_close_samples(b.y.unsqueeze(1) - b.x.unsqueeze(2), [c.unsqueeze(0) - a.unsqueeze(1) for a, c in zip(xs, ys)])
    assert_close_samples(p.mean(dim=1), [r.mean(0) for r in ref])


def test_padded_index_precomputed():
    b = Collator({"img": Field(ragged=(1, 2), padded_index=True)})(
        [{"img": torch.randn(2, 3, 4)}, {"img": torch.randn(2, 1, 5)}]
    )
    padded, mask = b.padded("img")
    assert padded.shape == (2, 2, 3, 5) and mask.shape == (2, 3, 5)
    assert int(mask[0].sum()) == 12 and int(mask[1].sum()) == 5
    assert torch.equal(padded, b.img.to_padded())


# ---------------------------------------------------------------------------- bad input


def test_static_dim_mismatch_names_field_sample_shapes_and_fix():
    samples = [{"img": torch.randn(3, 4, 4)}, {"img": torch.randn(4, 4, 5)}]
    with pytest.raises(ValueError, match=r"field 'img': sample 1 has shape \(4, 4, 5\), sample 0 has \(3, 4, 4\): dim 0 differs"):
        Collator({"img": Field(ragged=(1, 2))})(samples)
    with pytest.raises(ValueError, match=r"Field\(ragged=\(0, 1\)\)"):
        Collator({"x": Field(ragged=0)})([{"x": torch.randn(2, 3)}, {"x": torch.randn(2, 4)}])


def test_rank_dtype_none_and_keys():
    c = Collator({"x": Field()})
    with pytest.raises(ValueError, match=r"field 'x': sample 1 has shape \(2, 1\) \(rank 2\), sample 0 has shape \(3,\)"):
        c([{"x": torch.ones(3)}, {"x": torch.ones(2, 1)}])
    with pytest.raises(TypeError, match=r"field 'x': sample 1 has dtype torch.int64 \(shape \(2,\)\), sample 0 has torch.float32"):
        c([{"x": torch.ones(3)}, {"x": torch.ones(2, dtype=torch.int64)}])
    with pytest.raises(TypeError, match=r"field 'x': sample 1 is None"):
        c([{"x": torch.ones(3)}, {"x": None}])
    with pytest.raises(KeyError, match=r"field 'x': sample 1 has no key 'x'"):
        c([{"x": torch.ones(3)}, {"y": torch.ones(3)}])
    with pytest.raises(KeyError, match=r"field 'x' is declared, but sample 0 has no key 'x'"):
        c([{"y": torch.ones(3)}])
    with pytest.raises(ValueError, match="empty batch"):
        c([])
    with pytest.raises(TypeError, match="sample 0 is a Tensor; a Collator takes dicts"):
        c([torch.ones(2)])
    with pytest.raises(ValueError, match=r"ragged dim 2 is out of range for samples of shape \(3,\)"):
        Collator({"x": Field(ragged=2)})([{"x": torch.ones(3)}])


def test_schema_errors():
    with pytest.raises(ValueError, match=r"pair='z' must be True or the name of another declared field"):
        Collator({"x": Field(pair="z")})
    with pytest.raises(ValueError, match="pair maps and pad_to_multiple"):
        Collator({"x": Field(pair=True, pad_to_multiple=8)})
    with pytest.raises(ValueError, match=r"position_ids output 'x' collides with field 'x'"):
        Collator({"x": Field(position_ids="x")})
    with pytest.raises(ValueError, match=r"labels output 'l' collides with the ids.position_ids output"):
        Collator({"ids": Field(position_ids="l", labels="l")})
    with pytest.raises(ValueError, match="pad_to_multiple must be a positive int"):
        Collator({"x": Field(pad_to_multiple=0)})
    with pytest.raises(TypeError, match="fields must map names to padless.Field"):
        Collator({"x": 0})
    with pytest.raises(ValueError, match=r"position_ids need samples ragged along dim 0 only"):
        Collator({"img": Field(ragged=(1, 2), position_ids="p")})([{"img": torch.ones(3, 2, 2)}])
    with pytest.raises(ValueError, match=r"pair maps need samples \(N_i, \*static\) ragged along dim 0"):
        Collator({"x": Field(ragged=1, pair=True)})([{"x": torch.ones(3, 2)}])


def test_worker_metadata_equals_the_layout_module():
    """The collator's own (numpy-backed) index maths gives layout's values."""
    from padless.collation import metadata as md
    from padless.tensor import layout

    sizes = torch.tensor([[2, 3, 4], [0, 2, 4], [3, 1, 4], [1, 0, 4]])
    for ragged in ((0,), (1,), (0, 1), (1, 0)):
        offsets = layout.offsets_from_counts(layout.row_counts(sizes, ragged))
        total = int(offsets[-1])
        rows = md.row_maps(sizes, offsets, ragged, total)
        sid, coords = layout.row_coords(sizes, offsets, ragged, total)
        assert torch.equal(rows.row_ids, sid) and all(torch.equal(a, b) for a, b in zip(rows.coords, coords))
        env = sizes.amax(0).tolist()
        assert torch.equal(md.padded_index(rows, ragged, env), layout.padded_row_index(sizes, offsets, ragged, total, env))
        assert all(torch.equal(a, b) for a, b in zip(md.partitions(sizes, ragged), layout.partitions(sizes, ragged)))


def test_pair_maps_with_empty_samples_match_the_op_layer():
    xs, ys = _seqs([2, 0, 3, 1], dim=3), _seqs([1, 2, 0, 0], dim=3)
    b = Collator({"x": Field(pair="y"), "y": Field()})([{"x": a, "y": c} for a, c in zip(xs, ys)])
    fx, fy = padless.from_list(xs), padless.from_list(ys)
    got, want = b.x.unsqueeze(2) * b.y.unsqueeze(1), fx.unsqueeze(2) * fy.unsqueeze(1)
    assert torch.equal(got.offsets(), want.offsets()) and torch.equal(got.values(), want.values())
    assert torch.equal(got.sum(dim=2).values(), want.sum(dim=2).values())
    sq = Collator({"x": Field(pair=True)})([{"x": a} for a in xs])
    assert torch.equal((sq.x.unsqueeze(2) - sq.x.unsqueeze(1)).values(), (fx.unsqueeze(2) - fx.unsqueeze(1)).values())
