"""Windows and positions of ragged dims whose bounds are read from the batch's shape
(padless.ops.rows.windows): ``x[:, :x.shape[1] - 1]`` gives every sample its own bound
``L_i - 1`` (Python's slice semantics on that sample alone, negative values and clamping
included), as the padded code does on one sample. Issue 39, fuzzer entry
``window_extent_bound``: the bound was read as the envelope's int."""

from __future__ import annotations

import pytest
import torch

import padless
from padless.tensor.errors import StructureError
from padless.testing import check_samples, leaves

SEQ = [(3, 4), (0, 4), (5, 4), (1, 4), (4, 4)]
NONEMPTY = [(3, 4), (5, 4), (1, 4), (4, 4)]

# name -> the window, given the size n (an Extent on the batch, the sample's own size alone)
WINDOWS = {
    "stop_n_minus_1": lambda n: slice(None, n - 1),
    "start_half": lambda n: slice(n // 2, None),
    "one_to_n": lambda n: slice(1, n),
    "whole": lambda n: slice(None, n),
    "last_half_negative": lambda n: slice(-(n // 2), None),
    "start_below_zero": lambda n: slice(n - 6, None),  # negative for every sample: counts from its end, clamped
    "both_from_shape": lambda n: slice(n // 3, n - 1),
    "even_prefix": lambda n: slice(None, (n // 2) * 2),  # the envelope's int covers a sample its own bound cuts
    "stop_negative_n": lambda n: slice(None, -n),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_window_bound_from_shape_is_per_sample(name):
    w = WINDOWS[name]
    check_samples(lambda x: x[:, w(x.shape[1])], lambda s: s[w(s.shape[0])], [leaves(SEQ, 1, dtype=torch.float64)])
    check_samples(lambda x: x[:, w(x.size(1))], lambda s: s[w(s.size(0))], [leaves(SEQ, 2, dtype=torch.float64)])


@pytest.mark.parametrize("name", ["stop_n_minus_1", "start_half", "even_prefix"])
def test_window_bound_from_shape_one_sample_batch(name):
    w = WINDOWS[name]
    check_samples(lambda x: x[:, w(x.shape[1])], lambda s: s[w(s.shape[0])], [leaves([(5, 2)], 3, dtype=torch.float64)])


def test_window_bound_from_shape_second_ragged_dim():
    pair = [(3, 3, 2), (0, 0, 2), (4, 4, 2), (1, 1, 2)]
    check_samples(lambda z: z[:, :, : z.shape[2] - 1], lambda s: s[:, : s.shape[1] - 1], [leaves(pair, 4, ragged=(0, 1), dtype=torch.float64)])
    check_samples(lambda z: z[:, 1 : z.shape[1], : z.shape[2] // 2], lambda s: s[1:, : s.shape[1] // 2], [leaves(pair, 5, ragged=(0, 1), dtype=torch.float64)])


@pytest.mark.parametrize("k", ["last", "first", "half"])
def test_position_from_shape_is_per_sample(k):
    pick = {"last": lambda n: n - 1, "first": lambda n: -n, "half": lambda n: n // 2}[k]
    check_samples(lambda x: x[:, pick(x.shape[1])], lambda s: s[pick(s.shape[0])], [leaves(NONEMPTY, 6, dtype=torch.float64)])


def test_position_from_shape_out_of_range_names_the_sample():
    x = padless.from_list([torch.ones(3, 2), torch.ones(1, 2)])
    with pytest.raises(IndexError, match=r"index 3 is out of range for sample 0, of size 3 along ragged dim 1"):
        x[:, x.shape[1]]


@pytest.mark.parametrize("write", ["setitem", "mul_", "iadd", "position"])
def test_write_through_window_from_shape(write):
    lengths = [3, 1, 0, 4] if write != "position" else [3, 1, 4]
    g = torch.Generator().manual_seed(7)
    samples = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in lengths]
    x = padless.from_list([s.clone() for s in samples])

    def apply(t, n):
        if write == "setitem":
            t[:, : n - 1] = 0.5
        elif write == "mul_":
            t[:, n // 2 :].mul_(3.0)
        elif write == "iadd":
            t[:, 1:n] += 1.0
        else:
            t[:, n - 1] = -2.0

    apply(x, x.shape[1])
    for i, s in enumerate(samples):
        apply(s[None], s.shape[0])
        torch.testing.assert_close(x[i], s)


def test_window_bound_from_another_batch_is_refused():
    x = padless.from_list([torch.ones(3, 2), torch.ones(1, 2)])
    y = padless.from_list([torch.ones(2, 2), torch.ones(2, 2), torch.ones(1, 2)])
    with pytest.raises(StructureError, match=r"the window's stop = 1 was read from the shape of a batch of 3 samples"):
        x[:, : y.shape[1] - 1]
    assert x[:, : int(y.shape[1]) - 1].sizes()[:, 0].tolist() == [1, 1]  # int(...): the same bound for every sample


NARROWS = {
    "drop_last": lambda n: (0, n - 1),
    "second_half": lambda n: (n // 2, n - n // 2),
    "negative_start": lambda n: (-n, n // 2),
    "skip_first": lambda n: (1, n - 1),
}


@pytest.mark.parametrize("name", list(NARROWS))
def test_narrow_from_shape_is_per_sample(name):
    """``x.narrow(1, start, length)`` with sizes read from the shape: every sample's own window."""
    w = NARROWS[name]
    seq = [(3, 4), (5, 4), (1, 4), (2, 4)]
    check_samples(lambda x: x.narrow(1, *w(x.shape[1])), lambda s: s.narrow(0, *w(s.shape[0])), [leaves(seq, 8, dtype=torch.float64)])
    check_samples(lambda x: x.narrow(1, *w(x.shape[1])), lambda s: s.narrow(0, *w(s.shape[0])), [leaves([(4, 2)], 9, dtype=torch.float64)])


def test_narrow_from_shape_too_short_names_the_sample():
    x = padless.from_list([torch.ones(3, 2), torch.ones(4, 2)])
    with pytest.raises(IndexError, match=r"narrow\(\): sample 0 has size 3 along dim 1, too short for its window start=2, length=2"):
        x.narrow(1, 2, x.shape[1] - 1)
    y = padless.from_list([torch.ones(2, 2), torch.ones(2, 2), torch.ones(1, 2)])
    with pytest.raises(StructureError, match=r"narrow\(\): length = 1 was read from the shape of a batch of 3 samples"):
        x.narrow(1, 0, y.shape[1] - 1)
