"""NestedTensor <-> torch.nn.utils.rnn.PackedSequence: torch's own packing, both ways."""

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import padless
from padless.testing import assert_close_samples


def _samples(lens, feat=(3,), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, *feat, generator=g, dtype=torch.float64) for n in lens]


@pytest.mark.parametrize("lens", [[2, 4, 1, 4], [1], [5, 3, 3, 1], [2, 2, 2]])
@pytest.mark.parametrize("feat", [(3,), (2, 3), ()])
def test_to_packed_sequence_is_pack_sequence(lens, feat):
    xs = _samples(lens, feat)
    x = padless.from_list(xs)
    ps = x.to_packed_sequence()
    ref = pack_sequence(xs, enforce_sorted=False)
    assert torch.equal(ps.batch_sizes, ref.batch_sizes)
    # torch sorts ties in any order; the packed rows follow ps's own order
    torch.testing.assert_close(pad_packed_sequence(ps, batch_first=True)[0], pad_packed_sequence(ref, batch_first=True)[0])
    assert torch.equal(ps.unsorted_indices, torch.argsort(ps.sorted_indices))
    assert_close_samples(padless.from_packed_sequence(ps), xs)


def test_round_trip_and_gradients():
    xs = _samples([3, 1, 5])
    x = padless.from_list(xs, requires_grad=True)
    back = padless.NestedTensor.from_packed_sequence(padless.to_packed_sequence(x))
    assert back.ragged_dims == (0,) and back.same_structure(x)
    w = padless.from_list(_samples([3, 1, 5], seed=1))
    (back * w).sum().backward()
    assert_close_samples(x.grad, w.unbind(), what="gradient")


def test_from_torch_packing_in_batch_order():
    xs = _samples([2, 5, 3])
    lengths = torch.tensor([2, 5, 3])
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    for enforce_sorted, batch in ((False, padded), (True, padded[[1, 2, 0]])):
        lens = lengths if not enforce_sorted else lengths[[1, 2, 0]]
        ps = pack_padded_sequence(batch, lens, batch_first=True, enforce_sorted=enforce_sorted)
        want = xs if not enforce_sorted else [xs[1], xs[2], xs[0]]
        assert_close_samples(padless.from_packed_sequence(ps), want)


def test_enforce_sorted():
    xs = _samples([4, 4, 2])
    ps = padless.from_list(xs).to_packed_sequence(enforce_sorted=True)
    assert ps.sorted_indices is None and ps.batch_sizes.tolist() == [3, 3, 2, 2]
    assert_close_samples(padless.from_packed_sequence(ps), xs)
    with pytest.raises(padless.StructureError, match=r"enforce_sorted=True .* sample 2 \(length 5\) is longer than sample 1"):
        padless.from_list(_samples([4, 2, 5])).to_packed_sequence(enforce_sorted=True)


def test_refusals():
    with pytest.raises(padless.StructureError, match=r"to_packed_sequence\(\): sample 1 has length 0"):
        padless.from_list(_samples([2, 0, 1])).to_packed_sequence()
    with pytest.raises(padless.StructureError, match=r"to_packed_sequence\(\): expects a batch of sequences .* ragged dims \(0, 1\)"):
        padless.from_list([torch.randn(2, 3), torch.randn(3, 2)]).to_packed_sequence()
    with pytest.raises(TypeError, match=r"to_packed_sequence\(\): expects a NestedTensor"):
        padless.to_packed_sequence(torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"from_packed_sequence\(\): expects a torch.nn.utils.rnn.PackedSequence"):
        padless.from_packed_sequence(torch.randn(2, 3))


def test_cached_plan_is_shared_by_a_linear_output():
    x = padless.from_list(_samples([2, 5, 3]))
    x.to_packed_sequence()
    y = torch.nn.functional.linear(x, torch.randn(7, 3, dtype=torch.float64))
    assert any(k[0] == "packed_sequence" for k in y._meta.derived if isinstance(k, tuple))


def test_empty_batch_and_traced_values_are_refused():
    x = padless.from_list(_samples([2, 3]))
    with pytest.raises(padless.StructureError, match=r"to_packed_sequence\(\): the batch holds no sample"):
        x[torch.tensor([False, False])].to_packed_sequence()
    with pytest.raises(NotImplementedError, match=r"to_packed_sequence\(\): packing sequences by length .* torch.compile"):
        x.to("meta").to_packed_sequence()  # meta values stand for a trace: no host metadata to plan from
