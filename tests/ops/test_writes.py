"""In-place writes into views of a NestedTensor (padless.tensor.views, padless.ops.rows.setitem):
windows and positions of ragged dims, indexing of static dims, samples and sub-batches. Each
idiom is run on the batch and, as the dense code, on every sample alone; the batch's values
after the write and the gradients of its base (and of a written value) must agree, sample by
sample, with gradients on, under no_grad and under inference_mode."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import padless
from padless.tensor.errors import StructureError

F64 = torch.float64
BATCHES = {
    "ragged": [3, 1, 0, 4],  # an empty sample and one shorter than most windows
    "nonempty": [3, 1, 4],  # every sample has a last position
    "one_sample": [4],
}
C = 3


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, C, generator=g, dtype=F64) for n in lengths]


# name -> (write on the batch x given t (B, C), the same write on sample s (index i) given t[i], needs every sample non-empty)
CASES: dict[str, tuple[Callable, Callable, bool]] = {
    "zero_window": (lambda x, t: x[:, :1].zero_(), lambda s, i, t: s[:1].zero_(), False),
    "fill_position": (lambda x, t: x[:, -1].fill_(5.0), lambda s, i, t: s[-1].fill_(5.0), True),
    "fill_first_position": (lambda x, t: x[:, 0].fill_(-5.0), lambda s, i, t: s[0].fill_(-5.0), True),
    "add_clamped_window": (lambda x, t: x[:, 1:3].add_(10.0), lambda s, i, t: s[1:3].add_(10.0), False),
    "mul_negative_window": (lambda x, t: x[:, -2:].mul_(3.0), lambda s, i, t: s[-2:].mul_(3.0), False),
    "copy_window_dense": (lambda x, t: x[:, :2].copy_(t[0]), lambda s, i, t: s[:2].copy_(t[0]), False),
    "setitem_window": (lambda x, t: x.__setitem__((slice(None), slice(None, 1)), 0.0), lambda s, i, t: s.__setitem__(slice(None, 1), 0.0), False),
    "setitem_position_tensor": (lambda x, t: x.__setitem__((slice(None), -1), t), lambda s, i, t: s.__setitem__(-1, t[i]), True),
    "setitem_window_static": (lambda x, t: x.__setitem__((slice(None), slice(None, 2), 0), -1.0), lambda s, i, t: s.__setitem__((slice(None, 2), 0), -1.0), False),
    "setitem_position_static": (lambda x, t: x.__setitem__((slice(None), -1, 1), t[:, 0]), lambda s, i, t: s.__setitem__((-1, 1), t[i, 0]), True),
    "iadd_window": (lambda x, t: x[:, :2].__iadd__(t[:1]), lambda s, i, t: s[:2].__iadd__(t[:1]), False),
    "relu_inplace_window": (lambda x, t: F.relu(x[:, 1:], inplace=True), lambda s, i, t: F.relu(s[1:], inplace=True), False),
    "window_of_window": (lambda x, t: x[:, 1:][:, :1].fill_(9.0), lambda s, i, t: s[1:][:1].fill_(9.0), False),
    "static_view": (lambda x, t: x[..., 0].zero_(), lambda s, i, t: s[..., 0].zero_(), False),
    "static_view_of_window": (lambda x, t: x[:, :2][..., 1].fill_(4.0), lambda s, i, t: s[:2][..., 1].fill_(4.0), False),
    "sample": (lambda x, t: x[-1].mul_(2.0), lambda s, i, t, n=None: None, False),  # dense side below
    "sub_batch": (lambda x, t: x[1:].mul_(2.0), lambda s, i, t: s.mul_(2.0) if i >= 1 else None, False),
    "setitem_sub_batch_window": (lambda x, t: x.__setitem__((slice(1, None), slice(None, 1)), 2.0), lambda s, i, t: s[:1].fill_(2.0) if i >= 1 else None, False),
}


def _dense(name: str, s, i: int, b: int, t):
    if name == "sample":
        if i == b - 1:
            s.mul_(2.0)
        return
    CASES[name][1](s, i, t)


def _run(name, lengths, mode):
    """Values and gradients of ``(x.cos() + 0.7 * x).sum()`` after the write, batch vs samples
    (its derivative is not zero at written zeros)."""
    write, _, nonempty = CASES[name]
    rows = _samples(lengths)
    t_src = torch.randn(len(lengths), C, generator=torch.Generator().manual_seed(9), dtype=F64)
    grad = mode == "grad"
    ctx = torch.inference_mode() if mode == "inference" else torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    leaf = padless.from_list([r.clone() for r in rows]).requires_grad_(grad)
    t = t_src.clone().requires_grad_(grad)
    with ctx:
        x = leaf * 1.0  # the base: not a leaf (writing a view of a leaf that requires grad is refused)
        write(x, t)
        out = x.cos() + 0.7 * x
    got = x.unbind()
    refs, leaves = [], []
    t_ref = t_src.clone().requires_grad_(grad)
    for i, r in enumerate(rows):
        lr = r.clone().requires_grad_(grad)
        s = lr * 1.0
        _dense(name, s, i, len(rows), t_ref)
        refs.append(s)
        leaves.append(lr)
    for a, b in zip(got, refs):
        torch.testing.assert_close(a, b.detach())
    if grad:
        out.sum().backward()
        sum((s.cos() + 0.7 * s).sum() for s in refs).backward()
        for a, b in zip(leaf.grad.unbind(), leaves):
            torch.testing.assert_close(a, b.grad)
        if t_ref.grad is not None or t.grad is not None:
            torch.testing.assert_close(t.grad, t_ref.grad if t_ref.grad is not None else torch.zeros_like(t_src))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_write_through_views(name, batch, mode):
    lengths = BATCHES[batch]
    if CASES[name][2] and 0 in lengths:
        pytest.skip("a position of an empty sample is out of range (dense raises too)")
    if name in ("sub_batch", "setitem_sub_batch_window") and len(lengths) == 1:
        pytest.skip("no second sample")
    _run(name, lengths, mode)


def test_pairs_window_of_the_inner_ragged_dim():
    rows = [torch.randn(n, n, 2, dtype=F64) for n in (3, 1, 2)]
    leaf = padless.from_list([r.clone() for r in rows], ragged_dims=(0, 1)).requires_grad_()
    z = leaf * 1.0
    z[:, :, :1].zero_()
    z[:, 1:, :2] += 1.0
    (z.sin() * 2).sum().backward()
    for i, r in enumerate(rows):
        lr = r.clone().requires_grad_()
        s = lr * 1.0
        s[:, :1].zero_()
        s[1:, :2] += 1.0
        (s.sin() * 2).sum().backward()
        torch.testing.assert_close(z.unbind()[i], s.detach())
        torch.testing.assert_close(leaf.grad.unbind()[i], lr.grad)


def test_narrow_writes_through():
    rows = _samples([3, 2, 4])
    x = padless.from_list([r.clone() for r in rows])
    x.narrow(1, 1, 1).fill_(7.0)
    for got, r in zip(x.unbind(), rows):
        r.narrow(0, 1, 1).fill_(7.0)
        torch.testing.assert_close(got, r)


def test_write_is_seen_by_a_graph_that_saved_the_rows():
    """The base's version counter moves: a backward that needs its old rows raises, as dense."""
    leaf = padless.from_list(_samples([3, 2])).requires_grad_()
    x = leaf * 1.0
    y = x.exp()  # saves its output... and x.sin() saves x
    z = x.sin()
    x[:, :1].zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + z.sum()).backward()


