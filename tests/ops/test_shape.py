"""Shape ops that keep every sample's rows (padless/ops/rows/shape.py) and static indexing
(padless/tensor/convert.getitem), through the reference harness."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.testing import check_op, make_batch
from padless.tensor.core import NestedTensor

Case = tuple[str, Callable, Callable | None]

# (variant, op on the NestedTensor, per-sample reference or None for fn(s[None])[0])
RESHAPE: list[Case] = [
    ("seq", lambda x: x.reshape(x.shape[0], -1, 2, 2), None),
    ("empty_sample", lambda x: x.reshape(-1, x.shape[1], 4, 1), lambda s: s.reshape(-1, 4, 1)),
    ("all_empty", lambda x: x.reshape(x.shape[0], -1, 2, 2), None),
    ("one_sample", lambda x: torch.reshape(x, (1, -1, 2, -1)), lambda s: s.reshape(-1, 2, 2)),
    ("all_equal", lambda x: x.reshape(x.shape), None),
    ("seq_1d", lambda x: x.reshape(x.shape[0], -1, 1), None),
    ("channels_first", lambda x: x.reshape(-1, 2, 2, x.shape[2]), lambda s: s.reshape(2, 2, -1)),
    ("image", lambda x: x.reshape(x.shape[0], 1, 3, -1, -1), lambda s: s.reshape(1, 3, *s.shape[1:])),
    ("pair", lambda x: x.reshape(x.shape[0], -1, -1, 2, 1), lambda s: s.reshape(*s.shape[:2], 2, 1)),
    ("heads_pair", lambda x: x.reshape(-1, 1, 2, -1, -1), lambda s: s.reshape(1, 2, *s.shape[1:])),
    ("three_ragged", lambda x: x.reshape(x.shape[0], -1, -1, -1, 1, 2), lambda s: s.reshape(*s.shape[:3], 1, 2)),
    ("static_zero", lambda x: x.reshape(x.shape[0], -1, 0, 5), lambda s: s.reshape(s.shape[0], 0, 5)),
]


@pytest.mark.parametrize("v, fn, ref", RESHAPE, ids=[c[0] for c in RESHAPE])
def test_reshape(v, fn, ref):
    out = check_op(fn, v, ref=ref)
    assert len(out.ragged_dims) == len(make_batch(v)[0].ragged_dims)  # ragged dims stay declared


@pytest.mark.parametrize("v, fn, ref", RESHAPE[:3] + RESHAPE[6:9], ids=[c[0] for c in RESHAPE[:3] + RESHAPE[6:9]])
def test_view_is_a_view_of_values(v, fn, ref):
    def as_view(x):
        return x.view(*fn(x).shape) if isinstance(x, NestedTensor) else fn(x)

    check_op(as_view, v, ref=ref or (lambda s: fn(s[None])[0]))
    nt, _ = make_batch(v)
    assert as_view(nt).values().data_ptr() == nt.values().data_ptr()


def test_reshape_keeps_ragged_positions_and_storage_order():
    nt, dense = make_batch("channels_first")  # (4, L_i) -> (2, 2, L_i)
    out = nt.reshape(nt.shape[0], 2, 2, -1)
    assert out.ragged_dims == (2,) and out.shape[1:3] == (2, 2)
    t = make_batch("pair")[0].transpose(1, 2)  # ragged stored as (1, 0)
    out = t.reshape(t.shape[0], -1, -1, 1, 2)
    assert out._ragged == (1, 0)
    for got, s in zip(out.unbind(), make_batch("pair")[1]):
        torch.testing.assert_close(got, s.transpose(0, 1).reshape(*s.shape[:2], 1, 2))


def test_reshape_prefers_minus_one_and_original_positions():
    x = padless.from_list([torch.randn(1, 1), torch.randn(1, 1)], ragged_dims=(0,))  # envelope (2, 1, 1)
    assert x.reshape(2, 1, 1).ragged_dims == (0,)
    assert x.reshape(2, 1, -1).ragged_dims == (1,)


def test_reshape_as_and_view_as():
    nt, _ = make_batch("seq")
    other = nt.unflatten(2, (2, 2))
    check_op(lambda x: x.reshape_as(x.unflatten(-1, (2, 2))), "seq")
    assert nt.view_as(other).shape == other.shape
    with pytest.raises(ValueError, match=r"reshape_as\(\): ragged structures differ: sample 0 has \(3, 4\), other has \(5, 4\)"):
        nt.reshape_as(make_batch("seq")[0][[1, 0, 2]])
    with pytest.raises(ValueError, match=r"view_as\(\): ragged structures differ: ragged sample dims \(0,\) vs \(0, 1\), batch sizes 3 vs 3"):
        nt.view_as(make_batch("pair")[0])


def test_view_dtype_reinterprets_the_last_dim():
    check_op(lambda x: x.view(torch.int32), "seq", grad=False)
    check_op(lambda x: x.view(torch.float16), "pair", grad=False)
    with pytest.raises(ValueError, match=r"view\(\): viewing as torch.float16 rescales the last dim, which must be static \(ragged outer dims: \(2,\)\)"):
        make_batch("channels_first")[0].view(torch.float16)


def test_reshape_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"reshape\(\): the target shape \(5, -1\) must keep the batch dim first \(as 3 or -1\)"):
        nt.reshape(5, -1)
    with pytest.raises(ValueError, match=r"reshape\(\): cannot reshape .* to \(-1, 8\)"):
        nt.reshape(-1, 8)  # nt.reshape(-1, 4) flattens every real row (tests/ops/test_shape_idioms.py)
    with pytest.raises(ValueError, match=r"reshape\(\): cannot reshape a NestedTensor of envelope \(3, 5, 4\) with ragged outer dims \(1,\) to \(3, 20\).*only static dims can be reshaped"):
        nt.reshape(3, 20)
    with pytest.raises(ValueError, match=r"static runs hold \(1, 4\) elements"):
        nt.reshape(3, -1, 3)
    with pytest.raises(ValueError, match=r"view\(\): cannot reshape"):
        nt.view(3, 2, -1)  # would cross the ragged dim
    x = padless.from_list([torch.randn(2, 1)] * 2, ragged_dims=(1,))  # envelope (2, 2, 1)
    with pytest.raises(ValueError, match=r"reshape\(\): target shape \(2, 1, 2, 1, 1\) is ambiguous .* write each ragged dim as -1"):
        x.reshape(2, 1, 2, 1, 1)
    assert x.reshape(2, 1, 2, -1, 1).shape == (2, 1, 2, 1, 1)
    with pytest.raises(ValueError, match=r"invalid target shape"):
        nt.reshape(3, -1, -2)
    with pytest.raises(TypeError, match=r"reshape\(\): shape entries must be ints"):
        nt.reshape(3, -1, 4.0)


# ---------------------------------------------------------------------------- flatten / unflatten

FLATTEN: list[Case] = [
    ("seq", lambda x: x.unflatten(-1, (2, 2)).flatten(2), None),
    ("pair", lambda x: x.unsqueeze(-1).flatten(-2), None),
    ("seq", lambda x: x.flatten(1, 1), None),
    ("image", lambda x: x.flatten(2), None),
    ("image", lambda x: torch.flatten(x, 2, 3), None),
    ("pair", lambda x: x.flatten(1, 2), None),
    ("rect", lambda x: x.flatten(1, -2), None),
    ("heads_pair", lambda x: x.flatten(-2), None),
    ("three_ragged", lambda x: x.flatten(1, 3), None),
    ("three_ragged", lambda x: x.flatten(2, 3), None),
    ("empty_sample", lambda x: x.unsqueeze(-1).flatten(2), None),
]


@pytest.mark.parametrize("v, fn, ref", FLATTEN, ids=[f"{c[0]}-{i}" for i, c in enumerate(FLATTEN)])
def test_flatten(v, fn, ref):
    check_op(fn, v, ref=ref)


def test_flatten_of_ragged_dims_keeps_rows_and_host_metadata():
    nt, _ = make_batch("image")
    out = nt.flatten(2)
    assert out.ragged_dims == (1,) and out.values().data_ptr() == nt.values().data_ptr()
    assert torch.equal(out._meta.host_sizes, torch.tensor([[3, 20], [3, 12], [3, 9]]))
    assert out.shape == (3, 3, 20)


def test_flatten_errors():
    nt, _ = make_batch("image")
    with pytest.raises(ValueError, match=r"flatten\(\): dims 0\.\.3 include the batch dim \(0\)"):
        nt.flatten()
    with pytest.raises(ValueError, match=r"flatten\(\): dims 1\.\.2 mix ragged dims \(2,\) with static dims \(1,\)"):
        nt.flatten(1, 2)
    with pytest.raises(ValueError, match=r"flatten\(\): start_dim 3 comes after end_dim 2"):
        nt.flatten(3, 2)
    p, _ = make_batch("pair")
    with pytest.raises(ValueError, match=r"flatten\(\): ragged dims 1\.\.2 are stored in order \(2, 1\)"):
        p.transpose(1, 2).flatten(1, 2)
    with pytest.raises(IndexError, match=r"flatten\(\): dim 5 is out of range"):
        nt.flatten(1, 5)
    compiled = torch.compile(lambda x: x.flatten(2), backend="aot_eager", fullgraph=True)
    out = compiled(nt)  # compiles now: the envelope max H_i*W_i is a new symbol (tests/ops/test_shape_compile.py)
    assert out.shape == nt.flatten(2).shape and torch.equal(out.values(), nt.values())


UNFLATTEN: list[Case] = [
    ("seq", lambda x: x.unflatten(2, (2, 2)), None),
    ("empty_sample", lambda x: x.unflatten(-1, (2, -1)), None),
    ("all_empty", lambda x: torch.unflatten(x, 2, (4, 1)), None),
    ("channels_first", lambda x: x.unflatten(1, (2, 2)), None),
    ("image", lambda x: x.unflatten(1, (1, 3)), None),
    ("pair", lambda x: x.unflatten(3, (2, 1)), None),
]


@pytest.mark.parametrize("v, fn, ref", UNFLATTEN, ids=[c[0] for c in UNFLATTEN])
def test_unflatten(v, fn, ref):
    check_op(fn, v, ref=ref)


def test_unflatten_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"unflatten\(\): dim 1 is ragged; samples have different extents along it.*\(ragged outer dims: \(1,\)\)"):
        nt.unflatten(1, (1, -1))
    with pytest.raises(ValueError, match=r"unflatten\(\): dim 0 is the batch dim"):
        nt.unflatten(0, (1, 3))


# ---------------------------------------------------------------------------- expand / pad

EXPAND: list[Case] = [
    ("seq", lambda x: x[..., :1].expand(-1, -1, 3), None),
    ("empty_sample", lambda x: x[..., 1:2].expand(x.shape[0], -1, 5), None),
    ("one_sample", lambda x: x.unsqueeze(2).expand(-1, -1, 2, -1), None),
    ("image", lambda x: x[:, :1].expand(-1, 4, -1, -1), None),
    ("pair", lambda x: x.unsqueeze(-1).expand(-1, -1, -1, -1, 3), None),
    ("seq", lambda x: x[..., :1].expand_as(x), None),
    ("channels_first", lambda x: x.expand(x.shape), None),
]


@pytest.mark.parametrize("v, fn, ref", EXPAND, ids=[f"{c[0]}-{i}" for i, c in enumerate(EXPAND)])
def test_expand(v, fn, ref):
    check_op(fn, v, ref=ref)


def test_expand_with_envelope_extents_and_dense_other():
    nt, _ = make_batch("seq")
    a = nt[..., :1].expand(nt.shape[0], nt.shape[1], 3)
    b = nt[..., :1].expand(-1, -1, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
    assert nt[..., :1].expand_as(torch.empty(nt.shape)).shape == nt.shape


def test_expand_errors():
    nt, _ = make_batch("seq")
    with pytest.raises(ValueError, match=r"expand\(\): dim 1 is ragged; it cannot be expanded to 7 \(ragged outer dims: \(1,\)\)"):
        nt.expand(3, 7, 4)
    with pytest.raises(ValueError, match=r"expand\(\): static dim 2 has extent 4; only extent-1 dims expand \(to 8\)"):
        nt.expand(-1, -1, 8)
    with pytest.raises(ValueError, match=r"expand\(\): target \(2, 3, 5, 4\) must have 3 entries"):
        nt.expand(2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"expand\(\): the batch dim must stay 3 \(or -1\), got 6"):
        nt.expand(6, -1, -1)
    with pytest.raises(ValueError, match=r"expand_as\(\): ragged structures differ: sample 0 has \(3, 1\), other has \(5, 4\)"):
        nt[..., :1].expand_as(nt[[1, 0, 2]])


PAD: list[Case] = [
    ("seq", lambda x: F.pad(x, (1, 2)), None),
    ("empty_sample", lambda x: F.pad(x, (0, 1), value=3.5), None),
    ("all_empty", lambda x: F.pad(x, (2, 0)), None),
    ("seq", lambda x: F.pad(x, (0, 0)), None),
    ("seq", lambda x: F.pad(x, (-1, 1)), None),
    ("image", lambda x: F.pad(x, (0, 0, 0, 0, 1, 1), value=-1.0), None),
    ("heads_pair", lambda x: F.pad(x, [0, 0, 0, 0, 2, 0]), None),
    ("pair", lambda x: F.pad(x.unsqueeze(-2), (1, 1, 2, 0)), None),
    ("seq", lambda x: F.pad(x, (2, 1), mode="reflect"), None),
    ("one_sample", lambda x: F.pad(x, (1, 2), mode="replicate"), None),
    ("seq", lambda x: F.pad(x, (1, 1), mode="circular"), None),
    ("all_equal", lambda x: F.pad(x, (1, 1), mode="replicate"), None),
]


@pytest.mark.parametrize("v, fn, ref", PAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(PAD)])
def test_pad(v, fn, ref):
    check_op(fn, v, ref=ref)


def test_pad_errors():
    cf, _ = make_batch("channels_first")
    with pytest.raises(ValueError, match=r"pad\(\): pad \(1, 1, 1\) must have an even length of at most 2 \* 2"):
        F.pad(cf, (1, 1, 1))
    with pytest.raises(ValueError, match=r"pad\(\): pad .* must have an even length"):
        F.pad(cf, (0,) * 6)


# ---------------------------------------------------------------------------- split / chunk / tensor_split

SPLIT: list[tuple[str, Callable[[torch.Tensor], tuple], int]] = [
    ("seq", lambda x: x.split(3, dim=2), 2),
    ("empty_sample", lambda x: torch.split(x, [1, 3], dim=-1), 2),
    ("image", lambda x: x.split(1, 1), 3),
    ("pair", lambda x: x.chunk(2, dim=3), 2),
    ("all_empty", lambda x: torch.chunk(x, 3, -1), 2),
    ("channels_first", lambda x: x.tensor_split([1, 3], dim=1), 3),
    ("one_sample", lambda x: torch.tensor_split(x, 3, dim=2), 3),
]


@pytest.mark.parametrize("v, fn, n", SPLIT, ids=[f"{c[0]}-{i}" for i, c in enumerate(SPLIT)])
def test_split_static(v, fn, n):
    nt, _ = make_batch(v)
    assert len(fn(nt)) == n
    for k in range(n):
        check_op(lambda x, k=k: fn(x)[k], v)


@pytest.mark.parametrize(
    "fn, sizes",
    [
        (lambda x: x.split(2), [2, 1]),
        (lambda x: torch.split(x, [1, 0, 2], dim=0), [1, 0, 2]),
        (lambda x: x.chunk(2), [2, 1]),
        (lambda x: torch.tensor_split(x, [1], dim=0), [1, 2]),
        (lambda x: x.tensor_split(3), [1, 1, 1]),
    ],
)
def test_split_batch_gives_sub_batches(fn, sizes):
    nt, dense = make_batch("empty_sample", requires_grad=True)
    pieces = fn(nt)
    assert [p.batch_size for p in pieces] == sizes
    got = [s for p in pieces for s in p.unbind()]
    for g, d in zip(got, dense):
        torch.testing.assert_close(g, d)
    sum(p.values().sum() * (i + 1) for i, p in enumerate(pieces)).backward()
    assert nt.grad is not None


def test_split_errors():
    nt, _ = make_batch("seq")
    for op in (lambda: nt.split(2, 1), lambda: nt.chunk(2, 1)):
        with pytest.raises(ValueError, match=r"(split|chunk)\(\): dim 1 is ragged; .*narrow\(1, start, length\).*\(ragged outer dims: \(1,\)\)"):
            op()
    with pytest.raises(ValueError, match=r"tensor_split\(\): dim 1 is ragged"):
        nt.tensor_split(2, 1)
    with pytest.raises(ValueError, match=r"split\(\): sections \(1, 1\) sum to 2, the batch has 3 samples"):
        nt.split([1, 1])


# ---------------------------------------------------------------------------- indexing

INDEX: list[Case] = [
    ("seq", lambda x: x[:, :, 1:3], None),
    ("seq", lambda x: x[..., 0], None),
    ("seq", lambda x: x[:, ..., 0], None),
    ("empty_sample", lambda x: x[..., -1], None),
    ("all_empty", lambda x: x[..., :2], None),
    ("one_sample", lambda x: x[:, :, ::2], None),
    ("seq", lambda x: x[:, None], None),
    ("seq", lambda x: x[..., None, 1:], None),
    ("seq", lambda x: x[:, : x.shape[1]], None),
    ("channels_first", lambda x: x[:, 1:3], None),
    ("image", lambda x: x[:, 0], None),
    ("image", lambda x: x[:, None, 1:, ..., None], None),
    ("pair", lambda x: x[..., 1], None),
    ("heads_pair", lambda x: x[:, -1], None),
    ("three_ragged", lambda x: x[:, :, :, :, 0], None),
    ("static_zero", lambda x: x[..., :0], None),
]


@pytest.mark.parametrize("v, fn, ref", INDEX, ids=[f"{c[0]}-{i}" for i, c in enumerate(INDEX)])
def test_index_static_dims(v, fn, ref):
    check_op(fn, v, ref=ref)


def test_index_batch_and_static_together():
    nt, dense = make_batch("pair", requires_grad=True)
    out = nt[[2, 0], ..., 1]
    for got, i in zip(out.unbind(), (2, 0)):
        torch.testing.assert_close(got, dense[i][..., 1])
    out = nt[1:, :, :, 0]
    assert out.batch_size == 2
    out.values().sum().backward()
    assert nt.grad is not None
    assert nt[...] is nt and nt[()] is nt
    assert nt[:].batch_size == 3 and nt[:, ...].batch_size == 3
    torch.testing.assert_close(nt[1, ..., 0], dense[1][..., 0])  # int batch index: a dense sample


def test_index_static_is_a_view():
    nt, _ = make_batch("seq")
    assert nt[..., 1:].values().data_ptr() == nt.values()[:, 1:].data_ptr()


def test_index_errors():
    nt, _ = make_batch("seq")
    pair, _ = make_batch("pair")
    with pytest.raises(NotImplementedError, match=r"dim 1 is ragged .* so 0 would cut every sample.*x\.narrow\(1, start, length\)"):
        pair[:, 0]  # nt[:, 0] with one ragged dim picks position 0 of every sample (tests/ops/test_windows.py)
    with pytest.raises(NotImplementedError, match=r"dim 1 is ragged; a window of it takes slice step 1 only, got 2"):
        nt[:, 1::2]  # nt[:, 1:] takes that window of every sample (tests/ops/test_windows.py)
    with pytest.raises(IndexError, match=r"None before the batch dim would add a dim in front of the batch"):
        nt[None]
    with pytest.raises(IndexError, match=r"index 4 is out of range for static dim 2 of size 4"):
        nt[..., 4]
    with pytest.raises(IndexError, match=r"too many indices \(4\) for a NestedTensor of 3 dims"):
        nt[:, :, :, 0]
    with pytest.raises(IndexError, match=r"only have a single ellipsis"):
        nt[..., 0, ...]
    with pytest.raises(NotImplementedError, match=r"only ints, slices, None and \.\.\. can index the dims inside samples \(got Tensor at dim 2\)"):
        nt[..., torch.tensor([0, 1])]
    with pytest.raises(NotImplementedError, match=r"got bool at dim 2"):
        nt[..., True]
    with pytest.raises(ValueError, match=r"slice step must be positive, got -1 at dim 2"):
        nt[..., ::-1]


# ---------------------------------------------------------------------------- dtypes, layouts, compile


@pytest.mark.parametrize(
    "v, fn, ref",
    [
        ("seq", lambda x: x.unflatten(-1, (2, 2)).transpose(2, 3).reshape(x.shape[0], -1, 4), None),  # strided values
        ("pair", lambda x: x.transpose(1, 2).reshape(x.shape[0], -1, -1, 1, 2), lambda s: s.transpose(0, 1).unsqueeze(2)),
        ("image", lambda x: x.movedim(1, -1)[..., :2].flatten(1, 2), None),
    ],
)
def test_shape_ops_on_non_contiguous_layouts(v, fn, ref):
    check_op(fn, v, ref=ref)


@pytest.mark.parametrize(
    "v, fn",
    [
        ("seq", lambda x: F.pad(x[..., 1:].unflatten(-1, (1, 3)), (1, 0))),
        ("image", lambda x: x.flatten(2)[:, None, :2].expand(-1, 2, -1, -1)),
    ],
)
def test_shape_ops_bf16(v, fn):
    check_op(fn, v, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "v, fn",
    [
        ("seq", lambda x: x.reshape(x.shape[0], -1, 2, 2)),
        ("seq", lambda x: x[..., 1:3]),
        ("pair", lambda x: F.pad(x, (1, 1))),
        ("seq", lambda x: x.unflatten(-1, (2, 2)).flatten(2)),
        ("seq", lambda x: x.split(2, dim=2)[1]),
        ("seq", lambda x: x[..., :1].expand_as(x)),
    ],
)
def test_static_shape_ops_compile(v, fn):
    check_op(fn, v, compiled=True)
