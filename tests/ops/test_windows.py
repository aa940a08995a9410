"""Fixed windows of ragged dims (padless.ops.rows.windows): ``x[:, a:b]`` takes the same window
from every sample, clamped per sample as Python slicing clamps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import padless
from padless.testing import check_samples, leaves

SEQ = [(3, 4), (0, 4), (5, 4), (1, 4)]
PAIR = [(3, 3, 2), (0, 0, 2), (4, 4, 2), (1, 1, 2)]
WINDOWS = [
    slice(None, 2), slice(1, 3), slice(0, 1), slice(2, None), slice(-2, None), slice(None, -1),
    slice(-3, -1), slice(3, 1), slice(4, 9), slice(-9, 2),
]


def _ids(ws):
    return [f"{w.start}:{w.stop}" for w in ws]


@pytest.mark.parametrize("w", WINDOWS, ids=_ids(WINDOWS))
def test_sequence_window(w):
    nts = [leaves(SEQ, 1, dtype=torch.float64)]
    check_samples(lambda x: x[:, w], lambda s: s[w], nts)


@pytest.mark.parametrize("w", [slice(None, 2), slice(-1, None), slice(1, 2)], ids=_ids([slice(None, 2), slice(-1, None), slice(1, 2)]))
def test_one_sample_batch(w):
    nts = [leaves([(3, 5)], 2, dtype=torch.float64)]
    check_samples(lambda x: x[:, w], lambda s: s[w], nts)


@pytest.mark.parametrize("w", [slice(0, 1), slice(1, 3), slice(-2, None)], ids=_ids([slice(0, 1), slice(1, 3), slice(-2, None)]))
def test_pair_window_second_ragged_dim(w):
    """``z[:, :, 0:1]``: a window of the second ragged dim of a pair state."""
    nts = [leaves(PAIR, 3, dtype=torch.float64)]
    check_samples(lambda z: z[:, :, w], lambda s: s[:, w], nts)
    check_samples(lambda z: z[:, w, w], lambda s: s[w, w], nts)


def test_window_with_static_index_and_none():
    nts = [leaves(SEQ, 4, dtype=torch.float64)]
    check_samples(lambda x: x[:, 1:3, :2], lambda s: s[1:3, :2], nts)
    check_samples(lambda x: x[:, None, :2, 0], lambda s: s[None, :2, 0], nts)
    check_samples(lambda x: x[..., :2, :], lambda s: s[:2], nts)


def test_image_window():
    nts = [leaves([(3, 4, 6), (3, 2, 2), (3, 0, 1)], 5, ragged=(1, 2), dtype=torch.float64)]
    check_samples(lambda x: x[:, :, 1:3, :2], lambda s: s[:, 1:3, :2], nts)


def test_window_structure_and_gradient_scatter():
    x = padless.from_list([torch.ones(3, 2), torch.ones(1, 2), torch.ones(0, 2)]).requires_grad_()
    y = x[:, :2]
    assert y.shape == (3, 2, 2) and y.sizes()[:, 0].tolist() == [2, 1, 0]
    assert y.offsets().tolist() == [0, 2, 3, 3]
    y.values().sum().backward()
    assert x.grad.values()[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    again = x[:, :2]  # the same window again reuses the cached structure
    assert again._meta is y._meta


def test_window_errors():
    x = padless.from_list([torch.ones(3, 2), torch.ones(1, 2)])
    with pytest.raises(NotImplementedError, match=r"dim 1 is ragged; a window of it takes slice step 1 only, got 2"):
        x[:, ::2]
    with pytest.raises(IndexError, match=r"index 1 is out of range for sample 1, of size 1 along ragged dim 1"):
        x[:, 1]
    z = padless.from_list([torch.ones(3, 3, 2), torch.ones(1, 1, 2)], ragged_dims=(0, 1))
    with pytest.raises(NotImplementedError, match=r"dim 1 is ragged .* so 0 would cut every sample"):
        z[:, 0]  # an int picks a position only on a sole ragged dim


@pytest.mark.parametrize("k", [0, 1, -1, -2])
def test_int_position_of_sole_ragged_dim(k):
    """``x[:, 0]`` (the class token): position k of every sample, dense ``(B, ...)``."""
    nts = [leaves([(3, 4), (2, 4), (5, 4)], 6, dtype=torch.float64)]
    out = check_samples(lambda x: x[:, k], lambda s: s[k], nts)
    assert not isinstance(out, padless.NestedTensor) and out.shape == (3, 4)
    check_samples(lambda x: x[:, k, 1:3], lambda s: s[k, 1:3], [leaves([(2, 4), (4, 4)], 7, dtype=torch.float64)])
    check_samples(lambda x: x[:, :, k], lambda s: s[:, k], [leaves([(3, 4), (3, 2)], 8, ragged=(1,), dtype=torch.float64)])


INT_LIKE = {
    "numpy_window": ((slice(None), slice(np.int64(0), np.int64(2))), (slice(0, 2),)),
    "numpy_negative_window": ((slice(None), slice(np.int32(-2), None)), (slice(-2, None),)),
    "tensor_window": ((slice(None), slice(torch.tensor(1), torch.tensor(3))), (slice(1, 3),)),
    "numpy_static": ((Ellipsis, np.int64(1)), (Ellipsis, 1)),
    "tensor_static": ((slice(None), slice(None), torch.tensor(0)), (slice(None), 0)),
}


@pytest.mark.parametrize("name", sorted(INT_LIKE))
def test_numpy_ints_and_0d_tensors_index_as_ints(name):
    """``x[:, np.int64(0):np.int64(2)]``, ``x[:, torch.tensor(1):...]``: the ints they hold."""
    index, per_sample = INT_LIKE[name]
    check_samples(lambda x: x[index], lambda s: s[per_sample], [leaves(SEQ, 3, dtype=torch.float64)])


def test_0d_tensor_position_and_batch_index():
    nts = [leaves([(3, 4), (5, 4), (1, 4)], 4, dtype=torch.float64)]
    check_samples(lambda x: x[:, torch.tensor(-1)], lambda s: s[-1], nts)
    x, dense = leaves([(3, 4), (5, 4)], 5, dtype=torch.float64)
    torch.testing.assert_close(x[torch.tensor(1)], dense[1])
    torch.testing.assert_close(x[np.int64(0), np.int64(2)], dense[0][2])


def test_0d_index_tensor_off_the_cpu_is_refused():
    x, _ = leaves(SEQ, 6, dtype=torch.float64)
    with pytest.raises(IndexError, match=r"a 0-d index tensor on meta would be read on the host \(a device sync\); pass int\(t\)"):
        x[:, torch.tensor(1, device="meta")]