def test_view_of_a_leaf_that_requires_grad_is_refused():
    leaf = padless.from_list(_samples([3, 2])).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf[:, :1].zero_()
    torch.testing.assert_close(leaf.values(), torch.cat(_samples([3, 2])))  # nothing written
    with torch.no_grad():  # as dense: allowed without grad
        leaf[:, :1].zero_()
    assert leaf.unbind()[0][0].abs().sum() == 0


def test_setitem_whole_samples_by_index_list():
    rows = _samples([3, 1, 2])
    x = padless.from_list([r.clone() for r in rows])
    x[[0, 2]] = 0.0
    for i, (got, r) in enumerate(zip(x.unbind(), rows)):
        torch.testing.assert_close(got, r * 0 if i in (0, 2) else r)


def test_setitem_index_list_with_an_index_inside_samples_is_refused():
    x = padless.from_list(_samples([3, 1, 2]))
    with pytest.raises(StructureError, match=r"batch index of type list with an index inside the samples.*x\[i\]\[\.\.\.\] = v"):
        x[[0, 2], :1] = 0.0


def test_position_of_an_empty_sample_is_refused_for_writes_too():
    x = padless.from_list(_samples([3, 0]))
    with pytest.raises(IndexError, match="index -1 is out of range for sample 1, of size 0"):
        x[:, -1] = 1.0


def test_views_read_as_plain_tensors():
    """A position is a dense tensor for every op that does not write it; saved and copied plain."""
    import copy
    import io

    x = padless.from_list(_samples([3, 2]))
    p = x[:, 0]
    assert isinstance(p, torch.Tensor) and type(p * 2) is torch.Tensor
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, p)
    assert type(copy.deepcopy(p)) is torch.Tensor
